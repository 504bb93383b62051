"""Recalls carrying several rows each (``recall_many``, coalescing pools) are served on the
sidecar's UNIFORM route: one search for every row of every slot of a batch, answers scattered
back to each slot's rows. Checked against float64 on a real sidecar, and the route is read back
from the sidecar's own per-route batch counter (a test that only checked answers would also pass
on the general route)."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest
from conftest import assert_topk, free_port

from kalos.clients import RecallPool


def routes(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kalos_batches_by_route_total{"):
            out[line.split('route="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("pipeline", ["off", "on"])
@pytest.mark.asyncio
async def test_concurrent_recall_many_are_searched_as_one_uniform_batch(sidecar_factory, seed, pipeline):
    port = free_port()
    h = sidecar_factory(
        "mq",
        "--dim",
        "32",
        "--random-rows",
        "3000",
        "--seed",
        str(seed),
        "--slots",
        "32",
        "--max-k",
        "64",
        "--max-queries",
        "8",
        "--backend",
        "numpy",
        "--pipeline",
        pipeline,
        "--metrics-port",
        str(port),
    )
    matrix = np.random.default_rng(seed).standard_normal((3000, 32), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    jobs = [
        (rng.standard_normal((int(rng.integers(2, 9)), 32)).astype(np.float32), int(rng.integers(1, 65)))
        for _ in range(300)
    ]
    async with RecallPool(h.name, size=16) as pool:
        sem = asyncio.Semaphore(16)

        async def one(q: np.ndarray, k: int) -> list:
            async with sem:
                return await pool.recall_many(q, k, timeout=30)

        outs = await asyncio.gather(*(one(q, k) for q, k in jobs))
    for (q, k), hits in zip(jobs, outs):
        assert len(hits) == len(q)
        for row, hit in zip(q, hits):
            assert len(hit) == k
            assert_topk(row, matrix, hit.ids, hit.scores, k)
    r = routes(port)
    assert r["general"] == 0, r  # every batch of multi-row recalls stayed off the general route
    assert r["uniform"] >= 1 and r["single"] == 0, r


@pytest.mark.asyncio
async def test_a_multi_row_recall_next_to_a_bad_one_still_gets_its_answer(sidecar_factory, seed):
    """A batch mixing several-row recalls with one the uniform route cannot take (payloads
    requested) is served request by request, each still exact."""
    port = free_port()
    h = sidecar_factory(
        "mq2",
        "--dim",
        "32",
        "--random-rows",
        "2000",
        "--seed",
        str(seed),
        "--slots",
        "16",
        "--max-k",
        "64",
        "--max-queries",
        "8",
        "--backend",
        "numpy",
        "--metrics-port",
        str(port),
    )
    matrix = np.random.default_rng(seed).standard_normal((2000, 32), dtype=np.float32)
    rng = np.random.default_rng(seed + 2)
    async with RecallPool(h.name, size=8) as pool:
        qs = [rng.standard_normal((3, 32)).astype(np.float32) for _ in range(40)]
        calls = [pool.recall_many(q, 7, timeout=30, with_payload=(i % 5 == 0)) for i, q in enumerate(qs)]
        outs = await asyncio.gather(*calls)
    for q, hits in zip(qs, outs):
        for row, hit in zip(q, hits):
            assert_topk(row, matrix, hit.ids, hit.scores, 7)
    assert sum(routes(port).values()) >= 1
