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
  (:func:`kalos_id`). Before writing, the store reads the records at those ids: one that holds
  another node is never overwritten; the node probes ``kalos_id(node_id, 1)``, ``2``, ... instead
  (up to :data:`MAX_PROBES`, then :class:`IdCollision`). Nodes written before stay where they are
  (found by ``_node_id``), so adding a node again updates it in place. The check and the write
  are two requests: two writers adding *different* nodes whose ids collide at the same moment
  could still overwrite one another (2^-63 per pair).
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

Synchronous methods use one blocking :class:`~kalos.clients.blocking.RecallClient`; the ``a``-methods use
a :class:`~kalos.clients.pool.RecallPool` opened on first use in each event loop. Both are opened lazily
and owned by the store (``close()`` / ``aclose()``), unless given to the constructor. Call
``await store.aclose()`` before the event loop that used it ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from llama_index.core.bridge.pydantic import Field, PrivateAttr
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

from kalos.broker.errors import InvalidRequest, KalosError, PayloadTooLarge, UnknownNamespace
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool
from kalos.clients.results import Hits
from kalos.integrations import require_similarity

__all__ = ["KalosLlamaVectorStore", "UnsupportedQuery", "IdCollision", "kalos_id", "to_where",
           "NODE_ID_KEY", "MAX_PROBES"]

#: Payload field holding the LlamaIndex node id (filters and deletes by node id use it).
NODE_ID_KEY = "_node_id"
#: Ids tried per node before :class:`IdCollision`.
MAX_PROBES = 8
#: Node ids per ``$in`` when looking nodes up (keeps a filter well inside a slot's blob area).
_LOOKUP_CHUNK = 256
#: Kalos's bound on the values of one ``$in``.
_MAX_IN = 1024
_ID_MASK = (1 << 63) - 1
_RANGE = {FilterOperator.GT: "$gt", FilterOperator.GTE: "$gte",
          FilterOperator.LT: "$lt", FilterOperator.LTE: "$lte"}
_SUPPORTED = "EQ, NE, IN, NIN, GT, GTE, LT, LTE, IS_EMPTY"


class UnsupportedQuery(InvalidRequest):
    """A filter operator, condition or query mode that Kalos cannot serve as LlamaIndex means it;
    raised before anything is sent."""


class IdCollision(KalosError):
    """Every id probed for a node holds another node (:data:`MAX_PROBES` of them)."""


# --------------------------------------------------------------------------- pure mapping

def kalos_id(node_id: str, attempt: int = 0) -> int:
    """The Kalos id (0 <= id < 2**63) of ``node_id`` at probe ``attempt``: deterministic, the
    same in every process."""
    data = node_id.encode() if attempt == 0 else f"{attempt}\x00{node_id}".encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"kalos.llama").digest()
    return int.from_bytes(digest, "big") & _ID_MASK


def _scalar(f: MetadataFilter) -> str | int | float:
    v = f.value
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise UnsupportedQuery(f"filter on {f.key!r}: {f.operator.name} needs a string or a "
                               f"number, got {v!r}")
    return v


def _filter_where(f: MetadataFilter) -> dict[str, Any]:
    op, key = f.operator, f.key
    if op == FilterOperator.EQ:
        return {key: _scalar(f)}
    if op == FilterOperator.NE:
        return {key: {"$ne": _scalar(f)}}
    if op in (FilterOperator.IN, FilterOperator.NIN):
        if not isinstance(f.value, list):
            raise UnsupportedQuery(f"filter on {key!r}: {op.name} needs a list, got {f.value!r}")
        return {key: {"$in" if op == FilterOperator.IN else "$nin": list(f.value)}}
    if op in _RANGE:
        v = f.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UnsupportedQuery(f"filter on {key!r}: Kalos compares {op.name} with numbers "
                                   f"only, got {v!r}")
        return {key: {_RANGE[op]: v}}
    if op == FilterOperator.IS_EMPTY:  # as SimpleVectorStore: missing, None or ""
        return {"$or": [{key: {"$exists": False}}, {key: None}, {key: ""}]}
    raise UnsupportedQuery(f"filter on {key!r}: operator {op.name} ({op.value!r}) is not supported "
                           f"by the Kalos store; supported: {_SUPPORTED}")


def to_where(filters: MetadataFilters | None) -> dict[str, Any] | None:
    """The Kalos ``where=`` filter of ``filters`` (None: no filter). Raises UnsupportedQuery."""
    if filters is None or not filters.filters:
        return None
    return _filters_where(filters)


def _filters_where(filters: MetadataFilters) -> dict[str, Any]:
    cond = filters.condition or FilterCondition.AND
    if cond not in (FilterCondition.AND, FilterCondition.OR):
        raise UnsupportedQuery(f"condition {cond.name} is not supported by the Kalos store; "
                               "supported: AND, OR")
    parts: list[dict[str, Any]] = []
    for f in filters.filters:
        if isinstance(f, MetadataFilters):
            if not f.filters:
                raise UnsupportedQuery("an empty nested MetadataFilters")
            parts.append(_filters_where(f))
        else:
            parts.append(_filter_where(f))
    return {"$and" if cond == FilterCondition.AND else "$or": parts}


def _in(key: str, values: Sequence[str]) -> dict[str, Any]:
    """``key`` is one of ``values`` (split into several ``$in`` when there are many)."""
    chunks = [list(values[i:i + _MAX_IN]) for i in range(0, len(values), _MAX_IN)]
    if len(chunks) <= 1:
        return {key: {"$in": chunks[0] if chunks else []}}
    return {"$or": [{key: {"$in": c}} for c in chunks]}


def _all_of(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else {"$and": present}


def query_where(query: VectorStoreQuery) -> dict[str, Any] | None:
    """The ``where=`` of a query: its filters, ``doc_ids`` and ``node_ids`` together. Empty
    ``node_ids``/``doc_ids`` restrict nothing: ``VectorStoreIndex.as_retriever`` passes the ids of
    its (empty, for a store that keeps the text) index struct."""
    return _all_of(to_where(query.filters),
                   _in("ref_doc_id", query.doc_ids) if query.doc_ids else None,
                   _in(NODE_ID_KEY, query.node_ids) if query.node_ids else None)


def _unit(rows: Sequence[Any] | np.ndarray) -> np.ndarray:
    """float32 rows scaled to unit length (zero rows stay zero): inner product = cosine."""
    m = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(m, axis=-1, keepdims=True)
    return (m / np.where(norms == 0, 1.0, norms)).astype(np.float32)


def _payload(node: BaseNode, flat_metadata: bool) -> dict[str, Any]:
    payload: dict[str, Any] = node_to_metadata_dict(node, remove_text=False, flat_metadata=flat_metadata)
    payload[NODE_ID_KEY] = node.node_id
    return payload


def _occupant(payload: Any) -> str | None:
    """The node id a stored record holds (None: a record that is not a LlamaIndex node)."""
    if isinstance(payload, dict):
        nid = payload.get(NODE_ID_KEY)
        return nid if isinstance(nid, str) else None
    return None


def claim(pending: Sequence[str], candidates: Mapping[str, int], occupied: Collection[int],
          taken: set[int]) -> tuple[dict[str, int], list[str]]:
    """Give each pending node its candidate id if no record holds it and no node of this write
    took it (``taken`` grows). Returns (placed, still pending)."""
    placed: dict[str, int] = {}
    rest: list[str] = []
    for nid in pending:
        i = candidates[nid]
        if i in occupied or i in taken:
            rest.append(nid)
        else:
            placed[nid] = i
            taken.add(i)
    return placed, rest


def pack(sizes: Sequence[int], max_rows: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split rows into [lo, hi) runs of at most ``max_rows`` rows whose JSON lines (``sizes``
    bytes each, newline-joined) fit ``max_bytes``; a row too big on its own gets a run alone (the
    sidecar then refuses it with PayloadTooLarge)."""
    runs: list[tuple[int, int]] = []
    lo, used = 0, -1
    for i, size in enumerate(sizes):
        if i > lo and (i - lo >= max_rows or used + 1 + size > max_bytes):
            runs.append((lo, i))
            lo, used = i, -1
        used += 1 + size
    if lo < len(sizes):
        runs.append((lo, len(sizes)))
    return runs


def _line_bytes(payload: Any) -> int:
    return len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def _result(hits: Hits) -> VectorStoreQueryResult:
    payloads = hits.payloads or []
    nodes = [metadata_dict_to_node(p) for p in payloads]
    return VectorStoreQueryResult(nodes=nodes, similarities=[float(s) for s in hits.scores],
                                  ids=[n.node_id for n in nodes])


class _Write:
    """One add(): the nodes (last of a repeated id wins), their vectors and payloads."""

    def __init__(self, nodes: Sequence[BaseNode], flat_metadata: bool) -> None:
        last = {n.node_id: n for n in nodes}
        self.node_ids = list(last)
        self.vectors = _unit([last[nid].get_embedding() for nid in self.node_ids])
        self.payloads = [_payload(last[nid], flat_metadata) for nid in self.node_ids]
        self.first = {nid: kalos_id(nid) for nid in self.node_ids}

    def runs(self, ids: Mapping[str, int], max_rows: int,
             max_bytes: int) -> list[tuple[np.ndarray, np.ndarray, list[Any]]]:
        """(ids, vectors, payloads) per upsert request, each fitting one slot."""
        idarr = np.array([ids[nid] for nid in self.node_ids], dtype=np.int64)
        return [(idarr[lo:hi], self.vectors[lo:hi], self.payloads[lo:hi])
                for lo, hi in pack([_line_bytes(p) for p in self.payloads], max_rows, max_bytes)]


def _placement(w: _Write) -> Generator[tuple[str, list[Any]], Any, dict[str, int]]:
    """The Kalos id of each node of a write (module docstring: a node already stored keeps its
    record, else the first free id of its probe sequence; another node's record is never
    taken). No I/O: it yields the lookups it needs, ``("occupants", kalos ids)`` (answer: which
    node each existing record holds) and ``("locate", node ids)`` (answer: where those nodes are
    stored already), and returns node id -> Kalos id. Raises IdCollision."""
    occ = yield ("occupants", list(dict.fromkeys(w.first.values())))
    ids = _same(w.first, occ)
    rest = [nid for nid in w.node_ids if nid not in ids]
    if rest:
        ids.update((yield ("locate", rest)))
        rest = [nid for nid in rest if nid not in ids]
    taken = set(ids.values())
    occupied: Collection[int] = set(occ)
    for attempt in range(MAX_PROBES):
        if not rest:
            break
        cand = {nid: kalos_id(nid, attempt) for nid in rest}
        if attempt:
            occupied = set((yield ("occupants", list(cand.values()))))
        placed, rest = claim(rest, cand, occupied, taken)
        ids.update(placed)
    if rest:
        raise _probe_failed(rest)
    return ids


def _same(first: Mapping[str, int], occ: Mapping[int, str | None]) -> dict[str, int]:
    """The nodes already stored at their first id (written again in place)."""
    return {nid: i for nid, i in first.items() if i in occ and occ[i] == nid}


def _probe_failed(pending: Iterable[str]) -> IdCollision:
    return IdCollision(f"no free id for node(s) {sorted(pending)[:5]} after {MAX_PROBES} probes")


# --------------------------------------------------------------------------- the store

class KalosLlamaVectorStore(BasePydanticVectorStore):  # type: ignore[misc,unused-ignore]
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
    name: str = "default"
    namespace: str = "llamaindex"
    timeout: float | None = None
    connect_timeout: float = 10.0
    pool_size: int = Field(default=4, ge=1)

    _client: RecallClient | None = PrivateAttr(default=None)
    _owns_client: bool = PrivateAttr(default=False)
    _client_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _pool: RecallPool | None = PrivateAttr(default=None)
    _pools: dict[asyncio.AbstractEventLoop, asyncio.Task[RecallPool]] = PrivateAttr(
        default_factory=dict)

    def __init__(self, name: str = "default", *, client: RecallClient | None = None,
                 pool: RecallPool | None = None, **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)  # type: ignore[call-arg,unused-ignore]
        self._client = client
        self._pool = pool

    @classmethod
    def class_name(cls) -> str:
        return "KalosLlamaVectorStore"

    # ------------------------------------------------------------------ connections
    @property
    def client(self) -> RecallClient:
        """The blocking client of the synchronous methods (opened on first use)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = RecallClient(self.name, timeout=self.timeout,
                                                connect_timeout=self.connect_timeout)
                    self._owns_client = True
        require_similarity(self._client.metric, "KalosLlamaVectorStore")
        return self._client

    async def _apool(self) -> RecallPool:
        """This event loop's pool (opened on first use; one per loop, since a pool belongs to
        the loop that opened it)."""
        if self._pool is not None:
            require_similarity(self._pool.metric, "KalosLlamaVectorStore")
            return self._pool
        loop = asyncio.get_running_loop()
        self._reap_closed_loops()
        task = self._pools.get(loop)
        if task is None:
            pool = RecallPool(self.name, size=self.pool_size, timeout=self.timeout,
                              connect_timeout=self.connect_timeout)
            task = self._pools[loop] = loop.create_task(pool.open())
        try:
            pool = await asyncio.shield(task)
            require_similarity(pool.metric, "KalosLlamaVectorStore")
            return pool
        except BaseException:
            if task.done() and self._pools.get(loop) is task and \
                    (task.cancelled() or task.exception() is not None):
                del self._pools[loop]  # the next call tries again
            raise

    def _reap_closed_loops(self) -> None:
        for loop in [lp for lp in self._pools if lp.is_closed()]:
            _terminate(self._pools.pop(loop))

    def close(self) -> None:
        """Close the blocking client and the pools of event loops that have ended (if the store
        opened them). Closing twice is fine."""
        with self._client_lock:
            client, owned = self._client, self._owns_client
            if owned:
                self._client, self._owns_client = None, False
        if owned and client is not None:
            client.close()
        self._reap_closed_loops()

    async def aclose(self) -> None:
        """Close this event loop's pool, then as :meth:`close`."""
        task = self._pools.pop(asyncio.get_running_loop(), None)
        if task is not None:
            try:
                pool = await task
            except Exception:
                pool = None
            if pool is not None:
                await pool.close()
        self.close()

    # ------------------------------------------------------------------ writes
    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Write nodes (with their embeddings); returns their node ids in the order given. A node
        already stored is replaced. Raises IdCollision, PayloadTooLarge (a node over the
        sidecar's --payload-limit), InvalidRequest (dimension), ValueError (non-flat metadata
        with ``flat_metadata``) and the errors of RecallClient."""
        if not nodes:
            return []
        w = _Write(nodes, self.flat_metadata)
        c = self.client
        steps = _placement(w)
        ask = next(steps)
        try:
            while True:  # each lookup the placement asks for, answered through the client
                ask = steps.send(self._occupants(ask[1]) if ask[0] == "occupants" else self._locate(ask[1]))
        except StopIteration as done:
            ids: dict[str, int] = done.value
        lay = c.layout
        for idarr, vecs, pls in w.runs(ids, lay.max_queries, lay.blob_bytes):
            c.upsert(idarr, vecs, pls, namespace=self.namespace)
        return [n.node_id for n in nodes]

    def _occupants(self, ids: Iterable[int]) -> dict[int, str | None]:
        """Which node each existing record among ``ids`` holds (absent: no record)."""
        out: dict[int, str | None] = {}
        for chunk in _chunks(list(dict.fromkeys(ids)), self.client.layout.max_queries):
            for i, p in self._get_payloads(chunk):
                out[i] = _occupant(p)
        return out

    def _get_payloads(self, ids: Sequence[int]) -> list[tuple[int, Any]]:
        """(id, payload) of the records that exist; halves the request while the payloads
        overflow the slot."""
        try:
            recs = self.client.get(list(ids), namespace=self.namespace, with_vectors=False)
        except UnknownNamespace:
            return []
        except PayloadTooLarge:
            if len(ids) == 1:
                raise
            half = len(ids) // 2
            return self._get_payloads(ids[:half]) + self._get_payloads(ids[half:])
        return list(zip(recs.ids.tolist(), recs.payloads))

    def _locate(self, node_ids: Sequence[str]) -> dict[str, int]:
        """Where the given nodes are stored, if they are."""
        found: dict[str, int] = {}
        for chunk in _chunks(node_ids, _LOOKUP_CHUNK):
            for i, p in self._export({NODE_ID_KEY: {"$in": list(chunk)}}):
                nid = _occupant(p)
                if nid is not None:
                    found[nid] = i
        return found

    def _export(self, where: dict[str, Any] | None) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        after = -1
        while True:
            try:
                ids, _, payloads = self.client.export_page(self.namespace, after, where=where)
            except UnknownNamespace:
                return out
            if len(ids) == 0:
                return out
            out.extend(zip(ids.tolist(), payloads))
            after = int(ids[-1])

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete every node of document ``ref_doc_id``."""
        self.client.delete(where={"ref_doc_id": ref_doc_id}, namespace=self.namespace)

    def delete_nodes(self, node_ids: list[str] | None = None,
                     filters: MetadataFilters | None = None, **delete_kwargs: Any) -> None:
        """Delete the nodes among ``node_ids`` (all if None) that match ``filters`` (all if
        None); with neither, every node of the store, as SimpleVectorStore does."""
        fw = to_where(filters)
        if node_ids is None and fw is None:
            self.clear()
            return
        for where in _delete_wheres(node_ids, fw):
            self.client.delete(where=where, namespace=self.namespace)

    def clear(self) -> None:
        """Delete every node of the store (drops its namespace)."""
        self.client.drop_namespace(self.namespace)

    # ------------------------------------------------------------------ reads
    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """Exact top ``similarity_top_k`` nodes by cosine similarity among those matching
        ``filters``, ``doc_ids`` and ``node_ids``, best first, with their text. Raises
        UnsupportedQuery, InvalidRequest (k above the sidecar's --max-k, wrong dimension) and
        the errors of RecallClient."""
        vec, where = _check_query(query)
        c = self.client
        try:
            hits = c.recall(vec, query.similarity_top_k, namespace=self.namespace,
                            with_payload=True, where=where)
        except UnknownNamespace:
            return VectorStoreQueryResult(nodes=[], similarities=[], ids=[])
        except PayloadTooLarge:  # the hits' payloads overflow one slot: fetch them apart
            hits = c.recall(vec, query.similarity_top_k, namespace=self.namespace, where=where)
            hits = _with_payloads(hits, self._get_payloads(hits.ids.tolist()))
        return _result(hits)

    def get_nodes(self, node_ids: list[str] | None = None,
                  filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The stored nodes among ``node_ids`` (all if None) matching ``filters``, in Kalos id
        order (not the order asked)."""
        out: list[BaseNode] = []
        for where in _get_wheres(node_ids, to_where(filters)):
            out.extend(metadata_dict_to_node(p) for _, p in self._export(where))
        return out

    # ------------------------------------------------------------------ async
    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        """As :meth:`add`, through this event loop's pool (requests sent concurrently)."""
        if not nodes:
            return []
        w = _Write(nodes, self.flat_metadata)
        pool = await self._apool()
        steps = _placement(w)
        ask = next(steps)
        try:
            while True:  # each lookup the placement asks for, answered through the pool
                ask = steps.send(await self._aoccupants(pool, ask[1]) if ask[0] == "occupants"
                                 else await self._alocate(pool, ask[1]))
        except StopIteration as done:
            ids: dict[str, int] = done.value
        lay = pool.layout
        await asyncio.gather(*(pool.upsert(idarr, vecs, pls, namespace=self.namespace)
                               for idarr, vecs, pls in w.runs(ids, lay.max_queries, lay.blob_bytes)))
        return [n.node_id for n in nodes]

    async def _aoccupants(self, pool: RecallPool, ids: Iterable[int]) -> dict[int, str | None]:
        chunks = list(_chunks(list(dict.fromkeys(ids)), pool.layout.max_queries))
        parts = await asyncio.gather(*(self._aget_payloads(pool, c) for c in chunks))
        return {i: _occupant(p) for part in parts for i, p in part}

    async def _aget_payloads(self, pool: RecallPool, ids: Sequence[int]) -> list[tuple[int, Any]]:
        try:
            recs = await pool.get(list(ids), namespace=self.namespace, with_vectors=False)
        except UnknownNamespace:
            return []
        except PayloadTooLarge:
            if len(ids) == 1:
                raise
            half = len(ids) // 2
            a, b = await asyncio.gather(self._aget_payloads(pool, ids[:half]),
                                        self._aget_payloads(pool, ids[half:]))
            return a + b
        return list(zip(recs.ids.tolist(), recs.payloads))

    async def _alocate(self, pool: RecallPool, node_ids: Sequence[str]) -> dict[str, int]:
        parts = await asyncio.gather(*(self._aexport(pool, {NODE_ID_KEY: {"$in": list(c)}})
                                       for c in _chunks(node_ids, _LOOKUP_CHUNK)))
        return {nid: i for part in parts for i, p in part if (nid := _occupant(p)) is not None}

    async def _aexport(self, pool: RecallPool, where: dict[str, Any] | None) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        after = -1
        while True:
            try:
                ids, _, payloads = await pool.export_page(self.namespace, after, where=where)
            except UnknownNamespace:
                return out
            if len(ids) == 0:
                return out
            out.extend(zip(ids.tolist(), payloads))
            after = int(ids[-1])

    async def adelete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """As :meth:`delete`, through this event loop's pool."""
        pool = await self._apool()
        await pool.delete(where={"ref_doc_id": ref_doc_id}, namespace=self.namespace)

    async def adelete_nodes(self, node_ids: list[str] | None = None,
                            filters: MetadataFilters | None = None, **delete_kwargs: Any) -> None:
        """As :meth:`delete_nodes`, through this event loop's pool."""
        fw = to_where(filters)
        if node_ids is None and fw is None:
            await self.aclear()
            return
        pool = await self._apool()
        await asyncio.gather(*(pool.delete(where=where, namespace=self.namespace)
                               for where in _delete_wheres(node_ids, fw)))

    async def aclear(self) -> None:
        """As :meth:`clear`, through this event loop's pool."""
        pool = await self._apool()
        await pool.drop_namespace(self.namespace)

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """As :meth:`query`, through this event loop's pool."""
        vec, where = _check_query(query)
        pool = await self._apool()
        try:
            hits = await pool.recall(vec, query.similarity_top_k, namespace=self.namespace,
                                     with_payload=True, where=where)
        except UnknownNamespace:
            return VectorStoreQueryResult(nodes=[], similarities=[], ids=[])
        except PayloadTooLarge:
            hits = await pool.recall(vec, query.similarity_top_k, namespace=self.namespace,
                                     where=where)
            ids = hits.ids.tolist()
            parts = await asyncio.gather(*(self._aget_payloads(pool, c)
                                           for c in _chunks(ids, pool.layout.max_queries)))
            hits = _with_payloads(hits, [x for part in parts for x in part])
        return _result(hits)

    async def aget_nodes(self, node_ids: list[str] | None = None,
                         filters: MetadataFilters | None = None) -> list[BaseNode]:
        """As :meth:`get_nodes`, through this event loop's pool."""
        pool = await self._apool()
        parts = await asyncio.gather(*(self._aexport(pool, where)
                                       for where in _get_wheres(node_ids, to_where(filters))))
        return [metadata_dict_to_node(p) for part in parts for _, p in part]


def _check_query(query: VectorStoreQuery) -> tuple[np.ndarray, dict[str, Any] | None]:
    """The unit query vector and the filter, or UnsupportedQuery (before anything is sent)."""
    if query.mode != VectorStoreQueryMode.DEFAULT:
        raise UnsupportedQuery(f"query mode {query.mode.value!r} is not supported by the Kalos "
                               "store (only 'default': exact top-k)")
    if query.query_embedding is None:
        raise UnsupportedQuery("the Kalos store needs a query_embedding")
    return _unit(query.query_embedding), query_where(query)


def _delete_wheres(node_ids: list[str] | None, fw: dict[str, Any] | None) -> list[dict[str, Any]]:
    if node_ids is None:
        return [] if fw is None else [fw]
    return [w for c in _chunks(node_ids, _LOOKUP_CHUNK)
            if (w := _all_of(_in(NODE_ID_KEY, c), fw)) is not None]


def _get_wheres(node_ids: list[str] | None,
                fw: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    if node_ids is None:
        return [fw]
    return [_all_of(_in(NODE_ID_KEY, c), fw) for c in _chunks(node_ids, _LOOKUP_CHUNK)]


def _with_payloads(hits: Hits, found: Sequence[tuple[int, Any]]) -> Hits:
    """``hits`` with the payloads fetched for them (a hit deleted meanwhile is dropped)."""
    by_id = dict(found)
    keep = np.array([i in by_id for i in hits.ids.tolist()], dtype=bool)
    ids = hits.ids[keep]
    return Hits(ids, hits.scores[keep], [by_id[i] for i in ids.tolist()])


def _terminate(task: asyncio.Task[RecallPool]) -> None:
    """Close the pool of an event loop that has ended, if it opened."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return
    try:
        task.result().terminate()
    except RuntimeError:  # its loop is closed under a task it still had: the leases go at exit
        pass
