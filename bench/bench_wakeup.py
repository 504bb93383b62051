#!/usr/bin/env python3
"""What the wake-up mechanism costs: round trips through the broker over a tiny memory (16 x 4, so
compute is ~nothing), with the pool's spin phase (polls shared memory between loop turns) and with
spinning off (``spin_us=0``: every answer arrives through the waiter thread and
``call_soon_threadsafe``), on asyncio and uvloop, and for the blocking client. Compare with the IPC
floors in PERFORMANCE.md, and with a bare posix_ipc ping-pong measured in the same run (the floor
any semaphore-based design pays on this machine). Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.clients import RecallClient
from kalos.testing.loadgen import LoadSpec, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


def _echo(req_name: str, resp_name: str) -> None:
    import posix_ipc

    req, resp = posix_ipc.Semaphore(req_name), posix_ipc.Semaphore(resp_name)
    while True:
        req.acquire()
        resp.release()


def ipc_floor(seconds: float) -> list[dict[str, Any]]:
    """The same run's floor: a bare posix_ipc semaphore ping-pong with an echo process, the
    client blocking in sem_wait or polling with sem_trywait (what any design here pays)."""
    import multiprocessing as mp

    import posix_ipc

    tag = f"/kalos-floor-{os.getpid()}"
    req = posix_ipc.Semaphore(tag + "-q", posix_ipc.O_CREX)
    resp = posix_ipc.Semaphore(tag + "-s", posix_ipc.O_CREX)
    p = mp.get_context("spawn").Process(target=_echo, args=(req.name, resp.name), daemon=True)
    p.start()
    out = []
    try:
        for mode in ("sem_wait (blocking)", "sem_trywait (polling)"):
            lat = []
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter_ns()
                req.release()
                if mode.startswith("sem_wait"):
                    resp.acquire()
                else:
                    while True:
                        try:
                            resp.acquire(0)
                            break
                        except posix_ipc.BusyError:
                            pass
                lat.append(time.perf_counter_ns() - t)
            p50, p95, p99 = np.percentile(np.asarray(lat[100:]) / 1e3, [50, 95, 99])
            out.append(
                {
                    "client": "bare posix_ipc",
                    "mechanism": mode,
                    "spin_us": None,
                    "p50_us": round(float(p50), 1),
                    "p95_us": round(float(p95), 1),
                    "p99_us": round(float(p99), 1),
                    "n": len(lat),
                }
            )
    finally:
        p.kill()
        req.unlink()
        resp.unlink()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sidecar-spin-us", type=float, default=250.0)
    a = ap.parse_args()
    name = f"wake-{os.getpid()}"
    proc = start_sidecar_process(
        ["--ephemeral", "--dim", "4", "--random-rows", "16", "--backend", "numpy", "--spin-us", str(a.sidecar_spin_us)],
        name,
    )
    rows = []
    try:
        for loop in ("asyncio", "uvloop"):
            for spin in (250.0, 0.0):
                res = run_load(
                    LoadSpec(
                        name=name, dim=4, tasks=1, procs=1, duration_s=a.seconds, k=4, loop=loop, spin_us=spin, keep=0
                    )
                )
                p = res.percentiles_us()
                rows.append(
                    {
                        "client": f"pool/{loop}",
                        "mechanism": "poll then wait" if spin else "waiter thread only",
                        "spin_us": spin,
                        **{k: round(v, 1) for k, v in p.items()},
                        "n": res.count,
                    }
                )
        for spin in (250.0, 0.0):
            lat = []
            with RecallClient(name, spin_us=spin) as c:
                q = np.ones(4, np.float32)
                end = time.perf_counter() + a.seconds
                while time.perf_counter() < end:
                    t = time.perf_counter_ns()
                    c.recall(q, k=4)
                    lat.append(time.perf_counter_ns() - t)
            q = np.percentile(np.asarray(lat[100:]) / 1e3, [50, 95, 99])
            rows.append(
                {
                    "client": "blocking",
                    "mechanism": "spin then sem_timedwait" if spin else "sem_timedwait only",
                    "spin_us": spin,
                    "p50_us": round(float(q[0]), 1),
                    "p95_us": round(float(q[1]), 1),
                    "p99_us": round(float(q[2]), 1),
                    "n": len(lat),
                }
            )
    finally:
        stop_sidecar_process(proc)
    rows += ipc_floor(a.seconds)
    for r in rows:
        print(
            f"{r['client']:16} {r['mechanism']:26} p50 {r['p50_us']:7.1f} us  p95 {r['p95_us']:7.1f}  p99 {r['p99_us']:7.1f}"
        )
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"wakeup-{os.uname().nodename}-{dt.date.today()}.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": environment(),
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
