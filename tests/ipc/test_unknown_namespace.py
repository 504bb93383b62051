"""Issue 33, item 14: a namespace that was never written, or was dropped, holds no memory, and
reading it is no error. Against a real sidecar, on both drivers (RecallPool and RecallClient):
recall and recall_many (plain, filtered, recency-ranked, with payloads, with timestamps), get,
count and export answer empty, as LangGraph's store and mem0 answer for a user with no memories
yet (a service with a namespace per user meets this on every new user's first turn); reading
creates nothing, a fresh sidecar lists no namespace, and dropping one (``default`` too) leaves
none behind. The LangChain, LangGraph and LlamaIndex stores return nothing for a new user."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest

from kalos.broker.clock import Recency
from kalos.clients import Hits, RecallClient, RecallPool, Records

pytestmark = pytest.mark.timeout(120)

DIM = 8
WHERE = {"user": "u1"}
RECENCY = Recency(half_life=60.0, weight=0.5)

#: A driver's call by method name: awaited on a pool, called on a blocking client.
Call = Callable[..., Awaitable[Any]]


@pytest.fixture
def fresh(sidecar_factory):
    """An empty sidecar (cosine, so the stores of every integration can use it too)."""
    return sidecar_factory(
        "unk", "--dim", str(DIM), "--metric", "cosine", "--max-k", "16", "--max-queries", "4", "--backend", "numpy"
    )


@pytest.fixture(params=["pool", "client"])
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def on_pool(pool: RecallPool) -> Call:
    async def call(method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(pool, method)(*args, **kwargs)

    return call


def on_client(client: RecallClient) -> Call:
    async def call(method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(client, method)(*args, **kwargs)

    return call


class Opened:
    """``async with Opened(driver, name) as call``: a pool or a blocking client, as ``call``."""

    def __init__(self, driver: str, name: str) -> None:
        self.driver, self.name = driver, name
        self._pool: RecallPool | None = None
        self._client: RecallClient | None = None

    async def __aenter__(self) -> Call:
        if self.driver == "pool":
            self._pool = await RecallPool(self.name, size=2, timeout=30).open()
            return on_pool(self._pool)
        self._client = RecallClient(self.name, timeout=30)
        return on_client(self._client)

    async def __aexit__(self, *exc: object) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._client is not None:
            self._client.close()


def assert_no_hits(h: Any, *, payloads: bool = False, times: bool = False, recency: bool = False) -> None:
    """An OK answer without hits, of the shape a recall with those options answers."""
    assert isinstance(h, Hits), h
    assert len(h) == 0 and list(h) == []
    assert h.ids.dtype == np.int64 and h.ids.shape == (0,) and h.scores.shape == (0,)
    if payloads:
        assert h.payloads == []
    if times:
        for stamps in (h.created_at, h.updated_at, h.expires_at):
            assert stamps is not None and len(stamps) == 0
    if recency:
        assert h.recency is not None and len(h.recency) == 0


def assert_no_records(r: Any, asked: Sequence[int], *, vectors: bool = True) -> None:
    """A get answer in which none of ``asked`` exists (all missing, in the order asked)."""
    assert isinstance(r, Records), r
    assert r.ids.tolist() == [] and r.missing.tolist() == list(asked) and r.payloads == []
    if vectors:
        assert r.vectors is not None and r.vectors.shape == (0, DIM)
    else:
        assert r.vectors is None


async def assert_reads_empty(call: Call, ns: str) -> None:
    """Every read of ``ns`` answers empty, with the shape its options ask for, and none fails."""
    q = np.ones(DIM, np.float32)
    qs = np.ones((3, DIM), np.float32)
    assert_no_hits(await call("recall", q, 5, namespace=ns))
    assert_no_hits(await call("recall", q, 16, namespace=ns, with_payload=True), payloads=True, times=True)
    assert_no_hits(await call("recall", q, 5, namespace=ns, with_times=True), times=True)
    assert_no_hits(await call("recall", q, 5, namespace=ns, where=WHERE))
    assert_no_hits(await call("recall", q, 5, namespace=ns, recency=RECENCY), times=True, recency=True)
    got = await call("recall", q, 5, namespace=ns, where=WHERE, recency=RECENCY, with_payload=True)
    assert_no_hits(got, payloads=True, times=True, recency=True)
    assert_no_hits(await call("recall", q, 5, namespace=ns, refresh_ttl=True))  # (nothing to touch)
    for kw in ({}, {"with_payload": True}, {"where": WHERE}, {"recency": RECENCY}, {"with_times": True}):
        many = await call("recall_many", qs, 4, namespace=ns, **kw)
        assert len(many) == 3, kw
        for h in many:
            assert_no_hits(h, payloads="with_payload" in kw)
    assert_no_records(await call("get", [3, 1, 2], namespace=ns), [3, 1, 2])
    assert_no_records(await call("get", list(range(10)), namespace=ns, with_vectors=False), range(10), vectors=False)
    assert await call("count", ns) == 0
    assert await call("count", ns, WHERE) == 0
    for kw in ({}, {"where": WHERE}):
        ids, vectors, payloads = await call("export_page", ns, **kw)
        assert ids.tolist() == [] and vectors.shape == (0, DIM) and payloads == []
    # Writes already took an absent namespace as empty: nothing to delete or touch there.
    assert await call("delete", [1, 2], namespace=ns) == 0
    assert await call("delete", where=WHERE, namespace=ns) == 0
    assert await call("touch", [1], namespace=ns) == 0


@pytest.mark.asyncio
async def test_a_fresh_sidecar_lists_no_namespace_and_every_read_answers_empty(fresh, driver):
    async with Opened(driver, fresh.name) as call:
        assert await call("namespaces") == {}  # no empty "default" that nobody wrote
        for ns in ("default", "user-new"):  # the namespace a call names by default, and a new user's
            await assert_reads_empty(call, ns)
        assert await call("namespaces") == {}  # reading a namespace does not create it


@pytest.mark.asyncio
async def test_a_dropped_namespace_reads_as_one_never_written(fresh, driver, rng):
    vecs = rng.standard_normal((6, DIM)).astype(np.float32)
    async with Opened(driver, fresh.name) as call:
        for ns in ("gone", "default"):
            assert await call("upsert", np.arange(6), vecs, [WHERE] * 6, namespace=ns) == 6
            hits = await call("recall", vecs[0], 3, namespace=ns, where=WHERE, with_payload=True)
            assert len(hits) == 3 and hits.payloads == [WHERE] * 3
        assert await call("namespaces") == {"default": 6, "gone": 6}
        assert await call("drop_namespace", "gone") == 6
        assert await call("drop_namespace", "default") == 6
        assert await call("namespaces") == {}  # "default" is not made again
        for ns in ("gone", "default"):
            await assert_reads_empty(call, ns)
        assert await call("drop_namespace", "gone") == 0
        assert await call("namespaces") == {}
        # Written again, it holds what was written since, and nothing from before the drop.
        assert await call("upsert", [9], vecs[:1], [{"again": True}], namespace="gone") == 1
        got = await call("get", [0, 9], namespace="gone")
        assert got.ids.tolist() == [9] and got.missing.tolist() == [0] and got.payloads == [{"again": True}]
        assert await call("namespaces") == {"gone": 1}


def test_export_of_a_namespace_never_written_is_empty(fresh, tmp_path):
    from kalos.transfer import export_namespace

    out = tmp_path / "out"
    with open(os.devnull, "w") as quiet:
        assert export_namespace(fresh.name, "user-new", str(out), progress=quiet) == 0
    assert np.load(out / "vectors.npy").shape == (0, DIM) and np.load(out / "ids.npy").shape == (0,)
    assert (out / "payloads.jsonl").read_text() == ""
    with RecallClient(fresh.name) as c:
        assert c.namespaces() == {}


# --------------------------------------------------------------------------- the integrations


def embed_one(text: str) -> list[float]:
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(DIM).tolist()


@pytest.mark.asyncio
async def test_langchain_store_of_a_new_user_returns_no_documents(fresh):
    pytest.importorskip("langchain_core")
    from langchain_core.embeddings import DeterministicFakeEmbedding

    from kalos.integrations.langchain import KalosVectorStore

    emb = DeterministicFakeEmbedding(size=DIM)
    old = KalosVectorStore(emb, name=fresh.name, namespace="user-old")
    new = KalosVectorStore(emb, name=fresh.name, namespace="user-new")
    try:
        old.add_texts(["tea at noon", "rain all day"], [{"user": "u1"}, {"user": "u1"}], ids=["a", "b"])
        assert len(old.similarity_search("tea", k=2)) == 2
        for store in (new, old):
            if store is old:
                old.delete()  # dropped: as a new user's
            assert store.similarity_search("tea", k=4) == []
            assert store.similarity_search_with_score("tea", k=4, filter={"user": "u1"}) == []
            assert store.similarity_search_with_recency("tea", k=4, recency=RECENCY) == []
            assert store.max_marginal_relevance_search("tea", k=2, fetch_k=8) == []
            assert store.get_by_ids(["a", "b"]) == []
            assert await store.asimilarity_search("tea", k=4) == []
            assert await store.asimilarity_search_with_recency("tea", k=4, recency=RECENCY) == []
            assert await store.amax_marginal_relevance_search("tea", k=2, fetch_k=8) == []
            assert await store.aget_by_ids(["a"]) == []
            assert store.as_time_weighted_retriever(k=4).invoke("tea") == []
        with RecallClient(fresh.name) as c:
            assert c.namespaces() == {}  # searching created nothing
        # The new user's first write lands, and is found.
        assert new.add_texts(["coffee"], ids=["c"]) == ["c"]
        assert [d.id for d in new.similarity_search("coffee", k=4)] == ["c"]
    finally:
        await old.aclose()
        await new.aclose()


@pytest.mark.asyncio
async def test_langgraph_store_of_a_new_user_returns_no_items(fresh):
    pytest.importorskip("langgraph.store.base")
    from kalos.integrations.langgraph import KalosStore

    index = {"dims": DIM, "embed": lambda texts: [embed_one(t) for t in texts]}
    user = ("users", "u-new", "memories")
    # A store whose Kalos namespaces were never written, then one that holds another user's.
    with KalosStore(fresh.name, namespace="lg", index=index) as store:
        for _ in range(2):
            assert store.search(user) == []
            assert store.search(user, query="what do I like?") == []
            assert store.search(user, query="what do I like?", filter={"kind": "food"}) == []
            assert store.get(user, "likes") is None
            assert store.list_namespaces(prefix=("users", "u-new")) == []
            assert await store.asearch(user, query="what do I like?") == []
            assert await store.aget(user, "likes") is None
            store.put(("users", "u-old", "memories"), "likes", {"text": "tea", "kind": "food"})
        assert store.list_namespaces() == [("users", "u-old", "memories")]
        store.put(user, "likes", {"text": "coffee", "kind": "food"})
        got = store.get(user, "likes")
        assert got is not None and got.value == {"text": "coffee", "kind": "food"}
        assert [i.key for i in store.search(user, query="coffee")] == ["likes"]
        await store.aclose()


@pytest.mark.asyncio
async def test_llamaindex_store_of_a_new_user_returns_no_nodes(fresh):
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters, VectorStoreQuery

    from kalos.integrations.llamaindex import KalosLlamaVectorStore

    q = embed_one("tea")
    store = KalosLlamaVectorStore(fresh.name, namespace="user-new", timeout=10.0)
    try:
        for filters in (
            None,
            MetadataFilters(filters=[MetadataFilter(key="user", value="u1", operator=FilterOperator.EQ)]),
        ):
            query = VectorStoreQuery(query_embedding=q, similarity_top_k=4, filters=filters)
            for got in (store.query(query), await store.aquery(query)):
                assert got.ids == [] and got.nodes == [] and got.similarities == []
        assert store.get_nodes(node_ids=["n1"]) == []
        assert await store.aget_nodes(node_ids=["n1"]) == []
        store.delete("doc-1")  # nothing to delete: no error either
        assert store.client.namespaces() == {}
        store.add([TextNode(text="tea", id_="n1", embedding=q, metadata={"user": "u1"})])
        got = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=4))
        assert got.ids == ["n1"]
        store.clear()
        assert store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=4)).ids == []
    finally:
        await store.aclose()
