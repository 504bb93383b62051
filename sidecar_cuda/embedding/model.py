"""An embedding model directory, loaded once in the sidecar: :class:`TextEncoder`.

A directory as sentence-transformers and Hugging Face save one (nothing is downloaded):
``config.json`` (a BERT-family encoder: ``model_type`` bert; its sizes), ``model.safetensors``,
``tokenizer.json`` (read by the ``tokenizers`` package, the Rust tokenizer every Hugging Face
model ships), and optionally ``sentence_bert_config.json`` (``max_seq_length``),
``1_Pooling/config.json`` (mean or CLS pooling; mean without it) and ``modules.json`` (a
``Normalize`` module: unit vectors). Every problem is a :class:`ModelError` naming the file.

:meth:`TextEncoder.encode` embeds a list of texts in as few forward passes as a token budget
allows (one for a batch of the sizes agents send), texts sorted by length so that padding is
small, vectors returned in the order asked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .bert import Activation, Pooling, Shape, Weights, forward, weights_from
from .fused import FusedKernels
from .fused import forward as fused_forward
from .safetensors import read as read_weights

#: Tokens (texts x padded length) per forward pass: bounds the activations' memory.
TOKEN_BUDGET = 32768
_ACTIVATIONS = {"gelu": Activation.GELU, "gelu_new": Activation.GELU_TANH, "gelu_pytorch_tanh": Activation.GELU_TANH}


class ModelError(ValueError):
    """The embedding model directory cannot be served (the message names the file and why)."""


@dataclass
class EncodeStats:
    """What the encoder did since it was loaded (the sidecar's /metrics)."""

    calls: int = 0  # encode() calls: one per batch of text requests
    passes: int = 0  # forward passes
    texts: int = 0
    tokens: int = 0  # tokens embedded (padding excluded)
    seconds: float = 0.0


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ModelError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


class TextEncoder:
    """One embedding model, resident (``xp``: numpy, or cupy for the GPU; weights in ``dtype``).
    ``fused``: on CuPy with float16 weights, the pass with fused kernels (``fused.py``: ~80
    launches a pass instead of ~300); False: ``bert.forward`` there too (the tests compare both)."""

    def __init__(self, directory: Path, xp: Any = np, dtype: Any = np.float32, fused: bool = True) -> None:
        self.directory = directory = Path(directory)
        if not directory.is_dir():
            raise ModelError(f"{directory}: not a directory (a model saved by sentence-transformers or transformers)")
        config = _json(directory / "config.json")
        if not isinstance(config, dict) or config.get("model_type") != "bert":
            kind = config.get("model_type") if isinstance(config, dict) else None
            raise ModelError(
                f"{directory / 'config.json'}: model_type {kind!r}; Kalos serves BERT-family encoders "
                "(model_type 'bert': MiniLM, BGE, E5, GTE and most sentence-transformers models)"
            )
        act = _ACTIVATIONS.get(str(config.get("hidden_act", "gelu")))
        try:
            self.shape = Shape(
                hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=int(config["num_attention_heads"]),
                intermediate=int(config["intermediate_size"]),
                max_positions=int(config["max_position_embeddings"]),
                eps=float(config.get("layer_norm_eps", 1e-12)),
                activation=act or Activation.GELU,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{directory / 'config.json'}: missing or bad field {e}") from None
        if act is None or self.shape.hidden % self.shape.heads:
            raise ModelError(f"{directory / 'config.json'}: unsupported hidden_act or head count")
        self.dim = self.shape.hidden
        self.max_tokens = min(self.shape.max_positions, 512)
        st = directory / "sentence_bert_config.json"
        if st.exists():
            self.max_tokens = min(self.max_tokens, int(_json(st).get("max_seq_length", self.max_tokens)))
        self.pooling, self.normalize = self._head(directory)
        self._tokenizer = self._load_tokenizer(directory / "tokenizer.json")
        path = directory / "model.safetensors"
        if not path.exists():
            raise ModelError(f"{path}: missing (the weights, as safetensors; convert a pytorch_model.bin first)")
        try:
            tensors = read_weights(path)
        except (OSError, ValueError) as e:
            raise ModelError(str(e)) from None
        self.xp = xp
        try:
            self._weights: Weights = weights_from(tensors, self.shape, xp, dtype)
        except KeyError as e:
            raise ModelError(f"{path}: no tensor {e} (not a BERT encoder's weights?)") from None
        except ValueError as e:
            raise ModelError(f"{path}: {e}") from None
        vocab = int(self._weights.word.shape[0])
        if self._tokenizer.get_vocab_size() > vocab:  # (a token id past the table would read past it)
            raise ModelError(
                f"{directory / 'tokenizer.json'}: {self._tokenizer.get_vocab_size()} tokens, the weights embed {vocab}"
            )
        self.dtype = np.dtype(dtype).name
        self._fused: FusedKernels | None = None
        if fused and xp is not np and self.dtype == "float16":
            self._fused = FusedKernels()
        self.stats = EncodeStats()

    @staticmethod
    def _head(directory: Path) -> tuple[Pooling, bool]:
        pooling = Pooling.MEAN
        pc = directory / "1_Pooling" / "config.json"
        if pc.exists():
            c = _json(pc)
            if c.get("pooling_mode_cls_token"):
                pooling = Pooling.CLS
            elif not c.get("pooling_mode_mean_tokens", True):
                raise ModelError(f"{pc}: only mean and CLS pooling are served")
        normalize = False
        mj = directory / "modules.json"
        if mj.exists():
            modules = _json(mj)
            normalize = isinstance(modules, list) and any(
                isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize") for m in modules
            )
        return pooling, normalize

    def _load_tokenizer(self, path: Path) -> Any:
        try:
            from tokenizers import Tokenizer  # the `text` extra
        except ImportError:
            raise ModelError(
                "the embedding model needs the tokenizers package: install Kalos with its text extra ('.[text]' in the checkout)"
            ) from None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # (the Rust side raises its own Exception type)
            raise ModelError(f"{path}: {e}") from None
        tok.no_padding()
        tok.enable_truncation(self.max_tokens)
        return tok

    def describe(self) -> str:
        return (
            f"{self.directory.name} ({self.shape.layers} layers, dim {self.dim}, {self.pooling.value} pooling"
            f"{', normalized' if self.normalize else ''}, {self.max_tokens} tokens, {self.dtype}"
            f"{', fused kernels' if self._fused is not None else ''})"
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def encode(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32, in the order asked."""
        t0 = time.perf_counter()
        ids = self.tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = np.empty((len(texts), self.dim), np.float32)
        xp = self.xp
        start = 0
        while start < len(order):
            longest = max(len(ids[order[start]]), 1)
            end = start + 1
            # Grow the pass while its padded size (texts x longest so far) fits the budget.
            while end < len(order) and (end - start + 1) * max(len(ids[order[end]]), 1) <= TOKEN_BUDGET:
                longest = max(len(ids[order[end]]), 1)
                end += 1
            chunk = order[start:end]
            tok = np.zeros((len(chunk), longest), np.int64)
            mask = np.zeros((len(chunk), longest), np.int64)
            for row, i in enumerate(chunk):
                tok[row, : len(ids[i])] = ids[i]
                mask[row, : len(ids[i])] = 1
            if self._fused is not None:
                vecs = fused_forward(
                    self._fused,
                    self._weights,
                    self.shape,
                    xp.asarray(tok),
                    xp.asarray(mask),
                    self.pooling,
                    self.normalize,
                )
            else:
                vecs = forward(
                    self._weights, self.shape, xp.asarray(tok), xp.asarray(mask), self.pooling, self.normalize, xp
                )
            out[chunk] = vecs if xp is np else xp.asnumpy(vecs)
            self.stats.passes += 1
            self.stats.tokens += int(mask.sum())
            start = end
        self.stats.calls += 1
        self.stats.texts += len(texts)
        self.stats.seconds += time.perf_counter() - t0
        return out


__all__ = ["TOKEN_BUDGET", "EncodeStats", "ModelError", "TextEncoder"]
