"""The CUDA backend (CuPy and the kernels of ``kalos_topk.cu``). Importing it needs no CuPy:
:func:`cuda_available` says whether the backend can run here, and why not."""

from .backend import CudaSearch, CupyBackend, cuda_available, device_count
from .kernels import MAX_K, WARP_K
from .matrix import CupyMatrix
from .planner import HALF_K

__all__ = ["CudaSearch", "CupyBackend", "CupyMatrix", "HALF_K", "MAX_K", "WARP_K", "cuda_available",
           "device_count"]
