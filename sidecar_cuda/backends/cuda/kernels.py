"""The kernels of ``kalos_topk.cu`` and every constant they share with the host code.

The ``.cu`` defines none of these: :func:`compile_options` hands them to NVRTC as ``-D`` options
(the ``.cu`` stops with ``#error`` without them), so the host and the kernels cannot disagree.
:class:`Kernels` compiles the module once per backend (CuPy caches the binary on disk) and looks
up every function. Importing this module needs no CuPy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

KERNEL_FILE = Path(__file__).with_name("kalos_topk.cu")

MAX_K = 1024  # largest k served: the block-buffer kernels hold next_pow2(k + BLOCK) entries
WARP_K = 32  # largest k of the warp-list kernels and the fused path (one list entry per lane)
BLOCK = 256  # threads per block of every search kernel                           (KALOS_BLOCK)
HEADER_BYTES = 64  # request header before the queries: 16 int32 {n, B, k, l2, 0...} (KALOS_HEADER_INTS)
HALF_CAND = 32  # half-score path: candidates rescored per query, one per lane        (KALOS_HC)
ROW_ALIGN_BYTES = 16  # rows are padded to whole 16-byte vectors                      (KALOS_VEC)
SMALL_QT = (1, 2, 4, 8, 16)  # queries per block of the fused kernels kalos_small_q{QT}
HSCORE_UNROLLS = (2, 4, 8)  # 16-byte loads in flight per lane: kalos_hscores_top_u{UN}

#: name: (KALOS_STORAGE, numpy dtype holding the bits, cudaDataType)
STORAGE: dict[str, tuple[int, Any, int]] = {
    "float32": (0, np.float32, 0),  # CUDA_R_32F
    "float16": (1, np.uint16, 2),  # CUDA_R_16F
    "bfloat16": (2, np.uint16, 14),  # CUDA_R_16BF
}


def vec_elements(storage_dtype: str) -> int:
    """Storage elements per 16-byte vector: rows are padded to a multiple of this."""
    itemsize: int = np.dtype(STORAGE[storage_dtype][1]).itemsize
    return ROW_ALIGN_BYTES // itemsize


def compile_options(storage_dtype: str) -> tuple[str, ...]:
    """The NVRTC options of the module for ``storage_dtype``: every shared constant as ``-D``."""
    return ("-std=c++17",
            f"-DKALOS_STORAGE={STORAGE[storage_dtype][0]}",
            f"-DKALOS_VEC={vec_elements(storage_dtype)}",
            f"-DKALOS_BLOCK={BLOCK}",
            f"-DKALOS_HEADER_INTS={HEADER_BYTES // 4}",
            f"-DKALOS_HC={HALF_CAND}")


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


class Kernels:
    """The compiled module's functions, on the current CuPy device. ``smem_optin``: the device's
    opt-in shared memory per block, granted to the kernels whose dynamic shared memory grows."""

    def __init__(self, cp: Any, storage_dtype: str, smem_optin: int) -> None:
        module = cp.RawModule(code=kernel_source(), options=compile_options(storage_dtype))
        self.module = module
        self.small = {qt: module.get_function(f"kalos_small_q{qt}") for qt in SMALL_QT}
        self.scores_w = module.get_function("kalos_scores_topk_w")  # GEMM top-k, k <= WARP_K
        self.scores_b = module.get_function("kalos_scores_topk_b")  # GEMM top-k, larger k
        self.prep = module.get_function("kalos_prep_queries")
        self.prep_h = module.get_function("kalos_prep_queries_h")
        self.hscores = {un: module.get_function(f"kalos_hscores_top_u{un}") for un in HSCORE_UNROLLS}
        self.rescore = module.get_function("kalos_rescore_h")
        self.write = module.get_function("kalos_write_rows")
        self.move = module.get_function("kalos_move_rows")
        for kern in (*self.small.values(), self.scores_b):
            kern.max_dynamic_shared_size_bytes = smem_optin
