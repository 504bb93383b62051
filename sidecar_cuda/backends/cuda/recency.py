"""Recency-weighted searches on the GPU: the kernel of ``kalos_recency.cu`` (built once per
:class:`Device`, on first use, so a device that never serves one never compiles it) and the one
call that enqueues it, on a chunk of the GEMM path's score matrix before its top-k kernel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..base import Decay
from .kernels import BLOCK

KERNEL_FILE = Path(__file__).with_name("kalos_recency.cu")
#: Blocks of the recency kernel at most (a grid-stride loop covers the rest).
MAX_BLOCKS = 4096


def recency_kernel(dev: Any) -> Any:
    """``kalos_recency_add`` on ``dev`` (compiled on the first call, then kept on the device)."""
    kern = getattr(dev, "recency_kernel", None)
    if kern is None:
        module = dev.cp.RawModule(code=KERNEL_FILE.read_text(), options=("-std=c++17",))
        kern = dev.recency_kernel = module.get_function("kalos_recency_add")
    return kern


def add_recency(dev: Any, scores_ptr: int, b: int, nc: int, row0: int, times: Any, decay: Decay, l2: bool) -> None:
    """Enqueue on ``dev.stream``: add each row's recency part to ``b`` x ``nc`` float32 scores at
    ``scores_ptr`` (query-major) of rows ``row0 .. row0 + nc`` (``times``: the rows' times, a
    device int64 array of ns). Under l2 the top-k kernel scores ``2 * dot - |x|^2 - |q|^2``: half
    the weight is added to the dot product, so the score gets all of it."""
    total = b * nc
    blocks = max(1, min(MAX_BLOCKS, -(-total // BLOCK)))
    weight = decay.weight * (0.5 if l2 else 1.0)
    recency_kernel(dev)(
        (blocks,),
        (BLOCK,),
        (
            scores_ptr,
            np.int32(nc),
            np.int32(b),
            times,
            np.int64(row0),
            np.int64(decay.now_ns),
            np.float64(decay.half_life_s),
            np.float64(weight),
        ),
        stream=dev.stream,
    )


__all__ = ["add_recency", "recency_kernel"]
