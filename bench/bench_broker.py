#!/usr/bin/env python3
"""Broker benchmark (CPU or GPU sidecar): recall latency and throughput through the whole broker
(sidecar process + client processes over shared memory), beside in-process numpy measured in the
same run. Prints a table and writes JSON to bench/results/.

    python bench/bench_broker.py                       # the issue's matrix on this machine
    python bench/bench_broker.py --sizes 256x128 --tasks 1 --procs 1 --seconds 2
    python bench/bench_broker.py --sizes 256x128 --tasks 1,64 --procs 1,4 --paths compiled,python

``--paths``: the clients' slot paths to compare (``compiled``: KALOS_REQUIRE_COMPILED=1,
``python``: KALOS_PURE_PYTHON=1, in the client processes' environment; the path each ran is
checked), measured one after the other for every configuration, against one sidecar.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.demo import inproc_numpy
from kalos.testing.loadgen import LoadResult, LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


def parse_size(s: str) -> tuple[int, int]:
    n, d = s.lower().split("x")
    mult = {"k": 1000, "m": 1_000_000}
    n_i = int(float(n[:-1]) * mult[n[-1]]) if n[-1] in mult else int(n)
    return n_i, int(d)


#: The environment that makes a client process run each slot path (broker.slotpath).
PATH_ENV = {
    "compiled": {"KALOS_REQUIRE_COMPILED": "1", "KALOS_PURE_PYTHON": ""},
    "python": {"KALOS_PURE_PYTHON": "1", "KALOS_REQUIRE_COMPILED": ""},
    "default": {},
}


def _load_on(path: str, spec: LoadSpec) -> LoadResult:
    """``run_load`` with the client processes on slot path ``path`` (they are spawned: they take
    this process's environment), checked."""
    saved = {k: os.environ.get(k) for k in PATH_ENV[path]}
    os.environ.update(PATH_ENV[path])
    try:
        res = run_load(spec)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if path != "default" and set(res.slot_paths) != {path}:
        raise RuntimeError(f"asked for the {path} slot path, the clients ran {res.slot_paths}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256x128,100kx384")
    ap.add_argument("--tasks", default="1,8,64", help="concurrent tasks in total")
    ap.add_argument("--procs", default="1,2,4", help="client processes the tasks are spread over")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--loops", default="uvloop", help="event loops to measure (uvloop,asyncio)")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--coalesce", action="store_true", help="clients' pools coalesce waiting recalls")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<backend>-<host>-<date>.json)")
    ap.add_argument("--paths", default="default", help="client slot paths, comma-separated: compiled, python, default")
    a = ap.parse_args()

    seed = int.from_bytes(os.urandom(4), "little")
    rows = []
    for size in a.sizes.split(","):
        n, d = parse_size(size)
        name = f"bench-{os.getpid()}-{n}x{d}"
        t0 = time.perf_counter()
        max_tasks = max(int(t) for t in a.tasks.split(","))
        proc = start_sidecar_process(
            [
                "--ephemeral",
                "--dim",
                str(d),
                "--backend",
                a.backend,
                "--dtype",
                a.dtype,
                "--random-rows",
                str(n),
                "--seed",
                str(seed),
                "--slots",
                str(max(64, max_tasks)),
            ],
            name,
            timeout=600,
        )
        print(f"# {n}x{d}: sidecar ready in {time.perf_counter() - t0:.1f} s", flush=True)
        matrix = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
        base1, _base1_tput = inproc_numpy(matrix, a.k, seconds=max(1.0, a.seconds / 2), batch=1)
        _base64, base64_tput = inproc_numpy(matrix, a.k, seconds=max(1.0, a.seconds / 2), batch=64)
        try:
            for loop in a.loops.split(","):
                for tasks in (int(t) for t in a.tasks.split(",")):
                    for procs, path in ((int(p), path) for p in a.procs.split(",") for path in a.paths.split(",")):
                        if procs > tasks:
                            continue
                        res = _load_on(
                            path,
                            LoadSpec(
                                name=name,
                                dim=d,
                                procs=procs,
                                tasks=tasks,
                                duration_s=a.seconds,
                                warmup_s=0.5,
                                k=a.k,
                                seed=seed,
                                loop=loop,
                                keep=50,
                                coalesce=a.coalesce,
                            ),
                        )
                        checked, wrong = check_samples(res.samples, matrix, a.k)
                        p = res.percentiles_us()
                        row = {
                            "n": n,
                            "dim": d,
                            "k": a.k,
                            "loop": loop,
                            "tasks": tasks,
                            "procs": procs,
                            "slot_path": ",".join(sorted(set(res.slot_paths))),
                            **{kk: round(v, 1) for kk, v in p.items()},
                            "recalls_per_s": round(res.throughput),
                            "count": res.count,
                            "errors": res.errors,
                            "checked": checked,
                            "wrong": wrong,
                            "inproc_numpy_1q_p50_us": round(base1["p50_us"], 1),
                            "inproc_numpy_b64_recalls_per_s": round(base64_tput),
                            "overhead_p50_us": round(p["p50_us"] - base1["p50_us"], 1),
                            # CPU of the client processes per recall (measured window)
                            "client_cpu_us_per_recall": round(res.client_cpu_s / max(1, res.count) * 1e6, 1),
                            "throughput_vs_b64": round(res.throughput / base64_tput, 3),
                        }
                        rows.append(row)
                        print(
                            f"{n:>8}x{d:<4} {loop:7} tasks={tasks:<3} procs={procs} {row['slot_path']:8} "
                            f"p50={p['p50_us']:8.1f}us "
                            f"p95={p['p95_us']:8.1f} p99={p['p99_us']:8.1f}  {res.throughput:10,.0f}/s  "
                            f"| numpy 1q p50 {base1['p50_us']:.1f}us, b64 {base64_tput:,.0f}/s  "
                            f"| overhead {row['overhead_p50_us']:+.1f}us, tput x{row['throughput_vs_b64']:.2f}"
                            f"  client CPU {row['client_cpu_us_per_recall']:.1f} us/recall  wrong {wrong}/{checked}",
                            flush=True,
                        )
        finally:
            stop_sidecar_process(proc)
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"{a.backend}-{os.uname().nodename}-{dt.date.today()}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": environment(),
                "backend": a.backend,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"# wrote {out}")
    return 1 if any(r["wrong"] or r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
