"""The LlamaIndex vector store on real sidecars: VectorStoreIndex end to end with a deterministic
embedding, and the same data, queries and filters differentially against LlamaIndex's own
SimpleVectorStore (same node ids in the same order, cosine scores within 1e-5)."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core", reason="the llamaindex extra is not installed")

from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import (
    Document,
    MetadataMode,
    NodeRelationship,
    RelatedNodeInfo,
    TextNode,
)
from llama_index.core.vector_stores import SimpleVectorStore
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)

import kalos.integrations.llamaindex as kli
from kalos.integrations.llamaindex import (
    CREATED_AT_KEY,
    UPDATED_AT_KEY,
    IdCollision,
    KalosLlamaVectorStore,
    UnsupportedQuery,
    kalos_id,
    to_where,
)

DIM = 16
F, OP, C = MetadataFilter, FilterOperator, FilterCondition


class HashEmbedding(BaseEmbedding):
    """Deterministic bag of words: each word adds +-1 to a bucket picked by its hash, so texts
    sharing words point the same way (llama_index's MockEmbedding is a constant)."""

    dim: int = DIM

    def _vec(self, text: str) -> list[float]:
        v = np.zeros(self.dim)
        for word in re.findall(r"\w+", text.lower()):
            h = hashlib.blake2b(word.encode(), digest_size=8).digest()
            v[int.from_bytes(h[:4], "little") % self.dim] += 1.0 if h[4] & 1 else -1.0
        return v.tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vec(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vec(query)


@pytest.fixture
def broker(sidecar_factory):
    return sidecar_factory(
        "llama", "--dim", str(DIM), "--max-k", "64", "--max-queries", "8", "--slots", "16", "--backend", "numpy"
    )


@pytest.fixture
def store(broker):
    s = KalosLlamaVectorStore(broker.name, namespace="li", timeout=10.0)
    yield s
    s.close()


def random_nodes(rng: np.random.Generator, n: int, dim: int = DIM, docs: int = 7) -> list[TextNode]:
    """Nodes with random embeddings and metadata of every kind the filters meet: a string key
    that is sometimes missing, None or "", ints, floats (integral ones too), a constant."""
    nodes = []
    for i in range(n):
        meta: dict[str, Any] = {
            "rank": int(rng.integers(0, 10)),
            "weight": float(rng.choice([0.5, 1.0, 1.5, 2.0])),
            "lang": str(rng.choice(["en", "fr"])),
        }
        r = rng.random()
        if r < 0.1:
            pass  # no color
        elif r < 0.15:
            meta["color"] = None
        elif r < 0.2:
            meta["color"] = ""
        else:
            meta["color"] = str(rng.choice(["red", "green", "blue"]))
        node = TextNode(
            text=f"node {i} text", id_=f"node-{i}", metadata=meta, embedding=rng.standard_normal(dim).tolist()
        )
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=f"doc-{i % docs}")
        nodes.append(node)
    return nodes


def simple_store(nodes: list[TextNode]) -> SimpleVectorStore:
    s = SimpleVectorStore()
    s.add(nodes)
    return s


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def without_times(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if k not in (CREATED_AT_KEY, UPDATED_AT_KEY)}


def assert_times_are_the_records(nodes: Any, client: Any, namespace: str) -> None:
    """Each node's kalos_created_at / kalos_updated_at are its record's (seconds since the
    epoch, read by the client), kept out of the text for embeddings and LLMs."""
    assert nodes
    for n in nodes:  # (one by one: large payloads)
        rec = client.get([kalos_id(n.node_id)], namespace=namespace, with_vectors=False)
        assert rec.missing.size == 0
        created, updated = float(rec.created_at[0]), float(rec.updated_at[0])
        assert (n.metadata[CREATED_AT_KEY], n.metadata[UPDATED_AT_KEY]) == (created, updated)
        assert isinstance(created, float) and 1.7e9 < created <= updated
        assert CREATED_AT_KEY in n.excluded_llm_metadata_keys and UPDATED_AT_KEY in n.excluded_embed_metadata_keys


def assert_same_result(
    got: VectorStoreQueryResult,
    want: VectorStoreQueryResult,
    emb: dict[str, list[float]],
    q: list[float],
    atol: float = 1e-5,
) -> None:
    """Same ids in the same order and scores within ``atol``; two ids may swap only where the
    reference scores them within ``atol`` of each other (a tie at float32 precision)."""
    assert got.ids is not None and want.ids is not None
    assert got.similarities is not None and want.similarities is not None
    assert len(got.ids) == len(want.ids), (got.ids, want.ids)
    np.testing.assert_allclose(got.similarities, want.similarities, atol=atol)
    if got.ids != want.ids:
        assert set(got.ids) <= set(emb)
        exact = [cosine(emb[i], q) for i in got.ids]
        np.testing.assert_allclose(
            exact, want.similarities, atol=atol, err_msg=f"order differs beyond ties: {got.ids} vs {want.ids}"
        )
    assert got.nodes is not None and [n.node_id for n in got.nodes] == got.ids


FILTER_CASES: dict[str, MetadataFilters] = {
    "eq-str": MetadataFilters(filters=[F(key="color", value="red")]),
    "eq-int": MetadataFilters(filters=[F(key="rank", value=3, operator=OP.EQ)]),
    "eq-int-vs-float": MetadataFilters(filters=[F(key="weight", value=2)]),
    "ne": MetadataFilters(filters=[F(key="color", value="red", operator=OP.NE)]),
    "ne-missing-key": MetadataFilters(filters=[F(key="absent", value=1, operator=OP.NE)]),
    "in-str": MetadataFilters(filters=[F(key="color", value=["red", "blue"], operator=OP.IN)]),
    "in-int": MetadataFilters(filters=[F(key="rank", value=[1, 2, 3], operator=OP.IN)]),
    "nin": MetadataFilters(filters=[F(key="color", value=["red"], operator=OP.NIN)]),
    "gt": MetadataFilters(filters=[F(key="rank", value=5, operator=OP.GT)]),
    "gte-float": MetadataFilters(filters=[F(key="weight", value=1.5, operator=OP.GTE)]),
    "lt": MetadataFilters(filters=[F(key="rank", value=2, operator=OP.LT)]),
    "lte": MetadataFilters(filters=[F(key="weight", value=1.0, operator=OP.LTE)]),
    "is-empty": MetadataFilters(filters=[F(key="color", value=None, operator=OP.IS_EMPTY)]),
    "and": MetadataFilters(filters=[F(key="color", value="red"), F(key="rank", value=4, operator=OP.GTE)]),
    "and-3": MetadataFilters(
        filters=[
            F(key="color", value="blue", operator=OP.NE),
            F(key="lang", value=["en"], operator=OP.IN),
            F(key="weight", value=2.0, operator=OP.LT),
        ],
        condition=C.AND,
    ),
    "or": MetadataFilters(
        filters=[F(key="color", value="green"), F(key="rank", value=1, operator=OP.LT)], condition=C.OR
    ),
    "ref-doc-id": MetadataFilters(filters=[F(key="ref_doc_id", value=["doc-1", "doc-4"], operator=OP.IN)]),
    "matches-nothing": MetadataFilters(filters=[F(key="color", value="purple")]),
}


def test_differential_filters(store, rng):
    """Every supported operator and condition: Kalos and SimpleVectorStore agree on ids, order
    and scores, for k below and above the number of matches."""
    nodes = random_nodes(rng, 300)
    emb = {n.node_id: n.get_embedding() for n in nodes}
    assert store.add(nodes) == [n.node_id for n in nodes]
    ref = simple_store(nodes)
    for name, filters in FILTER_CASES.items():
        for k in (5, 64):
            q = rng.standard_normal(DIM).tolist()
            vq = VectorStoreQuery(query_embedding=q, similarity_top_k=k, filters=filters)
            got, want = store.query(vq), ref.query(vq)
            try:
                assert_same_result(got, want, emb, q)
            except AssertionError as e:
                raise AssertionError(f"filter case {name!r}, k={k}: {e}") from None
            assert got.nodes is not None
            if name == "eq-str":  # the filter really filtered
                assert got.nodes and all(n.metadata["color"] == "red" for n in got.nodes)
    # no filter, and node_ids restrictions (SimpleVectorStore's own)
    q = rng.standard_normal(DIM).tolist()
    for vq in (
        VectorStoreQuery(query_embedding=q, similarity_top_k=10),
        VectorStoreQuery(query_embedding=q, similarity_top_k=10, node_ids=[f"node-{i}" for i in range(0, 300, 3)]),
    ):
        assert_same_result(store.query(vq), ref.query(vq), emb, q)
    # node_ids=[] restricts nothing: VectorStoreIndex.as_retriever passes its index struct's
    # node ids, empty for a store that keeps the text (SimpleVectorStore does not keep it)
    vq = VectorStoreQuery(query_embedding=q, similarity_top_k=10, node_ids=[], filters=FILTER_CASES["eq-str"])
    assert_same_result(
        store.query(vq),
        ref.query(VectorStoreQuery(query_embedding=q, similarity_top_k=10, filters=FILTER_CASES["eq-str"])),
        emb,
        q,
    )


def test_nested_filters_and_doc_ids(store, rng):
    """Nested MetadataFilters and doc_ids (which SimpleVectorStore does not serve) against a
    brute-force reference."""
    nodes = random_nodes(rng, 200)
    store.add(nodes)
    nested = MetadataFilters(
        condition=C.OR,
        filters=[
            MetadataFilters(filters=[F(key="color", value="red"), F(key="rank", value=5, operator=OP.GT)]),
            MetadataFilters(filters=[F(key="lang", value="fr"), F(key="weight", value=1.0, operator=OP.LTE)]),
        ],
    )

    def keep(n: TextNode) -> bool:
        m = n.metadata
        return (
            (m.get("color") == "red" and m["rank"] > 5) or (m["lang"] == "fr" and m["weight"] <= 1.0)
        ) and n.ref_doc_id in ("doc-2", "doc-3", "doc-5")

    q = rng.standard_normal(DIM).tolist()
    got = store.query(
        VectorStoreQuery(query_embedding=q, similarity_top_k=64, filters=nested, doc_ids=["doc-2", "doc-3", "doc-5"])
    )
    ranked = sorted(((cosine(n.get_embedding(), q), n.node_id) for n in nodes if keep(n)), reverse=True)
    assert got.ids == [i for _, i in ranked]
    np.testing.assert_allclose(got.similarities, [s for s, _ in ranked], atol=1e-5)
    assert to_where(nested) == {"$or": [{"color": "red", "rank": {"$gt": 5}}, {"lang": "fr", "weight": {"$lte": 1.0}}]}


def test_delete_get_and_update(store, rng):
    """delete(ref_doc_id) as SimpleVectorStore does it; delete_nodes, get_nodes; adding a node
    again replaces it; the nodes come back whole."""
    nodes = random_nodes(rng, 120)
    emb = {n.node_id: n.get_embedding() for n in nodes}
    store.add(nodes)
    ref = simple_store(nodes)
    c = store.client
    assert c.count("li") == 120
    store.delete("doc-3")
    ref.delete("doc-3")
    assert c.count("li") == 120 - sum(n.ref_doc_id == "doc-3" for n in nodes)
    assert c.count("li", where={"ref_doc_id": "doc-3"}) == 0
    q = rng.standard_normal(DIM).tolist()
    for filters in (None, FILTER_CASES["or"]):
        vq = VectorStoreQuery(query_embedding=q, similarity_top_k=64, filters=filters)
        assert_same_result(store.query(vq), ref.query(vq), emb, q)

    store.delete_nodes(["node-0", "node-1", "node-2"])
    ref.delete_nodes(["node-0", "node-1", "node-2"])
    store.delete_nodes(filters=FILTER_CASES["gt"])
    ref.delete_nodes(filters=FILTER_CASES["gt"])
    vq = VectorStoreQuery(query_embedding=q, similarity_top_k=64)
    assert_same_result(store.query(vq), ref.query(vq), emb, q)
    left = {i for i in ref.data.embedding_dict}
    got = store.get_nodes()
    assert {n.node_id for n in got} == left
    by_id = {n.node_id: n for n in nodes}
    for n in got:  # text, metadata, relationships as they went in, and the record's timestamps
        assert n.get_content() == by_id[n.node_id].get_content()
        assert without_times(n.metadata) == by_id[n.node_id].metadata
        assert n.ref_doc_id == by_id[n.node_id].ref_doc_id
    assert_times_are_the_records(got, c, "li")
    some = sorted(left)[:5]
    assert {n.node_id for n in store.get_nodes(some)} == set(some)
    assert {n.node_id for n in store.get_nodes(filters=FILTER_CASES["eq-str"])} == {
        i for i in left if by_id[i].metadata.get("color") == "red"
    }

    # adding a node again replaces it in place (same Kalos id, one record)
    n0 = by_id[some[0]].model_copy()
    n0.text, n0.metadata = "rewritten", {**n0.metadata, "rank": 99}
    before = c.count("li")
    store.add([n0])
    assert c.count("li") == before
    [back] = store.get_nodes([n0.node_id])
    assert back.get_content() == "rewritten" and back.metadata["rank"] == 99
    old = next(n for n in got if n.node_id == n0.node_id)
    assert back.metadata[CREATED_AT_KEY] == old.metadata[CREATED_AT_KEY]
    assert back.metadata[UPDATED_AT_KEY] > old.metadata[UPDATED_AT_KEY]
    # a node read back and added again does not store the timestamps it was given
    back.metadata["rank"], back.embedding = 100, n0.embedding
    store.add([back])
    [payload] = c.get([kalos_id(n0.node_id)], namespace="li").payloads
    assert payload["rank"] == 100 and not any(k.startswith("kalos_") for k in payload)
    assert "kalos_" not in payload["_node_content"]
    store.clear()
    assert store.query(vq).ids == []


def test_vector_store_index_end_to_end(broker):
    """VectorStoreIndex over the Kalos store and over SimpleVectorStore, same nodes and
    embedding: the same retrievals; filters, delete_ref_doc, insert and a query engine."""
    emb = HashEmbedding()
    docs = [
        Document(text=t, id_=f"d{i}", metadata={"topic": topic, "year": year})
        for i, (t, topic, year) in enumerate(
            [
                ("The user likes green tea in the morning.", "drinks", 2021),
                ("Coffee keeps the team awake during releases.", "drinks", 2023),
                ("The sidecar serves exact top-k recall over shared memory.", "kalos", 2024),
                ("Shared memory slots carry requests and responses.", "kalos", 2025),
                ("Black tea with milk is a British habit.", "drinks", 2019),
                ("Release notes list every change to the protocol.", "kalos", 2022),
            ]
        )
    ]
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=0).get_nodes_from_documents(docs)
    store = KalosLlamaVectorStore(broker.name, namespace="e2e", timeout=10.0)
    try:
        index = VectorStoreIndex(
            nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=emb
        )
        ref = VectorStoreIndex(
            nodes, storage_context=StorageContext.from_defaults(vector_store=SimpleVectorStore()), embed_model=emb
        )
        for text in ("green tea", "shared memory", "release protocol", "coffee"):
            for filters in (
                None,
                MetadataFilters(filters=[F(key="topic", value="drinks"), F(key="year", value=2020, operator=OP.GTE)]),
            ):
                got = index.as_retriever(similarity_top_k=3, filters=filters).retrieve(text)
                want = ref.as_retriever(similarity_top_k=3, filters=filters).retrieve(text)
                assert [n.node_id for n in got] == [n.node_id for n in want], text
                np.testing.assert_allclose([n.score for n in got], [n.score for n in want], atol=1e-5)
        top = index.as_retriever(similarity_top_k=1).retrieve("green tea")[0].node
        assert top.get_content() == docs[0].text and top.ref_doc_id == "d0"
        assert without_times(top.metadata) == {"topic": "drinks", "year": 2021}
        for mode in (MetadataMode.LLM, MetadataMode.EMBED):  # the timestamps stay out of prompts
            assert top.get_content(mode) == ref.as_retriever(similarity_top_k=1).retrieve("green tea")[
                0
            ].node.get_content(mode)
            assert "kalos_" not in top.get_content(mode) and "topic: drinks" in top.get_content(mode)

        index.delete_ref_doc("d0")
        hits = index.as_retriever(similarity_top_k=6).retrieve("green tea")
        assert "d0" not in {h.node.ref_doc_id for h in hits} and len(hits) == 5
        index.insert(docs[0])
        assert index.as_retriever(similarity_top_k=1).retrieve("green tea")[0].node.ref_doc_id == "d0"

        response = index.as_query_engine(llm=MockLLM(max_tokens=4), similarity_top_k=2).query("tea")
        assert len(response.source_nodes) == 2
        assert all("tea" in s.node.get_content().lower() for s in response.source_nodes)
    finally:
        store.close()


@pytest.mark.asyncio
async def test_async_end_to_end(broker, seed):
    """async_add / aquery / adelete / adelete_nodes / aget_nodes against SimpleVectorStore, and
    VectorStoreIndex's async paths (ainsert_nodes, aretrieve, adelete_ref_doc)."""
    rng = np.random.default_rng(seed)
    nodes = random_nodes(rng, 150)
    emb = {n.node_id: n.get_embedding() for n in nodes}
    store = KalosLlamaVectorStore(broker.name, namespace="async", timeout=10.0)
    try:
        assert await store.async_add(nodes) == [n.node_id for n in nodes]
        ref = simple_store(nodes)
        for name in ("eq-str", "in-int", "gte-float", "and", "or", "nin"):
            q = rng.standard_normal(DIM).tolist()
            vq = VectorStoreQuery(query_embedding=q, similarity_top_k=20, filters=FILTER_CASES[name])
            assert_same_result(await store.aquery(vq), ref.query(vq), emb, q)
        await store.adelete("doc-2")
        ref.delete("doc-2")
        await store.adelete_nodes(["node-10", "node-11"], filters=FILTER_CASES["eq-str"])
        ref.delete_nodes(["node-10", "node-11"], filters=FILTER_CASES["eq-str"])
        q = rng.standard_normal(DIM).tolist()
        vq = VectorStoreQuery(query_embedding=q, similarity_top_k=64)
        results = await asyncio.gather(*(store.aquery(vq) for _ in range(8)))
        for r in results:  # concurrent queries over the pool's slots
            assert_same_result(r, ref.query(vq), emb, q)
        assert {n.node_id for n in await store.aget_nodes()} == set(ref.data.embedding_dict)

        he = HashEmbedding()
        docs = [Document(text="green tea at noon", id_="a"), Document(text="dark roast coffee", id_="b")]
        index = VectorStoreIndex(
            [],
            storage_context=StorageContext.from_defaults(
                vector_store=KalosLlamaVectorStore(broker.name, namespace="async-index", pool=None)
            ),
            embed_model=he,
        )
        vs = index.vector_store
        try:
            await index.ainsert_nodes(SentenceSplitter().get_nodes_from_documents(docs))
            hits = await index.as_retriever(similarity_top_k=1).aretrieve("tea")
            assert hits[0].node.ref_doc_id == "a"
            await index.adelete_ref_doc("a")
            hits = await index.as_retriever(similarity_top_k=2).aretrieve("tea")
            assert [h.node.ref_doc_id for h in hits] == ["b"]
        finally:
            await vs.aclose()
    finally:
        await store.aclose()


def test_large_payloads_split(sidecar_factory, rng):
    """Payloads that overflow one slot: writes are packed per slot, and a recall whose hits'
    payloads do not fit fetches them apart, with the same answer."""
    h = sidecar_factory(
        "llamabig",
        "--dim",
        str(DIM),
        "--max-k",
        "64",
        "--max-queries",
        "8",
        "--blob-bytes",
        "16384",
        "--backend",
        "numpy",
    )
    nodes = random_nodes(rng, 40)
    for n in nodes:
        n.text = f"{n.node_id} " + "lorem ipsum " * 250  # ~3 KB a node: 5 per slot at most
    emb = {n.node_id: n.get_embedding() for n in nodes}
    store = KalosLlamaVectorStore(h.name, namespace="big", timeout=10.0)
    try:
        store.add(nodes)
        assert store.client.count("big") == 40
        ref = simple_store(nodes)
        q = rng.standard_normal(DIM).tolist()
        vq = VectorStoreQuery(query_embedding=q, similarity_top_k=20)
        got = store.query(vq)
        assert_same_result(got, ref.query(vq), emb, q)
        assert got.nodes is not None and all(n.get_content().startswith(n.node_id) for n in got.nodes)
        assert_times_are_the_records(got.nodes, store.client, "big")  # (fetched apart, too)
        store.add(nodes[:10])  # again: the occupancy reads split too
        assert store.client.count("big") == 40
        assert len(store.get_nodes()) == 40
    finally:
        store.close()


def test_id_collisions_never_overwrite(store, rng, monkeypatch):
    """With a hash that sends every node to the same ids, nodes probe on and never overwrite
    one another; a node stays where it was written (no second copy when an earlier id frees
    up); probes run out with IdCollision."""
    monkeypatch.setattr(kli, "kalos_id", lambda node_id, attempt=0: 1000 + attempt)
    nodes = random_nodes(rng, 5)
    store.add(nodes[:2])
    store.add(nodes[2:])  # collide with the stored ones and with each other
    c = store.client
    recs = c.get(list(range(1000, 1005)), namespace="li", with_vectors=False)
    assert [p["_node_id"] for p in recs.payloads] == [n.node_id for n in nodes]
    q = rng.standard_normal(DIM).tolist()
    got = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=5))
    assert sorted(got.ids or []) == sorted(n.node_id for n in nodes)

    store.delete_nodes([nodes[0].node_id])  # frees id 1000
    store.add([nodes[3]])  # still at 1003: found there, not copied to 1000
    assert c.count("li") == 4
    assert c.get([1000], namespace="li").missing.tolist() == [1000]
    assert c.get([1003], namespace="li", with_vectors=False).payloads[0]["_node_id"] == "node-3"

    extra = random_nodes(rng, 12)[5:]  # node-5 .. node-11; within 8 probes only 1000, 1005-1007 are free
    with pytest.raises(IdCollision, match="node-11"):
        store.add(extra)
    assert c.count("li") == 4  # nothing was written


@pytest.mark.parametrize("op", [OP.CONTAINS, OP.ANY, OP.ALL, OP.TEXT_MATCH, OP.TEXT_MATCH_INSENSITIVE])
def test_unsupported_operators_raise(op):
    """Raised before anything is sent: this store names no running sidecar."""
    store = KalosLlamaVectorStore("no-such-sidecar", connect_timeout=0.05)
    value: Any = ["a"] if op in (OP.ANY, OP.ALL) else "a"
    vq = VectorStoreQuery(
        query_embedding=[1.0] * DIM,
        similarity_top_k=3,
        filters=MetadataFilters(filters=[F(key="tags", value=value, operator=op)]),
    )
    with pytest.raises(UnsupportedQuery, match=f"operator {op.name}"):
        store.query(vq)
    with pytest.raises(UnsupportedQuery):
        store.delete_nodes(filters=vq.filters)
    assert not store._conns.opened  # nothing was opened


@pytest.mark.parametrize(
    "bad,match",
    [
        (MetadataFilters(filters=[F(key="a", value=1)], condition=C.NOT), "condition NOT"),
        (MetadataFilters(filters=[F(key="a", value="x", operator=OP.GT)]), "numbers only"),
        (MetadataFilters(filters=[F(key="a", value="x", operator=OP.IN)]), "needs a list"),
        (MetadataFilters(filters=[F(key="a", value=None)]), "needs a string or a number"),
        (MetadataFilters(filters=[F(key="a", value=["x"], operator=OP.NE)]), "needs a string or a number"),
    ],
)
def test_unsupported_filters_raise(bad, match):
    store = KalosLlamaVectorStore("no-such-sidecar", connect_timeout=0.05)
    with pytest.raises(UnsupportedQuery, match=match):
        store.query(VectorStoreQuery(query_embedding=[1.0] * DIM, filters=bad))
    with pytest.raises(ValueError):  # UnsupportedQuery is an InvalidRequest, a ValueError
        to_where(bad)


def test_unsupported_query_modes_raise():
    store = KalosLlamaVectorStore("no-such-sidecar", connect_timeout=0.05)
    with pytest.raises(UnsupportedQuery, match="mmr"):
        store.query(VectorStoreQuery(query_embedding=[1.0] * DIM, mode=VectorStoreQueryMode.MMR))
    with pytest.raises(UnsupportedQuery, match="query_embedding"):
        store.query(VectorStoreQuery(query_str="tea"))


def test_empty_store_and_mapping_details(store):
    q = VectorStoreQuery(query_embedding=[1.0] * DIM, similarity_top_k=3)
    assert store.query(q).ids == []  # no namespace yet: empty, as SimpleVectorStore
    assert store.get_nodes() == []
    store.delete("nothing")
    # deterministic ids, the same in every process and version (pinned)
    assert kalos_id("node-1") == kalos_id("node-1") != kalos_id("node-1", 1)
    assert kalos_id("00000000-0000-0000-0000-000000000000") == 3357814380515466140
    assert 0 <= kalos_id("x", 7) < 2**63
    assert to_where(None) is None and to_where(MetadataFilters(filters=[])) is None
    assert to_where(FILTER_CASES["is-empty"]) == {
        "$or": [{"color": {"$exists": False}}, {"color": None}, {"color": ""}]
    }


@pytest.mark.asyncio
async def test_an_l2_sidecar_is_refused_with_the_reason(sidecar_factory):
    """Scores are promised as cosine similarities (like SimpleVectorStore's): a sidecar started
    with --metric l2 is refused with the reason, sync and async."""
    from kalos import UsageError

    h = sidecar_factory("lil2", "--dim", str(DIM), "--metric", "l2", "--backend", "numpy")
    store = KalosLlamaVectorStore(h.name, namespace="l2", timeout=10.0)
    try:
        node = TextNode(text="x", id_="n1", embedding=[1.0] * DIM)
        with pytest.raises(UsageError, match="--metric cosine or dot.*'l2'"):
            store.add([node])
        with pytest.raises(UsageError, match="'l2'"):
            await store.async_add([node])
    finally:
        store.close()
        await store.aclose()


def test_timestamps_feed_llamaindexs_time_weighted_postprocessor(store, rng):
    """The nodes' ``kalos_updated_at`` is epoch seconds, the form LlamaIndex's own
    TimeWeightedPostprocessor reads (``last_accessed_key``): it reranks the store's answer by
    similarity + (1 - time_decay) ** hours since the last write, as float64 says."""
    import time

    from llama_index.core.postprocessor import TimeWeightedPostprocessor
    from llama_index.core.schema import NodeWithScore

    base = rng.standard_normal(DIM)
    base /= np.linalg.norm(base)
    nodes = random_nodes(rng, 30)
    for n in nodes:  # near one direction: cosines differ about as much as a second's decay
        n.embedding = (base + 0.03 * rng.standard_normal(DIM)).tolist()
    store.add(nodes[:15])
    time.sleep(0.4)
    store.add(nodes[15:])
    emb = {n.node_id: n.get_embedding() for n in nodes}
    reranked = 0
    for _ in range(6):
        q = (base + 0.03 * rng.standard_normal(DIM)).tolist()
        result = store.query(VectorStoreQuery(query_embedding=q, similarity_top_k=30))
        assert result.nodes is not None and result.similarities is not None
        updated = np.array([n.metadata[UPDATED_AT_KEY] for n in result.nodes])
        assert updated.max() - updated.min() > 0.35
        now, decay = float(updated.max()) + 0.2, 1.0 - 2.0**-52  # 1 % per second
        pp = TimeWeightedPostprocessor(
            last_accessed_key=UPDATED_AT_KEY, time_decay=decay, top_k=5, now=now, time_access_refresh=False
        )
        out = pp.postprocess_nodes([NodeWithScore(node=n, score=s) for n, s in zip(result.nodes, result.similarities)])
        combined = {
            n.node_id: cosine(emb[n.node_id], q) + (1.0 - decay) ** ((now - u) / 3600.0)
            for n, u in zip(result.nodes, updated)
        }
        kth = sorted(combined.values(), reverse=True)[4]
        got = [combined[o.node.node_id] for o in out]  # the top 5 (up to float32 ties), best first
        assert len(got) == 5 and min(got) >= kth - 1e-5 and np.all(np.diff(got) <= 1e-5)
        np.testing.assert_allclose([o.score for o in out], got, atol=1e-5)
        reranked += [o.node.node_id for o in out] != result.ids[:5]
    assert reranked >= 1
