#!/usr/bin/env python3
"""Where the sidecar's serving thread spends its time under load: runs the sidecar under cProfile
(``python -m cProfile -m kalos.sidecar_cuda``), drives it with client processes (kalos.testing.loadgen), stops
it with SIGTERM and prints the functions with the most own time and the serving path's cumulative
times. cProfile slows every Python call, so read the shares, not the absolute times.

    python3 bench/profile_sidecar.py --backend cuda --dtype float16 --rows 1000000 --dim 768 \\
        --tasks 256 --procs 8 --seconds 4 [--out sidecar.prof]
"""

from __future__ import annotations

import argparse
import os
import pstats
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.testing.loadgen import LoadSpec, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument(
        "--selectivity",
        type=float,
        default=0.0,
        help="filtered recalls: rows get {'bucket': id %% 1000} and every recall "
        "filters bucket < 1000 x this (0: unfiltered)",
    )
    a = ap.parse_args()

    out = a.out or os.path.join(tempfile.mkdtemp(), "sidecar.prof")
    name = f"prof{os.getpid()}"
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
            str(a.rows),
            "--seed",
            "1",
            "--slots",
            str(a.tasks + 16),
            "--max-k",
            "64",
            "--max-queries",
            "4",
            *(["--random-payloads"] if a.selectivity else []),
        ],
        name,
        timeout=900,
        python_args=["-m", "cProfile", "-o", out],
    )
    try:
        res = run_load(
            LoadSpec(
                name=name,
                dim=a.dim,
                procs=a.procs,
                tasks=a.tasks,
                duration_s=a.seconds,
                warmup_s=0.5,
                k=a.k,
                seed=2,
                where={"bucket": {"$lt": a.selectivity * 1000}} if a.selectivity else None,
            )
        )
        p = res.percentiles_us()
        print(
            f"# {a.rows}x{a.dim} {a.dtype} {a.backend}, {a.tasks} tasks / {a.procs} procs under "
            f"cProfile: {res.throughput:,.0f}/s, p50 {p['p50_us']:.0f} us, p99 {p['p99_us']:.0f} us",
            flush=True,
        )
    finally:
        stop_sidecar_process(proc)
    st = pstats.Stats(out)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats("server.py|general.py|pipeline.py|backend.py|store.py", a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
