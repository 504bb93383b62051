"""Adapters that let other frameworks keep their vectors in a Kalos sidecar."""
