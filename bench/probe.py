#!/usr/bin/env python3
"""In-process probes of the search backends (no broker), on their public entry points.

``paths``: the CUDA backend's paths forced one by one (``Matrix.search(path=...)``) beside the
planner's choice, per number of rows and batch size, interleaved rep by rep. GPU ms = CUDA events
on the backend's stream around the enqueued search (query copy, kernels; not the read of the
answer nor a redo), median of --reps; wall ms = ``search`` as the sidecar calls it (staging,
launches, wait, answer, redo), median. With --check every answer is compared with float64 scores
of the stored rows (on the GPU): "wrong" counts queries with a returned row whose float64 score is
below the true k-th by more than 2^-20 |q| max|x| (float32 level), "wrong_loose" by more than
3 * 2^-11 |q| max|x| (the GPU tests' float16 tolerance). A path that cannot serve a shape is
left out of its row.

    python3 bench/probe.py paths --rows 1000000,2097152 --batches 2,16,32 --paths auto,wgmma,gemm,gemmh
    python3 bench/probe.py paths --dtype float32 --rows 256,4096 --dim 128 --batches 1,4,16 --paths auto,host,small

``search``: the planner's choice only, wall time of ``search`` (median and the best of --runs
blocks), through the Backend interface alone, so that it runs against any checkout (``--tree``):
an A/B of two checkouts alternates ``--trees A,B`` in separate processes.

    python3 bench/probe.py search --shapes 1000000x768:float16:1,16,64,256 256x128:float32:1 \\
        --trees /tmp/old,. --rounds 2 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fill(cp: Any, m: Any, n: int, d: int, seed: int) -> None:
    """Rows [0, n) of fresh random float32 values, drawn on the GPU, written through write_rows."""
    gen = cp.random.default_rng(seed)
    chunk = 1 << 17
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m.write_rows(np.arange(lo, hi), cp.asnumpy(gen.standard_normal((hi - lo, d), dtype=cp.float32)))


# ---------------------------------------------------------------------------------------- paths
def probe_paths(a: argparse.Namespace) -> int:
    sys.path.insert(0, ROOT)
    import cupy as cp

    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.cuda import CupyBackend, SearchPath

    names = [p.strip() for p in a.paths.split(",")]
    paths: dict[str, SearchPath | None] = {p: (None if p == "auto" else SearchPath(p)) for p in names}
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    be = CupyBackend(storage_dtype=a.dtype, host_work=a.host_work)
    res: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "dim": a.dim,
        "k": a.k,
        "dtype": a.dtype,
        "reps": a.reps,
        "seed": seed,
        "backend": be.description,
        "wgmma_built": be.wgmma_built,
        "cupy": cp.__version__,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    s = be.stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    k = a.k
    for n in (int(x) for x in a.rows.split(",")):
        m = be.new_matrix(a.dim, n, Metric.DOT)
        fill(cp, m, n, a.dim, seed + n)
        for b in (int(x) for x in a.batches.split(",")):
            q = rng.standard_normal((b, a.dim), dtype=np.float32)
            row: dict[str, Any] = {"rows": n, "b": b, "planner": m.plan(b, n, k).path.value}
            ok = {}
            for name, path in paths.items():
                try:
                    for _ in range(3):  # warm-up (and the first build of a wgmma query tile)
                        m.search(q, n, k, path=path)
                    ok[name] = path
                except ValueError as e:
                    row[name] = {"refused": str(e)}
            gpu: dict[str, list[float]] = {p: [] for p in ok}
            wall: dict[str, list[float]] = {p: [] for p in ok}
            for _ in range(a.reps):
                for name, path in ok.items():
                    e0.record(s)
                    pending = m.search_start(q, n, k, path=path)
                    e1.record(s)
                    pending.result()
                    e1.synchronize()
                    gpu[name].append(cp.cuda.get_elapsed_time(e0, e1))
                    t = time.perf_counter()
                    m.search(q, n, k, path=path)
                    wall[name].append((time.perf_counter() - t) * 1e3)
            truth = reference(cp, m, q, n, k) if a.check else None
            for name, path in ok.items():
                row[name] = {
                    "gpu_ms": round(float(np.median(gpu[name])), 4),
                    "wall_ms": round(float(np.median(wall[name])), 4),
                }
                if truth is not None:
                    rows, _scores = m.search(q, n, k, path=path)
                    row[name]["wrong"], row[name]["wrong_loose"] = wrong(cp, truth, rows)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["stats"] = be.stats_line()
    be.close()
    print("\n| rows | b | planner | " + " | ".join(f"{p} GPU ms | {p} wall ms" for p in paths) + " |")
    print("|---|---|---|" + "---|---|" * len(paths))
    for r in res["rows"]:
        cells = [f"{r[p]['gpu_ms']:.3f} | {r[p]['wall_ms']:.3f}" if "gpu_ms" in r[p] else "- | -" for p in paths]
        print(f"| {r['rows']} | {r['b']} | {r['planner']} | " + " | ".join(cells) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def reference(cp: Any, m: Any, q: np.ndarray, n: int, k: int) -> tuple[Any, Any, Any]:
    """The float64 scores of q against rows [0, n) (read back once per batch, for every path's
    check), the true k-th score per query and the queries' score scale |q| * max |x|."""
    chunk = 1 << 17
    q64 = cp.asarray(q, cp.float64)
    ref = cp.empty((len(q), n), cp.float64)
    xmax = 0.0
    for lo in range(0, n, chunk):
        x = cp.asarray(m.read_rows(np.arange(lo, min(n, lo + chunk))), cp.float64)
        ref[:, lo : lo + len(x)] = q64 @ x.T
        xmax = max(xmax, float(cp.sqrt((x * x).sum(axis=1)).max()))
    kk = min(k, n)
    kth = -cp.partition(-ref, kk - 1, axis=1)[:, kk - 1]
    return ref, kth, cp.linalg.norm(q64, axis=1) * xmax


def wrong(cp: Any, truth: tuple[Any, Any, Any], rows: np.ndarray) -> tuple[int, int]:
    """Queries with a returned row below the true k-th float64 score by more than float32-level
    and float16-level tolerances (see the module docstring); ``truth`` from reference()."""
    ref, kth, scale = truth
    got = cp.take_along_axis(ref, cp.asarray(rows), axis=1)
    strict = int(((got < (kth - 2.0**-20 * scale)[:, None]).any(axis=1)).sum())
    loose = int(((got < (kth - 3 * 2.0**-11 * scale)[:, None]).any(axis=1)).sum())
    return strict, loose


# --------------------------------------------------------------------------------------- search
def parse_shape(text: str) -> tuple[int, int, str, list[int]]:
    """``ROWSxDIM:DTYPE:B1,B2`` (rows with k/M suffixes) -> (rows, dim, dtype, batches)."""
    shape, dtype, batches = text.split(":")
    rows, dim = shape.lower().split("x")
    mult = {"k": 1000, "m": 1000_000}.get(rows[-1], 1)
    return int(float(rows.rstrip("km")) * mult), int(dim), dtype, [int(b) for b in batches.split(",")]


def search_once(a: argparse.Namespace) -> dict[str, Any]:
    """The planner's search in this process, on the checkout ``a.tree``: medians in us."""
    sys.path.insert(0, os.path.abspath(a.tree))
    import cupy as cp

    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    out: dict[str, Any] = {}
    for text in a.shapes:
        n, d, dtype, batches = parse_shape(text)
        be = CupyBackend(storage_dtype=dtype)
        m = be.new_matrix(d, n, Metric.DOT)
        fill(cp, m, n, d, a.seed)
        rng = np.random.default_rng(a.seed + 1)
        for b in batches:
            q = rng.standard_normal((b, d), dtype=np.float32)
            for _ in range(20):
                m.search(q, n, a.k)
            reps = max(20, min(a.reps, int(a.budget_s / max(1e-6, timed_once(m, q, n, a.k)))))
            block = max(1, reps // a.blocks)
            ts: list[float] = []
            means: list[float] = []
            for _ in range(a.blocks):
                chunk = [timed_once(m, q, n, a.k) for _ in range(block)]
                ts += chunk
                means.append(statistics.fmean(chunk))
            out[f"{n}x{d}:{dtype} b={b}"] = {
                "p50_us": round(statistics.median(ts) * 1e6, 2),
                "best_block_mean_us": round(min(means) * 1e6, 2),
                "reps": len(ts),
            }
        be.close()
        cp.get_default_memory_pool().free_all_blocks()
    return out


def timed_once(m: Any, q: np.ndarray, n: int, k: int) -> float:
    t = time.perf_counter()
    m.search(q, n, k)
    return time.perf_counter() - t


def probe_search(a: argparse.Namespace) -> int:
    if not a.trees:
        print(json.dumps(search_once(a)))
        return 0
    trees = a.trees.split(",")
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for rnd in range(a.rounds):
        for tree in trees:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "search",
                "--tree",
                tree,
                "-k",
                str(a.k),
                "--reps",
                str(a.reps),
                "--budget-s",
                str(a.budget_s),
                "--blocks",
                str(a.blocks),
                "--seed",
                str(a.seed),
                "--shapes",
                *a.shapes,
            ]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode or not lines:
                print(f"{tree} round {rnd} failed ({done.returncode}): {done.stderr[-2000:]}", flush=True)
                return 1
            runs[tree].append(json.loads(lines[-1]))
            print(f"# round {rnd} {tree} ({time.perf_counter() - t0:.0f} s): {lines[-1]}", flush=True)
    cases = list(runs[trees[0]][0])
    print("\n| case | " + " | ".join(f"{t} p50 us" for t in trees) + " | ratio |")
    print("|---|" + "---|" * (len(trees) + 1))
    summary: dict[str, dict[str, float]] = {}
    for c in cases:
        med = {t: statistics.median(r[c]["p50_us"] for r in runs[t]) for t in trees}
        summary[c] = med
        cells = " | ".join(" / ".join(f"{r[c]['p50_us']:.1f}" for r in runs[t]) for t in trees)
        print(f"| {c} | {cells} | {med[trees[-1]] / med[trees[0]]:.3f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"command": " ".join(["python3", *sys.argv]), "trees": trees, "runs": runs, "median_p50_us": summary},
                f,
                indent=1,
            )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("paths", help="the CUDA backend's paths forced one by one, GPU and wall time")
    p.add_argument("--rows", default="1000000", help="comma list")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batches", default="16,32,64")
    p.add_argument(
        "--paths",
        default="auto,wgmma,gemm,gemmh",
        help="auto (the planner) and path labels: host, small, wgmma, gemmh, gemm",
    )
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--host-work", type=int, default=0, help="the backend's --host-search-work")
    p.add_argument("--check", action="store_true", help="answers against float64 on the GPU")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default="")
    p.set_defaults(run=probe_paths)
    s = sub.add_parser("search", help="the planner's search, wall time, any checkout (A/B)")
    s.add_argument("--shapes", nargs="+", default=["1000000x768:float16:1,16,64,256", "256x128:float32:1"])
    s.add_argument("--tree", default=ROOT, help="the checkout to import (one process)")
    s.add_argument("--trees", default="", help="comma list of checkouts: alternate them in processes")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("-k", type=int, default=10)
    s.add_argument("--reps", type=int, default=2000, help="searches per case at most")
    s.add_argument("--budget-s", type=float, default=1.5, help="seconds per case at most (roughly)")
    s.add_argument("--blocks", type=int, default=5)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--out", default="")
    s.set_defaults(run=probe_search)
    a = ap.parse_args()
    rc: int = a.run(a)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
