"""The CUDA backend (CuPy and the kernels of ``kalos_topk.cu`` and ``kalos_wgmma.cu``). Importing it
needs no CuPy: :func:`cuda_available` says whether the backend can run here, and why not."""

from .backend import CupyBackend, cuda_available, device_count
from .kernels import MAX_K, WARP_K, Storage
from .matrix import CupyMatrix
from .planner import HALF_K, Plan, SearchPath
from .search import CudaSearch

__all__ = [
    "CudaSearch",
    "CupyBackend",
    "CupyMatrix",
    "HALF_K",
    "MAX_K",
    "Plan",
    "SearchPath",
    "Storage",
    "WARP_K",
    "cuda_available",
    "device_count",
]
