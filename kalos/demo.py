"""``kalos demo`` and ``kalos bench``: a real sidecar process, real client processes, a table."""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


def inproc_numpy(
    matrix: np.ndarray, k: int, seconds: float = 1.0, batch: int = 1, seed: int = 1
) -> tuple[dict[str, float], float]:
    """What a user would do in their own process: scores = Q @ M.T, argpartition, sort.
    Returns (percentiles of one call in us, recalls/s)."""
    rng = np.random.default_rng(seed)
    bank = rng.standard_normal((64, batch, matrix.shape[1]), dtype=np.float32)
    lat: list[int] = []
    n = matrix.shape[0]
    kk = min(k, n)
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(lat) < 20:
        q = bank[i % 64]
        i += 1
        t = time.perf_counter_ns()
        s = q @ matrix.T
        if kk < n:
            part = np.argpartition(s, n - kk, axis=1)[:, n - kk :]
        else:
            part = np.broadcast_to(np.arange(n), s.shape)
        v = np.take_along_axis(s, part, axis=1)
        np.take_along_axis(part, np.argsort(-v, axis=1), axis=1)
        lat.append(time.perf_counter_ns() - t)
    a = np.asarray(lat[5:]) / 1e3
    p = np.percentile(a, [50, 95, 99])
    return ({"p50_us": float(p[0]), "p95_us": float(p[1]), "p99_us": float(p[2])}, batch * len(a) / (a.sum() / 1e6))


def run_demo(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from kalos.testing.loadgen import LoadSpec, check_samples, run_load

    console = Console()
    seed = int.from_bytes(os.urandom(4), "little")
    name = f"demo-{os.getpid()}"
    console.print(
        f"[bold]Kalos demo[/]: {a.rows:,} memories x {a.dim} (seed {seed}), {a.agents} async agents "
        f"over {a.procs} processes, {a.seconds:.0f} s, k={a.k}"
    )
    proc = start_sidecar_process(
        [
            "--ephemeral",
            "--dim",
            str(a.dim),
            "--backend",
            a.backend,
            "--random-rows",
            str(a.rows),
            "--seed",
            str(seed),
            "--slots",
            str(max(64, a.agents)),
        ],
        name,
    )
    try:
        spec = LoadSpec(
            name=name,
            dim=a.dim,
            procs=a.procs,
            tasks=a.agents,
            duration_s=a.seconds,
            warmup_s=0.5,
            k=a.k,
            seed=seed,
            keep=500,
        )
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[n]:>9,} recalls"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as prog:
            task = prog.add_task("agents recalling", total=a.seconds, n=0)
            t0 = [0.0]

            def tick(n: int) -> None:
                if n and not t0[0]:
                    t0[0] = time.perf_counter()
                prog.update(task, completed=time.perf_counter() - t0[0] if t0[0] else 0, n=n)

            res = run_load(spec, progress_cb=tick)
        backend = _backend_line(name)
    finally:
        stop_sidecar_process(proc)
    matrix = np.random.default_rng(seed).standard_normal((a.rows, a.dim), dtype=np.float32)
    checked, wrong = check_samples(res.samples, matrix, a.k)
    base, base_tput = inproc_numpy(matrix, a.k, seconds=1.0)
    batch, batch_tput = inproc_numpy(matrix, a.k, seconds=1.0, batch=a.agents)
    p = res.percentiles_us()
    t = Table(title=f"recall latency through the broker ({backend})")
    for col in ("path", "p50 us", "p95 us", "p99 us", "recalls/s"):
        t.add_column(col, justify="right" if col != "path" else "left")
    t.add_row(
        f"broker, {a.agents} agents / {a.procs} procs",
        f"{p['p50_us']:.1f}",
        f"{p['p95_us']:.1f}",
        f"{p['p99_us']:.1f}",
        f"{res.throughput:,.0f}",
    )
    t.add_row(
        "in-process numpy, 1 query",
        f"{base['p50_us']:.1f}",
        f"{base['p95_us']:.1f}",
        f"{base['p99_us']:.1f}",
        f"{base_tput:,.0f}",
    )
    t.add_row(
        f"in-process numpy, batch of {a.agents}",
        f"{batch['p50_us']:.1f}",
        f"{batch['p95_us']:.1f}",
        f"{batch['p99_us']:.1f}",
        f"{batch_tput:,.0f}",
    )
    console.print(t)
    console.print(
        f"{res.count:,} recalls, {res.errors} errors; {checked} answers checked against a "
        f"numpy float64 reference: [{'green' if not wrong else 'red'}]{wrong} wrong[/]"
    )
    return 1 if wrong or res.errors or not res.count else 0


def _backend_line(name: str) -> str:
    from kalos.clients._transport import Connection

    c = Connection(name)
    try:
        return {1: "numpy backend", 2: "CUDA backend"}.get(int(c.seg.header["backend"]), "?")
    finally:
        c.close()


def run_bench(a: argparse.Namespace) -> int:
    import json

    from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load

    seed = int.from_bytes(os.urandom(4), "little")
    name = f"bench-{os.getpid()}"
    proc = start_sidecar_process(
        [
            "--ephemeral",
            "--dim",
            str(a.dim),
            "--backend",
            a.backend,
            "--random-rows",
            str(a.rows),
            "--seed",
            str(seed),
            "--slots",
            str(max(64, a.tasks)),
        ],
        name,
    )
    try:
        res = run_load(
            LoadSpec(
                name=name, dim=a.dim, procs=a.procs, tasks=a.tasks, duration_s=a.seconds, k=a.k, seed=seed, loop=a.loop
            )
        )
        backend = _backend_line(name)
    finally:
        stop_sidecar_process(proc)
    matrix = np.random.default_rng(seed).standard_normal((a.rows, a.dim), dtype=np.float32)
    checked, wrong = check_samples(res.samples, matrix, a.k)
    base, base_tput = inproc_numpy(matrix, a.k)
    out = {
        "rows": a.rows,
        "dim": a.dim,
        "k": a.k,
        "tasks": a.tasks,
        "procs": a.procs,
        "loop": a.loop,
        "backend": backend,
        "broker": {**res.percentiles_us(), "recalls_per_s": res.throughput, "n": res.count, "errors": res.errors},
        "inproc_numpy": {**base, "recalls_per_s": base_tput},
        "checked": checked,
        "wrong": wrong,
        "env": environment(),
    }
    print(json.dumps(out, indent=1))
    return 1 if wrong else 0
