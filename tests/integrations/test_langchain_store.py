"""The LangChain adapter (kalos.integrations.langchain) against a real sidecar: LangChain's own
standard suite (sync and async, unmodified), then ours: the id mapping and collisions, filters
checked against a numpy float64 reference on random data, MMR, relevance scores, the retriever.

One sidecar per module (started as tests/conftest.py starts them: same harness, backend and
shards from the environment); every test gets a fresh namespace, so every store starts empty.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import math
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
import pytest_asyncio

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from conftest import TEST_BACKEND, TEST_SHARDS, assert_topk, unique_name
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores.utils import maximal_marginal_relevance
from langchain_tests.integration_tests import VectorStoreIntegrationTests

from kalos import InvalidRequest, RecallClient
from kalos.integrations.langchain import (
    DOC_FIELD,
    ID_FIELD,
    IdCollisionError,
    KalosTimeWeightedRetriever,
    KalosVectorStore,
    kalos_id,
    mmr_select,
    to_where,
)
from kalos.testing.sidecar import running_sidecar

DIM = 6  # the standard suite's EMBEDDING_SIZE
MAX_K = 64
_ns = itertools.count()


@pytest.fixture(scope="module")
def lc_sidecar() -> Iterator[str]:
    """A cosine sidecar of dim 6 for the whole module; its name."""
    name = unique_name("lc")
    args = ["--ephemeral", "--dim", str(DIM), "--metric", "cosine", "--max-k", str(MAX_K), "--backend", TEST_BACKEND]
    if TEST_SHARDS:
        args += ["--shards", TEST_SHARDS]
    with running_sidecar(args, name, timeout=60):
        yield name


def fresh_namespace() -> str:
    return f"lc-{next(_ns)}"


# --------------------------------------------------------------------------- the standard suite


@pytest.mark.asyncio
@pytest.mark.filterwarnings(  # the suite's sync tests inherit the class's asyncio mark
    "ignore:The test <Function.*is marked with '@pytest.mark.asyncio' but it is not an async"
)
class TestKalosStandardSuite(VectorStoreIntegrationTests):
    """LangChain's VectorStoreIntegrationTests, sync and async: a store on a fresh namespace per
    test. Sync tests use the store's blocking RecallClient; async tests (on asyncio and uvloop)
    its RecallPool, opened in the test's loop."""

    @pytest_asyncio.fixture
    async def vectorstore(self, lc_sidecar: str) -> AsyncIterator[KalosVectorStore]:  # type: ignore[override]
        store = KalosVectorStore(self.get_embeddings(), name=lc_sidecar, namespace=fresh_namespace())
        try:
            yield store
        finally:
            await store.adelete()  # ids=None: every document (the namespace is dropped)
            await store.aclose()


# --------------------------------------------------------------------------- helpers


class TableEmbeddings(Embeddings):
    """Texts -> vectors we chose, so results can be checked against numpy."""

    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.table[t].tolist() for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.table[text].tolist()


def table_of(store: KalosVectorStore) -> dict[str, np.ndarray]:
    return cast(TableEmbeddings, store.embeddings).table


@pytest.fixture
def store(lc_sidecar: str) -> Iterator[KalosVectorStore]:
    s = KalosVectorStore(TableEmbeddings({}), name=lc_sidecar, namespace=fresh_namespace())
    try:
        yield s
    finally:
        s.delete()
        s.close()


@pytest_asyncio.fixture
async def astore(lc_sidecar: str) -> AsyncIterator[KalosVectorStore]:
    s = KalosVectorStore(TableEmbeddings({}), name=lc_sidecar, namespace=fresh_namespace())
    try:
        yield s
    finally:
        await s.adelete()
        await s.aclose()


def random_corpus(rng: np.random.Generator, n: int) -> tuple[list[str], np.ndarray, list[dict[str, Any]]]:
    """n texts with random vectors and metadata: cat (a/b/c), n (int 0..9), x (float), and
    opt (present on about half)."""
    texts = [f"doc-{i}" for i in range(n)]
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    metas: list[dict[str, Any]] = []
    for _ in range(n):
        m: dict[str, Any] = {
            "cat": str(rng.choice(["a", "b", "c"])),
            "n": int(rng.integers(0, 10)),
            "x": float(rng.random()),
        }
        if rng.random() < 0.5:
            m["opt"] = bool(rng.random() < 0.5)
        metas.append(m)
    return texts, vecs, metas


#: (LangChain filter, the same predicate in Python) — every operator the adapter maps.
FILTERS: list[tuple[dict[str, Any], Callable[[dict[str, Any]], bool]]] = [
    ({"cat": "a"}, lambda m: m["cat"] == "a"),
    ({"cat": {"$eq": "b"}}, lambda m: m["cat"] == "b"),
    ({"cat": {"$ne": "b"}}, lambda m: m["cat"] != "b"),
    ({"cat": {"$in": ["a", "c"]}}, lambda m: m["cat"] in ("a", "c")),
    ({"cat": {"$nin": ["a"]}}, lambda m: m["cat"] != "a"),
    ({"n": {"$gte": 3, "$lt": 7}}, lambda m: 3 <= m["n"] < 7),
    ({"x": {"$gt": 0.25, "$lte": 0.75}}, lambda m: 0.25 < m["x"] <= 0.75),
    ({"opt": {"$exists": True}}, lambda m: "opt" in m),
    ({"opt": {"$exists": False}}, lambda m: "opt" not in m),
    ({"opt": True}, lambda m: m.get("opt") is True),
    ({"cat": "a", "n": {"$lte": 4}}, lambda m: m["cat"] == "a" and m["n"] <= 4),
    ({"cat": {"$eq": "c", "$ne": "a"}, "n": {"$gt": 1}}, lambda m: m["cat"] == "c" and m["n"] > 1),
    ({"$or": [{"cat": "a"}, {"x": {"$gt": 0.8}}]}, lambda m: m["cat"] == "a" or m["x"] > 0.8),
    (
        {"$and": [{"n": {"$gt": 2}}, {"$or": [{"cat": {"$nin": ["b"]}}, {"opt": False}]}]},
        lambda m: m["n"] > 2 and (m["cat"] != "b" or m.get("opt") is False),
    ),
    ({"n": {"$gt": 100}}, lambda m: False),
]


def check_filtered(
    query: np.ndarray,
    vecs: np.ndarray,
    metas: list[dict[str, Any]],
    pred: Callable[[dict[str, Any]], bool],
    k: int,
    got: list[tuple[Document, float]],
) -> None:
    """Exact top-k among the documents matching ``pred``, against a float64 cosine reference."""
    match = np.array([i for i, m in enumerate(metas) if pred(m)], np.int64)
    if len(match) == 0:
        assert got == []
        return
    ids = np.array([int(d.page_content.removeprefix("doc-")) for d, _ in got], np.int64)
    assert set(ids.tolist()) <= set(match.tolist()), "a document outside the filter"
    for d, _ in got:
        assert d.metadata == metas[int(d.page_content.removeprefix("doc-"))]
    pos = {int(g): j for j, g in enumerate(match)}
    assert_topk(
        query,
        vecs[match],
        np.array([pos[int(i)] for i in ids], np.int64),
        np.array([s for _, s in got], np.float32),
        k,
        metric="cosine",
    )


# --------------------------------------------------------------------------- ids


def test_kalos_id_is_documented_blake2b_and_pinned() -> None:
    for s in ["", "1", "foo", "ünïcødé", "a" * 1000]:
        digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest()
        assert kalos_id(s) == int.from_bytes(digest, "big") & (2**63 - 1)
        assert 0 <= kalos_id(s) < 2**63
    # pinned: the mapping must never change (stored documents are found by it)
    assert kalos_id("foo") == 0x7403_AEA3_9BAF_52FB
    assert kalos_id("doc-1") == 6265767295393789249
    assert kalos_id("1") != kalos_id("2")
    with pytest.raises(InvalidRequest):
        kalos_id(1)  # type: ignore[arg-type]


def test_ids_roundtrip_through_records(store: KalosVectorStore, lc_sidecar: str) -> None:
    """The record of string id s is at kalos_id(s) and names s in its payload."""
    rng = np.random.default_rng(0)
    table_of(store).update({"t1": rng.standard_normal(DIM), "t2": rng.standard_normal(DIM)})
    ids = store.add_texts(["t1", "t2"], [{"k": 1}, {}], ids=["alpha", None])  # type: ignore[list-item]
    assert ids[0] == "alpha" and isinstance(ids[1], str) and ids[1] != "alpha"
    with RecallClient(lc_sidecar) as c:
        rec = c.get([kalos_id(i) for i in ids], namespace=store.namespace, with_vectors=False)
    assert rec.ids.tolist() == [kalos_id(i) for i in ids]
    assert [p[ID_FIELD] for p in rec.payloads] == ids
    assert rec.payloads[0] == {ID_FIELD: "alpha", DOC_FIELD: {"page_content": "t1"}, "m.k": 1}
    assert [d.id for d in store.get_by_ids(["alpha", "nope", ids[1], "alpha"])] == ["alpha", ids[1]]


def plant(lc_sidecar: str, namespace: str, at: int, payload: Any) -> None:
    """A record written by someone else at Kalos id ``at``."""
    with RecallClient(lc_sidecar) as c:
        c.upsert([at], np.ones((1, DIM), np.float32), [payload], namespace=namespace)


def payload_at(lc_sidecar: str, namespace: str, at: int) -> Any:
    with RecallClient(lc_sidecar) as c:
        rec = c.get([at], namespace=namespace, with_vectors=False)
    return rec.payloads[0] if len(rec) else None


@pytest.mark.parametrize(
    "foreign",
    [
        {ID_FIELD: "other", DOC_FIELD: {"page_content": "theirs"}},  # another document at our id
        {"not": "a document"},  # a record that is no document at all
    ],
)
def test_collision_with_stored_record_raises_and_keeps_it(
    store: KalosVectorStore, lc_sidecar: str, foreign: dict[str, Any]
) -> None:
    table_of(store).update({"mine": np.ones(DIM), "fine": np.arange(DIM, dtype=float)})
    plant(lc_sidecar, store.namespace, kalos_id("x"), foreign)
    with pytest.raises(IdCollisionError, match="'x'"):
        store.add_texts(["fine", "mine"], ids=["y", "x"])
    assert payload_at(lc_sidecar, store.namespace, kalos_id("x")) == foreign  # not overwritten
    assert payload_at(lc_sidecar, store.namespace, kalos_id("y")) is None  # nothing of the batch
    assert store.get_by_ids(["x"]) == []  # never the other record
    store.delete(["x"])  # selects by lc_id: the colliding record stays
    assert payload_at(lc_sidecar, store.namespace, kalos_id("x")) == foreign
    store.add_texts(["fine"], ids=["z"])  # searches return documents, skip other records
    docs = {"z"} | ({foreign[ID_FIELD]} if ID_FIELD in foreign else set())
    assert {d.id for d in store.similarity_search("mine", k=4)} == docs
    assert {d.id for d in store.max_marginal_relevance_search("mine", k=4)} == docs


@pytest.mark.asyncio
async def test_collision_with_stored_record_raises_async(astore: KalosVectorStore, lc_sidecar: str) -> None:
    table_of(astore)["mine"] = np.ones(DIM)
    foreign = {ID_FIELD: "other", DOC_FIELD: {"page_content": "theirs"}}
    plant(lc_sidecar, astore.namespace, kalos_id("x"), foreign)
    with pytest.raises(IdCollisionError):
        await astore.aadd_texts(["mine"], ids=["x"])
    assert payload_at(lc_sidecar, astore.namespace, kalos_id("x")) == foreign
    assert await astore.aget_by_ids(["x"]) == []
    await astore.adelete(["x"])
    assert payload_at(lc_sidecar, astore.namespace, kalos_id("x")) == foreign


def colliding_pair(id_map: Callable[[str], int]) -> tuple[str, str]:
    seen: dict[int, str] = {}
    for i in itertools.count():
        s = f"id-{i}"
        if id_map(s) in seen:
            return seen[id_map(s)], s
        seen[id_map(s)] = s
    raise AssertionError


def test_collision_between_string_ids(lc_sidecar: str) -> None:
    """Real collisions, made likely by a 2-bit id map: an add whose id collides with a stored
    document raises and writes nothing; one whose ids collide within the batch too; updates of
    the same id, deletes and reads never touch the colliding document."""
    weak = lambda s: kalos_id(s) % 4  # noqa: E731
    a, b = colliding_pair(weak)
    table = {t: np.random.default_rng(j).standard_normal(DIM) for j, t in enumerate("pqr")}
    store = KalosVectorStore(TableEmbeddings(table), name=lc_sidecar, namespace=fresh_namespace(), id_map=weak)
    try:
        assert store.add_texts(["p"], ids=[a]) == [a]
        assert store.add_texts(["q"], ids=[a]) == [a]  # same id: an update
        with pytest.raises(IdCollisionError):
            store.add_texts(["r"], ids=[b])
        with pytest.raises(IdCollisionError):  # the first id is fine, the second is not
            store.add_texts(["p", "r"], ids=["fine", b])
        assert store.get_by_ids(["fine"]) == []  # nothing of the batch was written
        docs = store.get_by_ids([a, b])
        assert [(d.id, d.page_content) for d in docs] == [(a, "q")]
        store.delete([b])
        assert [d.id for d in store.get_by_ids([a])] == [a]
        assert [d.id for d in store.similarity_search("p", k=4)] == [a]
    finally:
        store.delete()
        store.close()


def test_in_batch_collision_writes_nothing(lc_sidecar: str) -> None:
    weak = lambda s: kalos_id(s) % 4  # noqa: E731
    a, b = colliding_pair(weak)
    table = {"p": np.ones(DIM), "q": -np.ones(DIM)}
    store = KalosVectorStore(TableEmbeddings(table), name=lc_sidecar, namespace=fresh_namespace(), id_map=weak)
    try:
        with pytest.raises(IdCollisionError, match="another key of this write"):
            store.add_texts(["p", "q"], ids=[a, b])
        assert store.similarity_search("p", k=4) == []
    finally:
        store.delete()
        store.close()


# --------------------------------------------------------------------------- filters


def test_to_where_mapping() -> None:
    assert to_where({"a": 1}) == {"m.a": 1}
    assert to_where({"a": {"$eq": "x"}}) == {"m.a": "x"}
    assert to_where({"a": {"$in": ("x", "y")}, "b": {"$gte": 1, "$lt": 2}}) == {
        "m.a": {"$in": ["x", "y"]},
        "m.b": {"$gte": 1, "$lt": 2},
    }
    assert to_where({"a": {"$eq": 1, "$ne": 2}}) == {"$and": [{"m.a": 1}, {"m.a": {"$ne": 2}}]}
    assert to_where({"$or": [{"a": 1}, {"b": {"$exists": False}}]}) == {
        "$or": [{"m.a": 1}, {"m.b": {"$exists": False}}]
    }
    # after $eq comes a value: a dict there is never read as operators (it used to become $in)
    for bad in [
        {"$not": {"a": 1}},
        {"a": {"$like": "x%"}},
        {"a": {}},
        {},
        {"$or": []},
        [1],
        {"a": {"$eq": {"$in": [1, 2]}}},
    ]:
        with pytest.raises(InvalidRequest):
            to_where(bad)  # type: ignore[arg-type]


def test_filters_match_numpy_reference(store: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, metas = random_corpus(rng, 400)
    table_of(store).update(zip(texts, vecs))
    store.add_texts(texts, metas, ids=[f"id-{i}" for i in range(len(texts))])
    for _ in range(3):
        q = rng.standard_normal(DIM).astype(np.float32)
        for flt, pred in FILTERS:
            for k in (1, 10, MAX_K):
                got = store.similarity_search_with_score_by_vector(q.tolist(), k, filter=flt)
                check_filtered(q, vecs, metas, pred, k, got)
    with pytest.raises(InvalidRequest):
        store.similarity_search_by_vector(q.tolist(), 3, filter={"cat": {"$regex": "a"}})
    # delete by filter removes exactly the matching documents
    store.delete(filter={"cat": "a", "n": {"$lt": 5}})
    left = store.similarity_search_with_score_by_vector(q.tolist(), MAX_K, filter={"cat": "a"})
    assert left and all(d.metadata["n"] >= 5 for d, _ in left)


@pytest.mark.asyncio
async def test_filters_match_numpy_reference_async(astore: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, metas = random_corpus(rng, 300)
    table_of(astore).update(zip(texts, vecs))
    await astore.aadd_texts(texts, metas)
    q = rng.standard_normal(DIM).astype(np.float32)
    for flt, pred in FILTERS:
        got = await astore.asimilarity_search_with_score_by_vector(q.tolist(), 10, filter=flt)
        check_filtered(q, vecs, metas, pred, 10, got)
    await astore.adelete(filter={"cat": {"$in": ["a", "b"]}})
    rest = await astore.asimilarity_search_by_vector(q.tolist(), MAX_K)
    assert rest and all(d.metadata["cat"] == "c" for d in rest)


def test_relevance_scores(store: KalosVectorStore, rng: np.random.Generator) -> None:
    """Kalos scores are cosine similarities here; relevance is (1 + cos) / 2."""
    texts, vecs, _ = random_corpus(rng, 50)
    q = rng.standard_normal(DIM)
    table_of(store).update(zip(texts, vecs))
    table_of(store)["query"] = q
    store.add_texts(texts)
    unit = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    cos = unit @ (q / np.linalg.norm(q))
    got = store.similarity_search_with_relevance_scores("query", k=5)
    want = np.sort(cos)[::-1][:5]
    np.testing.assert_allclose([s for _, s in got], (1 + want) / 2, atol=1e-5)
    raw = store.similarity_search_with_score("query", k=5)
    np.testing.assert_allclose([s for _, s in raw], want, atol=1e-5)
    assert all(0.0 <= s <= 1.0 for _, s in got)


# --------------------------------------------------------------------------- MMR


def test_mmr_select_matches_langchain(rng: np.random.Generator) -> None:
    for _ in range(20):
        n, d = int(rng.integers(1, 40)), int(rng.integers(2, 16))
        cands = rng.standard_normal((n, d))
        q = rng.standard_normal(d)
        k = int(rng.integers(1, n + 2))
        lam = float(rng.random())
        assert mmr_select(q, cands, k, lam) == maximal_marginal_relevance(q, cands.tolist(), lam, k)


def test_mmr_search(store: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, metas = random_corpus(rng, 200)
    q = rng.standard_normal(DIM).astype(np.float32)
    table_of(store).update(zip(texts, vecs))
    table_of(store)["query"] = q
    store.add_texts(texts, metas)
    unit = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    for fetch_k, lam, flt, pred in [
        (20, 0.5, None, lambda m: True),
        (30, 0.2, {"cat": "b"}, lambda m: m["cat"] == "b"),
        (500, 0.9, None, lambda m: True),
    ]:
        match = np.array([i for i, m in enumerate(metas) if pred(m)])
        top = match[np.argsort(-(unit[match] @ q))[: min(fetch_k, MAX_K)]]
        want = [f"doc-{top[j]}" for j in maximal_marginal_relevance(q, unit[top].tolist(), lam, 5)]
        got = store.max_marginal_relevance_search("query", k=5, fetch_k=fetch_k, lambda_mult=lam, filter=flt)
        assert [d.page_content for d in got] == want
    # lambda 1: pure relevance, the plain top-k order
    assert [d.id for d in store.max_marginal_relevance_search("query", k=6, lambda_mult=1.0)] == [
        d.id for d in store.similarity_search("query", k=6)
    ]


@pytest.mark.asyncio
async def test_mmr_search_start(astore: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, _ = random_corpus(rng, 100)
    q = rng.standard_normal(DIM).astype(np.float32)
    table_of(astore).update(zip(texts, vecs))
    table_of(astore)["query"] = q
    await astore.aadd_texts(texts)
    unit = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    top = np.argsort(-(unit @ q))[:20]
    want = [f"doc-{top[j]}" for j in maximal_marginal_relevance(q, unit[top].tolist(), 0.5, 4)]
    got = await astore.amax_marginal_relevance_search("query", k=4, fetch_k=20)
    assert [d.page_content for d in got] == want
    assert (
        await KalosVectorStore(
            TableEmbeddings({"query": q}), name=astore.name, namespace="lc-never-written"
        ).amax_marginal_relevance_search("query")
        == []
    )


# --------------------------------------------------------------------------- retriever


def test_retriever(store: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, metas = random_corpus(rng, 100)
    q = rng.standard_normal(DIM).astype(np.float32)
    table_of(store).update(zip(texts, vecs))
    table_of(store)["query"] = q
    store.add_texts(texts, metas)
    r = store.as_retriever(search_kwargs={"k": 3, "filter": {"cat": "c"}})
    docs = r.invoke("query")
    assert len(docs) == 3 and all(d.metadata["cat"] == "c" for d in docs)
    assert docs == store.similarity_search("query", k=3, filter={"cat": "c"})
    mmr = store.as_retriever(search_type="mmr", search_kwargs={"k": 4, "fetch_k": 30})
    assert mmr.invoke("query") == store.max_marginal_relevance_search("query", k=4, fetch_k=30)
    thr = store.as_retriever(search_type="similarity_score_threshold", search_kwargs={"k": 50, "score_threshold": 0.8})
    kept = thr.invoke("query")
    unit = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    rel = (1 + unit @ (q / np.linalg.norm(q))) / 2
    assert {d.page_content for d in kept} == {f"doc-{i}" for i in np.flatnonzero(rel >= 0.8)}


@pytest.mark.asyncio
async def test_retriever_async(astore: KalosVectorStore, rng: np.random.Generator) -> None:
    texts, vecs, metas = random_corpus(rng, 60)
    q = rng.standard_normal(DIM).astype(np.float32)
    table_of(astore).update(zip(texts, vecs))
    table_of(astore)["query"] = q
    await astore.aadd_texts(texts, metas)
    r = astore.as_retriever(search_kwargs={"k": 5, "filter": {"n": {"$lt": 5}}})
    docs = await r.ainvoke("query")
    assert docs == await astore.asimilarity_search("query", k=5, filter={"n": {"$lt": 5}})
    assert len(docs) == 5 and all(d.metadata["n"] < 5 for d in docs)
    mmr = astore.as_retriever(search_type="mmr", search_kwargs={"k": 3})
    assert await mmr.ainvoke("query") == await astore.amax_marginal_relevance_search("query", k=3)


# --------------------------------------------------------------------------- lifecycle


@pytest.mark.asyncio
async def test_from_texts_and_owned_connections(lc_sidecar: str) -> None:
    table = {"a": np.ones(DIM), "b": -np.ones(DIM)}
    ns = fresh_namespace()
    store = await KalosVectorStore.afrom_texts(
        ["a", "b"], TableEmbeddings(table), ids=["1", "2"], name=lc_sidecar, namespace=ns
    )
    async with store:
        assert [d.id for d in await store.asimilarity_search("a", k=1)] == ["1"]
        assert [d.id for d in store.similarity_search("b", k=1)] == ["2"]  # sync beside async
        with pytest.raises(TypeError):
            await store.asimilarity_search("a", k=1, bogus=True)
        await store.adelete()
    await store.aclose()  # twice is fine


def test_passed_in_client_is_not_closed(lc_sidecar: str) -> None:
    with RecallClient(lc_sidecar) as client:
        store = KalosVectorStore(
            TableEmbeddings({"a": np.ones(DIM)}), name=lc_sidecar, namespace=fresh_namespace(), client=client
        )
        with store:
            store.add_texts(["a"], ids=["z"])
        assert client.count(store.namespace) == 1  # still open
        client.drop_namespace(store.namespace)


@pytest.mark.asyncio
async def test_async_methods_stay_on_the_loop(astore: KalosVectorStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The async methods use the RecallPool: no blocking client, no executor thread."""
    import langchain_core.vectorstores.base as lc_base

    import kalos.integrations._core as core

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("left the event loop")

    monkeypatch.setattr(core, "RecallClient", refuse)
    monkeypatch.setattr(lc_base, "run_in_executor", refuse)
    table_of(astore).update({"a": np.ones(DIM), "b": -np.ones(DIM)})
    ids = await astore.aadd_documents([Document("a", metadata={"n": 1}), Document("b", id="B")])
    assert ids[1] == "B"
    assert [d.id for d in await astore.aget_by_ids(ids)] == ids
    assert (await astore.asimilarity_search_with_relevance_scores("a", k=1))[0][0].id == ids[0]
    assert len(await astore.amax_marginal_relevance_search("a", k=2)) == 2
    assert len(await astore.as_retriever().ainvoke("b")) == 2
    await astore.adelete([ids[0]], filter={"n": 1})
    assert [d.id for d in await astore.asimilarity_search("a", k=4)] == ["B"]


def test_delete_many_ids_in_chunks(store: KalosVectorStore, lc_sidecar: str) -> None:
    """More ids than one $in carries: every chunk is deleted, nothing else."""
    n = 2600
    texts = [f"t{i}" for i in range(n)]
    table_of(store).update((t, np.random.default_rng(i).standard_normal(DIM)) for i, t in enumerate(texts))
    ids = store.add_texts(texts, ids=[f"{i:08d}" * 8 for i in range(n)])  # 64-char ids
    store.delete(ids[:2500] + ["never-added"])
    with RecallClient(lc_sidecar) as c:
        assert c.count(store.namespace) == 100
    assert {d.id for d in store.get_by_ids(ids)} == set(ids[2500:])


def test_relevance_follows_the_sidecars_own_metric(sidecar_factory, rng: np.random.Generator) -> None:
    """Without metric=, relevance reads the sidecar's --metric from its header: on an l2 sidecar
    a near-duplicate is ~1 and the far side of the sphere ~0 (cosine's mapping would clamp every
    l2 score, which is <= 0, to about 0)."""
    h = sidecar_factory("lcl2", "--dim", str(DIM), "--metric", "l2", "--backend", "numpy")
    v = rng.standard_normal(DIM)
    v /= np.linalg.norm(v)
    store = KalosVectorStore(
        TableEmbeddings({"near": v, "far": -v, "query": v}), name=h.name, namespace=fresh_namespace()
    )
    try:
        store.add_texts(["near", "far"])
        got = {d.page_content: s for d, s in store.similarity_search_with_relevance_scores("query", k=2)}
        assert got["near"] == pytest.approx(1.0, abs=1e-5) and got["far"] == pytest.approx(0.0, abs=1e-5)
    finally:
        store.close()


# --------------------------------------------------------------------------- recency
#: The fastest decay LangChain's float decay_rate can express, 1 - 2**-52: (1 - r) ** hours
#: loses 1 % per second, so writes a second apart rank differently within a test.
FAST_DECAY = 1.0 - 2.0**-52


def near_one_direction(rng: np.random.Generator, n: int, spread: float = 0.05) -> np.ndarray:
    """Random vectors close to one random direction: cosines to a query like them differ by about
    as much as a second's decay, so recency reorders them."""
    base = rng.standard_normal(DIM)
    return (base / np.linalg.norm(base) + spread * rng.standard_normal((n, DIM))).astype(np.float32)


def query_near(rng: np.random.Generator, vecs: np.ndarray, j: int) -> np.ndarray:
    """A query among the documents: near their mean, or near one of them."""
    near = vecs.mean(axis=0) if j % 2 else vecs[rng.integers(len(vecs))]
    return (near + 0.03 * rng.standard_normal(DIM)).astype(np.float32)


def write_in_rounds(
    store: KalosVectorStore, rng: np.random.Generator, n: int, rounds: int = 4, pause: float = 0.3
) -> tuple[list[str], np.ndarray, list[dict[str, Any]], dict[str, tuple[float, float]]]:
    """n documents (ids = texts) added in ``rounds`` rounds ``pause`` seconds apart, and each
    one's (created_at, updated_at) as the sidecar stamped them (read back by a RecallClient)."""
    texts, _, metas = random_corpus(rng, n)
    vecs = near_one_direction(rng, n)
    table_of(store).update(zip(texts, vecs))
    for r in range(rounds):
        if r:
            time.sleep(pause)
        part = slice(r * n // rounds, (r + 1) * n // rounds)
        store.add_texts(texts[part], metas[part], ids=texts[part])
    with RecallClient(store.name) as c:
        recs = c.get([kalos_id(t) for t in texts], namespace=store.namespace, with_vectors=False)
    assert recs.created_at is not None and recs.updated_at is not None and len(recs) == n
    times = {t: (float(c_), float(u)) for t, c_, u in zip(texts, recs.created_at, recs.updated_at)}
    return texts, vecs, metas, times


def cosines(q: np.ndarray, vecs: np.ndarray) -> np.ndarray:
    m = vecs.astype(np.float64) / np.linalg.norm(vecs, axis=1, keepdims=True)
    return m @ (q.astype(np.float64) / np.linalg.norm(q))


def langchain_score(q: np.ndarray, vecs: np.ndarray, updated: np.ndarray, now: float, decay_rate: float) -> np.ndarray:
    """LangChain's score, written as it defines it, in float64: relevance (here the cosine
    similarity) + (1 - decay_rate) ** hours since ``last_accessed_at`` (here the last write)."""
    return cosines(q, vecs) + (1.0 - decay_rate) ** ((now - updated) / 3600.0)


def kalos_score(q: np.ndarray, vecs: np.ndarray, updated: np.ndarray, now: float, half_life: float, weight: float):
    """Kalos's (broker/clock.py), in float64: similarity + weight * 0.5 ** (age / half_life)."""
    return cosines(q, vecs) + weight * 0.5 ** ((now - updated) / half_life)


def drift(t0: float, t1: float, per_second: float) -> float:
    """How far a recency part can move while a call is served somewhere in [t0, t1] (the clock
    tolerance of these checks), given its steepest slope ``per_second``."""
    return 2e-6 + per_second * (t1 - t0)


def check_ranked(ref: np.ndarray, got: list[int], scores: list[float] | None, k: int, tol: float) -> None:
    """``got`` (row numbers, best first) is the top ``k`` of ``ref`` up to ``tol``: no row left
    out scores above the last one taken, the order holds, and the scores are ref's."""
    assert len(got) == min(k, len(ref)) and len(set(got)) == len(got)
    kth = np.sort(ref)[::-1][len(got) - 1]
    assert (ref[got] >= kth - tol).all(), "a row outside the true top-k"
    assert np.all(np.diff(ref[got]) <= tol), "not sorted best first"
    if scores is not None:
        np.testing.assert_allclose(scores, ref[got], rtol=0, atol=tol + 1e-6)


def test_time_weighted_retriever_against_langchains(
    store: KalosVectorStore, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the definitions agree, Kalos's time-weighted retriever answers as LangChain's
    ``TimeWeightedVectorStoreRetriever``: relevance = the raw cosine similarity (a vector store
    whose relevance function is the identity), every document a candidate (``search_kwargs k``
    >= the documents), ``last_accessed_at`` = the last write (LangChain's refresh on retrieval
    undone after each query), and its clock set to when the sidecar served ours (the middle of
    the call; tolerance: how far the decay moves during it). Both against float64 too."""
    twr = pytest.importorskip("langchain_classic.retrievers.time_weighted_retriever")
    from langchain_core.vectorstores import InMemoryVectorStore

    class CosineRelevance(InMemoryVectorStore):  # its scores are cosine similarities
        def _select_relevance_score_fn(self) -> Callable[[float], float]:
            return lambda s: s

    class Clock(datetime.datetime):
        at = 0.0

        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.datetime.fromtimestamp(cls.at, tz)

    monkeypatch.setattr(twr, "datetime", types.SimpleNamespace(datetime=Clock, timedelta=datetime.timedelta))
    n, k = 60, 5
    texts, vecs, metas, times = write_in_rounds(store, rng, n)
    updated = np.array([times[t][1] for t in texts])
    assert updated.max() - updated.min() > 0.6  # the rounds really are apart
    lc = twr.TimeWeightedVectorStoreRetriever(
        vectorstore=CosineRelevance(TableEmbeddings(table_of(store))),
        decay_rate=FAST_DECAY,
        k=k,
        search_kwargs={"k": n},
    )
    lc.add_documents(
        [
            Document(page_content=t, metadata={**m, "created_at": times[t][0], "last_accessed_at": times[t][1]})
            for t, m in zip(texts, metas)
        ]
    )
    ours = store.as_time_weighted_retriever(decay_rate=FAST_DECAY, k=k)
    row = {t: i for i, t in enumerate(texts)}
    reordered = 0
    for j in range(12):
        q = query_near(rng, vecs, j)
        table_of(store)[f"q{j}"] = q.astype(np.float32)
        t0 = time.time()
        got = ours.invoke(f"q{j}")
        t1 = time.time()
        Clock.at = (t0 + t1) / 2
        want = lc.invoke(f"q{j}")
        for d in lc.memory_stream:  # undo LangChain's refresh of last_accessed_at
            d.metadata["last_accessed_at"] = times[d.page_content][1]
        ref = langchain_score(q, vecs, updated, Clock.at, FAST_DECAY)
        tol = drift(t0, t1, -math.log1p(-FAST_DECAY) / 3600.0)
        check_ranked(ref, [row[d.page_content] for d in got], None, k, tol)
        check_ranked(ref, [row[d.page_content] for d in want], None, k, tol)  # (the reference itself)
        for a, b in zip(got, want):
            assert a.page_content == b.page_content or abs(ref[row[a.page_content]] - ref[row[b.page_content]]) <= tol
        for d in got:
            meta = {key: v for key, v in d.metadata.items() if not key.startswith("kalos_")}
            assert meta == metas[row[d.page_content]]
            assert (d.metadata["kalos_created_at"], d.metadata["kalos_updated_at"]) == times[d.page_content]
        similarity_only = np.argsort(-cosines(q, vecs))[:k]
        reordered += [row[d.page_content] for d in got] != similarity_only.tolist()
    assert reordered >= 3  # recency changed the answer, not only the scores


@pytest.mark.asyncio
async def test_recency_search_exact_against_float64(astore: KalosVectorStore, rng: np.random.Generator) -> None:
    """similarity_search_with_recency (async) with a weight and a filter: the exact top-k of
    every matching document by similarity + weight * 0.5 ** (age / half_life), with that score;
    writing a document again makes it recent (its created_at kept)."""
    from kalos import Recency

    texts, vecs, metas, times = write_in_rounds(astore, rng, 48, rounds=3)
    updated = np.array([times[t][1] for t in texts])
    recency = Recency(half_life=0.5, weight=0.3)
    cats = np.array([m["cat"] for m in metas])
    for j in range(8):
        q = query_near(rng, vecs, j)
        table_of(astore)[f"q{j}"] = q
        filt = None if j % 2 else {"cat": {"$in": ["a", "b"]}}
        t0 = time.time()
        got = await astore.asimilarity_search_with_recency(f"q{j}", 6, recency=recency, filter=filt)
        t1 = time.time()
        ref = kalos_score(q, vecs, updated, (t0 + t1) / 2, recency.half_life, recency.weight)
        if filt is not None:
            ref = np.where(np.isin(cats, ["a", "b"]), ref, -np.inf)
        rows = [texts.index(d.page_content) for d, _ in got]
        check_ranked(ref, rows, [s for _, s in got], 6, drift(t0, t1, recency.weight * math.log(2) / recency.half_life))
    oldest = texts[int(np.argmin(updated))]
    await astore.aadd_texts([oldest], [metas[texts.index(oldest)]], ids=[oldest])
    [(doc, _)] = await astore.asimilarity_search_with_recency("q0", 1, recency=Recency(half_life=1.0, weight=100.0))
    assert doc.page_content == oldest  # the freshest now, by far
    assert doc.metadata["kalos_created_at"] == times[oldest][0] and doc.metadata["kalos_updated_at"] > times[oldest][1]
    retriever = astore.as_time_weighted_retriever(decay_rate=0.5, k=3, filter={"cat": "c"})
    docs = await retriever.ainvoke("q1")
    assert len(docs) == 3 and all(d.metadata["cat"] == "c" and "kalos_updated_at" in d.metadata for d in docs)


def test_time_weighted_retriever_refusals(store: KalosVectorStore) -> None:
    from pydantic import ValidationError

    for rate in (0.0, 1.0, -0.5, 2.0):
        with pytest.raises(ValidationError, match="decay_rate"):
            store.as_time_weighted_retriever(decay_rate=rate)
    with pytest.raises(ValidationError, match="search_kwargs"):
        KalosTimeWeightedRetriever(vectorstore=store, search_kwargs={"fetch_k": 3})
    with pytest.raises(ValidationError, match="not"):
        store.as_time_weighted_retriever(filter={"cat": {"$not": "a"}})
    r = KalosTimeWeightedRetriever(vectorstore=store, search_kwargs={"k": 100})  # LangChain's k: ignored
    assert r.recency.half_life == pytest.approx(3600 * math.log(0.5) / math.log(0.99))
    with pytest.raises(InvalidRequest, match="current_time"):
        r.add_documents([Document(page_content="x")], current_time=None)
    table_of(store)["anything"] = np.ones(DIM)
    assert r.invoke("anything") == []  # an empty store: no namespace yet
    with pytest.raises(InvalidRequest, match="Recency"):
        store.similarity_search_with_recency("x", recency=0.5)  # type: ignore[arg-type]
