"""The one spin-then-block policy (broker/waiting.py) that the pool's poller, the blocking client's
wait and the sidecar's loop all use: pure, so it is tested with numbers, no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from kalos.broker.waiting import SMOOTHING, SpinThenBlock

ROOT = Path(__file__).resolve().parents[2]


def reference_window_ns(spin_us: float, max_spin_us: float | None, round_trips: list[float]) -> int:
    """The window after ``round_trips`` (ns), from the documented rule, in float64: ``spin_us``,
    widened to twice the exponentially weighted round trip, at most ``max_spin_us``."""
    if spin_us == 0:
        return 0
    typical = np.float64(0.0)
    for rt in round_trips:
        typical = (1 - SMOOTHING) * typical + SMOOTHING * np.float64(rt)
    cap = max(spin_us, max_spin_us or 0.0) * 1000
    return int(min(cap, max(spin_us * 1000, 2 * typical)))


@pytest.mark.parametrize("spin_us,max_spin_us", [(250, 2000), (50, 50), (250, None), (0, 2000), (10, 5)])
def test_the_window_follows_twice_the_typical_round_trip_within_its_bounds(rng, spin_us, max_spin_us):
    p = SpinThenBlock(spin_us, max_spin_us)
    seen: list[float] = []
    for scale in (1e3, 1e5, 1e6, 1e7, 1e4):  # microseconds to tens of milliseconds, and back
        for rt in rng.exponential(scale, size=40).tolist():
            p.observe(rt)
            seen.append(rt)
            want = reference_window_ns(spin_us, max_spin_us, seen)
            assert abs(p.window_ns() - want) <= 1, (spin_us, max_spin_us, len(seen))
            w = p.window_ns()
            assert not p.spinning(w) and (w == 0 or p.spinning(w - 1))


def test_a_fixed_window_is_the_sidecars_spin_us():
    """The sidecar's loop: polls while less than ``--spin-us`` passed since its last work, then
    sleeps (its condition before the policy was ``now - last_work < spin_ns``)."""
    p = SpinThenBlock(250)
    for rt in (1e9, 5e6, 1e3):
        p.observe(rt)  # nothing widens a window without max_spin_us
        assert p.window_ns() == 250_000
    assert p.spinning(0) and p.spinning(249_999) and not p.spinning(250_000)
    off = SpinThenBlock(0)
    assert off.window_ns() == 0 and not off.spinning(0)


def test_the_clients_and_the_sidecars_loop_take_their_window_from_the_policy():
    """The three waiters decide spin-or-block through SpinThenBlock.spinning, not a copy of the
    rule: each driver constructs a SpinThenBlock and its waiting loop (the pool's poller, the
    blocking client, the sidecar's loop) calls ``spinning``."""
    for made, used in (
        ("clients/pool.py", "clients/_poller.py"),
        ("clients/blocking.py", "clients/blocking.py"),
        ("sidecar_cuda/server.py", "sidecar_cuda/server.py"),
    ):
        names = {n.id for n in ast.walk(ast.parse((ROOT / made).read_text())) if isinstance(n, ast.Name)}
        attrs = {n.attr for n in ast.walk(ast.parse((ROOT / used).read_text())) if isinstance(n, ast.Attribute)}
        assert "SpinThenBlock" in names and "spinning" in attrs, (made, used)


@pytest.mark.asyncio
async def test_the_pools_window_widens_with_its_round_trips(rng):
    """On the fake transport: answers that take at least 2 ms widen the pool's polling window
    from its 50 us towards twice the typical round trip (and never past max_spin_us)."""
    import asyncio

    from kalos.broker.layout import Layout
    from kalos.clients import RecallPool
    from kalos.clients.fake import FakeConnection

    conn = FakeConnection(Layout(n_slots=2, dim=8, max_k=4, max_queries=2, blob_bytes=1024))
    pool = await RecallPool("fake", size=1, spin_us=50, max_spin_us=1500, connect=lambda name, uid: conn).open()
    assert pool.spin_window_ns() == 50_000
    ids = np.zeros((1, 3), np.int64)
    scores = np.zeros((1, 3), np.float32)
    for _ in range(6):
        task = asyncio.ensure_future(pool.recall(rng.standard_normal(8), k=3, timeout=5))
        await asyncio.sleep(0.002)
        while not conn.serve(lambda v, op, k, nq: (ids, scores)):
            await asyncio.sleep(0.001)
        await task
    window = pool.spin_window_ns()
    print(f"[window] {window} ns after 6 round trips of >= 2 ms")
    assert window == 1_500_000  # 2 x typical (>= 2 x 1.47 ms after six) reaches the cap
    await pool.close()
