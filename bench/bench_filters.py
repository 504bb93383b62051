"""Filtered recall beside the same recall unfiltered, in one run: a namespace of n random rows
whose payloads carry a field ``b`` with 1000 values, filtered at selectivities 0.1 %, 1 %, 10 %
and 50 % (``{"b": {"$lt": s}}``). Measured in the sidecar's store (no shared memory round trip):
filter evaluation (payload columns -> row mask) timed apart from the search. JSON to bench/results/.

    .venv/bin/python bench/bench_filters.py --backend numpy --n 256 --dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from broker.layout import Metric
from broker.validation import parse_where
from sidecar_cuda.backends.select import choose_backend
from sidecar_cuda.store import Namespace

SELECTIVITIES = (0.001, 0.01, 0.1, 0.5)


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``reps`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--n", type=int, nargs="+", default=[256, 100_000])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    backend = choose_backend(a.backend)
    runs = []
    for n in a.n:
        ns = Namespace("bench", backend, a.dim, Metric.DOT, capacity=n)
        x = rng.standard_normal((n, a.dim), dtype=np.float32)
        b = rng.integers(1000, size=n)
        pls = [json.dumps({"b": int(v), "tag": f"t{v % 13}"}).encode() for v in b]
        t0 = time.perf_counter()
        ns.upsert(np.arange(n, dtype=np.int64), x, pls)
        load_s = time.perf_counter() - t0
        q = rng.standard_normal((1, a.dim), dtype=np.float32)
        row = {"n": n, "dim": a.dim, "k": a.k, "load_s": load_s,
               "unfiltered_us": timed(lambda: ns.search(q, a.k), a.reps) * 1e6, "filtered": []}
        for s in SELECTIVITIES:
            node = parse_where({"b": {"$lt": s * 1000}})
            mask = ns.where(node)
            eval_s = timed(lambda: ns.where(node), a.reps)
            search_s = timed(lambda: ns.search_where(q, a.k, mask), a.reps)
            total_s = timed(lambda: ns.search_where(q, a.k, ns.where(node)), a.reps)
            row["filtered"].append({"selectivity": s, "matches": int(mask.sum()),
                                    "filter_eval_us": eval_s * 1e6, "search_us": search_s * 1e6,
                                    "total_us": total_s * 1e6})
        eq = parse_where({"tag": {"$in": ["t1", "t2"]}, "b": {"$gte": 500}})
        row["in_and_range_eval_us"] = timed(lambda: ns.where(eq), a.reps) * 1e6
        runs.append(row)
        print(json.dumps(row))
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                f"filters-{a.backend}-{platform.node() or 'host'}.json")
    with open(out, "w") as f:
        json.dump({"backend": backend.description, "cpus": os.cpu_count(), "seed": a.seed,
                   "reps": a.reps, "runs": runs}, f, indent=1)
    print("wrote", out)
    backend.close()


if __name__ == "__main__":
    main()
