"""The public operations, written once: :class:`AsyncOps` (this file, by hand) is what
``RecallPool`` offers; ``_ops_sync.py`` is generated from it (``make ops``: ``clients/_unasync.py``
drops ``async``/``await``) and is what ``RecallClient`` offers. Each operation validates and
encodes its request (``_requests``: a ``Prepared[R]``), then hands it to the driver's hooks:

* ``_gate()``: refuse at once where the driver's state says so (before a recall is encoded);
* ``_execute(p, timeout, t0) -> R``: one request, within ``timeout`` (the call began at ``t0``);
* ``_execute_all(preps, timeout, t0) -> list[R]``: a read's chunks;
* ``_write(op, preps, timeout, t0) -> Written``: a write's chunks, settled into one outcome.

A driver sets ``name``, ``_ns``, ``_fast``, ``_timeout``, ``_payload_limit`` and ``_embed_dim`` (the
sidecar's model's dimension, 0: none) and has a ``layout`` (a property that refuses once closed) over ``_layout``. The text operations (``embed``,
``upsert_text``, ``recall_text``, ``recall_text_many``) embed in the sidecar (Op.EMBED: every
client's text requests of a pass in one forward pass), then write or recall as the vector
operations do, within one budget.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from ..broker.clock import Recency
from ..broker.errors import InvalidRequest
from ..broker.layout import Layout, Op
from ..broker.lexical import Hybrid
from ..broker.positions import Position
from ._requests import (
    DEFAULT,
    ONE,
    ROWS,
    FastRows,
    NamespaceCache,
    Prepared,
    Timeout,
    hybrid_recall,
    merge_records,
    remaining,
    resolve_timeout,
    text_payloads,
    wait_after,
)
from ._requests import count as encode_count
from ._requests import delete as encode_delete
from ._requests import drop as encode_drop
from ._requests import embed as encode_embed
from ._requests import export_page as encode_export_page
from ._requests import get as encode_get
from ._requests import list_namespaces as encode_list_namespaces
from ._requests import recall as encode_recall
from ._requests import set_ttl as encode_set_ttl
from ._requests import touch as encode_touch
from ._requests import upsert as encode_upsert
from .results import Hits, Records, Written

R = TypeVar("R")


class AsyncOps:
    """The operations of an asyncio driver (``RecallPool``); see the module docstring."""

    name: str
    _ns: NamespaceCache
    _fast: FastRows | None
    _timeout: float | None
    _payload_limit: int
    _embed_dim: int
    _features: int
    _layout: Layout

    @property
    def layout(self) -> Layout:
        raise NotImplementedError

    def _gate(self) -> None:
        raise NotImplementedError

    async def _execute(self, p: Prepared[R], budget: Timeout, t0: int) -> R:
        raise NotImplementedError

    async def _execute_all(self, preps: list[Prepared[R]], timeout: Timeout, t0: int) -> list[R]:
        raise NotImplementedError

    async def _write(self, op: Op, preps: list[Prepared[Written]], budget: Timeout, t0: int) -> Written:
        raise NotImplementedError

    async def recall(
        self,
        vector: Any,
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        with_payload: bool = False,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        with_times: bool = False,
        refresh_ttl: bool = False,
    ) -> Hits:
        """Exact top-``k`` of one vector (shape (dim,)) in ``namespace``, best first. An expired
        record is never returned (README, "Memory over time").

        ``where``: only records whose payload matches the filter (README, "Filters"; the record
        timestamps ``$created_at``, ``$updated_at``, ``$expires_at`` too); fewer than ``k`` hits
        when fewer match, none when nothing does.

        ``recency``: rank by ``similarity + weight * 0.5 ** (age / half_life)`` (a
        :class:`~kalos.broker.clock.Recency`; age since the record's last write, on the sidecar's
        clock): the exact top-k under that score; each hit reports both parts and its timestamps.
        ``with_times``: the hits carry their timestamps (``with_payload=True`` recalls always do).
        ``refresh_ttl``: the hits' expiry restarts (their own TTL), durably, before the answer.

        ``after``: a write's ``Written.position`` (from any node of a fleet sharing one
        PostgreSQL store): served once this sidecar has applied the change log up to it, within
        ``timeout`` (then PositionTimeout, a ResponseTimeout). No wait without a fleet store.

        ``timeout`` (seconds, None = no limit; default: the pool's or client's) covers waiting for
        a free slot and for the answer. Raises InvalidRequest (bad vector/k/namespace name/recency, before
        anything is sent), AcquireTimeout, ResponseTimeout, BrokerUnavailable,
        ClosedError.
        """
        t0 = time.monotonic_ns()
        self._gate()  # (then the layout without a second check: the recall is the hot path)
        p = encode_recall(
            self._layout,
            vector,
            k,
            self._ns.encode(namespace),
            with_payload,
            ONE,
            where,
            self._fast,
            recency=recency,
            with_times=with_times,
            refresh_ttl=refresh_ttl,
        )
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return await self._execute(p, timeout, t0)

    async def recall_many(
        self,
        vectors: Any,
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        with_payload: bool = False,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        with_times: bool = False,
        refresh_ttl: bool = False,
    ) -> list[Hits]:
        """Top-``k`` for each row of ``vectors`` (n, dim), n <= the broker's max_queries, in one
        slot and one round trip (``where``, ``recency``, ``with_times``, ``refresh_ttl``: one for
        every row; ``after``: as in :meth:`recall`). Same errors as :meth:`recall`."""
        t0 = time.monotonic_ns()
        self._gate()
        p = encode_recall(
            self._layout,
            vectors,
            k,
            self._ns.encode(namespace),
            with_payload,
            ROWS,
            where,
            self._fast,
            recency=recency,
            with_times=with_times,
            refresh_ttl=refresh_ttl,
        )
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return await self._execute(p, timeout, t0)

    async def upsert(
        self,
        ids: Any,
        vectors: Any,
        payloads: list[Any] | None = None,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        ttl: float | Sequence[float | None] | None = None,
    ) -> Written:
        """Insert or replace records (vector and payload together); returns the rows written
        (a :class:`Written`: an int with the fleet ``position`` of the write, for ``after=``).

        ``ttl``: seconds each record lives after this write (then it is never returned again and
        is deleted durably); None: the namespace's default (:meth:`set_default_ttl`; none unless
        set); ``math.inf``: never expires, whatever the default; or one of those per row. The
        sidecar stamps ``created_at`` (kept from an earlier write of the id) and ``updated_at``.

        ``vectors``: shape (n, dim), one row per id (README, "Vectors"); duplicate ids: the last
        wins. Every row, id and payload is checked before anything is sent (InvalidRequest;
        PayloadTooLarge for a payload over the sidecar's ``--payload-limit`` or a slot's blob
        area: the call writes nothing). Rows go in chunks (max_queries rows, a slot's blob area
        of payloads), sent concurrently over a pool's slots (a client's one after the other: after a
        failure no further chunk is sent); each chunk is durable (with
        ``--data-dir`` or ``--store``) before it is acknowledged. ``timeout`` (seconds, None = no limit) is one
        budget for the whole call. A failure after part of the call was applied (an outage, a
        store failure or the budget running out between chunks) raises PartialWrite, also an
        instance of the error that stopped it (BrokerUnavailable, ServerError, KalosTimeout ...),
        naming the ids written, not written and in doubt.
        """
        t0 = time.monotonic_ns()
        preps = encode_upsert(self.layout, ids, vectors, payloads, namespace, self._payload_limit, ttl)
        return await self._write(Op.UPSERT, preps, timeout, t0)

    async def touch(
        self, ids: Any, *, namespace: str = "default", ttl: float | None = None, timeout: Timeout = DEFAULT
    ) -> Written:
        """Restart the expiry clock of the records ``ids`` (durably): each expires its TTL after
        now, ``ttl`` seconds after now if given (``math.inf``: never). Their ``updated_at`` does
        not change (a touch is no write of the record). Returns the records touched (a
        :class:`Written`): those that exist and have not expired; unknown ids: 0, no error. Chunks
        and errors as for :meth:`delete`."""
        t0 = time.monotonic_ns()
        return await self._write(Op.TOUCH, encode_touch(self.layout, ids, namespace, ttl), timeout, t0)

    async def set_default_ttl(self, namespace: str, ttl: float | None, *, timeout: Timeout = DEFAULT) -> Written:
        """The TTL (seconds) of the records an upsert without ``ttl=`` writes into ``namespace``
        from now on (None or ``math.inf``: none); records already written keep theirs. Durable,
        kept until the namespace is dropped; creates the namespace if it does not exist."""
        return await self._execute(encode_set_ttl(namespace, ttl), timeout, time.monotonic_ns())

    async def delete(
        self,
        ids: Any = None,
        *,
        where: dict[str, Any] | None = None,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
    ) -> Written:
        """Delete records by id, or every record whose payload matches ``where`` (one of the two);
        returns how many existed (a :class:`Written`, as :meth:`upsert`). Unknown ids/namespace: 0, no error. More ids than max_queries
        go in chunks, as for :meth:`upsert` (PartialWrite if the call fails part way)."""
        t0 = time.monotonic_ns()
        preps = encode_delete(self.layout, ids, namespace, where)
        return await self._write(Op.DELETE, preps, timeout, t0)

    async def get(
        self,
        ids: Any,
        *,
        namespace: str = "default",
        with_vectors: bool = True,
        timeout: Timeout = DEFAULT,
        after: Position | str | None = None,
        refresh_ttl: bool = False,
    ) -> Records:
        """The records of ``ids`` that exist, in the order asked (id, vector as stored, payload,
        timestamps), and the ids that do not (``Records.missing``; not an error; an expired
        record does not exist). ``refresh_ttl``: the records found are touched (:meth:`touch`)
        before the answer. More ids than max_queries are sent in chunks (concurrently by a pool). Raises
        InvalidRequest (bad ids, before anything is sent), PayloadTooLarge (the
        payloads of one chunk exceed the slot's blob area), and the errors of :meth:`recall`."""
        t0 = time.monotonic_ns()
        preps = encode_get(self.layout, ids, namespace, with_vectors, refresh_ttl)
        if after is not None:  # (``after``: as in :meth:`recall`)
            wait_after(preps, after, t0, resolve_timeout(timeout, self._timeout))
        parts = await self._execute_all(preps, timeout, t0)
        return merge_records(preps, parts, self.layout.dim)

    async def drop_namespace(self, namespace: str, *, timeout: Timeout = DEFAULT) -> Written:
        """Remove a namespace and all its records; returns the rows it held (0 if unknown; a
        :class:`Written`, as :meth:`upsert`)."""
        return await self._execute(encode_drop(namespace), timeout, time.monotonic_ns())

    async def namespaces(self, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Every namespace with its row count."""
        return await self._execute(encode_list_namespaces(), timeout, time.monotonic_ns())

    async def export_page(
        self, namespace: str, after: int = -1, *, where: dict[str, Any] | None = None, timeout: Timeout = DEFAULT
    ) -> tuple[Any, Any, list[Any]]:
        """Up to max_queries records with id > ``after`` in ascending id order (those matching
        ``where``, if given): (ids int64, vectors float32 as stored, payloads); none for a
        namespace that does not exist."""
        return await self._execute(
            encode_export_page(self.layout, namespace, after, where), timeout, time.monotonic_ns()
        )

    async def count(
        self,
        namespace: str = "default",
        where: dict[str, Any] | None = None,
        *,
        timeout: Timeout = DEFAULT,
        after: Position | str | None = None,
    ) -> int:
        """Records in ``namespace`` (those matching ``where``, if given; ``after``: as in
        :meth:`recall`); 0 for a namespace that does not exist."""
        t0 = time.monotonic_ns()
        p = encode_count(self.layout, namespace, where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return await self._execute(p, timeout, t0)

    # ------------------------------------------------------------------ text
    async def embed(self, texts: Sequence[str], *, timeout: Timeout = DEFAULT) -> np.ndarray:
        """The vectors of ``texts`` under the sidecar's embedding model (``kalos serve --embed
        DIR``): (len(texts), dim) float32, in order. Texts pending from every client process are
        embedded together, in one forward pass per batch. Each text: 1 to 16,384 bytes of UTF-8,
        no NUL, not only whitespace (README, "Text"); longer than the model's token window, it
        is truncated (as sentence-transformers does). More texts than a slot holds go in chunks.
        Raises ConfigError (the sidecar serves no model), InvalidRequest (a bad text, before
        anything is sent), and the errors of :meth:`recall`."""
        t0 = time.monotonic_ns()
        self._gate()
        preps = encode_embed(self.layout, texts, self._embed_dim, self.name)
        parts = await self._execute_all(preps, timeout, t0)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def upsert_text(
        self,
        ids: Any,
        texts: Sequence[str],
        payloads: list[Any] | None = None,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        ttl: float | Sequence[float | None] | None = None,
    ) -> Written:
        """Embed ``texts`` in the sidecar (:meth:`embed`) and write them as records (:meth:`upsert`):
        each record's payload is its own (a dict, or None) with its text in the ``"text"`` field
        (``Hit.text`` reads it back). ``timeout`` is one budget for both steps. Raises what
        :meth:`embed` and :meth:`upsert` raise; InvalidRequest for a payload that is not a dict or
        None, or whose ``"text"`` is another text."""
        t0 = time.monotonic_ns()
        records = text_payloads(texts, payloads)
        budget = resolve_timeout(timeout, self._timeout)
        vectors = await self.embed(texts, timeout=budget)
        left = remaining(budget, t0, time.monotonic_ns())
        return await self.upsert(ids, vectors, records, namespace=namespace, timeout=left, ttl=ttl)

    async def recall_text(
        self,
        text: str,
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        refresh_ttl: bool = False,
        hybrid: Hybrid | None = None,
    ) -> Hits:
        """Exact top-``k`` of ``text``, embedded in the sidecar (:meth:`embed`), in ``namespace``:
        :meth:`recall` of its vector with payloads (each hit's ``text``: what :meth:`upsert_text`
        stored). ``where``, ``after``, ``recency``, ``refresh_ttl`` as for :meth:`recall`;
        ``timeout``: one budget for both steps.

        ``hybrid``: a :class:`~kalos.broker.lexical.Hybrid`: rank every record the filter admits by
        ``similarity + weight * max(bm25, 0) / max_bm25``, BM25 over the namespace's stored texts
        (README, "Text"; exact over every matching row). Not with ``recency`` (InvalidRequest);
        ConfigError from a sidecar that does not serve it."""
        t0 = time.monotonic_ns()
        budget = resolve_timeout(timeout, self._timeout)
        if hybrid is not None and recency is not None:
            raise InvalidRequest("a hybrid recall does not take recency")
        vector = await self.embed([text], timeout=budget)
        if hybrid is not None:
            p = hybrid_recall(
                self.layout, vector[0], text, hybrid, k, self._ns.encode(namespace), self._features, where,
                refresh_ttl=refresh_ttl,
            )  # fmt: skip
            if after is not None:
                wait_after([p], after, t0, budget)
            return await self._execute(p, remaining(budget, t0, time.monotonic_ns()), t0)
        return await self.recall(
            vector[0],
            k,
            namespace=namespace,
            timeout=remaining(budget, t0, time.monotonic_ns()),
            with_payload=True,
            where=where,
            after=after,
            recency=recency,
            refresh_ttl=refresh_ttl,
        )

    async def recall_text_many(
        self,
        texts: Sequence[str],
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        refresh_ttl: bool = False,
        hybrid: Hybrid | None = None,
    ) -> list[Hits]:
        """:meth:`recall_text` for each of ``texts`` (embedded together; recalled max_queries
        rows per request, or one request per text with ``hybrid``), one budget for the call."""
        t0 = time.monotonic_ns()
        budget = resolve_timeout(timeout, self._timeout)
        if hybrid is not None and recency is not None:
            raise InvalidRequest("a hybrid recall does not take recency")
        vectors = await self.embed(texts, timeout=budget)
        if hybrid is not None:
            ns = self._ns.encode(namespace)
            preps = [
                hybrid_recall(self.layout, v, t, hybrid, k, ns, self._features, where, refresh_ttl=refresh_ttl)
                for v, t in zip(vectors, texts)
            ]
            if after is not None:
                wait_after(preps, after, t0, budget)
            return await self._execute_all(preps, remaining(budget, t0, time.monotonic_ns()), t0)
        out: list[Hits] = []
        step = self.layout.max_queries
        for start in range(0, len(vectors), step):
            out += await self.recall_many(
                vectors[start : start + step],
                k,
                namespace=namespace,
                timeout=remaining(budget, t0, time.monotonic_ns()),
                with_payload=True,
                where=where,
                after=after,
                recency=recency,
                refresh_ttl=refresh_ttl,
            )
        return out


__all__ = ["AsyncOps"]
