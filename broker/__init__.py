"""Kalos broker core: the shared-memory contract, errors and validation shared by sidecar and clients."""
