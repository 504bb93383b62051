"""The LangChain adapter (kalos.integrations.langchain) against a real sidecar: LangChain's own
standard suite (sync and async, unmodified), then ours: the id mapping and collisions, filters
checked against a numpy float64 reference on random data, MMR, relevance scores, the retriever.

One sidecar per module (started as tests/conftest.py starts them: same harness, backend and
shards from the environment); every test gets a fresh namespace, so every store starts empty.
"""

from __future__ import annotations

import hashlib
import itertools
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
    KalosVectorStore,
    kalos_id,
    mmr_select,
    to_where,
)
from kalos.sidecar_cuda.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

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
    proc = start_sidecar_process(args, name, timeout=60)
    try:
        yield name
    finally:
        stop_sidecar_process(proc)
        try:
            cleanup(name, force=True)
        except Exception:
            pass


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
async def test_mmr_search_async(astore: KalosVectorStore, rng: np.random.Generator) -> None:
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
