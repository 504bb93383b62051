"""Helpers for tests, benchmarks and the demo: a sidecar in a child process, a load generator."""

from kalos.testing.loadgen import LoadResult, LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

__all__ = [
    "LoadResult",
    "LoadSpec",
    "check_samples",
    "environment",
    "run_load",
    "start_sidecar_process",
    "stop_sidecar_process",
]
