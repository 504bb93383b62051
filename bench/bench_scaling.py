#!/usr/bin/env python3
"""Scaling benchmark: exact top-k from 10k to 10M rows on one GPU, so a user sees where exact search
stops being the right tool. For each size: recall latency (p50/p95/p99) and throughput through the
broker (a sidecar process, client tasks in other processes) at 1 task and at 256 tasks over 8
processes; in the same run, torch in-process (one query, one query replayed as a CUDA graph, and a
batch of 256: bench_gpu.torch_baselines) and the time of one full read of the matrix at the
device's measured copy rate (the floor of any exact search). Every broker answer kept as a sample
is checked against a float64 reference over the stored rows.

    python3 bench/bench_scaling.py --out DIR/scaling.json           # 10k..10M x 768 fp16 (~3-4 min on an H200)
    python3 bench/bench_scaling.py --backend numpy --sizes 10k,100k --dim 128 --seconds 1 --procs 2

Rows: by default (``--fill npy``) the rows are drawn on the device (CuPy's generator; numpy's on the
numpy backend), written to a temporary .npy file in the storage dtype and loaded by the sidecar
with ``--load``, and the same array serves the in-process baseline and the answer check. The
sidecar's ``--random-rows`` draws its rows on the host with numpy, one 65536-row chunk after the
other (13 s per 1M x 768 on the H200 host), and the benchmark would have to draw them again for
its reference: at 10M that is two ~130 s passes, most of the time budget. ``--fill random`` does
exactly that (bench_gpu.py's way), for comparison at small sizes.

The answer check follows kalos.testing.loadgen.check_samples (by score, with its tolerance), in
float64 a chunk of rows at a time, on the GPU with CuPy (10M x 768 in float64 would be 61 GB).

Without a CUDA device (or CuPy) ``--backend cuda`` prints why and exits 0 without measuring;
``--backend numpy`` measures the CPU path instead, with numpy in-process as the baseline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_gpu import (
    RTOL,
    copy_bandwidth,
    free_port,
    gpu_environment,
    latency_sample,
    log,
    parse_size,
    scrape,
    sidecar_matrix,
    torch_baselines,
)

from kalos.demo import inproc_numpy
from kalos.testing.loadgen import LoadSpec, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

#: Dense 16-bit tensor rate measured on the H200 (PERFORMANCE.md, "Method"): with the copy rate, the
#: floor of a batch is the larger of (bytes read / copy rate) and (flops / this).
PEAK_TFLOPS = {"float16": 790.0}
KEEP = 40  # answers kept per client process for the check


class Interrupted(BaseException):
    """SIGTERM (e.g. from `timeout`): stop the sidecar and write what was measured. Not an
    Exception, so that no `except Exception` on the way (run_load's queue polling) swallows it."""


def parse_rows(s: str, dim: int) -> int:
    return parse_size(f"{s.strip()}x{dim}")[0]


def human(n: int) -> str:
    for div, suf in ((1_000_000, "M"), (1000, "k")):
        if n >= div and n % (div // 10) == 0:
            v = n / div
            return f"{v:g}{suf}"
    return str(n)


def cuda_or_reason() -> tuple[Any, str]:
    """(cupy, "") where a CUDA device is usable, else (None, why not)."""
    try:
        import cupy as cp
    except ImportError as e:
        return None, f"CuPy is not installed ({e})"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device"
    except Exception as e:  # CUDARuntimeError without a driver
        return None, f"no usable CUDA device ({type(e).__name__}: {e})"
    return cp, ""


def host_copy_bandwidth() -> float:
    """Host memory copy of 256 MiB: (bytes read + bytes written) / time, TB/s (median of 7)."""
    a = np.ones(64 * 1024**2, np.float32)
    b = np.empty_like(a)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return 2 * a.nbytes / float(np.median(ts)) / 1e12


# ---------------------------------------------------------------------------- rows
def draw_rows(xp: Any, n: int, d: int, dtype: str, seed: int) -> Any:
    """(n, d) random normal rows in the storage dtype, on the device of ``xp`` (cupy or numpy)."""
    out = xp.empty((n, d), dtype)
    step = 1 << 20
    if xp is np:
        rng = np.random.default_rng(seed)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            out[lo:hi] = rng.standard_normal((hi - lo, d), dtype=np.float32)
    else:
        rs = xp.random.RandomState(seed)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            out[lo:hi] = rs.standard_normal((hi - lo, d), dtype=np.float32).astype(dtype)
    return out


def npy_dir(nbytes: int, wanted: str | None) -> str:
    """A folder with room for a .npy of ``nbytes`` (/dev/shm, memory-backed, else the temp folder)."""
    for cand in [wanted] if wanted else ["/dev/shm", tempfile.gettempdir()]:
        try:
            if shutil.disk_usage(cand).free > nbytes * 1.1 + 2**30:
                return cand
        except OSError:
            continue
    raise SystemExit(f"no room for a {nbytes / 1e9:.1f} GB row file (give --tmp-dir)")


# ---------------------------------------------------------------------------- answer check
def check_answers(
    samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], rows: Any, k: int, rtol: float, xp: Any
) -> tuple[int, int]:
    """kalos.testing.loadgen.check_samples's rule (answers compared by their true score, with a
    tolerance of rtol x (max |score| + 1)) against the stored ``rows`` (record id = row), computed
    in float64 on the device of ``xp`` a chunk of rows at a time. Returns (checked, wrong)."""
    if not samples:
        return 0, 0
    n, d = rows.shape
    kk = min(k, n)
    q = xp.asarray(np.stack([s[0] for s in samples]).astype(np.float64))
    s_n = len(samples)
    top = xp.full((s_n, kk), -np.inf)  # the kk largest true scores so far
    amax = xp.zeros(s_n)
    chunk = max(1024, (1 << (28 if xp is np else 30)) // (8 * s_n))  # float64 scores: 256 MiB, 1 GiB on a GPU
    for lo in range(0, n, chunk):
        sc = q @ rows[lo : lo + chunk].astype(xp.float64).T
        amax = xp.maximum(amax, xp.abs(sc).max(axis=1))
        cand = xp.concatenate([top, sc], axis=1)
        top = -xp.partition(-cand, kk - 1, axis=1)[:, :kk]
    to_host = np.asarray if xp is np else xp.asnumpy
    kth = to_host(top.min(axis=1))
    tol = rtol * (to_host(amax) + 1)
    wrong = 0
    ok_shape = []
    for j, (_q, ids, _s) in enumerate(samples):
        ids = np.asarray(ids)
        if len(ids) != kk or len(set(ids.tolist())) != kk or ids.min() < 0 or ids.max() >= n:
            wrong += 1
        else:
            ok_shape.append(j)
    if ok_shape:
        sel = np.asarray(ok_shape)
        ids = xp.asarray(np.stack([np.asarray(samples[j][1], np.int64) for j in ok_shape]))
        got = rows[ids.ravel()].astype(xp.float64).reshape(len(sel), kk, d)
        true = to_host(xp.einsum("skd,sd->sk", got, q[xp.asarray(sel)]))
        t = tol[sel][:, None]
        bad = (true < kth[sel][:, None] - t).any(axis=1) | (np.diff(true, axis=1) > t).any(axis=1)
        wrong += int(bad.sum())
    return s_n, wrong


# ---------------------------------------------------------------------------- one size
def inproc_rows(
    backend: str, host: np.ndarray, dtype: str, k: int, bank: np.ndarray, reps: int, seconds: float
) -> list[dict[str, Any]]:
    """In-process baselines at this size: torch on CUDA (one query, CUDA graph, batches of 64 and
    256), numpy on the CPU (one query, a batch of 256)."""
    if backend == "cuda":
        return torch_baselines(host, dtype, k, bank, reps)
    out = []
    for b in (1, 256):
        p, tput = inproc_numpy(host, k, seconds=max(0.5, seconds / 2), batch=b)
        out.append(
            {
                "what": "numpy_single" if b == 1 else f"numpy_batch{b}",
                **{kk: round(v, 2) for kk, v in p.items()},
                "recalls_per_s": round(tput),
            }
        )
    return out


def broker_rows(
    a: argparse.Namespace, n: int, fill_args: list[str], base: dict[str, Any], floor_us: float, seed: int
) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """One sidecar for this size; a load run per --tasks. Returns (rows, kept answers per row)."""
    tasks_list = [int(t) for t in a.tasks.split(",")]
    name = f"bscale{os.getpid()}x{n}"
    port = free_port()
    t0 = time.perf_counter()
    args = [
        "--ephemeral",
        "--backend",
        a.backend,
        "--dtype",
        a.dtype,
        "--dim",
        str(a.dim),
        *fill_args,
        "--slots",
        str(max(64, max(tasks_list) + 16)),
        "--max-k",
        "64",
        "--max-queries",
        "4",
        "--metrics-port",
        str(port),
        *(["--device", "0"] if a.backend == "cuda" else []),
        *a.sidecar_args.split(),
    ]
    proc = start_sidecar_process(args, name, timeout=900)
    ready_s = time.perf_counter() - t0
    log(f"# sidecar ready in {ready_s:.1f} s")
    rows: list[dict[str, Any]] = [{**base, "what": "sidecar_start", "ready_s": round(ready_s, 1)}]
    kept: list[list[Any]] = [[]]
    try:
        for tasks in tasks_list:
            procs = 1 if tasks == 1 else min(a.procs, tasks)
            before = scrape(port)
            res = run_load(
                LoadSpec(
                    name=name,
                    dim=a.dim,
                    procs=procs,
                    tasks=tasks,
                    duration_s=a.seconds,
                    warmup_s=0.5,
                    k=a.k,
                    seed=seed,
                    loop=a.loop,
                    keep=KEEP,
                )
            )
            after = scrape(port)
            p = res.percentiles_us()
            row = {
                **base,
                "what": "broker",
                "tasks": tasks,
                "procs": procs,
                **{kk: round(v, 1) for kk, v in p.items()},
                "p50_over_floor": round(p["p50_us"] / floor_us, 2) if floor_us else None,
                "recalls_per_s": round(res.throughput),
                "count": res.count,
                "errors": res.errors,
            }
            delta = {kk: after.get(kk, 0.0) - before.get(kk, 0.0) for kk in after}
            nb = delta.get("kalos_batch_compute_seconds_count", 0.0)
            if nb:
                row["mean_batch_size"] = round(
                    delta.get("kalos_batch_size_sum", 0.0) / max(1.0, delta.get("kalos_batch_size_count", nb)), 1
                )
                row["sidecar_compute_us_per_batch"] = round(delta["kalos_batch_compute_seconds_sum"] / nb * 1e6, 1)
            row["lat_sample_us"] = latency_sample(res.latencies_ns)
            rows.append(row)
            kept.append(res.samples)
            log(
                f"{human(n):>6} x{a.dim} {a.dtype:8} tasks={tasks:<3} procs={procs} p50={p['p50_us']:9.1f}us "
                f"p95={p['p95_us']:9.1f} p99={p['p99_us']:9.1f} {res.throughput:10,.0f}/s "
                f"batch~{row.get('mean_batch_size')} errors {res.errors}"
            )
    finally:
        stop_sidecar_process(proc)
    return rows, kept


def run_size(a: argparse.Namespace, xp: Any, n: int, seed: int, bw_tbps: float) -> list[dict[str, Any]]:
    d, dtype = a.dim, a.dtype
    itemsize = np.dtype(dtype).itemsize
    nbytes = n * d * itemsize
    floor_us = nbytes / (bw_tbps * 1e12) * 1e6
    base = {"n": n, "dim": d, "dtype": dtype, "k": a.k, "floor_us": round(floor_us, 2)}
    peak = PEAK_TFLOPS.get(dtype) if a.backend == "cuda" else None
    if peak:  # a batch of 256 reads the rows once and does 2 * 256 * n * d flops
        t_b = max(nbytes / (bw_tbps * 1e12), 2 * 256 * n * d / (peak * 1e12))
        base["bound_batch256_per_s"] = round(256 / t_b)
    reps = a.reps if n < 500_000 else max(100, a.reps // 3) if n < 5_000_000 else max(50, a.reps // 10)
    bank = np.random.default_rng(seed + 1).standard_normal((1024, d), dtype=np.float32)
    out: list[dict[str, Any]] = []

    t0 = time.perf_counter()
    path = None
    if a.fill == "random":
        host = sidecar_matrix(n, d, seed)  # what --random-rows draws, float32
        dev = xp.asarray(host).astype(dtype) if xp is not np else host
        fill_args = ["--random-rows", str(n), "--seed", str(seed)]
    else:
        dev = draw_rows(xp, n, d, dtype, seed)
        host = dev if xp is np else dev.get()
        fd, path = tempfile.mkstemp(suffix=".npy", prefix="kalos-scale-", dir=npy_dir(nbytes, a.tmp_dir))
        with os.fdopen(fd, "wb") as f:
            np.save(f, host)
        fill_args = ["--load", path]
    gen_s = time.perf_counter() - t0
    log(
        f"# {human(n)} x {d} {dtype}: {nbytes / 1e9:.2f} GB, rows ready in {gen_s:.1f} s ({a.fill}); "
        f"one full read {floor_us:.1f} us"
    )
    out.append({**base, "what": "rows", "fill": a.fill, "bytes": nbytes, "seconds": round(gen_s, 1)})
    try:
        if not a.skip_inproc:
            try:
                for r in inproc_rows(a.backend, host, dtype, a.k, bank, reps, a.seconds):
                    row = {**base, **r}
                    if "p50_us" in r and floor_us:
                        row["p50_over_floor"] = round(r["p50_us"] / floor_us, 2)
                    out.append(row)
                    log("inproc", json.dumps(row))
            except Exception as e:  # a baseline that fails is reported, not fatal
                log(f"# in-process baseline failed: {type(e).__name__}: {e}")
                out.append({**base, "what": "inproc_error", "error": f"{type(e).__name__}: {e}"})
        del host
        rows, kept = broker_rows(a, n, fill_args, base, floor_us, seed)
    finally:
        if path:
            os.unlink(path)
    t0 = time.perf_counter()
    for row, samples in zip(rows, kept):
        if row["what"] == "broker":
            row["checked"], row["wrong"] = check_answers(samples, dev, a.k, RTOL[dtype], xp)
    log(
        f"# checked against float64 in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{r['tasks']} tasks {r['wrong']}/{r['checked']} wrong" for r in rows if r["what"] == "broker")
    )
    del dev
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    return out + rows


# ---------------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]]) -> str:
    by_n: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        key = r["what"] if r["what"] != "broker" else f"broker{r['tasks']}"
        by_n.setdefault(r["n"], {})[key] = r

    def f(r: dict[str, Any] | None, key: str, fmt: str = "{:,.1f}") -> str:
        return fmt.format(r[key]) if r and r.get(key) is not None else "-"

    head = (
        "rows",
        "one read",
        "1 task p50 us",
        "p95",
        "p99",
        "x read",
        "in-proc 1q p50",
        "256 tasks /s",
        "p99 us",
        "in-proc b256 /s",
        "bound b256 /s",
        "wrong/checked",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for n in sorted(by_n):
        g = by_n[n]
        b1 = next((v for kk, v in g.items() if kk == "broker1"), None)
        bmax = max(
            (v for kk, v in g.items() if kk.startswith("broker") and kk != "broker1"),
            key=lambda v: v["tasks"],
            default=None,
        )
        one = g.get("torch_graph_single") or g.get("numpy_single")
        b256 = g.get("torch_batch256") or g.get("numpy_batch256")
        anyr = next(iter(g.values()))
        wrong = [(v.get("wrong"), v.get("checked")) for kk, v in g.items() if kk.startswith("broker")]
        lines.append(
            " | ".join(
                [
                    human(n),
                    f"{anyr['floor_us']:,.1f} us",
                    f(b1, "p50_us"),
                    f(b1, "p95_us"),
                    f(b1, "p99_us"),
                    f(b1, "p50_over_floor", "{:.2f}x"),
                    f(one, "p50_us"),
                    f(bmax, "recalls_per_s", "{:,.0f}"),
                    f(bmax, "p99_us"),
                    f(b256, "recalls_per_s", "{:,.0f}"),
                    f(anyr, "bound_batch256_per_s", "{:,.0f}"),
                    ", ".join(f"{w}/{c}" for w, c in wrong),
                ]
            )
        )
    lines.append(
        "(in-proc: torch + CUDA graph for one query and torch for a batch of 256 on CUDA, numpy on the "
        "numpy backend; bound: one read of the rows or 2*256*n*d flops at the tensor peak, the larger)"
    )
    return "\n".join(lines)


def write(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10k,100k,1M,10M", help="row counts (k, M suffixes)")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "float32"],
        help="storage dtype (the numpy backend stores float32 only)",
    )
    ap.add_argument("--backend", default="cuda", choices=["cuda", "numpy"])
    ap.add_argument("--tasks", default="1,256", help="concurrent client tasks in total")
    ap.add_argument("--procs", type=int, default=8, help="client processes for more than one task")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per broker run")
    ap.add_argument("--reps", type=int, default=1000, help="in-process repetitions (fewer from 500k rows)")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument(
        "--fill",
        default="npy",
        choices=["npy", "random"],
        help="npy: rows drawn on the device, loaded by the sidecar from a .npy (default); "
        "random: the sidecar's --random-rows, drawn again here on the host (slow at 10M)",
    )
    ap.add_argument("--tmp-dir", default=None, help="folder for the .npy of --fill npy (default: /dev/shm, else temp)")
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--sidecar-args", default="", help="extra sidecar arguments, e.g. '--pipeline off'")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/scaling-BACKEND-DATE.json)")
    a = ap.parse_args()

    if a.backend == "cuda":
        xp, why = cuda_or_reason()
        if xp is None:
            log(
                f"# skipped: {why}. This benchmark measures a CUDA GPU; "
                f"`--backend numpy` runs the CPU path at small sizes."
            )
            return 0
    else:
        xp = np
        if a.dtype != "float32":
            log("# the numpy backend stores float32: --dtype float32")
            a.dtype = "float32"
    sizes = [parse_rows(s, a.dim) for s in a.sizes.split(",")]
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"# seed {seed}")
    env = gpu_environment(xp) if xp is not np else environment()
    env["backend"] = a.backend
    if xp is not np:
        bw = copy_bandwidth(xp)
    else:
        bw = host_copy_bandwidth()
    log(
        f"# {env.get('gpu', env.get('cpu', 'host'))}: copy {bw:.3f} TB/s (read + write); "
        f"one full read of n x {a.dim} {a.dtype} takes n x {a.dim * np.dtype(a.dtype).itemsize} B at that rate"
    )
    path = a.out or os.path.join(HERE, "results", f"scaling-{a.backend}-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "scaling",
        "command": " ".join(["python3", *sys.argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "seed": seed,
        "env": env,
        "copy_TBps": round(bw, 3),
        "fill": a.fill,
        "rows": [],
    }

    def on_term(signum: int, _frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    status = 0
    try:
        for n in sizes:
            doc["rows"] += run_size(a, xp, n, seed, bw)
            write(path, doc)  # after every size: a run cut short keeps what it measured
    except (Interrupted, KeyboardInterrupt) as e:
        log(f"# interrupted ({e}): writing what was measured")
        doc["interrupted"] = True
        status = 2
    except Exception as e:  # e.g. load workers killed with us: keep the sizes already measured
        log(f"# failed: {type(e).__name__}: {e}")
        doc["error"] = f"{type(e).__name__}: {e}"
        status = 1
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write(path, doc)
    log("")
    log(table(doc["rows"]))
    log(f"# wrote {path} ({doc['elapsed_s']} s)")
    bad = [r for r in doc["rows"] if r.get("wrong") or r.get("errors")]
    return status or (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
