"""Crossover of the CUDA backend's host path: in-process wall of path=host vs the GPU planner.

Run on a GPU machine from the repository root (writes $OUT/<name>.json, or ./ without OUT).
Results: bench/results/h200-2026-12-01e/ and bench/results/README.md."""
import json, os, time
import numpy as np
from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.cuda.backend import CupyBackend

def wall(fn, reps):
    t = []
    for i in range(reps + 20):
        t0 = time.perf_counter_ns(); fn(); t1 = time.perf_counter_ns()
        if i >= 20: t.append(t1 - t0)
    return round(float(np.median(t)) / 1e3, 2)

rng = np.random.default_rng(3)
out = []
for dt in ("float32", "float16"):
    be = CupyBackend(storage_dtype=dt, host_work=0)
    for d in (128, 384, 768):
        for n in (64, 256, 512, 1024, 2048, 4096, 8192):
            m = be.new_matrix(d, n, Metric.DOT)
            m.write_rows(np.arange(n), rng.standard_normal((n, d), dtype=np.float32))
            for b in (1, 4, 16):
                q = rng.standard_normal((b, d), dtype=np.float32)
                be.search(m, q, n, 10, path="host")
                h = wall(lambda: be.search(m, q, n, 10, path="host"), 200)
                g = wall(lambda: be.search(m, q, n, 10), 200)
                row = {"dtype": dt, "n": n, "d": d, "b": b, "work": b * n * m.dpad, "host_us": h, "gpu_us": g,
                       "gpu_path": be._plan(b, n, 10, m)[0]}
                out.append(row)
                print(f"{dt:8s} n={n:5d} d={d:4d} b={b:3d} work={row['work']:9d} host {h:8.1f} gpu {g:8.1f} ({row['gpu_path']}) {'HOST' if h < g else ''}")
    be.close()
json.dump({"command": "python3 bench/probe_host_path.py", "rows": out}, open(os.environ.get("OUT", ".") + "/probe-host-path.json", "w"), indent=1)
