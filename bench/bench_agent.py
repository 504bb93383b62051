#!/usr/bin/env python3
"""The agent workload: a namespace per user or agent, each recall to its own namespace, through the
whole broker (a sidecar process, client tasks in several processes, shared memory), checked
against numpy float64 in every run (issue 34).

Layouts (``--layouts``, comma-separated):

* ``NxR``: N namespaces of R rows each (``1024x1000``, ``100000x10``; ``1x1000000`` is the one-
  namespace case at the same rows per namespace as ``1x1000``);
* ``zipf:N:TOTAL:S``: N namespaces of sizes proportional to 1/rank^S summing to TOTAL rows (a few
  large tenants, many small ones), each recall's namespace drawn in proportion to its size.

``--target all`` (default) sends each recall to a namespace drawn at random (uniform for ``NxR``);
``--target one`` sends every recall to namespace 0 while the others are merely loaded (what a
one-namespace workload costs beside 100k namespaces). Each layout is loaded once (the creation
time and rate are reported: namespaces are created by their first upsert), then measured at every
``--tasks`` count over ``--procs`` processes. Each row reports recalls/s, p50/p95/p99, the routes
and backend paths that served it (``/metrics`` deltas), the batch sizes, and the float64 check.

The script uses only the public API (``RecallPool``) and ``kalos.testing.sidecar``, so an older
checkout runs it too (``cd OLD && python3 /path/to/new/bench/bench_agent.py``): that is how
``bench/gpu_session.sh agent`` alternates old and new on one GPU.

    python bench/bench_agent.py --backend numpy --dim 128 --layouts 1x200,1024x200 --tasks 1,32 --procs 2
    python bench/bench_agent.py --backend cuda --dtype float16 --dim 768 --layouts 1024x1000,1x1000 \\
        --tasks 1,8,64,256 --procs 8 --out bench/results/agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())  # the checkout being measured (cd OLD && python3 NEW/bench/...)

from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


@dataclass(frozen=True)
class Layout:
    text: str
    sizes: np.ndarray  # rows per namespace
    weights: np.ndarray  # probability a recall names each namespace

    @property
    def rows(self) -> int:
        return int(self.sizes.sum())


def parse_layout(text: str) -> Layout:
    if text.startswith("zipf:"):
        _z, n_s, total_s, s_s = text.split(":")
        n, total, s = int(n_s), int(float(total_s)), float(s_s)
        w = 1.0 / np.arange(1, n + 1) ** s
        sizes = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
        return Layout(text, sizes, sizes / sizes.sum())
    n_s, r_s = text.lower().split("x")
    n, r = int(float(n_s.replace("k", "e3").replace("m", "e6"))), int(float(r_s.replace("k", "e3").replace("m", "e6")))
    return Layout(text, np.full(n, r, np.int64), np.full(n, 1.0 / n))


def ns_name(i: int) -> str:
    return f"user-{i}"


def rows_of(seed: int, layout: Layout, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Every namespace's rows, one matrix (float32), and each namespace's first row in it."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((layout.rows, dim), dtype=np.float32)
    offs = np.zeros(len(layout.sizes) + 1, np.int64)
    np.cumsum(layout.sizes, out=offs[1:])
    return data, offs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def deltas(before: dict[str, float], after: dict[str, float], prefix: str, label: str) -> dict[str, float]:
    """Increases of the counters ``prefix{...label="X"...}`` by X (summed over other labels)."""
    out: dict[str, float] = {}
    for key, v in after.items():
        if key.startswith(prefix + "{") and f'{label}="' in key:
            x = key.split(f'{label}="', 1)[1].split('"', 1)[0]
            d = v - before.get(key, 0.0)
            if d:
                out[x] = out.get(x, 0.0) + d
    return out


# --------------------------------------------------------------------------- load


async def _load(name: str, layout: Layout, data: np.ndarray, offs: np.ndarray, conc: int) -> float:
    from kalos.clients import RecallPool

    t0 = time.perf_counter()
    async with RecallPool(name, size=min(conc, 16)) as pool:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                a, b = int(offs[i]), int(offs[i + 1])
                await pool.upsert(np.arange(b - a, dtype=np.int64), data[a:b], namespace=ns_name(i), timeout=600)

        await asyncio.gather(*(one(i) for i in range(len(layout.sizes))))
    return time.perf_counter() - t0


async def _worker_main(args: dict[str, Any], n_tasks: int, rank: int, start_at: float) -> dict[str, Any]:
    from kalos.clients import RecallPool

    rng = np.random.default_rng((args["seed"], rank, 7))
    bank = rng.standard_normal((1024, args["dim"]), dtype=np.float32)
    weights = np.asarray(args["weights"])
    picks = (
        np.zeros(4096, np.int64)
        if args["target"] == "one"
        else rng.choice(len(weights), 4096, p=weights).astype(np.int64)
    )
    lat: list[int] = []
    samples: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    errors = 0
    k = args["k"]
    async with RecallPool(args["name"], size=n_tasks, min_size=n_tasks) as pool:
        while time.time() < start_at:  # noqa: ASYNC110 (a start line shared by processes)
            await asyncio.sleep(0.001)
        t_measure = time.perf_counter() + args["warmup"]
        t_end = t_measure + args["seconds"]

        async def task(j: int) -> None:
            nonlocal errors
            i = j
            n = 0
            while True:
                now = time.perf_counter()
                if now >= t_end:
                    return
                q = bank[i % len(bank)]
                ns = int(picks[i % len(picks)])
                i += n_tasks
                t = time.perf_counter_ns()
                try:
                    hits = await pool.recall(q, k, namespace=ns_name(ns))
                except Exception:
                    errors += 1
                    continue
                dt_ns = time.perf_counter_ns() - t
                n += 1
                if now >= t_measure:
                    lat.append(dt_ns)
                    if len(samples) < args["keep"] and n % 5 == 0:
                        samples.append((ns, q.copy(), hits.ids, hits.scores))

        cpu: list[float] = []  # this process's CPU time (all its threads) at the window's ends

        async def meter() -> None:
            for t in (t_measure, t_end):
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                cpu.append(time.process_time())

        t0 = time.perf_counter()
        await asyncio.gather(meter(), *(task(j) for j in range(n_tasks)))
        elapsed = time.perf_counter() - t0 - args["warmup"]
    return {
        "lat": np.asarray(lat, np.int64),
        "elapsed": min(elapsed, args["seconds"]),
        "errors": errors,
        "samples": samples,
        "cpu_s": cpu[1] - cpu[0] if len(cpu) == 2 else float("nan"),
    }


def _worker(args: dict[str, Any], n_tasks: int, rank: int, start_at: float, out: Any) -> None:
    try:
        import uvloop

        res = uvloop.run(_worker_main(args, n_tasks, rank, start_at))
    except ImportError:
        res = asyncio.run(_worker_main(args, n_tasks, rank, start_at))
    out.put(res)


def run_tasks(args: dict[str, Any], tasks: int, procs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    split = [tasks // procs + (1 if r < tasks % procs else 0) for r in range(procs)]
    split = [s for s in split if s > 0]
    start_at = time.time() + 2.0 + 0.3 * len(split)
    ps = [ctx.Process(target=_worker, args=(args, n, r, start_at, out), daemon=True) for r, n in enumerate(split)]
    for p in ps:
        p.start()
    results = [out.get(timeout=120 + args["seconds"] + args["warmup"]) for _ in ps]
    for p in ps:
        p.join(timeout=10)
    lat = np.concatenate([r["lat"] for r in results])
    return {
        "lat": lat,
        "elapsed": max(r["elapsed"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "samples": [s for r in results for s in r["samples"]],
        "cpu_s": sum(r["cpu_s"] for r in results),
    }


def check(
    samples: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], data: np.ndarray, offs: np.ndarray, k: int
) -> tuple[int, int]:
    """Each sampled answer against its namespace's rows in float64, by score (ties by value).
    Returns (checked, wrong)."""
    wrong = 0
    for ns, q, ids, scores in samples:
        m = data[int(offs[ns]) : int(offs[ns + 1])].astype(np.float64)
        ref = m @ q.astype(np.float64)
        kk = min(k, len(m))
        tol = 1e-3 * (np.abs(ref).max() + 1.0)  # (fp16 storage rounds the rows)
        if len(ids) != kk or len(set(ids.tolist())) != kk or (ids < 0).any() or (ids >= len(m)).any():
            wrong += 1
            continue
        kth = np.sort(ref)[::-1][kk - 1]
        true = ref[ids]
        if (true < kth - tol).any() or (np.abs(scores - true) > tol).any():
            wrong += 1
    return len(samples), wrong


def cpu_s(pid: int) -> float:
    """CPU time (user + system, every thread) a process has used, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def gpu_mb(pid: int) -> float:
    try:
        outp = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return float("nan")
    for line in outp.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return float("nan")


def environment() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count()}
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["code"] = subprocess.run(
            ["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True, timeout=10
        ).stdout.strip()[:100]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def start_spy(folder: str, pid: int, layout: str, tasks: int, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the sidecar ``pid`` for ``seconds`` into ``folder`` (raw stacks), or None
    when no folder is given."""
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, f"{layout.replace(':', '_')}-{tasks}.raw")
    cmd = ["py-spy", "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "1000", "-f", "raw"]
    return subprocess.Popen([*cmd, "--nonblocking", "-o", out], stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layouts", default="1x200,1024x200")
    ap.add_argument("--target", choices=("all", "one"), default="all")
    ap.add_argument("--tasks", default="1,32")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=int, default=60, help="answers checked per process and run")
    ap.add_argument("--sidecar-args", default="")
    ap.add_argument("--reload", action="store_true", help="also time a restart that reloads from a data dir")
    ap.add_argument("--label", default="", help="a name for this checkout in the JSON (old/new)")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--py-spy",
        default="",
        help="a folder: sample the sidecar with py-spy (on PATH) during each run, raw stacks per layout and tasks",
    )
    a = ap.parse_args()
    tasks = [int(x) for x in a.tasks.split(",")]
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "label": a.label,
        "environment": environment(),
        "runs": [],
    }
    for text in a.layouts.split(","):
        layout = parse_layout(text)
        data, offs = rows_of(a.seed, layout, a.dim)
        name = f"agent{os.getpid()}"
        port = free_port()
        ddir = None
        sargs = ["--dim", str(a.dim), "--backend", a.backend, "--slots", str(max(64, max(tasks) + 40))]
        sargs += ["--metrics-port", str(port)]
        if a.backend == "cuda":
            sargs += ["--dtype", a.dtype]
        if a.reload:
            import tempfile

            ddir = tempfile.mkdtemp(prefix="kalos-agent-")
            sargs += ["--data-dir", ddir]
        else:
            sargs += ["--ephemeral"]
        sargs += a.sidecar_args.split()
        proc = start_sidecar_process(sargs, name, timeout=300)
        try:
            rss0 = rss_mb(proc.pid)
            load_s = asyncio.run(_load(name, layout, data, offs, 64))
            rss1 = rss_mb(proc.pid)
            loaded = {
                "namespaces": len(layout.sizes),
                "rows": layout.rows,
                "load_s": round(load_s, 3),
                "namespaces_per_s": round(len(layout.sizes) / load_s, 1),
                "sidecar_rss_mb_before": round(rss0, 1),
                "sidecar_rss_mb_after": round(rss1, 1),
                "host_bytes_per_namespace": round((rss1 - rss0) * 2**20 / len(layout.sizes), 1),
                "gpu_mb": gpu_mb(proc.pid),
            }
            print(f"== {text} ({a.label or 'this checkout'}): loaded {loaded}", flush=True)
            if a.reload and ddir is not None:
                stop_sidecar_process(proc)
                t0 = time.perf_counter()
                proc = start_sidecar_process(sargs, name, timeout=600)
                loaded["reload_s"] = round(time.perf_counter() - t0, 3)
                print(f"   restart reloaded in {loaded['reload_s']} s", flush=True)
            wargs = {
                "name": name,
                "dim": a.dim,
                "seed": a.seed,
                "weights": layout.weights.tolist(),
                "target": a.target,
                "k": a.k,
                "seconds": a.seconds,
                "warmup": a.warmup,
                "keep": a.keep,
            }
            for t in tasks:
                procs = min(a.procs, t)
                before, cpu_before = scrape(port), cpu_s(proc.pid)
                spy = start_spy(a.py_spy, proc.pid, text, t, a.seconds + a.warmup)
                r = run_tasks(wargs, t, procs)
                after, cpu_after = scrape(port), cpu_s(proc.pid)
                if spy is not None:
                    spy.wait()
                checked, wrong = check(r["samples"], data, offs, a.k)
                lat_us = r["lat"] / 1e3
                p = np.percentile(lat_us, [50, 95, 99]) if len(lat_us) else [float("nan")] * 3
                routes = deltas(before, after, "kalos_batches_by_route_total", "route")
                paths = deltas(before, after, "kalos_backend_searches_total", "path")
                path_s = deltas(before, after, "kalos_backend_search_seconds_total", "path")
                stage_ms = {}  # mean per batch (compute) or request (queue_wait, service), ms
                for stage, metric in (
                    ("queue_wait", "kalos_queue_wait_seconds"),
                    ("compute", "kalos_batch_compute_seconds"),
                    ("service", "kalos_service_seconds"),
                ):
                    c = after.get(metric + "_count", 0) - before.get(metric + "_count", 0)
                    sm = after.get(metric + "_sum", 0) - before.get(metric + "_sum", 0)
                    if c:
                        stage_ms[stage] = round(1e3 * sm / c, 3)
                search_ms = {x: round(1e3 * path_s.get(x, 0.0) / paths[x], 3) for x in paths if paths[x]}
                batches = after.get("kalos_batch_size_count", 0) - before.get("kalos_batch_size_count", 0)
                reqs = after.get("kalos_batch_size_sum", 0) - before.get("kalos_batch_size_sum", 0)
                row = {
                    "layout": text,
                    "target": a.target,
                    "tasks": t,
                    "procs": procs,
                    "recalls_per_s": round(len(lat_us) / r["elapsed"], 1) if r["elapsed"] > 0 else 0.0,
                    "p50_us": round(float(p[0]), 1),
                    "p95_us": round(float(p[1]), 1),
                    "p99_us": round(float(p[2]), 1),
                    "errors": r["errors"],
                    "checked": checked,
                    "wrong": wrong,
                    "routes": routes,
                    "paths": paths,
                    "mean_batch": round(reqs / batches, 1) if batches else None,
                    "stage_ms": stage_ms,
                    "search_ms": search_ms,
                    # CPU per request: the client processes' over the measured window and its
                    # recalls; the sidecar's over the whole run and the requests it served
                    "client_cpu_us": round(1e6 * r["cpu_s"] / len(lat_us), 2) if len(lat_us) else None,
                    "sidecar_cpu_us": round(1e6 * (cpu_after - cpu_before) / reqs, 2) if reqs else None,
                    "loaded": loaded,
                }
                report["runs"].append(row)
                print(
                    f"{text:>16} target={a.target} tasks={t:<4} {row['recalls_per_s']:>10.1f}/s "
                    f"p50 {row['p50_us']:>8.1f} p95 {row['p95_us']:>8.1f} p99 {row['p99_us']:>8.1f} us "
                    f"batch {row['mean_batch']} routes {routes} paths {paths} search_ms {search_ms} "
                    f"stage_ms {stage_ms} cpu_us client {row['client_cpu_us']} sidecar {row['sidecar_cpu_us']} "
                    f"checked {checked} wrong {wrong} errors {r['errors']}",
                    flush=True,
                )
        finally:
            stop_sidecar_process(proc)
            if ddir is not None:
                import shutil

                shutil.rmtree(ddir, ignore_errors=True)
        del data
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
