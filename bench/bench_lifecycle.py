#!/usr/bin/env python3
"""Memory lifecycle benchmark: upserts/s (one record per call, and batched) through the broker and,
as the in-process baseline, through the same store code without IPC; recall latency while a writer
is active beside the read-only figure; and how long a restart takes to load N x dim from the
durable store. Writes JSON to bench/results/.

    python bench/bench_lifecycle.py                          # durable (SQLite) and ephemeral
    python bench/bench_lifecycle.py --load-rows 1000000 --load-dim 768
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.clients import RecallPool
from kalos.testing.loadgen import environment
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


def pct(a: list[int]) -> dict[str, float]:
    p = np.percentile(np.asarray(a) / 1e3, [50, 95, 99])
    return {"p50_us": round(float(p[0]), 1), "p95_us": round(float(p[1]), 1), "p99_us": round(float(p[2]), 1)}


async def upsert_rates(name: str, dim: int, seconds: float, batch: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((4096, dim)).astype(np.float32)
    out = {}
    async with RecallPool(name, size=16) as pool:
        # single: one record per call, one caller
        n, lat, t_end = 0, [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t = time.perf_counter_ns()
            await pool.upsert([n], vecs[n % 4096][None], payloads=[{"n": n}], namespace="w1")
            lat.append(time.perf_counter_ns() - t)
            n += 1
        out["single"] = {"upserts_per_s": round(n / seconds), **pct(lat)}
        # batched: `batch` records per call, 16 callers
        done = 0
        t_end = time.perf_counter() + seconds

        async def writer(j: int) -> None:
            nonlocal done
            base = 10_000_000 * (j + 1)
            while time.perf_counter() < t_end:
                ids = np.arange(base, base + batch)
                base += batch
                await pool.upsert(ids, vecs[:batch], namespace="w2")
                done += batch

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(j) for j in range(16)))
        out["batched"] = {"batch": batch, "callers": 16, "upserts_per_s": round(done / (time.perf_counter() - t0))}
    return out


async def recall_under_writes(name: str, dim: int, seconds: float) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    q = rng.standard_normal((256, dim)).astype(np.float32)
    vecs = rng.standard_normal((4096, dim)).astype(np.float32)
    out = {}
    async with RecallPool(name, size=8) as pool:
        for mode in ("read_only", "with_writer"):
            stop = asyncio.Event()
            writes = 0

            async def writer() -> None:
                nonlocal writes
                i = 0
                while not stop.is_set():
                    await pool.upsert(np.arange(i, i + 32) % 50_000 + 5_000_000, vecs[:32], namespace="default")
                    await pool.delete([(i * 7) % 50_000 + 5_000_000], namespace="default")
                    writes += 33
                    i += 32

            w = asyncio.ensure_future(writer()) if mode == "with_writer" else None
            lat = []
            t_end = time.perf_counter() + seconds
            j = 0
            while time.perf_counter() < t_end:
                t = time.perf_counter_ns()
                await pool.recall(q[j % 256], k=10)
                lat.append(time.perf_counter_ns() - t)
                j += 1
            stop.set()
            if w is not None:
                await w
            out[mode] = {**pct(lat), "recalls": len(lat), "writes_per_s": round(writes / seconds)}
    return out


def inproc_upserts(dim: int, seconds: float, batch: int, workdir: str) -> dict[str, Any]:
    """The in-process baseline: the same store code (numpy backend + SQLite), no IPC."""
    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
    from kalos.sidecar_cuda.storage.durable import resolve_writes
    from kalos.sidecar_cuda.storage.sqlite import Persistence
    from kalos.sidecar_cuda.storage.store import MemoryStore
    from kalos.sidecar_cuda.storage.writes import Write, WriteOp

    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((4096, dim)).astype(np.float32)
    out = {}
    for mode in ("durable", "ephemeral"):
        store = MemoryStore(NumpyBackend(), dim, Metric.DOT)
        persist = Persistence(os.path.join(workdir, "inproc-" + mode), dim, "dot") if mode == "durable" else None
        res = {}
        for label, size in (("single", 1), ("batched", batch)):
            n, t_end = 0, time.perf_counter() + seconds
            t0 = time.perf_counter()
            while time.perf_counter() < t_end:
                ids = np.arange(n, n + size, dtype=np.int64)
                v = vecs[n % 4096 : n % 4096 + size] if n % 4096 + size <= 4096 else vecs[:size]
                pls: list[bytes | None] = [b'{"n":1}'] * size
                if persist is not None:
                    writes = [Write(WriteOp.UPSERT, "w", ids=ids, vectors=v, payloads=pls)]
                    resolve_writes(writes, None)
                    persist.commit(writes)
                store.get_or_create("w").upsert(ids, v, pls)
                n += size
            res[label] = {"upserts_per_s": round(n / (time.perf_counter() - t0))}
        if persist is not None:
            persist.close()
        out[mode] = res
    return out


def load_time(rows: int, dim: int, workdir: str) -> dict[str, Any]:
    """Fill a durable store with rows x dim (kalos import), then time a restart's load."""
    name = f"bl-load-{os.getpid()}"
    data = os.path.join(workdir, "load-data")
    src = os.path.join(workdir, "load-src")
    os.makedirs(src, exist_ok=True)
    rng = np.random.default_rng(3)
    vec = np.lib.format.open_memmap(os.path.join(src, "vectors.npy"), mode="w+", dtype=np.float32, shape=(rows, dim))
    for lo in range(0, rows, 65536):
        vec[lo : lo + 65536] = rng.standard_normal((min(65536, rows - lo), dim), dtype=np.float32)
    vec.flush()
    del vec
    args = ["--dim", str(dim), "--data-dir", data, "--backend", "numpy", "--max-queries", "256", "--slots", "32"]
    proc = start_sidecar_process(args, name)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "kalos.cli", "import", "default", src, "--name", name, "--timeout", "600"],
        capture_output=True,
        text=True,
    )
    import_s = time.perf_counter() - t0
    stop_sidecar_process(proc)
    if r.returncode:
        raise RuntimeError(r.stderr)
    t0 = time.perf_counter()
    reader = subprocess.Popen(
        [sys.executable, "-m", "kalos.sidecar_cuda", "--name", name, *args], stderr=subprocess.PIPE, text=True
    )
    loaded = None
    assert reader.stderr is not None
    for line in reader.stderr:
        m = re.search(r"loaded (\d+) rows .* in ([0-9.]+) s", line)
        if m:
            loaded = (int(m.group(1)), float(m.group(2)))
        if "ready" in line:
            break
    ready_s = time.perf_counter() - t0
    reader.terminate()
    reader.wait(timeout=60)
    db_bytes = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))
    return {
        "rows": rows,
        "dim": dim,
        "import_s": round(import_s, 1),
        "import_rows_per_s": round(rows / import_s),
        "load_rows": loaded and loaded[0],
        "load_s": loaded and loaded[1],
        "start_to_ready_s": round(ready_s, 1),
        "store_bytes": db_bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--rows", type=int, default=100_000, help="read-only memory for the recall figures")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--load-rows", type=int, default=200_000)
    ap.add_argument("--load-dim", type=int, default=768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kalos-bench-")
    results: dict[str, Any] = {}
    try:
        for mode in ("durable", "ephemeral"):
            name = f"bl-{mode}-{os.getpid()}"
            extra = ["--data-dir", os.path.join(work, "d-" + mode)] if mode == "durable" else ["--ephemeral"]
            proc = start_sidecar_process(["--dim", str(a.dim), "--backend", "numpy", *extra], name)
            try:
                results[f"upserts_{mode}"] = asyncio.run(upsert_rates(name, a.dim, a.seconds, a.batch))
            finally:
                stop_sidecar_process(proc)
            print(mode, json.dumps(results[f"upserts_{mode}"]), flush=True)
        results["inproc_upserts"] = inproc_upserts(a.dim, a.seconds, a.batch, work)
        print("inproc", json.dumps(results["inproc_upserts"]), flush=True)
        name = f"bl-rw-{os.getpid()}"
        proc = start_sidecar_process(
            ["--dim", str(a.dim), "--backend", "numpy", "--ephemeral", "--random-rows", str(a.rows)], name
        )
        try:
            results["recall_while_writing"] = asyncio.run(recall_under_writes(name, a.dim, a.seconds))
        finally:
            stop_sidecar_process(proc)
        print("recall", json.dumps(results["recall_while_writing"]), flush=True)
        if a.load_rows:
            results["load"] = load_time(a.load_rows, a.load_dim, work)
            print("load", json.dumps(results["load"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"lifecycle-{os.uname().nodename}-{dt.date.today()}.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": environment(),
                "dim": a.dim,
                "results": results,
            },
            f,
            indent=1,
        )
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
