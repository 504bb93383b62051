"""CPU backend: one matrix product for the whole batch, then exact top-k per query.

``search_start`` runs a large search (:data:`INLINE_WORK` and more) on the backend's one worker
thread (numpy releases the GIL in the product and the selection) and returns its Future, so the
sidecar's pipeline overlaps it with its own work; a smaller one runs at once on the calling thread
(handing it to a thread and back costs more than it). Products below :data:`SMALL_WORK` run on one
BLAS thread (:mod:`kalos.sidecar_cuda.backends.blas`, :func:`blas_threads`). Searches are counted
by where they ran (:class:`NumpyPath`) for the statistics."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ...broker.layout import Metric
from .base import BackendStatistics, Decay, Made, Matrix, PendingSearch, SearchCounts, SearchResult, Subset
from .blas import BlasThreads, find_blas_threads

#: Work (rows x queries x dim) below which a product runs on one BLAS thread. 2^22 is ~70 us on
#: one core of the 2-vCPU VM (n 256, 64 queries, dim 128: 69 us on one thread, 41 us on two with
#: the second core idle, milliseconds when a client holds it); a lone recall over 100k x 128
#: (2^23.6) keeps every thread (3.3 ms on one, 1.5 ms on two).
SMALL_WORK = 1 << 22
#: Work below which ``search_start`` searches at once instead of on the worker thread.
INLINE_WORK = 1 << 26


def blas_threads(work: int, default: int, others_busy: bool) -> int | None:
    """The BLAS thread count for a product of ``work``: one below :data:`SMALL_WORK`, the
    library's default above; None (leave it) while another thread may be inside BLAS, since
    the setting is process-wide. Pure."""
    want = 1 if work < SMALL_WORK else default
    if want != default and others_busy:
        return None
    return want


def topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k per row of a (B, n) score matrix, best first. Pure.

    Written with ndarray methods: on small inputs numpy's function wrappers cost more than the work.
    """
    b, n = scores.shape
    kk = min(k, n)
    if kk == 0:
        return np.empty((b, 0), np.int64), np.empty((b, 0), np.float32)
    if b == 1:  # the common single-query case: 1-d calls are several times cheaper
        x = scores[0]
        part = x.argpartition(n - kk)[n - kk :] if kk < n else np.arange(n)
        v = x[part]
        o = v.argsort()[::-1]
        return part[o].reshape(1, kk), v[o].reshape(1, kk)
    part = scores.argpartition(n - kk, axis=1)[:, n - kk :] if kk < n else np.tile(np.arange(n), (b, 1))
    r = np.arange(b)[:, None]
    v = scores[r, part]
    o = v.argsort(axis=1)[:, ::-1]
    return part[r, o], v[r, o]


class NumpyPath(str, enum.Enum):
    """Where a numpy search ran (the statistics' path label)."""

    INLINE = "inline"  # on the calling (serving) thread: small, filtered and recency-weighted searches
    WORKER = "worker"  # on the backend's search thread (INLINE_WORK and more)
    MIXED = "mixed"  # a batch over many namespaces (search_mixed): one product each, one top-k


#: Namespaces of at most this many rows share search_mixed's one score buffer and one top-k (its
#: width is the largest of them); larger ones are searched on their own.
MIXED_ROWS = 2048


#: A filtered search scores every row and hides the non-candidates when at least 1/DENSE_FRACTION
#: of the rows are candidates; below that it gathers the candidates' rows and scores only those.
DENSE_FRACTION = 4


class NumpyMatrix:
    def __init__(self, dim: int, capacity: int, metric: Metric, backend: NumpyBackend) -> None:
        self.backend = backend  # its worker thread runs search_start
        self.dim = dim
        self.metric = metric
        self.capacity = max(1, capacity)
        self.data = np.zeros((self.capacity, dim), np.float32)
        self.sqnorm = np.zeros(self.capacity, np.float32)  # l2 only
        self.times = np.zeros(self.capacity, np.int64)  # each row's time (ns), for a Decay

    def set_times(self, rows: np.ndarray, times_ns: np.ndarray) -> None:
        self.times[rows] = times_ns

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        self.data[rows] = vectors
        if self.metric == Metric.L2:
            self.sqnorm[rows] = np.einsum("ij,ij->i", vectors, vectors)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.data[dst] = self.data[src]
        self.sqnorm[dst] = self.sqnorm[src]

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        picked: np.ndarray = self.data[rows]
        return picked

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        data = np.zeros((capacity, self.dim), np.float32)
        data[: self.capacity] = self.data
        sq = np.zeros(capacity, np.float32)
        sq[: self.capacity] = self.sqnorm
        times = np.zeros(capacity, np.int64)
        times[: self.capacity] = self.times
        self.data, self.sqnorm, self.times, self.capacity = data, sq, times, capacity

    def _scores(self, queries: np.ndarray, data: np.ndarray, sqnorm: np.ndarray) -> np.ndarray:
        self.backend.threads_for(len(queries) * len(data) * self.dim)
        scores: np.ndarray = queries.dot(data.T)
        if self.metric == Metric.L2:
            qn = np.einsum("ij,ij->i", queries, queries)
            scores = 2.0 * scores - sqnorm[None, :] - qn[:, None]
        return scores

    @property
    def nbytes(self) -> int:
        """Memory of the rows and what is kept beside them (norms, times)."""
        return int(self.data.nbytes + self.sqnorm.nbytes + self.times.nbytes)

    def search(
        self, queries: np.ndarray, n: int, k: int, *, within: Subset | None = None, decay: Decay | None = None
    ) -> SearchResult:
        t0 = time.perf_counter_ns()
        if within is None:
            found = self._search(queries, n, k, decay)
        else:
            found = self._search_rows(queries, n, k, within.rows, decay)
        self.backend.counts.add(NumpyPath.INLINE, len(queries), time.perf_counter_ns() - t0)
        return found

    def _search(self, queries: np.ndarray, n: int, k: int, decay: Decay | None) -> SearchResult:
        scores = self._scores(queries, self.data[:n], self.sqnorm[:n])
        if decay is not None:
            scores += decay.bias(self.times[:n])
        return topk_rows(scores, k)

    def _search_rows(
        self, queries: np.ndarray, n: int, k: int, candidates: np.ndarray, decay: Decay | None
    ) -> SearchResult:
        m = len(candidates)
        if m * DENSE_FRACTION >= n:
            # Many candidates: score every row and hide the others (no gather copy). A real score
            # of -inf (overflow) could tie with a hidden row: then the gathered search decides.
            scores = self._scores(queries, self.data[:n], self.sqnorm[:n])
            if decay is not None:
                scores += decay.bias(self.times[:n])
            hidden = np.ones(n, bool)
            hidden[candidates] = False
            scores[:, hidden] = -np.inf
            rows, best = topk_rows(scores, min(k, m))
            if not hidden[rows].any():
                return rows, best
        scores = self._scores(queries, self.data[candidates], self.sqnorm[candidates])
        if decay is not None:
            scores += decay.bias(self.times[candidates])
        rows, best = topk_rows(scores, k)
        return candidates[rows], best

    def search_start(self, queries: np.ndarray, n: int, k: int, *, row_ids: np.ndarray | None = None) -> PendingSearch:
        if n * len(queries) * self.dim < INLINE_WORK:
            return self.backend.run_now(self._search_ids, NumpyPath.INLINE, queries, n, k, row_ids)
        return self.backend.submit(self._search_ids, NumpyPath.WORKER, queries, n, k, row_ids)

    def _search_ids(
        self, path: NumpyPath, queries: np.ndarray, n: int, k: int, row_ids: np.ndarray | None
    ) -> SearchResult:
        t0 = time.perf_counter_ns()
        rows, scores = self._search(queries, n, k, None)
        found = (rows if row_ids is None else row_ids[rows]), scores
        self.backend.counts.add(path, len(queries), time.perf_counter_ns() - t0)
        return found


class NumpyBackend:
    name = "numpy"
    code = 1
    max_k = 1 << 30
    placement = "cpu"
    mixed_rows = MIXED_ROWS

    def __init__(self) -> None:
        self.description = f"numpy {np.__version__} (CPU)"
        self._pool: ThreadPoolExecutor | None = None  # started by the first search_start
        self.blas: BlasThreads | None = find_blas_threads()
        self.counts: SearchCounts[NumpyPath] = SearchCounts()
        self._matrices = Made(NumpyMatrix)

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> NumpyMatrix:
        return self._matrices.add(NumpyMatrix(dim, capacity, metric, self))

    def search_mixed(
        self, matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> PendingSearch:
        """``Backend.search_mixed`` on this thread: one product per namespace (its rows with its
        queries) into one score buffer, padded with -inf, then one top-k for every query."""
        return self.run_now(self._mixed, self._matrices.own(matrices), n, of_query, queries, k)

    def _mixed(
        self, mats: list[NumpyMatrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> SearchResult:
        t0 = time.perf_counter_ns()
        b = len(queries)
        width = int(n.max())
        scores = np.full((b, width), -np.inf, np.float32)
        self.threads_for(0)  # (small products: one BLAS thread)
        l2 = mats[0].metric == Metric.L2
        qn = np.einsum("ij,ij->i", queries, queries) if l2 else None
        order = np.argsort(of_query, kind="stable")
        cuts = np.flatnonzero(np.diff(of_query[order])) + 1
        for idx in np.split(order, cuts):
            i = int(of_query[idx[0]])
            m, ni = mats[i], int(n[i])
            rows = m.data[:ni]
            if len(idx) == 1:  # (1-d products are several times cheaper)
                j = int(idx[0])
                s = rows.dot(queries[j])
                if qn is not None:
                    s = 2.0 * s - m.sqnorm[:ni] - qn[j]
                scores[j, :ni] = s
            else:
                s = queries[idx].dot(rows.T)
                if qn is not None:
                    s = 2.0 * s - m.sqnorm[None, :ni] - qn[idx, None]
                scores[idx, :ni] = s
        rows_, best = topk_rows(scores, k)
        pad = rows_ >= n[of_query][:, None]  # (a namespace of fewer than k rows)
        rows_[pad] = -1
        best[pad] = -np.inf
        if rows_.shape[1] < k:
            rows_ = np.pad(rows_, ((0, 0), (0, k - rows_.shape[1])), constant_values=-1)
            best = np.pad(best, ((0, 0), (0, k - best.shape[1])), constant_values=-np.inf)
        self.counts.add(NumpyPath.MIXED, b, time.perf_counter_ns() - t0)
        return rows_, best

    def statistics(self) -> BackendStatistics:
        """Searches by where they ran and batch size; the matrices' bytes (part ``rows``)."""
        matrices = self._matrices.alive()
        return BackendStatistics(self.counts.searches(), (), (("rows", sum(m.nbytes for m in matrices)),))

    def submit(self, fn: Callable[..., SearchResult], *args: Any) -> PendingSearch:
        """Run ``fn(*args)`` on the backend's one worker thread (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kalos-search")
        blas = self.blas
        if blas is None:
            return self._pool.submit(fn, *args)
        blas.enter()  # before it can start: no thread lowers the count under it
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            blas.leave()
            raise
        fut.add_done_callback(lambda _f: blas.leave())
        return fut

    @staticmethod
    def run_now(fn: Callable[..., SearchResult], *args: Any) -> PendingSearch:
        """Run ``fn(*args)`` on this thread; its result (or error) as a finished Future."""
        f: PendingSearch = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:
            f.set_exception(e)
        return f

    def threads_for(self, work: int) -> None:
        """Set the BLAS thread count for a product of ``work`` (:func:`blas_threads`)."""
        blas = self.blas
        if blas is None:
            return
        n = blas_threads(work, blas.default, blas.busy > 0)
        if n is not None:
            blas.set(n)

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        return np.empty(shape, dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.blas is not None:
            self.blas.set(self.blas.default)
