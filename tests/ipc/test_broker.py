"""The broker end to end: real sidecar processes, real client processes, real shm and semaphores."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import numpy as np
import posix_ipc
import pytest
from conftest import assert_topk, run_py, slots_free, wait_until

from kalos.broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    ClosedError,
    InvalidRequest,
    ProtocolError,
    ResponseTimeout,
    SlotsExhausted,
)
from kalos.broker.layout import PROTOCOL_VERSION
from kalos.broker.names import shm_name
from kalos.clients import RecallClient, RecallPool
from kalos.clients._transport import Connection
from kalos.testing.loadgen import LoadSpec, check_samples, run_load

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- correctness


@pytest.mark.asyncio
async def test_recall_matches_float64_reference_concurrently(sidecar, rng):
    async with RecallPool(sidecar.name, size=8) as pool:
        qs = rng.standard_normal((200, 32)).astype(np.float32)
        ks = rng.integers(1, 65, size=200)
        hits = await asyncio.gather(*(pool.recall(q, int(k)) for q, k in zip(qs, ks)))
        for q, k, h in zip(qs, ks, hits):
            assert_topk(q, sidecar.matrix, h.ids, h.scores, int(k))
        many = await pool.recall_many(qs[:8], k=5)
        for q, h in zip(qs[:8], many):
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
        st = pool.statistics()
        assert st.free == st.size == 8 and st.in_flight == 0 and st.errors == 0


def load_at_least(spec: LoadSpec, count: int) -> tuple[int, int, list]:
    """Load runs until they made more than ``count`` recalls in all (a loaded machine makes fewer
    per second; at most 10 runs): (recalls, errors, samples)."""
    recalls = errors = 0
    samples: list = []
    for _ in range(10):
        res = run_load(spec)
        recalls, errors, samples = recalls + res.count, errors + res.errors, samples + res.samples
        if recalls > count:
            break
    return recalls, errors, samples


def test_many_processes_many_tasks_are_correct(sidecar, seed):
    recalls, errors, samples = load_at_least(
        LoadSpec(
            name=sidecar.name,
            dim=32,
            procs=3,
            tasks=24,
            duration_s=1.5,
            warmup_s=0.1,
            k=10,
            seed=seed,
            keep=300,
            loop="asyncio",
        ),
        100,
    )
    assert errors == 0 and recalls > 100
    checked, wrong = check_samples(samples, sidecar.matrix, 10)
    assert checked >= 30 and wrong == 0
    assert slots_free(sidecar.name)


def test_pipelined_batches_are_correct(sidecar_factory, seed):
    """``--pipeline on``: every uniform batch is left in flight while the next is taken."""
    h = sidecar_factory(
        "pipe",
        "--dim",
        "32",
        "--random-rows",
        "3000",
        "--seed",
        str(seed),
        "--slots",
        "40",
        "--backend",
        "numpy",
        "--pipeline",
        "on",
    )
    matrix = np.random.default_rng(seed).standard_normal((3000, 32), dtype=np.float32)
    recalls, errors, samples = load_at_least(
        LoadSpec(
            name=h.name,
            dim=32,
            procs=3,
            tasks=30,
            duration_s=1.5,
            warmup_s=0.1,
            k=10,
            seed=seed,
            keep=300,
            loop="uvloop",
        ),
        100,
    )
    assert errors == 0 and recalls > 100
    checked, wrong = check_samples(samples, matrix, 10)
    assert checked >= 30 and wrong == 0
    assert slots_free(h.name)


def test_blocking_client(sidecar, rng):
    with RecallClient(sidecar.name, timeout=5) as c:
        for _ in range(20):
            q = rng.standard_normal(32).astype(np.float32)
            h = c.recall(q, k=7)
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 7)
        assert c.namespaces() == {"default": 2000}
        qs = rng.standard_normal((8, 32)).astype(np.float32)
        for q, h in zip(qs, c.recall_many(qs, k=5)):
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
        assert c.upsert([1, 2], qs[:2], payloads=[{"a": 1}, None], namespace="b") == 2
        h = c.recall(qs[0], k=2, namespace="b", with_payload=True)
        assert {hit.id: hit.payload for hit in h} == {1: {"a": 1}, 2: None}
        assert c.delete([2, 3], namespace="b") == 1
        assert c.drop_namespace("b") == 1
        assert c.namespaces() == {"default": 2000}
    assert slots_free(sidecar.name)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_metrics_cosine_and_l2(sidecar_factory, seed, metric):
    h = sidecar_factory(
        "metric", "--dim", "16", "--random-rows", "500", "--seed", str(seed), "--metric", metric, "--backend", "numpy"
    )
    m = np.random.default_rng(seed).standard_normal((500, 16), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    with RecallClient(h.name) as c:
        for _ in range(10):
            q = rng.standard_normal(16).astype(np.float32)
            r = c.recall(q, k=9)
            assert_topk(q, m, r.ids, r.scores, 9, metric=metric)


def test_k_larger_than_namespace_returns_all_rows(sidecar_factory, rng):
    h = sidecar_factory("small", "--dim", "4", "--backend", "numpy")
    with RecallClient(h.name) as c:
        vecs = rng.standard_normal((3, 4)).astype(np.float32)
        assert c.upsert([10, 11, 12], vecs) == 3
        r = c.recall(vecs[0], k=50)
        assert_topk(vecs[0], vecs, np.array([[10, 11, 12].index(i) for i in r.ids]), r.scores, 50)
        assert c.recall(vecs[0], k=1, namespace="default").ids.tolist() == [int(r.ids[0])]


# --------------------------------------------------------------------------- cancellation, timeouts


@pytest.mark.asyncio
async def test_cancellation_storm_leaks_nothing(sidecar, rng):
    done: list[tuple[np.ndarray, object]] = []
    async with RecallPool(sidecar.name, size=6) as pool:

        async def one(q: np.ndarray) -> None:
            h = await pool.recall(q, k=10)
            done.append((q, h))

        for _round in range(15):
            qs = rng.standard_normal((40, 32)).astype(np.float32)
            tasks = [asyncio.ensure_future(one(q)) for q in qs]
            for _ in range(random.randint(1, 6)):
                await asyncio.sleep(random.random() * 0.002)
                for t in random.sample(tasks, 8):
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Every slot comes back once the sidecar has answered the abandoned requests.
        for _ in range(6000):  # (60 s: a guard against a leak, not a bound)
            st = pool.statistics()
            if st.free == st.size and st.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        st = pool.statistics()
        assert st.free == st.size == 6 and st.in_flight == 0
        assert len(done) > 0
        for q, h in done:
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 10)
        # The pool still works and answers belong to their callers.
        q = rng.standard_normal(32).astype(np.float32)
        h = await pool.recall(q, k=3)
        assert_topk(q, sidecar.matrix, h.ids, h.scores, 3)


@pytest.fixture
def slow_sidecar(sidecar_factory, seed):
    """Large enough that one recall takes milliseconds on the CPU."""
    h = sidecar_factory(
        "slow", "--dim", "256", "--random-rows", "300000", "--seed", str(seed), "--slots", "4", "--backend", "numpy"
    )
    return h


@pytest.mark.asyncio
async def test_response_and_acquire_timeouts(slow_sidecar, rng):
    q = rng.standard_normal(256).astype(np.float32)
    async with RecallPool(slow_sidecar.name, size=1) as pool:
        with pytest.raises(ResponseTimeout):  # 10 us: shorter than any round trip
            await pool.recall(q, k=5, timeout=1e-5)
        # The slot is still in flight: the next caller cannot get it within a tiny budget.
        with pytest.raises(AcquireTimeout):
            await pool.recall(q, k=5, timeout=1e-5)
        # With time, the abandoned request finishes and the slot is reused; the answer is fresh.
        h = await pool.recall(q, k=5, timeout=30)
        assert len(h) == 5
        assert pool.statistics().free == 1


def test_blocking_client_timeout_then_recovers(slow_sidecar, rng):
    q = rng.standard_normal(256).astype(np.float32)
    with RecallClient(slow_sidecar.name) as c:
        with pytest.raises(ResponseTimeout):
            c.recall(q, k=5, timeout=1e-5)
        h1 = c.recall(q, k=5, timeout=30)
        h2 = c.recall(q, k=5, timeout=30)
        assert h1.ids.tolist() == h2.ids.tolist()


# --------------------------------------------------------------------------- crashes

CLIENT_HOLDS_SLOTS = r"""
import asyncio, sys, numpy as np
from kalos.clients import RecallPool
async def main():
    pool = RecallPool(sys.argv[1], size=int(sys.argv[2]))
    await pool.open()
    qs = np.random.standard_normal((1000, int(sys.argv[3]))).astype(np.float32)
    print("ready", flush=True)
    while True:   # keep every slot busy until killed
        await asyncio.gather(*(pool.recall(q, 5) for q in qs[:int(sys.argv[2])]))
asyncio.run(main())
"""


def test_kill9_client_holding_slots_frees_them(slow_sidecar):
    name = slow_sidecar.name
    p = run_py(CLIENT_HOLDS_SLOTS, name, "4", "256")
    assert p.stdout.readline().strip() == b"ready"
    time.sleep(0.2)
    assert not slots_free(name)
    p.kill()  # SIGKILL mid-request, leases held
    p.wait()
    assert wait_until(lambda: slots_free(name), timeout=15), "slots of a dead client were not reclaimed"
    with RecallClient(name) as c:  # and they serve a new owner correctly
        assert len(c.recall(np.ones(256, np.float32), k=3, timeout=30)) == 3


@pytest.mark.asyncio
async def test_kill9_sidecar_gives_broker_unavailable_quickly(sidecar_factory, rng):
    h = sidecar_factory("victim", "--dim", "64", "--random-rows", "200000", "--backend", "numpy", "--slots", "8")
    pool = RecallPool(h.name, size=4, reconnect=False)  # fail fast (tests/test_restarts.py: re-attach)
    await pool.open()
    q = rng.standard_normal(64).astype(np.float32)
    await pool.recall(q, k=3)

    async def agent() -> BaseException:
        while True:  # recall until the broker goes away
            try:
                await pool.recall(q, k=3)
            except BaseException as e:
                return e

    tasks = [asyncio.ensure_future(agent()) for _ in range(8)]
    await asyncio.sleep(0.05)
    h.kill9()
    t0 = time.monotonic()
    results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    assert all(isinstance(r, BrokerUnavailable) for r in results), results
    # (no call has a timeout: without the liveness checks they would wait forever)
    print(f"\n[kill -9] every caller got BrokerUnavailable {elapsed * 1000:.0f} ms after the kill")
    assert elapsed < 30, f"took {elapsed:.2f} s to notice the dead sidecar"
    with pytest.raises(BrokerUnavailable):
        await pool.recall(q, k=3)
    pool.terminate()
    # A new client refuses at once; `kalos cleanup` removes the leftovers; a new sidecar starts.
    with pytest.raises(BrokerUnavailable):
        RecallClient(h.name, connect_timeout=0.5)
    from kalos.cli import main as kalos

    assert kalos(["cleanup", h.name]) == 0
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(shm_name(h.name))
    h2 = sidecar_factory("victim2", "--dim", "64", name=h.name)
    with RecallClient(h2.name) as c:
        assert c.namespaces() == {}  # a fresh sidecar: no namespace until one is written


def test_restart_over_leftovers_of_a_crashed_sidecar(sidecar_factory):
    h = sidecar_factory("crash", "--dim", "8")
    h.kill9()
    h2 = sidecar_factory("crash2", "--dim", "8", name=h.name)  # removes the leftovers itself
    with RecallClient(h2.name) as c:
        assert c.namespaces() == {}


def test_sigterm_finishes_in_flight_and_unlinks(sidecar_factory, rng):
    h = sidecar_factory("term", "--dim", "256", "--random-rows", "300000", "--backend", "numpy")
    code = r"""
import sys, numpy as np
from kalos.clients import RecallClient
from kalos.broker.errors import BrokerUnavailable
c = RecallClient(sys.argv[1])
print("ready", flush=True)
try:
    h = c.recall(np.ones(256, np.float32), k=4, timeout=30)
    print("ok", len(h), flush=True)
except BrokerUnavailable as e:
    print("unavailable", flush=True)
"""
    p = run_py(code, h.name)
    assert p.stdout.readline().strip() == b"ready"
    time.sleep(0.002)
    h.proc.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=30)[0].decode()
    assert out.strip() in ("ok 4", "unavailable")
    assert h.proc.wait(timeout=10) == 0
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(shm_name(h.name))


def sched_s(pid: int) -> tuple[float, float]:
    """(on CPU, waiting for a CPU) in seconds, summed over the threads of process ``pid`` (the
    kernel's schedstat). Wall time beyond both is time its threads were blocked."""
    cpu = runq = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                a, b, _ = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
        cpu, runq = cpu + int(a), runq + int(b)
    return cpu / 1e9, runq / 1e9


@pytest.mark.asyncio
async def test_pipeline_never_stalls_after_idle_gaps(sidecar_factory, seed):
    """``--pipeline on`` with a threaded search: callers that post while the sidecar is about to
    sleep must not wait for the doorbell's 250 ms timeout (a batch in flight keeps it awake).
    A stall is told from a slow machine by where the time went: during a stall the sidecar's
    threads are blocked (neither on a CPU nor waiting for one) while a call is outstanding."""
    h = sidecar_factory(
        "pipesleep",
        "--dim",
        "64",
        "--random-rows",
        "20000",
        "--seed",
        str(seed),
        "--slots",
        "8",
        "--backend",
        "numpy",
        "--pipeline",
        "on",
        "--spin-us",
        "100",
    )
    matrix = np.random.default_rng(seed).standard_normal((20000, 64), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    worst = blocked = 0.0
    async with RecallPool(h.name, size=4) as pool:

        async def caller() -> None:
            nonlocal worst, blocked
            for _ in range(60):
                q = rng.standard_normal(64).astype(np.float32)
                t, (cpu, runq), (_, ours) = time.perf_counter(), sched_s(h.proc.pid), sched_s(os.getpid())
                hit = await pool.recall(q, k=5)
                took = time.perf_counter() - t
                cpu2, runq2 = sched_s(h.proc.pid)
                # (waiting for a CPU here, between post and doorbell, keeps the sidecar asleep too)
                ours = sched_s(os.getpid())[1] - ours
                worst = max(worst, took)
                blocked = max(blocked, took - (cpu2 - cpu) - (runq2 - runq) - ours)
                assert_topk(q, matrix, hit.ids, hit.scores, 5)
                await asyncio.sleep(float(rng.uniform(0.0, 0.0004)))  # around the spin window

        await asyncio.gather(*(caller() for _ in range(3)))
    print(
        f"\n[pipeline] slowest recall {worst * 1e3:.1f} ms; the sidecar blocked at most "
        f"{max(blocked, 0) * 1e3:.1f} ms of a call (a stall blocks it for the doorbell's 250 ms)"
    )
    assert blocked < 0.15, f"the sidecar slept {blocked * 1e3:.0f} ms with a call outstanding"


@pytest.mark.asyncio
async def test_sigterm_under_pipelined_load_answers_or_refuses_cleanly(sidecar_factory, seed):
    h = sidecar_factory(
        "pipeterm",
        "--dim",
        "64",
        "--random-rows",
        "50000",
        "--seed",
        str(seed),
        "--slots",
        "16",
        "--backend",
        "numpy",
        "--pipeline",
        "on",
    )
    matrix = np.random.default_rng(seed).standard_normal((50000, 64), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    outcomes = {"ok": 0, "unavailable": 0}
    async with RecallPool(h.name, size=12) as pool:

        async def caller() -> None:
            while True:
                q = rng.standard_normal(64).astype(np.float32)
                try:
                    hit = await pool.recall(q, k=3, timeout=10)
                except BrokerUnavailable:
                    outcomes["unavailable"] += 1
                    return
                assert_topk(q, matrix, hit.ids, hit.scores, 3)
                outcomes["ok"] += 1

        tasks = [asyncio.ensure_future(caller()) for _ in range(12)]
        for _ in range(6000):  # under load: some answers first, however long they take (60 s)
            if outcomes["ok"] > 20:
                break
            await asyncio.sleep(0.01)
        h.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    assert outcomes["ok"] > 20 and outcomes["unavailable"] == 12
    assert h.proc.wait(timeout=10) == 0


def test_missing_sidecar_is_unavailable_after_connect_timeout():
    """Opening waits for a sidecar to serve the name (tests/test_restarts.py: one that comes),
    and says so when none does."""
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="no sidecar serves broker 'no-such-broker-here'"):
        RecallClient("no-such-broker-here", connect_timeout=0.3)
    took = time.monotonic() - t0
    print(f"\n[connect] gave up after {took * 1000:.0f} ms (connect_timeout 300 ms)")
    assert 0.3 <= took < 10, took  # it waited the budget, then not for ever


def test_protocol_version_mismatch_is_refused(sidecar):
    c = Connection(sidecar.name)
    try:
        hdr = c.seg.header
        hdr["version"] = 999  # as if the sidecar spoke another protocol
        with pytest.raises(ProtocolError, match="protocol version 999"):
            Connection(sidecar.name)
    finally:
        c.seg.header["version"] = PROTOCOL_VERSION
        c.close()


def test_idle_sidecar_burns_no_cpu(sidecar):
    def cpu() -> float:
        with open(f"/proc/{sidecar.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    c0, t0 = cpu(), time.monotonic()
    time.sleep(3.0)
    share = (cpu() - c0) / (time.monotonic() - t0)
    assert share < 0.05, f"idle sidecar used {share:.1%} of a core"


# --------------------------------------------------------------------------- bad input


@pytest.mark.asyncio
async def test_bad_input_is_refused_before_shared_memory(sidecar):
    async with RecallPool(sidecar.name, size=2, min_size=2) as pool:
        good = np.zeros(32, np.float32)
        bad_inputs = [
            (np.zeros(31, np.float32), {}),  # wrong dim
            (np.zeros((2, 32), np.float32), {}),  # recall() takes one vector
            (np.array(["a"] * 32), {}),  # wrong dtype
            (np.full(32, np.nan, np.float32), {}),
            (np.full(32, np.inf, np.float32), {}),
            (np.full(32, 1e39), {}),  # finite float64, inf as float32
            (good, {"k": 0}),
            (good, {"k": 65}),  # > max_k
            (good, {"k": 2.5}),
            (good, {"namespace": "bad name!"}),
            (good, {"namespace": ""}),
        ]
        for vec, kw in bad_inputs:
            with pytest.raises(InvalidRequest):
                await pool.recall(vec, **kw)
        with pytest.raises(InvalidRequest):
            await pool.recall_many(np.zeros((9, 32), np.float32))  # > max_queries
        assert len(await pool.recall(good, namespace="nobody")) == 0  # never written: no hits
        st = pool.statistics()
        assert st.free == 2 and st.in_flight == 0
        assert len(await pool.recall(good, k=3)) == 3
    with pytest.raises(ClosedError):
        await pool.recall(good)


def test_garbage_slot_from_a_broken_client_gets_a_status(sidecar, rng):
    """Write nonsense straight into a leased slot; the sidecar answers with an error status for
    that slot alone and keeps serving everyone else."""
    from kalos.broker.layout import Status

    c = Connection(sidecar.name)
    slot = c.lease(1)[0]
    cases = [
        dict(op=99, k=5, nq=1, ns=b"default", status=Status.UNKNOWN_OP),
        dict(op=1, k=0, nq=1, ns=b"default", status=Status.K_OUT_OF_RANGE),
        dict(op=1, k=10**6, nq=1, ns=b"default", status=Status.K_OUT_OF_RANGE),
        dict(op=1, k=5, nq=0, ns=b"default", status=Status.TOO_MANY_QUERIES),
        dict(op=1, k=5, nq=10**6, ns=b"default", status=Status.TOO_MANY_QUERIES),
        dict(op=1, k=5, nq=1, ns=b"\xff\xfe", status=Status.BAD_REQUEST),
        dict(op=1, k=5, nq=1, ns=b"default", status=Status.NOT_FINITE, nan=True),
        dict(op=2, k=0, nq=1, ns=b"default", status=Status.NOT_FINITE, nan=True),
        dict(op=1, k=5, nq=1, ns=b"nobody", status=Status.OK),  # never written: no hits, no error
    ]
    with RecallClient(sidecar.name) as good:
        try:
            for case in cases:
                slot.view.queries[0] = np.nan if case.get("nan") else 1.0
                slot.view.ids[0] = 1
                slot.post(case["op"], case["ns"], case["k"], case["nq"], 0, 0, 0)
                assert wait_until(lambda: slot.is_done() and slot.try_consume(), 5)
                status, _n, blen = slot.outcome()
                assert status == case["status"], (case, status, slot.blob_text(blen))
                slot.set_free()
                q = rng.standard_normal(32).astype(np.float32)
                h = good.recall(q, k=4)
                assert_topk(q, sidecar.matrix, h.ids, h.scores, 4)
            # Payload blob that is not JSON lines.
            slot.view.queries[0] = 1.0
            slot.view.ids[0] = 5
            slot.view.blob[:3] = np.frombuffer(b"{x}", np.uint8)
            slot.post(2, b"default", 0, 1, 0, 3, 0)
            assert wait_until(lambda: slot.is_done() and slot.try_consume(), 5)
            assert slot.outcome()[0] == Status.BAD_REQUEST
            slot.set_free()
            assert good.namespaces() == {"default": 2000}  # nothing was written
        finally:
            c.give_back([slot], [])
            c.close()


def test_pool_refuses_when_no_slots_left(sidecar):
    async def main() -> None:
        async with RecallPool(sidecar.name, size=32, min_size=32):
            with pytest.raises(SlotsExhausted, match="32 slots: 32 leased"):
                async with RecallPool(sidecar.name, size=2, connect_timeout=0.5):
                    pass

    asyncio.run(main())


def test_cli_help_everywhere():
    from kalos.cli import build_parser

    p = build_parser()
    for cmd in ("serve", "demo", "bench", "cleanup", "namespaces", "export", "import", "top"):
        with pytest.raises(SystemExit) as e:
            p.parse_args([cmd, "--help"])
        assert e.value.code == 0


def test_objects_are_private_to_the_owner(sidecar):
    st = os.stat(f"/dev/shm/kalos.{sidecar.name}")
    assert st.st_mode & 0o777 == 0o600
    st = os.stat(f"/dev/shm/sem.kalos.{sidecar.name}.bell")
    assert st.st_mode & 0o777 == 0o600


@pytest.mark.asyncio
async def test_cancel_while_waiting_for_a_slot_restores_it():
    """A slot handed to a waiter that is cancelled before it runs goes back, never lost (pure)."""
    from kalos.clients._free import FreeSlots

    free = FreeSlots(asyncio.get_running_loop())
    waiter = asyncio.ensure_future(free.get(None))
    await asyncio.sleep(0)
    free.put_nowait("slot-a")  # handed straight to the waiter ...
    waiter.cancel()  # ... which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert free.qsize() == 1 and free.get_nowait() == "slot-a"
    with pytest.raises(asyncio.TimeoutError):
        await free.get(0.01)
    free.put_nowait("slot-b")  # no stale waiter may swallow it
    assert free.get_nowait() == "slot-b"


@pytest.mark.asyncio
async def test_cancel_mid_acquire_on_a_busy_pool(slow_sidecar, rng):
    q = rng.standard_normal(256).astype(np.float32)
    async with RecallPool(slow_sidecar.name, size=1) as pool:
        first = asyncio.ensure_future(pool.recall(q, k=3, timeout=30))
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(pool.recall(q, k=3)) for _ in range(5)]
        await asyncio.sleep(0.001)
        # (on a slow machine a waiter may have been answered already: cancel() says which were
        # still waiting, and those must end cancelled)
        cancelled = [t.cancel() for t in waiting[::2]]
        res = await asyncio.gather(first, *waiting, return_exceptions=True)
        assert len(res[0]) == 3
        for was, r in zip(cancelled, res[1::2]):
            assert isinstance(r, asyncio.CancelledError) if was else len(r) == 3
        assert any(cancelled) and sum(isinstance(r, asyncio.CancelledError) for r in res) == sum(cancelled)
        assert all(len(r) == 3 for r in res[2::2])
        st = pool.statistics()
        assert st.free == 1 and st.in_flight == 0


@pytest.mark.parametrize("metric", ["dot", "cosine", "l2"])
@pytest.mark.asyncio
async def test_clients_know_what_the_scores_mean(sidecar_factory, metric):
    """The sidecar's --metric is read from its header by both clients (adapters use it to turn
    scores into what their framework expects)."""
    h = sidecar_factory("metric", "--dim", "4", "--metric", metric, "--backend", "numpy")
    async with RecallPool(h.name, size=1) as pool:
        assert pool.metric == metric
    with RecallClient(h.name) as c:
        assert c.metric == metric
