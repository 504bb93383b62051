"""Text memory through real sidecars (``--embed DIR`` with a model built on the spot): the vectors
equal the model's own in-process output; upsert_text / recall_text exact against numpy float64 and
keeping each record's text; bad text refused with nothing embedded; text requests of several
processes embedded in shared forward passes (asserted from /metrics) without sending a batch of
recalls to the general route; a sidecar without a model, or with one of another dimension."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from conftest import TEST_BACKEND, free_port, run_py, wait_until

from kalos import Hybrid, RecallClient, RecallPool
from kalos.broker.errors import ConfigError, InvalidRequest
from kalos.broker.layout import Flag, Op, Status
from kalos.broker.lexical import tokenize
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.embedding import TextEncoder
from kalos.testing.tinymodel import WORDS, build_tiny_model

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.timeout(180)
async_test = pytest.mark.asyncio
DIM = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), dim=DIM, seed=11)


@pytest.fixture
def text_sidecar(sidecar_factory, tiny):
    port = free_port()
    h = sidecar_factory(
        "text",
        "--dim", str(DIM), "--metric", "cosine", "--embed", str(tiny), "--slots", "32", "--max-queries", "8",
        "--max-k", "32", "--backend", "numpy", "--metrics-port", str(port),
    )  # fmt: skip
    h.port = port
    return h


def tolerance(name: str) -> float:
    """float32 on numpy; the CUDA backend serves the model in float16."""
    c = Connection(name, sidecar_uid=os.geteuid())
    try:
        return 1e-6 if int(c.seg.header["backend"]) == 1 else 2e-2
    finally:
        c.close()


def sentences(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, int(rng.integers(2, 30)))) for _ in range(n)]


def metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"{{{v}}}" for v in s.labels.values())
            out[key] = s.value
    return out


@async_test
async def test_embed_through_the_broker_is_the_models_own_output(text_sidecar, tiny, rng):
    texts = sentences(rng, 21) + ["Café déjà vu, 東京!", "line one\nline two"]
    want = TextEncoder(tiny).encode(texts)  # the runtime in process (numpy float32)
    tol = tolerance(text_sidecar.name)
    async with RecallPool(text_sidecar.name, size=4) as pool:
        got = await pool.embed(texts)  # 23 texts: 3 requests of at most 8
        assert got.shape == (23, DIM) and got.dtype == np.float32
        assert np.abs(got - want).max() <= tol
        assert np.abs((await pool.embed(texts[5:6]))[0] - want[5]).max() <= tol
    with RecallClient(text_sidecar.name) as c:
        assert np.abs(c.embed(texts) - want).max() <= tol
    m = metrics(text_sidecar.port)
    assert m["kalos_embed_texts_total"] == 23 + 1 + 23
    assert m["kalos_batches_by_route_total{embed}"] >= 1


@async_test
async def test_upsert_text_and_recall_text_are_exact_and_keep_the_text(text_sidecar, tiny, rng):
    enc = TextEncoder(tiny)
    spaces = {"u1": sentences(rng, 120), "u2": sentences(rng, 40), "u3": sentences(rng, 5)}
    async with RecallPool(text_sidecar.name, size=4) as pool:
        for ns, texts in spaces.items():
            payloads = [{"n": i, "tag": "even" if i % 2 == 0 else "odd"} for i in range(len(texts))]
            written = await pool.upsert_text(np.arange(len(texts)) + 1000, texts, payloads, namespace=ns)
            assert int(written) == len(texts)
        tol = tolerance(text_sidecar.name)
        for ns, texts in spaces.items():
            rows = enc.encode(texts).astype(np.float64)
            queries = sentences(rng, 6)
            qv = enc.encode(queries).astype(np.float64)
            k = min(5, len(texts))
            for q, v in zip(queries, qv):
                hits = await pool.recall_text(q, k=k, namespace=ns)
                scores = rows @ v
                want = np.argsort(-scores, kind="stable")[:k]
                assert len(hits) == k
                # Exact: the k-th best score (ties at the boundary allowed), every hit's score right.
                assert np.allclose(hits.scores, scores[hits.ids - 1000], atol=max(tol, 1e-5))
                assert hits.scores.min() >= scores[want[-1]] - max(tol, 1e-5)
                for h in hits:
                    i = h.id - 1000
                    assert h.text == texts[i] and h.payload["n"] == i and h.payload["text"] == texts[i]
                filtered = await pool.recall_text(q, k=k, namespace=ns, where={"tag": "odd"})
                assert all(h.payload["n"] % 2 == 1 for h in filtered)
        many = await pool.recall_text_many(sentences(rng, 11), k=3, namespace="u1")  # 11 > max_queries
        assert len(many) == 11 and all(len(h) == 3 and all(x.text for x in h) for h in many)
        with pytest.raises(InvalidRequest, match="takes dict payloads"):
            await pool.upsert_text([1], ["a text"], ["not a dict"], namespace="u1")
        assert await pool.count("u1") == 120  # nothing written by the refused call


def raw_embed(
    c: Connection,
    blob: bytes,
    nq: int,
    op: Op = Op.EMBED,
    ns: bytes = b"",
    k: int = 0,
    flags: int = 0,
    weight: float = 0.0,
) -> tuple[int, str, int]:
    """A request written by hand (no client-side checks; an EMBED unless told) in a slot of its
    own, given back after: (status, detail, n_results)."""
    s = c.lease(1)[0]
    try:
        s.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
        s.view.queries[:nq] = 1.0
        s.view.ctl["hybrid_weight"] = weight
        s.post(int(op), ns, k, nq, flags, len(blob), 0)
        assert wait_until(lambda: s.is_done() and s.try_consume(), 10)
        status, n, blen = s.outcome()
        detail = s.blob_text(blen).decode(errors="replace") if status else ""
        s.set_free()
        return status, detail, n
    finally:
        c.give_back([s], [])


def test_bad_text_gets_a_clear_error_and_nothing_is_embedded(text_sidecar):
    c = Connection(text_sidecar.name, sidecar_uid=os.geteuid())
    try:
        before = metrics(text_sidecar.port)["kalos_embed_texts_total"]
        for blob, nq, status, match in (
            (b"ok\x00\xff\xfe\x00", 2, Status.BAD_REQUEST, "text 1 is not valid UTF-8"),
            (b"ok\x00\x00", 2, Status.BAD_REQUEST, "text 1 is empty"),
            (b"no terminator", 1, Status.BAD_REQUEST, "must end with a NUL"),
            (b"a\x00b\x00", 3, Status.BAD_REQUEST, "holds 2 texts, nq is 3"),
            (b"x" * 16385 + b"\x00", 1, Status.BAD_REQUEST, "the most is 16384"),
            (b"", 1, Status.BAD_REQUEST, "blob_len=0"),
            (b"a\x00" * 9, 9, Status.TOO_MANY_QUERIES, "nq=9 outside 1..8"),
            (b"a\x00", 0, Status.TOO_MANY_QUERIES, "nq=0"),
        ):
            got, detail, _ = raw_embed(c, blob, nq)
            assert (got, match in detail) == (status, True), (blob[:20], detail)
        assert metrics(text_sidecar.port)["kalos_embed_texts_total"] == before  # nothing embedded
        got, _, n = raw_embed(c, b"fine, after all that\x00", 1)  # and it serves on
        assert (got, n) == (Status.OK, 1)
    finally:
        c.close()


@async_test
async def test_a_sidecar_without_a_model_says_so(sidecar_factory):
    h = sidecar_factory("plain", "--dim", str(DIM), "--backend", "numpy")
    async with RecallPool(h.name, size=2) as pool:
        with pytest.raises(ConfigError, match="serves no embedding model .*--embed DIR"):
            await pool.embed(["hello"])
        with pytest.raises(ConfigError, match="serves no embedding model"):
            await pool.recall_text("hello", namespace="u")
    c = Connection(h.name, sidecar_uid=os.geteuid())
    try:
        got, detail, _ = raw_embed(c, b"hello\x00", 1)
        assert got == Status.UNKNOWN_OP and "serves no embedding model" in detail
    finally:
        c.close()


def test_a_model_of_another_dimension_is_refused_at_start(tiny):
    r = subprocess.run(
        [sys.executable, "-m", "kalos.sidecar_cuda", "--name", "dimcheck", "--ephemeral", "--dim", "64",
         "--backend", "numpy", "--embed", str(tiny)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and "32 dimensions, --dim is 64" in r.stderr


_WORKER = """
import asyncio, sys
from kalos import RecallPool
name, me = sys.argv[1], int(sys.argv[2])
async def main():
    async with RecallPool(name, size=4) as pool:
        for r in range(12):
            await asyncio.gather(*(pool.embed([f"agent {me} round {r} text {j} {w}" for w in ("tea", "code")])
                                   for j in range(4)))
asyncio.run(main())
"""


def test_text_requests_of_several_processes_share_forward_passes(text_sidecar, rng):
    before = metrics(text_sidecar.port)
    procs = [run_py(_WORKER, text_sidecar.name, str(i)) for i in range(4)]
    for p in procs:
        assert p.wait(120) == 0
    m = metrics(text_sidecar.port)
    requests, texts = 4 * 12 * 4, 4 * 12 * 4 * 2

    def d(key: str) -> float:
        return m[key] - before.get(key, 0.0)

    assert d("kalos_embed_texts_total") == texts
    # Every text request of a pass goes through the model together: fewer batches than requests.
    assert d("kalos_embed_batches_total") < requests
    assert d("kalos_embed_passes_total") == d("kalos_embed_batches_total")  # one pass per batch here
    assert d("kalos_batches_by_route_total{embed}") == d("kalos_embed_batches_total")


_RECALLER = """
import asyncio, sys
import numpy as np
from kalos import RecallPool
name, seed = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(seed)
async def main():
    async with RecallPool(name, size=8) as pool:
        for _ in range(40):
            qs = rng.standard_normal((8, 32)).astype(np.float32)
            hits = await asyncio.gather(*(pool.recall(q, k=5, namespace="vec") for q in qs),
                                        pool.embed(["interleaved text", "another one"]))
            for q, h in zip(qs, hits[:-1]):
                print(q.tobytes().hex(), *h.ids.tolist())
asyncio.run(main())
"""


def test_text_requests_do_not_send_recalls_to_the_general_route(text_sidecar, rng):
    rows = rng.standard_normal((300, DIM)).astype(np.float32)

    async def load() -> None:
        async with RecallPool(text_sidecar.name, size=2) as pool:
            await pool.upsert(np.arange(300), rows, namespace="vec")

    asyncio.run(load())
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)  # (cosine: stored normalised)
    before = metrics(text_sidecar.port)
    procs = [run_py(_RECALLER, text_sidecar.name, str(int(rng.integers(1 << 30)))) for _ in range(3)]
    checked = 0
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        for line in out.decode().splitlines():
            hexq, *ids = line.split()
            q = np.frombuffer(bytes.fromhex(hexq), np.float32).astype(np.float64)
            scores = unit.astype(np.float64) @ (q / np.linalg.norm(q))
            got = np.array([int(i) for i in ids])
            assert scores[got].min() >= np.sort(scores)[-5] - 1e-5
            checked += 1
    assert checked == 3 * 40 * 8
    m = metrics(text_sidecar.port)
    general = m["kalos_batches_by_route_total{general}"] - before["kalos_batches_by_route_total{general}"]
    embeds = m["kalos_batches_by_route_total{embed}"] - before["kalos_batches_by_route_total{embed}"]
    assert embeds > 0 and general == 0, (embeds, general)
    assert TEST_BACKEND in ("numpy", "cuda")


@async_test
async def test_hybrid_recall_is_exact_against_bm25_and_float64(text_sidecar, tiny, rng):
    """recall_text(hybrid=...) against rank_bm25 (over the live records' texts) plus the
    similarity in float64, normalized as documented, with and without a filter, after deletes
    and an expiry (the index follows the writes), at several weights."""
    rank_bm25 = pytest.importorskip("rank_bm25")
    import asyncio as aio

    enc = TextEncoder(tiny)
    tol = max(tolerance(text_sidecar.name), 1e-5)
    texts = sentences(rng, 150)
    payloads = [{"n": i, "tag": "odd" if i % 2 else "even"} for i in range(150)]
    async with RecallPool(text_sidecar.name, size=4) as pool:
        await pool.upsert_text(np.arange(150) + 1000, texts, payloads, namespace="hy")
        await pool.delete([1003, 1007], namespace="hy")
        await pool.upsert_text([9000], [" ".join(texts[:3])], namespace="hy", ttl=0.3)  # gone below
        await aio.sleep(0.5)
        alive = [i for i in range(150) if i not in (3, 7)]
        rows = enc.encode([texts[i] for i in alive]).astype(np.float64)
        bm25 = rank_bm25.BM25Okapi([tokenize(texts[i]) for i in alive])
        checked = 0
        for q in sentences(rng, 6) + [texts[10], "tea"]:
            qv = enc.encode([q])[0].astype(np.float64)
            dense, lex = rows @ (qv / np.linalg.norm(qv)), np.maximum(bm25.get_scores(tokenize(q)), 0.0)
            for weight in (0.0, 0.7, 3.0):
                for where in (None, {"tag": "odd"}):
                    sel = np.array([where is None or payloads[i]["tag"] == "odd" for i in alive])
                    top = lex[sel].max()
                    fused = dense + (weight * lex / top if top > 0 else 0.0)
                    fused[~sel] = -np.inf
                    hits = await pool.recall_text(q, k=5, namespace="hy", hybrid=Hybrid(weight), where=where)
                    pos = {1000 + i: j for j, i in enumerate(alive)}
                    assert len(hits) == 5 and all(h.id in pos for h in hits)  # never 9000 (expired), 1003, 1007
                    got = np.array([fused[pos[h.id]] for h in hits])
                    np.testing.assert_allclose(hits.scores, got, atol=tol)  # each hit's score is its fused score
                    assert got.min() >= np.sort(fused)[-5] - tol  # and they are the best five
                    assert all(h.text == texts[h.id - 1000] for h in hits)
                    checked += 1
        assert checked == 48
        many = await pool.recall_text_many(["tea", "paris"], k=3, namespace="hy", hybrid=Hybrid(1.0))
        assert [len(h) for h in many] == [3, 3]
        with pytest.raises(InvalidRequest, match="does not take recency"):
            from kalos import Recency

            await pool.recall_text("tea", namespace="hy", hybrid=Hybrid(), recency=Recency(60.0))
        assert not (await pool.recall_text("tea", namespace="never", hybrid=Hybrid()))


def test_a_hybrid_recall_a_client_broke_gets_a_clear_error(text_sidecar):
    c = Connection(text_sidecar.name, sidecar_uid=os.geteuid())
    flags = int(Flag.HYBRID | Flag.WITH_PAYLOAD)
    try:
        for blob, nq, weight, fl, match in (
            (b"no terminator", 1, 0.5, flags, "NUL-terminated"),
            (b"\xff\xfe\x00", 1, 0.5, flags, "not valid UTF-8"),
            (b"tea\x00", 1, float("nan"), flags, "finite number >= 0"),
            (b"tea\x00", 2, 0.5, flags, "one query"),
            (b'tea\x00{"a":1}', 1, 0.5, flags, "without a filter"),
            (b"tea\x00{bad", 1, 0.5, flags | int(Flag.WHERE), "hybrid: "),
        ):
            got, detail, _ = raw_embed(c, blob, nq, Op.RECALL, b"hy", 3, fl, weight)
            assert (got, match in detail) == (Status.BAD_REQUEST, True), (blob, detail)
    finally:
        c.close()
