"""The launch decisions in a deterministic simulation of the closed loop (kalos.testing.launchsim):
N callers in 8 processes who post, are answered and turn around; a device of a + b n per batch
with two batches in flight at most; a serving thread that pays for taking and answering.

Three machines: a GPU at 1M x 768 (a = 450 us, b = 2.4 us) with a host as the issue measured it
(Python slot work, 1.5 us a request each way) and with a lean one, and a CPU-like device whose
time grows with the batch. The old decision must reproduce the split of issue 27 (that makes the
test able to fail); the new one must fill the batches where that pays, keep the device busy where
it does not, never be slower, and never make a lone caller wait."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kalos.sidecar_cuda.serving.launch import EagerPolicy, FillPolicy, Regime
from kalos.testing.launchsim import SimResult, SimSpec, run

pytestmark = pytest.mark.timeout(120)

GATHER_NS = 1_000_000  # --gather-us 1000, the default
BASE = SimSpec(duration_ns=250_000_000, warmup_ns=50_000_000)
GPU_PYTHON_HOST = replace(BASE, take_ns=(20_000, 1_500), answer_ns=(20_000, 1_500))
GPU_LEAN_HOST = replace(BASE, take_ns=(5_000, 200), answer_ns=(5_000, 200))
CPU_LIKE = replace(BASE, a_ns=50_000, b_ns=20_000, take_ns=(5_000, 200), answer_ns=(5_000, 200))
MACHINES = {"gpu-python-host": GPU_PYTHON_HOST, "gpu-lean-host": GPU_LEAN_HOST, "cpu-like": CPU_LIKE}


def both(spec: SimSpec) -> tuple[SimResult, SimResult, FillPolicy]:
    fill = FillPolicy(GATHER_NS)
    return run(spec, EagerPolicy(GATHER_NS)), run(spec, fill), fill


def show(what: str, eager: SimResult, fill: SimResult, policy: FillPolicy) -> None:
    print(f"\n[{what}] eager {eager.summary()}\n{' ' * (len(what) + 3)}fill  {fill.summary()} ({policy.regime.value})")


@pytest.mark.parametrize("callers", [8, 64, 256])
def test_the_old_decision_splits_the_callers_and_fill_merges_them(callers):
    eager, fill, policy = both(replace(GPU_LEAN_HOST, callers=callers))
    show(f"gpu-lean-host {callers} callers", eager, fill, policy)
    assert eager.mean_batch == pytest.approx(callers / 2, rel=0.1)  # the split of issue 27
    assert policy.regime is Regime.MERGE
    assert fill.mean_batch >= 0.9 * callers
    assert fill.throughput >= 1.05 * eager.throughput


def test_fill_keeps_the_device_busy_where_merging_does_not_pay():
    """With the host's Python slot work (about 0.8 ms to answer and take 256 requests) one batch
    of everyone idles the device longer than the batch it saves: two halves, device always busy."""
    eager, fill, policy = both(replace(GPU_PYTHON_HOST, callers=256))
    show("gpu-python-host 256 callers", eager, fill, policy)
    assert eager.mean_batch == pytest.approx(128, rel=0.1) and eager.device_busy < 0.9
    assert policy.regime is Regime.SPLIT
    assert fill.device_busy >= 0.95
    assert fill.throughput >= 1.1 * eager.throughput


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("depth", [2, 1])
@pytest.mark.parametrize("callers", [1, 8, 64, 256])
def test_fill_is_never_slower_than_the_old_decision(machine, depth, callers):
    spec = replace(MACHINES[machine], callers=callers, depth=depth)
    eager, fill, policy = both(spec)
    show(f"{machine} depth {depth} {callers} callers", eager, fill, policy)
    assert fill.throughput >= 0.97 * eager.throughput
    assert fill.latency_us(99) <= 1.1 * max(eager.latency_us(99), eager.latency_us(50) * 2)


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_a_lone_caller_never_waits(machine):
    eager, fill, _ = both(replace(MACHINES[machine], callers=1))
    assert fill.waits_ns and max(fill.waits_ns) == 0 and max(eager.waits_ns) == 0
    assert fill.latencies_ns == eager.latencies_ns


def test_a_device_curve_replaces_the_linear_model():
    lin = SimSpec(callers=64, duration_ns=60_000_000)
    same = SimSpec(callers=64, duration_ns=60_000_000, device_curve=((1, lin.device_ns(1)), (512, lin.device_ns(512))))
    assert [same.device_ns(n) for n in (1, 7, 100, 512)] == [lin.device_ns(n) for n in (1, 7, 100, 512)]
    a, b = run(lin, FillPolicy(1_000_000)), run(same, FillPolicy(1_000_000))
    assert (a.batches, a.latencies_ns) == (b.batches, b.latencies_ns)
    slow = SimSpec(callers=64, duration_ns=60_000_000, device_curve=((1, 900_000), (512, 2_000_000)))
    assert run(slow, FillPolicy(1_000_000)).throughput < a.throughput


def test_a_later_start_shifts_time_and_nothing_else():
    """``start_ns``: the same run later on the clock (so one policy can serve runs in turn)."""
    a = run(SimSpec(callers=32, duration_ns=40_000_000), FillPolicy(1_000_000))
    b = run(SimSpec(callers=32, duration_ns=40_000_000, start_ns=7_000_000_000), FillPolicy(1_000_000))
    assert (a.batches, a.latencies_ns, a.waits_ns, a.busy_ns) == (b.batches, b.latencies_ns, b.waits_ns, b.busy_ns)
    assert a.batches and a.throughput == b.throughput


def test_one_policy_serves_runs_in_turn():
    """A sidecar serves 1, then 8, then 64 callers: the policy's measurements carry over and each
    run still serves every caller and fills its batches as a fresh policy does (within a request)."""
    pol, t0 = FillPolicy(1_000_000), 0
    for callers in (1, 8, 64):
        spec = SimSpec(callers=callers, duration_ns=60_000_000, start_ns=t0)
        carried, fresh = run(spec, pol), run(SimSpec(callers=callers, duration_ns=60_000_000), FillPolicy(1_000_000))
        assert carried.batches and max(carried.batches) <= callers
        assert abs(carried.mean_batch - fresh.mean_batch) <= 1.0, (callers, carried.mean_batch, fresh.mean_batch)
        t0 += spec.duration_ns + 10_000_000
