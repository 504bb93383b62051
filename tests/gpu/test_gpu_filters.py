"""Filtered search on the CUDA backend (over-fetched or gathered candidate rows) against a numpy
float64 reference. Skipped where CuPy or a CUDA device is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.broker.layout import Metric
from kalos.broker.validation import parse_where
from kalos.sidecar_cuda.backends.base import Subset, prepare_queries, prepare_rows
from kalos.sidecar_cuda.backends.cuda import HALF_K, cuda_available
from kalos.sidecar_cuda.backends.cuda.planner import SearchPath, cheap_k
from kalos.sidecar_cuda.storage.store import Namespace

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]
REL_TOL = {"float32": 2e-5, "float16": 3 * 2.0**-11, "bfloat16": 3 * 2.0**-9}


@pytest.fixture(scope="module", params=list(REL_TOL))
def backend(request):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype=request.param, host_work=0)  # (the kernels: host path in test_gpu_host_path.py)
    yield be
    be.close()


def test_a_filtered_search_refuses_a_named_path(backend, rng):
    """A search ``within`` candidates takes the planner's paths, round by round: naming one is a
    ValueError, and nothing is searched."""
    m = backend.new_matrix(8, 100, Metric.DOT)
    m.write_rows(np.arange(100), rng.standard_normal((100, 8), dtype=np.float32))
    q = rng.standard_normal((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="planner's paths"):
        m.search(q, 100, 5, within=Subset(np.arange(0, 100, 2)), path=SearchPath.GEMM)
    rows, _ = m.search(q, 100, 5, within=Subset(np.arange(0, 100, 2)))
    assert (rows % 2 == 0).all()


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2], ids=lambda m: m.name)
@pytest.mark.parametrize(
    "n,d,k,b,frac",
    [
        (1000, 16, 10, 1, 0.001),
        (5000, 128, 10, 4, 0.01),
        (20000, 96, 100, 3, 0.1),
        (20000, 64, 1024, 2, 0.5),
        (3001, 32, 7, 70, 1.0),
        (50, 8, 64, 1, 0.5),
        (20000, 64, 10, 5, 0.3),
        (20000, 64, 10, 8, 0.5),
    ],
)
def test_search_within_matches_float64(backend, rng, metric, n, d, k, b, frac):
    x = prepare_rows(rng.standard_normal((n, d), dtype=np.float32), metric)
    m = backend.new_matrix(d, n, metric)
    m.write_rows(np.arange(n), x)
    cand = np.sort(rng.choice(n, max(1, int(n * frac)), replace=False)).astype(np.int64)
    q = np.ascontiguousarray(prepare_queries(rng.standard_normal((b, d), dtype=np.float32), metric))
    rows, scores = m.search(q, n, k, within=Subset(cand))
    kk = min(k, len(cand))
    assert rows.shape == (b, kk) and np.isin(rows, cand).all()
    q64, x64 = q.astype(np.float64), x[cand].astype(np.float64)
    ref = q64 @ x64.T
    if metric == Metric.L2:
        ref = 2 * ref - (x64 * x64).sum(1)[None] - (q64 * q64).sum(1)[:, None]
    scale = np.linalg.norm(q64, axis=1) * np.linalg.norm(x64, axis=1).max()
    if metric == Metric.L2:
        scale = (np.linalg.norm(q64, axis=1) + np.linalg.norm(x64, axis=1).max()) ** 2
    tol = REL_TOL[backend.storage_dtype] * scale + 1e-6
    kth = -np.partition(-ref, kk - 1, axis=1)[:, kk - 1]
    full = q64 @ x.astype(np.float64).T
    if metric == Metric.L2:
        full = 2 * full - (x.astype(np.float64) ** 2).sum(1)[None] - (q64 * q64).sum(1)[:, None]
    for i in range(b):
        assert len(np.unique(rows[i])) == kk
        true = full[i, rows[i]]
        assert (true >= kth[i] - tol[i]).all()
        assert (np.abs(scores[i] - true) <= tol[i]).all()


def test_namespace_filtered_search_on_cuda(backend, rng):
    ns = Namespace("g", backend, 16, Metric.DOT, capacity=64)
    n = 3000
    x = rng.standard_normal((n, 16), dtype=np.float32)
    pls = [json.dumps({"c": int(c)}).encode() for c in rng.integers(10, size=n)]
    ns.upsert(np.arange(n, dtype=np.int64), x, pls)
    ns.delete(np.arange(0, n, 7, dtype=np.int64))  # compaction moves rows and their columns
    node = parse_where({"c": {"$in": [1, 2]}})
    alive = np.setdiff1d(np.arange(n), np.arange(0, n, 7))
    match = alive[[json.loads(pls[i])["c"] in (1, 2) for i in alive]]
    q = rng.standard_normal((2, 16), dtype=np.float32)
    ids, scores = ns.search(q, 50, match=ns.where(node))
    ref = q.astype(np.float64) @ x[match].astype(np.float64).T
    assert np.isin(ids, match).all() and ids.shape == (2, 50)
    tol = REL_TOL[backend.storage_dtype] * np.abs(ref).max() * 4 + 1e-5
    np.testing.assert_allclose(scores, -np.sort(-ref, axis=1)[:, :50], atol=tol)


def _check_top(q, x, rows, scores, cand, k, rel):
    tol = rel * 2 * np.linalg.norm(q, axis=1).max() * np.linalg.norm(x, axis=1).max() + 1e-5
    ref = q.astype(np.float64) @ x.astype(np.float64).T
    kk = min(k, len(cand))
    assert rows.shape == (len(q), kk) and np.isin(rows, cand).all()
    best = -np.sort(-ref[:, cand], axis=1)[:, :kk]
    np.testing.assert_allclose(scores, best, atol=tol)
    np.testing.assert_allclose(np.take_along_axis(ref, rows, 1), best, atol=tol)


def test_filtered_paths_cache_and_invalidation(backend, rng):
    """Which way a filtered search went is counted: over-fetch when half the rows match,
    gathered (and its copy reused under the same key) at 1 %, the copy dropped by a write; a
    filter that matches the rows scoring worst for the query makes the over-fetch proof fail, and those
    queries are redone gathered, still exact."""
    n, d, k = 40000, 64, 10
    x = rng.standard_normal((n, d), dtype=np.float32)
    m = backend.new_matrix(d, n, Metric.DOT)
    m.write_rows(np.arange(n), x)
    tol = REL_TOL[backend.storage_dtype]
    q = rng.standard_normal((6, d), dtype=np.float32)
    half = np.sort(rng.choice(n, n // 2, replace=False)).astype(np.int64)

    def over() -> int:
        return sum(v for kk, v in m.filter_stats.items() if kk.startswith("overfetch_"))

    o0, g0 = over(), m.filter_stats["gathered"]
    rows, scores = m.search(q[:1], n, k, within=Subset(half, ("v0", b"half")))  # one query: fused, over-fetched
    _check_top(q[:1], x, rows, scores, half, k, tol)
    assert over() == o0 + 1 and m.filter_stats["gathered"] == g0
    rows, scores = m.search(q, n, k, within=Subset(half, ("v0", b"half")))  # a batch of 6
    _check_top(q, x, rows, scores, half, k, tol)
    # 6 x 40 000 scores are below HALF_WORK_MIN: the float32 GEMM serves this batch on every
    # dtype, so k' = 32 is as cheap as k' = 16 and proves it (the half-score path's choice to
    # gather instead is planner.filtered_plan's, tested in tests/unit/test_filters.py).
    assert cheap_k(m.plan(6, n, HALF_K).path) == 32
    assert over() == o0 + 7 and m.filter_stats["gathered"] == g0
    before = dict(m.filter_stats)
    few = np.sort(rng.choice(n, n // 100, replace=False)).astype(np.int64)
    for _ in range(2):
        rows, scores = m.search(q, n, k, within=Subset(few, ("v0", b"few")))
        _check_top(q, x, rows, scores, few, k, tol)
    assert m.filter_stats["gathered"] - before["gathered"] == 12
    assert m.filter_stats["gather_reused"] - before["gather_reused"] == 6
    x[few[:50]] = 10 * rng.standard_normal((50, d), dtype=np.float32)  # the gathered copy is stale
    m.write_rows(few[:50], x[few[:50]])
    rows, scores = m.search(q, n, k, within=Subset(few, ("v0", b"few")))  # (same key: still not reused)
    _check_top(q, x, rows, scores, few, k, tol)
    assert m.filter_stats["gather_reused"] - before["gather_reused"] == 6
    worst = np.sort(np.argsort(q[0].astype(np.float64) @ x.astype(np.float64).T)[: n // 2]).astype(np.int64)
    g0 = m.filter_stats["gathered"]
    rows, scores = m.search(q[:1], n, k, within=Subset(worst))
    _check_top(q[:1], x, rows, scores, worst, k, tol)
    assert m.filter_stats["gathered"] == g0 + 1  # the proof failed: redone gathered
