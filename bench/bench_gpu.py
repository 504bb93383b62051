#!/usr/bin/env python3
"""GPU benchmark: recall through the whole broker (a CUDA sidecar process, client tasks in other
processes, shared memory) side by side, in one run, with in-process baselines at the same sizes:
torch (H2D + matmul + topk + D2H, and a CUDA-graph variant), naive CuPy (matmul + argpartition),
and this backend called in-process. Also measures the device's copy bandwidth (the floor is one
full read of the matrix at that rate), GPU time per batch by CUDA events for both search paths,
and the sidecar's own per-batch time from its /metrics endpoint. Every broker run checks a sample
of answers against numpy float64 on the regenerated matrix. Broker rows also keep 2000 quantiles of
their latencies (`lat_sample_us`) for the CDF charts of bench/charts.py.

    python bench/bench_gpu.py --out-dir DIR                # the issue's matrix (about 5 minutes)
    python bench/bench_gpu.py --sizes 256x128:float32 --seconds 1 --tasks 1
    python bench/bench_gpu.py --sizes 1Mx768:float16 --tasks 8,64,256 --skip-inproc --sidecar-args '--launch fill'

Every broker row also prints the batch-size distribution from the sidecar's ``kalos_batch_size``
histogram over the run (bench/bench_launch.py alternates ``--launch`` policies in one run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import Metric
from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

RTOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}  # check_samples: x (max |score| + 1)


def log(*a: object) -> None:
    print(*a, flush=True)


def parse_size(s: str) -> tuple[int, int, str]:
    shape, _, dtype = s.partition(":")
    n, d = shape.lower().split("x")
    mult = {"k": 1000, "m": 1_000_000}
    n_i = int(float(n[:-1]) * mult[n[-1]]) if n[-1] in mult else int(n)
    return n_i, int(d), dtype or "float32"


def sidecar_matrix(n: int, d: int, seed: int) -> np.ndarray:
    """The rows `--random-rows n --seed seed` fills the sidecar with (same generator, same chunks)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, d), np.float32)
    for lo in range(0, n, 65536):
        hi = min(n, lo + 65536)
        out[lo:hi] = rng.standard_normal((hi - lo, d), dtype=np.float32)
    return out


def pct(lat_ns: list[int] | np.ndarray) -> dict[str, float]:
    a = np.asarray(lat_ns, np.float64) / 1e3
    p = np.percentile(a, [50, 95, 99])
    return {"p50_us": round(float(p[0]), 2), "p95_us": round(float(p[1]), 2), "p99_us": round(float(p[2]), 2)}


def latency_sample(lat_ns: list[int] | np.ndarray, n: int = 2000) -> list[float]:
    """A compact stand-in for all the latencies, for CDF charts (bench/charts.py): ``n`` evenly
    spaced quantiles ((i + 0.5) / n, sorted, us, 0.1 us steps), or every latency when there are
    fewer."""
    a = np.sort(np.asarray(lat_ns, np.float64)) / 1e3
    if len(a) > n:
        a = np.quantile(a, (np.arange(n) + 0.5) / n)
    return [round(float(x), 1) for x in a]


def timed(fn: Callable[[], object], reps: int, warm: int = 20) -> dict[str, float]:
    for _ in range(warm):
        fn()
    lat = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        lat.append(time.perf_counter_ns() - t)
    return pct(lat)


def gpu_environment(cp: Any) -> dict[str, Any]:
    """Versions and device of a GPU run (JSON ``env``): environment() plus the GPU, CuPy, CUDA and
    torch (where installed)."""
    props = cp.cuda.runtime.getDeviceProperties(0)
    env = environment()
    env.update(
        {
            "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "gpu_memory_bytes": int(props["totalGlobalMem"]),
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        }
    )
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def copy_bandwidth(cp: Any) -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time, TB/s (median of 10)."""
    a = cp.empty(2 * 1024**3 // 4, cp.float32)
    a[...] = 1.0
    b = cp.empty_like(a)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(12):
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * 2 * 1024**3 / (float(np.median(ts[2:])) / 1e3) / 1e12


def scrape(port: int) -> dict[str, float]:
    """Sums and counts of the sidecar's histograms (for per-batch averages between two scrapes)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(
            r"^(kalos_(?:batch_compute_seconds|batch_size|service_seconds|queue_wait_seconds)"
            r"_(?:sum|count))(?:\{[^}]*\})? ([0-9.eE+-]+)$",
            line,
        )
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


_BATCH_BUCKET = re.compile(r'^kalos_batch_size_bucket\{le="([^"]+)"\} ([0-9.eE+-]+)$')


def scrape_batch_sizes(port: int) -> dict[float, float]:
    """The sidecar's ``kalos_batch_size`` histogram: cumulative batches by upper bound."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:
        return {}
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = _BATCH_BUCKET.match(line)
        if m:
            out[float(m.group(1))] = float(m.group(2))
    return out


_PATH_SAMPLE = re.compile(r"^kalos_backend_(searches|search_seconds)_total\{([^}]*)\} ([0-9.eE+-]+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape_paths(port: int) -> dict[str, list[float]]:
    """The backend's searches by path: ``"path/batch" -> [searches, seconds]`` (empty from a
    sidecar before kalos_backend_searches_total existed)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _PATH_SAMPLE.match(line)
        if m:
            lab = dict(_LABEL.findall(m.group(2)))
            key = f"{lab.get('path')}/{lab.get('batch')}"
            out.setdefault(key, [0.0, 0.0])[m.group(1) == "search_seconds"] = float(m.group(3))
    return out


_SLOT_PATH = re.compile(r"^kalos_slot_path_info\{([^}]*)\} ")


def scrape_slot_path(port: int) -> str:
    """The sidecar's slot path from ``kalos_slot_path_info`` ("compiled" / "python"; "unknown" from
    a sidecar that does not export it)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:
        return "unknown"
    for line in text.splitlines():
        m = _SLOT_PATH.match(line)
        if m:
            return str(dict(_LABEL.findall(m.group(1))).get("path", "unknown"))
    return "unknown"


def client_slot_path() -> str:
    """The slot path this checkout's clients take in this environment (the load processes inherit it)."""
    from kalos.broker.slotpath import choose

    return choose(os.environ, lambda: importlib.import_module("kalos.clients._cslot")).path.value


def path_mix(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Searches and mean wall time (us) by "path/batch" between two scrapes, most searches first."""
    out = {}
    for key, (n, sec) in after.items():
        n0, s0 = before.get(key, [0.0, 0.0])
        if n > n0:
            out[key] = {"searches": int(n - n0), "mean_us": round((sec - s0) / (n - n0) * 1e6, 1)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["searches"]))


def batch_distribution(before: dict[float, float], after: dict[float, float]) -> list[tuple[str, int]]:
    """Batches per size bucket between two scrapes, as ("lo-hi", count), empty buckets left out."""
    out = []
    prev_bound, prev_cum = 0.0, 0.0
    for bound in sorted(after):
        cum = after[bound] - before.get(bound, 0.0)
        n = round(cum - prev_cum)
        if n:
            lo, hi = int(prev_bound) + 1, "inf" if bound == float("inf") else str(int(bound))
            out.append((str(lo) if hi == str(lo) else f"{lo}-{hi}", n))
        prev_bound, prev_cum = bound, cum
    return out


def shown_distribution(dist: list[tuple[str, int]]) -> str:
    """``"97-128:12% 129-192:52% ..."``: each bucket's share of the batches (under 0.5 % left out)."""
    total = sum(n for _, n in dist) or 1
    return " ".join(f"{b}:{100 * n / total:.0f}%" for b, n in dist if 100 * n / total >= 0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------------------- in-process baselines
def torch_baselines(matrix: np.ndarray, dtype: str, k: int, bank: np.ndarray, reps: int) -> list[dict[str, Any]]:
    import torch

    out = []
    n, d = matrix.shape
    M = torch.from_numpy(matrix).to("cuda").to(getattr(torch, dtype))
    qh = torch.from_numpy(bank).pin_memory()
    i = [0]

    def one() -> None:
        q = qh[i[0] % len(bank)].to("cuda", non_blocking=True).to(M.dtype)  # noqa: F821 (M is deleted after the closures have run)
        i[0] += 1
        v, ix = torch.topk((M @ q).float(), min(k, n))  # noqa: F821 (M is deleted after the closures have run)
        ix.cpu(), v.cpu()

    out.append({"what": "torch_single", **timed(one, reps)})
    qs = torch.empty(d, device="cuda", dtype=M.dtype)
    qs.copy_(qh[0])
    st = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st):
        for _ in range(3):
            torch.topk((M @ qs).float(), min(k, n))
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            vg, ig = torch.topk((M @ qs).float(), min(k, n))
    oi = torch.empty(min(k, n), dtype=torch.int64).pin_memory()
    ov = torch.empty(min(k, n), dtype=torch.float32).pin_memory()

    def graph_one() -> None:
        qs.copy_(qh[i[0] % len(bank)], non_blocking=True)
        i[0] += 1
        g.replay()
        oi.copy_(ig, non_blocking=True)
        ov.copy_(vg, non_blocking=True)
        torch.cuda.synchronize()

    out.append({"what": "torch_graph_single", **timed(graph_one, reps)})
    for b in (64, 256):

        def batch() -> None:
            q = qh[:b].to("cuda", non_blocking=True).to(M.dtype)  # noqa: F821 (M is deleted after the closures have run)
            v, ix = torch.topk((q @ M.T).float(), min(k, n), dim=1)  # noqa: F821 (M is deleted after the closures have run)
            ix.cpu(), v.cpu()

        r = timed(batch, max(20, reps // 10), warm=5)
        out.append({"what": f"torch_batch{b}", **r, "recalls_per_s": round(b / r["p50_us"] * 1e6)})
    del M
    torch.cuda.empty_cache()
    return out


def cupy_naive(cp: Any, matrix: np.ndarray, dtype: str, k: int, bank: np.ndarray, reps: int) -> list[dict[str, Any]]:
    n = len(matrix)
    M = cp.asarray(matrix).astype(dtype)
    s = cp.cuda.Stream(non_blocking=True)
    i = [0]

    def one() -> None:
        with s:
            q = cp.asarray(bank[i[0] % len(bank)]).astype(M.dtype)  # noqa: F821 (M is deleted after the closures have run)
            i[0] += 1
            sc = (M @ q).astype(cp.float32)  # noqa: F821 (M is deleted after the closures have run)
            idx = cp.argpartition(-sc, k)[:k] if n > k else cp.arange(n)
            top = idx[cp.argsort(-sc[idx])]
            cp.asnumpy(top, stream=s), cp.asnumpy(sc[top], stream=s)
        s.synchronize()

    r = [{"what": "cupy_naive_single", **timed(one, reps)}]
    del M
    cp.get_default_memory_pool().free_all_blocks()
    return r


def kalos_inproc(cp: Any, matrix: np.ndarray, dtype: str, k: int, bank: np.ndarray, reps: int) -> list[dict[str, Any]]:
    """This backend called in-process: latency of Matrix.search (graphs on and off), recalls/s of
    batches, and GPU time per batch (CUDA events) on each path; also checks the answers."""
    from kalos.sidecar_cuda.backends.cuda import CupyBackend, SearchPath

    n, d = matrix.shape
    out: list[dict[str, Any]] = []
    be = CupyBackend(storage_dtype=dtype)
    try:
        m = be.new_matrix(d, n, Metric.DOT)
        for lo in range(0, n, 65536):
            m.write_rows(np.arange(lo, min(n, lo + 65536)), matrix[lo : lo + 65536])
        i = [0]
        for graphs in (True, False):
            be.device.graphs.enabled = graphs

            def one() -> None:
                m.search(bank[i[0] % len(bank)][None, :], n, k)
                i[0] += 1

            out.append({"what": f"kalos_single{'' if graphs else '_nograph'}", **timed(one, reps)})
        be.device.graphs.enabled = True
        for b in (8, 64, 256):
            qb = bank[:b]
            r = timed(lambda: m.search(qb, n, k), max(20, reps // 10), warm=5)
            out.append(
                {
                    "what": f"kalos_batch{b}",
                    **r,
                    "recalls_per_s": round(b / r["p50_us"] * 1e6),
                    "path": m.plan(b, n, k).path.value,
                }
            )
        ids, scores = m.search(bank[:64], n, k)
        samples = [(bank[j], ids[j], scores[j]) for j in range(64)]
        checked, wrong = check_samples(samples, matrix, k, rtol=RTOL[dtype])
        out.append({"what": "kalos_check", "checked": checked, "wrong": wrong})
        # GPU time per batch on each path: events around the enqueued search (not its collection).
        s = be.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        for b in (1, 4, 8, 16, 64, 256):
            qb = np.ascontiguousarray(bank[:b])
            for path in (SearchPath.FUSED, SearchPath.GEMM, SearchPath.HALF_GEMM, SearchPath.INT8):
                if path is SearchPath.FUSED and b > 64:
                    continue
                try:
                    m.search(qb, n, k, path=path)
                except ValueError:  # (a path that cannot serve this search)
                    continue
                ts = []
                for rep in range(25):
                    e0.record(s)
                    pending = m.search_start(qb, n, k, path=path)
                    e1.record(s)
                    e1.synchronize()
                    pending.result()
                    if rep >= 5:
                        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                out.append(
                    {
                        "what": "kalos_gpu_time",
                        "path": path.value,
                        "batch": b,
                        "gpu_us_median": round(float(np.median(ts)), 2),
                    }
                )
    finally:
        be.close()
        cp.get_default_memory_pool().free_all_blocks()
    return out


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256x128:float32,100kx768:float16,1Mx768:float16")
    ap.add_argument("--tasks", default="1,8,64,256", help="concurrent client tasks in total")
    ap.add_argument("--procs", type=int, default=8, help="client processes for more than one task")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=1000, help="in-process repetitions (fewer at 1M)")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--skip-broker", action="store_true", help="in-process baselines only")
    ap.add_argument("--sidecar-args", default="", help="extra sidecar arguments, e.g. '--pipeline off'")
    ap.add_argument("--coalesce", action="store_true", help="clients' pools coalesce waiting recalls")
    ap.add_argument("--out-name", default="", help="JSON file name (default gpu-h200-DATE.json)")
    a = ap.parse_args()

    import cupy as cp

    seed = int.from_bytes(os.urandom(4), "little")
    log(f"# seed {seed}")
    env = gpu_environment(cp)
    bw = copy_bandwidth(cp)
    log(f"# {env['gpu']}: copy bandwidth {bw:.3f} TB/s (read + write)")
    results: list[dict[str, Any]] = []
    tasks_list = [int(t) for t in a.tasks.split(",")]
    for size in a.sizes.split(","):
        n, d, dtype = parse_size(size)
        itemsize = 4 if dtype == "float32" else 2
        floor_us = n * d * itemsize / (bw * 1e12) * 1e6
        base = {"n": n, "dim": d, "dtype": dtype, "k": a.k, "floor_us": round(floor_us, 2)}
        t0 = time.perf_counter()
        matrix = sidecar_matrix(n, d, seed)
        bank = np.random.default_rng(seed + 1).standard_normal((1024, d), dtype=np.float32)
        log(
            f"# {n}x{d} {dtype}: matrix regenerated in {time.perf_counter() - t0:.1f} s; "
            f"floor (one read at {bw:.2f} TB/s) {floor_us:.1f} us"
        )
        reps = a.reps if n < 500_000 else max(100, a.reps // 3)
        if not a.skip_inproc:
            for fn in (torch_baselines, lambda *x: cupy_naive(cp, *x), lambda *x: kalos_inproc(cp, *x)):
                try:
                    for r in fn(matrix, dtype, a.k, bank, reps):
                        row = {**base, **r}
                        if "p50_us" in r:
                            row["p50_over_floor"] = round(r["p50_us"] / floor_us, 2)
                        results.append(row)
                        log("inproc", json.dumps(row))
                except Exception as e:  # a baseline that fails is reported, not fatal
                    log(f"# in-process baseline failed: {type(e).__name__}: {e}")
                    results.append({**base, "what": "inproc_error", "error": f"{type(e).__name__}: {e}"})
        if a.skip_broker:
            del matrix
            continue
        name = f"bgpu{os.getpid()}x{n}"
        port = free_port()
        t0 = time.perf_counter()
        proc = start_sidecar_process(
            [
                "--ephemeral",
                "--backend",
                "cuda",
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
                *a.sidecar_args.split(),
            ],
            name,
            timeout=900,
        )
        slot_paths = {"sidecar": scrape_slot_path(port), "clients": client_slot_path()}
        log(f"# sidecar ready in {time.perf_counter() - t0:.1f} s; slot path: {slot_paths}")
        try:
            for tasks in tasks_list:
                procs = 1 if tasks == 1 else min(a.procs, tasks)
                before, sizes_before, paths_before = scrape(port), scrape_batch_sizes(port), scrape_paths(port)
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
                after, dist = scrape(port), batch_distribution(sizes_before, scrape_batch_sizes(port))
                paths = path_mix(paths_before, scrape_paths(port))
                checked, wrong = check_samples(res.samples, matrix, a.k, rtol=RTOL[dtype])
                p = res.percentiles_us()
                row = {
                    **base,
                    "what": "broker",
                    "tasks": tasks,
                    "procs": procs,
                    **{kk: round(v, 1) for kk, v in p.items()},
                    "p50_over_floor": round(p["p50_us"] / floor_us, 2),
                    "recalls_per_s": round(res.throughput),
                    "count": res.count,
                    "errors": res.errors,
                    "checked": checked,
                    "wrong": wrong,
                    "lat_sample_us": latency_sample(res.latencies_ns),
                    "batch_sizes": dist,
                    "paths": paths,  # the backend's searches by path and batch bucket in this run
                    "slot_path": slot_paths,  # compiled or python, in the sidecar and in the clients
                }
                delta = {kk: after.get(kk, 0.0) - before.get(kk, 0.0) for kk in after}
                nb = delta.get("kalos_batch_compute_seconds_count", 0.0)
                if nb:
                    row["sidecar_batches"] = int(nb)
                    row["mean_batch_size"] = round(
                        delta.get("kalos_batch_size_sum", 0.0) / max(1.0, delta.get("kalos_batch_size_count", nb)), 1
                    )
                    row["sidecar_compute_us_per_batch"] = round(delta["kalos_batch_compute_seconds_sum"] / nb * 1e6, 1)
                results.append(row)
                log(
                    f"{n:>8}x{d:<4} {dtype:8} tasks={tasks:<3} procs={procs} p50={p['p50_us']:8.1f}us "
                    f"p95={p['p95_us']:8.1f} p99={p['p99_us']:8.1f} {res.throughput:11,.0f}/s "
                    f"floor {floor_us:.1f}us x{row['p50_over_floor']} batch~{row.get('mean_batch_size')} "
                    f"sidecar {row.get('sidecar_compute_us_per_batch')}us/batch wrong {wrong}/{checked}"
                )
                log(f"{'':>14}batch sizes: {shown_distribution(dist)}")
                if paths:
                    log(
                        f"{'':>14}paths: "
                        + "; ".join(f"{k} {v['searches']} x {v['mean_us']} us" for k, v in paths.items())
                    )
        finally:
            stop_sidecar_process(proc)
        del matrix
    date = dt.date.today().isoformat()
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, a.out_name or f"gpu-h200-{date}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "command": " ".join(["python3", *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "seed": seed,
                "env": env,
                "copy_TBps": round(bw, 3),
                "rows": results,
            },
            f,
            indent=1,
        )
    log(f"# wrote {path}")
    bad = [r for r in results if r.get("wrong") or r.get("errors")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
