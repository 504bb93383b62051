"""Load generation against a running sidecar: many async tasks in several processes.

Used by ``kalos demo``, ``kalos bench`` and the scripts in ``bench/``. Queries come from a bank drawn
up front (so the generator measures the broker, not the RNG); a sample of answers is kept for checking
against a float64 reference.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class LoadSpec:
    name: str
    dim: int
    procs: int = 1
    tasks: int = 1  # concurrent tasks in total (split over procs)
    duration_s: float = 3.0
    warmup_s: float = 0.5
    k: int = 10
    namespace: str = "default"
    loop: str = "uvloop"  # or "asyncio"
    seed: int = 0
    keep: int = 200  # answers kept per process for checking
    spin_us: float | None = None
    max_spin_us: float | None = None
    max_requests: int | None = None  # per task, stops early (for tests)
    where: dict[str, Any] | None = None  # a filter on every recall (filtered-recall benchmarks)
    coalesce: bool = False  # RecallPool(coalesce=...)


@dataclass
class LoadResult:
    latencies_ns: np.ndarray
    elapsed_s: float
    errors: int
    samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # (q, ids, scores)
    client_cpu_s: float = 0.0  # CPU time of the client processes in the measured window (all)
    slot_paths: tuple[str, ...] = ()  # each client process's slot path ("compiled" or "python")

    @property
    def count(self) -> int:
        return len(self.latencies_ns)

    def percentiles_us(self) -> dict[str, float]:
        if not self.count:
            return {"p50_us": float("nan"), "p95_us": float("nan"), "p99_us": float("nan")}
        p = np.percentile(self.latencies_ns, [50, 95, 99]) / 1e3
        return {"p50_us": float(p[0]), "p95_us": float(p[1]), "p99_us": float(p[2])}

    @property
    def throughput(self) -> float:
        return self.count / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def _worker_main(spec: LoadSpec, n_tasks: int, rank: int, start_at: float, progress: Any) -> dict[str, Any]:
    from kalos.clients.pool import DEFAULT_SPIN_US, MAX_SPIN_US, RecallPool

    rng = np.random.default_rng((spec.seed, rank))
    bank = rng.standard_normal((1024, spec.dim), dtype=np.float32)
    lat: list[int] = []
    samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    errors = 0
    spin = DEFAULT_SPIN_US if spec.spin_us is None else spec.spin_us
    max_spin = MAX_SPIN_US if spec.max_spin_us is None else spec.max_spin_us
    async with RecallPool(
        spec.name, size=n_tasks, min_size=n_tasks, spin_us=spin, max_spin_us=max_spin, coalesce=spec.coalesce
    ) as pool:
        while time.time() < start_at:  # noqa: ASYNC110 (a start line shared by processes: a clock, not an event)
            await asyncio.sleep(0.001)
        t_measure = time.perf_counter() + spec.warmup_s
        t_end = t_measure + spec.duration_s
        done = 0

        async def task(j: int) -> None:
            nonlocal errors, done
            i = j
            n = 0
            while True:
                now = time.perf_counter()
                if now >= t_end or (spec.max_requests is not None and n >= spec.max_requests):
                    return
                q = bank[i % len(bank)]
                i += n_tasks
                t = time.perf_counter_ns()
                try:
                    hits = await pool.recall(q, spec.k, namespace=spec.namespace, where=spec.where)
                except Exception:
                    errors += 1
                    continue
                dt = time.perf_counter_ns() - t
                n += 1
                if now >= t_measure:
                    lat.append(dt)
                    if len(samples) < spec.keep and n % 7 == 0:
                        samples.append((q.copy(), hits.ids, hits.scores))
                    done += 1
                    if progress is not None and done % 256 == 0:
                        progress.value += 256

        cpu0 = [0.0]

        async def mark_cpu() -> None:  # this process's CPU time from the measured window's start
            await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
            cpu0[0] = time.process_time()

        marker = asyncio.ensure_future(mark_cpu())
        t0 = time.perf_counter()
        await asyncio.gather(*(task(j) for j in range(n_tasks)))
        elapsed = time.perf_counter() - max(t0 + spec.warmup_s, t0)
        cpu_s = time.process_time() - cpu0[0] if marker.done() else 0.0
        marker.cancel()
        slot_path = pool.statistics().slot_path
    return {
        "slot_path": slot_path,
        "lat": np.asarray(lat, np.int64),
        "elapsed": min(elapsed, spec.duration_s),
        "errors": errors,
        "samples": samples,
        "cpu_s": cpu_s,
    }


def _worker(spec: LoadSpec, n_tasks: int, rank: int, start_at: float, out: Any, progress: Any) -> None:
    if spec.loop == "uvloop":
        import uvloop

        res = uvloop.run(_worker_main(spec, n_tasks, rank, start_at, progress))
    else:
        res = asyncio.run(_worker_main(spec, n_tasks, rank, start_at, progress))
    out.put(res)


def run_load(spec: LoadSpec, progress_cb: Any = None) -> LoadResult:
    """Run ``spec.tasks`` concurrent tasks over ``spec.procs`` processes; gather latencies."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    progress = ctx.Value("q", 0, lock=False) if progress_cb is not None else None
    split = [spec.tasks // spec.procs + (1 if r < spec.tasks % spec.procs else 0) for r in range(spec.procs)]
    split = [s for s in split if s > 0]
    start_at = time.time() + 1.0 + 0.2 * len(split)
    ps = [
        ctx.Process(target=_worker, args=(spec, n, r, start_at, out, progress), daemon=True)
        for r, n in enumerate(split)
    ]
    for p in ps:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.time() + 60 + spec.warmup_s + spec.duration_s + 5 * len(split)
    while len(results) < len(ps):
        if progress_cb is not None and progress is not None:
            progress_cb(progress.value)
        try:
            results.append(out.get(timeout=0.1))
        except Exception as e:
            if time.time() > deadline or (all(not p.is_alive() for p in ps) and out.empty()):
                if len(results) < len(ps):
                    for p in ps:
                        p.kill()
                    raise RuntimeError(
                        f"load workers failed ({len(results)}/{len(ps)} reported; "
                        f"exit codes {[p.exitcode for p in ps]})"
                    ) from e
    for p in ps:
        p.join(timeout=5)
    lat = np.concatenate([r["lat"] for r in results]) if results else np.empty(0, np.int64)
    elapsed = max(r["elapsed"] for r in results)
    samples = [s for r in results for s in r["samples"]]
    return LoadResult(
        lat,
        elapsed,
        sum(r["errors"] for r in results),
        samples,
        sum(r["cpu_s"] for r in results),
        tuple(r["slot_path"] for r in results),
    )


def check_samples(
    samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    matrix: np.ndarray,
    k: int,
    rtol: float = 1e-4,
    allowed: np.ndarray | None = None,
) -> tuple[int, int]:
    """Compare answers with a float64 reference by score (ties and rounding are compared by value,
    not by index); ids are rows of ``matrix``. ``allowed``: a filtered recall's bool mask of the
    rows it may return (every other row counts as wrong). Returns (checked, wrong)."""
    if not samples:
        return 0, 0
    m64 = matrix.astype(np.float64)
    q = np.stack([s[0] for s in samples]).astype(np.float64)
    ref = q @ m64.T
    kk = min(k, matrix.shape[0])
    if allowed is not None:
        ref[:, ~allowed] = -np.inf
        kk = min(k, int(allowed.sum()))
    if kk == 0:  # nothing matches: every answer must be empty
        return len(samples), sum(1 for s in samples if len(s[1]))
    kth = -np.partition(-ref, kk - 1, axis=1)[:, kk - 1]
    wrong = 0
    for j, (_q, ids, _scores) in enumerate(samples):
        if len(ids) != kk or len(set(ids.tolist())) != kk or (allowed is not None and not allowed[ids].all()):
            wrong += 1
            continue
        true = ref[j, ids]
        tol = rtol * (np.abs(ref[j][np.isfinite(ref[j])]).max() + 1)
        if (true < kth[j] - tol).any() or (np.diff(true) > tol).any():
            wrong += 1
    return len(samples), wrong


def environment() -> dict[str, Any]:
    import platform

    import numpy

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "machine": platform.machine(),
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        info["uvloop"] = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info
