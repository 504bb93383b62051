"""Issue 33 item 2, with real processes on a real sidecar: capacity with the defaults.

The quick start opens ``RecallPool(...)`` once per worker process; the sidecar has ``--slots 64``.
Pools used to lease ``size=16`` slots at open, so the fifth worker failed with SlotsExhausted.
Now pools are elastic (clients.pool.LeasePlan): ``min_size`` (1) slots at open, more while callers
wait and the broker has slots free, idle ones given back, grown ones ceded to a process waiting
for its first slot. Every answer is checked against a float64 reference."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_topk

from kalos import RecallClient, RecallPool, SlotsExhausted
from kalos.clients._leaseplan import IDLE_S, TICK_S
from kalos.clients._transport import Connection

pytestmark = pytest.mark.timeout(420)

DIM = 128  # `kalos serve`'s default --dim
ROWS = 3000
K = 10

WORKER = """
import asyncio, json, sys, time
import numpy as np
from kalos.clients import RecallPool

name, seed, idx, rounds, fanout, dim, k = sys.argv[1], *map(int, sys.argv[2:8])
LOAD_S = float(sys.argv[8])

async def main():
    loop = asyncio.get_running_loop()
    async with RecallPool(name) as pool:  # the quick start's pool, every argument its default
        print(json.dumps({"opened": pool.statistics().size}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # every worker is up: go
        rng = np.random.default_rng([seed, idx])
        answers, most, t0, r = [], 0, time.monotonic(), 0
        while r < rounds or time.monotonic() - t0 < LOAD_S:  # at least `rounds`, for LOAD_S
            r += 1
            qs = rng.standard_normal((fanout, dim)).astype(np.float32)
            hits = await asyncio.gather(*(pool.recall(q, k=k) for q in qs))
            most = max(most, pool.statistics().size)
            answers += [[h.ids.tolist(), h.scores.tolist()] for h in hits]
        st = pool.statistics()
        print(json.dumps({"answers": answers, "most": most, "grown": st.grown, "refused": st.refused,
                          "errors": st.errors}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # idle meanwhile
        st = pool.statistics()
        print(json.dumps({"size": st.size, "returned": st.returned}), flush=True)
    print(json.dumps({"closed": True}), flush=True)

try:
    asyncio.run(main())
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.exit(1)
"""


def spawn(code: str, *args: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def line(p: subprocess.Popen[bytes]) -> dict:
    assert p.stdout is not None
    raw = p.stdout.readline()
    if not raw:
        p.wait(timeout=30)
        raise AssertionError(f"worker exited ({p.returncode}): {p.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
    got = json.loads(raw)
    assert "error" not in got, got["error"]
    return dict(got)


def tell(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.flush()


def leased(name: str) -> int:
    c = Connection(name)
    try:
        return int((c.seg.slots["owner_pid"] != 0).sum())
    finally:
        c.close()


def test_32_worker_processes_with_default_pools_share_a_default_sidecar(sidecar_factory, seed):
    """32 processes each open the quick start's pool (defaults) against a sidecar with its
    defaults (--slots 64): all open (one slot each), all recall at once for 2 s with 24
    concurrent calls each (far more than 64 slots: pools grow while slots are free, share them
    under contention, and queue), every answer is the float64 top-k, and once idle the pools
    give their grown slots back."""
    h = sidecar_factory("cap", "--random-rows", str(ROWS), "--seed", str(seed), "--backend", "numpy")
    matrix = np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)
    n, rounds, fanout, load_s = 32, 3, 24, 2.0
    workers = [spawn(WORKER, h.name, seed, i, rounds, fanout, DIM, K, load_s) for i in range(n)]
    try:
        t0 = time.monotonic()
        opened = [line(w) for w in workers]
        assert [o["opened"] for o in opened] == [1] * n
        assert leased(h.name) == n  # one slot each: 32 of 64 free for the pools that get busy
        print(f"\n[capacity] {n} workers opened in {time.monotonic() - t0:.1f} s, {leased(h.name)} slots leased")
        for w in workers:
            tell(w)
        done = [line(w) for w in workers]
        for i, d in enumerate(done):
            assert d["errors"] == 0
            rng = np.random.default_rng([seed, i])
            made = len(d["answers"]) // fanout
            assert made >= rounds and len(d["answers"]) == made * fanout
            qs = np.concatenate([rng.standard_normal((fanout, DIM)).astype(np.float32) for _ in range(made)])
            for q, (ids, scores) in zip(qs, d["answers"]):
                assert_topk(q, matrix, np.asarray(ids), np.asarray(scores, np.float32), K)
        most = [d["most"] for d in done]
        print(
            f"[capacity] {sum(len(d['answers']) for d in done)} recalls checked; pool sizes at most {max(most)} "
            f"(sum of peaks {sum(most)}), grown {sum(d['grown'] for d in done)}, "
            f"refused {sum(d['refused'] for d in done)}"
        )
        print(f"[capacity] peak pool sizes: {sorted(most)}")
        assert max(most) <= 16 and sum(d["grown"] for d in done) > 0  # busy pools grew
        # Contended, spare slots are shared (each pool's fair share), not kept by the first
        # pools to grow: many pools grew, not a few to size.
        assert sum(m > 1 for m in most) >= n // 2, sorted(most)
        # Idle: the grown slots go back (each pool to its min_size, 1) within two idle periods.
        t1 = time.monotonic()
        while leased(h.name) > n and time.monotonic() - t1 < 2 * IDLE_S + 10 * TICK_S + 5:
            time.sleep(0.1)
        print(f"[capacity] back to {leased(h.name)} slots leased {time.monotonic() - t1:.1f} s after the load")
        assert leased(h.name) == n
        for w in workers:
            tell(w)
        idle = [line(w) for w in workers]
        assert [i["size"] for i in idle] == [1] * n
        assert sum(i["returned"] for i in idle) == sum(d["grown"] for d in done)
        for w in workers:
            assert line(w) == {"closed": True}
            assert w.wait(timeout=30) == 0
        assert leased(h.name) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


BUSY = """
import asyncio, json, sys, threading
import numpy as np
from kalos.clients import RecallPool

name, seed, dim, size, min_size = sys.argv[1], *map(int, sys.argv[2:])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()

async def main():
    rng = np.random.default_rng(seed)
    async with RecallPool(name, size=size, min_size=min_size, timeout=30) as pool:
        said = False
        last = None
        while not stop.is_set():
            qs = rng.standard_normal((8, dim)).astype(np.float32)
            hits = await asyncio.gather(*(pool.recall(q, k=5) for q in qs))
            last = (qs, hits)
            if not said and pool.statistics().size == size:
                print(json.dumps({"busy": size}), flush=True)
                said = True
        st = pool.statistics()
        qs, hits = last
        print(json.dumps({"errors": st.errors, "returned": st.returned, "size": st.size,
                          "qs": qs.tolist(), "answers": [[h.ids.tolist(), h.scores.tolist()] for h in hits]}),
              flush=True)

try:
    asyncio.run(main())
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.exit(1)
"""


@pytest.mark.asyncio
async def test_a_busy_process_cedes_grown_slots_to_a_starting_one(sidecar_factory, seed, rng):
    """Every slot (4) leased by one busy process, whose pool grew to them: a new pool still
    opens within its connect_timeout (it announces its wait on the lease file; the busy pool
    gives back its grown slots as they free up), then a RecallClient the same way, and all
    answer correctly."""
    h = sidecar_factory("cede", "--dim", "16", "--slots", "4", "--random-rows", "500", "--seed", str(seed))
    matrix = np.random.default_rng(seed).standard_normal((500, 16), dtype=np.float32)
    busy = spawn(BUSY, h.name, seed, 16, 4, 1)
    try:
        assert line(busy) == {"busy": 4}
        assert leased(h.name) == 4
        t0 = time.monotonic()
        async with RecallPool(h.name, size=2, connect_timeout=20) as pool:
            took = time.monotonic() - t0
            print(f"\n[cede] opened {took * 1000:.0f} ms after asking, with every slot leased by a busy process")
            assert took < 10
            for _ in range(20):
                q = rng.standard_normal(16).astype(np.float32)
                hit = await pool.recall(q, k=5, timeout=10)
                assert_topk(q, matrix, hit.ids, hit.scores, 5)
        await asyncio.sleep(1.0)  # the busy pool grows back into the slot given back
        assert leased(h.name) == 4
        t0 = time.monotonic()
        with RecallClient(h.name, connect_timeout=20, timeout=10) as c:  # the blocking client too
            took = time.monotonic() - t0
            print(f"[cede] a RecallClient opened {took * 1000:.0f} ms after asking")
            assert took < 10
            q = rng.standard_normal(16).astype(np.float32)
            hit = c.recall(q, k=5)
            assert_topk(q, matrix, hit.ids, hit.scores, 5)
        tell(busy)
        end = line(busy)
        assert end["errors"] == 0 and end["returned"] >= 2
        for q, (ids, scores) in zip(end["qs"], end["answers"]):
            assert_topk(np.asarray(q, np.float32), matrix, np.asarray(ids), np.asarray(scores, np.float32), 5)
        assert busy.wait(timeout=30) == 0
    finally:
        if busy.poll() is None:
            busy.kill()
            busy.wait()


@pytest.mark.asyncio
async def test_only_a_pool_that_gets_no_first_slot_fails_naming_slots(sidecar_factory, seed):
    """A process whose pool keeps every slot as its minimum (min_size=4 of --slots 4) cannot cede
    them: another pool waits its connect_timeout for one, then SlotsExhausted names the counts
    and --slots."""
    h = sidecar_factory("full", "--dim", "16", "--slots", "4", "--random-rows", "100", "--seed", str(seed))
    holder = spawn(BUSY, h.name, seed, 16, 4, 4)
    try:
        assert line(holder) == {"busy": 4}
        t0 = time.monotonic()
        with pytest.raises(SlotsExhausted) as e:
            await RecallPool(h.name, size=2, connect_timeout=1.0).open()
        took = time.monotonic() - t0
        msg = str(e.value)
        print(f"\n[exhausted] after {took:.2f} s: {msg}")
        assert 0.9 < took < 5
        assert "has 4 slots: 4 leased by other pools" in msg and "0 free" in msg
        assert "needs at least 1 (min_size" in msg and "more --slots" in msg
        assert "waited within 1.0 s for other pools to give slots back" in msg
        tell(holder)
        assert line(holder)["errors"] == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
