"""Namespaces of memories: external int64 ids, payloads, timestamps, dense rows on the backend.

Rows of a namespace are kept dense: a delete moves the last live rows into the holes at once
(compaction is part of the delete, so no search ever scans a tombstone), and capacity doubles when
full (one device-side copy). This module holds no I/O of its own; durability is the job of
:mod:`kalos.sidecar_cuda.storage.sqlite`, called by the server before anything here changes.

**Time** (``broker.clock``): beside each row, host columns of its ``created``, ``updated`` and
``expires`` timestamps (int64 ns of the sidecar's clock; expires 0: never) and its ``ttl`` (for a
touch to restart). A row is expired once ``0 < expires <= now``; every read here takes ``now`` from
the namespace's clock and leaves expired rows out, exactly (a search over the live rows, as a
filter does), until the sweeper deletes them (:meth:`Namespace.expired_ids`). It costs nothing
while nothing has expired: ``_earliest`` is a lower bound on the earliest expiry of any row
(``NO_EXPIRY`` when none may expire), and a read whose ``now`` is below it is a plain read. The
matrix keeps each row's ``updated`` (int64 ns, ``Matrix.set_times``) for recency-weighted searches.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from ...broker.clock import decay_part
from ...broker.layout import Metric, hit_meta_dtype
from ...broker.validation import WhereNode, decode_where
from ..backends.base import (
    Backend,
    Decay,
    PendingSearch,
    PolledFuture,
    SearchResult,
    Subset,
    completed,
    prepare_queries,
    prepare_rows,
)
from .filters import PayloadIndex
from .lexical import LexicalIndex, text_of

#: ``_earliest`` of a namespace none of whose rows can expire.
NO_EXPIRY = int(np.iinfo(np.int64).max)
Clock = Callable[[], int]


@dataclass(frozen=True, slots=True)
class Stamps:
    """The timestamps of rows being written, one entry per row (int64 ns; expires 0: never; ttl
    0: none): what a write resolved (``writes.Write.resolve``) or a store loaded."""

    created: np.ndarray
    updated: np.ndarray
    expires: np.ndarray
    ttl: np.ndarray

    @classmethod
    def fresh(cls, m: int, now: int) -> Stamps:
        """``m`` rows written at ``now`` that never expire."""
        return cls.written(m, now, 0)

    @classmethod
    def written(cls, m: int, now: int, ttl: int) -> Stamps:
        """``m`` new rows written at ``now`` with TTL ``ttl`` (ns; 0: never expire)."""
        t = np.full(m, now, np.int64)
        return cls(t, t.copy(), np.full(m, now + ttl if ttl else 0, np.int64), np.full(m, ttl, np.int64))

    def take(self, keep: np.ndarray) -> Stamps:
        return Stamps(self.created[keep], self.updated[keep], self.expires[keep], self.ttl[keep])


@dataclass(frozen=True, slots=True)
class Live:
    """The rows not expired in one version of a namespace, valid for ``now`` in [since, until)."""

    version: int
    since: int
    until: int  # the earliest expiry among them (NO_EXPIRY: none)
    dead: np.ndarray  # bool, rows [0, n): expired
    rows: np.ndarray  # the live rows, ascending int64


MIN_CAPACITY = 16  # rows a new namespace holds before its first growth (doubling): a namespace per user must be cheap
#: Filter results kept per namespace (LRU, keyed by the filter's bytes), valid until its next write.
FILTER_CACHE = 64


def last_wins(ids: np.ndarray) -> np.ndarray:
    """Indices into ``ids`` keeping the last occurrence of each id, in first-seen order. Pure."""
    if len(ids) == 1:
        return np.zeros(1, np.intp)
    rev = ids[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    keep = len(ids) - 1 - first_in_rev
    return np.sort(keep)


def compaction_moves(holes: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows to move after deleting the distinct rows ``holes`` from [0, n). Pure.

    Returns (src, dst): live rows of the tail [n - m, n) go into the holes below n - m, so rows
    [0, n - m) stay dense.
    """
    m = len(holes)
    new_n = n - m
    dst = np.sort(holes[holes < new_n])
    tail = np.arange(new_n, n, dtype=np.int64)
    src = tail[~np.isin(tail, holes)]
    return src, dst


@dataclass(frozen=True, slots=True)
class Filtered:
    """What a filter matches in one version of a namespace's rows."""

    mask: np.ndarray  # bool, rows [0, n)
    rows: np.ndarray  # the matching rows, ascending int64
    key: tuple[int, bytes]  # (version, filter bytes): names this row set in a backend's cache


class Namespace:
    def __init__(
        self,
        name: str,
        backend: Backend,
        dim: int,
        metric: Metric,
        capacity: int = MIN_CAPACITY,
        clock: Clock = time.time_ns,
        on_expiry: Callable[[str, int], None] | None = None,
    ) -> None:
        self.name = name
        # Told whenever ``_earliest`` falls (the store's heap of due namespaces).
        self._on_expiry = on_expiry
        self.dim = dim
        self.metric = metric
        self.clock = clock  # CLOCK_REALTIME ns: what expiry is decided at
        self.matrix = backend.new_matrix(dim, capacity, metric)
        self.row_ids = np.full(self.matrix.capacity, -1, np.int64)
        cap = self.matrix.capacity
        self.created = np.zeros(cap, np.int64)
        self.updated = np.zeros(cap, np.int64)
        self.expires = np.zeros(cap, np.int64)
        self.ttl = np.zeros(cap, np.int64)
        self.default_ttl = 0  # ns; the TTL of an upsert that names none (Op.SET_TTL)
        self._earliest = NO_EXPIRY
        self._live: Live | None = None
        self.id_row: dict[int, int] = {}
        self.payloads: dict[int, bytes] = {}
        self.index = PayloadIndex(self.matrix.capacity)  # filter columns, row by row
        self.n = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) by id, for export
        # Bumped by every write: a cached filter result (and a backend's cache keyed by it)
        # belongs to one version of the rows.
        self.version = 0
        self._filtered: OrderedDict[bytes, Filtered] = OrderedDict()
        # Hybrid recall's BM25 index of the live rows' texts: (version, live until) -> index.
        self._lexical: tuple[tuple[int, int | None], LexicalIndex] | None = None

    def ensure_capacity(self, need: int) -> None:
        """Room for ``need`` rows (capacity doubles until it fits). Raises what the backend
        raises when it cannot grow; nothing is changed then."""
        cap = self.matrix.capacity
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        self.matrix.grow(cap)
        row_ids = np.full(cap, -1, np.int64)
        row_ids[: self.n] = self.row_ids[: self.n]
        self.row_ids = row_ids
        for name in ("created", "updated", "expires", "ttl"):
            col = np.zeros(cap, np.int64)
            col[: self.n] = getattr(self, name)[: self.n]
            setattr(self, name, col)
        self.index.grow(cap)

    def upsert(
        self, ids: np.ndarray, vectors: np.ndarray, payloads: list[bytes | None] | None, stamps: Stamps | None = None
    ) -> int:
        """Insert or replace records (vector, payload and timestamps together). Duplicate ids: the
        last wins. ``stamps``: one per row (None: written now, never expiring)."""
        self._changed()
        keep = last_wins(ids)
        ids = ids[keep]
        if stamps is None:
            stamps = Stamps.fresh(len(ids), self.clock())
        else:
            stamps = stamps.take(keep)
        vectors = prepare_rows(np.ascontiguousarray(vectors[keep]), self.metric)
        rows = np.empty(len(ids), np.int64)
        new = 0
        for j, i in enumerate(ids.tolist()):
            r = self.id_row.get(i)
            if r is None:
                r = self.n + new
                new += 1
            rows[j] = r
        self.ensure_capacity(self.n + new)
        self.matrix.write_rows(rows, vectors)
        self._stamp(rows, stamps)
        kept: list[bytes | None] = []
        for j, i in enumerate(ids.tolist()):
            r = int(rows[j])
            if r >= self.n:
                self.id_row[i] = r
                self.row_ids[r] = i
            p = payloads[keep[j]] if payloads is not None else None
            kept.append(p)
            if p is None:
                self.payloads.pop(i, None)
            else:
                self.payloads[i] = p
        self.index.write(rows, kept)
        self.n += new
        return len(ids)

    def _stamp(self, rows: np.ndarray, st: Stamps) -> None:
        self.created[rows] = st.created
        self.updated[rows] = st.updated
        self.expires[rows] = st.expires
        self.ttl[rows] = st.ttl
        self._may_expire(st.expires)
        self.matrix.set_times(rows, st.updated)

    def _may_expire(self, expires: np.ndarray) -> None:
        """Rows now expire at ``expires`` (0: never): keep ``_earliest`` a lower bound."""
        pos = expires[expires > 0]
        if len(pos):
            e = int(pos.min())
            if e < self._earliest:
                self._earliest = e
                if self._on_expiry is not None:
                    self._on_expiry(self.name, e)

    def delete(self, ids: np.ndarray, now: int | None = None) -> int:
        """Remove the records of ``ids`` that exist; returns how many were removed (of them, those
        not expired at ``now``, when given: what the caller sees as existing)."""
        self._changed()
        holes_l = []
        for i in set(ids.tolist()):
            r = self.id_row.pop(i, None)
            if r is not None:
                holes_l.append(r)
                self.payloads.pop(i, None)
        if not holes_l:
            return 0
        holes = np.asarray(holes_l, np.int64)
        gone = len(holes)
        if now is not None:
            e = self.expires[holes]
            gone -= int(((e > 0) & (e <= now)).sum())
        src, dst = compaction_moves(holes, self.n)
        if len(src):
            self.matrix.move_rows(src, dst)
            self.index.move(src, dst)
            moved = self.row_ids[src]
            self.row_ids[dst] = moved
            for col in (self.created, self.updated, self.expires, self.ttl):
                col[dst] = col[src]
            self.matrix.set_times(dst, self.updated[dst])
            for i, r in zip(moved.tolist(), dst.tolist()):
                self.id_row[i] = r
        self.n -= len(holes)
        self.row_ids[self.n : self.n + len(holes)] = -1
        for col in (self.created, self.updated, self.expires, self.ttl):
            col[self.n : self.n + len(holes)] = 0
        return gone

    def touch(self, ids: np.ndarray, expires: np.ndarray, ttl: np.ndarray) -> int:
        """Rows of ``ids`` (that exist) now expire at ``expires`` with TTL ``ttl`` (resolved by
        ``writes.Write.resolve``: only ids that existed and had not expired). Returns how many."""
        rows = [self.id_row.get(i, -1) for i in ids.tolist()]
        sel = np.asarray([j for j, r in enumerate(rows) if r >= 0], np.intp)
        if len(sel) == 0:
            return 0
        self._changed()  # (an $expires_at filter's rows change)
        r = np.asarray(rows, np.int64)[sel]
        self.expires[r] = expires[sel]
        self.ttl[r] = ttl[sel]
        self._may_expire(expires[sel])
        return len(sel)

    # ------------------------------------------------------------------ time
    def stamps_for(self, ids: np.ndarray, now: int, ttl: int | None) -> Stamps:
        """The stamps of an upsert of ``ids`` at ``now``: ``created`` kept from a live record of
        the id, ``ttl`` the given one (None: the namespace default; 0: never). Pure over the
        namespace's state."""
        st = Stamps.written(len(ids), now, self.default_ttl if ttl is None else ttl)
        created = st.created
        for j, i in enumerate(ids.tolist()):
            r = self.id_row.get(i)
            if r is not None and not 0 < self.expires[r] <= now:
                created[j] = self.created[r]
        return st

    def touch_plan(self, ids: np.ndarray, now: int, ttl: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, expires, ttl) of a touch at ``now``: the ids that exist and have not expired,
        once each, each with its own TTL or ``ttl`` (0: never), expiring ``now`` + it."""
        out: list[int] = []
        ttls: list[int] = []
        for i in dict.fromkeys(ids.tolist()):
            r = self.id_row.get(i)
            if r is None or 0 < self.expires[r] <= now:
                continue
            out.append(i)
            ttls.append(int(self.ttl[r]) if ttl is None else ttl)
        t = np.asarray(ttls, np.int64)
        return np.asarray(out, np.int64), np.where(t > 0, now + t, 0), t

    def live(self, now: int) -> Live | None:
        """The rows not expired at ``now``, or None when none has expired (the plain path: free
        while ``now`` is below ``_earliest``). Kept until the next write or the next expiry."""
        if now < self._earliest:
            return None
        c = self._live
        if c is not None and c.version == self.version and c.since <= now < c.until:
            return c
        e = self.expires[: self.n]
        dead = (e > 0) & (e <= now)
        later = e[(e > now)]
        until = int(later.min()) if len(later) else NO_EXPIRY
        if not dead.any():
            self._earliest = until  # exact again: the next reads are plain until then
            self._live = None
            return None
        c = self._live = Live(self.version, now, until, dead, np.flatnonzero(~dead).astype(np.int64))
        return c

    def live_count(self, now: int) -> int:
        """Rows not expired at ``now``. Changes nothing (the metrics thread asks it too)."""
        n = self.n
        if now < self._earliest:
            return n
        e = self.expires[:n]
        return n - int(((e > 0) & (e <= now)).sum())

    def expired_ids(self, now: int, limit: int) -> np.ndarray:
        """Ids of at most ``limit`` records expired at ``now`` (the sweeper's next delete)."""
        c = self.live(now)
        if c is None:
            return np.empty(0, np.int64)
        ids: np.ndarray = self.row_ids[: self.n][c.dead][:limit]
        return ids

    def next_expiry(self) -> int:
        """A lower bound on the earliest expiry of a row (NO_EXPIRY: none can expire)."""
        return self._earliest

    def meta(self, ids: np.ndarray, now: int, decay: Decay | None = None) -> np.ndarray:
        """HIT_META records (``broker.layout.hit_meta_dtype``) of the records ``ids`` (each must
        exist): timestamps, and their recency part under ``decay`` (0 without)."""
        id_row = self.id_row
        rows = np.fromiter((id_row[i] for i in ids.tolist()), np.int64, len(ids))
        return self.meta_rows(rows, now, decay)

    def meta_rows(self, rows: np.ndarray, now: int, decay: Decay | None = None) -> np.ndarray:
        out = np.zeros(len(rows), _META)
        out["created_at_ns"] = self.created[rows]
        out["updated_at_ns"] = self.updated[rows]
        out["expires_at_ns"] = self.expires[rows]
        if decay is not None:
            out["recency"] = decay_part(self.updated[rows], now, decay.half_life_s, decay.weight)
        return out

    # ------------------------------------------------------------------ reads
    def search(
        self,
        queries: np.ndarray,
        k: int,
        *,
        match: np.ndarray | Filtered | None = None,
        decay: Decay | None = None,
        now: int | None = None,
    ) -> SearchResult:
        """The one synchronous search of a namespace: top-k (ids, scores) over its live rows, or
        with ``match`` over the matching live rows only (a bool mask of rows [0, n), or a
        :meth:`filtered` result), never a row outside it; ``min(k, rows searched)`` columns.
        ``decay``: scores are ranked with each row's recency part added (``Decay``). ``now``: the
        clock expiry is decided at (default: the decay's, else the namespace's clock now)."""
        if match is not None:
            return self._search_match(queries, k, match, decay, now)
        if self.n == 0:
            b = len(queries)
            return np.empty((b, 0), np.int64), np.empty((b, 0), np.float32)
        if self._earliest != NO_EXPIRY:
            c = self.live(now if now is not None else decay.now_ns if decay is not None else self.clock())
            if c is not None:
                return self._search_rows(queries, k, c.rows, (c.version, b"", c.until), decay)
        rows, scores = self.matrix.search(prepare_queries(queries, self.metric), self.n, k, decay=decay)
        return self.row_ids[rows], scores

    def _changed(self) -> None:
        self._sorted = None
        self.version += 1
        self._filtered.clear()
        self._live = None
        self._lexical = None

    def lexical(self, now: int) -> LexicalIndex:
        """The BM25 index of the texts of the records not expired at ``now`` (hybrid recall),
        built on first use after a write or an expiry and kept until the next."""
        live = self.live(now)
        key = (self.version, None if live is None else live.until)
        if self._lexical is None or self._lexical[0] != key:
            dead = None if live is None else live.dead
            pls = self.payloads
            texts = [
                None if dead is not None and dead[r] else text_of(pls.get(i))
                for r, i in enumerate(self.row_ids[: self.n].tolist())
            ]
            self._lexical = (key, LexicalIndex(texts))
        return self._lexical[1]

    def where(self, node: WhereNode) -> np.ndarray:
        """The rows [0, n) that match a parsed filter, as a bool mask."""
        return self.index.mask(node, self.n, self._time_columns)

    def _time_columns(self, field: str) -> np.ndarray:
        """A record timestamp column of rows [0, n), for the filters' time fields."""
        n = self.n
        if field == "$created_at":
            return self.created[:n]
        if field == "$updated_at":
            return self.updated[:n]
        e = self.expires[:n]
        return np.where(e == 0, NO_EXPIRY, e)  # (never expires: +infinity)

    def filtered(self, node: WhereNode, key: bytes) -> Filtered:
        """The rows a filter matches, evaluated once per version of the rows: ``key`` (the
        filter's encoded bytes) finds an earlier evaluation of the same filter (LRU)."""
        hit = self._filtered.get(key)
        if hit is not None:
            self._filtered.move_to_end(key)
            return hit
        mask = self.where(node)
        f = Filtered(mask, mask.nonzero()[0].astype(np.int64), (self.version, key))
        self._filtered[key] = f
        while len(self._filtered) > FILTER_CACHE:
            self._filtered.popitem(last=False)
        return f

    def filtered_bytes(self, blob: bytes) -> Filtered:
        """:meth:`filtered` of a filter still in its encoded bytes (a client wrote them: parsed
        only when no earlier evaluation of the same bytes is cached). Raises InvalidRequest."""
        hit = self._filtered.get(blob)
        if hit is not None:
            self._filtered.move_to_end(blob)
            return hit
        return self.filtered(decode_where(blob), blob)

    def matching_ids(self, node: WhereNode) -> np.ndarray:
        """Ids of the records that match a parsed filter (row order; expired ones too: a delete
        by filter removes them with the rest)."""
        ids: np.ndarray = self.row_ids[: self.n][self.where(node)]
        return ids

    def _search_match(
        self, queries: np.ndarray, k: int, match: np.ndarray | Filtered, decay: Decay | None, now: int | None
    ) -> SearchResult:
        key: Hashable
        if isinstance(match, Filtered):
            candidates, key = match.rows, match.key
        else:
            candidates, key = match.nonzero()[0].astype(np.int64), None
        if self._earliest != NO_EXPIRY and len(candidates):
            c = self.live(now if now is not None else decay.now_ns if decay is not None else self.clock())
            if c is not None:
                candidates = candidates[~c.dead[candidates]]
                key = None if key is None else (key, c.until)
        return self._search_rows(queries, k, candidates, key, decay)

    def _search_rows(
        self, queries: np.ndarray, k: int, candidates: np.ndarray, key: Hashable, decay: Decay | None
    ) -> SearchResult:
        if len(candidates) == 0:
            b = len(queries)
            return np.empty((b, 0), np.int64), np.empty((b, 0), np.float32)
        q = prepare_queries(queries, self.metric)
        rows, scores = self.matrix.search(q, self.n, k, within=Subset(candidates, key), decay=decay)
        return self.row_ids[rows], scores

    def search_start(self, queries: np.ndarray, k: int, *, match: Filtered | None = None) -> PendingSearch:
        """:meth:`search` started on the device: a Future of (ids, scores). No write may reach this
        namespace before it is collected (the sidecar's pipeline makes sure). With ``match`` (a
        filter's rows) or expired rows not yet swept, the search is done at once."""
        if match is not None:
            return completed(*self._search_match(queries, k, match, None, None))
        if self.n == 0:
            b = len(queries)
            return completed(np.empty((b, 0), np.int64), np.empty((b, 0), np.float32))
        if self._earliest != NO_EXPIRY:
            c = self.live(self.clock())
            if c is not None:
                return completed(*self._search_rows(queries, k, c.rows, (c.version, b"", c.until), None))
        return self.matrix.search_start(prepare_queries(queries, self.metric), self.n, k, row_ids=self.row_ids)

    def get(self, asked: np.ndarray, now: int | None = None) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """The records of ``asked`` that exist (and have not expired at ``now``; default: the
        namespace's clock), in the order asked: (ids, float32 vectors as stored, payload JSON
        lines)."""
        ids, vecs, pls, _rows = self.get_rows(asked, now)
        return ids, vecs, pls

    def get_rows(
        self, asked: np.ndarray, now: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[bytes], np.ndarray]:
        """:meth:`get`, and the records' rows (their timestamps: :meth:`meta_rows`)."""
        id_row = self.id_row
        pairs = [(i, id_row[i]) for i in asked.tolist() if i in id_row]
        if pairs and self._earliest != NO_EXPIRY:
            t = self.clock() if now is None else now
            e = self.expires
            pairs = [(i, r) for i, r in pairs if not 0 < e[r] <= t]
        ids = np.array([i for i, _r in pairs], np.int64)
        rows = np.array([r for _i, r in pairs], np.int64)
        vecs = self.matrix.read_rows(rows) if len(rows) else np.empty((0, self.dim), np.float32)
        return ids, np.asarray(vecs, np.float32), [self.payloads.get(i, b"null") for i in ids.tolist()], rows

    def export_page(
        self, after: int, limit: int, mask: np.ndarray | None = None, now: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """Records with id > ``after`` in ascending id order, at most ``limit``: (ids, float32
        vectors as stored, payload JSON lines). A cursor over ids stays correct while writes go
        on. ``mask``: only the rows it marks (a filter's bool mask of rows [0, n)); expired records
        (at ``now``; default: the namespace's clock) never."""
        ids, vecs, pls, _rows = self.export_rows(after, limit, mask, now)
        return ids, vecs, pls

    def export_rows(
        self, after: int, limit: int, mask: np.ndarray | None = None, now: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[bytes], np.ndarray]:
        """:meth:`export_page`, and the records' rows (their timestamps: :meth:`meta_rows`)."""
        if self._sorted is None:
            ids = self.row_ids[: self.n]
            order = np.argsort(ids, kind="stable")
            self._sorted = (ids[order], order)
        sids, srows = self._sorted
        if self._earliest != NO_EXPIRY:
            c = self.live(self.clock() if now is None else now)
            if c is not None:
                mask = ~c.dead if mask is None else mask & ~c.dead
        if mask is not None:
            keep = mask[srows]
            sids, srows = sids[keep], srows[keep]
        lo = int(np.searchsorted(sids, after, side="right"))
        ids = sids[lo : lo + limit]
        rows = srows[lo : lo + limit]
        vecs = self.matrix.read_rows(rows) if len(rows) else np.empty((0, self.dim), np.float32)
        return ids, np.asarray(vecs, np.float32), [self.payloads.get(i, b"null") for i in ids.tolist()], rows


_META = hit_meta_dtype()


#: ``map_ids(tables, rows, out)``: ``out[j] = tables[j][rows[j]]``, -1 where ``rows[j]`` is -1
#: (:func:`map_row_ids`; the sidecar passes its compiled twin, ``SlotIO.map_ids``).
MapIds = Callable[[list[np.ndarray], np.ndarray, np.ndarray], None]


def map_row_ids(tables: list[np.ndarray], rows: np.ndarray, out: np.ndarray) -> None:
    """A mixed search's ids: ``out[j] = tables[j][rows[j]]`` and -1 where ``rows[j]`` is negative
    (no hit); ValueError for a row past its table. One small take a query (the compiled
    ``SlotIO.map_ids`` does the same without a Python call per query)."""
    if len(tables) != len(rows) or out.shape != rows.shape:
        raise ValueError("map_ids: one table per row of rows, and out shaped as rows")
    try:
        for j, table in enumerate(tables):
            out[j] = table.take(rows[j])  # (a -1 takes the last id: set to -1 below)
    except IndexError as e:  # a row past its table
        raise ValueError(f"map_ids: {e}") from None
    out[rows < 0] = -1


class MixedSearch(PolledFuture[SearchResult]):
    """A mixed-namespace search under way (:meth:`MemoryStore.search_mixed`): the namespaces
    searched on their own are in ``ids``/``scores`` already; the backend's one search of the rest
    is ``pending``, its rows mapped to each namespace's ids when collected (``map_ids``)."""

    def __init__(
        self,
        ids: np.ndarray,
        scores: np.ndarray,
        pending: PendingSearch | None,
        sel: np.ndarray,
        row_ids: list[np.ndarray],
        map_ids: MapIds = map_row_ids,
    ) -> None:
        super().__init__()
        self._ids, self._scores, self._pending = ids, scores, pending
        self._sel = sel  # the queries the backend searched, in its order
        self._row_ids = row_ids  # each of them: its namespace's row_ids
        self._map_ids = map_ids

    def _poll(self) -> bool:
        return self._pending is None or self._pending.done()

    def _collect(self) -> SearchResult:
        ids, scores = self._ids, self._scores
        if self._pending is not None:
            rows, sc = self._pending.result()
            rows = np.ascontiguousarray(rows, np.int64)
            if len(self._sel) == len(ids):  # (every query searched together: no scatter)
                self._map_ids(self._row_ids, rows, ids)
                return ids, sc
            got = np.empty(rows.shape, np.int64)
            self._map_ids(self._row_ids, rows, got)
            ids[self._sel] = got
            scores[self._sel] = sc
        return ids, scores


class MemoryStore:
    """All namespaces of one sidecar. ``clock``: CLOCK_REALTIME ns (tests give a fake one)."""

    def __init__(self, backend: Backend, dim: int, metric: Metric, clock: Clock = time.time_ns) -> None:
        self.backend = backend
        self.dim = dim
        self.metric = metric
        self.clock = clock
        self.namespaces: dict[str, Namespace] = {}
        # (a lower bound on a namespace's earliest expiry, its name), a heap: which namespaces may
        # be due is found without visiting the others (entries of dropped namespaces, or bounds
        # that rose since, are dropped or renewed when they surface).
        self._expiring: list[tuple[int, str]] = []

    def get(self, name: str) -> Namespace | None:
        return self.namespaces.get(name)

    def get_or_create(self, name: str, capacity: int = MIN_CAPACITY) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = Namespace(
                name, self.backend, self.dim, self.metric, max(capacity, MIN_CAPACITY), self.clock, self._may_expire
            )
            self.namespaces[name] = ns
        return ns

    def _may_expire(self, name: str, t: int) -> None:
        heapq.heappush(self._expiring, (t, name))

    def due(self, now: int) -> list[str]:
        """The namespaces that may hold records expired at ``now`` (their earliest expiry, a lower
        bound, has passed), found from the heap: the cost follows the namespaces with expiring
        records that surface, not the namespaces held."""
        heap = self._expiring
        seen: dict[str, Namespace] = {}
        while heap and heap[0][0] <= now:
            _t, name = heapq.heappop(heap)
            ns = self.namespaces.get(name)
            if ns is not None:
                seen[name] = ns
        out = []
        for name, ns in seen.items():
            e = ns.next_expiry()
            if e != NO_EXPIRY:
                heapq.heappush(heap, (e, name))  # (renewed: the sweep or a read may raise it later)
            if e <= now:
                out.append(name)
        return out

    def search_mixed(
        self,
        spaces: list[Namespace | None],
        of_query: np.ndarray,
        queries: np.ndarray,
        k: int,
        now: int | None = None,
        map_ids: MapIds = map_row_ids,
    ) -> PendingSearch:
        """Each query over its own namespace's live rows: query j searches ``spaces[of_query[j]]``
        (None: a namespace that does not exist, no hits). A Future of (ids int64 (Q, k), scores
        float32 (Q, k)), best first, padded with id -1 and score -inf past a namespace's hits.

        The namespaces the backend takes together (up to ``backend.mixed_rows`` rows, nothing
        expired at ``now``) are searched in one ``search_mixed`` call: on CUDA one launch, each
        query reading its own namespace's rows. The others (expired rows not yet swept: a search
        of the live rows; larger ones: the planner's paths, their queries batched) are searched
        first, one search each, and are done when this returns."""
        b = len(queries)
        t = self.clock() if now is None else now
        limit = self.backend.mixed_rows
        # Per namespace (not per query): searched with the others (its index among them), on its
        # own (-2), or not at all (-1: it does not exist or is empty).
        slot_of = [-1] * len(spaces)
        together: list[Namespace] = []
        alone: list[int] = []
        for i, ns in enumerate(spaces):  # (a plain loop: it runs for every namespace of a batch)
            if ns is None or not ns.n:
                continue
            if ns.n <= limit and (t < ns._earliest or ns.live(t) is None):
                slot_of[i] = len(together)
                together.append(ns)
            else:
                slot_of[i] = -2
                alone.append(i)
        of = np.array(slot_of, np.intp)[of_query]
        if not alone and len(together) == len(spaces):  # (the common batch: every query together)
            sel = np.arange(b)
            ids = np.empty((b, k), np.int64)
            scores = np.empty((b, k), np.float32)
        else:
            ids = np.full((b, k), -1, np.int64)
            scores = np.full((b, k), -np.inf, np.float32)
            for i in alone:
                idx = np.flatnonzero(of_query == i)
                ns = spaces[i]
                assert ns is not None
                r_ids, r_scores = ns.search(queries[idx], k, now=t)
                ids[idx, : r_ids.shape[1]] = r_ids
                scores[idx, : r_ids.shape[1]] = r_scores
            sel = np.flatnonzero(of >= 0)
            if not len(sel):
                return MixedSearch(ids, scores, None, sel, [])
            of = of[sel]
            queries = queries[sel]
        mats = [ns.matrix for ns in together]
        sizes = np.fromiter((ns.n for ns in together), np.int64, len(together))
        pending = self.backend.search_mixed(mats, sizes, of, prepare_queries(queries, self.metric), k)
        tables = [ns.row_ids for ns in together]
        return MixedSearch(ids, scores, pending, sel, [tables[j] for j in of.tolist()], map_ids)

    def drop(self, name: str, now: int | None = None) -> int:
        """Remove a namespace; returns its rows (those not expired at ``now``, when given)."""
        ns = self.namespaces.pop(name, None)
        if ns is None:
            return 0
        return ns.n if now is None else ns.live_count(now)

    def counts(self, now: int | None = None) -> dict[str, int]:
        """Rows per namespace: those not expired at ``now`` (default: the clock)."""
        t = self.clock() if now is None else now
        return {name: ns.live_count(t) for name, ns in sorted(self.namespaces.items())}

    def next_expiry(self) -> int:
        """A lower bound on the earliest expiry of any row (NO_EXPIRY: none can expire)."""
        return self._expiring[0][0] if self._expiring else NO_EXPIRY
