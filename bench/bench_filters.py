#!/usr/bin/env python3
"""Filtered recall beside the same recall unfiltered, in one run. Rows carry the payload
``{"bucket": id % 1000}``; the filter ``{"bucket": {"$lt": 1000 s}}`` matches a fraction s of them
(0.1 %, 1 %, 10 %, 50 %), spread evenly and independent of the vectors.

Two parts, both on fresh random rows:

* **in the store** (the sidecar's own objects in this process, no shared memory): the filter's
  evaluation (payload columns -> row mask -> candidate rows) timed apart from the search, and the
  search with the evaluation cached (what a repeated filter costs until the next write);
* **through the broker** (``--tasks``): a sidecar started with ``--random-rows N
  --random-payloads``, client tasks in ``--procs`` processes recalling with each filter; latency
  percentiles and throughput, every run's answers checked against numpy float64 restricted to the
  matching rows.

    python bench/bench_filters.py --backend numpy --n 256 100000 --dim 128 --tasks 1,64
    python bench/bench_filters.py --backend cuda --dtype float16 --n 1000000 --dim 768 --tasks 1,256
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import Metric
from kalos.broker.validation import (
    WhereNode,
    encode_where,
    parse_where,
)
from kalos.sidecar_cuda.backends.select import choose_backend
from kalos.sidecar_cuda.storage.store import Filtered, Namespace
from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

SELECTIVITIES = (0.001, 0.01, 0.1, 0.5)
RTOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def log(*a: object) -> None:
    print(*a, flush=True)


def timed(fn: Callable[[], object], reps: int, warm: int = 3) -> dict[str, float]:
    """p50/p99 microseconds of ``reps`` calls (after ``warm`` unmeasured ones)."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    p = np.percentile(np.asarray(out, np.float64) / 1e3, [50, 99])
    return {"p50_us": round(float(p[0]), 1), "p99_us": round(float(p[1]), 1)}


def sidecar_matrix(n: int, d: int, seed: int) -> np.ndarray:
    """The rows `--random-rows n --seed seed` fills the sidecar with (same generator, same chunks)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, d), np.float32)
    for lo in range(0, n, 65536):
        hi = min(n, lo + 65536)
        out[lo:hi] = rng.standard_normal((hi - lo, d), dtype=np.float32)
    return out


def evaluated(ns: Namespace, node: WhereNode, blob: bytes) -> Filtered:
    """The filter evaluated afresh, as ``Namespace.filtered`` does on a miss of its cache (the
    same key: a backend's cache of the rows still answers, as it would for the sidecar)."""
    mask = ns.where(node)
    return Filtered(mask, mask.nonzero()[0].astype(np.int64), (ns.version, blob))


def where_for(s: float) -> dict[str, object]:
    return {"bucket": {"$lt": s * 1000}}


def in_store(a: argparse.Namespace, n: int, x: np.ndarray, buckets: np.ndarray) -> list[dict[str, Any]]:
    backend = choose_backend(a.backend, storage_dtype=a.dtype)
    try:
        ns = Namespace("bench", backend, a.dim, Metric.DOT, capacity=n)
        pls: list[bytes | None] = [b'{"bucket":%d}' % b for b in buckets.tolist()]
        t0 = time.perf_counter()
        for lo in range(0, n, 65536):
            ns.upsert(np.arange(lo, min(n, lo + 65536), dtype=np.int64), x[lo : lo + 65536], pls[lo : lo + 65536])
        log(f"# in-store load of {n} rows with payloads: {time.perf_counter() - t0:.1f} s")
        rng = np.random.default_rng(a.seed + 7)
        reps = a.reps if n < 500_000 else max(30, a.reps // 5)
        rows = []
        for b in a.batch:
            q = rng.standard_normal((b, a.dim), dtype=np.float32)
            un = timed(lambda: ns.search(q, a.k), reps)
            row: dict[str, Any] = {"part": "store", "n": n, "batch": b, "unfiltered": un, "filtered": []}
            for s in SELECTIVITIES:
                w = where_for(s)
                node, blob = parse_where(w), encode_where(w, 1 << 20)
                f = ns.filtered(node, blob)
                ev = timed(lambda: ns.where(node), reps)
                cand = timed(lambda: ns.where(node).nonzero(), reps)
                cached = timed(lambda: ns.search(q, a.k, match=ns.filtered(node, blob)), reps)
                cold = timed(lambda: ns.search(q, a.k, match=evaluated(ns, node, blob)), max(5, reps // 4))
                ids, _ = ns.search(q, a.k, match=f)
                assert (buckets[ids] < s * 1000).all(), "a row outside the filter"
                fr = {
                    "selectivity": s,
                    "matches": len(f.rows),
                    "filter_eval": ev,
                    "eval_and_candidates": cand,
                    "search_cached_filter": cached,
                    "search_with_eval": cold,
                    "cached_vs_unfiltered": round(cached["p50_us"] / un["p50_us"], 2),
                    "with_eval_vs_unfiltered": round(cold["p50_us"] / un["p50_us"], 2),
                }
                stats = getattr(ns.matrix, "filter_stats", None)
                if stats is not None:
                    fr["cuda_paths_so_far"] = dict(stats)
                row["filtered"].append(fr)
                log(
                    f"store n={n} b={b} s={s:<6} matches={len(f.rows):>7} eval {ev['p50_us']:>8.1f}us "
                    f"cached {cached['p50_us']:>8.1f}us with-eval {cold['p50_us']:>8.1f}us "
                    f"unfiltered {un['p50_us']:>8.1f}us -> x{fr['cached_vs_unfiltered']} / "
                    f"x{fr['with_eval_vs_unfiltered']}"
                )
            rows.append(row)
        return rows
    finally:
        backend.close()


def through_broker(a: argparse.Namespace, n: int, x: np.ndarray, buckets: np.ndarray) -> list[dict[str, Any]]:
    name = f"bflt{os.getpid()}x{n}"
    tasks_list = [int(t) for t in a.tasks.split(",") if t]
    t0 = time.perf_counter()
    proc = start_sidecar_process(
        [
            "--ephemeral",
            "--backend",
            a.backend,
            "--dtype",
            a.dtype,
            "--dim",
            str(a.dim),
            "--random-rows",
            str(n),
            "--random-payloads",
            "--seed",
            str(a.seed),
            "--slots",
            str(max(64, max(tasks_list) + 16)),
            "--max-k",
            "64",
            "--max-queries",
            "4",
        ],
        name,
        timeout=1800,
    )
    log(f"# sidecar with {n} rows and payloads ready in {time.perf_counter() - t0:.1f} s")
    rows = []
    try:
        for tasks in tasks_list:
            procs = 1 if tasks == 1 else min(a.procs, tasks)
            base: dict[str, Any] | None = None
            for s in (None, *SELECTIVITIES):
                w = None if s is None else where_for(s)
                res = run_load(
                    LoadSpec(
                        name=name,
                        dim=a.dim,
                        procs=procs,
                        tasks=tasks,
                        duration_s=a.seconds,
                        warmup_s=0.5,
                        k=a.k,
                        seed=a.seed + 1,
                        loop=a.loop,
                        keep=max(1, 100 // procs),
                        where=w,
                    )
                )
                allowed = None if s is None else buckets < s * 1000
                checked, wrong = check_samples(res.samples, x, a.k, rtol=RTOL[a.dtype], allowed=allowed)
                p = res.percentiles_us()
                row: dict[str, Any] = {
                    "part": "broker",
                    "n": n,
                    "tasks": tasks,
                    "procs": procs,
                    "selectivity": s,
                    **{kk: round(v, 1) for kk, v in p.items()},
                    "recalls_per_s": round(res.throughput),
                    "count": res.count,
                    "errors": res.errors,
                    "checked": checked,
                    "wrong": wrong,
                }
                if s is None:
                    base = row
                else:
                    assert base is not None
                    row["p50_vs_unfiltered"] = round(row["p50_us"] / base["p50_us"], 2)
                    row["throughput_vs_unfiltered"] = round(row["recalls_per_s"] / max(1, base["recalls_per_s"]), 2)
                rows.append(row)
                log(
                    f"broker n={n} tasks={tasks:<3} s={s!s:<6} p50={p['p50_us']:9.1f}us "
                    f"p95={p['p95_us']:9.1f} p99={p['p99_us']:9.1f} {res.throughput:10,.0f}/s "
                    f"x{row.get('p50_vs_unfiltered', 1.0)} wrong {wrong}/{checked} errors {res.errors}"
                )
    finally:
        stop_sidecar_process(proc)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, nargs="+", default=[256, 100_000])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="queries per in-store search")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tasks", default="1,64", help="broker runs: concurrent tasks ('' to skip)")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    env = environment()
    if a.backend == "cuda":
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(0)
        env.update(
            {
                "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                "cupy": cp.__version__,
            }
        )
    results: list[dict[str, Any]] = []
    for n in a.n:
        x = sidecar_matrix(n, a.dim, a.seed)
        buckets = np.arange(n) % 1000
        results += in_store(a, n, x, buckets)
        if a.tasks:
            results += through_broker(a, n, x, buckets)
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"filters-{a.backend}-{dt.date.today().isoformat()}.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "command": " ".join(["python3", *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": env,
                "args": vars(a),
                "rows": results,
            },
            f,
            indent=1,
        )
    log("# wrote", out)
    bad = [r for r in results if r.get("wrong") or r.get("errors")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
