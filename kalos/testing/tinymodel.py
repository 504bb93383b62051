"""A small embedding model built on the spot (no network): a BERT encoder with random weights and a
WordPiece tokenizer over a few hundred pieces, saved as sentence-transformers saves a model
(config.json, model.safetensors, tokenizer.json, 1_Pooling/config.json, modules.json). The tests
serve it with ``kalos serve --embed DIR``; its vectors mean nothing, but every step a real model
takes (tokenizing, truncation, the layers, pooling, normalizing) is taken."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

from kalos.sidecar_cuda.embedding.safetensors import write as write_weights

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a an and or of to in on for with is are was be it this that agent user memory recall "
    "remember said likes lives works paris london tokyo coffee tea music book meeting project deadline "
    "monday friday morning evening dog cat blue red green code python rust gpu model vector search "
    "hello world name city job friend family plan trip food travel"
).split()


def build_tiny_model(
    directory: Path,
    *,
    dim: int = 32,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 64,
    max_positions: int = 64,
    max_seq_length: int = 48,
    pooling: str = "mean",
    normalize: bool = True,
    seed: int = 0,
) -> Path:
    """Write the model into ``directory`` (created) and return it."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pieces = SPECIAL + list(string.ascii_lowercase) + list(string.digits) + list(string.punctuation)
    pieces += ["##" + c for c in string.ascii_lowercase + string.digits] + WORDS
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.decoder = decoders.WordPiece()
    tok.save(str(directory / "tokenizer.json"))

    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t: dict[str, np.ndarray] = {}

    # (in the order the weights are drawn: a seed makes the same model)
    def dense(name: str, n_out: int, n_in: int) -> None:
        t[f"{name}.weight"] = w(n_out, n_in)
        t[f"{name}.bias"] = w(n_out, scale=0.05)

    def layer_norm(name: str) -> None:
        t[f"{name}.weight"] = 1 + w(dim, scale=0.1)
        t[f"{name}.bias"] = w(dim, scale=0.1)

    t["embeddings.word_embeddings.weight"] = w(len(vocab), dim, scale=1.0)
    t["embeddings.position_embeddings.weight"] = w(max_positions, dim, scale=0.5)
    t["embeddings.token_type_embeddings.weight"] = w(2, dim, scale=0.5)
    layer_norm("embeddings.LayerNorm")
    for n in range(layers):
        p = f"encoder.layer.{n}."
        for x in ("query", "key", "value"):
            dense(f"{p}attention.self.{x}", dim, dim)
        dense(f"{p}attention.output.dense", dim, dim)
        layer_norm(f"{p}attention.output.LayerNorm")
        dense(f"{p}intermediate.dense", intermediate, dim)
        dense(f"{p}output.dense", dim, intermediate)
        layer_norm(f"{p}output.LayerNorm")
    t["pooler.dense.weight"] = w(dim, dim)  # (as BertModel saves it; sentence models do not use it)
    write_weights(directory / "model.safetensors", t)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "type_vocab_size": 2,
        "vocab_size": len(vocab),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": dim,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
            }
        )
    )
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules, indent=1))
    return directory


__all__ = ["build_tiny_model"]
