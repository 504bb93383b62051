#!/usr/bin/env python3
"""What observability costs the hot path.

1. The sidecar's per-batch observer (``SidecarCollector.observe_batch``) and ``record_batch`` with
   and without it.
2. Round trips (blocking client and asyncio pool, one request at a time, 256 x 128, k=10) through
   a sidecar without the metrics endpoint, with it but not scraped, scraped once a second, and
   scraped in a tight loop by another process. Configurations are interleaved over several rounds
   (a fresh sidecar each time) and the medians of the rounds are reported.

Prints a table and writes JSON to bench/results/metrics-overhead-<machine>.json.

    python bench/bench_metrics_overhead.py                     # numpy sidecar, 3 rounds of 2 s
    python bench/bench_metrics_overhead.py --backend cuda --machine h200
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import timeit
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import Layout
from kalos.clients import RecallClient, RecallPool
from kalos.sidecar_cuda.metrics import SidecarCollector
from kalos.sidecar_cuda.serving.stats import BatchRecord, SidecarStats
from kalos.testing.loadgen import environment
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

CONFIGS = ("off", "idle", "scrape-1s", "scrape-tight")

SCRAPER = r"""
import sys, time, urllib.request
url, seconds, pause = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
durs = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        r.read()
    durs.append(time.perf_counter() - t0)
    if pause:
        time.sleep(pause)
durs.sort()
print(len(durs), durs[len(durs) // 2] if durs else 0.0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def per_call_ns(stmt: str, env: dict[str, Any], number: int) -> float:
    """Best of 7 repeats, in ns per call (the minimum is the cost without interference)."""
    return min(timeit.repeat(stmt, globals=env, number=number, repeat=7)) / number * 1e9


def bench_observer(number: int) -> dict[str, float]:
    layout = Layout(n_slots=64, dim=128, max_k=16, max_queries=4, blob_bytes=1024)
    plain, observed = SidecarStats(64), SidecarStats(64)
    fake = SimpleNamespace(layout=layout, seg=None, stats=observed)
    col = SidecarCollector(fake, pending_limit=1 << 30)
    col.attach()
    # what serve_pending hands over: posting times as a field of the batch's control blocks
    blocks = np.zeros(8, dtype=[("t_post_ns", "<u8"), ("other", "<u8")])
    blocks["t_post_ns"] = np.arange(1000, 9000, 1000)
    rec = BatchRecord(size=8, compute_ns=50_000, t_pick_ns=10_000, t_post_ns=blocks["t_post_ns"], t_done_ns=70_000)
    env = {"plain": plain.record_batch, "observed": observed.record_batch, "obs": col.observe_batch, "rec": rec}
    out = {
        "observe_batch_ns": per_call_ns("obs(rec)", env, number),
        "record_batch_ns": per_call_ns("plain(rec)", env, number),
        "record_batch_observed_ns": per_call_ns("observed(rec)", env, number),
    }
    col.detach()
    col.harvest()
    n = 10_000  # what the harvest thread then does with each queued record (off the serving path)
    for _ in range(n):
        col.observe_batch(rec)
    t0 = time.perf_counter()
    col.harvest()
    out["harvest_per_batch_of_8_ns"] = (time.perf_counter() - t0) / n * 1e9
    return out


def pct(lat_ns: list[int]) -> dict[str, float]:
    a = np.asarray(lat_ns, np.float64) / 1e3
    return {
        "n": len(a),
        "p50_us": float(np.percentile(a, 50)),
        "p95_us": float(np.percentile(a, 95)),
        "p99_us": float(np.percentile(a, 99)),
    }


def blocking_round_trips(name: str, seconds: float, q: np.ndarray, k: int) -> list[int]:
    lat: list[int] = []
    with RecallClient(name) as c:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # warm up
            c.recall(q[0], k)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            t0 = time.perf_counter_ns()
            c.recall(q[i % len(q)], k)
            lat.append(time.perf_counter_ns() - t0)
            i += 1
    return lat


def pool_round_trips(name: str, seconds: float, q: np.ndarray, k: int, loop: str) -> list[int]:
    async def go() -> list[int]:
        lat: list[int] = []
        async with RecallPool(name, size=1) as pool:
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                await pool.recall(q[0], k)
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end:
                t0 = time.perf_counter_ns()
                await pool.recall(q[i % len(q)], k)
                lat.append(time.perf_counter_ns() - t0)
                i += 1
        return lat

    if loop == "uvloop":
        import uvloop

        return uvloop.run(go())
    return asyncio.run(go())


def pin(cores: set[int] | None) -> None:
    """Run this process (and what it starts from now on) on ``cores``; None: leave it."""
    if cores:
        os.sched_setaffinity(0, cores)


def run_config(cfg: str, a: argparse.Namespace, q: np.ndarray, rnd: int) -> dict[str, Any]:
    name = f"bench-metrics-{os.getpid()}-{rnd}-{cfg}"
    everything = os.sched_getaffinity(0)
    args = [
        "--ephemeral",
        "--dim",
        str(a.dim),
        "--random-rows",
        str(a.rows),
        "--backend",
        a.backend,
        "--dtype",
        a.dtype,
        "--slots",
        "8",
    ]
    port = None
    if cfg != "off":
        port = free_port()
        args += ["--metrics-port", str(port)]
    pin(a.sidecar_cores)
    proc = start_sidecar_process(args, name, timeout=300)
    pin(a.scraper_cores)
    scraper = None
    try:
        if cfg.startswith("scrape"):
            pause = "1.0" if cfg == "scrape-1s" else "0"
            total_s = 2 * (a.seconds + 0.3) + 1.0
            scraper = subprocess.Popen(
                [sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{port}/metrics", str(total_s), pause],
                stdout=subprocess.PIPE,
                text=True,
            )
            time.sleep(0.3)
        pin(a.client_cores)
        res: dict[str, Any] = {
            "blocking": pct(blocking_round_trips(name, a.seconds, q, a.k)),
            "pool": pct(pool_round_trips(name, a.seconds, q, a.k, a.loop)),
        }
        if scraper is not None:
            out, _ = scraper.communicate(timeout=60)
            n, med = out.split()
            res["scrapes"] = int(n)
            res["scrape_p50_ms"] = float(med) * 1e3
        return res
    finally:
        pin(everything)
        if scraper is not None and scraper.poll() is None:
            scraper.kill()
            scraper.wait()
        stop_sidecar_process(proc)


def median_of(rounds: list[dict[str, Any]], path: tuple[str, ...]) -> float:
    vals = []
    for r in rounds:
        v: Any = r
        for p in path:
            v = v[p]
        vals.append(v)
    return float(statistics.median(vals))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=2.0, help="per client kind, per configuration")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--number", type=int, default=100_000, help="timeit calls per repeat")
    ap.add_argument("--machine", default=None, help="name in the output file (default: cpu<N>)")
    ap.add_argument(
        "--pin",
        choices=["auto", "yes", "no"],
        default="auto",
        help="pin sidecar (2 cores), client and scraper (a core each) apart, so that "
        "where the scheduler puts them does not differ between configurations "
        "(auto: when there are 8 cores or more)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if a.pin == "yes" and len(cores) < 7:
        raise SystemExit(f"--pin yes needs 7 cores, this process has {len(cores)}")
    if a.pin == "yes" or (a.pin == "auto" and len(cores) >= 8):
        a.sidecar_cores, a.client_cores, a.scraper_cores = set(cores[2:4]), {cores[4]}, {cores[6]}
    else:
        a.sidecar_cores = a.client_cores = a.scraper_cores = None
    machine = a.machine or f"cpu{os.cpu_count()}-{a.backend}"
    q = np.random.default_rng(1).standard_normal((256, a.dim)).astype(np.float32)

    observer = bench_observer(a.number)
    print("sidecar-side per batch, ns per call:")
    for key, v in observer.items():
        print(f"  {key:28s} {v:8.0f}")

    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for rnd in range(a.rounds):
        for cfg in CONFIGS:
            rounds[cfg].append(run_config(cfg, a, q, rnd))
            r = rounds[cfg][-1]
            extra = f"  scrapes {r['scrapes']} (p50 {r['scrape_p50_ms']:.2f} ms)" if "scrapes" in r else ""
            print(
                f"round {rnd} {cfg:13s} blocking p50 {r['blocking']['p50_us']:7.1f} us p99 "
                f"{r['blocking']['p99_us']:7.1f} | pool p50 {r['pool']['p50_us']:7.1f} us p99 "
                f"{r['pool']['p99_us']:7.1f}{extra}",
                flush=True,
            )

    summary: dict[str, Any] = {}
    for cfg in CONFIGS:
        s: dict[str, Any] = {}
        for kind in ("blocking", "pool"):
            for m in ("p50_us", "p95_us", "p99_us"):
                s[f"{kind}_{m}"] = median_of(rounds[cfg], (kind, m))
        if cfg.startswith("scrape"):
            s["scrapes_per_round"] = median_of(rounds[cfg], ("scrapes",))
            s["scrape_p50_ms"] = median_of(rounds[cfg], ("scrape_p50_ms",))
        summary[cfg] = s
    base = summary["off"]
    print(f"\nmedian of {a.rounds} rounds, {a.rows} x {a.dim}, k={a.k}, backend {a.backend}:")
    print(
        f"{'config':14s} {'blocking p50':>12s} {'p99':>8s} {'pool p50':>9s} {'p99':>8s}  "
        f"{'d p50 blocking':>14s} {'d p50 pool':>10s}"
    )
    for cfg, s in summary.items():
        s["blocking_p50_delta_us"] = s["blocking_p50_us"] - base["blocking_p50_us"]
        s["pool_p50_delta_us"] = s["pool_p50_us"] - base["pool_p50_us"]
        print(
            f"{cfg:14s} {s['blocking_p50_us']:12.1f} {s['blocking_p99_us']:8.1f} "
            f"{s['pool_p50_us']:9.1f} {s['pool_p99_us']:8.1f}  {s['blocking_p50_delta_us']:+14.1f} "
            f"{s['pool_p50_delta_us']:+10.1f}"
        )

    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"metrics-overhead-{machine}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    doc = {
        "benchmark": "metrics overhead",
        "machine": machine,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "environment": environment(),
        "params": {
            "rows": a.rows,
            "dim": a.dim,
            "k": a.k,
            "seconds": a.seconds,
            "rounds": a.rounds,
            "backend": a.backend,
            "dtype": a.dtype,
            "loop": a.loop,
            "timeit_number": a.number,
            "cores": {
                "sidecar": sorted(a.sidecar_cores or []),
                "client": sorted(a.client_cores or []),
                "scraper": sorted(a.scraper_cores or []),
            },
        },
        "sidecar_observer_ns": observer,
        "round_trip_summary": summary,
        "round_trip_rounds": rounds,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
