"""An independent float64 reference of a BERT sentence encoder (the unit and GPU tests of
``sidecar_cuda.embedding``), written from the architecture, not from bert.py: each text alone, at
its own length (no padding, no mask, no batching), math.erf, the weights read as float64."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kalos.sidecar_cuda.embedding.safetensors import read


def reference(directory: Path, texts: list[str]) -> np.ndarray:
    """A BERT sentence encoder in float64, written from the architecture, not from bert.py: each
    text alone, its own length, no mask."""
    from tokenizers import Tokenizer

    cfg = json.loads((directory / "config.json").read_text())
    pool = json.loads((directory / "1_Pooling" / "config.json").read_text())
    modules = json.loads((directory / "modules.json").read_text())
    max_len = json.loads((directory / "sentence_bert_config.json").read_text())["max_seq_length"]
    w = {k: v.astype(np.float64) for k, v in read(directory / "model.safetensors").items()}
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()  # (a saved tokenizer may pad to a fixed length: the reference takes each text as is)
    tok.enable_truncation(max_len)
    h, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    erf = np.vectorize(math.erf)

    def norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    out = []
    for text in texts:
        ids = tok.encode(text).ids
        n = len(ids)
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = norm(x, "embeddings.LayerNorm")
        dh = h // heads
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            q, k, v = (linear(x, f"{p}attention.self.{m}") for m in ("query", "key", "value"))
            ctx = np.zeros((n, h))
            for j in range(heads):
                s = slice(j * dh, (j + 1) * dh)
                a = q[:, s] @ k[:, s].T / math.sqrt(dh)
                a = np.exp(a - a.max(1, keepdims=True))
                ctx[:, s] = (a / a.sum(1, keepdims=True)) @ v[:, s]
            x = norm(linear(ctx, f"{p}attention.output.dense") + x, f"{p}attention.output.LayerNorm")
            u = linear(x, f"{p}intermediate.dense")
            u = 0.5 * u * (1 + erf(u / math.sqrt(2)))
            x = norm(linear(u, f"{p}output.dense") + x, f"{p}output.LayerNorm")
        e = x[0] if pool["pooling_mode_cls_token"] else x.mean(0)
        if any(m["type"].endswith("Normalize") for m in modules):
            e = e / np.linalg.norm(e)
        out.append(e)
    return np.array(out)
