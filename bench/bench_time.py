#!/usr/bin/env python3
"""Memory over time (issue 26): what a recall costs when its namespace has TTLs, and what a
recency-weighted recall costs, beside a plain recall of the same data measured in the same run.

Through the broker (a real sidecar, one client task, uvloop), alternating per round:

* ``plain``: a recall in a namespace without TTLs;
* ``ttl50``: the same recall in a namespace of the same rows, half of them with a TTL (long
  enough not to expire during the run: the case of a namespace where nothing has expired yet);
* ``recency``: a recency-weighted recall (``Recency(half_life=3600, weight=0.1)``) in ``plain``.

In process (``--inproc``, the sidecar's store and backend in this process, same data),
alternating too: the three above and ``expired10``: ``ttl50`` with 10 % of its rows expired and
not swept yet (the masked search every read takes until the sweeper has run).

Every answer of the first round is checked against a numpy float64 reference (recency too, with
the records' timestamps read back and the sidecar's clock of the answer). Prints p50/p95/p99 and
the ratios to ``plain``; writes JSON (machine, versions, command) under bench/results/.

    python bench/bench_time.py --rows 100000 --dim 384 --inproc
    python bench/bench_time.py --rows 1000000 --dim 768 --backend cuda --dtype float16 --inproc
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos import RecallPool, Recency
from kalos.testing.loadgen import environment
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

NS = 1_000_000_000
RECENCY = Recency(half_life=3600.0, weight=0.1)
LONG_TTL = 10 * 86400.0  # seconds: never expires during a run


def quantiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p95_us": float(np.percentile(a, 95)),
        "p99_us": float(np.percentile(a, 99)),
        "n": len(a),
    }


def check(
    vecs: np.ndarray, q: np.ndarray, ids: np.ndarray, scores: np.ndarray, k: int, bias: np.ndarray | None, rel: float
) -> None:
    """The answer is the float64 reference's top-k by score (``bias``: each row's recency part)."""
    ref = vecs.astype(np.float64) @ q.astype(np.float64)
    if bias is not None:
        ref = ref + bias
    scale = float(np.linalg.norm(q) * np.linalg.norm(vecs, axis=1).max())
    tol = rel * scale + 1e-6
    kth = np.sort(ref)[::-1][k - 1]
    assert len(ids) == k and len(set(ids.tolist())) == k
    assert (ref[ids] >= kth - tol).all(), "an id outside the true top-k"
    np.testing.assert_allclose(scores, ref[ids], atol=tol, rtol=0)


def rotate(cases: list[str], r: int) -> list[str]:
    i = r % len(cases)
    return cases[i:] + cases[:i]


async def broker(a: argparse.Namespace, vecs: np.ndarray, qs: np.ndarray, rel: float) -> dict[str, Any]:
    n, d = vecs.shape
    name = f"bench-time-{os.getpid()}"
    args = ["--ephemeral", "--dim", str(d), "--backend", a.backend, "--slots", "8", "--max-k", "64"]
    args += ["--max-queries", str(a.max_queries), "--blob-bytes", str(1 << 22)]
    if a.backend == "cuda":
        args += ["--dtype", a.dtype]
    proc = start_sidecar_process(args, name, timeout=600)
    try:
        async with RecallPool(name, size=4, timeout=600) as pool:
            t0 = time.perf_counter()
            step = 65536
            half = np.arange(n) % 2 == 0
            for lo in range(0, n, step):
                ids = np.arange(lo, min(n, lo + step))
                await pool.upsert(ids, vecs[ids], namespace="plain")
                await pool.upsert(ids, vecs[ids], namespace="ttl50", ttl=[LONG_TTL if half[i] else None for i in ids])
            fill_s = time.perf_counter() - t0
            assert await pool.count("plain") == n and await pool.count("ttl50") == n
            upd = np.empty(n)
            for lo in range(0, n, step):  # the records' timestamps, for the recency reference
                got = await pool.get(np.arange(lo, min(n, lo + step)), namespace="plain", with_vectors=False)
                upd[got.ids] = got.updated_at
            cases = ["plain", "ttl50", "recency"]
            lat: dict[str, list[float]] = {c: [] for c in cases}
            for r in range(a.reps + a.warmup):
                q = qs[r % len(qs)]
                for c in rotate(cases, r):
                    t = time.perf_counter()
                    if c == "recency":
                        hits = await pool.recall(q, a.k, namespace="plain", recency=RECENCY)
                    else:
                        hits = await pool.recall(q, a.k, namespace=c)
                    dt_s = time.perf_counter() - t
                    if r >= a.warmup:
                        lat[c].append(dt_s)
                    if r < 2:  # checked against float64
                        bias = None
                        if c == "recency":
                            assert hits.served_at_ns is not None and hits.recency is not None
                            age = np.maximum(hits.served_at_ns / NS - upd, 0.0)
                            bias = RECENCY.weight * 0.5 ** (age / RECENCY.half_life)
                        check(vecs, q, hits.ids, hits.scores, a.k, bias, rel)
            return {"fill_s": fill_s, "cases": {c: quantiles(v) for c, v in lat.items()}}
    finally:
        stop_sidecar_process(proc)


def inproc(a: argparse.Namespace, vecs: np.ndarray, qs: np.ndarray, rel: float) -> dict[str, Any]:
    """The same in this process: the sidecar's store and backend, no shared memory."""
    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.base import Decay
    from kalos.sidecar_cuda.backends.select import choose_backend
    from kalos.sidecar_cuda.storage.store import MemoryStore, Stamps

    n, d = vecs.shape
    backend = choose_backend(a.backend, storage_dtype=a.dtype, devices="all", shards=0)
    now = [time.time_ns()]
    store = MemoryStore(backend, d, Metric.DOT, clock=lambda: now[0])
    plain = store.get_or_create("plain", n)
    ttl50 = store.get_or_create("ttl50", n)
    exp10 = store.get_or_create("expired10", n)
    t = now[0]
    z = np.zeros(n, np.int64)
    upd = t - np.arange(n, dtype=np.int64) * 1000  # a microsecond apart: distinct ages
    plain.upsert(np.arange(n), vecs, None, Stamps(upd, upd, z, z))
    far = np.where(np.arange(n) % 2 == 0, t + int(LONG_TTL * NS), 0)
    ttl50.upsert(np.arange(n), vecs, None, Stamps(upd, upd, far, z))
    gone = np.where(np.arange(n) % 10 == 0, t - 1, far)  # 10 % expired, not swept
    exp10.upsert(np.arange(n), vecs, None, Stamps(upd, upd, gone, z))
    cases = ["plain", "ttl50", "expired10", "recency"]
    lat: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(a.reps + a.warmup):
        q = qs[r % len(qs)][None]
        for c in rotate(cases, r):
            t0 = time.perf_counter()
            if c == "recency":
                decay = Decay(store.clock(), RECENCY.half_life, RECENCY.weight)
                ids, scores = plain.search(q, a.k, decay=decay)
            else:
                ids, scores = store.namespaces[c].search(q, a.k)
            dt_s = time.perf_counter() - t0
            if r >= a.warmup:
                lat[c].append(dt_s)
            if r < 2:
                if c == "recency":
                    check(vecs, q[0], ids[0], scores[0], a.k, RECENCY.part(upd, now[0]), rel)
                elif c == "expired10":
                    keep = np.flatnonzero(np.arange(n) % 10 != 0)
                    check(vecs[keep], q[0], np.searchsorted(keep, ids[0]), scores[0], a.k, None, rel)
                else:
                    check(vecs, q[0], ids[0], scores[0], a.k, None, rel)
    backend.close()
    return {"cases": {c: quantiles(v) for c, v in lat.items()}}


def table(title: str, cases: dict[str, dict[str, float]]) -> list[str]:
    base = cases["plain"]
    out = [
        title,
        f"  {'case':10s} {'p50 us':>10s} {'p95 us':>10s} {'p99 us':>10s} {'p50/plain':>10s} {'p99/plain':>10s}",
    ]
    for c, qv in cases.items():
        out.append(
            f"  {c:10s} {qv['p50_us']:10.1f} {qv['p95_us']:10.1f} {qv['p99_us']:10.1f} "
            f"{qv['p50_us'] / base['p50_us']:10.3f} {qv['p99_us'] / base['p99_us']:10.3f}"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=300, help="measured rounds (each: every case once)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-queries", type=int, default=1024, help="the sidecar's --max-queries (the fill's chunks)")
    ap.add_argument("--inproc", action="store_true", help="also the in-process cases")
    ap.add_argument("--no-broker", action="store_true", help="only the in-process cases")
    ap.add_argument(
        "--out", default=None, help="JSON path (default bench/results/time-<backend>-<rows>x<dim>-<date>.json)"
    )
    a = ap.parse_args()
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((a.rows, a.dim), dtype=np.float32)
    qs = rng.standard_normal((64, a.dim), dtype=np.float32)
    rel = {"float32": 1e-5, "float16": 3 * 2.0**-11, "bfloat16": 3 * 2.0**-9}[a.dtype]
    result: dict[str, Any] = {
        "bench": "bench_time",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "rows": a.rows,
        "dim": a.dim,
        "k": a.k,
        "backend": a.backend,
        "dtype": a.dtype,
        "reps": a.reps,
        "recency": {"half_life_s": RECENCY.half_life, "weight": RECENCY.weight},
        "environment": environment(),
    }
    lines = [f"bench_time: {a.rows} x {a.dim}, k={a.k}, {a.backend} {a.dtype}, {a.reps} rounds (seed {seed})"]
    if not a.no_broker:
        import uvloop

        result["broker"] = uvloop.run(broker(a, vecs, qs, rel))
        lines += table("through the broker (one task, uvloop):", result["broker"]["cases"])
    if a.inproc or a.no_broker:
        result["inproc"] = inproc(a, vecs, qs, rel)
        lines += table("in process (the store and backend):", result["inproc"]["cases"])
    print("\n".join(lines))
    result["table"] = lines
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"time-{a.backend}-{a.rows}x{a.dim}-{dt.date.today().isoformat()}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return (
        0
        if all(
            math.isfinite(v["p50_us"]) for s in ("broker", "inproc") if s in result for v in result[s]["cases"].values()
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
