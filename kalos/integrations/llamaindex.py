"""LlamaIndex vector store on a Kalos sidecar: :class:`KalosLlamaVectorStore`.

Install with ``pip install 'kalos-recall[llamaindex]'`` (``llama-index-core>=0.12``).

```python
from llama_index.core import StorageContext, VectorStoreIndex
from kalos.integrations.llamaindex import KalosLlamaVectorStore

store = KalosLlamaVectorStore("default", namespace="docs")   # the sidecar's --name
index = VectorStoreIndex.from_documents(
    docs, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=...)
nodes = index.as_retriever(similarity_top_k=5).retrieve("what does the user drink?")
```

How LlamaIndex maps onto Kalos (one namespace per store):

* **Records.** A node becomes one record: its embedding, normalised to unit length, and a payload
  made by LlamaIndex's own ``node_to_metadata_dict`` (the metadata at the top level, where
  ``where=`` filters see it, ``ref_doc_id``/``doc_id``/``document_id``, the node as JSON in
  ``_node_content``) plus the node id in ``_node_id``. Results are rebuilt with
  ``metadata_dict_to_node``: text, metadata and relationships come back as they went in
  (``stores_text=True``).
* **Ids.** The Kalos id of a node is the first 63 bits of ``blake2b(node id)``
  (:func:`kalos_id`); a node may also take ``kalos_id(node_id, 1)``, ``2``, ... (up to
  :data:`MAX_PROBES` ids; the integrations' one id scheme, ``kalos.integrations._ids``): a node
  already stored at one of them is updated in place there, else it takes the first that holds no
  record; a record of another node is never overwritten (all taken: :class:`IdCollision`,
  nothing written). Before writing, the store reads each node's first id, looks the nodes whose
  first id is free up by ``_node_id`` (wherever an earlier collision sent them), and reads the
  other ids only of nodes whose first id holds another record. The check and the write are two
  requests: two writers adding *different* nodes whose ids collide at the same moment could
  still overwrite one another (2^-63 per pair).
* **Scores.** LlamaIndex's ``SimpleVectorStore`` ranks by cosine similarity; Kalos ranks by
  inner product (``--metric dot``) or cosine (``--metric cosine``). Vectors and queries are
  normalised before they are sent, so on either metric the scores are cosine similarities and the
  order is ``SimpleVectorStore``'s (a zero vector stays zero and scores 0). Do not use
  ``--metric l2`` for this store.
* **Filters.** ``MetadataFilters`` become one ``where=`` filter, evaluated exactly by the sidecar
  (:func:`to_where`): EQ, NE, IN, NIN, GT, GTE, LT, LTE, IS_EMPTY, conditions AND and OR, nested
  ``MetadataFilters`` too. Semantics follow ``SimpleVectorStore``: NE and NIN match nodes without
  the key, the others do not. Differences: range operators compare numbers only (a string bound
  raises :class:`UnsupportedQuery`; a string value never matches), ``True`` does not equal ``1``,
  and IS_EMPTY does not see empty lists. CONTAINS, ANY, ALL, TEXT_MATCH,
  TEXT_MATCH_INSENSITIVE and the NOT condition raise :class:`UnsupportedQuery` before anything is
  sent, as do query modes other than DEFAULT.
* **Deletes.** ``delete(ref_doc_id)`` is ``delete(where={"ref_doc_id": ref_doc_id})``;
  ``delete_nodes`` and ``get_nodes`` filter on ``_node_id``.
* **Timestamps.** Every node the store returns (``query``, ``get_nodes``) carries its record's
  timestamps in its metadata: ``kalos_created_at`` (the node's first write) and
  ``kalos_updated_at`` (its last), float seconds since the epoch on the sidecar's clock (the
  form of ``time.time()``, and of the ``last_accessed_key`` LlamaIndex's
  ``TimeWeightedPostprocessor`` reads). Both are listed in the node's
  ``excluded_embed_metadata_keys`` and ``excluded_llm_metadata_keys``, so they reach neither an
  embedding model nor a prompt, and a node added again does not store them. ``query`` reads them
  with the hits; ``get_nodes`` with a second request per ``max_queries`` nodes (export pages
  carry no timestamps).

Each operation is written once, as a plan (``kalos.integrations._plans``) that the synchronous
method runs on one blocking :class:`~kalos.clients.blocking.RecallClient` and its ``a``-twin on a
:class:`~kalos.clients.pool.RecallPool` opened on first use in each event loop. Both are opened
lazily and owned by the store (``close()`` / ``aclose()``), unless given to the constructor. Call
``await store.aclose()`` before the event loop that used it ends (else its pool is terminated on
the store's next use or close).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from kalos.broker.errors import InvalidRequest, PayloadTooLarge
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool
from kalos.clients.results import Hits

from ._core import ConnectedStore, Connections
from ._filters import FieldOp, Where, all_of, any_of, condition, in_chunks, one_of
from ._ids import IdCollision, IdScheme, Probing, claim
from ._plans import (
    CREATED_AT_KEY,
    DELETE,
    DROP_NAMESPACE,
    RECALL,
    TIME_KEYS,
    UPDATED_AT_KEY,
    ByKey,
    Plan,
    Stamped,
    fetch_records,
    layout,
    read_probes,
    scan,
    together,
    unit_rows,
    upsert_rows,
)

__all__ = [
    "KalosEmbedding",
    "KalosLlamaVectorStore",
    "UnsupportedQuery",
    "IdCollision",
    "kalos_id",
    "to_where",
    "NODE_ID_KEY",
    "MAX_PROBES",
    "CREATED_AT_KEY",
    "UPDATED_AT_KEY",
]

#: Payload field holding the LlamaIndex node id (filters and deletes by node id use it).
NODE_ID_KEY = "_node_id"
#: Ids a node may take (:class:`IdCollision` when all hold other nodes).
MAX_PROBES = 8
#: Pinned: nodes already stored are found by these ids.
IDS = IdScheme(Probing.REHASH, probes=MAX_PROBES, person=b"kalos.llama")
_RANGE = {
    FilterOperator.GT: FieldOp.GT,
    FilterOperator.GTE: FieldOp.GTE,
    FilterOperator.LT: FieldOp.LT,
    FilterOperator.LTE: FieldOp.LTE,
}
_SUPPORTED = "EQ, NE, IN, NIN, GT, GTE, LT, LTE, IS_EMPTY"


class UnsupportedQuery(InvalidRequest):
    """A filter operator, condition or query mode that Kalos cannot serve as LlamaIndex means it;
    raised before anything is sent."""


# --------------------------------------------------------------------------- pure mapping


def kalos_id(node_id: str, attempt: int = 0) -> int:
    """The Kalos id (0 <= id < 2**63) of ``node_id`` at probe ``attempt``: deterministic, the
    same in every process."""
    return IDS.probe(node_id, attempt)


def _scalar(f: MetadataFilter) -> str | int | float:
    v = f.value
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise UnsupportedQuery(f"filter on {f.key!r}: {f.operator.name} needs a string or a number, got {v!r}")
    return v


def _filter_where(f: MetadataFilter) -> Where:
    op, key = f.operator, f.key
    if op == FilterOperator.EQ:
        return condition(key, FieldOp.EQ, _scalar(f))
    if op == FilterOperator.NE:
        return condition(key, FieldOp.NE, _scalar(f))
    if op in (FilterOperator.IN, FilterOperator.NIN):
        if not isinstance(f.value, list):
            raise UnsupportedQuery(f"filter on {key!r}: {op.name} needs a list, got {f.value!r}")
        return condition(key, FieldOp.IN if op == FilterOperator.IN else FieldOp.NIN, f.value)
    if op in _RANGE:
        v = f.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UnsupportedQuery(f"filter on {key!r}: Kalos compares {op.name} with numbers only, got {v!r}")
        return condition(key, _RANGE[op], v)
    if op == FilterOperator.IS_EMPTY:  # as SimpleVectorStore: missing, None or ""
        return any_of(
            [condition(key, FieldOp.EXISTS, False), condition(key, FieldOp.EQ, None), condition(key, FieldOp.EQ, "")]
        )
    raise UnsupportedQuery(
        f"filter on {key!r}: operator {op.name} ({op.value!r}) is not supported "
        f"by the Kalos store; supported: {_SUPPORTED}"
    )


def to_where(filters: MetadataFilters | None) -> Where | None:
    """The Kalos ``where=`` filter of ``filters`` (None: no filter). Raises UnsupportedQuery."""
    if filters is None or not filters.filters:
        return None
    return _filters_where(filters)


def _filters_where(filters: MetadataFilters) -> Where:
    cond = filters.condition or FilterCondition.AND
    if cond not in (FilterCondition.AND, FilterCondition.OR):
        raise UnsupportedQuery(f"condition {cond.name} is not supported by the Kalos store; supported: AND, OR")
    parts: list[Where] = []
    for f in filters.filters:
        if isinstance(f, MetadataFilters):
            if not f.filters:
                raise UnsupportedQuery("an empty nested MetadataFilters")
            parts.append(_filters_where(f))
        else:
            parts.append(_filter_where(f))
    if cond == FilterCondition.OR:
        return any_of(parts)
    where = all_of(parts)
    assert where is not None  # parts is not empty
    return where


def query_where(query: VectorStoreQuery) -> Where | None:
    """The ``where=`` of a query: its filters, ``doc_ids`` and ``node_ids`` together. Empty
    ``node_ids``/``doc_ids`` restrict nothing: ``VectorStoreIndex.as_retriever`` passes the ids of
    its (empty, for a store that keeps the text) index struct."""
    return all_of(
        [
            to_where(query.filters),
            one_of("ref_doc_id", query.doc_ids) if query.doc_ids else None,
            one_of(NODE_ID_KEY, query.node_ids) if query.node_ids else None,
        ]
    )


def _payload(node: BaseNode, flat_metadata: bool) -> dict[str, Any]:
    payload: dict[str, Any] = node_to_metadata_dict(_unstamped(node), remove_text=False, flat_metadata=flat_metadata)
    payload[NODE_ID_KEY] = node.node_id
    return payload


def _stamped(node: BaseNode, created_at: float, updated_at: float) -> BaseNode:
    """``node`` with its record's timestamps in its metadata (``kalos_created_at``,
    ``kalos_updated_at``: seconds since the epoch, the sidecar's clock), keys left out of the
    text given to embedding models and LLMs (as LlamaIndex's file readers leave out file dates)."""
    node.metadata[CREATED_AT_KEY] = created_at
    node.metadata[UPDATED_AT_KEY] = updated_at
    for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
        excluded.extend(k for k in TIME_KEYS if k not in excluded)
    return node


def _unstamped(node: BaseNode) -> BaseNode:
    """``node`` as it is stored: without the timestamps :func:`_stamped` gave it (a node read
    back and added again must not store them: the sidecar keeps its own)."""
    lists = (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys)
    if not any(k in node.metadata or any(k in x for x in lists) for k in TIME_KEYS):
        return node
    node = node.model_copy()
    node.metadata = {k: v for k, v in node.metadata.items() if k not in TIME_KEYS}
    node.excluded_embed_metadata_keys = [k for k in lists[0] if k not in TIME_KEYS]
    node.excluded_llm_metadata_keys = [k for k in lists[1] if k not in TIME_KEYS]
    return node


def _occupant(payload: Any) -> str | None:
    """The node id a stored record holds (None: a record that is not a LlamaIndex node)."""
    if isinstance(payload, dict):
        nid = payload.get(NODE_ID_KEY)
        return nid if isinstance(nid, str) else None
    return None


def _node_id_wheres(node_ids: Sequence[str], blob_bytes: int) -> list[Where]:
    """Filters selecting the records of ``node_ids`` wherever they are, one per request."""
    return [condition(NODE_ID_KEY, FieldOp.IN, c) for c in in_chunks(node_ids, blob_bytes)]


#: A record names its node in ``_node_id``: a node is looked up by it, not probe by probe.
_NODES = ByKey(_occupant, _node_id_wheres)


def _result(hits: Hits) -> VectorStoreQueryResult:
    payloads = hits.payloads or []
    assert hits.created_at is not None and hits.updated_at is not None  # (recalls with payloads carry them)
    nodes = [
        _stamped(metadata_dict_to_node(p), c, u)
        for p, c, u in zip(payloads, hits.created_at.tolist(), hits.updated_at.tolist())
    ]
    return VectorStoreQueryResult(
        nodes=nodes, similarities=[float(s) for s in hits.scores], ids=[n.node_id for n in nodes]
    )


def _with_payloads(hits: Hits, found: Mapping[int, Stamped]) -> Hits:
    """``hits`` with the payloads and timestamps fetched for them (a hit deleted meanwhile is
    dropped)."""
    keep = np.array([i in found for i in hits.ids.tolist()], dtype=bool)
    ids = hits.ids[keep].tolist()
    return Hits(
        hits.ids[keep],
        hits.scores[keep],
        [found[i].payload for i in ids],
        created_at=np.array([found[i].created_at for i in ids]),
        updated_at=np.array([found[i].updated_at for i in ids]),
    )


def _check_query(query: VectorStoreQuery) -> tuple[np.ndarray, Where | None]:
    """The unit query vector and the filter, or UnsupportedQuery (before anything is sent)."""
    if query.mode != VectorStoreQueryMode.DEFAULT:
        raise UnsupportedQuery(
            f"query mode {query.mode.value!r} is not supported by the Kalos store (only 'default': exact top-k)"
        )
    if query.query_embedding is None:
        raise UnsupportedQuery("the Kalos store needs a query_embedding")
    return unit_rows(query.query_embedding), query_where(query)


# --------------------------------------------------------------------------- the store


class _OnSidecar(BaseModel):  # type: ignore[misc,unused-ignore]
    """The fields that connect a LlamaIndex model (the embedding, the vector store) to the sidecar
    ``name``, and its :class:`Connections` made from them, with the ``client`` / ``pool`` given to
    the constructor. ``similarity_for``: as for :class:`Connections`. A subclass names this
    ``__init__`` as its own, or mypy would give it the keyword-only one of its fields."""

    name: str = "default"
    timeout: float | None = None
    connect_timeout: float = 10.0
    pool_size: int = Field(default=4, ge=1)

    _conns: Connections = PrivateAttr()
    similarity_for: ClassVar[str | None] = None

    def __init__(
        self,
        name: str = "default",
        *,
        client: RecallClient | None = None,
        pool: RecallPool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, **self._named(name), **kwargs)
        self._conns = Connections(
            self.name,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            pool_size=self.pool_size,
            client=client,
            pool=pool,
            similarity_for=self.similarity_for,
        )

    @classmethod
    def _named(cls, name: str) -> dict[str, Any]:
        """More fields that follow from ``name``."""
        return {}


class KalosEmbedding(_OnSidecar, BaseEmbedding):  # type: ignore[misc,unused-ignore]
    """LlamaIndex's embedding model computed by the sidecar ``name``'s model (``kalos serve
    --embed``): set it as ``Settings.embed_model`` (or pass ``embed_model=``) and no worker loads a
    model; the sidecar embeds every worker's pending texts together (docs/text.md). ``timeout``,
    ``connect_timeout``, ``pool_size``, ``client`` / ``pool``: as for the vector store. Raises
    ConfigError when the sidecar serves no model, InvalidRequest for a bad text."""

    timeout: float | None = 10.0

    __init__ = _OnSidecar.__init__

    @classmethod
    def _named(cls, name: str) -> dict[str, Any]:
        return {"model_name": f"kalos:{name}"}

    @classmethod
    def class_name(cls) -> str:
        return "KalosEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._conns.embed(texts)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await self._conns.aembed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embeddings([query])[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self._aget_text_embeddings([query]))[0]

    def close(self) -> None:
        self._conns.close()

    async def aclose(self) -> None:
        await self._conns.aclose()


class KalosLlamaVectorStore(
    ConnectedStore,  # type: ignore[misc,unused-ignore]
    _OnSidecar,
    BasePydanticVectorStore,
):
    """LlamaIndex vector store on a Kalos sidecar (exact top-k, cosine scores); see the module
    docstring for how ids, filters and scores map.

    ``name``: the sidecar's ``--name``; ``namespace``: the Kalos namespace of this store;
    ``timeout``: seconds per Kalos call (None: no limit); ``connect_timeout``: seconds to wait
    for a sidecar on first use; ``pool_size``: slots of each event loop's pool;
    ``flat_metadata``: refuse metadata values other than str, int, float, None (the ones filters
    can match). ``client`` / ``pool``: an open RecallClient / RecallPool to use instead of opening
    one (not closed by the store). Kalos errors (``kalos.KalosError``) reach the caller as they are.
    """

    stores_text: bool = True
    is_embedding_query: bool = True
    flat_metadata: bool = True
    namespace: str = "llamaindex"
    similarity_for: ClassVar[str | None] = "KalosLlamaVectorStore"

    __init__ = _OnSidecar.__init__

    @classmethod
    def class_name(cls) -> str:
        return "KalosLlamaVectorStore"

    # ------------------------------------------------------------------ connections
    @property
    def client(self) -> RecallClient:
        """The blocking client of the synchronous methods (opened on first use)."""
        return self._conns.client()

    # ------------------------------------------------------------------ writes
    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Write nodes (with their embeddings); returns their node ids in the order given. A node
        already stored is replaced. Raises IdCollision, PayloadTooLarge (a node over the
        sidecar's --payload-limit), InvalidRequest (dimension), ValueError (non-flat metadata
        with ``flat_metadata``) and the errors of RecallClient."""
        return self._conns.run(self._add(nodes))

    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        """As :meth:`add`, through this event loop's pool (requests sent concurrently)."""
        return await self._conns.arun(self._add(nodes))

    def _add(self, nodes: Sequence[BaseNode]) -> Plan[list[str]]:
        if not nodes:
            return []
        last = {n.node_id: n for n in nodes}  # a node given twice: the last wins
        payloads = [_payload(n, self.flat_metadata) for n in last.values()]
        vectors = unit_rows([n.get_embedding() for n in last.values()])
        probes = {nid: [kalos_id(nid, a) for a in range(MAX_PROBES)] for nid in last}
        seen = yield from read_probes(self.namespace, probes, _NODES, filled=self._conns.filled)
        at = claim(probes, seen.held)
        yield from upsert_rows(self.namespace, [at[nid] for nid in last], vectors, payloads, filled=self._conns.filled)
        return [n.node_id for n in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete every node of document ``ref_doc_id``."""
        self._conns.run(self._delete(ref_doc_id))

    async def adelete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """As :meth:`delete`, through this event loop's pool."""
        await self._conns.arun(self._delete(ref_doc_id))

    def _delete(self, ref_doc_id: str) -> Plan[None]:
        yield [DELETE(where=condition("ref_doc_id", FieldOp.EQ, ref_doc_id), namespace=self.namespace)]
        return None

    def delete_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None, **delete_kwargs: Any
    ) -> None:
        """Delete the nodes among ``node_ids`` (all if None) that match ``filters`` (all if
        None); with neither, every node of the store, as SimpleVectorStore does."""
        self._conns.run(self._delete_nodes(node_ids, filters))

    async def adelete_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None, **delete_kwargs: Any
    ) -> None:
        """As :meth:`delete_nodes`, through this event loop's pool."""
        await self._conns.arun(self._delete_nodes(node_ids, filters))

    def _delete_nodes(self, node_ids: list[str] | None, filters: MetadataFilters | None) -> Plan[None]:
        fw = to_where(filters)
        if node_ids is None and fw is None:
            yield from self._clear()
            return None
        wheres = yield from self._node_wheres(node_ids, fw)
        if wheres:
            yield [DELETE(where=w, namespace=self.namespace) for w in wheres]
        return None

    def clear(self) -> None:
        """Delete every node of the store (drops its namespace)."""
        self._conns.run(self._clear())

    async def aclear(self) -> None:
        """As :meth:`clear`, through this event loop's pool."""
        await self._conns.arun(self._clear())

    def _clear(self) -> Plan[None]:
        yield [DROP_NAMESPACE(self.namespace)]
        self._conns.filled.discard(self.namespace)
        return None

    # ------------------------------------------------------------------ reads
    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """Exact top ``similarity_top_k`` nodes by cosine similarity among those matching
        ``filters``, ``doc_ids`` and ``node_ids``, best first, with their text. Raises
        UnsupportedQuery, InvalidRequest (k above the sidecar's --max-k, wrong dimension) and
        the errors of RecallClient."""
        return self._conns.run(self._query(query))

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """As :meth:`query`, through this event loop's pool."""
        return await self._conns.arun(self._query(query))

    def _query(self, query: VectorStoreQuery) -> Plan[VectorStoreQueryResult]:
        vec, where = _check_query(query)
        k = query.similarity_top_k
        # (a namespace never written: no hits, as the sidecar answers it)
        [hits] = yield [
            RECALL(vec, k, namespace=self.namespace, with_payload=True, where=where).catching(PayloadTooLarge)
        ]
        if isinstance(hits, PayloadTooLarge):  # the hits' payloads overflow one slot: apart
            [hits] = yield [RECALL(vec, k, namespace=self.namespace, where=where)]
            hits = _with_payloads(hits, (yield from fetch_records(self.namespace, hits.ids.tolist())))
        return _result(hits)

    def get_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The stored nodes among ``node_ids`` (all if None) matching ``filters``, in Kalos id
        order (not the order asked)."""
        return self._conns.run(self._get_nodes(node_ids, filters))

    async def aget_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None
    ) -> list[BaseNode]:
        """As :meth:`get_nodes`, through this event loop's pool."""
        return await self._conns.arun(self._get_nodes(node_ids, filters))

    def _get_nodes(self, node_ids: list[str] | None, filters: MetadataFilters | None) -> Plan[list[BaseNode]]:
        fw = to_where(filters)
        wheres: list[Where | None] = [fw]
        if node_ids is not None:
            wheres = list((yield from self._node_wheres(node_ids, fw)))
        scans = yield from together([scan(self.namespace, w) for w in wheres])
        # Export pages carry no timestamps: a get of the records found reads them (a node
        # deleted in between is left out).
        found = yield from fetch_records(self.namespace, [i for s in scans for i in s.ids])
        return [
            _stamped(metadata_dict_to_node(r.payload), r.created_at, r.updated_at)
            for s in scans
            for i in s.ids
            if (r := found.get(i)) is not None
        ]

    def _node_wheres(self, node_ids: list[str] | None, fw: Where | None) -> Plan[list[Where]]:
        """The filters selecting ``node_ids`` (every node if None) that match ``fw``: one per
        chunk of ids that fits a slot's ``$in``."""
        if node_ids is None:
            return [] if fw is None else [fw]
        blob_bytes = (yield from layout()).blob_bytes
        wheres = [all_of([condition(NODE_ID_KEY, FieldOp.IN, c), fw]) for c in in_chunks(node_ids, blob_bytes)]
        return [w for w in wheres if w is not None]
