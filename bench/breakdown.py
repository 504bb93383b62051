"""Where the microseconds of one lone recall go, from public entry points only.

A sidecar process (``--backend``, rows from ``--random-rows``, its metrics endpoint on) and one
blocking client (``RecallClient``) in this process doing recalls one after another:

    end to end        RecallClient.recall, measured here (p50, p99)
    sidecar wait      posted by the client -> taken into a batch (the sidecar's
                      ``kalos_stage_latency_window_seconds{stage="queue_wait"}``)
    sidecar serve     taken -> answered: the sidecar's ``service`` stage (posted -> answered)
                      less its wait
    client            end to end less the sidecar's service: validate, encode, write, post, then
                      notice the answer, decode, release

The sidecar's figures are the quantiles of its own sliding window over the measured recalls (one
at a time, so each batch is one request). Then, in this process on the same shape: the search
through the backend (``Matrix.search``, wall time) and, on CUDA, its GPU time from CUDA events on
the backend's stream, which split "sidecar serve" into kernel, launch + sync and the sidecar's
own Python (the rest). Prints the table of p50s and writes JSON.

    python3 bench/breakdown.py --backend cuda --sizes 256x128:float32,1Mx768:float16 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kalos.broker.layout import Metric
from kalos.clients import RecallClient
from kalos.testing.loadgen import environment
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

STAGES = ["sidecar wait", "sidecar serve", "client"]


def parse_size(s: str) -> tuple[int, int, str]:
    shape, _, dtype = s.partition(":")
    rows, dim = shape.lower().split("x")
    mult = {"k": 1000, "m": 1000_000}.get(rows[-1], 1)
    return int(float(rows.rstrip("km")) * mult), int(dim), dtype or "float32"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stage_quantiles(port: int) -> dict[tuple[str, str], float]:
    """The sidecar's stage quantiles in microseconds, by (stage, quantile), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kalos_stage_latency_window_seconds":  # a summary: quantiles, _count, _sum
            for s in fam.samples:
                if "quantile" in s.labels:
                    out[(s.labels["stage"], s.labels["quantile"])] = s.value * 1e6
    return out


def lone_recalls(name: str, dim: int, k: int, n: int, warm: int, seed: int) -> tuple[np.ndarray, str]:
    """End-to-end ns of ``n`` recalls made one after another (after ``warm`` more), and the
    client's slot path (``KALOS_PURE_PYTHON=1`` in the environment: the Python one)."""
    rng = np.random.default_rng(seed)
    qs = rng.standard_normal((n + warm, dim), dtype=np.float32)
    e2e = np.zeros(n, np.int64)
    with RecallClient(name) as c:
        path = c.slot_path
        for i in range(n + warm):
            t0 = time.perf_counter_ns()
            hits = c.recall(qs[i], k=k)
            t1 = time.perf_counter_ns()
            assert len(hits) == k
            if i >= warm:
                e2e[i - warm] = t1 - t0
    return e2e, path


def inprocess(
    backend: str, rows: int, dim: int, dtype: str, k: int, seed: int, reps: int, host_work: int | None = None
) -> dict[str, Any]:
    """The backend's search of one query in this process: wall and GPU time (p50, us), and the
    path the CUDA backend took."""
    be: Any
    if backend != "cuda":
        from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend

        be = NumpyBackend()
    else:
        from kalos.sidecar_cuda.backends.cuda import CupyBackend

        be = (
            CupyBackend(storage_dtype=dtype)
            if host_work is None
            else CupyBackend(storage_dtype=dtype, host_work=host_work)
        )
    rng = np.random.default_rng(seed)
    m = be.new_matrix(dim, rows, Metric.DOT)
    chunk = 1 << 17
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        m.write_rows(np.arange(r0, r1), rng.standard_normal((r1 - r0, dim), dtype=np.float32))
    q = rng.standard_normal((reps + 10, 1, dim), dtype=np.float32)
    wall, gpu = [], []
    ev = None
    if backend == "cuda":
        import cupy as cp

        ev = (cp.cuda.Event(), cp.cuda.Event())
        be.stats.clear()
    for i in range(reps + 10):
        t0 = time.perf_counter_ns()
        if ev is not None:
            ev[0].record(be.stream)
        m.search(q[i], rows, k)
        if ev is not None:
            ev[1].record(be.stream)
            ev[1].synchronize()
        t1 = time.perf_counter_ns()
        if i >= 10:
            wall.append(t1 - t0)
            if ev is not None:
                gpu.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e6)
    res: dict[str, Any] = {"search wall": float(np.median(wall)) / 1e3}
    paths = sorted(p.value for p, _bucket in be.stats.by_path) if backend == "cuda" else []
    if paths:
        res["path"] = ",".join(paths)
    if gpu and paths != ["host"]:
        res["GPU time (events)"] = float(np.median(gpu)) / 1e3
    be.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--sizes", default="256x128:float32")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("-n", type=int, default=3000, help="recalls measured (after 300 of warm-up)")
    ap.add_argument("--reps", type=int, default=300, help="in-process searches")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sidecar-args", default="")
    ap.add_argument(
        "--host-search-work",
        type=int,
        default=None,
        help="cuda: the sidecar's and the in-process backend's --host-search-work (default: theirs; 0: always the GPU)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = []
    for size in a.sizes.split(","):
        rows, dim, dtype = parse_size(size)
        name = f"kbd{os.getpid()}x{rows}"
        port = free_port()
        args = [
            "--dim",
            str(dim),
            "--backend",
            a.backend,
            "--dtype",
            dtype,
            "--ephemeral",
            "--random-rows",
            str(rows),
            "--seed",
            str(a.seed),
            "--metrics-port",
            str(port),
            *a.sidecar_args.split(),
        ]
        if a.host_search_work is not None:
            args += ["--host-search-work", str(a.host_search_work)]
        proc = start_sidecar_process(args, name, timeout=600)
        try:
            e2e, slot_path = lone_recalls(name, dim, a.k, a.n, 300, a.seed + 1)
            time.sleep(1.5)  # (the sidecar's harvest thread moves the last records into its windows)
            sq = stage_quantiles(port)
        finally:
            stop_sidecar_process(proc)
        ip = inprocess(a.backend, rows, dim, dtype, a.k, a.seed, a.reps, a.host_search_work)
        p50: dict[str, float] = {"end to end": float(np.median(e2e)) / 1e3}
        p99: dict[str, float] = {"end to end": float(np.percentile(e2e, 99)) / 1e3}
        for out, q in ((p50, "0.5"), (p99, "0.99")):
            out["sidecar wait"] = sq.get(("queue_wait", q), float("nan"))
            out["sidecar serve"] = sq.get(("service", q), float("nan")) - out["sidecar wait"]
            out["client"] = out["end to end"] - out["sidecar serve"] - out["sidecar wait"]
        serve = p50["sidecar serve"]
        if "GPU time (events)" in ip:
            split = {
                "kernel (GPU time)": ip["GPU time (events)"],
                "launch + sync (backend wall - GPU)": ip["search wall"] - ip["GPU time (events)"],
                "sidecar Python (serve - backend wall)": serve - ip["search wall"],
            }
        else:  # numpy, or the CUDA backend's host path
            split = {
                "search (in-process wall)": ip["search wall"],
                "sidecar Python (serve - search)": serve - ip["search wall"],
            }
        print(f"\n{rows}x{dim} {dtype} backend={a.backend} k={a.k}: {a.n} lone recalls, {slot_path} slot path")
        print(f"  {'stage':40s} {'p50 us':>9s} {'p99 us':>9s}")
        for s in STAGES:
            print(f"  {s:40s} {p50[s]:9.1f} {p99[s]:9.1f}")
            if s == "sidecar serve":
                for name2, v in split.items():
                    print(f"    {name2:38s} {v:9.1f}")
        print(f"  {'end to end (measured)':40s} {p50['end to end']:9.1f} {p99['end to end']:9.1f}")
        print(
            "  in-process search: "
            + ", ".join(f"{kk} {v:.1f} us" if isinstance(v, float) else f"{kk} {v}" for kk, v in ip.items())
        )
        results.append(
            {
                "size": size,
                "rows": rows,
                "dim": dim,
                "dtype": dtype,
                "k": a.k,
                "n": a.n,
                "slot_path": slot_path,
                "p50_us": p50,
                "p99_us": p99,
                "serve_split_us": split,
                "inprocess_us": ip,
            }
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "environment": environment(), "backend": a.backend, "results": results},
                f,
                indent=1,
            )
        print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
