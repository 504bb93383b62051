"""The launch decision (sidecar_cuda/serving/launch.py): pure, so it is driven here with a fake clock and
made-up measurements; tests/unit/test_launch_sim.py runs it in a simulated closed loop and
tests/ipc/test_launch_serving.py on a real sidecar."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kalos.sidecar_cuda.serving import launch as L
from kalos.sidecar_cuda.serving.launch import (
    Cost,
    EagerPolicy,
    FillPolicy,
    Launch,
    Regime,
    Returning,
    SizeCurve,
    Turnarounds,
    launch_policy,
)

pytestmark = pytest.mark.timeout(30)

US = 1000
MS = 1_000_000


# ---------------------------------------------------------------------------- SizeCurve
def test_size_curve_is_linear_between_sizes_flat_below_and_continued_above():
    c = SizeCurve()
    assert not c.known() and c(10) == 0.0 and c.saving(4, 4) == 0.0
    c.observe(8, 500 * US)
    assert c(1) == c(8) == c(256) == 500 * US  # one size known: flat
    c.observe(256, 1000 * US)
    assert c(1) == 500 * US  # flat below the smallest
    assert c(132) == pytest.approx(750 * US)  # linear between
    assert c(504) == pytest.approx(1500 * US)  # along the last segment above
    # A merge of two halves saves one fixed part: 2 D(128) - D(256).
    assert c.saving(128, 128) == pytest.approx(2 * c(128) - c(256))
    assert c.saving(0, 5) == 0.0


def test_size_curve_never_falls_with_size_and_shrugs_off_one_wild_measurement():
    c = SizeCurve()
    c.observe(4, 400 * US)
    c.observe(64, 300 * US)  # noise: a bigger batch measured faster
    assert c(64) >= c(4)
    c.observe(16, 500 * US)
    c.observe(16, 500 * MS)  # a first call that compiled a kernel: moves the mean by at most 2x
    assert c(16) <= 2 * 500 * US
    for _ in range(30):
        c.observe(16, 500 * US)
    assert c(16) == pytest.approx(500 * US, rel=0.01)
    c.observe(0, 100)  # nonsense is ignored
    c.observe(5, -1)
    assert c(16) == pytest.approx(500 * US, rel=0.01)


# ---------------------------------------------------------------------------- Turnarounds
def test_turnaround_quantiles_follow_the_measurements(rng):
    t = Turnarounds()
    assert t.quantile(0.5) is None
    d = rng.uniform(50 * US, 450 * US, 4000).astype(np.int64)
    done = rng.integers(1, 1 << 40, 4000).astype(np.uint64)
    t.observe(done + d.astype(np.uint64), done)
    for q in (0.1, 0.5, 0.9, 0.99):
        # Quarter-octave bins: within 19 % of the exact quantile.
        assert t.quantile(q) == pytest.approx(np.quantile(d, q), rel=0.19), q
    # Older ones fade: a new regime of slow callers takes over within a few memories' worth.
    for _ in range(3):
        d2 = rng.uniform(5 * MS, 6 * MS, 2048).astype(np.int64)
        t.observe(done[:2048] + d2.astype(np.uint64), done[:2048])
    assert t.quantile(0.5) == pytest.approx(5.5 * MS, rel=0.19)


def test_turnaround_stamps_that_make_no_turnaround_are_skipped():
    """t_post_ns and t_done_ns are what clients left in shared memory: untrusted."""
    t = Turnarounds()
    big = np.uint64((1 << 64) - 5)
    post = np.array([100, 50, 5 * 10**9, big, 10, 2 * MS], np.uint64)
    done = np.array([0, 60, 1, 7, big, MS], np.uint64)  # none yet, negative, > 1 s, garbage x2, ok
    t.observe(post, done)
    assert t.quantile(0.0) == pytest.approx(t.quantile(1.0), rel=0.19)  # only the last one counted
    assert t.quantile(0.5) == pytest.approx(MS, rel=0.19)
    t.observe_one(5, 0)
    t.observe_one(5, 9)
    assert t.quantile(0.5) == pytest.approx(MS, rel=0.19)


def test_single_turnarounds_count_as_batched_ones(rng):
    one, many = Turnarounds(memory=256), Turnarounds(memory=256)
    for scale in (200 * US, 20 * MS):  # the newer measurements take over in both
        d = rng.uniform(scale, 2 * scale, 600).astype(np.int64)
        for x in d.tolist():
            one.observe_one(1000 + x, 1000)
        many.observe(np.uint64(1000) + d.astype(np.uint64), np.full(len(d), 1000, np.uint64))
        for q in (0.1, 0.5, 0.9):
            assert one.quantile(q) == pytest.approx(many.quantile(q), rel=0.1)
            assert one.quantile(q) == pytest.approx(np.quantile(d, q), rel=0.19)


# ---------------------------------------------------------------------------- Returning
class Horizon:
    def __init__(self, ns: int) -> None:
        self.horizon_ns = ns


def test_returning_counts_the_answered_callers_not_back_within_the_horizon():
    r = Returning(8)
    h = Horizon(1 * MS)
    assert r.count(np.array([3], np.intp), 0, h) == (0, 0)
    r.answered(np.array([0, 1, 2, 3], np.intp), 10 * MS)
    r.answered_one(5, 10 * MS + 100)
    assert len(r) == 5
    assert r.count(np.array([1, 2], np.intp), 10 * MS + 200, h) == (3, 10 * MS + 100)
    r.back([1, 2])
    assert len(r) == 3
    r.answered(np.array([0, 6], np.intp), 10 * MS + 300)  # 0 answered again: still one slot
    assert len(r) == 4
    assert r.count(np.array([], np.intp), 10 * MS + 400, h) == (4, 10 * MS + 300)
    # Past the horizon the quiet ones are forgotten (3 and 5); 0 and 6 are still expected.
    assert r.count(np.array([], np.intp), 11 * MS + 250, h) == (2, 10 * MS + 300)
    assert len(r) == 2
    assert r.count(np.array([0, 6], np.intp), 11 * MS + 250, h) == (0, 0)


def test_a_lone_caller_back_on_its_slot_is_not_waited_for_and_needs_no_horizon():
    class NoHorizon:
        @property
        def horizon_ns(self) -> int:
            raise AssertionError("asked for the horizon")

    r = Returning(4)
    r.answered_one(2, 5 * MS)
    assert r.count(np.array([2], np.intp), 6 * MS, NoHorizon()) == (0, 0)


# ---------------------------------------------------------------------------- EagerPolicy
def test_eager_is_the_decision_before_issue_27():
    p = EagerPolicy(gather_ns=1 * MS)
    assert p.horizon_ns == 0
    assert p.decide(0, 1, 0, 0, []).launch  # nothing served yet
    p.answered(8, 2 * MS, 10 * MS)
    # A batch in flight: wait for as many as the last batch held.
    assert not p.decide(11 * MS, 7, 0, 0, [(4, 10 * MS)]).launch
    assert p.decide(11 * MS, 8, 0, 0, [(4, 10 * MS)]).launch
    # None in flight: a quarter of the last service time (0.5 ms), at most gather_ns.
    d = p.decide(20 * MS, 3, 0, 0, [])
    assert not d.launch and d.until_ns == 20 * MS + 500 * US and d.expect == 8
    assert not p.decide(20 * MS + 499 * US, 5, 0, 0, []).launch
    assert p.decide(20 * MS + 500 * US, 5, 0, 0, []).launch
    p.answered(8, 40 * MS, 30 * MS)
    assert p.decide(31 * MS, 3, 0, 0, []).until_ns == 32 * MS  # gather_ns caps it
    off = EagerPolicy(0)
    off.answered(8, 2 * MS, 0)
    assert off.decide(1, 3, 0, 0, []).launch  # --gather-us 0: no waiting


# ---------------------------------------------------------------------------- FillPolicy
def gpu_like(p: FillPolicy, *, a: int = 450 * US, b: int = 2_400, turn: int = 150 * US, host: int = 20 * US) -> None:
    """Measurements of a device with a large fixed part (D = a + b n) and callers that turn around
    in ``turn``."""
    for n in (1, 8, 64, 128, 256):
        p.device.observe(n, a + b * n)
        p.take.observe(n, host)
        p.answer.observe(n, host)
    done = np.arange(1, 2001, dtype=np.uint64) * np.uint64(MS)
    p.turnarounds(done + np.uint64(turn), done)


def test_fill_lets_a_lone_caller_go_at_once_in_every_regime():
    for regime in Regime:
        p = FillPolicy(1 * MS)
        gpu_like(p)
        p.regime = regime
        d = p.decide(5 * MS, 1, 0, 0, [])
        assert d.launch and d.until_ns == 5 * MS and d.expect == 1
    assert FillPolicy(1 * MS).decide(0, 1, 0, 0, []).launch  # and before anything is measured


def test_fill_split_sends_a_half_once_it_is_back_and_the_rest_when_the_device_is_about_free():
    p = FillPolicy(1 * MS)
    gpu_like(p)
    assert p.regime is Regime.SPLIT
    on_device = [(128, 10 * MS)]  # busy until about 10 ms + D(128) = 10.757 ms
    d = p.decide(10 * MS + 100 * US, 100, 28, 10 * MS, on_device)
    assert not d.launch and d.until_ns == pytest.approx(10 * MS + 450 * US + 2_400 * 128, abs=2)
    assert p.decide(10 * MS + 200 * US, 128, 0, 0, on_device).launch  # the whole half is back
    assert p.decide(10 * MS + 200 * US, 127, 1, 10 * MS, on_device).launch is False
    assert p.decide(d.until_ns, 127, 1, 10 * MS, on_device).launch  # the device is about free
    # Nothing on the device: wait for a half at most a quarter of its device time.
    p = FillPolicy(1 * MS)
    gpu_like(p)
    d = p.decide(20 * MS, 10, 118, 19 * MS, [])
    assert not d.launch and d.until_ns == 20 * MS + (450 * US + 2_400 * 64) // 4
    assert p.decide(20 * MS + 10 * US, 64, 64, 19 * MS, []).launch


def test_fill_merge_holds_the_posted_while_the_device_works_then_waits_for_the_callers_back():
    p = FillPolicy(1 * MS)
    gpu_like(p, turn=150 * US)
    p.regime = Regime.MERGE
    # A straggler posts while the batch of the others runs: held until they are back.
    d = p.decide(10 * MS + 100 * US, 1, 0, 0, [(255, 10 * MS)])
    busy = 10 * MS + 450 * US + 2_400 * 255
    assert not d.launch and d.expect == 256
    assert d.until_ns == pytest.approx(busy + 20 * US + 150 * US, rel=0.01)
    # The batch is answered at 12 ms: the first of its callers is back at 12.1 ms. Wait until the
    # turnaround's 99th percentile after the answer (about 150 us) ...
    d = p.decide(12 * MS + 100 * US, 2, 254, 12 * MS, [])
    assert not d.launch and d.until_ns == pytest.approx(12 * MS + 150 * US, rel=0.001)
    assert not p.decide(12 * MS + 120 * US, 200, 56, 12 * MS, []).launch
    assert p.decide(12 * MS + 130 * US, 256, 0, 0, []).launch  # ... or until every one is back
    d = p.decide(13 * MS, 2, 254, 12 * MS + 900 * US, [])
    assert p.decide(d.until_ns, 250, 6, 12 * MS + 900 * US, []).launch  # the stragglers miss it


@pytest.mark.parametrize("gather_us,turn_us", [(100, 900), (1000, 900), (5000, 900)])
def test_fill_merge_never_keeps_the_device_waiting_past_its_caps(gather_us, turn_us):
    """At most --gather-us, and at most the device time a merge saves (2 D(128) - D(256) = a)."""
    p = FillPolicy(gather_us * US)
    gpu_like(p, turn=turn_us * US)
    p.regime = Regime.MERGE
    cap = min(gather_us * US, 450 * US)
    d = p.decide(12 * MS, 1, 255, 12 * MS, [])
    assert not d.launch and d.until_ns == 12 * MS + cap
    assert not p.decide(12 * MS + cap - 1, 100, 156, 12 * MS, []).launch
    assert p.decide(12 * MS + cap, 100, 156, 12 * MS, []).launch


def drive(p: FillPolicy, batches: int, n: int, callers: int, *, t: int, a: int, b: int, idle: int, host: int) -> int:
    """Report ``batches`` batches of ``n`` requests out of ``callers`` to ``p`` as the pipeline
    would, each after ``idle`` of idle device; returns the time after the last."""
    for _ in range(batches):
        p.decide(t, 1, callers - 1, t - 1, [])  # (the pipeline's count of callers)
        t += idle
        p.launched(n, t - host, t, True)
        t += a + b * n
        p.device_done(n, t - a - b * n, t)
        t += host
        p.answered(n, a + b * n, t)
    return t


def test_fill_moves_to_merge_where_one_batch_costs_less_per_request_and_says_why():
    seen: list[tuple[Regime, str]] = []
    p = FillPolicy(1 * MS, on_switch=lambda r, why: seen.append((r, why)))
    gpu_like(p, turn=100 * US)
    # Served in halves of 128, the device busy: 2 D(128) per 256 requests.
    # (the first batch only starts the device's clock; then SETTLE, then MIN_BATCHES are counted)
    t = drive(p, L.SETTLE + L.MIN_BATCHES, 128, 256, t=10 * MS, a=450 * US, b=2_400, idle=0, host=20 * US)
    assert p.regime is Regime.SPLIT and not seen  # not judged before MIN_BATCHES counted
    assert p.estimate(Regime.MERGE, 256) < p.estimate(Regime.SPLIT, 256)
    drive(p, 1, 128, 256, t=t, a=450 * US, b=2_400, idle=0, host=20 * US)
    assert p.regime is Regime.MERGE
    assert len(seen) == 1 and seen[0][0] is Regime.MERGE and "256 callers" in seen[0][1]


def test_fill_tries_merge_where_it_looks_worse_and_backs_off_when_it_is():
    """A CPU backend: no fixed part worth waiting for. The estimates say split, but they may be
    wrong: merge is tried once its measurement is stale, and each try that confirms it is worse
    makes the next one wait twice as long."""
    p = FillPolicy(1 * MS)
    gpu_like(p, a=20 * US, b=100 * US, turn=200 * US)
    assert p.estimate(Regime.MERGE, 64) > p.estimate(Regime.SPLIT, 64)
    t = drive(p, 1 + L.SETTLE + L.MIN_BATCHES, 32, 64, t=10 * MS, a=20 * US, b=100 * US, idle=0, host=20 * US)
    assert p.regime is Regime.MERGE  # (never measured: tried)
    trust = L.STALE_NS
    for _ in range(3):
        # Merging measures worse: back to split, and merge is believed worse twice as long.
        t = drive(p, L.SETTLE + L.MIN_BATCHES, 64, 64, t=t, a=20 * US, b=100 * US, idle=2 * MS, host=20 * US)
        assert p.regime is Regime.SPLIT and p.costs[Regime.MERGE].trust_ns == 2 * trust
        trust *= 2
        t = drive(p, L.SETTLE + L.MIN_BATCHES + 1, 32, 64, t=t, a=20 * US, b=100 * US, idle=0, host=20 * US)
        assert p.regime is Regime.SPLIT  # within the trust: no try
        t = drive(p, 1, 32, 64, t=t + trust, a=20 * US, b=100 * US, idle=0, host=20 * US)
        assert p.regime is Regime.MERGE  # past it: tried again


def test_fill_leaves_merge_when_its_measured_cost_is_worse_and_tries_again_when_stale():
    p = FillPolicy(1 * MS)
    gpu_like(p, turn=100 * US)
    p.regime = Regime.MERGE
    # Merging measured badly: 3 ms of idle before every batch of 256.
    t = drive(p, 1 + L.SETTLE + L.MIN_BATCHES, 256, 256, t=10 * MS, a=450 * US, b=2_400, idle=900 * US, host=20 * US)
    assert p.regime is Regime.SPLIT
    # Split measured: halves with the device busy.
    t = drive(p, L.SETTLE + L.MIN_BATCHES + 1, 128, 256, t=t, a=450 * US, b=2_400, idle=0, host=20 * US)
    assert p.regime is Regime.SPLIT  # the fresh measurement of MERGE is believed over its estimate
    # Later the measurement of MERGE is stale: its estimate (which looks better) is tried again.
    drive(p, 1, 128, 256, t=t + L.STALE_NS, a=450 * US, b=2_400, idle=0, host=20 * US)
    assert p.regime is Regime.MERGE


def test_fill_counts_callers_it_saw_lately_too():
    """A caller slower than the horizon is not seen coming back but is there: the count falls
    slowly, not to what one decision sees."""
    p = FillPolicy(1 * MS)
    gpu_like(p)
    p.decide(1 * MS, 100, 156, 1, [])
    assert p.callers == 256
    p.decide(2 * MS, 128, 0, 0, [])  # (the others not seen)
    assert p.callers == 252
    for i in range(400):
        p.decide(3 * MS + i, 128, 0, 0, [])
    assert p.callers == 128


def test_a_regime_cost_covers_both_halves_and_shrugs_off_a_stall():
    c = Cost()
    for i in range(L.SETTLE + L.COST_WINDOW):
        # Halves of 32: one waited 200 us for its callers, the other was queued (no idle).
        c.add(32, 640 * US + (200 * US if i % 2 else 0), 64, i * MS)
    assert c.per_request() == pytest.approx(740 * US / 32)
    c.add(32, 50 * MS, 64, 40 * MS)  # the machine stalled once
    assert c.per_request() == pytest.approx(740 * US / 32, rel=0.05)


def test_fill_measures_afresh_when_the_callers_change():
    c = Cost()
    for i in range(L.SETTLE + L.MIN_BATCHES):
        assert not c.fresh(i * MS, 64)
        c.add(64, 640 * US, 64, i * MS)
    assert c.fresh(20 * MS, 64) and c.per_request() == pytest.approx(10 * US)
    assert not c.fresh(20 * MS, 128) and not c.fresh(20 * MS + L.STALE_NS, 64)
    c.add(128, 128 * US, 128, 21 * MS)
    assert c.batches == 1 and c.per_request() == math.inf


def test_gather_us_zero_never_merges():
    p = FillPolicy(0)
    gpu_like(p)
    assert p.estimate(Regime.MERGE, 256) == math.inf
    p.regime = Regime.MERGE
    assert p.decide(12 * MS, 1, 255, 12 * MS, []).launch  # and even made to, it waits for no one


def test_launch_policy_builds_what_the_option_names():
    assert isinstance(launch_policy(Launch.EAGER, 5), EagerPolicy)
    p = launch_policy(Launch.FILL, 5)
    assert isinstance(p, FillPolicy) and p.gather_ns == 5 and p.held is None
    assert [m.value for m in Launch] == ["fill", "eager", "merge", "split"]


@pytest.mark.parametrize("kind,regime", [(Launch.MERGE, Regime.MERGE), (Launch.SPLIT, Regime.SPLIT)])
def test_merge_and_split_hold_fill_in_one_regime(kind, regime):
    p = launch_policy(kind, 1 * MS)
    assert isinstance(p, FillPolicy) and p.regime is regime
    gpu_like(p, turn=100 * US)
    other = 128 if regime is Regime.MERGE else 256  # what fill itself would measure its way to
    drive(p, 3 * (L.SETTLE + L.MIN_BATCHES), other, 256, t=10 * MS, a=450 * US, b=2_400, idle=3 * MS, host=20 * US)
    assert p.regime is regime
