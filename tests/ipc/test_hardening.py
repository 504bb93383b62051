"""Hostile and broken clients against real sidecars: nothing a client writes can end the sidecar,
break /metrics, keep dead clients' slots, or trick a client into trusting another user's objects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import posix_ipc
import pytest
from conftest import assert_topk, free_port, run_py, slots_free, unique_name, wait_until

from kalos.broker.errors import BrokerUnavailable, InvalidRequest, UntrustedBroker
from kalos.broker.layout import (
    S_FREE,
    Layout,
    SegmentView,
    SidecarState,
    Status,
)
from kalos.broker.names import bell_name, req_name, resp_name, shm_name
from kalos.broker.owners import sem_path, shm_path
from kalos.broker.slotpath import PURE_ENV, REQUIRE_ENV, SlotPath
from kalos.broker.validation import MAX_PAYLOAD_DEPTH
from kalos.clients import RecallClient, RecallPool
from kalos.clients._slots import load_compiled as load_client_slot_path
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.sidecar_cuda.serving.slotio import load_compiled

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # where conftest.py lives
NOBODY = 65534


def scrape_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def nested(depth: int) -> object:
    v: object = []
    for _ in range(depth - 1):
        v = [v]
    return v


def raw_post(c: Connection, slot: object, op: int, ns: bytes, nq: int, blob: bytes) -> tuple[int, str]:
    """Post a request written by hand (no client-side validation) and return (status, detail)."""
    s = slot  # a ClientSlot
    s.view.queries[:nq] = 1.0  # type: ignore[attr-defined]
    s.view.ids[:nq] = np.arange(nq) + 900  # type: ignore[attr-defined]
    s.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)  # type: ignore[attr-defined]
    s.post(op, ns, 0, nq, 0, len(blob), 0)  # type: ignore[attr-defined]
    assert wait_until(lambda: s.is_done() and s.try_consume(), 10)  # type: ignore[attr-defined]
    status, _n, blen = s.outcome()  # type: ignore[attr-defined]
    detail = s.blob_text(blen).decode(errors="replace")  # type: ignore[attr-defined]
    s.set_free()  # type: ignore[attr-defined]
    return status, detail


# --------------------------------------------------------------------------- 1. deep JSON


def test_deeply_nested_payload_is_refused_and_the_sidecar_lives(sidecar, rng):
    with RecallClient(sidecar.name) as client:
        # The client refuses before anything is sent, at the documented depth and far beyond it.
        for depth in (MAX_PAYLOAD_DEPTH + 1, 985, 5000):
            with pytest.raises(InvalidRequest, match="nests deeper"):
                client.upsert([985], np.ones((1, 32)), payloads=[nested(depth)], namespace="deep")
        assert client.upsert([1], np.ones((1, 32)), payloads=[nested(MAX_PAYLOAD_DEPTH)], namespace="deep") == 1
        # A client writing the protocol by hand: every depth gets BAD_REQUEST, nothing is stored.
        c = Connection(sidecar.name)
        slot = c.lease(1)[0]
        try:
            for depth in (MAX_PAYLOAD_DEPTH + 1, 985, 8000):
                blob = b"[" * depth + b"]" * depth
                status, detail = raw_post(c, slot, 2, b"deep", 1, blob)
                assert status == Status.BAD_REQUEST and "nests deeper" in detail, (depth, detail)
            status, detail = raw_post(c, slot, 2, b"deep", 1, b'{"a": [1, {"b": null}]}')
            assert status == Status.OK, detail
        finally:
            c.give_back([slot], [])
            c.close()
        assert sidecar.proc.poll() is None
        assert client.namespaces()["deep"] == 2  # ids 1 and 900: the refused ones wrote nothing
        q = rng.standard_normal(32).astype(np.float32)
        h = client.recall(q, k=5)
        assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)


# --------------------------------------------------------------------------- 2. lease pids


@pytest.mark.parametrize("pid", [2**31, 2**31 - 1 + 2**20, 2**63 - 1, -7, (1 << 22) + 1])
def test_lease_with_an_impossible_owner_pid_is_reclaimed(sidecar, pid):
    """Any pid a client writes is only a number for diagnostics: while its lease lock is held
    the slot stays leased; once the holder is gone (lock dropped) it is reclaimed. The sidecar
    never chokes on the value."""
    c = Connection(sidecar.name)
    slot = c.lease(1)[0]
    i = slot.index
    c.seg.slots[i]["owner_pid"] = pid
    c.seg.slots[i]["owner_start"] = 12345
    time.sleep(0.6)  # two reaper passes
    assert int(c.seg.slots[i]["owner_pid"]) == pid, "a held lease was taken away"
    seg_owner = Connection(sidecar.name)  # a second view to watch with
    c.close()  # the holder goes away: its lease lock is dropped by the kernel
    try:
        assert wait_until(lambda: int(seg_owner.seg.slots[i]["owner_pid"]) == 0, 30), (
            "the reaper did not reclaim the slot"
        )
        assert int(seg_owner.seg.slots[i]["state"]) == S_FREE
        assert sidecar.proc.poll() is None
        with RecallClient(sidecar.name) as client:
            assert len(client.recall(np.ones(32, np.float32), k=3)) == 3
    finally:
        seg_owner.close()


# --------------------------------------------------------------------------- 3. reaper under load

LOAD = """
import asyncio, sys, time, numpy as np
from kalos.clients import RecallPool
async def main():
    rng = np.random.default_rng(int(sys.argv[2]))
    async with RecallPool(sys.argv[1], size=16) as pool:
        print("ready", flush=True)
        async def task():
            while True:  # until killed
                await pool.recall_many(rng.standard_normal((8, 64), dtype=np.float32), k=10)
        await asyncio.gather(*(task() for _ in range(16)))
asyncio.run(main())
"""

HOLD = """
import asyncio, sys, numpy as np
from kalos.clients import RecallPool
async def main():
    async with RecallPool(sys.argv[1], size=int(sys.argv[2]), min_size=int(sys.argv[2])) as pool:
        print("ready", flush=True)
        while True:
            await pool.recall_many(np.ones((8, 64), np.float32), k=10)
asyncio.run(main())
"""


def test_dead_clients_slots_are_reclaimed_under_load(sidecar_factory):
    """3 processes x 16 tasks keep the sidecar saturated (each waiting for a slot); a fourth
    client holding 8 slots is killed -9: its slots are free again while the load goes on (the
    reaper runs on time, busy or not; the time it took is printed: about 250 ms on an idle VM)."""
    h = sidecar_factory(
        "reap", "--dim", "64", "--random-rows", "20000", "--slots", "56", "--max-queries", "8", "--backend", "numpy"
    )
    victim = run_py(HOLD, h.name, "8")
    assert victim.stdout.readline().strip() == b"ready"
    loads = [run_py(LOAD, h.name, str(i)) for i in range(3)]
    try:
        for p in loads:
            assert p.stdout.readline().strip() == b"ready"
        time.sleep(1.0)  # saturated: every slot leased, requests posted back to back
        c = Connection(h.name)
        try:
            owners = c.seg.slots["owner_pid"]
            assert int((owners == victim.pid).sum()) == 8
            assert int((owners != 0).sum()) == 56
            victim.kill()
            t0 = time.monotonic()
            victim.wait()
            freed = wait_until(lambda: int((c.seg.slots["owner_pid"] == victim.pid).sum()) == 0, timeout=30, step=0.005)
            took = time.monotonic() - t0
            print(f"\n[reaper] slots of the killed client reclaimed in {took * 1000:.0f} ms under load")
            assert freed, f"not reclaimed in {took:.0f} s under load"
            assert all(p.poll() is None for p in loads), "the load should still be running"
        finally:
            c.close()
    finally:
        for p in loads:
            p.kill()
            p.wait()
    assert h.proc.poll() is None


# --------------------------------------------------------------------------- 3b. frozen clients

FROZEN = r"""
import asyncio, fcntl, json, os, signal, sys, numpy as np
from kalos.broker import leases
from kalos.broker.names import leases_path, shm_name
from kalos.broker.owners import shm_path
from kalos.clients import RecallPool

async def main():
    name, n_slots = sys.argv[1], int(sys.argv[2])
    q = np.ones(32, np.float32)
    async with RecallPool(name, size=2, min_size=2) as pool:  # its leases: two lock bytes
        assert len(await pool.recall(q, k=3)) == 3
        # Every other lock a client can take, held while it is stopped:
        seg = os.open(shm_path(shm_name(name)), os.O_RDWR)
        fcntl.flock(seg, fcntl.LOCK_EX)  # the claim lock (clients lease slots under it)
        fcntl.lockf(seg, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a record lock of the whole segment
        lf = os.open(leases_path(name), os.O_RDWR)
        fcntl.flock(lf, fcntl.LOCK_EX)  # an flock of the lease file
        taken = [b for b in range(n_slots + 8) if leases.try_lock(lf, b)]  # every free lock byte
        in_flight = asyncio.ensure_future(pool.recall(q, k=3))
        await asyncio.sleep(0)  # posted: its answer waits in the slot while this process is stopped
        print(json.dumps({"taken": taken}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        # SIGCONT: let go of everything; the pool serves on
        for b in taken:
            leases.unlock(lf, b)
        os.close(lf)
        os.close(seg)
        assert len(await in_flight) == 3
        for _ in range(20):
            assert len(await pool.recall(q, k=3, timeout=30)) == 3
    print("resumed ok", flush=True)

asyncio.run(main())
"""


IDLE_HOLDER = """
import asyncio, sys, numpy as np
from kalos.clients import RecallPool
async def main():
    async with RecallPool(sys.argv[1], size=2, min_size=2) as pool:
        await pool.recall(np.ones(32, np.float32), k=3)
        print("ready", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _freeze(name: str, n_slots: int) -> subprocess.Popen[bytes]:
    """A client that takes every lock it can (the claim lock, its lease bytes, every free lock
    byte, a record lock and an flock of each file), posts a recall and stops itself (SIGSTOP)."""
    p = run_py(FROZEN, name, str(n_slots))
    line = p.stdout.readline()
    assert line, p.stderr.read().decode()
    assert len(json.loads(line)["taken"]) >= n_slots - 8, line  # the free bytes, not the leased
    assert wait_until(lambda: _stopped(p.pid), 30), "the client did not stop"
    return p


async def _recalls_while_stopped(pool: RecallPool, sidecar, rng, frozen: subprocess.Popen[bytes]) -> int:
    """Recalls from this process, each checked, for a second of reaper passes (REAP_S = 0.25 s)
    after the freeze and then 20 more, all while ``frozen`` is still stopped. A reaper that waited
    for the claim lock would stop serving within one pass: these calls would time out."""
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0 or n < 20:
        q = rng.standard_normal(32).astype(np.float32)
        h = await pool.recall(q, k=5, timeout=30)  # generous: only a stalled sidecar misses it
        assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
        n += 1
    assert _stopped(frozen.pid), "the frozen client was resumed before the recalls completed"
    print(
        f"\n[frozen] {n} recalls answered in {time.monotonic() - t0:.2f} s while a client held "
        "every lock it could, stopped"
    )
    return n


@pytest.mark.asyncio
async def test_a_frozen_client_holding_every_lock_cannot_pause_serving(sidecar, rng):
    """A client stopped (SIGSTOP) while it holds the claim lock, its leases and every lock byte it
    could take: another process's recalls are answered meanwhile; slots of a client that died
    meanwhile wait for the lock (nothing is freed without it) and are freed once it is let go;
    the resumed client is served; a client killed while stopped has its slots reclaimed."""
    name, n_slots = sidecar.name, 32
    frozen: list[subprocess.Popen[bytes]] = []
    victim = run_py(IDLE_HOLDER, name)

    def kill_all() -> None:  # (first, so that a failure cannot leave the sidecar waiting on a lock)
        for p in [victim, *frozen]:
            if p.poll() is None:
                p.kill()  # a stopped process dies of SIGKILL too
                p.wait()

    try:
        async with RecallPool(name, size=4, min_size=4) as pool:  # leased before any lock is taken
            c = Connection(name)
            try:
                assert victim.stdout.readline().strip() == b"ready", victim.stderr.read().decode()
                frozen.append(_freeze(name, n_slots))
                victim.kill()  # dies while the claim lock is held: its slots must wait for it
                victim.wait()
                await _recalls_while_stopped(pool, sidecar, rng, frozen[0])
                assert int((c.seg.slots["owner_pid"] == victim.pid).sum()) == 2, (
                    "slots were freed without the claim lock"
                )
                frozen[0].send_signal(signal.SIGCONT)
                out, err = frozen[0].communicate(timeout=60)
                assert frozen[0].returncode == 0 and out.strip() == b"resumed ok", err.decode()
                assert wait_until(lambda: not (c.seg.slots["owner_pid"] == victim.pid).any(), 30), (
                    "the dead client's slots were not reclaimed once the lock was let go"
                )
                # frozen, then killed while stopped: the kernel drops its locks, the reaper frees
                frozen.append(_freeze(name, n_slots))
                pid = frozen[1].pid
                await _recalls_while_stopped(pool, sidecar, rng, frozen[1])
                assert int((c.seg.slots["owner_pid"] == pid).sum()) == 2
                frozen[1].kill()
                frozen[1].wait()
                assert wait_until(lambda: not (c.seg.slots["owner_pid"] == pid).any(), 30), (
                    "the slots of a client killed while stopped were not reclaimed"
                )
            finally:
                c.close()
                kill_all()
            q = rng.standard_normal(32).astype(np.float32)
            h = await pool.recall(q, k=5, timeout=30)
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
        assert wait_until(lambda: slots_free(name), 30)
        with RecallClient(name) as client:  # and a new client leases (the claim lock is free)
            assert len(client.recall(np.ones(32, np.float32), k=3, timeout=30)) == 3
    finally:
        kill_all()
    assert sidecar.proc.poll() is None


@pytest.mark.asyncio
async def test_a_frozen_holder_of_the_claim_lock_cannot_block_another_clients_loop(sidecar, rng):
    """The same frozen client, seen from another client: opening a pool while it holds the claim
    lock fails within the pool's connect budget (LockBusy, a BrokerUnavailable) instead of
    blocking the event loop in flock(2) until the holder wakes; a pool closes at once (its leases
    are dropped, the reaper frees them); once the holder is gone a pool opens as usual."""
    from kalos.clients._transport import LockBusy

    name, n_slots = sidecar.name, 32
    frozen = _freeze(name, n_slots)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:  # the loop's own heartbeat: a blocking flock would stop it
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable) as e:
            async with RecallPool(name, size=2, connect_timeout=1.0):
                pass
        took = time.monotonic() - t0
        assert isinstance(e.value, LockBusy) and "claim lock" in str(e.value), e.value
        assert _stopped(frozen.pid), "the holder was resumed before the open gave up"
        worst = max(gaps, default=0.0)
        print(
            f"\n[claim lock] open gave up after {took:.2f} s (budget 1.0 s); the loop's longest "
            f"pause {worst * 1e3:.0f} ms"
        )
        # Generous: one attempt blocks FLOCK_WAIT_S (50 ms); a blocking flock would pause the loop
        # until the holder is killed below (never, here: the assertion comes first).
        assert worst < 2.0, worst
    finally:
        frozen.kill()
        frozen.wait()
        stop.set()
        await tick
    async with RecallPool(name, size=2, connect_timeout=30) as pool:
        q = rng.standard_normal(32).astype(np.float32)
        h = await pool.recall(q, k=5, timeout=30)
        assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
    assert wait_until(lambda: slots_free(name), 30)


# --------------------------------------------------------------------------- 4. stats fields


def test_client_written_stats_cannot_break_metrics(sidecar_factory, rng):
    port = free_port()
    h = sidecar_factory(
        "stats", "--dim", "32", "--random-rows", "100", "--backend", "numpy", "--metrics-port", str(port)
    )
    c = Connection(h.name)
    try:
        a, b = c.lease(2)
        # A request whose posting time is from the future (>= 2**63), through the one-request
        # fast path and through a batch of several.
        for slots in ([a], [a, b]):
            for s in slots:
                s.view.queries[0] = 1.0
                s.post(1, b"default", 3, 1, 0, 0, 0)
                c.seg.slots[s.index]["t_post_ns"] = 2**63 + 12345  # (after post: the sidecar may
            for s in slots:  #  read either; both are lies)
                assert wait_until(lambda s=s: s.is_done() and s.try_consume(), 5)
                assert s.outcome()[0] == Status.OK
                s.set_free()
            assert scrape_status(port) == 200
        # Counters at their limits and beyond.
        for value in (2**64 - 1, 2**63, 2**63 - 1):
            for field in ("lat_count", "lat_sum_ns", "err_count", "timeout_count"):
                c.seg.stats[a.index][field] = value
            a.view.hist[:] = value
            assert scrape_status(port) == 200
            assert scrape_status(port) == 200  # and the next scrape too
        c.seg.stats[a.index]["lat_count"] = 3  # a "reset"
        assert scrape_status(port) == 200
        with RecallClient(h.name) as client:
            client.recall(np.ones(32, np.float32), k=3)
        assert scrape_status(port) == 200
        c.give_back([a, b], [])
    finally:
        c.close()
    assert h.proc.poll() is None


# --------------------------------------------------------------------------- 5. squatting


def _squat(name: str, layout: Layout, uid: int, mode: int) -> None:
    """What another local user can do before any sidecar serves ``name``: create its objects,
    world-accessible, with a valid header naming a live process (this one)."""
    shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=mode, size=layout.total_bytes)
    import mmap

    mm = mmap.mmap(shm.fd, layout.total_bytes)
    seg = SegmentView(memoryview(mm), layout)
    seg.init_header(metric=1, backend=1, pid=os.getpid(), start_epoch_ns=time.time_ns(), payload_limit=16384)
    seg.header["state"] = SidecarState.READY
    seg.header["heartbeat_ns"] = time.monotonic_ns()
    os.fchmod(shm.fd, mode)
    os.fchown(shm.fd, uid, -1)
    shm.close_fd()
    del seg
    names = [bell_name(name)] + [f(name, i) for i in range(layout.n_slots) for f in (req_name, resp_name)]
    for n in names:
        posix_ipc.Semaphore(n, posix_ipc.O_CREX, mode=mode, initial_value=0).close()
        os.chmod(sem_path(n), mode)
        os.chown(sem_path(n), uid, -1)


def _unsquat(name: str, layout: Layout) -> None:
    for n in [bell_name(name)] + [f(name, i) for i in range(layout.n_slots) for f in (req_name, resp_name)]:
        try:
            os.unlink(sem_path(n))
        except FileNotFoundError:
            pass
    try:
        os.unlink(shm_path(shm_name(name)))
    except FileNotFoundError:
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="making objects owned by another uid needs root")
@pytest.mark.asyncio
async def test_squatted_name_is_refused_by_clients_and_by_the_sidecar():
    name = unique_name("squat")
    layout = Layout(n_slots=4, dim=8, max_k=8, max_queries=2, blob_bytes=4096)
    _squat(name, layout, NOBODY, 0o666)
    try:

        def squatted() -> list[str]:  # (only this name's objects: other tests may run beside)
            return sorted(f for f in os.listdir("/dev/shm") if name in f)

        before = squatted()
        assert before, "the squatted objects are in /dev/shm"
        with pytest.raises(UntrustedBroker, match=r"uid 65534 \(nobody\)"):
            async with RecallPool(name, size=1, connect_timeout=1):
                pass
        with pytest.raises(UntrustedBroker, match="refusing to attach"):
            RecallClient(name, connect_timeout=1)
        # Expecting the sidecar's uid to be 65534 is not enough either: the objects are open to all.
        with pytest.raises(UntrustedBroker, match="mode 0666"):
            RecallClient(name, connect_timeout=1, sidecar_uid=NOBODY)
        # The real sidecar refuses to start over them, says what to do, and removes nothing.
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "kalos.sidecar_cuda",
                "--name",
                name,
                "--ephemeral",
                "--dim",
                "8",
                "--backend",
                "numpy",
            ],
            capture_output=True,
            timeout=60,
        )
        assert p.returncode != 0
        err = p.stderr.decode()
        assert "not ours" in err and "65534" in err and "kalos cleanup" in err, err
        with pytest.raises(Exception, match="not ours"):
            cleanup(name, force=True)
        assert squatted() == before, "a foreign object was removed"
    finally:
        _unsquat(name, layout)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing object modes of a live sidecar as root only")
def test_own_objects_open_to_others_are_refused(sidecar):
    """Our own uid, but the segment was made world-writable (by hand, or an old version)."""
    path = shm_path(shm_name(sidecar.name))
    os.chmod(path, 0o606)
    try:
        with pytest.raises(UntrustedBroker, match="mode 0606"):
            RecallClient(sidecar.name, connect_timeout=1)
    finally:
        os.chmod(path, 0o600)
    os.chmod(sem_path(bell_name(sidecar.name)), 0o640)
    try:
        with pytest.raises(UntrustedBroker, match="semaphore"):
            RecallClient(sidecar.name, connect_timeout=1)
    finally:
        os.chmod(sem_path(bell_name(sidecar.name)), 0o600)
    with RecallClient(sidecar.name) as c:
        assert len(c.recall(np.ones(32, np.float32), k=2)) == 2


def run_py_from_private_dir(code: str, tmp_path: object, *args: str) -> subprocess.Popen[bytes]:
    """:func:`run_py`, with ``kalos`` imported through a directory only root can read (a 0700
    directory holding a link to the package), as from a checkout under /root or in ``mktemp -d``:
    what a child needs after it drops root must be imported before. Where the extension is built
    (and the pure path is not asked for), the child requires the compiled slot path, so a lazy
    import of it after the drop fails instead of quietly falling back."""
    private = os.path.join(str(tmp_path), "private")
    os.mkdir(private, 0o700)
    os.chmod(private, 0o700)
    import kalos

    os.symlink(os.path.dirname(os.path.abspath(kalos.__file__)), os.path.join(private, "kalos"))
    env = {**os.environ, "PYTHONPATH": private, "KALOS_TEST_PRIVATE": private}
    if os.environ.get(PURE_ENV, "") in ("", "0"):
        try:
            load_client_slot_path()
            env[REQUIRE_ENV] = "1"
        except ImportError:
            pass
    prelude = "import os, kalos\nassert kalos.__file__.startswith(os.environ['KALOS_TEST_PRIVATE']), kalos.__file__\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=private,
    )


AS_NOBODY = """
import os, sys
from kalos.clients import RecallClient
from kalos.broker.errors import BrokerUnavailable
import posix_ipc
os.setgid(65534); os.setuid(65534)   # drop root after the imports (the interpreter lives in /root)
try:
    RecallClient(sys.argv[1], connect_timeout=1)
    print("attached")
except BrokerUnavailable as e:
    print("refused:", e)
try:
    posix_ipc.Semaphore(sys.argv[2]).release()
    print("posted")
except posix_ipc.PermissionsError:
    print("sem refused")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_another_uid_cannot_attach(sidecar, tmp_path):
    p = run_py_from_private_dir(AS_NOBODY, tmp_path, sidecar.name, bell_name(sidecar.name))
    out, err = p.communicate(timeout=60)
    text = out.decode()
    assert "refused:" in text and "attached" not in text, (text, err.decode())
    assert "sem refused" in text and "posted" not in text, text


# --------------------------------------------------------------------------- 6. data dir


def test_data_dir_and_store_files_are_private_whatever_the_umask(sidecar_factory, tmp_path):
    fresh = tmp_path / "fresh"
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o755)
    (loose / "kalos.sqlite3").touch()
    os.chmod(loose / "kalos.sqlite3", 0o644)
    old = os.umask(0)  # the sidecar inherits the loosest umask
    try:
        for d in (fresh, loose):
            h = sidecar_factory("dir", "--dim", "8", "--data-dir", str(d), "--backend", "numpy", ephemeral=False)
            with RecallClient(h.name) as c:
                c.upsert([1, 2], np.ones((2, 8)), payloads=[{"secret": 1}, None])
            assert os.stat(d).st_mode & 0o777 == 0o700
            files = [f for f in os.listdir(d) if f.startswith("kalos.sqlite3")]
            assert "kalos.sqlite3-wal" in files, files
            for f in files:
                assert os.stat(d / f).st_mode & 0o777 == 0o600, (f, oct(os.stat(d / f).st_mode))
            h.stop()
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- the fuzzer

LEGIT = """
import asyncio, json, sys, time, numpy as np
from kalos.clients import RecallPool
sys.path.insert(0, sys.argv[4])
from conftest import assert_topk
async def main():
    seed, seconds = int(sys.argv[2]), float(sys.argv[3])
    matrix = np.random.default_rng(seed).standard_normal((500, 16), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    out = {"recalls": 0, "wrong": 0, "errors": []}
    async with RecallPool(sys.argv[1], size=4, timeout=10) as pool:
        print(json.dumps({"ready": True}), flush=True)
        end = time.monotonic() + seconds
        async def task():
            while time.monotonic() < end or out["recalls"] <= 20:  # (however slow the machine)
                k = int(rng.integers(1, 17))
                q = rng.standard_normal((int(rng.integers(1, 5)), 16)).astype(np.float32)
                try:
                    hits = await pool.recall_many(q, k=k)
                except Exception as e:
                    out["errors"].append(f"{type(e).__name__}: {e}")
                    continue
                for row, h in zip(q, hits):
                    out["recalls"] += 1
                    try:
                        assert_topk(row, matrix, h.ids, h.scores, k)
                    except AssertionError:
                        out["wrong"] += 1
        await asyncio.gather(*(task() for _ in range(4)))
    print(json.dumps(out), flush=True)
asyncio.run(main())
"""


def slot_path_env(path: SlotPath) -> dict[str, str]:
    """A sidecar environment that runs ``path`` and no other: the compiled path required (the
    sidecar refuses to start without it), or the Python one forced. Skips the compiled path where
    this run rules it out (KALOS_PURE_PYTHON=1) or it is not built and not required."""
    env = {k: v for k, v in os.environ.items() if k not in (PURE_ENV, REQUIRE_ENV)}
    if path is SlotPath.PYTHON:
        return {**env, PURE_ENV: "1"}
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        pytest.skip(f"{PURE_ENV}=1 rules the compiled slot path out")
    if os.environ.get(REQUIRE_ENV, "") in ("", "0"):
        try:
            load_compiled()
        except ImportError as e:
            pytest.skip(f"the compiled slot path is not built: {e}")
    return {**env, REQUIRE_ENV: "1"}


def slot_path_served(port: int) -> str:
    """The ``path`` label of the sidecar's ``kalos_slot_path_info``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    line = next(ln for ln in body.splitlines() if ln.startswith("kalos_slot_path_info{"))
    return line.split('path="', 1)[1].split('"', 1)[0]


@pytest.mark.parametrize("path", [SlotPath.COMPILED, SlotPath.PYTHON], ids=lambda p: p.value)
def test_fuzzed_slots_cannot_hurt_the_sidecar_or_other_clients(sidecar_factory, seed, request, path):
    """The fuzzer against a sidecar on each slot path (the one it served with is read back from
    its metrics): every garbage request answered or reclaimed, every well-formed one answered
    with its generation, a legitimate client's answers all correct, /metrics always up."""
    seconds = float(request.config.getoption("--fuzz-seconds"))
    port = free_port()
    env = slot_path_env(path)
    h = sidecar_factory(
        "fuzz",
        "--dim",
        "16",
        "--random-rows",
        "500",
        "--seed",
        str(seed),
        "--slots",
        "16",
        "--max-queries",
        "4",
        "--max-k",
        "16",
        "--blob-bytes",
        "65536",
        "--payload-limit",
        "65536",
        "--metrics-port",
        str(port),
        "--backend",
        "numpy",
        env=env,
    )
    assert slot_path_served(port) == path.value
    legit = run_py(LEGIT, h.name, str(seed), str(seconds + 1.0), TESTS)
    assert json.loads(legit.stdout.readline()).get("ready")
    fuzz = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "fuzz_client.py"),
            h.name,
            str(seed),
            str(seconds),
            f"http://127.0.0.1:{port}/metrics",
        ],
        capture_output=True,
        timeout=seconds + 120,
    )
    assert fuzz.returncode == 0, fuzz.stderr.decode()
    f = json.loads(fuzz.stdout.decode().strip().splitlines()[-1])
    lout, _lerr = legit.communicate(timeout=seconds + 60)
    g = json.loads(lout.decode().strip().splitlines()[-1])
    print(f"\n[fuzz] seed {seed}: {json.dumps(f)}\n[legit] {json.dumps({**g, 'errors': g['errors'][:3]})}")

    assert h.proc.poll() is None, "the sidecar died"
    assert f["iterations"] > 50 and f["wellformed"] > 5 and f["garbage_posted"] > 5, f
    assert f.get("wellformed_answered", 0) == f["wellformed"], f  # answered, generation echoed
    assert f.get("garbage_echo", 0) == 0 and f.get("garbage_unanswered", 0) == 0, f
    assert f.get("garbage_answered", 0) + f.get("garbage_reclaimed", 0) == f["garbage_posted"], f
    assert f.get("scrape_bad", 0) == 0 and f.get("scrape_ok", 0) >= 2, f
    # Bursts: every recall of a batch answered and right, whatever was posted beside it.
    assert f["burst"] > 5 and f.get("burst_checked", 0) > 10 and f.get("burst_wrong", 0) == 0, f
    assert f.get("burst_recall_answered", 0) == f["burst_checked"], f
    assert not any(f.get(f"burst_{w}_{o}", 0) for w in ("recall", "garbage") for o in ("echo", "unanswered")), f
    assert g["wrong"] == 0 and not g["errors"] and g["recalls"] > 20, g
    # The fuzzer exited holding its slots, many in states a client should never leave: every one
    # is reclaimed and FREE (the legitimate pool has closed too).
    c = Connection(h.name)
    try:
        assert wait_until(
            lambda: not c.seg.slots["owner_pid"].any() and (c.seg.slots["state"] == S_FREE).all(), timeout=30
        ), (c.seg.slots["owner_pid"], c.seg.slots["state"])
    finally:
        c.close()
    assert scrape_status(port) == 200
    assert slot_path_served(port) == path.value
    with RecallClient(h.name) as client:
        matrix = np.random.default_rng(seed).standard_normal((500, 16), dtype=np.float32)
        q = np.ones(16, np.float32)
        r = client.recall(q, k=7)
        assert_topk(q, matrix, r.ids, r.scores, 7)


AS_GROUP_MEMBER = """
import os, sys, numpy as np
from kalos.clients import RecallClient
from kalos.broker.errors import UntrustedBroker
os.setgroups([]); os.setgid(0); os.setuid(65534)  # another user, in the sidecar user's group
try:
    RecallClient(sys.argv[1], connect_timeout=1)
    print("attached without sidecar_uid")
except UntrustedBroker as e:
    print("untrusted:", e)
with RecallClient(sys.argv[1], connect_timeout=5, sidecar_uid=0) as c:
    print("recalled", len(c.recall(np.ones(8, np.float32), k=3)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_dedicated_sidecar_user_shares_objects_with_its_group(sidecar_factory, tmp_path):
    """--shm-mode 0660: a client of another uid in the sidecar user's group attaches only when it
    names the sidecar's uid (sidecar_uid=); the objects stay closed to everyone else."""
    h = sidecar_factory(
        "grp", "--dim", "8", "--random-rows", "50", "--slots", "4", "--shm-mode", "0660", "--backend", "numpy"
    )
    assert os.stat(shm_path(shm_name(h.name))).st_mode & 0o777 == 0o660
    assert os.stat(sem_path(bell_name(h.name))).st_mode & 0o777 == 0o660
    p = run_py_from_private_dir(AS_GROUP_MEMBER, tmp_path, h.name)
    out, err = p.communicate(timeout=60)
    text = out.decode()
    assert "untrusted:" in text and "belongs to uid 0 (root)" in text, (text, err.decode())
    assert "recalled 3" in text, (text, err.decode())
