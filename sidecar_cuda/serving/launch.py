"""When the next batch leaves (``--launch``): a pure decision the pipeline asks on every pass.

Why the callers split into two groups
-------------------------------------
N callers each post a recall, wait for the answer, turn around (their own work, then their pool's
wake-up) and post again. Up to issue 27 a batch left once as many requests as the last batch held
had posted, or once the device was done (:class:`EagerPolicy`). With a batch ``A`` on the device,
the other half of the callers ``B`` had turned around already, so ``B`` left at once and queued
behind ``A`` (``PIPELINE_DEPTH`` = 2). When ``A`` finished, its callers were answered, turned
around while ``B`` ran, and left as ``A'`` queued behind ``B``::

    device        |==== A (N/2) ====|==== B (N/2) ====|==== A' ====|==== B' ====|
    A's callers                     ^answered, back ^ A' leaves behind B
    B's callers     ^ B leaves behind A             ^answered, back ^ B' leaves behind A'

Each half keeps its own phase: "as many as last time" is what the other half always supplies, so
a longer gather window changes nothing. Without the pipeline (``--pipeline off``) a batch is
answered before the next is taken, and the next takes whoever turned around during it; the gather
window (a quarter of the last batch's time) holds the rest only when they turn around fast and
alike. Batches hold about N/2 requests, and every batch pays a fixed part ``a`` of the device time
(one read of the matrix on a GPU) whatever it holds.

What :class:`FillPolicy` does
-----------------------------
There are two ways to serve N callers that keep coming back, and which one is cheaper depends on
times it measures: the device time of a batch by its size (:class:`SizeCurve`), the host's time to
launch a batch and to answer one (the same), and the callers' turnaround (:class:`Turnarounds`:
next ``t_post`` minus last ``t_done`` of a slot, which the control blocks carry).

* MERGE (:class:`Regime`): one batch of all of them. After a batch is answered the next leaves
  when its callers are back (every one, or the turnaround's :data:`RETURN_QUANTILE` after their
  answers), collecting everything that arrived meanwhile; requests posted while a batch is on the
  device wait for it and its callers. One fixed cost per N requests, but the device idles while
  the batch is answered, the callers turn around and the next is taken:
  ``D(N) + answer(N) + turnaround + take(N)`` per N.
* SPLIT: two halves, one on the device while the other turns around. A half leaves as soon as it
  is back (queued behind the other), or when the device is about to be free: the device stays
  busy, ``2 D(N/2)`` per N at best. Unlike the eager decision it aims at halves (a merged group
  splits again, and stragglers do not make a third batch).

It serves in the regime that costs less device time per request, as measured while serving in it
(:class:`Cost`: the device's busy plus idle time over the requests served, believed for
:data:`STALE_NS` and at about the same number of callers). The other regime is tried, for
:data:`MIN_BATCHES` batches, when its measurement is older than that and its estimate looks better
or at least plausible; a try that confirms it is worse makes its measurement believed twice as
long (up to :data:`MAX_TRUST_NS`). The estimate: this regime's measured cost scaled by the ratio
of the two regimes' costs computed from the measured times (:meth:`FillPolicy.estimate`). So a GPU
with a large fixed part and callers that turn around fast merges, a CPU backend (whose product
grows with the batch) or a slow host splits, and where the estimates are wrong the measurements
decide.

Bounds: a caller that posts while no one else is out (a lone caller) leaves at once in both
regimes. MERGE keeps the device waiting for callers at most ``--gather-us`` and at most the device
time a merge saves, ``D(N/2) + D(N/2) - D(N)``; SPLIT waits for a half at most a quarter of its
device time and ``--gather-us``; ``--gather-us 0`` never merges.

No clock and no I/O here: the pipeline passes ``now`` and counts, and reports what it measured
(:meth:`~FillPolicy.launched`, :meth:`~FillPolicy.device_done`, :meth:`~FillPolicy.answered`,
:meth:`~FillPolicy.turnarounds`). Times are CLOCK_MONOTONIC nanoseconds. Sizes are requests
(slots), the unit the pipeline counts posted work in: a slot of several rows (``recall_many``,
coalescing clients) counts once.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np


class Launch(str, enum.Enum):
    """``--launch``: when the next batch leaves. The values are the option's spellings."""

    FILL = "fill"  # FillPolicy: one batch of every caller, or halves that keep the device busy
    EAGER = "eager"  # EagerPolicy: the decision up to issue 27 (kept for A/B runs)
    MERGE = "merge"  # FillPolicy held in MERGE (to measure one regime against the other)
    SPLIT = "split"  # FillPolicy held in SPLIT


class Decision:
    """What the pipeline does now: ``launch`` the posted requests, or wait and ask again, at the
    latest at ``until_ns``; ``expect``: the requests the batch is expected to hold when it leaves."""

    __slots__ = ("expect", "launch", "until_ns")

    def __init__(self, launch: bool, until_ns: int, expect: int) -> None:
        self.launch = launch
        self.until_ns = until_ns
        self.expect = expect

    def __repr__(self) -> str:
        what = "launch" if self.launch else f"wait until {self.until_ns}"
        return f"Decision({what}, expect {self.expect})"


#: A batch on the device, as the policy sees it: (requests, CLOCK_MONOTONIC ns when it started).
Flight = tuple[int, int]


class LaunchPolicy(Protocol):
    """The interface both policies implement (the pipeline holds one)."""

    @property
    def horizon_ns(self) -> int:
        """How long after its answer a caller still counts as coming back (0: the policy does not
        use the returning count, so the pipeline need not compute it)."""
        ...

    def decide(self, now: int, posted: int, returning: int, answered_ns: int, inflight: Sequence[Flight]) -> Decision:
        """``posted`` requests wait in their slots (>= 1); ``returning`` callers were answered
        within :attr:`horizon_ns` and have not posted again, the last of them at ``answered_ns``;
        ``inflight``: the batches on the device, oldest first."""
        ...

    def launched(self, n: int, t_decided: int, t_started: int, pipelined: bool) -> None:
        """A batch of ``n`` requests was decided at ``t_decided`` and started on the device at
        ``t_started`` (the host's launch time between); ``pipelined``: it is left in flight while
        the next is taken (else it is answered before)."""
        ...

    def device_done(self, n: int, t_started: int, t_end: int) -> None:
        """A batch of ``n`` requests started at ``t_started`` was seen finished at ``t_end``."""
        ...

    def answered(self, n: int, service_ns: int, t_done: int) -> None:
        """A batch's ``n`` answers were written at ``t_done``, ``service_ns`` after it was taken."""
        ...

    def turnarounds(self, t_post: np.ndarray, t_done: np.ndarray) -> None:
        """The control blocks of requests just taken: ``t_post_ns`` (this post) and ``t_done_ns``
        (the slot's answer before it), as the clients left them (untrusted)."""
        ...

    def turnaround(self, t_post: int, t_done: int) -> None:
        """:meth:`turnarounds` for one request (the SINGLE route)."""
        ...


# ---------------------------------------------------------------------------- the old decision
_LONG_NS = 1_000_000_000  # "until something changes": a post, or a batch finishing


class EagerPolicy:
    """The decision up to issue 27: with a batch in flight, the next leaves once as many requests
    as the last batch held have posted (or the device is done); with none, a pass waits for that
    many, at most a quarter of the last batch's service time and at most ``gather_ns``."""

    horizon_ns = 0

    def __init__(self, gather_ns: int) -> None:
        self.gather_ns = gather_ns
        self.last_batch = 0
        self.last_service_ns = 0
        self._since = 0  # when this pass began waiting (0: not waiting)

    def decide(self, now: int, posted: int, returning: int, answered_ns: int, inflight: Sequence[Flight]) -> Decision:
        if posted < self.last_batch:
            if inflight:
                return Decision(False, now + _LONG_NS, self.last_batch)  # until the device is done
            if self.gather_ns:
                if not self._since:
                    self._since = now
                end = self._since + min(self.gather_ns, self.last_service_ns // 4)
                if now < end:
                    return Decision(False, end, self.last_batch)
        self._since = 0
        return Decision(True, now, posted)

    def launched(self, n: int, t_decided: int, t_started: int, pipelined: bool) -> None:
        pass

    def device_done(self, n: int, t_started: int, t_end: int) -> None:
        pass

    def answered(self, n: int, service_ns: int, t_done: int) -> None:
        self.last_batch, self.last_service_ns = n, service_ns

    def turnarounds(self, t_post: np.ndarray, t_done: np.ndarray) -> None:
        pass

    def turnaround(self, t_post: int, t_done: int) -> None:
        pass


# ---------------------------------------------------------------------------- measurements
#: Weight of a new measurement in a running mean.
SMOOTHING = 0.25


def _blend(old: float, new: float) -> float:
    """A running mean that one wild measurement (a first call that compiles a kernel, a page
    fault storm) moves by at most a factor of 2."""
    if new > 2 * old:
        new = 2 * old
    elif new < old / 2:
        new = old / 2
    return old + SMOOTHING * (new - old)


_QUARTER_OCTAVE = [0] + [int(4 * math.log2(n)) for n in range(1, 4097)]  # a size's bucket, made once


class SizeCurve:
    """A time as a function of a batch's size (requests), from measured batches: a running mean
    of size and time per quarter octave of sizes (sizes 181-214 share one), joined by straight
    lines, flat below the smallest size seen and continued along the last segment above the
    largest (flat while one size range is known). Made non-decreasing: a bigger batch never costs
    less."""

    __slots__ = ("_buckets", "_dirty", "_ts", "_xs")

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[float, float]] = {}  # bucket -> (mean size, mean ns)
        self._xs: list[float] = []  # the curve's points, rebuilt when asked after a change
        self._ts: list[float] = []
        self._dirty = False

    def observe(self, n: int, ns: int) -> None:
        if n <= 0 or ns <= 0:
            return
        b = _QUARTER_OCTAVE[n] if n < len(_QUARTER_OCTAVE) else int(4 * math.log2(n))
        old = self._buckets.get(b)
        self._buckets[b] = (
            (float(n), float(ns)) if old is None else (old[0] + SMOOTHING * (n - old[0]), _blend(old[1], ns))
        )
        self._dirty = True

    def _points(self) -> tuple[list[float], list[float]]:
        if self._dirty:
            pts = sorted(self._buckets.values())
            self._xs = [x for x, _ in pts]
            self._ts = list(itertools.accumulate((t for _, t in pts), max))
            self._dirty = False
        return self._xs, self._ts

    def known(self) -> bool:
        return bool(self._buckets)

    def __call__(self, n: int) -> float:
        """Estimated ns for a batch of ``n`` (0.0 while nothing was measured)."""
        xs, ts = self._points()
        if not xs:
            return 0.0
        i = bisect.bisect_left(xs, n)
        if i == 0:
            return ts[0]
        if i == len(xs):
            if len(xs) == 1:
                return ts[0]
            i -= 1
        x0, x1, t0, t1 = xs[i - 1], xs[i], ts[i - 1], ts[i]
        return max(0.0, t0 + (t1 - t0) * (n - x0) / (x1 - x0))

    def saving(self, p: int, e: int) -> float:
        """ns saved by serving ``p`` and ``e`` requests as one batch instead of two."""
        if p <= 0 or e <= 0:
            return 0.0
        return max(0.0, self(p) + self(e) - self(p + e))


#: Turnarounds are kept in quarter-octave bins from 2^10 ns (1 us) to 2^30 ns (1.07 s); a longer
#: one is a caller that went quiet, not one turning around.
_T_LO, _T_BINS = 10, 80
TURNAROUND_MAX_NS = 1 << (_T_LO + _T_BINS // 4)


class Turnarounds:
    """Quantiles of the callers' turnaround (answer written -> next post on that slot), over about
    the last ``memory`` measurements (older ones fade). Client-written stamps are untrusted: a
    stamp that makes no turnaround (none yet, negative, a second or more) is skipped, and a lie
    within range can only move how long a batch waits, which is capped anyway."""

    __slots__ = ("_cache", "_counts", "_keep", "_weight")

    def __init__(self, memory: int = 2048) -> None:
        # Fading without touching every bin per measurement: each new one weighs 1 / keep times
        # the one before (the counts are scaled back down before the weights grow large).
        self._counts = np.zeros(_T_BINS, np.float64)
        self._keep = 1.0 - 1.0 / memory  # weight left to an old measurement per new one
        self._weight = 1.0  # of the next measurement
        self._cache: dict[float, int | None] = {}

    def observe(self, t_post: np.ndarray, t_done: np.ndarray) -> None:
        # Unsigned stamps as int64 (a wrapped difference of garbage lands outside the range).
        done = t_done.astype(np.int64, copy=False)
        d = t_post.astype(np.int64, copy=False) - done
        ok = d[(done > 0) & (d > 0) & (d < TURNAROUND_MAX_NS)]
        if len(ok):
            idx = np.clip((np.log2(ok) - _T_LO) * 4, 0, _T_BINS - 1).astype(np.intp)
            self._counts += np.bincount(idx, minlength=_T_BINS) * self._weight
            self._faded(len(ok))

    def observe_one(self, t_post: int, t_done: int) -> None:
        """:meth:`observe` of one measurement, without arrays (the SINGLE route's)."""
        d = t_post - t_done
        if t_done > 0 and 0 < d < TURNAROUND_MAX_NS:
            i = int((math.log2(d) - _T_LO) * 4)
            self._counts[min(max(i, 0), _T_BINS - 1)] += self._weight
            self._faded(1)

    def _faded(self, k: int) -> None:
        self._weight /= self._keep**k
        if self._weight > 1e12:
            self._counts /= self._weight
            self._weight = 1.0
        if self._cache:
            self._cache.clear()

    def quantile(self, q: float) -> int | None:
        """The turnaround ``q`` of the callers stay within (ns); None before any was measured."""
        hit = self._cache.get(q, -1)
        if hit != -1:
            return hit
        total = float(self._counts.sum())
        out: int | None = None
        if total > 0:
            cum = np.cumsum(self._counts)
            i = min(int(np.searchsorted(cum, max(q * total, 1e-9))), _T_BINS - 1)
            below = float(cum[i - 1]) if i else 0.0
            frac = (q * total - below) / max(float(self._counts[i]), 1e-12)
            out = int(2.0 ** (_T_LO + (i + min(max(frac, 0.0), 1.0)) / 4))
        self._cache[q] = out
        return out


class Regime(enum.Enum):
    """How :class:`FillPolicy` serves the callers at the moment."""

    SPLIT = "split"  # the eager decision: batches queue behind each other, the device stays busy
    MERGE = "merge"  # one batch of (nearly) every caller: wait for the callers just answered


class Cost:
    """What a regime measured: the device's time per request served (its busy time plus the idle
    time before each batch) over its last :data:`COST_WINDOW` batches, with the number of callers
    it was measured at and when, and how long it is believed (``trust_ns``: doubled each time a
    try of the regime confirms it is the worse one, up to :data:`MAX_TRUST_NS`).

    :meth:`per_request` is the median over runs of :data:`COST_RUN` consecutive batches of their
    time over their requests: a run covers both halves of SPLIT (one waits, the other queues), and
    the median shrugs off the odd stall of the machine (another process, a page-fault storm)."""

    __slots__ = ("_recent", "_runs", "at", "batches", "callers", "trust_ns")

    def __init__(self) -> None:
        self._recent: deque[tuple[int, int]] = deque(maxlen=COST_RUN)  # (ns, requests) per batch
        self._runs: deque[float] = deque(maxlen=COST_WINDOW - COST_RUN + 1)  # ns per request of each run
        self.batches = 0  # batches counted since the regime was last entered
        self.callers = 0
        self.at = 0
        self.trust_ns = STALE_NS

    def add(self, n: int, ns: int, callers: int, now: int) -> None:
        if not _near(callers, self.callers):  # other callers, other costs: measure afresh
            self.batches = 0
            self.trust_ns = STALE_NS
        self.batches += 1
        self.callers, self.at = callers, now
        if self.batches <= SETTLE:  # the first batches of a stint carry the change of regime
            self._recent.clear()
            self._runs.clear()
            return
        recent = self._recent
        recent.append((ns, n))
        if len(recent) == COST_RUN:
            self._runs.append(sum(x for x, _ in recent) / max(1, sum(k for _, k in recent)))

    def per_request(self) -> float:
        if not self._runs:
            return math.inf
        runs = sorted(self._runs)
        return runs[len(runs) // 2]

    def fresh(self, now: int, callers: int) -> bool:
        """Measured lately, at about this many callers."""
        return self.batches >= SETTLE + MIN_BATCHES and now - self.at < self.trust_ns and _near(callers, self.callers)


def _near(a: int, b: int) -> bool:
    """About the same number of callers (within 20 %, or 2)."""
    return abs(a - b) <= max(2, a // 5)


# ---------------------------------------------------------------------------- the new decision
#: The share of a group of callers a batch waits for: the rest join the batch after it.
RETURN_QUANTILE = 0.99
#: Callers answered longer ago than this quantile of the turnaround no longer count as coming back.
HORIZON_QUANTILE = 0.99
#: Batches of a new stint in a regime that are not counted (the change of regime shows in them),
#: then the batches counted before its cost is judged; how long a measured cost is believed at
#: first (after that the other regime is tried again), and at most; the margin by which a measured
#: regime must be cheaper to be chosen.
SETTLE = 2
MIN_BATCHES = 8
#: A regime's cost: the median over runs of COST_RUN consecutive batches among its last COST_WINDOW.
COST_RUN = 4
COST_WINDOW = 32
STALE_NS = 500_000_000
MAX_TRUST_NS = 8_000_000_000
#: A regime not measured lately is tried when its estimate is below this multiple of the cost
#: measured in the current one.
PROBE_FACTOR = 2.0
#: One batch in this many of a lone caller is measured.
LONE_SAMPLE = 16
HYSTERESIS = 0.05


class FillPolicy:
    """Batches that fill: MERGE where one batch of every caller costs less device time per
    request, SPLIT into two halves that keep the device busy where not (the module docstring).
    ``gather_ns``: ``--gather-us`` in ns, the longest the device may be kept waiting for callers;
    ``on_switch(regime, why)``: told of every change of regime (the sidecar logs it). It starts in
    SPLIT, which is what an unmeasured device gets from the eager decision too."""

    def __init__(
        self, gather_ns: int, on_switch: Callable[[Regime, str], None] | None = None, held: Regime | None = None
    ) -> None:
        self.gather_ns = max(0, gather_ns)
        self._on_switch = on_switch
        self.held = held  # a regime it never leaves (--launch merge|split: measurements)
        self.device = SizeCurve()  # device ns per batch
        self.take = SizeCurve()  # host ns from the decision to the batch started on the device
        self.answer = SizeCurve()  # host ns from a batch seen finished to its answers written
        self.turn = Turnarounds()
        self.regime = held or Regime.SPLIT
        self.costs = {Regime.SPLIT: Cost(), Regime.MERGE: Cost()}
        self.callers = 0  # posted + coming back + on the device, lately (_count)
        self.pipelined = True  # batches are left in flight while the next is taken (--pipeline)
        self.idle_since = 0  # when the device was last seen finishing a batch
        self._round = 0  # when the posted requests began waiting (0: none are)
        self._finished = 0  # size of a batch seen finished whose answers are not written yet
        self._lone = 0  # batches of a lone caller seen

    @property
    def horizon_ns(self) -> int:
        h = self.turn.quantile(HORIZON_QUANTILE)
        return 0 if h is None else h

    # -- the decision
    def decide(self, now: int, posted: int, returning: int, answered_ns: int, inflight: Sequence[Flight]) -> Decision:
        if returning <= 0 and not inflight:  # no one else is out (a lone caller): at once
            self._count(posted)
            return self._go(now, posted)
        on_device = sum(n for n, _ in inflight)
        callers = self._count(posted + returning + on_device)
        if not self._round:
            self._round = now
        if self.regime is Regime.SPLIT:
            # Two halves, one on the device while the other turns around: a half leaves as soon
            # as it is here (queued behind the other), when the device is about to be free, or
            # when no one else is coming back.
            if returning <= 0 or 2 * posted >= callers:
                return self._go(now, posted)
            if inflight:
                t_ready = self._busy_until(inflight, now)
                return self._go(now, posted) if now >= t_ready else Decision(False, t_ready, posted + returning)
            half = callers // 2
            deadline = self._round + min(self.gather_ns, int(self.device(half)) // 4)
            return self._go(now, posted) if now >= deadline else Decision(False, deadline, half)
        back = self.turn.quantile(RETURN_QUANTILE) or 0
        if inflight:  # hold until it is done and its callers are back
            t_back = self._busy_until(inflight, now) + int(self.answer(on_device)) + back
            return Decision(False, t_back, callers)
        t_back = answered_ns + back
        deadline = max(self._round, answered_ns) + self._cap(callers)
        if now >= t_back or now >= deadline:
            return self._go(now, posted)
        return Decision(False, min(t_back, deadline), callers)

    def _count(self, seen: int) -> int:
        """The callers: as many as a decision sees (posted, coming back, on the device), or, for
        a while, more if more were seen lately (a caller slower than the horizon is not seen
        coming back, but it is there): a count that falls by 1/64 per decision."""
        self.callers = max(seen, self.callers - (self.callers >> 6))
        return self.callers

    def _cap(self, callers: int) -> int:
        """The longest the device may idle waiting for callers in MERGE."""
        half = callers // 2
        return int(min(self.gather_ns, self.device.saving(callers - half, half)))

    def _busy_until(self, inflight: Sequence[Flight], now: int) -> int:
        t = 0.0
        for n, t_start in inflight:
            t = max(t, float(t_start)) + self.device(n)
        return max(int(t), now)

    def _go(self, now: int, posted: int) -> Decision:
        self._round = 0
        return Decision(True, now, posted)

    # -- the regime
    def estimate(self, regime: Regime, callers: int) -> float:
        """Device ns per request a regime would cost at ``callers`` callers that keep coming
        back, from the measured times: the time a caller's round takes, over the callers. D, A and
        K are the device, answer and take times by size, T the turnaround.

        * MERGE: ``D(N) + A(N) + T + K(N)``, all in turn;
        * SPLIT, pipelined: the halves' rounds overlap, ``max(D(N/2) + D(N/2), D(N/2) + A + T + K)``;
          not pipelined, the host's work does not overlap the device's:
          ``max(2 (D + A + K)(N/2), (D + A + K)(N/2) + T)``."""
        back = self.turn.quantile(RETURN_QUANTILE)
        if callers <= 0 or back is None or not self.device.known():
            return math.inf
        D, A, K = self.device, self.answer, self.take
        if regime is Regime.MERGE:
            if not self.gather_ns:
                return math.inf
            return (D(callers) + A(callers) + back + K(callers)) / callers
        h = callers - callers // 2
        host = A(h) + K(h)
        if self.pipelined:
            return max(D(h) + D(callers - h), D(h) + host + back) / callers
        return max(2 * (D(h) + host), D(h) + host + back) / callers

    def _judge(self, now: int) -> None:
        """After a batch: move to the other regime if it costs less by :data:`HYSTERESIS`:
        measured, or where its measurement is not believed any more, this regime's measured cost
        scaled by the ratio of their estimates (:meth:`estimate` leaves out what slows both, such
        as callers starved of CPU: the ratio carries over, the level does not)."""
        cur = self.costs[self.regime]
        callers = self.callers
        if cur.batches < SETTLE + MIN_BATCHES or callers < 2 or self.held is not None:
            return
        cur_regime = self.regime
        other = Regime.MERGE if cur_regime is Regime.SPLIT else Regime.SPLIT
        oc = self.costs[other]
        ours = cur.per_request()
        measured = oc.fresh(now, callers)
        if measured:
            theirs = oc.per_request()
            better = theirs < ours * (1.0 - HYSTERESIS)
        else:
            mine = self.estimate(cur_regime, callers)
            theirs = ours * self.estimate(other, callers) / mine if 0 < mine < math.inf else math.inf
            # A regime not measured lately is tried where it looks better, and also where it
            # looks plausible: the estimates can be wrong in favour of this one.
            better = theirs < ours * PROBE_FACTOR
        if better:
            self.regime = other
            oc.batches = 0
            if measured:  # back from a try of this regime: believe its cost longer next time
                cur.trust_ns = min(2 * cur.trust_ns, MAX_TRUST_NS)
            if self._on_switch is not None:
                how = "measured" if measured else "estimated (a try)"
                self._on_switch(
                    other,
                    f"{callers} callers: {theirs / 1e3:.2f} us of device time per request {how}, "
                    f"against {ours / 1e3:.2f} us measured in {cur_regime.value}",
                )

    # -- what the pipeline measured
    def launched(self, n: int, t_decided: int, t_started: int, pipelined: bool) -> None:
        self.take.observe(n, t_started - t_decided)
        self.pipelined = pipelined

    def device_done(self, n: int, t_started: int, t_end: int) -> None:
        if self.callers <= 1:
            # A lone caller: there is nothing to decide, so only one of its batches in
            # LONE_SAMPLE is measured (it still teaches D(1), at a fraction of the cost).
            self._lone += 1
            if self._lone % LONE_SAMPLE:
                self.idle_since = t_end
                self._finished = 0
                return
        # A batch queued behind another started on the device when that one finished; the idle
        # time before a batch is the regime's cost too, up to what waiting for callers can explain
        # (a longer idle is a quiet spell, nobody's cost).
        start = max(t_started, self.idle_since)
        busy = t_end - start
        self.device.observe(n, busy)
        if self.idle_since and self.callers > 1:  # (a lone caller has no regime to judge)
            idle = start - self.idle_since
            if idle > self.gather_ns:
                idle = min(idle, self.gather_ns + int(self.answer(n) + self.take(n)) + self.horizon_ns)
            self.costs[self.regime].add(n, busy + idle, self.callers, t_end)
        self.idle_since = t_end
        self._finished = n

    def answered(self, n: int, service_ns: int, t_done: int) -> None:
        if self._finished:
            self.answer.observe(self._finished, t_done - self.idle_since)
            self._finished = 0
            self._judge(t_done)

    def turnarounds(self, t_post: np.ndarray, t_done: np.ndarray) -> None:
        self.turn.observe(t_post, t_done)

    def turnaround(self, t_post: int, t_done: int) -> None:
        if self.callers > 1 or self._lone % LONE_SAMPLE == LONE_SAMPLE - 1:
            self.turn.observe_one(t_post, t_done)


# ---------------------------------------------------------------------------- who is coming back
class Returning:
    """The callers a policy may wait for: per slot, when its last answer was written, until its
    caller posts again (a pool re-posts on the slot it was answered on, or on another it freed in
    the same turn: the count is what matters). Owned by the pipeline, which reports answers and
    takes; plain arrays, no I/O."""

    __slots__ = ("_at", "_n")

    def __init__(self, n_slots: int) -> None:
        self._at = np.zeros(n_slots, np.int64)  # 0: not out (never answered, or back)
        self._n = 0  # slots out

    def answered(self, sel: np.ndarray, t_done: int) -> None:
        self._n += len(sel) - int(np.count_nonzero(self._at[sel]))
        self._at[sel] = t_done

    def answered_one(self, i: int, t_done: int) -> None:
        if not self._at[i]:
            self._n += 1
        self._at[i] = t_done

    def back(self, taken: list[int]) -> None:
        """The requests of slots ``taken`` were taken: their callers are back."""
        if self._n and len(taken) == 1:  # (a lone caller: no arrays)
            i = taken[0]
            if self._at[i]:
                self._at[i] = 0
                self._n -= 1
        elif self._n and taken:
            sel = np.asarray(taken, np.intp)
            self._n -= int(np.count_nonzero(self._at[sel]))
            self._at[sel] = 0

    def count(self, posted: np.ndarray, now: int, policy: LaunchPolicy) -> tuple[int, int]:
        """Of the callers answered within the ``policy``'s horizon before ``now``, those not
        among the ``posted`` slots: how many, and when the last of them was answered ((0, 0):
        none). One answered longer ago has gone quiet and is forgotten."""
        n = self._n
        if not n:
            return 0, 0
        at = self._at
        if n == 1 and len(posted) == 1 and at[posted[0]]:
            return 0, 0  # a lone caller back on its own slot
        horizon_ns = policy.horizon_ns
        if not horizon_ns:  # (the policy does not wait for anyone)
            return 0, 0
        if len(posted) >= n and int(np.count_nonzero(at[posted])) == n:
            return 0, 0  # every one of them has posted
        out = at > now - horizon_ns
        quiet = n - int(np.count_nonzero(out))
        if quiet:
            at[~out] = 0
            self._n = n - quiet
        out[posted] = False
        k = int(np.count_nonzero(out))
        return (k, int(at[out].max())) if k else (0, 0)

    def __len__(self) -> int:
        return self._n


def launch_policy(kind: Launch, gather_ns: int, on_switch: Callable[[Regime, str], None] | None = None) -> LaunchPolicy:
    """The policy ``--launch`` names, with ``--gather-us`` (in ns) as its cap; ``on_switch``: see
    :class:`FillPolicy`."""
    if kind is Launch.EAGER:
        return EagerPolicy(gather_ns)
    held = {Launch.MERGE: Regime.MERGE, Launch.SPLIT: Regime.SPLIT}.get(kind)
    return FillPolicy(gather_ns, on_switch, held)


__all__ = [
    "RETURN_QUANTILE",
    "Cost",
    "Decision",
    "EagerPolicy",
    "FillPolicy",
    "Flight",
    "Launch",
    "LaunchPolicy",
    "Regime",
    "Returning",
    "SizeCurve",
    "Turnarounds",
    "launch_policy",
]
