#!/usr/bin/env python3
"""The client's own stages of one recall, on the compiled slot path (``clients/_cslot.c``) and the
pure-Python one (the baseline), alternating in one run: each stage of ``clients._exchange`` timed
call by call (p50/p95/p99, ns), over a segment in memory (``clients.fake.FakeConnection``) whose
semaphores are real POSIX semaphores (made here, unlinked at the end), so a post and a consume
cost what they cost against a sidecar. The sidecar's part is played between the timed calls (not
timed). Stages:

    encode     _requests.recall: validate the vector, a Prepared (compiled: as_row first)
    send       Exchange(...).send(): the rows into the slot, header fields, POSTED, sem_post
    answered   ClientSlot.answered(): DONE, and the response post consumed (sem_trywait)
    complete   Exchange.complete(): generation, bounds, status, the Hits, the latency record, FREE

``--group N`` also times a shared slot of N one-vector recalls (coalescing): encode of N,
``recall_group``, send, complete with each caller's share and record, per recall.

    python bench/bench_slot_stages.py --rounds 5 --n 20000 --out bench/results/X.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import posix_ipc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import Layout, Op
from kalos.broker.slotpath import Choice, SlotPath
from kalos.clients import _requests
from kalos.clients._coalesce import Share
from kalos.clients._exchange import Exchange
from kalos.clients._slots import ClientSlot, NativeSemaphore, load_compiled
from kalos.clients._transport import Semaphore
from kalos.clients.fake import FakeConnection
from kalos.testing.loadgen import environment

STAGES = ["encode", "send", "answered", "complete"]


def _connection(path: str, layout: Layout, names: list[str]) -> tuple[FakeConnection, ClientSlot]:
    """A fake segment on ``path`` whose slot 0 posts and waits on real named semaphores."""
    if path == "compiled":
        choice = Choice(SlotPath.COMPILED, load_compiled(), "bench")
    else:
        choice = Choice(SlotPath.PYTHON, None, "bench")
    conn = FakeConnection(layout, slot_path=choice)
    sems: list[Any] = []
    for name in names:
        if choice.module is not None:
            sems.append(NativeSemaphore(name, name, choice.module))
        else:
            sems.append(Semaphore(name, name))
    conn.req[0], conn.resp[0] = sems
    [slot] = conn.lease(1)
    return conn, slot


def _quantiles(ns: list[int], per: int = 1) -> dict[str, float]:
    a = np.asarray(ns, np.float64) / per
    p = np.percentile(a, [50, 95, 99])
    return {"p50_ns": round(float(p[0]), 1), "p95_ns": round(float(p[1]), 1), "p99_ns": round(float(p[2]), 1)}


def measure(path: str, layout: Layout, n: int, group: int, names: list[str]) -> dict[str, Any]:
    conn, slot = _connection(path, layout, names)
    fast = conn.cslot
    rng = np.random.default_rng(1)
    qs = rng.standard_normal((1024, layout.dim), dtype=np.float32)
    ids = np.arange(layout.max_queries * 10, dtype=np.int64).reshape(layout.max_queries, 10)
    scores = np.ones((layout.max_queries, 10), np.float32)

    def answer(v: Any, op: int, k: int, nq: int) -> tuple[np.ndarray, np.ndarray]:
        return ids[:nq, :k], scores[:nq, :k]

    clock = time.perf_counter_ns
    out: dict[str, list[int]] = {s: [] for s in STAGES}
    for i in range(n + 200):
        q = qs[i % 1024]
        t0 = clock()
        p = _requests.recall(layout, q, 10, b"default", False, _requests.ONE, None, fast)
        t1 = clock()
        ex = Exchange(slot, p, None, time.monotonic_ns())
        ex.send()
        t2 = clock()
        conn.serve(answer)  # (the sidecar's part)
        t3 = clock()
        got = slot.answered()
        t4 = clock()
        assert got
        value = ex.complete((False,))[1]
        t5 = clock()
        assert len(value) == 10
        if i >= 200:
            out["encode"].append(t1 - t0)
            out["send"].append(t2 - t1)
            out["answered"].append(t4 - t3)
            out["complete"].append(t5 - t4)
    res: dict[str, Any] = {s: _quantiles(v) for s, v in out.items()}
    res["sum_p50_ns"] = round(sum(res[s]["p50_ns"] for s in STAGES), 1)
    if group > 1:
        shared: dict[str, list[int]] = {"encode": [], "send": [], "complete": []}
        for i in range(n // group + 20):
            t0 = clock()
            preps = [
                _requests.recall(layout, qs[(i * group + j) % 1024], 10, b"default", False, _requests.ONE, None, fast)
                for j in range(group)
            ]
            g = _requests.recall_group(preps)
            t1 = clock()
            parts = [Share(1, 10, True, t0) for _ in range(group)]
            gx = Exchange(slot, g, None, t0, parts)
            gx.send()
            t2 = clock()
            conn.serve(answer)
            assert slot.answered()
            t3 = clock()
            value = gx.complete([False] * group)[1]
            t4 = clock()
            assert len(value) == group and g.op is Op.RECALL
            if i >= 20:
                shared["encode"].append(t1 - t0)
                shared["send"].append(t2 - t1)
                shared["complete"].append(t4 - t3)
        res[f"shared slot of {group}, per recall"] = {s: _quantiles(v, group) for s, v in shared.items()}
    assert conn.posted() == []
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=20000, help="recalls per round and path")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group", type=int, default=32, help="recalls in the shared-slot case (0: skip it)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    layout = Layout(n_slots=2, dim=a.dim, max_k=128, max_queries=64, blob_bytes=4096)
    names = [f"/kalos-bench-{os.getpid()}-{w}" for w in ("req", "resp")]
    made = [posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600) for name in names]
    runs: dict[str, list[dict[str, Any]]] = {"compiled": [], "python": []}
    try:
        for _ in range(a.rounds):
            for path in ("compiled", "python"):  # in turn, so drifting load hits both alike
                runs[path].append(measure(path, layout, a.n, a.group, names))
    finally:
        for s, name in zip(made, names):
            s.close()
            posix_ipc.unlink_semaphore(name)
    summary: dict[str, Any] = {}
    for path, rs in runs.items():
        summary[path] = {s: statistics.median(r[s]["p50_ns"] for r in rs) for s in STAGES}
        summary[path]["sum"] = statistics.median(r["sum_p50_ns"] for r in rs)
        key = f"shared slot of {a.group}, per recall"
        if a.group > 1:
            summary[path][key] = {s: statistics.median(r[key][s]["p50_ns"] for r in rs) for s in rs[0][key]}
    print(f"# dim {a.dim}, {a.n} lone recalls x {a.rounds} rounds per path; median over rounds of each p50 (ns)")
    print(f"{'stage':10s} {'python':>9s} {'compiled':>9s}")
    for s in [*STAGES, "sum"]:
        print(f"{s:10s} {summary['python'][s]:9.0f} {summary['compiled'][s]:9.0f}")
    if a.group > 1:
        key = f"shared slot of {a.group}, per recall"
        print(f"# {key}")
        for s in summary["python"][key]:
            print(f"{s:10s} {summary['python'][key][s]:9.0f} {summary['compiled'][key][s]:9.0f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                    "date": dt.datetime.now().isoformat(timespec="seconds"),
                    "env": environment(),
                    "dim": a.dim,
                    "n": a.n,
                    "rounds": a.rounds,
                    "summary_median_p50_ns": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )
        print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
