"""A deterministic simulation of the sidecar's launch decision (:mod:`kalos.sidecar_cuda.serving.launch`)
under a closed loop of callers: what batches a policy makes, how busy it keeps the device, what
latency the callers see. No processes, no clock: events in simulated nanoseconds.

The model follows the serving loop (:meth:`Pipeline.serve_pending
<kalos.sidecar_cuda.serving.pipeline.Pipeline.serve_pending>`): one host thread that, pass after pass,
answers the oldest batch in flight once the device has finished it, then (with fewer than
``depth`` batches in flight) asks the policy about the posted requests and, told to launch, takes
them and starts them on the device, queued behind the batch there. With ``depth`` 1 (``--pipeline
off``) a started batch is answered at once. Host work costs ``take(n)`` and ``answer(n)``, the
device ``a + b * n`` per batch. Callers live in ``procs`` processes; a process's callers answered
by one batch post again one after the other (its event loop runs them in turn): the k-th of them
``base + k * step + jitter`` after its answer, ``jitter`` uniform in ``[0, jitter_ns)`` from a
seeded generator. ``device_curve`` replaces ``a + b * n`` by a measured curve (interpolated).

    run(SimSpec(callers=256), FillPolicy(1_000_000)) -> SimResult (mean batch, recalls/s, ...)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from kalos.sidecar_cuda.serving.launch import LaunchPolicy, Returning


@dataclass(frozen=True)
class SimSpec:
    callers: int = 256
    procs: int = 8  # processes the callers are spread over (fewer if there are fewer callers)
    depth: int = 2  # batches in flight at most (1: --pipeline off)
    a_ns: int = 450_000  # device time of a batch: a + b * n
    b_ns: int = 2_400
    # ... or, when given, interpolated between (batch size, ns) points (a measured curve, sorted)
    device_curve: tuple[tuple[int, int], ...] = ()
    take_ns: tuple[int, int] = (20_000, 1_500)  # host: taking n requests and starting them, (fixed, per request)
    answer_ns: tuple[int, int] = (20_000, 1_500)  # host: writing n answers
    base_ns: int = 60_000  # turnaround of a caller: base + k * step + jitter (k: its turn in its process)
    step_ns: int = 4_000
    jitter_ns: int = 30_000
    duration_ns: int = 200_000_000
    warmup_ns: int = 20_000_000  # batches and requests before this are not counted
    seed: int = 1
    start_ns: int = 0  # simulated time begins here (a policy carried over from an earlier run keeps
    # a clock that never goes back: runs one after the other, as a sidecar serves 1, then 8 ... callers)

    def device_ns(self, n: int) -> int:
        """Device time of a batch of n requests."""
        if not self.device_curve:
            return self.a_ns + self.b_ns * n
        xs, ys = zip(*self.device_curve)
        return int(np.interp(n, xs, ys))


@dataclass
class SimResult:
    batches: list[int] = field(default_factory=list)  # requests per batch (after the warm-up)
    latencies_ns: list[int] = field(default_factory=list)  # post -> answer written
    waits_ns: list[int] = field(default_factory=list)  # post -> taken into a batch
    busy_ns: int = 0  # device time spent on counted batches
    span_ns: int = 1

    @property
    def mean_batch(self) -> float:
        return float(np.mean(self.batches)) if self.batches else 0.0

    @property
    def throughput(self) -> float:
        """Requests answered per second (simulated)."""
        return len(self.latencies_ns) / (self.span_ns / 1e9)

    @property
    def device_busy(self) -> float:
        return self.busy_ns / self.span_ns

    def latency_us(self, q: float) -> float:
        return float(np.percentile(self.latencies_ns, q)) / 1e3 if self.latencies_ns else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "mean_batch": round(self.mean_batch, 1),
            "recalls_per_s": round(self.throughput),
            "p50_us": round(self.latency_us(50), 1),
            "p99_us": round(self.latency_us(99), 1),
            "device_busy": round(self.device_busy, 3),
            "max_wait_us": round(max(self.waits_ns, default=0) / 1e3, 1),
        }


class _Batch:
    __slots__ = ("callers", "end", "start", "t_pick")

    def __init__(self, callers: list[int], t_pick: int, start: int, end: int) -> None:
        self.callers, self.t_pick, self.start, self.end = callers, t_pick, start, end


def run(spec: SimSpec, policy: LaunchPolicy) -> SimResult:
    """Simulate ``spec.duration_ns`` of serving ``spec.callers`` callers with ``policy``."""
    rng = np.random.default_rng(spec.seed)
    n = spec.callers
    procs = max(1, min(spec.procs, n))
    proc_of = [c % procs for c in range(n)]
    t_post = [0] * n  # when each caller's current request was posted
    t_done = [0] * n  # when its last answer was written (0: never)
    # heap: (t_post, caller)
    posted: list[tuple[int, int]] = [(spec.start_ns + spec.base_ns + c * 1000, c) for c in range(n)]
    heapq.heapify(posted)
    ready: list[int] = []  # posted by now, not taken
    out = Returning(n)  # the pipeline's book of callers answered and not back (caller = slot)
    inflight: list[_Batch] = []
    res = SimResult()
    t = device_free = spec.start_ns
    end, counted_from = spec.start_ns + spec.duration_ns, spec.start_ns + spec.warmup_ns

    def answer(b: _Batch) -> None:
        nonlocal t
        seen = t
        policy.device_done(len(b.callers), b.start, seen)
        t += spec.answer_ns[0] + spec.answer_ns[1] * len(b.callers)
        policy.answered(len(b.callers), t - b.t_pick, t)
        counted = b.t_pick >= counted_from
        if counted:
            res.batches.append(len(b.callers))
            res.busy_ns += b.end - b.start
        out.answered(np.asarray(b.callers, np.intp), t)
        turn = [0] * procs
        for c in b.callers:
            if counted:
                res.latencies_ns.append(t - t_post[c])
            t_done[c] = t
            k = turn[proc_of[c]]
            turn[proc_of[c]] = k + 1
            back = t + spec.base_ns + k * spec.step_ns + int(rng.integers(0, max(1, spec.jitter_ns)))
            heapq.heappush(posted, (back, c))

    while t < end:
        while posted and posted[0][0] <= t:
            tp, c = heapq.heappop(posted)
            t_post[c] = tp
            ready.append(c)
        if inflight and inflight[0].end <= t:
            answer(inflight.pop(0))
            continue
        wake = inflight[0].end if inflight else None
        if len(inflight) < spec.depth and ready:
            returning, answered_ns = out.count(np.asarray(ready, np.intp), t, policy)
            d = policy.decide(t, len(ready), returning, answered_ns, [(len(b.callers), b.start) for b in inflight])
            if d.launch:
                taken, ready[:] = list(ready), []
                out.back(taken)
                policy.turnarounds(
                    np.asarray([t_post[c] for c in taken], np.uint64), np.asarray([t_done[c] for c in taken], np.uint64)
                )
                t_pick = t
                if t_pick >= counted_from:
                    res.waits_ns.extend(t_pick - t_post[c] for c in taken)
                t += spec.take_ns[0] + spec.take_ns[1] * len(taken)
                start = max(t, device_free)
                device_free = start + spec.device_ns(len(taken))
                policy.launched(len(taken), t_pick, t, spec.depth > 1)
                inflight.append(_Batch(taken, t_pick, start, device_free))
                if spec.depth == 1:  # not pipelined: answered at once
                    t = max(t, device_free)
                    answer(inflight.pop(0))
                continue
            wake = min(wake, d.until_ns) if wake is not None else d.until_ns
        nxt = [x for x in (wake, posted[0][0] if posted else None) if x is not None]
        t = max(t + 1000, min(nxt)) if nxt else end  # the loop polls about every microsecond
    res.span_ns = max(1, spec.duration_ns - spec.warmup_ns)
    return res


__all__ = ["SimResult", "SimSpec", "run"]
