"""The Kalos sidecar: owns the memory, batches every posted slot, serves it on CUDA or numpy."""

from .config import ServeConfig
from .server import Sidecar, run

__all__ = ["ServeConfig", "Sidecar", "run"]
