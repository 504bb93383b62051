"""The broker end to end with ``--backend cuda``: a real sidecar process on the GPU, real client
processes and tasks over shared memory, answers checked against numpy float64 (seeds printed).

Skipped at collection, with the reason, where CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import assert_topk

from kalos.clients import RecallPool
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.backends.cuda import cuda_available
from kalos.testing.loadgen import LoadSpec, check_samples, run_load

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]


@pytest.fixture(params=["float32", "float16"])
def gpu_sidecar(request, sidecar_factory, seed):
    dtype = request.param
    h = sidecar_factory(
        "gpu",
        "--backend",
        "cuda",
        "--dtype",
        dtype,
        "--dim",
        "64",
        "--random-rows",
        "20000",
        "--seed",
        str(seed),
        "--slots",
        "48",
        "--max-k",
        "128",
        "--max-queries",
        "8",
    )
    h.matrix = np.random.default_rng(seed).standard_normal((20000, 64), dtype=np.float32)
    h.rtol = 1e-5 if dtype == "float32" else 2e-3
    c = Connection(h.name)
    try:
        assert int(c.seg.header["backend"]) == 2, "the sidecar under test is not on the CUDA backend"
    finally:
        c.close()
    return h


@pytest.mark.asyncio
async def test_cuda_sidecar_recalls_match_reference(gpu_sidecar, rng):
    h = gpu_sidecar
    async with RecallPool(h.name, size=16) as pool:
        qs = rng.standard_normal((120, 64)).astype(np.float32)
        ks = rng.integers(1, 129, size=120)
        hits = await asyncio.gather(*(pool.recall(q, int(k)) for q, k in zip(qs, ks)))
        for q, k, hit in zip(qs, ks, hits):
            assert_topk(q, h.matrix, hit.ids, hit.scores, int(k), rtol=h.rtol)
        # Uniform batches of k = 10.
        hits = await asyncio.gather(*(pool.recall(q, 10) for q in qs))
        for q, hit in zip(qs, hits):
            assert_topk(q, h.matrix, hit.ids, hit.scores, 10, rtol=h.rtol)
        many = await pool.recall_many(qs[:8], k=17)
        for q, hit in zip(qs[:8], many):
            assert_topk(q, h.matrix, hit.ids, hit.scores, 17, rtol=h.rtol)
        # Writes go to the device rows: upsert, replace, delete, then recall sees them.
        new = rng.standard_normal((50, 64)).astype(np.float32) * 4.0
        ids = np.arange(100_000, 100_050)
        assert await pool.upsert(ids, new) == 50
        hit = await pool.recall(new[7], 3)
        assert hit.ids[0] == 100_007
        assert await pool.delete(ids[:25]) == 25
        matrix = np.vstack([h.matrix, new[25:]])
        id_of = np.concatenate([np.arange(20000), ids[25:]])
        for q in qs[:20]:
            hit = await pool.recall(q, 10)
            rows = np.searchsorted(id_of, hit.ids)
            assert (id_of[rows] == hit.ids).all(), "a deleted or unknown id came back"
            assert_topk(q, matrix, rows, hit.scores, 10, rtol=h.rtol)


def test_cuda_sidecar_under_load_from_processes(gpu_sidecar, seed):
    h = gpu_sidecar
    res = run_load(
        LoadSpec(
            name=h.name,
            dim=64,
            procs=4,
            tasks=32,
            duration_s=1.5,
            warmup_s=0.2,
            k=10,
            seed=seed,
            keep=300,
            loop="asyncio",
        )
    )
    assert res.errors == 0 and res.count > 100
    checked, wrong = check_samples(res.samples, h.matrix, 10, rtol=h.rtol)
    assert checked > 0 and wrong == 0
