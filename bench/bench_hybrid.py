#!/usr/bin/env python3
"""Hybrid recall against dense recall of the same text queries (issue 36's "a hybrid recall <= 1.5x
a dense one"), through a real sidecar, with a float64 + rank_bm25 check of sampled answers when
the namespace is small enough to score in this process.

The namespace holds ``--rows`` records: random vectors of the model's dimension and texts of random
words (upserted with the text in the payload's ``"text"``, as ``upsert_text`` stores it: the
lexical index reads the same field; no embedding is needed to fill it). Each round times, per
query text: ``recall_text`` (dense) and ``recall_text(hybrid=Hybrid(0.5))``, alternating, one
caller; the first hybrid recall after the load (the index build) is reported apart.

    python bench/bench_hybrid.py --model DIR --rows 100000 --queries 200
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.getcwd())
from bench_agent import environment, rss_mb

from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

WORDS = (
    "the user agent said likes lives works in at on with paris london tokyo coffee tea music books "
    "meeting project deadline monday friday morning evening dog cat train flight hotel dinner lunch "
    "doctor school job team birthday sister brother friend gift garden weekend plan budget report"
).split()


def texts_of(rng: np.random.Generator, n: int) -> list[str]:
    vocab = WORDS + [f"w{i}" for i in range(2000)]  # a long tail of rarer terms
    lengths = rng.integers(5, 25, n)
    picks = rng.choice(len(vocab), int(lengths.sum()))
    out, at = [], 0
    for m in lengths.tolist():
        out.append(" ".join(vocab[j] for j in picks[at : at + m]))
        at += m
    return out


async def run(a: argparse.Namespace, name: str, dim: int) -> dict[str, Any]:
    from kalos import Hybrid, RecallPool

    rng = np.random.default_rng(a.seed)
    texts = texts_of(rng, a.rows)
    vectors = rng.standard_normal((a.rows, dim), dtype=np.float32)
    out: dict[str, Any] = {}
    async with RecallPool(name, size=16) as pool:
        t0 = time.perf_counter()
        step = 4096
        await asyncio.gather(
            *(
                pool.upsert(
                    np.arange(lo, min(lo + step, a.rows)),
                    vectors[lo : lo + step],
                    [{"text": t} for t in texts[lo : lo + step]],
                    namespace="h",
                    timeout=600,
                )
                for lo in range(0, a.rows, step)
            )
        )
        out["load_s"] = round(time.perf_counter() - t0, 2)
        queries = [
            " ".join(rng.choice(WORDS + [f"w{i}" for i in range(50)], int(rng.integers(2, 6))))
            for _ in range(a.queries)
        ]
        t = time.perf_counter()
        await pool.recall_text(queries[0], k=a.k, namespace="h", hybrid=Hybrid(0.5), timeout=600)
        out["first_hybrid_ms"] = round((time.perf_counter() - t) * 1e3, 2)  # builds the index
        dense: list[int] = []
        hybrid: list[int] = []
        samples: list[tuple[str, np.ndarray, np.ndarray]] = []
        for q in queries:
            t = time.perf_counter_ns()
            await pool.recall_text(q, k=a.k, namespace="h")
            dense.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            hits = await pool.recall_text(q, k=a.k, namespace="h", hybrid=Hybrid(0.5))
            hybrid.append(time.perf_counter_ns() - t)
            if len(samples) < a.keep:
                samples.append((q, hits.ids.copy(), hits.scores.copy()))
        vec_q = await pool.embed([s[0] for s in samples]) if samples else np.empty((0, dim))
    for label, lat in (("dense", dense), ("hybrid", hybrid)):
        arr = np.asarray(lat) / 1e3
        out[label] = {f"p{p}_us": round(float(np.percentile(arr, p)), 1) for p in (50, 95, 99)}
    out["hybrid_over_dense_p50"] = round(out["hybrid"]["p50_us"] / out["dense"]["p50_us"], 3)
    out["checked"], out["wrong"] = check(samples, vec_q, vectors, texts, a.k) if a.rows <= a.check_rows else (0, 0)
    return out


def check(
    samples: list[tuple[str, np.ndarray, np.ndarray]], vq: np.ndarray, vectors: np.ndarray, texts: list[str], k: int
) -> tuple[int, int]:
    """Each sampled hybrid answer against rank_bm25 + numpy float64 (cosine sidecar)."""
    import rank_bm25

    from kalos.broker.lexical import tokenize

    bm = rank_bm25.BM25Okapi([tokenize(t) for t in texts])
    unit = vectors.astype(np.float64) / np.linalg.norm(vectors, axis=1, keepdims=True)
    wrong = 0
    for (q, ids, scores), v in zip(samples, vq):
        lex = np.maximum(bm.get_scores(tokenize(q)), 0.0)
        top = lex.max()
        fused = unit @ (v / np.linalg.norm(v)) + (0.5 * lex / top if top > 0 else 0.0)
        kth = np.sort(fused)[::-1][k - 1]
        if len(ids) != k or (fused[ids] < kth - 1e-4).any() or (np.abs(fused[ids] - scores) > 1e-4).any():
            wrong += 1
    return len(samples), wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--keep", type=int, default=20)
    ap.add_argument("--check-rows", type=int, default=200_000, help="float64 check up to this many rows")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from kalos.sidecar_cuda.embedding import TextEncoder

    dim = TextEncoder(Path(a.model)).dim
    name = f"hyb{os.getpid()}"
    proc = start_sidecar_process(
        ["--ephemeral", "--dim", str(dim), "--metric", "cosine", "--embed", a.model, "--backend", a.backend,
         "--payload-limit", "4096"], name, timeout=300,
    )  # fmt: skip
    try:
        res = asyncio.run(run(a, name, dim))
        res["sidecar_rss_mb"] = round(rss_mb(proc.pid), 1)
    finally:
        stop_sidecar_process(proc)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps(
                {
                    "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
                    "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "environment": environment(),
                    "rows": a.rows,
                    "result": res,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
