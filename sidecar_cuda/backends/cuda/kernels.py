"""The kernels of ``kalos_topk.cu`` and every constant they share with the host code.

The ``.cu`` defines none of these: :func:`compile_options` hands them to NVRTC as ``-D`` options
(the ``.cu`` stops with ``#error`` without them), so the host and the kernels cannot disagree.
:class:`Kernels` compiles the module once per backend (CuPy caches the binary on disk) and looks
up every function. Importing this module needs no CuPy.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import numpy as np

from ....broker.errors import ConfigError

KERNEL_FILE = Path(__file__).with_name("kalos_topk.cu")

MAX_K = 1024  # largest k served: the block-buffer kernels hold next_pow2(k + BLOCK) entries
WARP_K = 32  # largest k of the warp-list kernels and the fused path (one list entry per lane)
BLOCK = 256  # threads per block of every search kernel                           (KALOS_BLOCK)
HEADER_BYTES = 64  # request header before the queries: 16 int32 {n, B, k, l2, 0...} (KALOS_HEADER_INTS)
HALF_CAND = 32  # half-score path: candidates rescored per query, one per lane        (KALOS_HC)
ROW_ALIGN_BYTES = 16  # rows are padded to whole 16-byte vectors                      (KALOS_VEC)
SMALL_QT = (1, 2, 4, 8, 16)  # queries per block of the fused kernels kalos_small_q{QT}
HSCORE_UNROLL = 2  # 16-byte score loads in flight per lane of kalos_hscores_top_u{UN}: more
# measured slower on the H200 (docs/gpu.md, probe-gemm-h200-sweep.json)


class Storage(enum.Enum):
    """How the rows are stored on the device (``--dtype``); the value is the option's spelling."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @classmethod
    def parse(cls, value: Storage | str) -> Storage:
        """The storage of an option value; ConfigError names the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"storage dtype must be float32, float16 or bfloat16, got {value!r}") from None

    @property
    def code(self) -> int:
        """KALOS_STORAGE of the kernels."""
        return _STORAGE_CODE[self]

    @property
    def bits(self) -> type[np.generic]:
        """The numpy dtype holding a stored element's bits (16-bit formats as uint16)."""
        return np.float32 if self is Storage.FLOAT32 else np.uint16

    @property
    def itemsize(self) -> int:
        return 4 if self is Storage.FLOAT32 else 2

    @property
    def cuda_type(self) -> int:
        """cudaDataType of the stored rows (cuBLAS)."""
        return _CUDA_TYPE[self]

    @property
    def vec(self) -> int:
        """Storage elements per 16-byte vector: rows are padded to a multiple of this."""
        return ROW_ALIGN_BYTES // self.itemsize


_STORAGE_CODE = {Storage.FLOAT32: 0, Storage.FLOAT16: 1, Storage.BFLOAT16: 2}
_CUDA_TYPE = {Storage.FLOAT32: 0, Storage.FLOAT16: 2, Storage.BFLOAT16: 14}  # CUDA_R_32F, _16F, _16BF


def compile_options(storage: Storage) -> tuple[str, ...]:
    """The NVRTC options of the module for ``storage``: every shared constant as ``-D``."""
    return (
        "-std=c++17",
        f"-DKALOS_STORAGE={storage.code}",
        f"-DKALOS_VEC={storage.vec}",
        f"-DKALOS_BLOCK={BLOCK}",
        f"-DKALOS_HEADER_INTS={HEADER_BYTES // 4}",
        f"-DKALOS_HC={HALF_CAND}",
    )


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


class Kernels:
    """The compiled module's functions, on the current CuPy device. ``smem_optin``: the device's
    opt-in shared memory per block, granted to the kernels whose dynamic shared memory grows."""

    def __init__(self, cp: Any, storage: Storage, smem_optin: int) -> None:
        module = cp.RawModule(code=kernel_source(), options=compile_options(storage))
        self.module = module
        self.small = {qt: module.get_function(f"kalos_small_q{qt}") for qt in SMALL_QT}
        self.mixed = module.get_function("kalos_mixed")  # a batch over many namespaces' rows
        self.scores_w = module.get_function("kalos_scores_topk_w")  # GEMM top-k, k <= WARP_K
        self.scores_b = module.get_function("kalos_scores_topk_b")  # GEMM top-k, larger k
        self.prep = module.get_function("kalos_prep_queries")
        self.prep_h = module.get_function("kalos_prep_queries_h")
        self.hscores = module.get_function(f"kalos_hscores_top_u{HSCORE_UNROLL}")
        self.rescore = module.get_function("kalos_rescore_h")
        self.write = module.get_function("kalos_write_rows")
        self.move = module.get_function("kalos_move_rows")
        self.i8_rows = module.get_function("kalos_i8_rows")  # int8 first pass (int8.py, paths.py)
        self.i8_queries = module.get_function("kalos_i8_queries")
        self.i8_champions = module.get_function("kalos_i8_champions")
        self.i8_threshold = module.get_function("kalos_i8_threshold")
        self.i8_collect = module.get_function("kalos_i8_collect")
        self.i8_final = module.get_function("kalos_i8_final")
        for kern in (*self.small.values(), self.mixed, self.scores_b, self.i8_final):
            kern.max_dynamic_shared_size_bytes = smem_optin
