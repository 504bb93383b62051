"""The forward pass of a BERT-family text encoder (BERT, MiniLM, BGE, E5, GTE-small: the
sentence-embedding models of that architecture), written once for numpy and CuPy (``xp``).

Matrix products run in the weights' dtype (float32 on the CPU, float16 on the GPU, where cuBLAS
accumulates in float32); layer norms, softmax and pooling in float32. Attention masks padding,
so a text's vector does not depend on the texts it is batched with (up to rounding).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np


class Activation(enum.Enum):
    GELU = "gelu"  # erf-based (BERT's "gelu")
    GELU_TANH = "gelu_tanh"  # the tanh approximation ("gelu_new", "gelu_pytorch_tanh")


class Pooling(enum.Enum):
    MEAN = "mean"  # mean of the token vectors the mask keeps (sentence-transformers' default)
    CLS = "cls"  # the first token's vector (BGE)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    eps: float
    activation: Activation


@dataclass
class Layer:
    qkv_w: Any  # (hidden, 3 * hidden): query, key and value projections side by side
    qkv_b: Any
    out_w: Any
    out_b: Any
    ln1_g: Any
    ln1_b: Any
    up_w: Any
    up_b: Any
    down_w: Any
    down_b: Any
    ln2_g: Any
    ln2_b: Any


@dataclass
class Weights:
    word: Any  # (vocab, hidden)
    position: Any  # (max_positions, hidden)
    token_type: Any  # (hidden,): type 0, the only one a single text uses
    ln_g: Any
    ln_b: Any
    layers: list[Layer]


def weights_from(tensors: dict[str, np.ndarray], shape: Shape, xp: Any, dtype: Any) -> Weights:
    """Hugging Face's BertModel names (``bert.`` prefix or none), laid out for the pass: matrices
    transposed to (in, out) in ``dtype``, norms and biases float32. Raises KeyError naming a
    missing tensor, ValueError for one of the wrong shape."""
    prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""

    def t(name: str, want: tuple[int, ...]) -> np.ndarray:
        key = prefix + name
        if key not in tensors and name.endswith((".weight", ".bias")):  # older checkpoints: gamma/beta
            old = key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
            key = old if old in tensors else key
        a = tensors[key]
        if a.shape != want:
            raise ValueError(f"tensor {key!r} has shape {a.shape}, the config says {want}")
        return a

    h, i = shape.hidden, shape.intermediate

    def mat(name: str, rows: int, cols: int) -> Any:  # a Linear's (out, in) weight, as (in, out)
        return xp.asarray(np.ascontiguousarray(t(name, (rows, cols)).T), dtype=dtype)

    def vec(name: str, n: int) -> Any:
        return xp.asarray(t(name, (n,)), dtype=xp.float32)

    vocab = tensors[prefix + "embeddings.word_embeddings.weight"].shape[0]
    layers = []
    for n in range(shape.layers):
        p = f"encoder.layer.{n}."
        a = p + "attention."
        qkv = np.concatenate([t(f"{a}self.{x}.weight", (h, h)).T for x in ("query", "key", "value")], axis=1)
        layers.append(
            Layer(
                qkv_w=xp.asarray(np.ascontiguousarray(qkv), dtype=dtype),
                qkv_b=xp.asarray(np.concatenate([t(f"{a}self.{x}.bias", (h,)) for x in ("query", "key", "value")])),
                out_w=mat(a + "output.dense.weight", h, h),
                out_b=vec(a + "output.dense.bias", h),
                ln1_g=vec(a + "output.LayerNorm.weight", h),
                ln1_b=vec(a + "output.LayerNorm.bias", h),
                up_w=mat(p + "intermediate.dense.weight", i, h),
                up_b=vec(p + "intermediate.dense.bias", i),
                down_w=mat(p + "output.dense.weight", h, i),
                down_b=vec(p + "output.dense.bias", h),
                ln2_g=vec(p + "output.LayerNorm.weight", h),
                ln2_b=vec(p + "output.LayerNorm.bias", h),
            )
        )
    return Weights(
        word=xp.asarray(t("embeddings.word_embeddings.weight", (vocab, h)), dtype=xp.float32),
        position=xp.asarray(t("embeddings.position_embeddings.weight", (shape.max_positions, h)), dtype=xp.float32),
        token_type=xp.asarray(tensors[prefix + "embeddings.token_type_embeddings.weight"][0], dtype=xp.float32),
        ln_g=vec("embeddings.LayerNorm.weight", h),
        ln_b=vec("embeddings.LayerNorm.bias", h),
        layers=layers,
    )


def _layer_norm(x: Any, g: Any, b: Any, eps: float, xp: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(var + eps) * g + b


def _erf(x: Any, xp: Any) -> Any:
    """erf in float32 (numpy has none): Abramowitz and Stegun 7.1.26, |error| < 1.5e-7."""
    if xp is not np:
        import cupyx.scipy.special  # (CuPy's own)

        return cupyx.scipy.special.erf(x)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (
        ((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592
    ) * t * np.exp(-a * a)
    return (s * y).astype(x.dtype, copy=False)


def _gelu(x: Any, act: Activation, xp: Any) -> Any:
    if act is Activation.GELU:
        return 0.5 * x * (1.0 + _erf(x * (1.0 / math.sqrt(2.0)), xp))
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def forward(w: Weights, shape: Shape, ids: Any, mask: Any, pooling: Pooling, normalize: bool, xp: Any) -> Any:
    """Sentence vectors (float32, (B, hidden)) of the token ids ``ids`` (B, T) with ``mask``
    (B, T: 1 for a token, 0 for padding; every row has at least one token)."""
    b, n = ids.shape
    h, heads = shape.hidden, shape.heads
    dh = h // heads
    dtype = w.layers[0].qkv_w.dtype if w.layers else xp.float32
    x = w.word[ids] + w.position[:n][None, :, :] + w.token_type
    x = _layer_norm(x, w.ln_g, w.ln_b, shape.eps, xp)
    bias = ((mask.astype(xp.float32, copy=False) - 1.0) * 1e9)[:, None, None, :]  # -1e9 where padded
    scale = 1.0 / math.sqrt(dh)
    for L in w.layers:
        flat = x.reshape(b * n, h).astype(dtype, copy=False)
        qkv = (flat @ L.qkv_w).astype(xp.float32, copy=False) + L.qkv_b
        qkv = qkv.reshape(b, n, 3, heads, dh).transpose(2, 0, 3, 1, 4)  # (3, B, heads, T, dh)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q.astype(dtype, copy=False) @ k.astype(dtype, copy=False).transpose(0, 1, 3, 2)).astype(
            xp.float32, copy=False
        ) * scale + bias
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        ctx = (p.astype(dtype, copy=False) @ v.astype(dtype, copy=False)).astype(
            xp.float32, copy=False
        )  # (B, heads, T, dh)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b * n, h)
        a = (ctx.astype(dtype, copy=False) @ L.out_w).astype(xp.float32, copy=False) + L.out_b
        x = _layer_norm(a.reshape(b, n, h) + x, L.ln1_g, L.ln1_b, shape.eps, xp)
        up = (x.reshape(b * n, h).astype(dtype, copy=False) @ L.up_w).astype(xp.float32, copy=False) + L.up_b
        down = (_gelu(up, shape.activation, xp).astype(dtype, copy=False) @ L.down_w).astype(
            xp.float32, copy=False
        ) + L.down_b
        x = _layer_norm(down.reshape(b, n, h) + x, L.ln2_g, L.ln2_b, shape.eps, xp)
    if pooling is Pooling.CLS:
        out = x[:, 0, :]
    else:
        m = mask.astype(xp.float32, copy=False)[:, :, None]
        out = (x * m).sum(axis=1) / xp.maximum(m.sum(axis=1), 1.0)
    if normalize:
        out = out / xp.maximum(xp.sqrt((out * out).sum(axis=1, keepdims=True)), 1e-12)
    return out.astype(xp.float32, copy=False)


__all__ = ["Activation", "Layer", "Pooling", "Shape", "Weights", "forward", "weights_from"]
