"""The metrics' arithmetic, pure: bucket counts, counters that never go backwards over per-slot
counters clients reset, the latency rings read without trusting their writers, sliding windows
and nearest-rank quantiles, the sidecar's stage times from its batch records.

Everything a client wrote is clamped before it is summed (``COUNTER_CAP``, ``STAGE_CAP_NS``, the
u64 -> int64 views): a hostile slot cannot overflow a total or break a scrape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from prometheus_client.utils import floatToGoString

from ...broker.errors import ConfigError
from ...broker.layout import LATENCY_BOUNDS_NS, RING_NS_MAX, RING_OP_SHIFT
from ..serving.stats import BatchRecord

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
#: The sidecar's stages can be shorter than the shortest end-to-end bucket (5 us): two finer ones.
STAGE_BOUNDS_NS: tuple[int, ...] = (1_000, 2_500) + LATENCY_BOUNDS_NS
#: Requests per batch: half octaves, so a batch of half the callers (128 of 256) and a full one
#: (over 192) land in different buckets (issue 27: do the batches fill?).
BATCH_SIZE_BOUNDS: tuple[int, ...] = (
    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
)  # fmt: skip
OTHER_NAMESPACES = "_other"
#: Per-slot client counters (written by clients) are clipped to this before they are summed, so
#: the totals of every slot cannot overflow int64.
COUNTER_CAP = 1 << 50  # x 4096 slots < 2**63
#: Longest stage time recorded (a client's posting time is untrusted): one day.
STAGE_CAP_NS = 86_400 * 10**9
STAGES = ("queue_wait", "compute", "service")


def le_text(v: float) -> str:
    """A bound as Prometheus writes it in ``le`` (Go's float formatting)."""
    text: str = floatToGoString(v)  # type: ignore[no-untyped-call]  # (untyped in prometheus_client)
    return text


def bucket_counts(values: Any, bounds: Sequence[int]) -> np.ndarray:
    """Per-bucket counts (len(bounds) + 1, the last is +Inf) of ``values``: a value goes to the
    first bound >= it, the rule clients follow for ``hist`` and Prometheus' ``le``."""
    idx = np.searchsorted(np.asarray(bounds, np.int64), np.asarray(values, np.int64), side="left")
    return np.bincount(idx, minlength=len(bounds) + 1).astype(np.int64)


def cumulative_buckets(counts: Sequence[int] | np.ndarray, bounds: Sequence[float | str]) -> list[tuple[str, float]]:
    """Prometheus buckets ``[(le, cumulative count), ..., ("+Inf", total)]`` from per-bucket counts;
    ``bounds``: upper bounds as numbers or as ready ``le`` strings."""
    cum = np.cumsum(np.asarray(counts, np.int64))
    les = [b if isinstance(b, str) else le_text(b) for b in bounds]
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
        inc: np.ndarray = delta.sum(axis=0)
        self.totals += inc
        return inc


def ring_take_all(
    rings: np.ndarray, last: np.ndarray, count: np.ndarray, reread: Callable[[], np.ndarray]
) -> tuple[np.ndarray, np.ndarray, int]:
    """The entries of every slot's latency ring written since the previous read, in a few numpy
    calls whatever the number of slots.

    The writer of a slot stores its n-th latency (0-based) at ``ring[n % len]``, then sets
    ``lat_count`` to n + 1. ``rings``: (slots, len); ``last``: the counts at the previous read;
    ``count``: the counts read now, before copying; ``reread()``: the counts again, called after the
    copy. Entry j is being overwritten once its writer reaches j + len, so entries with
    j <= (count after the copy) - len are not trusted: at most ``len - 1`` entries of a slot come out
    of one read. A count below ``last`` means the slot's counters were reset: read from zero.

    Returns (the new entries, slot after slot, oldest first, in the rings' dtype; the new ``last``;
    entries lost: overwritten before this read, or possibly during the copy).
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
    out: np.ndarray = vals[keep]
    return out, count.copy(), lost + total - kept


def split_ring_entries(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(op, latency ns) of ring entries (``op << RING_OP_SHIFT | ns``, u64), both as int64. The op
    is a client's word: callers drop those outside LatencyOp."""
    e = np.asarray(entries).astype(np.uint64)
    ops = (e >> np.uint64(RING_OP_SHIFT)).astype(np.int64)
    ns = (e & np.uint64(RING_NS_MAX)).astype(np.int64)
    return ops, ns


def slots_matrix(views: Sequence[np.ndarray]) -> np.ndarray:
    """One (slots, len) view over per-slot views that sit at a constant stride in one buffer (the
    segment's hist or ring of every slot): a single numpy read instead of one per slot."""
    first = views[0]
    if len(views) == 1:
        return first.reshape(1, -1)
    stride = views[1].ctypes.data - first.ctypes.data
    m = np.lib.stride_tricks.as_strided(
        first, shape=(len(views), len(first)), strides=(stride, first.strides[0]), writeable=False
    )
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
        self._vals[pos : pos + first] = values[:first]
        self._times[pos : pos + first] = t
        if first < k:
            self._vals[: k - first] = values[first:]
            self._times[: k - first] = t
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
            kept = int(np.searchsorted(self._times[oldest : oldest + seg], cut, side="left"))
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
            vals: np.ndarray = self._vals[start : start + self._n].copy()
            return vals
        return np.concatenate([self._vals[start:], self._vals[: self._end % m]])

    def quantiles(self, qs: Sequence[float], now: float) -> list[float]:
        self.expire(now)
        key = tuple(qs)
        if self._cache is None or self._cache[0] != key:
            m = self.max_samples
            start = (self._end - self._n) % m
            if start + self._n <= m:  # the whole buffer or one run of it: no need to keep order
                vals = self._vals[start : start + self._n].copy()
            else:
                vals = np.concatenate([self._vals[start:], self._vals[: self._end % m]])
            self._cache = (key, nearest_rank_quantiles(vals, qs))
        return list(self._cache[1])


def top_namespaces(counts: dict[str, int], n: int) -> list[tuple[str, int]]:
    """``[(label, rows)]``: the ``n`` largest namespaces by rows (ties by name), then
    ``(OTHER_NAMESPACES, rows of all the others)`` if there are others. A namespace literally named
    ``_other`` is always counted in the other bucket, so label values stay unique."""
    named = sorted(
        ((name, rows) for name, rows in counts.items() if name != OTHER_NAMESPACES), key=lambda kv: (-kv[1], kv[0])
    )
    top = named[:n]
    rest = named[n:]
    if OTHER_NAMESPACES in counts or rest:
        top.append((OTHER_NAMESPACES, sum(r for _n, r in rest) + counts.get(OTHER_NAMESPACES, 0)))
    return top


class StageAggregator:
    """Histograms and windows of the sidecar's stages from stamped BatchRecords.

    Queue wait is posted -> taken into a batch, per request; compute the backend work of a whole
    batch; service posted -> results written, per request. Posting times are written by clients:
    a stage time is clamped to [0, STAGE_CAP_NS]."""

    def __init__(self, window_s: float, window_samples: int) -> None:
        self.hist = {s: np.zeros(len(STAGE_BOUNDS_NS) + 1, np.int64) for s in STAGES}
        self.sums_ns = {s: 0 for s in STAGES}
        self.windows = {s: SlidingWindow(window_s, window_samples) for s in STAGES}
        self.batch_size = np.zeros(len(BATCH_SIZE_BOUNDS) + 1, np.int64)
        self.batch_size_sum = 0

    def add(self, stamped: Sequence[tuple[BatchRecord, int]], now: float) -> None:
        """``stamped``: (record, CLOCK_MONOTONIC ns when the serving thread reported it; the end
        of service for a record without ``t_done_ns``)."""
        if not stamped:
            return
        n = len(stamped)
        sizes = np.fromiter((r.size for r, _t in stamped), np.int64, n)
        compute = np.fromiter((r.compute_ns for r, _t in stamped), np.int64, n)
        # Batches of several requests are done in a few numpy calls for all of them; batches of
        # one (the sidecar's SINGLE route, the common case at low load) as plain ints.
        posts: list[Any] = []  # arrays of posting times, with the batch's pick-up and done times
        picks: list[int] = []
        ends: list[int] = []
        one_post: list[int] = []
        one_pick: list[int] = []
        one_end: list[int] = []
        for r, t_obs in stamped:
            t_post = r.t_post_ns
            end = r.t_done_ns or t_obs
            if len(t_post) == 1:
                one_post.append(int(t_post[0]))
                one_pick.append(r.t_pick_ns)
                one_end.append(end)
            else:
                posts.append(t_post)
                picks.append(r.t_pick_ns)
                ends.append(end)
        queue_parts: list[np.ndarray] = []
        service_parts: list[np.ndarray] = []
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
