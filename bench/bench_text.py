#!/usr/bin/env python3
"""Text recall as users do it today against text sent to the sidecar (issue 36), side by side in one
run, through the whole broker, with the float64 check in every run.

* ``inproc`` (today): every worker process loads its own copy of the embedding model (the same
  runtime and weights: ``kalos.sidecar_cuda.embedding.TextEncoder``, numpy float32 on the CPU,
  CuPy float16 on the GPU), embeds each query in process, then recalls the vector through the
  sidecar (``pool.recall``);
* ``sidecar``: the workers send the text (``pool.recall_text``); the sidecar's one model embeds every
  pending text request of a pass together, then searches.

The sidecar holds ``--rows`` random memories in one namespace (cosine, the model's dimension):
the search costs the same whatever the vectors' origin. Each row reports text recalls/s,
p50/p95/p99, the workers' and the sidecar's memory (RSS; GPU memory by process from nvidia-smi),
the embedding batches (``/metrics``), and sampled answers checked against numpy float64 (the
query embedded in this process, float32; fp16 on the GPU rounds the query's vector, hence the
tolerance).

    python bench/bench_text.py --model DIR --backend numpy --rows 100000 --procs 1,4 --tasks 1,4
    python bench/bench_text.py --model DIR --backend cuda --dtype float16 --rows 1000000 \\
        --procs 1,8 --tasks 1,256 --out bench/results/text-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())
from bench_agent import environment, free_port, gpu_mb, rss_mb, scrape

from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

WORDS = (
    "the user agent said likes lives works in at on with a to of for and my our their "
    "paris london tokyo berlin coffee tea music books meeting project deadline monday friday "
    "morning evening dog cat car train flight hotel dinner lunch doctor school job team "
    "birthday sister brother mother father friend gift garden weekend plan budget report"
).split()


def sentences(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(6, 20)))) for _ in range(n)]


def encoder(model: str, backend: str, fused: bool = True) -> Any:
    from kalos.sidecar_cuda.embedding import TextEncoder

    if backend == "cuda":
        import cupy

        return TextEncoder(Path(model), cupy, cupy.float16, fused=fused)
    return TextEncoder(Path(model))


async def _worker_main(a: dict[str, Any], n_tasks: int, rank: int, start_at: float) -> dict[str, Any]:
    from kalos.clients import RecallPool

    bank = sentences(a["seed"] * 1000 + rank, 512)
    enc = encoder(a["model"], a["backend"]) if a["mode"] == "inproc" else None
    if enc is not None:
        enc.encode(bank[:4])  # (warm: the first pass compiles CuPy's kernels)
    lat: list[int] = []
    samples: list[tuple[str, np.ndarray, np.ndarray]] = []
    errors = 0
    k = a["k"]
    async with RecallPool(a["name"], size=n_tasks, min_size=n_tasks) as pool:
        while time.time() < start_at:  # noqa: ASYNC110 (a start line shared by processes)
            await asyncio.sleep(0.001)
        t_measure = time.perf_counter() + a["warmup"]
        t_end = t_measure + a["seconds"]

        async def task(j: int) -> None:
            nonlocal errors
            i, n = j, 0
            while (now := time.perf_counter()) < t_end:
                text = bank[i % len(bank)]
                i += n_tasks
                t = time.perf_counter_ns()
                try:
                    if enc is None:
                        hits = await pool.recall_text(text, k, namespace="default")
                    else:
                        hits = await pool.recall(enc.encode([text])[0], k, namespace="default")
                except Exception:
                    errors += 1
                    continue
                took = time.perf_counter_ns() - t
                n += 1
                if now >= t_measure:
                    lat.append(took)
                    if len(samples) < a["keep"] and n % 7 == 0:
                        samples.append((text, hits.ids.copy(), hits.scores.copy()))

        t0 = time.perf_counter()
        await asyncio.gather(*(task(j) for j in range(n_tasks)))
        elapsed = time.perf_counter() - t0 - a["warmup"]
    return {
        "lat": np.asarray(lat, np.int64),
        "elapsed": min(elapsed, a["seconds"]),
        "errors": errors,
        "samples": samples,
        "rss_mb": rss_mb(os.getpid()),
        "gpu_mb": gpu_mb(os.getpid()) if a["backend"] == "cuda" else 0.0,
    }


def _worker(a: dict[str, Any], n_tasks: int, rank: int, start_at: float, out: Any) -> None:
    out.put(asyncio.run(_worker_main(a, n_tasks, rank, start_at)))


def run(a: dict[str, Any], procs: int, tasks: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0 + 0.5 * procs + (4.0 if a["mode"] == "inproc" else 0.0)
    ps = [ctx.Process(target=_worker, args=(a, tasks, r, start_at, out), daemon=True) for r in range(procs)]
    for p in ps:
        p.start()
    res = [out.get(timeout=300 + a["seconds"]) for _ in ps]
    for p in ps:
        p.join(timeout=10)
    lat = np.concatenate([r["lat"] for r in res])
    return {
        "lat": lat,
        "elapsed": max(r["elapsed"] for r in res),
        "errors": sum(r["errors"] for r in res),
        "samples": [s for r in res for s in r["samples"]],
        "worker_rss_mb": round(sum(r["rss_mb"] for r in res), 1),
        "worker_gpu_mb": round(sum(r["gpu_mb"] for r in res), 1),
    }


def check(samples: list[tuple[str, np.ndarray, np.ndarray]], matrix: np.ndarray, enc: Any, k: int, tol: float) -> int:
    """Sampled answers against float64 over the sidecar's rows (its --random-rows, regenerated),
    the query embedded here. Returns the wrong ones."""
    if not samples:
        return 0
    qs = enc.encode([s[0] for s in samples]).astype(np.float64)
    wrong = 0
    for (_, ids, _scores), q in zip(samples, qs):
        ref = matrix @ q
        kth = np.sort(ref)[::-1][k - 1]
        if len(ids) != k or len(set(ids.tolist())) != k or (ref[ids] < kth - tol).any():
            wrong += 1
    return wrong


def probe(model: str, backend: str, sizes: list[int], seed: int) -> list[dict[str, Any]]:
    """The model alone, in this process: texts/s and ms per encode() at each batch size (what a
    sidecar's pass costs; no broker). On CUDA the fused pass and the plain one (bert.forward on
    CuPy) alternate, an A/B in one process."""
    passes = {"fused": encoder(model, backend, True), "plain": encoder(model, backend, False)}
    if backend != "cuda":
        passes = {"numpy": passes["fused"]}
    out = []
    for n in sizes:
        batch = sentences(seed + n, n)
        for label, enc in passes.items():
            enc.encode(batch)  # warm (CuPy compiles its kernels for new shapes)
            reps = max(3, min(50, 2000 // n))
            t0 = time.perf_counter()
            for _ in range(reps):
                enc.encode(batch)
            ms = (time.perf_counter() - t0) / reps * 1e3
            out.append(
                {"pass": label, "batch": n, "ms_per_encode": round(ms, 3), "texts_per_s": round(n / ms * 1e3, 1)}
            )
            print(f"   probe {label:>5} batch {n:>4}: {ms:8.2f} ms per encode, {n / ms * 1e3:9.1f} texts/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an embedding model directory (kalos serve --embed)")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--procs", default="1,4")
    ap.add_argument("--tasks", default="1,4", help="tasks per process")
    ap.add_argument("--modes", default="inproc,sidecar")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--keep", type=int, default=40)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--slots", type=int, default=0, help="0: procs x tasks, at least 64")
    ap.add_argument("--probe", default="", help="batch sizes to time the model alone at first (e.g. 1,32,256)")
    ap.add_argument(
        "--worker-blas-threads",
        type=int,
        default=0,
        help="BLAS threads of each worker process (OPENBLAS/OMP/MKL_NUM_THREADS; 0: numpy's default, "
        "as an app that sets nothing gets); the sidecar is started before and keeps its own",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    probed = probe(a.model, a.backend, [int(x) for x in a.probe.split(",")], a.seed) if a.probe else []
    procs_list = [int(x) for x in a.procs.split(",")]
    tasks_list = [int(x) for x in a.tasks.split(",")]
    here = encoder(a.model, "numpy")
    dim = here.dim
    name = f"text{os.getpid()}"
    port = free_port()
    slots = a.slots or max(64, max(procs_list) * max(tasks_list) + 8)
    args = ["--ephemeral", "--dim", str(dim), "--metric", "cosine", "--random-rows", str(a.rows), "--seed",
            str(a.seed), "--backend", a.backend, "--embed", a.model, "--slots", str(slots), "--max-k", "64",
            "--metrics-port", str(port)]  # fmt: skip
    if a.backend == "cuda":
        args += ["--dtype", a.dtype]
    matrix = np.random.default_rng(a.seed).standard_normal((a.rows, dim), dtype=np.float32).astype(np.float64)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    proc = start_sidecar_process(args, name, timeout=600)
    if a.worker_blas_threads:  # (read by numpy as the spawned workers import it)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(a.worker_blas_threads)
    runs: list[dict[str, Any]] = []
    tol = 2e-2 if a.backend == "cuda" else 2e-4
    try:
        side_rss0 = rss_mb(proc.pid)
        for procs in procs_list:
            for tasks in tasks_list:
                for mode in a.modes.split(","):
                    before = scrape(port)
                    r = run(
                        {"name": name, "model": a.model, "backend": a.backend, "mode": mode, "k": a.k,
                         "seconds": a.seconds, "warmup": a.warmup, "keep": a.keep, "seed": a.seed},
                        procs, tasks,
                    )  # fmt: skip
                    after = scrape(port)
                    lat = r["lat"] / 1e3
                    row = {
                        "mode": mode,
                        "procs": procs,
                        "tasks_per_proc": tasks,
                        "recalls_per_s": round(len(lat) / r["elapsed"], 1) if r["elapsed"] > 0 else 0.0,
                        "p50_us": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
                        "p95_us": round(float(np.percentile(lat, 95)), 1) if len(lat) else None,
                        "p99_us": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
                        "errors": r["errors"],
                        "checked": len(r["samples"]),
                        "wrong": check(r["samples"], matrix, here, a.k, tol),
                        "worker_rss_mb": r["worker_rss_mb"],
                        "worker_gpu_mb": r["worker_gpu_mb"],
                        "sidecar_rss_mb": round(rss_mb(proc.pid), 1),
                        "sidecar_gpu_mb": gpu_mb(proc.pid) if a.backend == "cuda" else 0.0,
                        "embed_batches": after.get("kalos_embed_batches_total", 0)
                        - before.get("kalos_embed_batches_total", 0),
                        "embed_texts": after.get("kalos_embed_texts_total", 0)
                        - before.get("kalos_embed_texts_total", 0),
                    }
                    row["texts_per_batch"] = (
                        round(row["embed_texts"] / row["embed_batches"], 1) if row["embed_batches"] else None
                    )
                    runs.append(row)
                    print(
                        f"{mode:>8} procs={procs} tasks={tasks:<4} {row['recalls_per_s']:>9.1f}/s p50 {row['p50_us']:>9} "
                        f"p95 {row['p95_us']:>9} p99 {row['p99_us']:>9} us  workers {row['worker_rss_mb']:.0f} MB "
                        f"(gpu {row['worker_gpu_mb']:.0f}) sidecar {row['sidecar_rss_mb']:.0f} MB "
                        f"(gpu {row['sidecar_gpu_mb']}) texts/batch {row['texts_per_batch']} "
                        f"checked {row['checked']} wrong {row['wrong']} errors {row['errors']}",
                        flush=True,
                    )
    finally:
        stop_sidecar_process(proc)
    result = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        "model": {"dir": Path(a.model).name, "describe": here.describe()},
        "rows": a.rows,
        "worker_blas_threads": a.worker_blas_threads or "default",
        "sidecar_rss_mb_idle": round(side_rss0, 1),
        "probe": probed,
        "runs": runs,
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print("wrote", a.out)


if __name__ == "__main__":
    main()
