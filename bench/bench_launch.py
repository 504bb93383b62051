#!/usr/bin/env python3
"""Launch policy A/B (issue 27): recall throughput, latency and the batch-size distribution
through the whole broker under each ``--launch`` policy, alternating in one run.

One sidecar per policy is started up front, on the same rows (``--random-rows``, one seed), and
stays up; each round runs every task count against every sidecar in turn (the order flips from
round to round), so the policies share the machine's drift. For each run it prints throughput,
p50/p95/p99, the mean batch and the batch-size distribution from the sidecar's ``/metrics``
(``kalos_batch_size``, the difference between a scrape before and after), and checks a sample of
answers against numpy float64 on the regenerated rows. JSON under bench/results/.

    python3 bench/bench_launch.py                                   # numpy, 200k x 256, 1..256 tasks
    python3 bench/bench_launch.py --backend cuda --size 1Mx768:float16 --tasks 1,8,64,256 --policies eager,fill,merge,split
    python3 bench/bench_launch.py --policies fill,eager --sidecar-args '--pipeline off'

On a 2-vCPU machine the numpy backend stands in for a device: pick a size whose batch takes
milliseconds there, as a GPU batch takes at 1M x 768 (the whole product is compute, though: the
fixed part of a batch that merging saves is small on a CPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_gpu import (
    RTOL,
    batch_distribution,
    free_port,
    latency_sample,
    log,
    parse_size,
    scrape_batch_sizes,
    shown_distribution,
    sidecar_matrix,
)

from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

_TOTAL = re.compile(r"^(kalos_batch_size_(?:sum|count))(?:\{[^}]*\})? (\S+)$")


def totals(port: int) -> dict[str, float]:
    """``kalos_batch_size``'s sum and count from the sidecar's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _TOTAL.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="200kx256", help="rows x dim[:dtype] (k, M suffixes)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cuda"])
    ap.add_argument("--policies", default="eager,fill", help="--launch values to compare")
    ap.add_argument("--tasks", default="1,8,64,256", help="concurrent client tasks in total")
    ap.add_argument("--procs", type=int, default=8, help="client processes for more than one task")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every policy at every task count")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument("--coalesce", action="store_true", help="clients' pools coalesce waiting recalls")
    ap.add_argument("--sidecar-args", default="", help="extra arguments for every sidecar, e.g. '--pipeline off'")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/launch-BACKEND-DATE.json)")
    a = ap.parse_args()

    n, d, dtype = parse_size(a.size)
    if a.backend == "numpy":
        dtype = "float32"
    policies = a.policies.split(",")
    tasks_list = [int(t) for t in a.tasks.split(",")]
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"# seed {seed}; {n} x {d} {dtype} on {a.backend}; policies {policies}; tasks {tasks_list}")
    t0 = time.perf_counter()
    matrix = sidecar_matrix(n, d, seed)
    log(f"# rows regenerated in {time.perf_counter() - t0:.1f} s")
    sidecars: dict[str, tuple[Any, str, int]] = {}
    rows: list[dict[str, Any]] = []
    try:
        for pol in policies:
            name, port = f"blaunch{os.getpid()}{pol}", free_port()
            t0 = time.perf_counter()
            proc = start_sidecar_process(
                [
                    "--ephemeral",
                    "--backend",
                    a.backend,
                    "--dtype",
                    dtype,
                    "--dim",
                    str(d),
                    "--random-rows",
                    str(n),
                    "--seed",
                    str(seed),
                    "--slots",
                    str(max(64, max(tasks_list) + 16)),
                    "--max-k",
                    "64",
                    "--max-queries",
                    "4",
                    "--metrics-port",
                    str(port),
                    "--launch",
                    pol,
                    *a.sidecar_args.split(),
                ],
                name,
                timeout=900,
            )
            sidecars[pol] = (proc, name, port)
            log(f"# sidecar --launch {pol} ready in {time.perf_counter() - t0:.1f} s")
        for rnd in range(a.rounds):
            for tasks in tasks_list:
                order = policies if (rnd + tasks_list.index(tasks)) % 2 == 0 else policies[::-1]
                for pol in order:
                    _proc, name, port = sidecars[pol]
                    procs = 1 if tasks == 1 else min(a.procs, tasks)
                    tot0, b0 = totals(port), scrape_batch_sizes(port)
                    res = run_load(
                        LoadSpec(
                            name=name,
                            dim=d,
                            procs=procs,
                            tasks=tasks,
                            duration_s=a.seconds,
                            warmup_s=0.5,
                            k=a.k,
                            seed=seed,
                            loop=a.loop,
                            keep=40,
                            coalesce=a.coalesce,
                        )
                    )
                    tot1, b1 = totals(port), scrape_batch_sizes(port)
                    checked, wrong = check_samples(res.samples, matrix, a.k, rtol=RTOL[dtype])
                    p = res.percentiles_us()
                    dist = batch_distribution(b0, b1)
                    nb = tot1.get("kalos_batch_size_count", 0.0) - tot0.get("kalos_batch_size_count", 0.0)
                    size_sum = tot1.get("kalos_batch_size_sum", 0.0) - tot0.get("kalos_batch_size_sum", 0.0)
                    row = {
                        "policy": pol,
                        "round": rnd,
                        "tasks": tasks,
                        "procs": procs,
                        **{kk: round(v, 1) for kk, v in p.items()},
                        "recalls_per_s": round(res.throughput),
                        "count": res.count,
                        "errors": res.errors,
                        "checked": checked,
                        "wrong": wrong,
                        "batches": int(nb),
                        "mean_batch": round(size_sum / nb, 1) if nb else None,
                        "batch_sizes": dist,
                        "client_cpu_us_per_recall": round(res.client_cpu_s / max(1, res.count) * 1e6, 1),
                        "lat_sample_us": latency_sample(res.latencies_ns, 200),
                    }
                    rows.append(row)
                    log(
                        f"round {rnd} tasks={tasks:<3} {pol:6} {res.throughput:10,.0f}/s p50={p['p50_us']:8.1f} "
                        f"p95={p['p95_us']:8.1f} p99={p['p99_us']:8.1f} us  batch~{row['mean_batch']}  "
                        f"[{shown_distribution(dist)}]  wrong {wrong}/{checked}"
                    )
    finally:
        for proc, _name, _port in sidecars.values():
            stop_sidecar_process(proc)
    log("")
    log("policy  tasks   recalls/s (median of rounds)   p50 us   p99 us   mean batch")
    summary = []
    for tasks in tasks_list:
        for pol in policies:
            mine = [r for r in rows if r["tasks"] == tasks and r["policy"] == pol]
            s = {
                "policy": pol,
                "tasks": tasks,
                "recalls_per_s": float(np.median([r["recalls_per_s"] for r in mine])),
                "p50_us": float(np.median([r["p50_us"] for r in mine])),
                "p99_us": float(np.median([r["p99_us"] for r in mine])),
                "mean_batch": float(np.median([r["mean_batch"] or 0 for r in mine])),
            }
            summary.append(s)
            log(
                f"{pol:6} {tasks:6} {s['recalls_per_s']:14,.0f} {s['p50_us']:24.1f} {s['p99_us']:8.1f} "
                f"{s['mean_batch']:10.1f}"
            )
    path = a.out or os.path.join(HERE, "results", f"launch-{a.backend}-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "benchmark": "launch",
                "command": " ".join(["python3", *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "seed": seed,
                "env": environment(),
                "size": {"n": n, "dim": d, "dtype": dtype, "backend": a.backend, "k": a.k},
                "sidecar_args": a.sidecar_args,
                "summary": summary,
                "rows": rows,
            },
            f,
            indent=1,
        )
    log(f"# wrote {path}")
    return 1 if any(r["wrong"] or r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
