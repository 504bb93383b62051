"""The launch policy (``--launch``) on a real sidecar: real slots and semaphores, clients in this
process and in others, answers checked against float64. The decisions themselves are tested pure
(tests/unit/test_launch.py) and in a simulated closed loop (tests/unit/test_launch_sim.py); here:
that the pipeline feeds the policy what it measures, that a lone caller is never held back, and
that merging, once chosen, really serves every caller in one batch."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import unique_name

from kalos import RecallClient
from kalos.sidecar_cuda.server import ServeConfig, Sidecar
from kalos.sidecar_cuda.serving.launch import EagerPolicy, FillPolicy, Regime
from kalos.testing.loadgen import LoadSpec, check_samples, run_load

pytestmark = pytest.mark.timeout(120)

N, DIM = 4000, 32


class Serving:
    """A sidecar of this process serving from a thread; its batches' sizes and its policy's
    decisions recorded."""

    def __init__(self, seed: int, launch: str, **cfg: object) -> None:
        self.cfg = ServeConfig(
            name=unique_name("launch"),
            dim=DIM,
            slots=24,
            backend="numpy",
            random_rows=N,
            seed=seed,
            launch=launch,
            **cfg,  # type: ignore[arg-type]
        )
        self.matrix = np.random.default_rng(seed).standard_normal((N, DIM), dtype=np.float32)
        self.sc = Sidecar(self.cfg)
        self.sizes: list[int] = []
        self.waits = 0
        self.decisions = 0

    def __enter__(self) -> Serving:
        self.sc.start()
        assert self.sc.pipeline is not None
        self.sc.stats.observers.append(lambda rec: self.sizes.append(rec.size))
        self.watch(self.sc.pipeline.launch)
        self.th = threading.Thread(target=self.sc.serve_forever, daemon=True)
        self.th.start()
        return self

    def watch(self, policy: object) -> None:
        decide = policy.decide  # type: ignore[attr-defined]

        def counted(*a: object) -> object:
            d = decide(*a)
            self.decisions += 1
            self.waits += not d.launch
            return d

        policy.decide = counted  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        self.sc.request_stop()
        self.th.join(10)
        assert not self.th.is_alive()


@pytest.mark.parametrize("launch", ["fill", "eager"])
def test_a_lone_caller_is_never_held_back(seed, launch):
    rng = np.random.default_rng(seed)
    with Serving(seed, launch) as s, RecallClient(s.cfg.name) as client:
        samples = []
        for _ in range(300):
            q = rng.standard_normal(DIM).astype(np.float32)
            hits = client.recall(q, k=5)
            samples.append((q, hits.ids, hits.scores))
        policy = s.sc.pipeline.launch
    assert isinstance(policy, FillPolicy if launch == "fill" else EagerPolicy)
    assert check_samples(samples, s.matrix, 5) == (300, 0)
    assert s.sizes == [1] * 300
    assert s.decisions >= 299 and s.waits == 0  # asked every time, never told to wait


def test_the_pipeline_reports_what_the_policy_measures(seed):
    """Callers in two processes: the policy learns device times by batch size, the host's launch
    and answer times and the callers' turnaround from the slots, and judges a regime."""
    with Serving(seed, "fill") as s:
        res = run_load(
            LoadSpec(name=s.cfg.name, dim=DIM, procs=2, tasks=12, duration_s=1.0, warmup_s=0.2, seed=seed, keep=30)
        )
        policy = s.sc.pipeline.launch
        assert isinstance(policy, FillPolicy)
        assert res.errors == 0 and check_samples(res.samples, s.matrix, 10)[1] == 0
        assert policy.device.known() and policy.take.known() and policy.answer.known()
        t50 = policy.turn.quantile(0.5)
        assert t50 is not None and 0 < t50 < 1_000_000_000
        assert policy.horizon_ns >= t50
        assert 2 <= policy.callers <= 12
        assert sum(c.batches for c in policy.costs.values()) > 0
        assert max(s.sizes) > 1
    print(f"\n[launch] {len(s.sizes)} batches, mean {np.mean(s.sizes):.1f}, regime {policy.regime.value}")


class Merging(FillPolicy):
    """Fill, made to merge whatever it measures, with only --gather-us as the cap (on this CPU a
    merge saves little device time, so the measured choice would be to split)."""

    def __init__(self, gather_ns: int) -> None:
        super().__init__(gather_ns)
        self.regime = Regime.MERGE

    def _judge(self, now: int) -> None:
        pass

    def _cap(self, callers: int) -> int:
        return self.gather_ns


def test_merging_serves_every_caller_in_one_batch(seed):
    """Twelve callers in three processes turn around at their own pace; while merging, a batch
    leaves once they are all back (or at the cap), so batches hold about all of them."""
    # (a 200 ms cap: a client process starved for a while on a loaded machine still makes the batch)
    with Serving(seed, "fill", gather_us=200_000.0) as s:
        merging = Merging(int(s.cfg.gather_us * 1000))
        s.watch(merging)
        s.sc.pipeline.launch = merging  # (between batches: nothing is posted yet)
        res = run_load(
            LoadSpec(name=s.cfg.name, dim=DIM, procs=3, tasks=12, duration_s=1.5, warmup_s=0.3, seed=seed, keep=30)
        )
    assert res.errors == 0 and check_samples(res.samples, s.matrix, 10)[1] == 0
    steady = s.sizes[len(s.sizes) // 4 :]
    print(f"\n[launch] merging: {len(steady)} batches, mean {np.mean(steady):.1f} of 12 callers")
    assert np.mean(steady) >= 0.75 * 12
    assert s.waits > 0  # it did hold requests back for the others
