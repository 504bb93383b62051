"""One search on the CUDA backend, start to answer: :func:`start` checks the request, asks the
planner (``planner.plan``, pure) for a :class:`Plan` and has ``paths.enqueue`` put it on the
stream; :class:`CudaSearch` is the Future the sidecar polls; :func:`collect` waits for the
device, reads the answer and redoes on the float32 path the queries a proving path could not
prove. Two searches may be pending (one per buffer set of the :class:`Device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ....broker.errors import KalosError, ServerError
from ..base import Decay, PolledFuture, SearchResult
from .buffers import Buffer, BufferSet
from .device import Device
from .int8 import ensure as ensure_int8
from .kernels import MAX_K
from .paths import enqueue, search_host, search_mixed
from .planner import BIASED_PATHS, REDO, Plan, SearchPath, forced, plan, plan_biased
from .rows import DeviceRows

#: Raised by a search as they are (bad input, Kalos's own); anything else the device raises is a
#: ServerError.
_PASSED = (KalosError, ValueError, IndexError, TypeError)


class Launch:
    """One search as enqueued: what collecting it needs (``value``: answered without the device)."""

    __slots__ = ("bufs", "m", "q", "n", "k", "kk", "path", "t0", "row_ids", "value")

    def __init__(
        self, bufs: BufferSet, m: DeviceRows, q: np.ndarray, n: int, k: int, kk: int, path: SearchPath | None, t0: int
    ) -> None:
        self.bufs, self.m, self.q = bufs, m, q
        self.n, self.k, self.kk, self.path, self.t0 = n, k, kk, path, t0
        self.row_ids: np.ndarray | None = None  # rows come back as row_ids[rows]
        self.value: SearchResult | None = None


class CudaSearch(PolledFuture[SearchResult]):
    """A search enqueued on the device's stream: ``done()`` asks its CUDA event without blocking
    (a CUDA error counts as done: ``result()`` raises it as ServerError); ``result()`` waits for
    it and reads the answer (:func:`collect`)."""

    def __init__(self, dev: Device, launch: Launch) -> None:
        super().__init__()
        self._dev = dev
        self._launch = launch

    def _poll(self) -> bool:
        return self._launch.value is not None or bool(self._launch.bufs.done.done)

    def _collect(self) -> SearchResult:
        return collect(self._dev, self._launch)


class MixedSearch(PolledFuture[SearchResult]):
    """A ``kalos_mixed`` launch (:func:`start_mixed`): polled like :class:`CudaSearch`; its
    answer is k entries per query, row -1 and -inf past a namespace's rows."""

    def __init__(self, dev: Device, bufs: BufferSet, b: int, k: int, t0: int) -> None:
        super().__init__()
        self._dev, self._bufs, self._b, self._k, self._t0 = dev, bufs, b, k, t0

    def _poll(self) -> bool:
        return bool(self._bufs.done.done)

    def _collect(self) -> SearchResult:
        dev, bufs, b, k = self._dev, self._bufs, self._b, self._k
        with _collecting(dev, bufs):
            dev.wait(bufs.done)
            rows, scores = _read_answer(bufs.h_out, b, k)
        dev.stats.add(SearchPath.MIXED, b, time.perf_counter_ns() - self._t0)
        return rows, scores


def start_mixed(
    dev: Device, mats: Sequence[DeviceRows], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
) -> MixedSearch:
    """Enqueue ``Backend.search_mixed`` (``paths.search_mixed``: one launch) and return its
    Future. Raises ValueError for a bad shape, k or n, RuntimeError when two searches are
    pending already, ServerError when the device fails."""
    dev.check_usable()
    q = np.ascontiguousarray(queries, np.float32)
    b = len(q)
    n = np.asarray(n, np.int64)
    of_query = np.asarray(of_query, np.intp)
    if q.ndim != 2 or b == 0 or not mats:
        raise ValueError("search_mixed takes at least one query of one matrix")
    if any(m.dim != q.shape[1] for m in mats):
        raise ValueError(f"queries have dim {q.shape[1]}, a matrix another")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if len(n) != len(mats) or not all(1 <= int(x) <= m.capacity for x, m in zip(n, mats)):
        raise ValueError("each matrix needs 1 <= n <= its capacity")
    if len(of_query) != b or of_query.min() < 0 or of_query.max() >= len(mats):
        raise ValueError("of_query must name a matrix for every query")
    bufs = next((st for st in dev.sets if not st.busy), None)
    if bufs is None:
        raise RuntimeError("two searches are pending already: collect one first")
    t0 = time.perf_counter_ns()
    _enqueue_on(dev, bufs, lambda: search_mixed(dev, bufs, mats, n, of_query, q, k))
    return MixedSearch(dev, bufs, b, k, t0)


def plan_for(dev: Device, m: DeviceRows, b: int, n: int, k: int) -> Plan:
    """The planner's path for b queries over rows [0, n) of ``m`` on this device."""
    return plan(b, n, k, m.traits, dev.limits)


def start(
    dev: Device,
    m: DeviceRows,
    queries: np.ndarray,
    n: int,
    k: int,
    path: SearchPath | None = None,
    row_ids: np.ndarray | None = None,
    decay: Decay | None = None,
) -> CudaSearch:
    """Enqueue the exact top-k of float32 ``queries`` (b, dim) over rows [0, n) of ``m`` and
    return at once its Future; the host path answers here. ``path``: this path instead of the
    planner's (ValueError where it cannot serve the search). ``row_ids``: the answer's rows come
    back as ``row_ids[rows]``. ``decay``: recency-weighted (``planner.plan_biased``). Raises
    ValueError for a bad shape, k or n, RuntimeError when two searches are pending already,
    ServerError when the device fails, ClosedError once closed."""
    launch = _launch(dev, m, queries, n, k, path, decay)
    launch.row_ids = row_ids
    return CudaSearch(dev, launch)


def run(
    dev: Device,
    m: DeviceRows,
    queries: np.ndarray,
    n: int,
    k: int,
    path: SearchPath | None = None,
    decay: Decay | None = None,
) -> SearchResult:
    """:func:`start` and :func:`collect` at once."""
    return collect(dev, _launch(dev, m, queries, n, k, path, decay))


def _launch(
    dev: Device, m: DeviceRows, queries: np.ndarray, n: int, k: int, path: SearchPath | None, decay: Decay | None
) -> Launch:
    dev.check_usable()
    q = queries
    if q.dtype != np.float32 or q.ndim != 2 or not q.flags.c_contiguous:
        q = np.ascontiguousarray(q, np.float32).reshape(len(q), -1)
    b, d = q.shape
    if d != m.dim:
        raise ValueError(f"queries have dim {d}, the matrix {m.dim}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if not 0 <= n <= m.capacity:
        raise ValueError(f"n={n} outside the matrix capacity {m.capacity}")
    kk = min(k, n)
    bufs = next((st for st in dev.sets if not st.busy), None)
    if bufs is None:
        raise RuntimeError("two searches are pending already: collect one first")
    p = Launch(bufs, m, q, n, k, kk, path, time.perf_counter_ns())
    if b == 0 or kk == 0:
        p.value = (np.empty((b, kk), np.int64), np.empty((b, kk), np.float32))
        return p
    if decay is not None:
        if path is not None and path not in BIASED_PATHS:
            raise ValueError(f"a recency-weighted search takes the {' or '.join(x.value for x in BIASED_PATHS)} path")
        pl = plan_biased(b, n, m.traits, dev.limits) if path is None else forced(path, b, k, m.traits, dev.limits)
    else:
        pl = plan(b, n, k, m.traits, dev.limits) if path is None else forced(path, b, k, m.traits, dev.limits)
        if pl.path is SearchPath.INT8 and path is None and m.i8 is None:
            try:  # the first int8 search of these rows builds their copy, if it fits
                ensure_int8(dev, m)
            except ValueError:  # (it does not: the rows' traits now keep the planner off the path)
                pl = plan(b, n, k, m.traits, dev.limits)
    p.path = pl.path
    if pl.path is SearchPath.HOST:  # answered now, from the host copy (read back first if stale)
        p.value = search_host(dev, m, q, n, k, decay)
        return p
    _enqueue_on(dev, bufs, lambda: enqueue(dev, bufs, pl, m, q, n, k, kk, decay))
    return p


def _enqueue_on(dev: Device, bufs: BufferSet, work: Callable[[], None]) -> None:
    """Run ``work`` (enqueueing a search that writes ``bufs``) on the device, ``bufs`` busy from
    now until the search is collected; if enqueueing fails, free again, and raised as ServerError
    unless it is bad input or a Kalos error."""
    bufs.busy = True
    try:
        with dev.cuda:
            work()
    except BaseException as e:
        bufs.busy = False
        if isinstance(e, _PASSED):
            raise
        raise ServerError(f"CUDA search failed: {type(e).__name__}: {e}") from e


@contextmanager
def _collecting(dev: Device, bufs: BufferSet) -> Iterator[None]:
    """Around waiting for and reading a search's answer: what the device raises becomes
    ServerError (bad input and Kalos errors pass as they are), and however it ends ``bufs`` is
    free again and the graphs no pending search uses are pruned."""
    try:
        yield
    except _PASSED:
        raise
    except Exception as e:
        raise ServerError(f"CUDA search failed: {type(e).__name__}: {e}") from e
    finally:
        bufs.busy = False
        dev.graphs.prune(min((x.seq for x in dev.sets if x.busy), default=dev.seq + 1))


def _read_answer(out: Buffer, b: int, k: int) -> SearchResult:
    """The rows (int32 on the device, int64 here) and scores of b queries, k each, as the
    kernels leave them at the start of ``out``: all the rows, then all the scores."""
    rows = out.view(np.int32, b * k).reshape(b, k).astype(np.int64)
    scores = out.view(np.float32, 2 * b * k)[b * k :].reshape(b, k).copy()
    return rows, scores


def collect(dev: Device, p: Launch) -> SearchResult:
    """Wait for a launch and read its answer, redoing on the float32 path the queries the
    half-score, wgmma or int8 path flagged. Raises ServerError when the device fails or times out."""
    if p.value is not None:
        if p.path is not SearchPath.HOST:
            return p.value  # (empty: nothing to look up in row_ids)
        return _answer(dev, p, *p.value)
    bufs, b, kk = p.bufs, len(p.q), p.kk
    assert p.path is not None
    with _collecting(dev, bufs):
        dev.wait(bufs.done)
        out = bufs.h_out
        rows, scores = _read_answer(out, b, kk)
        redo_path = REDO.get(p.path)
        if redo_path is not None:
            # Flagged by the kernel, or with a row missing (scores beyond float16 even after
            # scaling, for queries of norm ~2^100 and more): the float32 path decides.
            redo = np.flatnonzero(out.view(np.int32, 2 * b * kk + b)[2 * b * kk :] | (rows < 0).any(axis=1))
            if redo.size:
                if p.path is SearchPath.HALF_GEMM:
                    dev.stats.half_fallbacks += int(redo.size)
                elif p.path is SearchPath.INT8:
                    dev.stats.int8_fallbacks += int(redo.size)
                else:
                    dev.stats.wgmma_fallbacks += int(redo.size)
                qr = np.ascontiguousarray(p.q[redo])
                with dev.cuda:
                    enqueue(dev, bufs, Plan(redo_path), p.m, qr, p.n, p.k, kk)
                dev.wait(bufs.done)
                rows[redo] = out.view(np.int32, len(redo) * kk).reshape(-1, kk)
                scores[redo] = out.view(np.float32, 2 * len(redo) * kk)[len(redo) * kk :].reshape(-1, kk)
    return _answer(dev, p, rows, scores)


def _answer(dev: Device, p: Launch, rows: np.ndarray, scores: np.ndarray) -> SearchResult:
    """A collected search: counted in the device's statistics, its rows looked up in ``row_ids``."""
    assert p.path is not None
    dev.stats.add(p.path, len(p.q), time.perf_counter_ns() - p.t0)
    if p.row_ids is not None:
        rows = p.row_ids[rows]
    return rows, scores


__all__ = ["CudaSearch", "Launch", "MixedSearch", "collect", "plan_for", "run", "start", "start_mixed"]
