"""LangChain ``VectorStore`` on a Kalos sidecar: :class:`KalosVectorStore`.

Install with the ``langchain`` extra (``langchain-core``). One store is one Kalos namespace
(``namespace=``, default ``"langchain"``) on the sidecar called ``name`` (its ``--name``); the
namespace belongs to the store: records written there by other code are not documents (searches
skip them, and the store never overwrites them, below).

Records
-------
A document is one record of the namespace::

    id       kalos_id(document.id)            int64, below
    vector   the embedding                    float32, dim = the sidecar's --dim
    payload  {"lc_id": document.id,
              "lc_doc": {"page_content": document.page_content},
              "m.<key>": document.metadata[key], ...}

Metadata keys are stored top level behind the ``m.`` prefix, so that every metadata field is a
filter column of the sidecar and no metadata key can clash with ``lc_id`` or start with ``$``.
The text sits inside an object because the sidecar keeps a dictionary of the scalar values of
every top-level field (its filter columns): a top-level text would be held there a second time.
Metadata values must be JSON (a tuple comes back a list); one payload is at most the sidecar's
``--payload-limit`` (16 KiB by default), and the payloads of one answer (``k`` hits, the
``fetch_k`` candidates of MMR, ``max_queries`` records of a read) at most its ``--blob-bytes``
(256 KiB): ``PayloadTooLarge`` beyond (lower k, or raise the sidecar's limits for long texts).

Ids
---
LangChain ids are strings; Kalos ids are non-negative int64. A string id maps to
``kalos_id(s) = int.from_bytes(blake2b(s.encode("utf-8"), digest_size=8).digest(), "big") &
(2**63 - 1)``: the same in every process, Python version and language, so any client can find a
document by its string id. Documents added without an id get ``str(uuid4())``. The string id is
also stored in the payload (``lc_id``), which makes a collision (two string ids, one int64)
detectable: before writing, the store reads the records at the target ids (``get``, without
vectors; only one request when the namespace does not exist yet) and raises :class:`IdCollisionError` (``kalos.integrations._ids.IdCollision``, the one
collision error of the integrations), writing nothing of the batch, if one of them holds another
string id or is not a document of this store; two ids of one batch that collide are refused the
same way. Reads check ``lc_id`` too (``get_by_ids`` never returns the other document),
and deletes select by ``lc_id`` with a filter, so deleting ``a`` never removes a colliding ``b``.

The trade-off: the check and the write are two requests, not one transaction. The embedding is
computed before the check, so the window is one round trip (tens to hundreds of microseconds), but two
writers that add *different* colliding string ids inside that window can still overwrite one
another. That needs a 63-bit collision (probability about n**2 / 2**64 over n documents: 5e-8 at
a million) *and* that race; a store with a single writer, or writers that own disjoint ids, is
never affected. Writing the same string id again replaces the document (LangChain's upsert).

Scores
------
``similarity_search_with_score`` returns Kalos's score unchanged: a similarity, higher is
better (dot product, cosine similarity, or minus the squared L2 distance, as the sidecar's
``--metric``). Relevance scores (``similarity_search_with_relevance_scores``, the retriever's
``similarity_score_threshold``) map it to [0, 1] as ``(1 + cos) / 2`` for unit-length embeddings:
``(1 + s) / 2`` under cosine and dot, ``1 + s / 4`` under l2 (``|a - b|**2 = 2 - 2 cos``), clamped
to [0, 1]. The store reads the sidecar's metric from its header (``metric=`` overrides it, and
``relevance_score_fn=`` replaces the mapping).

Filters
-------
``filter=`` takes a dict on metadata fields, Mongo-style as most LangChain stores do, mapped to
Kalos ``where=`` (README, "Filters") by prefixing each field: ``{"f": v}``, ``{"f": {"$eq"|"$ne"|
"$gt"|"$gte"|"$lt"|"$lte"|"$in"|"$nin"|"$exists": ...}}``, ``{"$and"|"$or": [filter, ...]}``.
Operators Kalos lacks (``$not``, ``$like``, ``$contains``, ...) raise ``InvalidRequest``.
Filtered searches are exact top-k over the matching documents.

Recency
-------
:class:`KalosTimeWeightedRetriever` (``store.as_time_weighted_retriever(decay_rate=...)``) is
LangChain's ``TimeWeightedVectorStoreRetriever`` on the sidecar's exact recency-weighted recall:
``similarity + weight * (1 - decay_rate) ** hours`` since a document's last write, over every
document of the store; :meth:`KalosVectorStore.similarity_search_with_recency` is the same search
with scores and a :class:`~kalos.broker.clock.Recency`. Their documents carry
``kalos_created_at`` / ``kalos_updated_at`` (epoch seconds). Where the two retrievers agree and
where not: the retriever's docstring and docs/integrations.md.

Sync and async
--------------
Each operation is written once, as a plan (``kalos.integrations._plans``) that both kinds of
method run. Sync methods run it on a blocking :class:`~kalos.clients.blocking.RecallClient` (one
slot, opened on first use); async methods on a :class:`~kalos.clients.pool.RecallPool` of the
running event loop (one per loop, opened on first use there; ``kalos.integrations._loops``).
Pools and clients passed in are the caller's; those the store opened are closed by :meth:`close` /
:meth:`aclose` (or ``with`` / ``async with``; a pool of a loop that has ended is terminated on the
store's next use or close).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field, field_validator

from kalos.broker.clock import Recency
from kalos.broker.errors import InvalidRequest, UsageError
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool
from kalos.clients.results import Hits, Records

from ._core import ConnectedStore, Connections
from ._filters import FieldOp, Where, all_of, condition, in_chunks, mongo_where
from ._ids import IdCollision, IdScheme, Probing, claim
from ._plans import (
    CREATED_AT_KEY,
    DELETE,
    DROP_NAMESPACE,
    GET,
    RECALL,
    UPDATED_AT_KEY,
    ByKey,
    Plan,
    Step,
    fetch_payloads,
    layout,
    read_probes,
    upsert_rows,
)
from .embeddings import KalosEmbeddings

__all__ = [
    "KalosVectorStore",
    "KalosTimeWeightedRetriever",
    "IdCollisionError",
    "kalos_id",
    "to_where",
    "mmr_select",
    "ID_FIELD",
    "DOC_FIELD",
    "METADATA_PREFIX",
    "CREATED_AT_KEY",
    "UPDATED_AT_KEY",
]

ID_FIELD = "lc_id"
DOC_FIELD = "lc_doc"
METADATA_PREFIX = "m."
#: One probe, no personalisation: the documented id any client can compute (pinned).
IDS = IdScheme(Probing.REHASH)
_INT63 = 2**63 - 1
Metric = Literal["cosine", "dot", "l2"]
_S = TypeVar("_S", bound="KalosVectorStore")

#: The name this store's collision error had; the one error of the integrations.
IdCollisionError = IdCollision


# --------------------------------------------------------------------------- pure mapping


def kalos_id(doc_id: str) -> int:
    """The Kalos id (int64, >= 0) of a LangChain string id: the first 8 bytes of its BLAKE2b-64
    digest (UTF-8), big-endian, top bit cleared. Deterministic everywhere."""
    if not isinstance(doc_id, str):
        raise InvalidRequest(f"document ids are strings, got {type(doc_id).__name__}")
    return IDS.probe(doc_id)


def to_payload(doc_id: str, text: str, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The Kalos payload of one document (module docstring, "Records")."""
    payload: dict[str, Any] = {ID_FIELD: doc_id, DOC_FIELD: {"page_content": text}}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str):
            raise InvalidRequest(f"metadata keys are strings, got {key!r}")
        payload[METADATA_PREFIX + key] = value
    return payload


def stored_id(payload: Any) -> str | None:
    """The string id a record's payload holds; None when the record is not a document."""
    if isinstance(payload, dict):
        sid = payload.get(ID_FIELD)
        if isinstance(sid, str) and isinstance(payload.get(DOC_FIELD), dict):
            return sid
    return None


def to_document(payload: Any) -> Document | None:
    """The document a payload holds; None when the record is not a document of a store."""
    sid = stored_id(payload)
    if sid is None:
        return None
    n = len(METADATA_PREFIX)
    metadata = {k[n:]: v for k, v in payload.items() if k.startswith(METADATA_PREFIX)}
    return Document(id=sid, page_content=str(payload[DOC_FIELD].get("page_content", "")), metadata=metadata)


def to_where(filter: Mapping[str, Any]) -> Where:
    """A LangChain metadata filter as a Kalos ``where=`` (module docstring, "Filters"): the
    Mongo-style filter of ``kalos.integrations._filters.mongo_where`` on the ``m.`` fields. Pure;
    raises InvalidRequest for what Kalos cannot express (Kalos checks the rest when sent)."""
    return mongo_where(filter, lambda key: METADATA_PREFIX + key)


def relevance_fn(metric: str) -> Callable[[float], float]:
    """Kalos score -> relevance in [0, 1]: (1 + cos) / 2 for unit-length embeddings."""
    if metric in ("cosine", "dot"):
        return lambda s: min(1.0, max(0.0, (1.0 + s) / 2.0))
    if metric == "l2":
        return lambda s: min(1.0, max(0.0, 1.0 + s / 4.0))
    raise UsageError(f"metric is 'cosine', 'dot' or 'l2', got {metric!r}")


def mmr_select(query: np.ndarray, candidates: np.ndarray, k: int, lambda_mult: float) -> list[int]:
    """Maximal marginal relevance, as LangChain defines it: indices into ``candidates`` (n, dim),
    the most query-similar first, then each time the one maximising ``lambda_mult * sim(query) -
    (1 - lambda_mult) * max sim(selected)``, by cosine similarity in float64. Pure."""
    n = len(candidates)
    if n == 0 or k <= 0:
        return []
    c = np.asarray(candidates, np.float64)
    c = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-300)
    q = np.asarray(query, np.float64)
    q = q / max(float(np.linalg.norm(q)), 1e-300)
    to_query = c @ q
    chosen = [int(np.argmax(to_query))]
    redundancy = c @ c[chosen[0]]  # max similarity of each candidate to the chosen ones
    while len(chosen) < min(k, n):
        gain = lambda_mult * to_query - (1.0 - lambda_mult) * redundancy
        gain[chosen] = -np.inf
        best = int(np.argmax(gain))
        chosen.append(best)
        redundancy = np.maximum(redundancy, c @ c[best])
    return chosen


@dataclass(frozen=True)
class _Batch:
    """One add: the string ids (as returned), their Kalos ids, the payloads."""

    doc_ids: list[str]
    kalos_ids: list[int]
    payloads: list[dict[str, Any]]


def plan_batch(
    texts: Sequence[str],
    metadatas: Sequence[Mapping[str, Any] | None] | None,
    ids: Sequence[str | None] | None,
    id_map: Callable[[str], int],
) -> _Batch:
    """Ids (a uuid4 for each missing one), Kalos ids and payloads of one add; raises
    InvalidRequest on mismatched lengths or an id map out of range. Pure apart from drawing
    uuids."""
    n = len(texts)
    if metadatas is not None and len(metadatas) != n:
        raise InvalidRequest(f"{len(metadatas)} metadatas for {n} texts")
    if ids is not None and len(ids) != n:
        raise InvalidRequest(f"{len(ids)} ids for {n} texts")
    doc_ids = [i if i is not None else str(uuid.uuid4()) for i in (ids or [None] * n)]
    kids = [id_map(i) for i in doc_ids]
    for sid, kid in zip(doc_ids, kids):
        if not 0 <= kid <= _INT63:
            raise InvalidRequest(f"id map gave {kid} for {sid!r}: Kalos ids are 0..2**63-1")
    payloads = [
        to_payload(sid, text, None if metadatas is None else metadatas[j])
        for j, (sid, text) in enumerate(zip(doc_ids, texts))
    ]
    return _Batch(doc_ids, kids, payloads)


def _docs_of(hits: Hits) -> list[tuple[Document, float]]:
    out = []
    for hit in hits:
        doc = to_document(hit.payload)
        if doc is not None:
            out.append((doc, hit.score))
    return out


def _timed_docs_of(hits: Hits) -> list[tuple[Document, float]]:
    """As :func:`_docs_of`, each document's metadata with the record's timestamps too."""
    assert hits.created_at is not None and hits.updated_at is not None  # (a recency recall has them)
    out = []
    for hit, created, updated in zip(hits, hits.created_at.tolist(), hits.updated_at.tolist()):
        doc = to_document(hit.payload)
        if doc is not None:
            doc.metadata[CREATED_AT_KEY] = created
            doc.metadata[UPDATED_AT_KEY] = updated
            out.append((doc, hit.score))
    return out


def _docs_by_id(asked: Sequence[str], payloads: Iterable[Any]) -> list[Document]:
    found: dict[str, Document] = {}
    for payload in payloads:
        doc = to_document(payload)
        if doc is not None and doc.id is not None:
            found[doc.id] = doc
    return [found[i] for i in asked if i in found]


def _mmr_docs(query: Sequence[float], hits: Hits, records: Records, k: int, lambda_mult: float) -> list[Document]:
    """MMR over the recalled candidates that are documents and whose vectors were fetched (one
    deleted between the two requests is dropped)."""
    assert records.vectors is not None
    row = {i: j for j, i in enumerate(records.ids.tolist())}
    docs: list[Document] = []
    rows: list[int] = []
    for i in hits.ids.tolist():  # (the payloads come with the vectors: they cross the slot once)
        j = row.get(i)
        doc = None if j is None else to_document(records.payloads[j])
        if doc is not None and j is not None:
            docs.append(doc)
            rows.append(j)
    picked = mmr_select(np.asarray(query), records.vectors[rows], k, lambda_mult)
    return [docs[p] for p in picked]


def _no_extra(kwargs: Mapping[str, Any], method: str) -> None:
    if kwargs:
        raise TypeError(f"{method}() got unexpected keyword arguments {sorted(kwargs)}")


def _where(filter: Mapping[str, Any] | None) -> Where | None:
    return None if filter is None else to_where(filter)


def _check_recency(recency: Any) -> None:
    if not isinstance(recency, Recency):
        raise InvalidRequest(f"recency takes a kalos.Recency(half_life=..., weight=...), got {recency!r}")


def _fetch_k(k: int, fetch_k: int, max_k: int) -> int:
    """Candidates to recall for MMR: at least ``k``, at most the sidecar's max_k."""
    return max(1, min(max(k, fetch_k), max_k))


# --------------------------------------------------------------------------- the store


class KalosVectorStore(ConnectedStore, VectorStore):
    """A LangChain vector store kept in one namespace of a Kalos sidecar (module docstring).

    ``name``: the sidecar's ``--name``; ``namespace``: this store's namespace; ``metric``: how to
    read scores for relevance (default: the sidecar's own ``--metric``, read from its header); ``timeout``: seconds per Kalos
    request (None: no limit); ``connect_timeout``: seconds to wait for the sidecar when opening;
    ``pool`` / ``client``: an open RecallPool / RecallClient to use instead of opening one (the
    caller closes it); ``pool_size``: slots of each pool the store opens (one per event loop);
    ``id_map``: string id -> Kalos id (default :func:`kalos_id`); ``relevance_score_fn``: score
    -> [0, 1]. ``embedding``: LangChain ``Embeddings``; None: the sidecar's own model
    (``kalos serve --embed``, :class:`~kalos.integrations.embeddings.KalosEmbeddings`), so the
    worker loads none.

    Errors are Kalos's (``InvalidRequest``, ``PayloadTooLarge``, ``BrokerUnavailable``, timeouts,
    ...) and :class:`IdCollisionError`; a namespace that does not exist yet reads as empty.
    """

    def __init__(
        self,
        embedding: Embeddings | None = None,
        *,
        name: str = "default",
        namespace: str = "langchain",
        metric: Metric | None = None,
        timeout: float | None = 10.0,
        connect_timeout: float = 10.0,
        pool: RecallPool | None = None,
        client: RecallClient | None = None,
        pool_size: int = 4,
        id_map: Callable[[str], int] = kalos_id,
        relevance_score_fn: Callable[[float], float] | None = None,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self._conns = Connections(
            name, timeout=timeout, connect_timeout=connect_timeout, pool_size=pool_size, client=client, pool=pool
        )
        # None: the sidecar's own model (--embed), over the store's connections.
        self._embedding = embedding if embedding is not None else KalosEmbeddings(name, connections=self._conns)
        self._id_map = id_map
        self._relevance = relevance_score_fn or (relevance_fn(metric) if metric is not None else None)

    @property
    def embeddings(self) -> Embeddings:
        return self._embedding

    # ------------------------------------------------------------------ writes
    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: Sequence[str | None] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Embed and store texts; returns their string ids (generated where ``ids`` has None).
        The same id again replaces the document; raises IdCollisionError (nothing written) when
        an id's Kalos id holds another document."""
        _no_extra(kwargs, "add_texts")
        return self._conns.run(self._add(list(texts), metadatas, ids))

    async def aadd_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: Sequence[str | None] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """:meth:`add_texts` on the running loop's RecallPool."""
        _no_extra(kwargs, "aadd_texts")
        return await self._conns.arun(self._add(list(texts), metadatas, ids))

    def _add(
        self, texts: list[str], metadatas: Sequence[Mapping[str, Any] | None] | None, ids: Sequence[str | None] | None
    ) -> Plan[list[str]]:
        batch = plan_batch(texts, metadatas, ids, self._id_map)
        if not texts:
            return []
        emb = self._embedding
        [vectors] = yield [Step(lambda _: emb.embed_documents(texts), lambda _: emb.aembed_documents(texts))]
        probes = {sid: [kid] for sid, kid in zip(batch.doc_ids, batch.kalos_ids)}
        seen = yield from read_probes(self.namespace, probes, ByKey(stored_id), filled=self._conns.filled)
        at = claim(probes, seen.held)
        yield from upsert_rows(
            self.namespace,
            [at[sid] for sid in batch.doc_ids],
            np.asarray(vectors, np.float32),
            batch.payloads,
            filled=self._conns.filled,
        )
        return batch.doc_ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete documents by string id (only those: a colliding document stays), or those
        matching ``filter=``; with neither, every document (the namespace is dropped).
        Unknown ids are not an error. Returns True."""
        filter_ = kwargs.pop("filter", None)
        _no_extra(kwargs, "delete")
        return self._conns.run(self._delete(ids, filter_))

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """:meth:`delete` on the running loop's RecallPool."""
        filter_ = kwargs.pop("filter", None)
        _no_extra(kwargs, "adelete")
        return await self._conns.arun(self._delete(ids, filter_))

    def _delete(self, ids: Sequence[str] | None, filter: Mapping[str, Any] | None) -> Plan[bool]:
        """By ``lc_id`` (so a colliding document is never removed), ANDed with the metadata
        filter when both are given; ids in chunks that fit one ``$in``."""
        if ids is None and filter is None:
            yield [DROP_NAMESPACE(self.namespace)]
            self._conns.filled.discard(self.namespace)
            return True
        extra = _where(filter)
        wheres: list[Where | None] = [extra]
        if ids is not None:
            blob_bytes = (yield from layout()).blob_bytes
            wheres = [all_of([condition(ID_FIELD, FieldOp.IN, chunk), extra]) for chunk in in_chunks(ids, blob_bytes)]
        if wheres:
            yield [DELETE(where=w, namespace=self.namespace) for w in wheres]
        return True

    # ------------------------------------------------------------------ reads by id
    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents of ``ids`` that exist, in the order asked, each once."""
        return self._conns.run(self._get_by_ids(ids))

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """:meth:`get_by_ids` on the running loop's RecallPool."""
        return await self._conns.arun(self._get_by_ids(ids))

    def _get_by_ids(self, ids: Sequence[str]) -> Plan[list[Document]]:
        asked = list(dict.fromkeys(ids))
        if not asked:
            return []
        held = yield from fetch_payloads(self.namespace, [self._id_map(i) for i in asked])
        return _docs_by_id(asked, held.values())

    # ------------------------------------------------------------------ search
    def similarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, *, filter: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        """Exact top-``k`` documents for an embedding with Kalos scores (higher is better),
        best first; fewer when fewer (match). ``k`` is at most the sidecar's --max-k."""
        _no_extra(kwargs, "similarity_search")
        return self._conns.run(self._search(embedding, k, filter))

    async def asimilarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, *, filter: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        """:meth:`similarity_search_with_score_by_vector` on the running loop's RecallPool."""
        _no_extra(kwargs, "asimilarity_search")
        return await self._conns.arun(self._search(embedding, k, filter))

    def _search(
        self, embedding: Sequence[float], k: int, filter: Mapping[str, Any] | None
    ) -> Plan[list[tuple[Document, float]]]:
        [hits] = yield [
            RECALL(
                np.asarray(embedding, np.float32), k, namespace=self.namespace, with_payload=True, where=_where(filter)
            )
        ]
        return _docs_of(hits)  # (a namespace never written: no hits, as the sidecar answers it)

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """Top-``k`` documents for a text with Kalos scores (higher is better); ``filter=``."""
        return self.similarity_search_with_score_by_vector(self._embedding.embed_query(query), k, **kwargs)

    async def asimilarity_search_with_score(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        return await self.asimilarity_search_with_score_by_vector(
            await self._embedding.aembed_query(query), k, **kwargs
        )

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        """Top-``k`` documents for a text, best first; ``filter=`` on metadata."""
        return [d for d, _ in self.similarity_search_with_score(query, k, **kwargs)]

    async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [d for d, _ in await self.asimilarity_search_with_score(query, k, **kwargs)]

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return [d for d, _ in self.similarity_search_with_score_by_vector(embedding, k, **kwargs)]

    async def asimilarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return [d for d, _ in await self.asimilarity_search_with_score_by_vector(embedding, k, **kwargs)]

    # ------------------------------------------------------------------ recency
    def similarity_search_with_recency(
        self, query: str, k: int = 4, *, recency: Recency, filter: Mapping[str, Any] | None = None
    ) -> list[tuple[Document, float]]:
        """The exact top-``k`` documents (of every one in the store, ``filter=`` applied) by
        ``similarity + recency.weight * 0.5 ** (age / recency.half_life)``, age since the
        document was last written (by the sidecar's clock, when the recall is served), best
        first, with that score. Each document's metadata carries ``kalos_created_at`` and
        ``kalos_updated_at`` (seconds since the epoch). ``Recency.from_decay_rate(r)`` is
        LangChain's ``(1 - r) ** hours``."""
        _check_recency(recency)
        return self._conns.run(self._recency_search(self._embedding.embed_query(query), k, recency, filter))

    async def asimilarity_search_with_recency(
        self, query: str, k: int = 4, *, recency: Recency, filter: Mapping[str, Any] | None = None
    ) -> list[tuple[Document, float]]:
        """:meth:`similarity_search_with_recency` on the running loop's RecallPool."""
        _check_recency(recency)
        embedding = await self._embedding.aembed_query(query)
        return await self._conns.arun(self._recency_search(embedding, k, recency, filter))

    def _recency_search(
        self, embedding: Sequence[float], k: int, recency: Recency, filter: Mapping[str, Any] | None
    ) -> Plan[list[tuple[Document, float]]]:
        [hits] = yield [
            RECALL(
                np.asarray(embedding, np.float32),
                k,
                namespace=self.namespace,
                with_payload=True,
                where=_where(filter),
                recency=recency,
            )
        ]
        return _timed_docs_of(hits)

    def as_time_weighted_retriever(
        self, *, decay_rate: float = 0.01, k: int = 4, weight: float = 1.0, filter: Mapping[str, Any] | None = None
    ) -> KalosTimeWeightedRetriever:
        """A retriever ranking by similarity plus ``weight * (1 - decay_rate) ** hours`` since a
        document was last written: :class:`KalosTimeWeightedRetriever`."""
        search_kwargs = {} if filter is None else {"filter": dict(filter)}
        return KalosTimeWeightedRetriever(
            vectorstore=self, decay_rate=decay_rate, k=k, weight=weight, search_kwargs=search_kwargs
        )

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        if self._relevance is None:  # the sidecar's metric: from an open pool, else the client
            self._relevance = relevance_fn(self._conns.metric())
        return self._relevance

    # ------------------------------------------------------------------ MMR
    def max_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        """``k`` documents by maximal marginal relevance among the exact top-``fetch_k`` (at most
        the sidecar's --max-k); ``filter=``. Two requests: the recall, then the candidates'
        vectors (as stored: unit rows under cosine; MMR compares by cosine in any metric)."""
        filter_ = kwargs.pop("filter", None)
        _no_extra(kwargs, "max_marginal_relevance_search")
        return self._conns.run(self._mmr(embedding, k, fetch_k, lambda_mult, filter_))

    async def amax_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        """:meth:`max_marginal_relevance_search_by_vector` on the running loop's RecallPool."""
        filter_ = kwargs.pop("filter", None)
        _no_extra(kwargs, "amax_marginal_relevance_search")
        return await self._conns.arun(self._mmr(embedding, k, fetch_k, lambda_mult, filter_))

    def _mmr(
        self, embedding: list[float], k: int, fetch_k: int, lambda_mult: float, filter: Mapping[str, Any] | None
    ) -> Plan[list[Document]]:
        where = _where(filter)
        max_k = (yield from layout()).max_k
        [hits] = yield [
            RECALL(
                np.asarray(embedding, np.float32), _fetch_k(k, fetch_k, max_k), namespace=self.namespace, where=where
            )
        ]
        if len(hits) == 0:
            return []
        [records] = yield [GET(hits.ids, namespace=self.namespace, with_vectors=True)]
        return _mmr_docs(embedding, hits, records, k, lambda_mult)

    def max_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return self.max_marginal_relevance_search_by_vector(
            self._embedding.embed_query(query), k, fetch_k, lambda_mult, **kwargs
        )

    async def amax_marginal_relevance_search(
        self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5, **kwargs: Any
    ) -> list[Document]:
        return await self.amax_marginal_relevance_search_by_vector(
            await self._embedding.aembed_query(query), k, fetch_k, lambda_mult, **kwargs
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_texts(
        cls: type[_S],
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> _S:
        """A store (``kwargs``: the constructor's options) with ``texts`` added."""
        store = cls(embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    @classmethod
    async def afrom_texts(
        cls: type[_S],
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> _S:
        store = cls(embedding, **kwargs)
        await store.aadd_texts(texts, metadatas, ids=ids)
        return store


# --------------------------------------------------------------------------- the time-weighted retriever


class KalosTimeWeightedRetriever(BaseRetriever):
    """LangChain's ``TimeWeightedVectorStoreRetriever`` on Kalos's exact recency recall: the top
    ``k`` documents by ``similarity + weight * (1 - decay_rate) ** hours_passed``, computed by the
    sidecar over every document of the store (``search_kwargs={"filter": ...}`` applied), with
    ``hours_passed`` since the document was last written, on the sidecar's clock.

    Where it agrees with LangChain's retriever, and where not (docs/integrations.md, "Recency"):
    LangChain adds the vector store's *relevance* (``similarity_search_with_relevance_scores``,
    in [0, 1]) where this adds the Kalos similarity itself (the cosine under ``--metric
    cosine``); LangChain re-ranks only the ``search_kwargs["k"]`` (100) most similar documents
    and the last ``k`` it added, this ranks every document; LangChain counts hours since a
    document was last *returned* (each retrieval refreshes ``last_accessed_at``), this since it
    was last *written* (a retrieval changes nothing; add a document again to refresh it). Its
    ``other_score_keys`` and ``default_salience`` have no counterpart. ``weight`` (1 in
    LangChain) scales the recency part.

    Documents come with ``kalos_created_at`` / ``kalos_updated_at`` (seconds since the epoch)
    in their metadata. ``search_kwargs`` takes ``filter``; its ``k`` (LangChain's candidate
    count) is ignored: every document is a candidate.
    """

    vectorstore: KalosVectorStore
    decay_rate: float = 0.01
    k: int = 4
    weight: float = 1.0
    search_kwargs: dict[str, Any] = Field(default_factory=dict)

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @field_validator("decay_rate")
    @classmethod
    def _check_decay_rate(cls, v: float) -> float:
        Recency.from_decay_rate(v)  # InvalidRequest (a ValueError) outside (0, 1)
        return v

    @field_validator("search_kwargs")
    @classmethod
    def _check_search_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        extra = set(v) - {"filter", "k"}
        if extra:
            raise ValueError(f"search_kwargs takes 'filter' (and ignores 'k'), got {sorted(extra)}")
        if v.get("filter") is not None:
            to_where(v["filter"])  # InvalidRequest now rather than at the first retrieval
        return v

    @property
    def recency(self) -> Recency:
        """The sidecar's form of the decay: a half-life of ``3600 * ln(0.5) / ln(1 -
        decay_rate)`` seconds, with ``weight``."""
        return Recency.from_decay_rate(self.decay_rate, self.weight)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        found = self.vectorstore.similarity_search_with_recency(
            query, self.k, recency=self.recency, filter=self.search_kwargs.get("filter")
        )
        return [doc for doc, _ in found]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        found = await self.vectorstore.asimilarity_search_with_recency(
            query, self.k, recency=self.recency, filter=self.search_kwargs.get("filter")
        )
        return [doc for doc, _ in found]

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """Add (or rewrite, which makes them recent again) documents in the store. The sidecar
        stamps the time: LangChain's ``current_time=`` is refused."""
        _no_current_time(kwargs)
        return self.vectorstore.add_documents(documents, **kwargs)

    async def aadd_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """:meth:`add_documents` on the running loop's RecallPool."""
        _no_current_time(kwargs)
        return await self.vectorstore.aadd_documents(documents, **kwargs)


def _no_current_time(kwargs: Mapping[str, Any]) -> None:
    if "current_time" in kwargs:
        raise InvalidRequest("the sidecar stamps every write with its own clock: current_time= cannot be honoured")
