#!/usr/bin/env python3
"""The CUDA backend's wgmma path against its GEMM paths, through the backend (issue 14 item 1).

One matrix of --rows x --dim float16 rows (fresh random data, written through ``write_rows``),
k = --k, per batch size: the wgmma path and the float32-score ("gemm") and half-score ("gemmh")
paths forced, interleaved rep by rep. GPU ms = CUDA events on the backend's stream around the
enqueued search (query H2D, kernels; not the host's read of the answer nor a redo), median of
--reps; wall ms = ``search`` as the sidecar calls it (staging, launches, wait, answer, redo),
median. Every answer is checked against float64 scores of the stored rows (on the GPU): "wrong"
= a returned row whose float64 score is below the true k-th by more than 2^-20 |q| max|x| (float32
level), "wrong_loose" by more than 3 * 2^-11 |q| max|x| (the GPU tests' float16 tolerance).

Run from the repository root:  python3 bench/probe_wgmma_path.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe_wgmma_path.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kalos.cuda").setLevel(logging.DEBUG)

    import cupy as cp

    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    n, d, k, reps = a.rows, a.dim, a.k, a.reps
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    be = CupyBackend(storage_dtype="float16", host_work=0)
    res: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]), "rows": n, "dim": d, "k": k, "reps": reps,
        "seed": seed, "backend": be.description, "start_s": round(time.perf_counter() - t0, 3),
        "compile_s": round(be._wg.compile_s, 3) if be._wg else None,
        "wgmma_built": be._wg is not None,
        "versions": {"cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                     "cuda_driver": cp.cuda.runtime.driverGetVersion()},
    }
    try:
        res["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:
        res["nvidia_smi"] = f"failed: {e}"
    print(json.dumps(res), flush=True)
    if be._wg is None:
        print("the wgmma path is not built: nothing to measure", flush=True)
        json.dump(res, open(a.out, "w"), indent=1)
        return 1

    m = be.new_matrix(d, n, Metric.DOT)
    chunk = 1 << 17
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m.write_rows(np.arange(lo, hi), rng.standard_normal((hi - lo, d), dtype=np.float32))
    be._stream.synchronize()
    res["fill_s"] = round(time.perf_counter() - t0, 3)
    xs = m.data[:n, :d].view(cp.float16)  # the rows as stored
    xmax = float(cp.sqrt((xs.astype(cp.float32) ** 2).sum(axis=1)).max())

    def wrong(q: np.ndarray, rows: np.ndarray) -> tuple[int, int]:
        q64 = cp.asarray(q, cp.float64)
        ref = cp.empty((len(q), n), cp.float64)
        for lo in range(0, n, chunk):
            ref[:, lo:lo + chunk] = q64 @ xs[lo:lo + chunk].astype(cp.float64).T
        kth = -cp.partition(-ref, k - 1, axis=1)[:, k - 1]
        got = cp.take_along_axis(ref, cp.asarray(rows), axis=1)
        scale = cp.linalg.norm(q64, axis=1) * xmax
        strict = int(((got < (kth - 2.0**-20 * scale)[:, None]).any(axis=1)).sum())
        loose = int(((got < (kth - 3 * 2.0**-11 * scale)[:, None]).any(axis=1)).sum())
        return strict, loose

    s = be._stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    rows_out = []
    for b in [int(x) for x in a.batches.split(",")]:
        q = rng.standard_normal((b, d), dtype=np.float32)
        paths = ["wgmma", "gemm", "gemmh"]
        row: dict[str, Any] = {"b": b, "planner": be._plan(b, n, k, m)[0]}
        gpu: dict[str, list[float]] = {p: [] for p in paths}
        wall: dict[str, list[float]] = {p: [] for p in paths}
        fb0 = be.wgmma_fallbacks
        for p in paths:  # warm-up (and the first compile of a query tile the warm-up lacks)
            for _ in range(3):
                be.search(m, q, n, k, path=p)
        for _ in range(reps):
            for p in paths:
                e0.record(s)
                fut = be.search_async(m, q, n, k, path=p)
                e1.record(s)
                fut.result()
                e1.synchronize()
                gpu[p].append(cp.cuda.get_elapsed_time(e0, e1))
                be._stream.synchronize()
                t = time.perf_counter()
                be.search(m, q, n, k, path=p)
                wall[p].append((time.perf_counter() - t) * 1e3)
        for p in paths:
            rows, _scores = be.search(m, q, n, k, path=p)
            st, lo = wrong(q, rows)
            row[p] = {"gpu_ms": round(float(np.median(gpu[p])), 4),
                      "gpu_ms_min": round(float(np.min(gpu[p])), 4),
                      "wall_ms": round(float(np.median(wall[p])), 4),
                      "wrong": st, "wrong_loose": lo}
        row["wgmma_fallbacks"] = be.wgmma_fallbacks - fb0
        best = min(("gemm", "gemmh"), key=lambda p: row[p]["gpu_ms"])
        row["best_gemm"] = best
        row["wgmma_over_best_gemm_gpu"] = round(row["wgmma"]["gpu_ms"] / row[best]["gpu_ms"], 3)
        row["wgmma_over_best_gemm_wall"] = round(row["wgmma"]["wall_ms"] / row[best]["wall_ms"], 3)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    res["batches"] = rows_out
    res["stats"] = be.stats_line()
    be.close()
    print("\n| b | planner | wgmma GPU ms | gemm GPU ms | gemmh GPU ms | wgmma / best | wgmma wall | "
          "best wall | wall ratio | wrong (w/g/h) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        bw = r[r["best_gemm"]]
        print(f"| {r['b']} | {r['planner']} | {r['wgmma']['gpu_ms']:.3f} | {r['gemm']['gpu_ms']:.3f} | "
              f"{r['gemmh']['gpu_ms']:.3f} | {r['wgmma_over_best_gemm_gpu']:.2f} | "
              f"{r['wgmma']['wall_ms']:.3f} | {bw['wall_ms']:.3f} | {r['wgmma_over_best_gemm_wall']:.2f} | "
              f"{r['wgmma']['wrong']}/{r['gemm']['wrong']}/{r['gemmh']['wrong']} |")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
