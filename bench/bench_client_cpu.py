#!/usr/bin/env python3
"""The asyncio pool's own CPU per recall, without a sidecar process: a RecallPool over
``clients.fake.FakeConnection`` (a real slot layout in a bytearray) answered by a coroutine in the
same event loop that serves every posted slot each loop turn with a fixed answer. What it reports
(process CPU time / recalls) is the client's Python: validation, queueing and coalescing, writing,
posting, polling, splitting and building each caller's Hits, plus the fake sidecar's share (the
same in every variant; its semaphores are Python objects, so a post or a consume costs more than
posix_ipc's). ``client_us_per_recall`` leaves out the CPU time spent inside the fake sidecar's
``serve`` (measured with the thread's CPU clock around each call). ``--trees`` runs the same
measurement from other checkouts, ``--paths`` on the compiled and the pure-Python slot path
(``KALOS_REQUIRE_COMPILED=1`` / ``KALOS_PURE_PYTHON=1``; the path that ran is checked), all in
alternation (A/B), medians over ``--runs``.

    python bench/bench_client_cpu.py --tasks 1,64 --runs 5 --paths compiled,python --out cpu.json
    python bench/bench_client_cpu.py --tasks 64 --runs 5 --trees .,/tmp/kalos-base --out cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _measure(tasks: int, coalesce: bool, seconds: float, dim: int) -> dict[str, Any]:
    import numpy as np

    from kalos.broker.layout import Layout
    from kalos.clients.fake import FakeConnection
    from kalos.clients.pool import RecallPool

    conn = FakeConnection(Layout(n_slots=max(64, tasks), dim=dim, max_k=128, max_queries=64, blob_bytes=4096))
    ids = np.arange(64 * 10, dtype=np.int64).reshape(64, 10)
    scores = np.ones((64, 10), np.float32)
    pool = RecallPool("fake", size=tasks, min_size=1, connect=lambda n, u: conn, coalesce=coalesce)
    await pool.open()
    stop = False

    fake_ns = 0

    async def sidecar() -> None:
        nonlocal fake_ns
        tick = time.thread_time_ns
        while not stop:
            t = tick()
            conn.serve(lambda v, op, k, nq: (ids[:nq, :k], scores[:nq, :k]))
            fake_ns += tick() - t
            await asyncio.sleep(0)

    side = asyncio.ensure_future(sidecar())
    bank = np.random.default_rng(0).standard_normal((1024, dim), dtype=np.float32)
    n = 0
    t_end = time.perf_counter() + seconds

    async def task(j: int) -> None:
        nonlocal n
        i = j
        while time.perf_counter() < t_end:
            await pool.recall(bank[i % 1024], 10)
            i += tasks
            n += 1

    c0 = time.process_time()
    await asyncio.gather(*(task(j) for j in range(tasks)))
    cpu = time.process_time() - c0
    stop = True
    await side
    stats = pool.statistics()
    await pool.close()
    return {
        "recalls": n,
        "cpu_s": cpu,
        "us_per_recall": cpu / n * 1e6,
        "fake_sidecar_s": fake_ns / 1e9,
        "client_us_per_recall": (cpu - fake_ns / 1e9) / n * 1e6,
        "posted": stats.posted,
        "slot_path": getattr(stats, "slot_path", "python"),  # (a tree from before it existed: python)
    }


#: The environment that makes a process run each slot path (broker.slotpath).
PATH_ENV = {
    "compiled": {"KALOS_REQUIRE_COMPILED": "1", "KALOS_PURE_PYTHON": ""},
    "python": {"KALOS_PURE_PYTHON": "1", "KALOS_REQUIRE_COMPILED": ""},
    "default": {},
}


def _one(tree: str, tasks: int, coalesce: bool, seconds: float, dim: int, path: str = "default") -> dict[str, Any]:
    """One measurement in a fresh process importing ``tree``'s clients, on slot path ``path``."""
    code = (
        f"import sys, json, uvloop; sys.path.insert(0, {tree!r}); sys.path.insert(0, {HERE!r} + '/bench');"
        f"import bench_client_cpu as b;"
        f"print(json.dumps(uvloop.run(b._measure({tasks}, {coalesce}, {seconds}, {dim}))))"
    )
    env = {**os.environ, "PYTHONPATH": tree, **PATH_ENV[path]}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if path != "default" and res["slot_path"] != path:
        raise RuntimeError(f"asked for the {path} slot path, the pool ran the {res['slot_path']} one")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="64", help="concurrent tasks, comma-separated")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trees", default=".", help="checkouts to compare, comma-separated")
    ap.add_argument(
        "--paths", default="default", help="slot paths to compare, comma-separated: compiled, python, default"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trees = [os.path.abspath(t) for t in a.trees.split(",")]
    paths = a.paths.split(",")
    tasks_list = [int(t) for t in a.tasks.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(a.runs):  # every variant once per round, in turn
        for tasks in tasks_list:
            for coalesce in (False, True):
                for tree in trees:
                    for path in paths:
                        key = f"{tree} tasks={tasks} coalesce={coalesce}" + (
                            f" path={path}" if path != "default" else ""
                        )
                        runs.setdefault(key, []).append(_one(tree, tasks, coalesce, a.seconds, a.dim, path))
    summary = {
        key: {
            "median_us_per_recall": round(statistics.median(r["us_per_recall"] for r in rs), 2),
            "min_us_per_recall": round(min(r["us_per_recall"] for r in rs), 2),
            "max_us_per_recall": round(max(r["us_per_recall"] for r in rs), 2),
            "median_client_us_per_recall": round(statistics.median(r["client_us_per_recall"] for r in rs), 2),
            "min_client_us_per_recall": round(min(r["client_us_per_recall"] for r in rs), 2),
            "max_client_us_per_recall": round(max(r["client_us_per_recall"] for r in rs), 2),
            "recalls_per_slot": round(statistics.median(r["recalls"] / max(1, r["posted"]) for r in rs), 1),
        }
        for key, rs in runs.items()
    }
    for key, s in summary.items():
        print(
            f"{key}: {s['median_us_per_recall']:.2f} us of CPU per recall (median of {a.runs}; "
            f"{s['min_us_per_recall']:.2f}-{s['max_us_per_recall']:.2f}), without the fake sidecar "
            f"{s['median_client_us_per_recall']:.2f} ({s['min_client_us_per_recall']:.2f}-"
            f"{s['max_client_us_per_recall']:.2f}), {s['recalls_per_slot']} recalls per slot"
        )
    if a.out:
        from kalos.testing.loadgen import environment

        with open(a.out, "w") as f:
            json.dump(
                {
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                    "date": dt.datetime.now().isoformat(timespec="seconds"),
                    "env": environment(),
                    "tasks": tasks_list,
                    "paths": paths,
                    "dim": a.dim,
                    "seconds": a.seconds,
                    "summary": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )
        print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
