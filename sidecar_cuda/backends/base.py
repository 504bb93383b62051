"""The backend interface: where the memory matrix lives and how a batch is searched.

A backend owns device memory; everything about ids, namespaces, payloads and durability lives in
:mod:`kalos.sidecar_cuda.storage.store` and is the same for every backend. Backends are chosen in one place,
:func:`kalos.sidecar_cuda.backends.select.choose_backend`; this module imports none of them.

A search started with ``search_start`` is a :class:`concurrent.futures.Future` of (rows, scores):
a finished one (:func:`completed`), the numpy backend's worker-thread future, or a
:class:`PolledFuture` (the CUDA backend's, and the store's mapping of rows to ids), which nobody
resolves from another thread: ``done()`` asks the device without blocking, ``result()`` collects.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from ...broker.clock import decay_part
from ...broker.layout import Metric

#: (rows or ids int64 (B, kk), scores float32 (B, kk)), best first.
SearchResult = tuple[np.ndarray, np.ndarray]
#: A search under way on a backend's device (the sidecar's pipeline keeps up to two).
PendingSearch = Future[SearchResult]

T = TypeVar("T")
M = TypeVar("M")


def completed(rows: np.ndarray, scores: np.ndarray) -> PendingSearch:
    """A search that finished when it was started (empty searches)."""
    f: PendingSearch = Future()
    f.set_result((rows, scores))
    return f


class PolledFuture(Future[T]):
    """A Future resolved by whoever asks, on the asking thread (the sidecar's serving thread).

    ``done()`` never blocks: it is True once the work has finished (or failed), so that
    ``result()`` will not wait. ``result()`` collects the work (waiting if need be), resolves the
    future with its value or its exception, and returns or raises it; later calls return the same.
    Subclasses give ``_poll()`` (non-blocking: has the work finished?) and ``_collect()``.
    Not for other threads: nothing resolves it until ``result()`` is called."""

    _collected = False  # resolved (set_result or set_exception done)

    def _poll(self) -> bool:
        raise NotImplementedError

    def _collect(self) -> T:
        raise NotImplementedError

    def done(self) -> bool:
        if self._collected:
            return True
        try:
            return self._poll()
        except Exception:  # a failed device: result() raises it
            return True

    def result(self, timeout: float | None = None) -> T:
        if not self._collected:
            self._collected = True
            try:
                value = self._collect()
            except BaseException as e:
                self.set_exception(e)
                raise
            self.set_result(value)
            return value
        return super().result(timeout)


@dataclass(frozen=True, slots=True)
class Decay:
    """A recency weighting of one search (``broker.clock``): every row's score gets
    ``weight * 0.5 ** (max(0, now - t) / half_life_s)`` added before the top-k is selected, ``t``
    the row's time (:meth:`Matrix.set_times`, int64 ns). ``now_ns``: the sidecar's clock when the
    request is served (CLOCK_REALTIME ns). Ages are taken from the exact nanoseconds, as the
    answer's recency part (``broker.clock.decay_part``) is: the ranking and the answer agree."""

    now_ns: int
    half_life_s: float
    weight: float

    @property
    def now_s(self) -> float:
        return self.now_ns / 1e9

    def bias(self, times_ns: np.ndarray) -> np.ndarray:
        """The recency part of rows whose times are ``times_ns`` (int64 ns), as float32: exactly
        ``broker.clock.decay_part`` (the age from the integer nanoseconds, the rest in float64)
        rounded once to float32, so a hit's score minus its reported recency part is its
        similarity within one rounding of the float32 sum."""
        out: np.ndarray = decay_part(times_ns, self.now_ns, self.half_life_s, self.weight).astype(np.float32)
        return out


@dataclass(frozen=True, slots=True)
class Subset:
    """The candidate rows of a filtered search (``Matrix.search(within=)``): ``rows`` distinct,
    ascending int64, each < n, at least one. ``key`` names this candidate set while the rows are
    unchanged (a new key is given after any write), so a backend may keep work done for it (the
    CUDA backend's gathered rows); None keeps nothing."""

    rows: np.ndarray
    key: Hashable = None


class Matrix(Protocol):
    """Rows of one namespace, resident on the backend's device. Rows [0, n) are live."""

    capacity: int

    def set_times(self, rows: np.ndarray, times_ns: np.ndarray) -> None:
        """The time of rows ``rows`` (int64 ns since the epoch: their last write), which a
        :class:`Decay` ages. Growth keeps it; a move does not carry it (the store sets it again
        for the rows it moved)."""

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Store float32 ``vectors`` (m, d) at row indices ``rows`` (m,) (already metric-prepared)."""

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy rows ``src`` onto rows ``dst`` (compaction after deletes; src and dst disjoint)."""

    def grow(self, capacity: int) -> None:
        """Grow to hold ``capacity`` rows, keeping the existing ones."""

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Stored rows as float32 (m, d), for export."""

    def search(
        self, queries: np.ndarray, n: int, k: int, *, within: Subset | None = None, decay: Decay | None = None
    ) -> SearchResult:
        """Exact top-k over rows [0, n) for float32 ``queries`` (B, d), or with ``within`` over
        those candidate rows only (a filtered recall: every row returned is a candidate).

        Returns (rows int64 (B, kk), scores float32 (B, kk)), kk = min(k, rows searched), best
        first. Scores: dot product (dot, cosine on normalised rows), or minus the squared L2
        distance; with ``decay``, plus each row's recency part (the top-k is exact under that sum).
        """

    def search_start(self, queries: np.ndarray, n: int, k: int, *, row_ids: np.ndarray | None = None) -> PendingSearch:
        """:meth:`search` (no subset, no decay) started, returned at once. ``queries`` must stay
        untouched until the result is collected. At most two searches of a backend may be pending
        at a time, and no write, move or growth of the matrix may happen while one of its searches
        is. ``row_ids``: the result's rows come back as ``row_ids[rows]`` (the store's ids of its
        rows), looked up where the search finishes (the numpy backend's worker thread)."""


def search_each(
    matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
) -> SearchResult:
    """``Backend.search_mixed`` as one search per matrix (its queries batched): the backends with
    no gathered kernel (numpy, sharded) and the reference the CUDA kernel is tested against."""
    b = len(queries)
    rows = np.full((b, k), -1, np.int64)
    scores = np.full((b, k), -np.inf, np.float32)
    order = np.argsort(of_query, kind="stable")
    cuts = np.flatnonzero(np.diff(of_query[order])) + 1
    for idx in np.split(order, cuts) if b else ():
        i = int(of_query[idx[0]])
        r, s = matrices[i].search(queries[idx], int(n[i]), k)
        rows[idx, : r.shape[1]] = r
        scores[idx, : r.shape[1]] = s
    return rows, scores


class Made(Generic[M]):
    """The matrices of type ``kind`` a backend made that are still alive (held weakly): what its
    statistics count at scrape time, from another thread than the one that makes them."""

    def __init__(self, kind: type[M]) -> None:
        self._kind = kind
        self._alive: weakref.WeakSet[M] = weakref.WeakSet()
        self._lock = threading.Lock()  # (a scrape's copy of the set, a new matrix)

    def add(self, m: M) -> M:
        with self._lock:
            self._alive.add(m)
        return m

    def alive(self) -> list[M]:
        with self._lock:
            return list(self._alive)

    def own(self, matrices: Sequence[Matrix]) -> list[M]:
        """``matrices`` (a ``search_mixed`` argument) as this backend's kind; TypeError when one
        is another backend's."""
        mats: list[M] = []
        for m in matrices:
            if isinstance(m, self._kind):
                mats.append(m)
        if len(mats) != len(matrices):
            raise TypeError("search_mixed takes this backend's matrices")
        return mats


def size_bucket(b: int) -> str:
    """Batch-size bucket of the per-path search statistics (a metric label)."""
    return "1" if b == 1 else "2-8" if b <= 8 else "9-64" if b <= 64 else "65-512" if b <= 512 else ">512"


@dataclass(frozen=True, slots=True)
class PathStat:
    """Searches a backend served on one path for batches in one size bucket, since it started,
    and their wall time from start to answer (seconds)."""

    path: str  # the path's label: the CUDA backend's SearchPath values, the numpy backend's NumpyPath
    batch: str  # size_bucket of the batch
    searches: int
    seconds: float


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """What a backend reports of itself at scrape time (a frozen snapshot, taken from another
    thread than the serving one): ``searches`` by path and batch bucket; ``redone``: queries a
    proving path could not prove exact and redid in float32, by path; ``memory``: bytes held,
    by part (``rows``: the matrices' rows and what is kept beside them; ``int8``: the rows' int8
    copies; ``gathered``: rows of filtered searches gathered on the device; ``host_copy``: the
    CUDA host path's float32 copy, in host memory)."""

    searches: tuple[PathStat, ...] = ()
    redone: tuple[tuple[str, int], ...] = ()
    memory: tuple[tuple[str, int], ...] = ()


P = TypeVar("P", bound=enum.Enum)


class SearchCounts(Generic[P]):
    """Searches and their wall time by (path, batch-size bucket) since start: ``by_path[path,
    bucket] = [searches, ns]``; counted from any thread (the numpy backend's worker too), read by
    a scrape (:meth:`searches`). A path's label is its enum value."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_path: dict[tuple[P, str], list[int]] = {}

    def add(self, path: P, b: int, ns: int) -> None:
        key = (path, size_bucket(b))
        with self.lock:
            st = self.by_path.setdefault(key, [0, 0])
            st[0] += 1
            st[1] += ns

    def count(self, path: P) -> int:
        """Searches served on ``path``, every batch size."""
        with self.lock:
            return sum(c for (p, _bucket), (c, _ns) in self.by_path.items() if p is path)

    def clear(self) -> None:
        with self.lock:
            self.by_path.clear()

    def searches(self) -> tuple[PathStat, ...]:
        """The counts now, by path label and bucket."""
        with self.lock:
            by = sorted((str(p.value), bk, c, ns) for (p, bk), (c, ns) in self.by_path.items())
        return tuple(PathStat(p, bk, c, ns / 1e9) for p, bk, c, ns in by)


def merge_statistics(parts: Iterable[BackendStatistics]) -> BackendStatistics:
    """Several backends as one (the sharded backend's shards): every count summed by its labels."""
    searches: dict[tuple[str, str], tuple[int, float]] = {}
    redone: Counter[str] = Counter()
    memory: Counter[str] = Counter()
    for st in parts:
        for ps in st.searches:
            n, sec = searches.get((ps.path, ps.batch), (0, 0.0))
            searches[ps.path, ps.batch] = (n + ps.searches, sec + ps.seconds)
        for path, n in st.redone:
            redone[path] += n
        for part, b in st.memory:
            memory[part] += b
    return BackendStatistics(
        tuple(PathStat(p, bk, n, sec) for (p, bk), (n, sec) in sorted(searches.items())),
        tuple(sorted(redone.items())),
        tuple(sorted(memory.items())),
    )


class Backend(Protocol):
    name: str  # "numpy" | "cuda"
    code: int  # header "backend" field: 1 numpy, 2 cuda
    description: str  # human-readable device line, printed at start
    placement: str  # where the rows live: "cpu", "cuda:0", or the shards' ("cuda:0,cuda:1")
    max_k: int  # largest k this backend can serve
    # Namespaces of at most this many rows go into one search_mixed; larger ones are searched on
    # their own (the planner's paths, their queries batched per namespace).
    mixed_rows: int

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> Matrix: ...

    def search_mixed(
        self, matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> PendingSearch:
        """The exact top-k of each query over its own matrix: query j over rows [0, n[i]) of
        ``matrices[i]``, i = ``of_query[j]`` (every n[i] >= 1; queries metric-prepared, float32
        (Q, d)). A Future of (rows int64 (Q, k), scores float32 (Q, k)), best first, padded with
        row -1 and score -inf past a matrix's n rows. The rules of ``search_start`` hold."""
        ...

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """Staging memory for gathering a batch (pinned on CUDA)."""
        ...

    def statistics(self) -> BackendStatistics:
        """Searches by path, redone queries and bytes held, now (safe from another thread)."""
        ...

    def close(self) -> None: ...


def prepare_rows(vectors: np.ndarray, metric: Metric) -> np.ndarray:
    """Cosine stores unit rows (normalised at insert); dot and l2 store rows as given."""
    if metric == Metric.COSINE:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        return np.ascontiguousarray(vectors / norms, dtype=np.float32)
    return vectors


def prepare_queries(queries: np.ndarray, metric: Metric) -> np.ndarray:
    return prepare_rows(queries, metric)
