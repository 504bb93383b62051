"""Prometheus metrics, liveness and readiness of a sidecar over HTTP.

``MetricsServer(sidecar, host, port)`` serves, from a background thread of the sidecar process:

* ``/metrics``  Prometheus exposition (text format, or OpenMetrics when the scraper asks for it);
* ``/healthz``  200 while the process is up;
* ``/readyz``   200 once the memory is loaded and the backend is serving, 503 before and while
  stopping.

It listens on loopback unless told otherwise: the endpoint has no authentication.

Everything is computed at scrape time by one collector of our own (:class:`SidecarCollector`),
registered in the registry the caller passes (a fresh ``CollectorRegistry`` otherwise; nothing is
ever put in prometheus_client's global registry). Its sources:

End-to-end latency as callers see it (``kalos_recall_latency_seconds``)
    Each slot's client stats block in shared memory (``broker.layout``: ``lat_count``,
    ``lat_sum_ns``, ``err_count``, ``timeout_count``, the histogram ``hist`` over the protocol's
    ``LATENCY_BOUNDS_NS`` and a ring of the last ``RING_LEN`` latencies), written by the slot's lease
    owner after every completed request, timed from the call including the wait for a slot. The
    collector keeps the last value it saw of every per-slot counter and adds the *difference* to
    its own totals (:class:`MonotonicTotals`). A slot whose counters went down (a new owner that
    started from zero) contributes its new values as the difference. So the exported counters
    never go backwards, however slots change owners, and a slot given up keeps its history.

Quantile gauges (``kalos_recall_latency_quantile_seconds{quantile="0.5|0.95|0.99"}``)
    A sliding window over recent samples (:class:`SlidingWindow`): the last ``window_s`` seconds
    (default 60), at most ``window_samples`` samples (default 20000, newest kept). Client samples
    come from the rings: a harvest thread reads, every ``harvest_interval_s`` (0.1 s) and at every
    scrape, the entries written since its last read of each slot, using ``lat_count`` as the
    ring's write index (:func:`ring_take`). A slot that completed more than ``RING_LEN`` requests
    between two reads loses the older ones (one read trusts at most ``RING_LEN - 1`` entries: the
    oldest may be under overwrite; losses are counted in ``kalos_metrics_dropped_samples_total``);
    the window is then a subsample. Entries the writer may have overwritten during the copy are
    discarded, never misread. Samples are stamped with the time they were read, not the time they
    were recorded (the ring has no timestamps), which shifts the window by at most one harvest
    interval. The quantile is the nearest-rank one: the smallest sample with at least q of the
    window at or below it (numpy ``method="inverted_cdf"``). Ring entries saturate at 2**32-1 ns
    (4.29 s); the histogram does not.

The sidecar's own stages (``kalos_queue_wait_seconds``, ``kalos_batch_compute_seconds``, ``kalos_service_seconds``)
    From a ``SidecarStats`` observer, called by the serving thread with each ``BatchRecord``: it only
    stamps the record and queues it (a few hundred nanoseconds); the harvest thread turns records
    into histograms and windows. Queue wait is posted -> taken into a batch, per request. Compute is
    the backend work of a whole batch, per batch. Service is posted -> results written
    (``t_done_ns`` of the record), per request.

Everything else is read at scrape time: slots (leased, by state), requests, batches and errors by
kind (one series per ``Status`` name: a bounded set), rows per namespace (the ``namespace_labels``
largest namespaces by rows as labels, every other namespace summed under ``namespace="_other"``;
a real namespace named ``_other`` always falls in that bucket), backend info and uptime.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily, Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker.errors import ConfigError
from broker.layout import (
    HIST_BUCKETS, LATENCY_BOUNDS_NS, RING_LEN, STATS_FIELDS, SidecarState, SlotState, Status,
)
from sidecar_cuda.stats import BatchRecord

log = logging.getLogger("kalos.metrics")

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
#: The sidecar's stages can be shorter than the shortest end-to-end bucket (5 us): two finer ones.
STAGE_BOUNDS_NS: tuple[int, ...] = (1_000, 2_500) + LATENCY_BOUNDS_NS
BATCH_SIZE_BOUNDS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
OTHER_NAMESPACES = "_other"
#: Per-slot client counters (written by clients) are clipped to this before they are summed, so
#: the totals of every slot cannot overflow int64.
COUNTER_CAP = 1 << 50  # x 4096 slots < 2**63
#: Longest stage time recorded (a client's posting time is untrusted): one day.
STAGE_CAP_NS = 86_400 * 10**9
_STATS_NAMES = tuple(f[0] for f in STATS_FIELDS)  # lat_count, lat_sum_ns, err_count, timeout_count
_STAGES = ("queue_wait", "compute", "service")


# --------------------------------------------------------------------------- pure aggregation

def bucket_counts(values: Any, bounds: Sequence[int]) -> np.ndarray:
    """Per-bucket counts (len(bounds) + 1, the last is +Inf) of ``values``: a value goes to the
    first bound >= it, the rule clients follow for ``hist`` and Prometheus' ``le``."""
    idx = np.searchsorted(np.asarray(bounds, np.int64), np.asarray(values, np.int64), side="left")
    return np.bincount(idx, minlength=len(bounds) + 1).astype(np.int64)


def cumulative_buckets(counts: Sequence[int] | np.ndarray, bounds: Sequence[float | str]
                       ) -> list[tuple[str, float]]:
    """Prometheus buckets ``[(le, cumulative count), ..., ("+Inf", total)]`` from per-bucket counts;
    ``bounds``: upper bounds as numbers or as ready ``le`` strings."""
    cum = np.cumsum(np.asarray(counts, np.int64))
    les = [b if isinstance(b, str) else floatToGoString(b) for b in bounds]
    out = list(zip(les, map(float, cum[:-1].tolist())))
    out.append(("+Inf", float(cum[-1])))
    return out


def nearest_rank_quantiles(values: np.ndarray, qs: Sequence[float]) -> list[float]:
    """For each q, the smallest value v with at least a fraction q of ``values`` <= v; NaN if empty."""
    if len(values) == 0:
        return [float("nan")] * len(qs)
    n = len(values)
    ranks = [min(n - 1, max(0, math.ceil(q * n) - 1)) for q in qs]  # numpy's "inverted_cdf"
    part = np.partition(values, sorted(set(ranks)))
    return [float(part[r]) for r in ranks]


class MonotonicTotals:
    """Totals of per-slot counters that are only ever reset by their writer, as counters that never
    go backwards.

    ``update(cur)`` takes the current values (rows: slots, columns: counters) and adds each row's
    increase since the previous call. A row with any column lower than before was reset (its slot
    got a new owner that started from zero): its current values are the increase. An increase that
    happens between two updates *and* is larger than the value before the reset is undercounted by
    the value before the reset; reads every scrape make that vanishingly rare.
    """

    def __init__(self, rows: int, columns: int) -> None:
        self._last = np.zeros((rows, columns), np.int64)
        self.totals = np.zeros(columns, np.int64)

    def update(self, cur: np.ndarray) -> np.ndarray:
        # Clients write these counters: a wrapped or absurd value must not overflow the totals.
        cur = np.clip(np.asarray(cur).astype(np.int64), 0, COUNTER_CAP)
        if cur.shape != self._last.shape:
            raise ValueError(f"expected shape {self._last.shape}, got {cur.shape}")
        delta = cur - self._last
        reset = (delta < 0).any(axis=1)
        if reset.any():
            delta[reset] = np.maximum(cur[reset], 0)
        self._last = cur
        inc = delta.sum(axis=0)
        self.totals += inc
        return inc


def ring_take_all(rings: np.ndarray, last: np.ndarray, count: np.ndarray,
                  reread: Callable[[], np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """The entries of every slot's latency ring written since the previous read, in a few numpy
    calls whatever the number of slots.

    The writer of a slot stores its n-th latency (0-based) at ``ring[n % len]``, then sets
    ``lat_count`` to n + 1. ``rings``: (slots, len); ``last``: the counts at the previous read;
    ``count``: the counts read now, before copying; ``reread()``: the counts again, called after the
    copy. Entry j is being overwritten once its writer reaches j + len, so entries with
    j <= (count after the copy) - len are not trusted: at most ``len - 1`` entries of a slot come out
    of one read. A count below ``last`` means the slot's counters were reset: read from zero.

    Returns (the new entries, slot after slot, oldest first, as int64 ns; the new ``last``; entries
    lost: overwritten before this read, or possibly during the copy).
    """
    n = rings.shape[1]
    # Counts are client-written u64 read as int64: a negative one (2**63 and up) reads as a reset
    # to zero, so no slice length can go negative.
    count = np.maximum(np.asarray(count, np.int64), 0)
    last = np.where(count < last, 0, last)
    lo = np.maximum(last, count - n)
    lost = int((lo - last).sum())
    k = count - lo
    total = int(k.sum())
    if total == 0:
        return np.empty(0, np.int64), count.copy(), lost
    first = np.cumsum(k) - k
    j = np.repeat(lo - first, k) + np.arange(total)  # entry numbers, slot after slot
    vals = rings[np.repeat(np.arange(len(k)), k), j % n]  # the copy
    after = np.maximum(np.asarray(reread(), np.int64), 0)
    keep = j > np.repeat(after, k) - n
    kept = int(keep.sum())
    return vals[keep].astype(np.int64), count.copy(), lost + total - kept


def ring_take(ring: np.ndarray, last: int, count: int, count_after: int) -> tuple[np.ndarray, int, int]:
    """:func:`ring_take_all` for one slot whose count after the copy is already known (tests, tools)."""
    vals, new_last, lost = ring_take_all(ring.reshape(1, -1), np.array([last], np.int64),
                                         np.array([count], np.int64),
                                         lambda: np.array([count_after], np.int64))
    return vals, int(new_last[0]), lost


def slots_matrix(views: Sequence[np.ndarray]) -> np.ndarray:
    """One (slots, len) view over per-slot views that sit at a constant stride in one buffer (the
    segment's hist or ring of every slot): a single numpy read instead of one per slot."""
    first = views[0]
    if len(views) == 1:
        return first.reshape(1, -1)
    stride = views[1].ctypes.data - first.ctypes.data
    m = np.lib.stride_tricks.as_strided(first, shape=(len(views), len(first)),
                                        strides=(stride, first.strides[0]), writeable=False)
    for i, v in enumerate(views):  # the layout promises a constant stride: check it once
        if m[i].ctypes.data != v.ctypes.data or v.shape != first.shape:
            raise ValueError("per-slot views are not evenly spaced")
    return m


class SlidingWindow:
    """Recent samples for quantiles: at most ``max_samples`` (newest kept), none older than
    ``window_s`` seconds (by the time they were added). A circular buffer of values and times;
    quantiles are recomputed only when the window changed. Not thread-safe: the collector locks."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 20_000) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ConfigError("window_s must be > 0 and max_samples >= 1")
        self.window_s = window_s
        self.max_samples = max_samples
        self._vals = np.zeros(max_samples, np.int64)
        self._times = np.zeros(max_samples, np.float64)
        self._end = 0  # samples ever added; the newest is at (_end - 1) % max_samples
        self._n = 0  # samples in the window
        self._cache: tuple[tuple[float, ...], list[float]] | None = None

    def __len__(self) -> int:
        return self._n

    def add(self, t: float, values: np.ndarray) -> None:
        k = len(values)
        if k == 0:
            return
        m = self.max_samples
        if k > m:
            values = values[-m:]
            self._end += k - m
            k = m
        pos = self._end % m
        first = min(k, m - pos)
        self._vals[pos:pos + first] = values[:first]
        self._times[pos:pos + first] = t
        if first < k:
            self._vals[:k - first] = values[first:]
            self._times[:k - first] = t
        self._end += k
        self._n = min(self._n + k, m)
        self._cache = None

    def expire(self, now: float) -> None:
        m, cut = self.max_samples, now - self.window_s
        while self._n:  # times are non-decreasing from the oldest: find the first one kept
            oldest = (self._end - self._n) % m
            if self._times[oldest] >= cut:
                return
            seg = min(self._n, m - oldest)  # contiguous run starting at the oldest
            kept = int(np.searchsorted(self._times[oldest:oldest + seg], cut, side="left"))
            self._n -= kept
            self._cache = None
            if kept < seg:
                return

    def values(self, now: float) -> np.ndarray:
        """The samples in the window, oldest first (a copy)."""
        self.expire(now)
        m = self.max_samples
        start = (self._end - self._n) % m
        if start + self._n <= m:
            return self._vals[start:start + self._n].copy()
        return np.concatenate([self._vals[start:], self._vals[:self._end % m]])

    def quantiles(self, qs: Sequence[float], now: float) -> list[float]:
        self.expire(now)
        key = tuple(qs)
        if self._cache is None or self._cache[0] != key:
            m = self.max_samples
            start = (self._end - self._n) % m
            if start + self._n <= m:  # the whole buffer or one run of it: no need to keep order
                vals = self._vals[start:start + self._n].copy()
            else:
                vals = np.concatenate([self._vals[start:], self._vals[:self._end % m]])
            self._cache = (key, nearest_rank_quantiles(vals, qs))
        return list(self._cache[1])


def top_namespaces(counts: dict[str, int], n: int) -> list[tuple[str, int]]:
    """``[(label, rows)]``: the ``n`` largest namespaces by rows (ties by name), then
    ``(OTHER_NAMESPACES, rows of all the others)`` if there are others. A namespace literally named
    ``_other`` is always counted in the other bucket, so label values stay unique."""
    named = sorted(((name, rows) for name, rows in counts.items() if name != OTHER_NAMESPACES),
                   key=lambda kv: (-kv[1], kv[0]))
    top = named[:n]
    rest = named[n:]
    if OTHER_NAMESPACES in counts or rest:
        top.append((OTHER_NAMESPACES, sum(r for _n, r in rest) + counts.get(OTHER_NAMESPACES, 0)))
    return top


def _after_pick_ns(r: BatchRecord, t_obs: int) -> int:
    """Pick-up -> results written for a batch: from ``t_done_ns`` when the record has it, else
    from the time the observer ran (after the results, maybe after the response posts), else the
    backend work alone (a lower bound)."""
    t_pick = getattr(r, "t_pick_ns", 0)
    if not t_pick:
        return r.compute_ns
    t_done = getattr(r, "t_done_ns", 0)
    return (t_done or t_obs) - t_pick


class StageAggregator:
    """Histograms and windows of the sidecar's stages from stamped BatchRecords."""

    def __init__(self, window_s: float, window_samples: int) -> None:
        self.hist = {s: np.zeros(len(STAGE_BOUNDS_NS) + 1, np.int64) for s in _STAGES}
        self.sums_ns = {s: 0 for s in _STAGES}
        self.windows = {s: SlidingWindow(window_s, window_samples) for s in _STAGES}
        self.batch_size = np.zeros(len(BATCH_SIZE_BOUNDS) + 1, np.int64)
        self.batch_size_sum = 0

    def add(self, stamped: Sequence[tuple[BatchRecord, int]], now: float) -> None:
        """``stamped``: (record, CLOCK_MONOTONIC ns when the serving thread reported it)."""
        if not stamped:
            return
        n = len(stamped)
        sizes = np.fromiter((r.size for r, _t in stamped), np.int64, n)
        compute = np.fromiter((r.compute_ns for r, _t in stamped), np.int64, n)
        # Records with posting and pick-up times (what serve_pending gives) are done in a few numpy
        # calls for all of them; others one by one.
        posts: list[Any] = []  # arrays of posting times, with the batch's pick-up and done times
        picks: list[int] = []
        ends: list[int] = []
        one_post: list[int] = []  # batches of one request (the sidecar's fast path): plain ints
        one_pick: list[int] = []
        one_end: list[int] = []
        queue_parts: list[np.ndarray] = []
        service_parts: list[np.ndarray] = []
        for r, t_obs in stamped:
            t_post, t_pick = getattr(r, "t_post_ns", None), getattr(r, "t_pick_ns", 0)
            if t_post is not None and t_pick:
                end = getattr(r, "t_done_ns", 0) or t_obs
                if len(t_post) == 1:
                    one_post.append(int(t_post[0]))
                    one_pick.append(t_pick)
                    one_end.append(end)
                else:
                    posts.append(t_post)
                    picks.append(t_pick)
                    ends.append(end)
            else:
                q = np.asarray(r.queue_ns, np.int64)
                queue_parts.append(q)
                service_parts.append(q + max(_after_pick_ns(r, t_obs), 0))
        if one_post:
            # Client-written u64 stamps, any value: reinterpret as int64 like the batched ones.
            post1 = np.array(one_post, np.uint64).view(np.int64)
            queue_parts.append(np.array(one_pick, np.int64) - post1)
            service_parts.append(np.array(one_end, np.int64) - post1)
        if posts:
            lens = np.fromiter(map(len, posts), np.int64, len(posts))
            post = np.concatenate(posts).astype(np.uint64).view(np.int64)
            queue_parts.append(np.repeat(np.asarray(picks, np.int64), lens) - post)
            service_parts.append(np.repeat(np.asarray(ends, np.int64), lens) - post)
        # A posting time after the pick-up (or a wrapped one) is a client's lie: clamp to [0, cap].
        queue = np.clip(np.concatenate(queue_parts), 0, STAGE_CAP_NS)
        service = np.clip(np.concatenate(service_parts), 0, STAGE_CAP_NS)
        for stage, vals in (("queue_wait", queue), ("compute", compute), ("service", service)):
            self.hist[stage] += bucket_counts(vals, STAGE_BOUNDS_NS)
            self.sums_ns[stage] += int(vals.sum())
            self.windows[stage].add(now, vals)
        self.batch_size += bucket_counts(sizes, BATCH_SIZE_BOUNDS)
        self.batch_size_sum += int(sizes.sum())


# --------------------------------------------------------------------------- the collector

_LAT_LE = [floatToGoString(b / 1e9) for b in LATENCY_BOUNDS_NS]
_STAGE_LE = [floatToGoString(b / 1e9) for b in STAGE_BOUNDS_NS]
_BATCH_LE = [floatToGoString(b) for b in BATCH_SIZE_BOUNDS]
_STAGE_METRICS = {
    "queue_wait": ("kalos_queue_wait_seconds",
                   "Sidecar queue wait per request: posted by the client -> taken into a batch."),
    "compute": ("kalos_batch_compute_seconds", "Backend work per batch (all namespaces of the batch), "
                "started to answered; a pipelined batch includes its wait behind the previous one."),
    "service": ("kalos_service_seconds",
                "Sidecar service time per request: posted by the client -> results written."),
}


class SidecarCollector(Collector):
    """Reads a sidecar (its SegmentView, SidecarStats, store and backend) at scrape time.

    ``sidecar`` needs ``seg`` (None until the segment exists), ``stats``, ``store.counts()``,
    ``backend.name/description``, ``cfg``, ``layout`` and ``ready``: ``sidecar_cuda.server.Sidecar``.
    Call :meth:`observe_batch` for each BatchRecord (see :meth:`attach`), :meth:`harvest` often
    (the MetricsServer's harvest thread does), and let the registry call :meth:`collect`.
    """

    def __init__(self, sidecar: Any, *, window_s: float = 60.0, window_samples: int = 20_000,
                 namespace_labels: int = 10, pending_limit: int = 1 << 16,
                 clock: Any = time.monotonic) -> None:
        if namespace_labels < 0:
            raise ConfigError("namespace_labels must be >= 0")
        self._sc = sidecar
        self._clock = clock
        self._lock = threading.Lock()
        n = sidecar.layout.n_slots
        self._n_slots = n
        self._client = MonotonicTotals(n, HIST_BUCKETS + len(_STATS_NAMES))
        self._ring_last = np.zeros(n, np.int64)
        self._seg_views: tuple[Any, np.ndarray, np.ndarray] | None = None  # (seg, rings, hists)
        self._client_window = SlidingWindow(window_s, window_samples)
        self._stages = StageAggregator(window_s, window_samples)
        self._pending: deque[tuple[BatchRecord, int]] = deque(maxlen=pending_limit)
        self._pending_limit = pending_limit
        self._dropped_batches = 0  # written by the serving thread only
        self._dropped_ring = 0
        self._namespace_labels = namespace_labels

    # -- feeding ----------------------------------------------------------------------------
    def observe_batch(self, rec: BatchRecord) -> None:
        """The SidecarStats observer: runs in the serving thread, so it only stamps and queues."""
        p = self._pending
        if len(p) >= self._pending_limit:
            self._dropped_batches += 1  # the harvest thread fell behind; the deque drops the oldest
        p.append((rec, time.monotonic_ns()))

    def attach(self) -> None:
        self._sc.stats.observers.append(self.observe_batch)

    def detach(self) -> None:
        try:
            self._sc.stats.observers.remove(self.observe_batch)
        except ValueError:
            pass

    def harvest(self) -> None:
        """Move new ring entries and queued batch records into the windows and histograms."""
        with self._lock:
            self._harvest_locked(self._clock())

    def _harvest_locked(self, now: float) -> None:
        p = self._pending
        stamped = [p.popleft() for _ in range(len(p))]
        self._stages.add(stamped, now)
        views = self._views()
        if views is None:
            return
        seg, rings, _hists = views
        counts_view = seg.stats["lat_count"]
        counts = counts_view.astype(np.int64)
        if (counts == self._ring_last).all():
            return
        vals, self._ring_last, lost = ring_take_all(rings, self._ring_last, counts,
                                                    lambda: counts_view.astype(np.int64))
        self._dropped_ring += lost
        self._client_window.add(now, vals)

    def _views(self) -> tuple[Any, np.ndarray, np.ndarray] | None:
        seg = self._sc.seg
        if seg is None:
            return None
        if self._seg_views is None or self._seg_views[0] is not seg:
            self._seg_views = (seg, slots_matrix([v.ring for v in seg.slot]),
                               slots_matrix([v.hist for v in seg.slot]))
        return self._seg_views

    # -- scraping ---------------------------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            now = self._clock()
            try:
                self._harvest_locked(now)
            except Exception:  # a scrape still answers with what is there
                log.exception("metrics harvest failed")
            snap = self._snapshot(now)
        return list(self._families(snap))

    def _snapshot(self, now: float) -> dict[str, Any]:
        sc = self._sc
        views = self._views()
        s: dict[str, Any] = {"ready": self._is_ready(), "counts": {}}
        if views is not None:
            seg, _rings, hists = views
            st = seg.stats
            cur = np.column_stack([hists.astype(np.int64)] +
                                  [st[name].astype(np.int64) for name in _STATS_NAMES])
            self._client.update(cur)
            slots = seg.slots
            states = slots["state"].astype(np.int64)
            owners = slots["owner_pid"]
            s["slot_states"] = np.bincount(np.clip(states, 0, len(SlotState)), minlength=len(SlotState) + 1)
            s["leased"] = int((owners != 0).sum())
            s["start_epoch_ns"] = int(seg.header["start_epoch_ns"])
        tot = self._client.totals
        s["client_hist"] = tot[:HIST_BUCKETS].copy()
        for j, name in enumerate(_STATS_NAMES):
            s[name] = int(tot[HIST_BUCKETS + j])
        s["client_q"] = self._client_window.quantiles(QUANTILES, now)
        s["client_window"] = len(self._client_window)
        s["stage_q"] = {st: self._stages.windows[st].quantiles(QUANTILES, now) for st in _STAGES}
        s["stage_window"] = {st: len(self._stages.windows[st]) for st in _STAGES}
        stats = sc.stats
        with stats.lock:
            s["errors"] = dict(stats.errors)
        s["batches"], s["requests"] = stats.batches, stats.requests
        s["reclaimed"] = stats.slots_reclaimed
        try:
            s["counts"] = dict(sc.store.counts())
        except RuntimeError:  # the serving thread added a namespace mid-copy: next scrape
            s["counts"] = None
        return s

    def _is_ready(self) -> bool:
        seg = self._sc.seg
        return bool(self._sc.ready and seg is not None
                    and int(seg.header["state"]) == SidecarState.READY)

    def _families(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        """Every metric family; without a snapshot, empty ones (for ``describe``)."""
        g = snap is not None
        s: dict[str, Any] = snap if snap is not None else {}
        # End to end, as callers see it.
        h = HistogramMetricFamily(
            "kalos_recall_latency_seconds",
            "End-to-end latency of completed requests as callers see it (call -> result, including "
            "the wait for a slot), from every slot's client stats in shared memory.")
        if g:
            h.add_metric([], cumulative_buckets(s["client_hist"], _LAT_LE), s["lat_sum_ns"] / 1e9)
        yield h
        q = GaugeMetricFamily("kalos_recall_latency_quantile_seconds",
                              "End-to-end latency quantiles (nearest rank) over the sliding window "
                              "of recent requests read from the slots' latency rings.",
                              labels=["quantile"])
        if g:
            for qq, v in zip(QUANTILES, s["client_q"]):
                q.add_metric([floatToGoString(qq)], v / 1e9)
        yield q
        c = CounterMetricFamily("kalos_client_requests", "Requests completed as callers saw them, by "
                                "outcome (timeout: the caller gave up or was cancelled).",
                                labels=["outcome"])
        if g:
            c.add_metric(["ok"], float(s["client_hist"].sum()))
            c.add_metric(["error"], float(s["err_count"]))
            c.add_metric(["timeout"], float(s["timeout_count"]))
        yield c
        # The sidecar's stages.
        sq = GaugeMetricFamily("kalos_stage_latency_quantile_seconds",
                               "Sidecar stage latency quantiles (nearest rank) over the sliding window.",
                               labels=["stage", "quantile"])
        for stage in _STAGES:
            name, doc = _STAGE_METRICS[stage]
            sh = HistogramMetricFamily(name, doc)
            if g:
                agg = self._stages
                sh.add_metric([], cumulative_buckets(agg.hist[stage], _STAGE_LE),
                              agg.sums_ns[stage] / 1e9)
                for qq, v in zip(QUANTILES, s["stage_q"][stage]):
                    sq.add_metric([stage, floatToGoString(qq)], v / 1e9)
            yield sh
        yield sq
        ws = GaugeMetricFamily("kalos_latency_window_samples",
                               "Samples in each quantile window.", labels=["source"])
        if g:
            ws.add_metric(["client"], s["client_window"])
            for stage in _STAGES:
                ws.add_metric([stage], s["stage_window"][stage])
        yield ws
        bs = HistogramMetricFamily("kalos_batch_size", "Requests per batch served by the sidecar.")
        if g:
            bs.add_metric([], cumulative_buckets(self._stages.batch_size, _BATCH_LE),
                          float(self._stages.batch_size_sum))
        yield bs
        # Counters of the serving loop.
        for name, key, doc in (
            ("kalos_requests", "requests", "Requests served by the sidecar (every op)."),
            ("kalos_batches", "batches", "Batches served by the sidecar."),
            ("kalos_slots_reclaimed", "reclaimed", "Slots freed after their owner died or left."),
        ):
            cm = CounterMetricFamily(name, doc)
            if g:
                cm.add_metric([], float(s[key]))
            yield cm
        e = CounterMetricFamily("kalos_errors", "Requests the sidecar answered with an error, by kind "
                                "(the protocol's Status names).", labels=["kind"])
        if g:
            errs = dict(s["errors"])
            for st in Status:
                if st != Status.OK:
                    e.add_metric([st.name], float(errs.pop(int(st), 0)))
            unknown = sum(v for k, v in errs.items() if k != Status.OK)
            if unknown:
                e.add_metric(["UNKNOWN"], float(unknown))
        yield e
        d = CounterMetricFamily("kalos_metrics_dropped_samples",
                                "Samples the exporter lost: ring entries overwritten before they were "
                                "read (quantile windows only), batch records queued past the limit.",
                                labels=["source"])
        if g:
            d.add_metric(["ring"], float(self._dropped_ring))
            d.add_metric(["batches"], float(self._dropped_batches))
        yield d
        # Slots.
        total = GaugeMetricFamily("kalos_slots", "Slots of the segment.")
        leased = GaugeMetricFamily("kalos_slots_leased", "Slots leased by client processes.")
        inflight = GaugeMetricFamily("kalos_slots_in_flight",
                                     "Slots holding a request (any state but FREE).")
        by_state = GaugeMetricFamily("kalos_slots_by_state", "Slots by state.", labels=["state"])
        if g:
            total.add_metric([], self._n_slots)
            if "slot_states" in s:
                st_counts = s["slot_states"]
                leased.add_metric([], s["leased"])
                inflight.add_metric([], int(st_counts[1:].sum()))
                for ss in SlotState:
                    by_state.add_metric([ss.name.lower()], int(st_counts[int(ss)]))
                by_state.add_metric(["invalid"], int(st_counts[len(SlotState)]))
        yield from (total, leased, inflight, by_state)
        # Memory.
        rows = GaugeMetricFamily("kalos_memory_rows",
                                 f"Rows per namespace: the {self._namespace_labels} largest by rows, the "
                                 f"rest summed under namespace=\"{OTHER_NAMESPACES}\".",
                                 labels=["namespace"])
        nss = GaugeMetricFamily("kalos_namespaces", "Namespaces in memory.")
        if g and s["counts"] is not None:
            for label, n in top_namespaces(s["counts"], self._namespace_labels):
                rows.add_metric([label], n)
            nss.add_metric([], len(s["counts"]))
        yield rows
        yield nss
        # Identity and state.
        info = InfoMetricFamily("kalos_backend", "Backend and configuration of the sidecar.")
        if g:
            cfg = self._sc.cfg
            backend = self._sc.backend
            info.add_metric([], {
                "broker": str(cfg.name), "backend": str(backend.name),
                "description": str(backend.description), "dtype": str(cfg.storage_dtype),
                "metric": str(cfg.metric), "dim": str(cfg.dim),
                "device": str(cfg.device) if backend.name == "cuda" else "cpu",
            })
        yield info
        ready = GaugeMetricFamily("kalos_ready", "1 when memory is loaded and the sidecar serves.")
        start = GaugeMetricFamily("kalos_start_time_seconds", "Sidecar start, seconds since the epoch.")
        up = GaugeMetricFamily("kalos_uptime_seconds", "Seconds since the sidecar started.")
        if g:
            ready.add_metric([], 1.0 if s["ready"] else 0.0)
            if s.get("start_epoch_ns"):
                start.add_metric([], s["start_epoch_ns"] / 1e9)
                up.add_metric([], max(0.0, time.time() - s["start_epoch_ns"] / 1e9))
        yield from (ready, start, up)


# --------------------------------------------------------------------------- HTTP

_TEXT_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary",
               "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _float_text(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label_text(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        v = v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return v


def encode_text(registry: Collector) -> bytes:
    """The Prometheus text format (0.0.4) of ``registry``, as ``prometheus_client``'s
    ``generate_latest`` writes it, without its per-sample name validation: a scrape holds the
    sidecar's GIL several times shorter (the serving thread waits for it meanwhile). Names come
    from our own collectors; label values are escaped."""
    out: list[str] = []
    for metric in registry.collect():
        mname, mtype = metric.name, metric.type
        if mtype == "counter":
            mname += "_total"
        elif mtype == "info":
            mname += "_info"
        doc = metric.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {_TEXT_TYPES.get(mtype, 'untyped')}\n")
        extra: dict[str, list[str]] = {}
        for s in metric.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_label_text(v)}"' for k, v in sorted(s.labels.items()))
                line = f"{s.name}{{{labels}}} {_float_text(s.value)}"
            else:
                line = f"{s.name} {_float_text(s.value)}"
            if s.timestamp is not None:
                line += f" {int(float(s.timestamp) * 1000):d}"
            suffix = s.name[len(metric.name):]
            if suffix in ("_created", "_gsum", "_gcount"):  # OpenMetrics-only: gauges of their own
                extra.setdefault(suffix, []).append(line + "\n")
            else:
                out.append(line + "\n")
        for suffix, lines in sorted(extra.items()):
            out.append(f"# HELP {metric.name}{suffix} {doc}\n# TYPE {metric.name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode()


def _wants_openmetrics_only(accept: str) -> bool:
    """Serve the text format to anyone who accepts it (Prometheus does, next to OpenMetrics)."""
    a = accept.lower()
    return bool(a) and "text/plain" not in a and "*/*" not in a


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds an idle keep-alive connection is kept

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path == "/metrics":
            try:
                accept = self.headers.get("Accept", "")
                if _wants_openmetrics_only(accept):
                    encoder, ctype = choose_encoder(accept)
                    payload = encoder(owner.registry)
                else:
                    ctype, payload = TEXT_CONTENT_TYPE, encode_text(owner.registry)
                status = 200
            except Exception:  # a broken collector must not kill the endpoint
                log.exception("collecting metrics failed")
                status, ctype, payload = 500, "text/plain; charset=utf-8", b"collecting metrics failed\n"
        elif path == "/healthz":
            status, ctype, payload = 200, "text/plain; charset=utf-8", b"ok\n"
        elif path == "/readyz":
            ok, why = owner.readiness()
            status, ctype, payload = (200 if ok else 503), "text/plain; charset=utf-8", why.encode() + b"\n"
        else:
            status, ctype, payload = 404, "text/plain; charset=utf-8", b"not found: try /metrics, /healthz, /readyz\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("%s " + format, self.address_string(), *args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetricsServer


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` of one sidecar, served from background threads.

    ``registry``: where the collector is registered; a fresh ``CollectorRegistry`` (with a
    ``ProcessCollector`` for the sidecar's CPU and memory) when None. ``port=0`` picks a free port
    (see :attr:`port`). ``start()`` raises ConfigError if the address cannot be bound; ``stop()``
    is idempotent.
    """

    def __init__(self, sidecar: Any, host: str = "127.0.0.1", port: int = 9464,
                 registry: CollectorRegistry | None = None, *, harvest_interval_s: float = 0.1,
                 window_s: float = 60.0, window_samples: int = 20_000, namespace_labels: int = 10) -> None:
        self.sidecar = sidecar
        self.host = host
        self._port = port
        self.harvest_interval_s = harvest_interval_s
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        self.collector = SidecarCollector(sidecar, window_s=window_s, window_samples=window_samples,
                                          namespace_labels=namespace_labels)
        self.registry.register(self.collector)
        self._httpd: _HTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port once started (the one asked for before)."""
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def readiness(self) -> tuple[bool, str]:
        sc = self.sidecar
        seg = sc.seg
        if seg is None or not sc.ready:
            return False, "not ready: loading"
        state = SidecarState(int(seg.header["state"]))
        if state != SidecarState.READY:
            return False, f"not ready: {state.name.lower()}"
        return True, "ready"

    def start(self) -> None:
        if self._httpd is not None:
            return
        cls = _HTTPServer6 if ":" in self.host else _HTTPServer
        try:
            httpd = cls((self.host, self._port), _Handler)
        except OSError as e:
            raise ConfigError(f"metrics endpoint: cannot listen on {self.host}:{self._port}: {e}") from None
        httpd.owner = self
        self._httpd = httpd
        self._port = int(httpd.server_address[1])
        self._stop.clear()
        self.collector.attach()
        self._threads = [
            threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                             name="kalos-metrics-http", daemon=True),
            threading.Thread(target=self._harvest_loop, name="kalos-metrics-harvest", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("metrics on %s/metrics (also /healthz, /readyz)", self.url)

    def _harvest_loop(self) -> None:
        while not self._stop.wait(self.harvest_interval_s):
            try:
                self.collector.harvest()
            except Exception:  # keep harvesting; the scrape reports what it can
                log.exception("metrics harvest failed")

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stop.set()
        self.collector.detach()
        httpd, self._httpd = self._httpd, None
        httpd.shutdown()
        httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "MetricsServer", "SidecarCollector", "encode_text", "MonotonicTotals", "SlidingWindow", "StageAggregator",
    "bucket_counts", "cumulative_buckets", "nearest_rank_quantiles", "ring_take", "ring_take_all",
    "slots_matrix", "top_namespaces",
    "QUANTILES", "STAGE_BOUNDS_NS", "BATCH_SIZE_BOUNDS", "OTHER_NAMESPACES",
]
