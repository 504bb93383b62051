"""Namespaces of memories: external int64 ids, payloads, dense rows on the backend.

Rows of a namespace are kept dense: a delete moves the last live rows into the holes at once
(compaction is part of the delete, so no search ever scans a tombstone), and capacity doubles when
full (one device-side copy). This module holds no I/O of its own; durability is the job of
:mod:`kalos.sidecar_cuda.persist`, called by the server before anything here changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..broker.layout import Metric
from ..broker.validation import WhereNode, decode_where
from .backends.base import (
    Backend,
    PendingSearch,
    SearchResult,
    completed,
    prepare_queries,
    prepare_rows,
)
from .filters import PayloadIndex

MIN_CAPACITY = 1024
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
    def __init__(self, name: str, backend: Backend, dim: int, metric: Metric, capacity: int = MIN_CAPACITY) -> None:
        self.name = name
        self.dim = dim
        self.metric = metric
        self.matrix = backend.new_matrix(dim, capacity, metric)
        self.row_ids = np.full(self.matrix.capacity, -1, np.int64)
        self.id_row: dict[int, int] = {}
        self.payloads: dict[int, bytes] = {}
        self.index = PayloadIndex(self.matrix.capacity)  # filter columns, row by row
        self.n = 0
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) by id, for export
        # Bumped by every write: a cached filter result (and a backend's cache keyed by it)
        # belongs to one version of the rows.
        self.version = 0
        self._filtered: OrderedDict[bytes, Filtered] = OrderedDict()

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
        self.index.grow(cap)

    def upsert(self, ids: np.ndarray, vectors: np.ndarray, payloads: list[bytes | None] | None) -> int:
        """Insert or replace records (vector and payload together). Duplicate ids: the last wins."""
        self._changed()
        keep = last_wins(ids)
        ids = ids[keep]
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

    def delete(self, ids: np.ndarray) -> int:
        """Remove the records of ``ids`` that exist; returns how many were removed."""
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
        src, dst = compaction_moves(holes, self.n)
        if len(src):
            self.matrix.move_rows(src, dst)
            self.index.move(src, dst)
            moved = self.row_ids[src]
            self.row_ids[dst] = moved
            for i, r in zip(moved.tolist(), dst.tolist()):
                self.id_row[i] = r
        self.n -= len(holes)
        self.row_ids[self.n : self.n + len(holes)] = -1
        return len(holes)

    def search(self, queries: np.ndarray, k: int) -> SearchResult:
        """Top-k (ids, scores) over the live rows; fewer than k columns when the namespace is small."""
        if self.n == 0:
            b = len(queries)
            return np.empty((b, 0), np.int64), np.empty((b, 0), np.float32)
        rows, scores = self.matrix.search(prepare_queries(queries, self.metric), self.n, k)
        return self.row_ids[rows], scores

    def _changed(self) -> None:
        self._sorted = None
        self.version += 1
        self._filtered.clear()

    def where(self, node: WhereNode) -> np.ndarray:
        """The rows [0, n) that match a parsed filter, as a bool mask."""
        return self.index.mask(node, self.n)

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
        """Ids of the records that match a parsed filter (row order)."""
        ids: np.ndarray = self.row_ids[: self.n][self.where(node)]
        return ids

    def search_where(self, queries: np.ndarray, k: int, match: np.ndarray | Filtered) -> SearchResult:
        """Top-k (ids, scores) over the matching rows only (a bool mask of rows [0, n), or a
        :meth:`filtered` result): ``min(k, matches)`` columns, never a row outside the match."""
        if isinstance(match, Filtered):
            candidates, key = match.rows, match.key
        else:
            candidates, key = match.nonzero()[0].astype(np.int64), None
        if len(candidates) == 0:
            b = len(queries)
            return np.empty((b, 0), np.int64), np.empty((b, 0), np.float32)
        rows, scores = self.matrix.search_rows(prepare_queries(queries, self.metric), self.n, k, candidates, key=key)
        return self.row_ids[rows], scores

    def search_start(self, queries: np.ndarray, k: int) -> PendingSearch:
        """``search`` started on the device: a Future of (ids, scores). No write may reach this
        namespace before it is collected (the sidecar's pipeline makes sure)."""
        if self.n == 0:
            b = len(queries)
            return completed(np.empty((b, 0), np.int64), np.empty((b, 0), np.float32))
        return self.matrix.search_async(prepare_queries(queries, self.metric), self.n, k, row_ids=self.row_ids)

    def get(self, asked: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """The records of ``asked`` that exist, in the order asked: (ids, float32 vectors as
        stored, payload JSON lines)."""
        id_row = self.id_row
        pairs = [(i, id_row[i]) for i in asked.tolist() if i in id_row]
        ids = np.array([i for i, _r in pairs], np.int64)
        rows = np.array([r for _i, r in pairs], np.int64)
        vecs = self.matrix.read_rows(rows) if len(rows) else np.empty((0, self.dim), np.float32)
        return ids, np.asarray(vecs, np.float32), [self.payloads.get(i, b"null") for i in ids.tolist()]

    def export_page(
        self, after: int, limit: int, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """Records with id > ``after`` in ascending id order, at most ``limit``: (ids, float32
        vectors as stored, payload JSON lines). A cursor over ids stays correct while writes go on.
        ``mask``: only the rows it marks (a filter's bool mask of rows [0, n))."""
        if self._sorted is None:
            ids = self.row_ids[: self.n]
            order = np.argsort(ids, kind="stable")
            self._sorted = (ids[order], order)
        sids, srows = self._sorted
        if mask is not None:
            keep = mask[srows]
            sids, srows = sids[keep], srows[keep]
        lo = int(np.searchsorted(sids, after, side="right"))
        ids = sids[lo : lo + limit]
        rows = srows[lo : lo + limit]
        vecs = self.matrix.read_rows(rows) if len(rows) else np.empty((0, self.dim), np.float32)
        return ids, np.asarray(vecs, np.float32), [self.payloads.get(i, b"null") for i in ids.tolist()]


class MemoryStore:
    """All namespaces of one sidecar."""

    def __init__(self, backend: Backend, dim: int, metric: Metric) -> None:
        self.backend = backend
        self.dim = dim
        self.metric = metric
        self.namespaces: dict[str, Namespace] = {}

    def get(self, name: str) -> Namespace | None:
        return self.namespaces.get(name)

    def get_or_create(self, name: str, capacity: int = MIN_CAPACITY) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = Namespace(name, self.backend, self.dim, self.metric, max(capacity, MIN_CAPACITY))
            self.namespaces[name] = ns
        return ns

    def drop(self, name: str) -> int:
        ns = self.namespaces.pop(name, None)
        return 0 if ns is None else ns.n

    def counts(self) -> dict[str, int]:
        return {name: ns.n for name, ns in sorted(self.namespaces.items())}
