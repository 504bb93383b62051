"""The Kalos sidecar: owns the memory, batches every posted slot, serves it on CUDA or numpy."""

from sidecar_cuda.config import ServeConfig
from sidecar_cuda.server import Sidecar, run

__all__ = ["ServeConfig", "Sidecar", "run"]
