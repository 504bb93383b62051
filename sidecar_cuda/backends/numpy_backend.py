"""CPU backend: one matrix product for the whole batch, then exact top-k per query.

``search_async`` runs the search on the backend's one worker thread (numpy releases the GIL in
the product and the selection) and returns its Future, so the sidecar's pipeline overlaps it with
its own work."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from broker.layout import Metric
from sidecar_cuda.backends.base import PendingSearch, SearchResult


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
        part = x.argpartition(n - kk)[n - kk:] if kk < n else np.arange(n)
        v = x[part]
        o = v.argsort()[::-1]
        return part[o].reshape(1, kk), v[o].reshape(1, kk)
    part = scores.argpartition(n - kk, axis=1)[:, n - kk:] if kk < n else np.tile(np.arange(n), (b, 1))
    r = np.arange(b)[:, None]
    v = scores[r, part]
    o = v.argsort(axis=1)[:, ::-1]
    return part[r, o], v[r, o]


#: A filtered search scores every row and hides the non-candidates when at least 1/DENSE_FRACTION
#: of the rows are candidates; below that it gathers the candidates' rows and scores only those.
DENSE_FRACTION = 4


class NumpyMatrix:
    def __init__(self, dim: int, capacity: int, metric: Metric, backend: NumpyBackend) -> None:
        self.backend = backend  # its worker thread runs search_async
        self.dim = dim
        self.metric = metric
        self.capacity = max(1, capacity)
        self.data = np.zeros((self.capacity, dim), np.float32)
        self.sqnorm = np.zeros(self.capacity, np.float32)  # l2 only

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
        self.data, self.sqnorm, self.capacity = data, sq, capacity

    def _scores(self, queries: np.ndarray, data: np.ndarray, sqnorm: np.ndarray) -> np.ndarray:
        scores: np.ndarray = queries.dot(data.T)
        if self.metric == Metric.L2:
            qn = np.einsum("ij,ij->i", queries, queries)
            scores = 2.0 * scores - sqnorm[None, :] - qn[:, None]
        return scores

    def search(self, queries: np.ndarray, n: int, k: int) -> SearchResult:
        return topk_rows(self._scores(queries, self.data[:n], self.sqnorm[:n]), k)

    def search_rows(self, queries: np.ndarray, n: int, k: int, candidates: np.ndarray, *,
                    key: Hashable = None) -> SearchResult:
        m = len(candidates)
        if m * DENSE_FRACTION >= n:
            # Many candidates: score every row and hide the others (no gather copy). A real score
            # of -inf (overflow) could tie with a hidden row: then the gathered search decides.
            scores = self._scores(queries, self.data[:n], self.sqnorm[:n])
            hidden = np.ones(n, bool)
            hidden[candidates] = False
            scores[:, hidden] = -np.inf
            rows, best = topk_rows(scores, min(k, m))
            if not hidden[rows].any():
                return rows, best
        rows, best = topk_rows(self._scores(queries, self.data[candidates], self.sqnorm[candidates]), k)
        return candidates[rows], best

    def search_async(self, queries: np.ndarray, n: int, k: int, *,
                     row_ids: np.ndarray | None = None) -> PendingSearch:
        return self.backend.submit(self._search_ids, queries, n, k, row_ids)

    def _search_ids(self, queries: np.ndarray, n: int, k: int,
                    row_ids: np.ndarray | None) -> SearchResult:
        rows, scores = self.search(queries, n, k)
        return (rows if row_ids is None else row_ids[rows]), scores


class NumpyBackend:
    name = "numpy"
    code = 1
    max_k = 1 << 30
    placement = "cpu"

    def __init__(self) -> None:
        self.description = f"numpy {np.__version__} (CPU)"
        self._pool: ThreadPoolExecutor | None = None  # started by the first search_async

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> NumpyMatrix:
        return NumpyMatrix(dim, capacity, metric, self)

    def submit(self, fn: Callable[..., SearchResult], *args: Any) -> PendingSearch:
        """Run ``fn(*args)`` on the backend's one worker thread (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kalos-search")
        return self._pool.submit(fn, *args)

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        return np.empty(shape, dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
