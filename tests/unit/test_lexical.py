"""Hybrid recall's pure parts: the BM25 index against rank_bm25 (an independent library) on fresh
random corpora, the tokenizer, the Hybrid value, the request blob, and what the sidecar's parser
refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kalos.broker.errors import ConfigError, InvalidRequest
from kalos.broker.layout import FEATURE_HYBRID, Flag, Layout, Op, Status
from kalos.broker.lexical import Hybrid, decode_hybrid_blob, encode_hybrid_blob, tokenize
from kalos.broker.texts import TextError
from kalos.clients._requests import hybrid_recall
from kalos.sidecar_cuda.serving.batching import Rejection, SlotFields, parse_request
from kalos.sidecar_cuda.storage.lexical import LexicalIndex, text_of

rank_bm25 = pytest.importorskip("rank_bm25")
LAY = Layout(n_slots=4, dim=4, max_k=8, max_queries=4, blob_bytes=256)
VOCAB = "alpha beta gamma delta tea paris tokyo café naïve 東京 dog cat the a of".split()


def corpus(rng: np.random.Generator, n: int) -> list[str | None]:
    out: list[str | None] = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append(None)  # a record without a text
        else:
            words = rng.choice(VOCAB, int(rng.integers(1, 12)))
            out.append(" ".join(w.upper() if rng.random() < 0.2 else w for w in words) + rng.choice(["", "!", ", ok."]))
    return out


@pytest.mark.parametrize("n", [1, 7, 200])
def test_bm25_scores_equal_rank_bm25s(rng, n):
    texts = corpus(rng, n)
    idx = LexicalIndex(texts)
    docs = [(i, tokenize(t)) for i, t in enumerate(texts) if t is not None]
    if not docs:
        assert len(idx.scores("alpha")[0]) == 0
        return
    ref = rank_bm25.BM25Okapi([toks for _i, toks in docs])  # defaults: k1 1.5, b 0.75, epsilon 0.25
    for _ in range(10):
        query = " ".join(rng.choice(VOCAB + ["unseen"], int(rng.integers(1, 5))))
        want = np.zeros(n)
        want[[i for i, _t in docs]] = ref.get_scores(tokenize(query))
        rows, got = idx.scores(query)  # the rows sharing a term; every other row scores 0
        dense = np.zeros(n)
        dense[rows] = got
        np.testing.assert_allclose(dense, want, rtol=1e-12, atol=1e-12)
        assert (np.diff(rows) > 0).all() and set(np.flatnonzero(want).tolist()) <= set(rows.tolist())


def test_tokenizer_and_texts_of_payloads():
    assert tokenize("Hello, WORLD! café-au-lait 東京 x_1") == ["hello", "world", "café", "au", "lait", "東京", "x_1"]
    assert tokenize("  ...  ") == []
    assert text_of(b'{"text": "hi", "u": 1}') == "hi"
    assert text_of(b'{"text": 5}') is None and text_of(b"null") is None and text_of(b"[1]") is None
    assert text_of(b'{"a": "text"}') is None and text_of(None) is None and text_of(b'{"text" broken') is None


def test_hybrid_values_and_blobs():
    assert Hybrid().weight == 0.5 and Hybrid(0).weight == 0
    for bad in (-0.1, math.nan, math.inf, "1", True):
        with pytest.raises(InvalidRequest, match="finite number >= 0"):
            Hybrid(bad)  # type: ignore[arg-type]
    blob = encode_hybrid_blob("東京 tea", b'{"a":1}')
    assert blob == "東京 tea".encode() + b'\x00{"a":1}'
    assert decode_hybrid_blob(blob) == ("東京 tea", b'{"a":1}')
    for bad, match in ((b"no nul", "NUL-terminated"), (b"\xff\x00", "not valid UTF-8"), (b" \x00", "empty")):
        with pytest.raises(TextError, match=match):
            decode_hybrid_blob(bad)
    with pytest.raises(InvalidRequest, match="holds a NUL"):
        encode_hybrid_blob("a\x00b", b"")


def test_the_client_builds_a_hybrid_recall_and_checks_the_sidecar_serves_it():
    p = hybrid_recall(LAY, np.ones(4, np.float32), "tea", Hybrid(0.25), 3, b"ns", FEATURE_HYBRID, {"a": 1})
    assert p.op is Op.RECALL and p.flags & Flag.HYBRID and p.flags & Flag.WHERE and p.flags & Flag.WITH_PAYLOAD
    assert p.hybrid == 0.25 and p.blob.startswith(b"tea\x00") and p.nq == 1
    with pytest.raises(ConfigError, match="does not serve hybrid"):
        hybrid_recall(LAY, np.ones(4, np.float32), "tea", Hybrid(), 3, b"ns", 0)
    with pytest.raises(InvalidRequest, match="must be a kalos.Hybrid"):
        hybrid_recall(LAY, np.ones(4, np.float32), "tea", 0.5, 3, b"ns", FEATURE_HYBRID)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="blob area holds 256"):
        hybrid_recall(LAY, np.ones(4, np.float32), "x" * 300, Hybrid(), 3, b"ns", FEATURE_HYBRID)


def fields(**kw: object) -> SlotFields:
    base: dict[str, object] = dict(
        op=int(Op.RECALL), k=2, nq=1, flags=int(Flag.HYBRID | Flag.WITH_PAYLOAD), blob_len=4, ns_len=2,
        namespace=b"ns" + b"\x00" * 62, generation=1, t_post_ns=0, hybrid_weight=0.5,
    )  # fmt: skip
    base.update(kw)
    return SlotFields(**base)  # type: ignore[arg-type]


def test_the_sidecar_refuses_a_hybrid_recall_it_cannot_serve():
    ok = parse_request(0, fields(), LAY, 8)
    assert not isinstance(ok, Rejection) and ok.hybrid == 0.5
    for kw, match in (
        (dict(hybrid_weight=math.nan), "finite number >= 0"),
        (dict(hybrid_weight=-1.0), "finite number >= 0"),
        (dict(nq=2), "one query"),
        (dict(flags=int(Flag.HYBRID | Flag.RECENCY), half_life_s=10.0, recency_weight=1.0), "does not take recency"),
        (dict(blob_len=0), "holds its query text"),
    ):
        got = parse_request(0, fields(**kw), LAY, 8)
        assert isinstance(got, Rejection) and got.status == Status.BAD_REQUEST and match in got.detail, kw
