"""Rows of one namespace on the GPU: the CUDA backend's :class:`~kalos.sidecar_cuda.backends.base.Matrix`.

Rows are stored in the storage dtype, padded with zeros to whole 16-byte vectors, with the squared
norm of every stored row beside them (for l2). Writes, moves and growth are device-side updates of
just those rows; searches are the backend's (:class:`MatrixOwner`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from ....broker.layout import Metric
from ..base import PendingSearch, SearchResult
from ..numpy_backend import topk_rows
from .kernels import BLOCK, Kernels
from .kernels import WARP_K
from .planner import (
    GATHER_CACHE_FRACTION, GATHER_CACHE_MIN_BYTES, HALF_K, filtered_plan,
)


class MatrixOwner(Protocol):
    """What a matrix uses of its backend (:class:`~kalos.sidecar_cuda.backends.cuda.backend.CupyBackend`)."""

    _cp: Any
    _stream: Any
    _kern: Kernels
    _vec: int
    _np_store: Any
    _storage_code: int
    max_k: int

    def _check_usable(self) -> None: ...

    def _guard(self, what: str) -> AbstractContextManager[None]: ...

    def _plan(self, b: int, n: int, k: int, m: CupyMatrix) -> tuple[str, int]: ...

    def _half_ok(self, m: CupyMatrix, k: int) -> bool: ...

    def free_bytes(self) -> int: ...

    def search(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int) -> SearchResult: ...

    def search_async(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int, path: str | None = None,
                     *, row_ids: np.ndarray | None = None) -> PendingSearch: ...


class CupyMatrix:
    """Rows [0, capacity) of one namespace on the GPU (see the module docstring)."""

    def __init__(self, backend: MatrixOwner, dim: int, capacity: int, metric: Metric) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        cp = backend._cp
        self.backend = backend
        self.dim = dim
        self.metric = metric
        self.dpad = -(-dim // backend._vec) * backend._vec
        self.capacity = max(1, int(capacity))
        if self.capacity >= 2**31:
            raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
        self.l2 = int(metric == Metric.L2)
        # An upper bound on the norm of every stored row (the half-score path's error bound):
        # raised by writes, never lowered (moves and deletes leave it a valid bound).
        self.max_norm = 0.0
        with backend._stream:
            self.data = cp.zeros((self.capacity, self.dpad), backend._np_store)
            self.sqn = cp.zeros(self.capacity, np.float32)
        self.ptrs = (int(self.data.data.ptr), int(self.sqn.data.ptr))
        self._gathered: OrderedDict[Hashable, CupyMatrix] = OrderedDict()  # search_rows' cache
        # Queries served by each way of search_rows: "overfetch_<k'>", "gathered", "gather_reused".
        self.filter_stats = {"gathered": 0, "gather_reused": 0}
        # Rows [0, n) as stored, widened to float32, and their squared norms (l2): the host
        # path's copy, read back on first use and dropped by every write, move or growth.
        self._host: tuple[np.ndarray, np.ndarray] | None = None

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        vectors = np.ascontiguousarray(vectors, np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(rows), self.dim):
            raise ValueError(f"vectors of shape {vectors.shape} for {len(rows)} rows of dim {self.dim}")
        if len(rows) == 0:
            return
        if rows.min() < 0 or rows.max() >= self.capacity:
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        self._forget_gathered()
        norm = float(np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64).max()))
        # Rounding to a 16-bit format lengthens a row by a relative 2^-8 at most, plus 2^-25 per
        # element where float16 values are subnormal.
        self.max_norm = max(self.max_norm, norm * (1.0 + 2.0 ** -7) + math.sqrt(self.dpad) * 2.0 ** -24)
        cp = be._cp
        with be._guard("write_rows"), be._stream:
            d_rows = cp.asarray(rows)
            d_vec = cp.asarray(vectors)
            m = len(rows)
            be._kern.write((-(-m * 32 // BLOCK),), (BLOCK,),
                        (self.data, self.sqn, np.int32(self.dpad), d_rows, d_vec, np.int32(m),
                         np.int32(self.dim)), stream=be._stream)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        src = np.ascontiguousarray(src, np.int64).reshape(-1)
        dst = np.ascontiguousarray(dst, np.int64).reshape(-1)
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if len(src) == 0:
            return
        if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= self.capacity:
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        self._forget_gathered()
        cp = be._cp
        with be._guard("move_rows"), be._stream:
            m = len(src)
            be._kern.move((-(-m * 32 // BLOCK),), (BLOCK,),
                       (self.data, self.sqn, np.int32(self.dpad), cp.asarray(src), cp.asarray(dst),
                        np.int32(m)), stream=be._stream)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        if capacity >= 2**31:
            raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
        be = self.backend
        be._check_usable()
        self._forget_gathered()
        cp = be._cp
        with be._guard(f"growing a matrix to {capacity} rows"), be._stream:
            data = cp.zeros((capacity, self.dpad), be._np_store)
            sqn = cp.zeros(capacity, np.float32)
            data[: self.capacity] = self.data  # device-to-device
            sqn[: self.capacity] = self.sqn
            self.data, self.sqn, self.capacity = data, sqn, capacity
            self.ptrs = (int(data.data.ptr), int(sqn.data.ptr))

    def search(self, queries: np.ndarray, n: int, k: int) -> SearchResult:
        return self.backend.search(self, queries, n, k)

    def search_async(self, queries: np.ndarray, n: int, k: int, *,
                     row_ids: np.ndarray | None = None) -> PendingSearch:
        return self.backend.search_async(self, queries, n, k, row_ids=row_ids)

    def host_search(self, queries: np.ndarray, n: int, k: int) -> SearchResult:
        """Exact top-k of float32 ``queries`` over rows [0, n), scored on the CPU from the host
        copy of the stored rows (the backend's ``host`` path: work too small to pay a launch).
        The formulas are the kernels': q.x, or 2 q.x - |x|^2 - |q|^2 for l2."""
        rows, sqn = self._host_copy(n)
        scores: np.ndarray = queries.dot(rows[:n].T)
        if self.l2:
            qn = np.einsum("ij,ij->i", queries, queries)
            scores = 2.0 * scores - sqn[None, :n] - qn[:, None]
        return topk_rows(scores, k)

    def _host_copy(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The host copy of rows [0, n) at least, read back (behind every write on the stream)
        when there is none or it is shorter."""
        h = self._host
        if h is None or len(h[0]) < n:
            rows = self.read_rows(np.arange(n))
            sqn = np.zeros(n, np.float32)
            if self.l2:
                be = self.backend
                with be._guard("reading norms"), be._stream:
                    sqn = be._cp.asnumpy(self.sqn[:n], stream=be._stream)
                    be._stream.synchronize()
            h = self._host = (rows, sqn)
        return h

    def gathered(self, rows: np.ndarray) -> CupyMatrix:
        """A new matrix holding the rows ``rows`` of this one, in that order (gathered on the
        device; nothing crosses to the host)."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        if len(rows) == 0 or rows.min() < 0 or rows.max() >= self.capacity:
            raise IndexError(f"no rows, or a row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        sub = CupyMatrix(be, self.dim, len(rows), self.metric)
        with be._guard("gathering candidate rows"), be._stream:
            d_rows = be._cp.asarray(rows)
            sub.data[...] = self.data[d_rows]
            sub.sqn[...] = self.sqn[d_rows]
        sub.max_norm = self.max_norm  # still a bound on every gathered row's norm
        return sub

    def search_rows(self, queries: np.ndarray, n: int, k: int, candidates: np.ndarray, *,
                    key: Hashable = None) -> SearchResult:
        """A filtered search (see ``planner.filtered_plan``). When many rows match, the top-k'
        of every row (k' > k) is searched and the candidates' first k among them are the answer,
        proven when at least min(k, candidates) of the k' are candidates (any candidate outside
        them scores no better than all k'); a query without that proof goes on to the next
        round, then to the gathered search. Otherwise the candidates' rows are gathered into a
        matrix of their own (kept under ``key`` until the next write, within a byte budget) and
        searched by the same exact paths."""
        be = self.backend
        m = len(candidates)
        if m == n:  # (candidates are sorted and unique: every row matches)
            self.filter_stats["all_rows"] = self.filter_stats.get("all_rows", 0) + len(queries)
            return be.search(self, queries, n, k)
        b = len(queries)
        kk = min(k, m)
        out_r = np.empty((b, kk), np.int64)
        out_s = np.empty((b, kk), np.float32)
        todo = np.arange(b)
        for kp in filtered_plan(k, m, n, be.max_k, cheap_k=self._cheap_k(b, n),
                                gather_kept=self._gather_kept(key, m)):
            rows, scores = be.search(self, np.ascontiguousarray(queries[todo]), n, kp)
            pos = np.minimum(np.searchsorted(candidates, rows), m - 1)
            hit = candidates[pos] == rows
            proven = hit.sum(axis=1) >= kk
            for i in np.flatnonzero(proven).tolist():
                cols = np.flatnonzero(hit[i])[:kk]
                out_r[todo[i]], out_s[todo[i]] = rows[i, cols], scores[i, cols]
            self.filter_stats[f"overfetch_{kp}"] = self.filter_stats.get(f"overfetch_{kp}", 0) + int(proven.sum())
            todo = todo[~proven]
            if len(todo) == 0:
                return out_r, out_s
        if len(todo) == b:
            return self._search_gathered(queries, k, candidates, key)
        out_r[todo], out_s[todo] = self._search_gathered(np.ascontiguousarray(queries[todo]), k,
                                                         candidates, key)
        return out_r, out_s

    def _search_gathered(self, queries: np.ndarray, k: int, candidates: np.ndarray,
                         key: Hashable) -> SearchResult:
        self.filter_stats["gathered"] += len(queries)
        sub = self._gathered.get(key) if key is not None else None
        if sub is None:
            sub = self.gathered(candidates)
            if key is not None and sub.data.nbytes <= self._gather_budget():
                while self._gathered and (sum(g.data.nbytes for g in self._gathered.values())
                                          + sub.data.nbytes > self._gather_budget()):
                    self._gathered.popitem(last=False)
                self._gathered[key] = sub
        else:
            self._gathered.move_to_end(key)
            self.filter_stats["gather_reused"] += len(queries)
        rows, scores = self.backend.search(sub, queries, len(candidates), k)
        return np.asarray(candidates, np.int64)[rows], scores

    def _cheap_k(self, b: int, n: int) -> int:
        """The largest k' a batch of b queries can over-fetch on the path of its unfiltered
        search: HALF_K where that is the half-score GEMM or the wgmma path (both serve k <= 16),
        else WARP_K."""
        path, _ = self.backend._plan(b, n, HALF_K, self)
        return HALF_K if path in ("gemmh", "wgmma") else WARP_K

    def _gather_kept(self, key: Hashable, matches: int) -> bool:
        """Are the gathered rows of ``key`` cached, or would they be?"""
        if key is None:
            return False
        return key in self._gathered or matches * self.data.shape[1] * self.data.itemsize <= self._gather_budget()

    def _gather_budget(self) -> int:
        """Device bytes the gathered-rows cache may hold: GATHER_CACHE_FRACTION of this matrix,
        at least 64 MiB, and never more than a quarter of the free device memory."""
        quarter = self.backend.free_bytes() // 4
        return max(min(GATHER_CACHE_MIN_BYTES, quarter), min(int(self.data.nbytes * GATHER_CACHE_FRACTION), quarter))

    def _forget_gathered(self) -> None:
        """The rows change: gathered copies of them, and the host copy, are stale."""
        self._gathered.clear()
        self._host = None

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Stored rows as float32 (m, d): the storage dtype's values, widened (for export)."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.capacity):
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        with be._guard("read_rows"), be._stream:
            sel = self.data[be._cp.asarray(rows)][:, : self.dim]
            raw: np.ndarray = be._cp.asnumpy(sel, stream=be._stream)
            be._stream.synchronize()
        if be._storage_code == 0:
            return np.ascontiguousarray(raw, np.float32)
        if be._storage_code == 1:
            return raw.view(np.float16).astype(np.float32)
        return (raw.astype(np.uint32) << 16).view(np.float32)
