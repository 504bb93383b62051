#!/usr/bin/env python3
"""Fleet benchmark (issue 24): sidecars following one local PostgreSQL store. Writes JSON to
bench/results/.

1. upserts/s through one sidecar (768-dim rows with payloads) on the PostgreSQL store beside the
   SQLite store, same run: one record per call from one caller, and 32-record calls from 16;
2. replication lag with 3 followers while one node takes writes at a fixed rate: for every write,
   how long after its acknowledgement each follower has applied it (``count(after=position)``
   on each follower, sent as soon as the write returns), p50/p99;
3. bootstrap time (start to READY, and the sidecar's own "loaded ... in X s") of N x 768 rows;
4. a lone caller's recall latency on a follower while it follows a writer, beside no writer.

    python bench/bench_fleet.py                              # all, bootstrap of 100k rows
    python bench/bench_fleet.py --bootstrap-rows 100000 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.positions import Position
from kalos.clients import RecallPool
from kalos.testing.loadgen import environment
from kalos.testing.postgres import PgServer, find_bin
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

DIM = 768


def pct_ms(a: list[float]) -> dict[str, float]:
    if not a:
        return {}
    p = np.percentile(np.asarray(a) * 1e3, [50, 99])
    return {"p50_ms": round(float(p[0]), 2), "p99_ms": round(float(p[1]), 2), "n": len(a)}


def pct_us(a: list[int]) -> dict[str, float]:
    p = np.percentile(np.asarray(a) / 1e3, [50, 95, 99])
    return {"p50_us": round(float(p[0]), 1), "p95_us": round(float(p[1]), 1), "p99_us": round(float(p[2]), 1)}


class Fleet:
    def __init__(self, pg: PgServer, db: str, log_dir: str) -> None:
        self.dsn = pg.create_db(db)
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def node(self, name: str, *args: str, store: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
        log = os.path.join(self.log_dir, name + ".log")
        with open(log, "ab") as f:
            proc = start_sidecar_process(
                [
                    "--dim",
                    str(DIM),
                    "--backend",
                    "numpy",
                    "--slots",
                    "32",
                    *(["--store", store or self.dsn] if "--data-dir" not in args else []),
                    *args,
                ],
                name,
                timeout=900,
                stderr=f,
            )
        self.procs.append(proc)
        return proc, log

    def close(self) -> None:
        for p in self.procs:
            stop_sidecar_process(p)
        self.procs.clear()


async def upsert_rates(name: str, seconds: float) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((4096, DIM)).astype(np.float32)
    out = {}
    async with RecallPool(name, size=16) as pool:
        n, lat, t_end = 0, [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t = time.perf_counter_ns()
            await pool.upsert([n], vecs[n % 4096][None], payloads=[{"n": n, "text": "a memory"}], namespace="w1")
            lat.append(time.perf_counter_ns() - t)
            n += 1
        out["single"] = {"upserts_per_s": round(n / seconds), **pct_us(lat)}
        done = 0
        t_end = time.perf_counter() + seconds

        async def writer(j: int) -> None:
            nonlocal done
            base = 10_000_000 * (j + 1)
            while time.perf_counter() < t_end:
                ids = np.arange(base, base + 32)
                await pool.upsert(
                    ids,
                    vecs[(base % 4000) : (base % 4000) + 32],
                    payloads=[{"n": int(i), "text": "a memory"} for i in ids],
                    namespace="w32",
                )
                base += 32
                done += 32

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(j) for j in range(16)))
        out["batched_32x16"] = {"upserts_per_s": round(done / (time.perf_counter() - t0))}
    return out


async def lag_run(writer: str, followers: list[str], rate: float, seconds: float, batch: int) -> dict[str, Any]:
    """Writes of ``batch`` rows at ``rate`` rows/s on ``writer``; per write, each follower's
    wait from the write's acknowledgement until it has applied it."""
    rng = np.random.default_rng(2)
    vecs = rng.standard_normal((batch, DIM)).astype(np.float32)
    lags: list[float] = []
    late = 0
    async with (
        RecallPool(writer, size=8) as w,
        RecallPool(followers[0], size=8) as f0,
        RecallPool(followers[1], size=8) as f1,
        RecallPool(followers[2], size=8) as f2,
    ):
        pools = [f0, f1, f2]
        interval = batch / rate
        t_next = time.perf_counter()
        t_end = t_next + seconds
        pending: list[asyncio.Task[None]] = []
        i = 0

        async def probe(pool: RecallPool, pos: Position | None, t_ack: float) -> None:
            await pool.count("lag", after=pos, timeout=30)
            lags.append(time.perf_counter() - t_ack)

        while time.perf_counter() < t_end:
            now = time.perf_counter()
            if now < t_next:
                await asyncio.sleep(t_next - now)
            elif now - t_next > interval:
                late += 1
            t_next += interval
            ids = np.arange(i, i + batch) % 20000
            res = await w.upsert(ids, vecs, payloads=[{"i": int(x)} for x in ids], namespace="lag")
            t_ack = time.perf_counter()
            for p in pools:
                pending.append(asyncio.ensure_future(probe(p, res.position, t_ack)))
            i += batch
        await asyncio.gather(*pending)
        achieved = i / seconds
    return {
        "target_rows_per_s": rate,
        "achieved_rows_per_s": round(achieved),
        "rows_per_write": batch,
        "late_writes": late,
        "ack_to_applied_on_follower": pct_ms(lags),
    }


def load_rows(pg: PgServer, dsn: str, rows: int, payloads: bool = True) -> float:
    import psycopg

    t0 = time.perf_counter()
    rng = np.random.default_rng(3)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        with conn.cursor().copy("COPY kalos.records (ns, id, vec, payload) FROM STDIN (FORMAT BINARY)") as cp:
            cp.set_types(["text", "int8", "bytea", "bytea"])
            for lo in range(0, rows, 20000):
                hi = min(rows, lo + 20000)
                block = rng.standard_normal((hi - lo, DIM), dtype=np.float32)
                for j in range(hi - lo):
                    cp.write_row(
                        ("default", lo + j, block[j].tobytes(), b'{"b":%d}' % ((lo + j) % 100) if payloads else None)
                    )
        conn.execute("VACUUM ANALYZE kalos.records")
    return time.perf_counter() - t0


def bootstrap(pg: PgServer, log_dir: str, rows: int, payloads: bool, attempts: int) -> dict[str, Any]:
    tag = f"{rows}{'p' if payloads else 'n'}"
    fl = Fleet(pg, f"boot{tag}", log_dir)
    try:
        p, log = fl.node(f"bench-boot-init-{tag}")  # makes the schema
        stop_sidecar_process(p)
        fl.procs.clear()
        load_s = load_rows(pg, fl.dsn, rows, payloads)
        out: dict[str, Any] = {"rows": rows, "dim": DIM, "payloads": payloads, "load_into_postgres_s": round(load_s, 1)}
        for attempt in range(attempts):
            t0 = time.perf_counter()
            p, log = fl.node(f"bench-boot-{tag}-{attempt}")
            ready = time.perf_counter() - t0
            with open(log) as f:
                m = re.findall(r"loaded (\d+) rows .* in ([0-9.]+) s", f.read())
            stop_sidecar_process(p)
            fl.procs.clear()
            out[f"start_to_ready_s_{attempt}"] = round(ready, 2)
            out[f"snapshot_load_s_{attempt}"] = float(m[-1][1]) if m else None
        return out
    finally:
        fl.close()


async def recall_while_following(reader: str, writer: str, seconds: float, rate: float) -> dict[str, Any]:
    rng = np.random.default_rng(4)
    q = rng.standard_normal(DIM).astype(np.float32)
    vecs = rng.standard_normal((10, DIM)).astype(np.float32)
    out = {}
    async with RecallPool(reader, size=2) as r, RecallPool(writer, size=4) as w:
        for phase in ("idle", "following"):
            stop = asyncio.Event()

            async def write(stop: asyncio.Event = stop) -> None:
                i = 0
                while not stop.is_set():
                    await w.upsert(np.arange(i, i + 10) % 5000, vecs, namespace="other")
                    i += 10
                    await asyncio.sleep(10 / rate)

            task = asyncio.ensure_future(write()) if phase == "following" else None
            await asyncio.sleep(0.5)
            lat = []
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t = time.perf_counter_ns()
                await r.recall(q, k=10)
                lat.append(time.perf_counter_ns() - t)
            stop.set()
            if task is not None:
                await task
            out[phase] = {"recalls": len(lat), **pct_us(lat)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--bootstrap-rows", type=int, nargs="*", default=[100_000])
    ap.add_argument("--lag-rates", type=float, nargs="*", default=[500, 1000, 2000])
    ap.add_argument("--bootstrap-payloads", choices=["with", "without", "both"], default="both")
    ap.add_argument("--only-bootstrap", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bindir = find_bin()
    if bindir is None:
        sys.exit("PostgreSQL server binaries not found (apt-get install postgresql)")
    pg = PgServer(bindir, fsync=True)  # durable like SQLite's synchronous=FULL
    log_dir = tempfile.mkdtemp(prefix="kalos-bench-fleet-")
    res: dict[str, Any] = {
        "env": environment(),
        "postgres": os.path.basename(os.path.dirname(bindir)),
        "fsync": True,
        "dim": DIM,
    }
    try:
        if not a.only_bootstrap:
            run_serving(pg, log_dir, a, res)
        # 3. bootstrap
        res["bootstrap"] = []
        for rows in a.bootstrap_rows:
            for payloads in {"with": [True], "without": [False], "both": [False, True]}[a.bootstrap_payloads]:
                r = bootstrap(pg, log_dir, rows, payloads, attempts=2 if rows <= 200_000 else 1)
                print(json.dumps(r), flush=True)
                res["bootstrap"].append(r)
    finally:
        pg.close()
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"fleet-vm-{dt.date.today().isoformat()}.json"
    )
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out)


def run_serving(pg: PgServer, log_dir: str, a: argparse.Namespace, res: dict[str, Any]) -> None:
    """1, 2 and 4 (the serving figures)."""
    # 1. upserts/s: PostgreSQL beside SQLite, same run
    fl = Fleet(pg, "upserts", log_dir)
    try:
        fl.node("bench-up-pg")
        res["upserts_postgres"] = asyncio.run(upsert_rates("bench-up-pg", a.seconds))
        fl.node("bench-up-sqlite", "--data-dir", os.path.join(log_dir, "sqlite"))
        res["upserts_sqlite"] = asyncio.run(upsert_rates("bench-up-sqlite", a.seconds))
    finally:
        fl.close()
    print(json.dumps({k: res[k] for k in ("upserts_postgres", "upserts_sqlite")}), flush=True)
    # 2. replication lag, 3 followers (+ the writer's own node)
    fl = Fleet(pg, "lag", log_dir)
    try:
        names = [f"bench-lag-{j}" for j in range(4)]
        for n in names:
            fl.node(n)
        res["lag"] = []
        for rate in a.lag_rates:
            # 50 writes/s of rate/50 rows: one writer's acknowledged write takes ~5-10 ms here
            r = asyncio.run(lag_run(names[0], names[1:], rate, a.seconds, batch=max(1, int(rate // 50))))
            print(json.dumps(r), flush=True)
            res["lag"].append(r)
        # 4. a lone caller's recall on a follower, idle and while it follows the writer
        res["recall_while_following"] = asyncio.run(recall_while_following(names[1], names[0], a.seconds, rate=500))
        print(json.dumps(res["recall_while_following"]), flush=True)
    finally:
        fl.close()


if __name__ == "__main__":
    main()
