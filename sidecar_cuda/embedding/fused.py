"""The encoder's forward pass on the GPU with its elementwise and row-wise steps fused
(``kalos_encoder.cu``): per layer, the five products on cuBLAS (CuPy's matmul, float16 in and out,
float32 accumulation) and six kernels of ours (split into heads, masked softmax, merge, two
bias + residual + layer norms, bias + GELU), ~80 launches for a 6-layer model where
``bert.forward`` on CuPy makes ~300: a pass is dominated by launches, not arithmetic.

The residual stream stays float32 (as ``bert.forward`` keeps it); products read its float16 copy,
which the layer-norm kernels write beside it. Same results as ``bert.forward`` up to float16
rounding (tests/gpu/test_gpu_embed.py compares both with the float64 reference).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .bert import Activation, Pooling, Shape, Weights

_SOURCE = Path(__file__).with_name("kalos_encoder.cu")
_ROW = 128  # ROW_THREADS in kalos_encoder.cu
_GRID = 1024  # blocks of the grid-stride kernels


class FusedKernels:
    """The compiled module (one per process and device; NVRTC through CuPy)."""

    def __init__(self) -> None:
        import cupy as cp

        module = cp.RawModule(code=_SOURCE.read_text(), options=("-std=c++17",))
        self.embed_ln = module.get_function("kalos_embed_ln")
        self.add_ln = module.get_function("kalos_add_ln")
        self.split_heads = module.get_function("kalos_split_heads")
        self.softmax = module.get_function("kalos_softmax")
        self.bias_gelu = module.get_function("kalos_bias_gelu")


def forward(k: FusedKernels, w: Weights, shape: Shape, ids: Any, mask: Any, pooling: Pooling, normalize: bool) -> Any:
    """``bert.forward`` for CuPy arrays (``ids``, ``mask``: int64 (B, T) on the device; weights in
    float16): float32 sentence vectors (B, hidden)."""
    import cupy as cp

    b, t = ids.shape
    h, heads = shape.hidden, shape.heads
    dh = h // heads
    rows = b * t
    f32, f16 = cp.float32, cp.float16
    ids = cp.ascontiguousarray(ids, dtype=cp.int64)
    mask = cp.ascontiguousarray(mask, dtype=cp.int64)
    x = cp.empty((rows, h), f32)
    x16 = cp.empty((rows, h), f16)
    eps = cp.float32(shape.eps)
    n = cp.int32(h)
    k.embed_ln((rows,), (_ROW,), (ids, cp.int32(t), w.word, w.position, w.token_type, w.ln_g, w.ln_b, x, x16, n, eps))
    q = cp.empty((b, heads, t, dh), f16)
    kt = cp.empty((b, heads, dh, t), f16)
    v = cp.empty((b, heads, t, dh), f16)
    total = rows * 3 * h
    grid = (min(_GRID, (total + 255) // 256),)
    tanh_form = cp.int32(1 if shape.activation is Activation.GELU_TANH else 0)
    for L in w.layers:
        qkv = x16 @ L.qkv_w  # (rows, 3h) float16
        k.split_heads(
            grid,
            (256,),
            (qkv, L.qkv_b, q, kt, v, cp.int32(t), cp.int32(heads), cp.int32(dh), cp.float32(1 / math.sqrt(dh)),
             cp.int64(total)),
        )  # fmt: skip
        scores = cp.matmul(q, kt)  # (B, heads, T, T) float16
        k.softmax((b * heads * t,), (_ROW,), (scores, mask, cp.int32(t), cp.int32(heads)))
        ctx = cp.matmul(scores, v)  # (B, heads, T, dh)
        merged = cp.ascontiguousarray(ctx.transpose(0, 2, 1, 3)).reshape(rows, h)
        a = merged @ L.out_w
        k.add_ln((rows,), (_ROW,), (a, L.out_b, x, x16, L.ln1_g, L.ln1_b, n, eps))
        up = x16 @ L.up_w  # (rows, intermediate) float16
        k.bias_gelu(
            (min(_GRID, (up.size + 255) // 256),), (256,), (up, L.up_b, cp.int32(shape.intermediate), cp.int64(up.size), tanh_form)
        )  # fmt: skip
        down = up @ L.down_w
        k.add_ln((rows,), (_ROW,), (down, L.down_b, x, x16, L.ln2_g, L.ln2_b, n, eps))
    out = x.reshape(b, t, h)
    if pooling is Pooling.CLS:
        vec = out[:, 0, :]
    else:
        m = mask.astype(f32)[:, :, None]
        vec = (out * m).sum(axis=1) / cp.maximum(m.sum(axis=1), 1.0)
    if normalize:
        vec = vec / cp.maximum(cp.sqrt((vec * vec).sum(axis=1, keepdims=True)), 1e-12)
    return cp.ascontiguousarray(vec, dtype=f32)


__all__ = ["FusedKernels", "forward"]
