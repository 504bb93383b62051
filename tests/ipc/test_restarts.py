"""Pools across sidecar restarts, starts and forks, with real sidecars and client processes."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest
from conftest import assert_topk, run_py, unique_name, wait_until

from kalos.broker.errors import BrokerUnavailable, ProtocolError
from kalos.broker.names import shm_name
from kalos.clients import RecallClient, RecallPool
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing import start_sidecar_process

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: conftest.py
TIMEOUT = 1.0  # every client call's own budget in the restart loop

CLIENT = """
import asyncio, json, os, sys, time, numpy as np
sys.path.insert(0, sys.argv[5])
from conftest import assert_topk
from kalos.clients import RecallPool
from kalos.broker.errors import BrokerUnavailable, KalosTimeout

def runq():
    # Nanoseconds each thread of this process has waited for a CPU (the kernel's schedstat): time
    # the machine's load took from us, which no timeout can be held to.
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just ended
    return out

def denied_s(before):
    after = runq()
    return sum(v - before.get(t, 0) for t, v in after.items()) / 1e9

async def main():
    name, seed, stop_file, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    matrix = np.random.default_rng(seed).standard_normal((3000, 16), dtype=np.float32)
    rng = np.random.default_rng(seed + int(sys.argv[6]))
    progress = os.open(stop_file + "." + sys.argv[6], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    out = {"ok": 0, "wrong": 0, "unavailable": 0, "timeouts": 0, "other": [], "max_over": 0.0,
           "max_excess": 0.0, "recovered_at": []}
    async with RecallPool(name, size=3, timeout=timeout) as pool:
        print(json.dumps({"ready": True}), flush=True)
        last_ok = time.monotonic()
        async def task():
            nonlocal last_ok
            while not os.path.exists(stop_file):
                q = rng.standard_normal(16).astype(np.float32)
                t0, waited0 = time.monotonic(), runq()
                try:
                    h = await pool.recall(q, k=5)
                    try:
                        assert_topk(q, matrix, h.ids, h.scores, 5)
                        out["ok"] += 1
                    except AssertionError:
                        out["wrong"] += 1
                    now = time.monotonic()
                    if now - last_ok > 0.03:
                        out["recovered_at"].append(now)
                        os.write(progress, f"{now}\\n".encode())  # the parent waits for these
                    last_ok = now
                except BrokerUnavailable:
                    out["unavailable"] += 1
                except KalosTimeout:
                    out["timeouts"] += 1
                except Exception as e:
                    out["other"].append(f"{type(e).__name__}: {e}")
                over = time.monotonic() - t0 - timeout
                if over > out["max_over"]:
                    out["max_over"] = over
                if over > 0:  # over its budget by more than the CPU the machine denied us?
                    out["max_excess"] = max(out["max_excess"], over - denied_s(waited0))
        await asyncio.gather(*(task() for _ in range(2)))
        st = pool.statistics()
        out["outages"], out["reattaches"] = st.outages, st.reattaches
    print(json.dumps(out), flush=True)

import uvloop
(uvloop.run if int(sys.argv[6]) % 2 else asyncio.run)(main())
"""


def start(name: str, seed: int, *extra: str) -> tuple[subprocess.Popen[bytes], float]:
    p = start_sidecar_process(
        [
            "--ephemeral",
            "--dim",
            "16",
            "--random-rows",
            "3000",
            "--seed",
            str(seed),
            "--slots",
            "16",
            "--backend",
            "numpy",
            *extra,
        ],
        name,
        stderr=subprocess.DEVNULL,
    )
    return p, time.monotonic()


def _recovered(stop: object, clients: int) -> list[float]:
    """The latest time each client was answered again after a gap (its progress file)."""
    last = []
    for i in range(clients):
        try:
            with open(f"{stop}.{i}") as f:
                lines = f.read().split()
        except FileNotFoundError:
            lines = []
        last.append(float(lines[-1]) if lines else 0.0)
    return last


@pytest.mark.timeout(900)  # 22 sidecar starts: about a minute, several on a loaded machine
def test_pools_survive_a_restart_loop(seed, tmp_path):
    """4 client processes (2 tasks each, asyncio and uvloop) keep recalling while the sidecar is
    killed -9 (and sometimes SIGTERMed) and restarted 22 times: 0 wrong answers, every pool
    serving again after each new READY (before the next kill), no call over its own timeout by
    more than 100 ms beyond the CPU time the machine's load denied its process, nobody reopened
    anything."""
    name = unique_name("restart")
    restarts = 22
    began = time.monotonic()
    stop = tmp_path / "stop"
    proc, ready = start(name, seed)
    clients = [run_py(CLIENT, name, str(seed), str(stop), str(TIMEOUT), HERE, str(i)) for i in range(4)]
    kills: list[float] = []
    readies: list[float] = []
    try:
        for c in clients:
            assert json.loads(c.stdout.readline())["ready"]
        for r in range(restarts):
            time.sleep(0.2)  # serving a while (not part of any bound)
            kills.append(time.monotonic())
            if r % 7 == 3:
                proc.send_signal(signal.SIGTERM)
            else:
                proc.kill()
            proc.wait()
            gone = time.monotonic()  # any answer after this comes from the next sidecar
            proc, ready = start(name, seed)
            readies.append(ready)
            # the next kill only once every pool serves again (a generous budget: a stuck pool)
            assert wait_until(lambda: min(_recovered(stop, len(clients))) > gone, 60, 0.005), (
                f"restart {r}: a pool never served again: {_recovered(stop, len(clients))} (READY {ready})"
            )
        time.sleep(1.5)
        stop.touch()
        outs = [json.loads(c.communicate(timeout=60)[0].decode().strip().splitlines()[-1]) for c in clients]
    finally:
        stop.touch()
        for c in clients:
            if c.poll() is None:
                c.kill()
        proc.terminate()
        proc.wait()
        cleanup(name, force=True)
    outage = []  # kill -> first good answer by any client
    late = []  # READY -> first good answer, per client and restart
    for kill, ready in zip(kills, readies):
        firsts = [min((t for t in o["recovered_at"] if t > kill), default=None) for o in outs]
        assert all(f is not None for f in firsts), "a pool never served again"
        outage.append(min(firsts) - kill)  # type: ignore[type-var]
        late.extend(f - ready for f in firsts)  # type: ignore[operator]
    summary = {k: sum(o[k] for o in outs) for k in ("ok", "wrong", "unavailable", "timeouts", "outages", "reattaches")}
    print(
        f"\n[restarts] {restarts} restarts in {time.monotonic() - began:.0f} s, {summary}; max over timeout "
        f"{max(o['max_over'] for o in outs) * 1000:.0f} ms ("
        f"{max(o['max_excess'] for o in outs) * 1000:.0f} ms beyond the CPU the load denied); "
        f"outage kill->first good answer p50 {np.median(outage) * 1000:.0f} ms, max "
        f"{max(outage) * 1000:.0f} ms; READY->serving max {max(late) * 1000:.0f} ms"
    )
    assert summary["wrong"] == 0
    assert not any(o["other"] for o in outs), [o["other"] for o in outs]
    assert max(o["max_excess"] for o in outs) <= 0.1
    assert all(o["ok"] >= restarts and o["reattaches"] >= restarts for o in outs), outs


def test_pool_opened_before_the_sidecar_starts_waits_for_it(seed):
    name = unique_name("early")
    code = """
import asyncio, sys, time, numpy as np
from kalos.clients import RecallPool
async def main():
    t0 = time.monotonic()
    print("opening", flush=True)
    async with RecallPool(sys.argv[1], size=2, connect_timeout=60) as pool:
        h = await pool.recall(np.ones(16, np.float32), k=3, timeout=5)
        print(len(h), round(time.monotonic() - t0, 2), flush=True)
asyncio.run(main())
"""
    early = [run_py(code, name) for _ in range(2)]
    blocking = run_py(
        "import sys, numpy as np\nfrom kalos.clients import RecallClient\n"
        "print('opening', flush=True)\n"
        "with RecallClient(sys.argv[1], connect_timeout=60) as c:\n"
        "    print(len(c.recall(np.ones(16, np.float32), k=3)), flush=True)",
        name,
    )
    for p in early + [blocking]:  # however long their start takes on a loaded machine
        assert p.stdout.readline().strip() == b"opening", p.stderr.read().decode()
    time.sleep(1.0)  # the pools are waiting for objects that do not exist yet
    assert all(p.poll() is None for p in early + [blocking])
    proc, _ = start(name, seed)
    try:
        for p in early:
            out, err = p.communicate(timeout=60)
            n, waited = out.decode().split()
            assert n == "3" and float(waited) >= 1.0, err.decode()  # it waited for the start
        out, err = blocking.communicate(timeout=60)
        assert out.decode().strip() == "3", err.decode()
    finally:
        proc.terminate()
        proc.wait()


def test_a_segment_a_sidecar_is_still_writing_is_unavailable_not_an_error():
    """A sidecar creates its segment, sizes it, and writes the magic last. A client attaching in
    between (on a loaded machine that can last long) must see a broker still starting, which it
    waits for, not a protocol error that breaks a pool for good; a wrong magic is an error."""
    name = unique_name("starting")
    shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        with pytest.raises(BrokerUnavailable, match="still starting"):
            Connection(name)  # created, not yet sized
        os.ftruncate(shm.fd, 8192)
        with pytest.raises(BrokerUnavailable, match="still starting"):
            Connection(name)  # sized, header not yet written
        with pytest.raises(BrokerUnavailable, match="still starting"):
            RecallClient(name, connect_timeout=0.3)  # waited for it, then said so
        mm = mmap.mmap(shm.fd, 8192)
        mm[:8] = b"NOTKALOS"
        mm.close()
        with pytest.raises(ProtocolError, match="bad magic"):
            Connection(name)
    finally:
        shm.close_fd()
        shm.unlink()


@pytest.mark.asyncio
async def test_slow_start_and_a_start_with_another_dim(tmp_path, rng):
    """A restarted sidecar that takes seconds to load: calls wait for it within their timeout.
    One that comes back with another dim: a clear ProtocolError, not a silent re-attach."""
    name = unique_name("slow")
    matrix = rng.standard_normal((2_000_000, 8)).astype(np.float32)
    np.save(tmp_path / "m.npy", matrix)
    args = ["--ephemeral", "--dim", "8", "--load", str(tmp_path / "m.npy"), "--backend", "numpy"]
    proc = start_sidecar_process(args, name, stderr=subprocess.DEVNULL)
    try:
        async with RecallPool(name, size=2) as pool:
            q = rng.standard_normal(8).astype(np.float32)
            await pool.recall(q, k=3, timeout=5)
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            restarted = subprocess.Popen(
                [sys.executable, "-m", "kalos.sidecar_cuda", "--name", name, *args], stderr=subprocess.DEVNULL
            )
            proc = restarted
            try:  # posted before the pool noticed the kill: in flight, so it fails
                h = await pool.recall(q, k=3, timeout=30)
            except BrokerUnavailable:
                h = await pool.recall(q, k=3, timeout=30)  # waits through the load
            waited = time.monotonic() - t0
            assert_topk(q, matrix, h.ids, h.scores, 3)
            st = pool.statistics()
            assert st.outages == 1 and st.reattaches == 1 and waited > 0.5, (st, waited)
            print(f"\n[slow start] answered {waited:.2f} s after the kill (load included)")
            proc.kill()
            proc.wait()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kalos.sidecar_cuda",
                    "--name",
                    name,
                    "--ephemeral",
                    "--dim",
                    "16",
                    "--backend",
                    "numpy",
                ],
                stderr=subprocess.DEVNULL,
            )
            with pytest.raises((ProtocolError, BrokerUnavailable)):
                await pool.recall(q, k=3, timeout=30)  # maybe in flight at the kill
            with pytest.raises(ProtocolError, match="another geometry"):
                await pool.recall(q, k=3, timeout=30)
            with pytest.raises(ProtocolError):  # and it stays an error
                await pool.recall(q, k=3, timeout=1)
    finally:
        proc.kill()
        proc.wait()
        cleanup(name, force=True)


FORK = """
import asyncio, os, sys, numpy as np
from kalos.clients import RecallClient, RecallPool
from kalos.broker.errors import ForkedPoolError

async def main():
    pool = await RecallPool(sys.argv[1], size=2).open()
    client = RecallClient(sys.argv[1])
    q = np.ones(16, np.float32)
    await pool.recall(q, k=3)
    pid = os.fork()
    if pid == 0:
        try:
            asyncio.run(pool.recall(q, k=3))
            print("child used the pool", flush=True)
        except ForkedPoolError as e:
            print("child refused:", e, flush=True)
        try:
            client.recall(q, k=3)
            print("child used the client", flush=True)
        except ForkedPoolError:
            print("child client refused", flush=True)
        client.close()   # must not give the parent's lease back
        os._exit(0)
    os.waitpid(pid, 0)
    h = await pool.recall(q, k=3)          # the parent's pool and client still work
    print("parent ok", len(h), len(client.recall(q, k=3)), flush=True)
    await pool.close()
    client.close()

asyncio.run(main())
"""


def test_a_forked_child_cannot_use_the_parents_pool(sidecar_factory):
    h = sidecar_factory("fork", "--dim", "16", "--random-rows", "100", "--backend", "numpy")
    p = run_py(FORK, h.name)
    out, err = p.communicate(timeout=60)
    text = out.decode()
    assert "child refused: this pool was opened in process" in text, (text, err.decode())
    assert "child client refused" in text and "used the" not in text, text
    assert "parent ok 3 3" in text, (text, err.decode())


UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(
    os.geteuid() != 0 or UNSHARE is None, reason="needs root and unshare(1) for a client in its own PID namespace"
)
def test_client_in_another_pid_namespace_is_served_and_reaped(sidecar_factory, seed):
    h = sidecar_factory("pidns", "--dim", "16", "--random-rows", "3000", "--seed", str(seed), "--backend", "numpy")
    code = """
import asyncio, os, sys, numpy as np
sys.path.insert(0, sys.argv[3])
from conftest import assert_topk
from kalos.clients import RecallPool
async def main():
    matrix = np.random.default_rng(int(sys.argv[2])).standard_normal((3000, 16), dtype=np.float32)
    rng = np.random.default_rng(1)
    async with RecallPool(sys.argv[1], size=4, min_size=4) as pool:
        for _ in range(200):
            q = rng.standard_normal(16).astype(np.float32)
            r = await pool.recall(q, k=5)
            assert_topk(q, matrix, r.ids, r.scores, 5)
        print("pid", os.getpid(), "ok", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""
    p = subprocess.Popen(
        [
            UNSHARE,
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-c",
            code,
            h.name,
            str(seed),
            HERE,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = p.stdout.readline().decode()
    if not line:
        err = p.stderr.read().decode()
        if "Operation not permitted" in err:
            pytest.skip(f"unshare is not permitted here: {err.strip()}")
        raise AssertionError(err)
    assert line.startswith("pid 1 ok"), line  # it sees itself as pid 1, and was served correctly
    from kalos.clients._transport import Connection

    c = Connection(h.name)
    try:
        owners = c.seg.slots["owner_pid"]
        assert int((owners == 1).sum()) == 4  # its leases carry its namespace-local pid
        time.sleep(0.6)  # two reaper passes: a live client in another namespace keeps its slots
        assert int((c.seg.slots["owner_pid"] == 1).sum()) == 4
        p.kill()  # kill -9 unshare; --kill-child makes the kernel SIGKILL the client with it
        t0 = time.monotonic()
        freed = wait_until(lambda: int((c.seg.slots["owner_pid"] == 1).sum()) == 0, 30, 0.005)
        took = time.monotonic() - t0
        print(f"\n[pidns] slots of the killed namespaced client freed in {took * 1000:.0f} ms")
        assert freed, f"not freed in {took:.0f} s"
    finally:
        c.close()
        p.wait()


def test_blocking_client_resends_a_read_and_waits_for_the_next_sidecar(seed):
    name = unique_name("blk")
    proc, _ = start(name, seed)
    matrix = np.random.default_rng(seed).standard_normal((3000, 16), dtype=np.float32)
    try:
        with RecallClient(name, timeout=10) as c:
            q = np.ones(16, np.float32)
            c.recall(q, k=3)
            proc.kill()
            proc.wait()
            restarter = __import__("threading").Timer(0.5, lambda: restarted.append(start(name, seed)[0]))
            restarted: list[subprocess.Popen[bytes]] = []
            restarter.start()
            h = c.recall(q, k=3)  # made during the outage: waits, then the new sidecar answers
            assert_topk(q, matrix, h.ids, h.scores, 3)
            restarter.join()
            proc = restarted[0]
            with pytest.raises(BrokerUnavailable):  # a write in an outage beyond its budget
                proc.kill()
                proc.wait()
                c.upsert([1], q[None], timeout=0.3)
    finally:
        proc.kill()
        proc.wait()
        cleanup(name, force=True)
