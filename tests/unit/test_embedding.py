"""The sidecar's embedding model on its own: the encoder's vectors against an independent float64
reference written here (one text at a time, no padding, no batching, math.erf), the model
directory's errors, the safetensors reader, and the texts' wire rules on both sides."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from text_reference import reference

from kalos.broker.errors import ConfigError, InvalidRequest
from kalos.broker.layout import Layout, Op
from kalos.broker.texts import MAX_TEXT_BYTES, TextError, decode_texts, encode_texts, text_problem
from kalos.clients._requests import TEXT_FIELD, embed, text_payloads
from kalos.sidecar_cuda.embedding import ModelError, TextEncoder
from kalos.sidecar_cuda.embedding import model as model_module
from kalos.sidecar_cuda.embedding.safetensors import WeightsError, read, write
from kalos.testing.tinymodel import build_tiny_model

pytest.importorskip("tokenizers")

TEXTS = [
    "Hello world",
    "The agent remembers that the user lives in Paris and likes tea in the morning.",
    "x",
    "Café, naïve: déjà vu! 東京 gpu-model search; the user's friend works on rust code " * 3,  # truncated
    "meeting\nfriday\tevening",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=7)


def test_the_encoder_matches_an_independent_float64_reference(tiny):
    enc = TextEncoder(tiny)
    got = enc.encode(TEXTS)
    want = reference(tiny, TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 32)
    assert np.abs(got - want).max() < 2e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)  # the Normalize module
    assert len(enc.tokenize([TEXTS[3]])[0]) == 48  # truncated at max_seq_length
    assert enc.stats.passes == 1 and enc.stats.texts == len(TEXTS) and enc.stats.calls == 1


@pytest.mark.parametrize("pooling,normalize", [("cls", False), ("mean", False)])
def test_pooling_and_normalizing_as_the_model_directory_says(tmp_path, pooling, normalize):
    d = build_tiny_model(tmp_path, pooling=pooling, normalize=normalize, layers=1, seed=3)
    enc = TextEncoder(d)
    got = enc.encode(TEXTS[:3])
    assert np.abs(got - reference(d, TEXTS[:3])).max() < 2e-5
    assert enc.pooling.value == pooling and enc.normalize is normalize
    assert not np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-3)


def test_a_texts_vector_does_not_depend_on_its_batch_or_the_token_budget(tiny, monkeypatch, rng):
    enc = TextEncoder(tiny)
    words = "the agent user memory paris coffee dog blue code search hello world".split()
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(60)]
    together = enc.encode(texts)
    alone = np.array([enc.encode([t])[0] for t in texts])
    assert np.abs(together - alone).max() < 1e-5  # padding is masked
    monkeypatch.setattr(model_module, "TOKEN_BUDGET", 100)
    before = enc.stats.passes
    chunked = enc.encode(texts)
    assert enc.stats.passes - before > 10  # many passes under a small budget ...
    assert np.abs(chunked - together).max() < 1e-5  # ... and the same vectors, in the order asked


def test_model_directory_problems_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="not a directory"):
        TextEncoder(tmp_path / "none")
    d = build_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ModelError, match="model_type 'llama'"):
        TextEncoder(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        TextEncoder(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelError, match="no tensor 'encoder.layer.2"):
        TextEncoder(d)
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ModelError, match="shape"):
        TextEncoder(d)
    (d / "config.json").write_text(json.dumps(cfg))
    weights = read(d / "model.safetensors")
    write(
        d / "model.safetensors",
        {**weights, "embeddings.word_embeddings.weight": weights["embeddings.word_embeddings.weight"][:50]},
    )
    with pytest.raises(ModelError, match="tokens, the weights embed 50"):  # ids past the table: refused at load
        TextEncoder(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="model.safetensors: missing"):
        TextEncoder(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match="tokenizer.json"):
        TextEncoder(d)


def test_the_sidecar_refuses_a_model_of_another_dimension(tmp_path):
    from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
    from kalos.sidecar_cuda.server import load_encoder

    d = build_tiny_model(tmp_path, dim=16, heads=2)
    with pytest.raises(ConfigError, match="16 dimensions, --dim is 32"):
        load_encoder(str(d), 32, NumpyBackend())
    with pytest.raises(ConfigError, match="--embed: .*not a directory"):
        load_encoder(str(tmp_path / "none"), 16, NumpyBackend())
    assert load_encoder(None, 16, NumpyBackend()) is None
    assert load_encoder(str(d), 16, NumpyBackend()).dim == 16


def test_safetensors_round_trip_bf16_and_corrupt_files(tmp_path, rng):
    t = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float16)}
    write(tmp_path / "w.safetensors", t)
    back = read(tmp_path / "w.safetensors")
    assert np.array_equal(back["a"], t["a"]) and np.array_equal(back["b"], t["b"].astype(np.float32))
    # BF16, written by hand: the top half of each float32.
    x = np.array([1.5, -2.25, 3e38], np.float32)
    raw = (x.view(np.uint32) >> 16).astype("<u2").tobytes()
    head = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    (tmp_path / "bf.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + raw)
    assert np.array_equal(read(tmp_path / "bf.safetensors")["x"], (x.view(np.uint32) & 0xFFFF0000).view(np.float32))
    for bad, match in (
        (b"\x01", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
        (struct.pack("<Q", 4) + b"nope", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(WeightsError, match=match):
            read(tmp_path / "bad")
    head = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "bad").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    with pytest.raises(WeightsError, match="do not match shape"):
        read(tmp_path / "bad")
    head = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "bad").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    with pytest.raises(WeightsError, match="unsupported dtype"):
        read(tmp_path / "bad")
    # An integer buffer (BERT's position_ids) is checked and left out; the floats beside it load.
    head = json.dumps(
        {
            "ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
            "f": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]},
        }
    ).encode()
    (tmp_path / "ok").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16 + np.float32(2.5).tobytes())
    assert {k: v.tolist() for k, v in read(tmp_path / "ok").items()} == {"f": [2.5]}
    head = json.dumps({"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "bad").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 12)
    with pytest.raises(WeightsError, match="do not match shape"):
        read(tmp_path / "bad")


def test_texts_on_the_wire():
    texts = ["one", "two\nlines", "東京 café", "x" * MAX_TEXT_BYTES]
    blob = encode_texts(texts)
    assert blob.count(b"\x00") == 4 and blob.endswith(b"\x00")
    assert decode_texts(blob, 4) == texts
    for blob, n, match in (
        (b"abc", 1, "must end with a NUL"),
        (b"a\x00b\x00", 3, "holds 2 texts, nq is 3"),
        (b"ok\x00\xff\xfe\x00", 2, "text 1 is not valid UTF-8"),
        (b"ok\x00\x00", 2, "text 1 is empty"),
        (b" \t\n\x00", 1, "text 0 is empty"),
        (b"x" * (MAX_TEXT_BYTES + 1) + b"\x00", 1, f"the most is {MAX_TEXT_BYTES}"),
        (b"\xed\xa0\x80\x00", 1, "not valid UTF-8"),  # an encoded surrogate
    ):
        with pytest.raises(TextError, match=match):
            decode_texts(blob, n)
    assert text_problem("ok") is None
    assert "NUL" in text_problem("a\x00b")
    assert "surrogate" in text_problem("\ud800")
    assert "empty" in text_problem("   ")
    assert "str" in text_problem(b"bytes")  # type: ignore[arg-type]
    assert "16385 bytes" in text_problem("é" * 8192 + "x")


def test_the_client_chunks_texts_by_rows_and_blob_bytes_and_checks_them_first():
    lay = Layout(n_slots=2, dim=8, max_k=4, max_queries=3, blob_bytes=64)
    preps = embed(lay, ["a"] * 7, 8, "b")
    assert [p.nq for p in preps] == [3, 3, 1] and all(p.op is Op.EMBED for p in preps)
    assert b"".join(p.blob for p in preps) == b"a\x00" * 7
    preps = embed(lay, ["x" * 30, "y" * 30, "zz"], 8, "b")  # 31 + 31 fit, 31 + 31 + 3 does not
    assert [p.nq for p in preps] == [2, 1]
    with pytest.raises(ConfigError, match="serves no embedding model"):
        embed(lay, ["a"], 0, "b")
    with pytest.raises(InvalidRequest, match="text 1 holds a NUL"):
        embed(lay, ["a", "b\x00"], 8, "b")
    with pytest.raises(InvalidRequest, match="a slot's blob area holds 64"):
        embed(lay, ["x" * 64], 8, "b")
    for bad in ("one text", [], None, b"x"):
        with pytest.raises(InvalidRequest, match="non-empty sequence of str"):
            embed(lay, bad, 8, "b")


def test_upsert_text_payloads_keep_each_records_own_fields():
    assert text_payloads(["a", "b"], None) == [{TEXT_FIELD: "a"}, {TEXT_FIELD: "b"}]
    assert text_payloads(["a", "b"], [{"u": 1}, None]) == [{"u": 1, TEXT_FIELD: "a"}, {TEXT_FIELD: "b"}]
    assert text_payloads(["a"], [{TEXT_FIELD: "a", "u": 2}]) == [{TEXT_FIELD: "a", "u": 2}]
    with pytest.raises(InvalidRequest, match="other than its text"):
        text_payloads(["a"], [{TEXT_FIELD: "b"}])
    with pytest.raises(InvalidRequest, match="takes dict payloads"):
        text_payloads(["a"], ["not a dict"])
    with pytest.raises(InvalidRequest, match="1 payloads for 2 texts"):
        text_payloads(["a", "b"], [None])
    with pytest.raises(InvalidRequest, match="sequence of str"):
        text_payloads("ab", None)
