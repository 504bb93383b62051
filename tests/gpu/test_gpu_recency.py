"""Recency-weighted search on the CUDA backend (issue 26): the GEMM path with each row's recency
part added before its top-k kernel, the host path, filtered searches (over-fetched and gathered)
and the store's expiry, against a numpy float64 reference. Every test asserts the path it claims
ran (the backend's per-path counts). Skipped where CuPy or a CUDA device is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.broker.clock import NS, decay_part
from kalos.broker.layout import Metric
from kalos.broker.validation import parse_where
from kalos.sidecar_cuda.backends.base import Decay, Subset, prepare_queries, prepare_rows
from kalos.sidecar_cuda.backends.cuda import cuda_available
from kalos.sidecar_cuda.backends.cuda.planner import SearchPath
from kalos.sidecar_cuda.storage.store import MemoryStore, Stamps

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]
REL_TOL = {"float32": 2e-5, "float16": 3 * 2.0**-11, "bfloat16": 3 * 2.0**-9}
T0 = 1_800_000_000 * NS


@pytest.fixture(scope="module", params=list(REL_TOL))
def backend(request):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype=request.param, host_work=0)
    yield be
    be.close()


def _stored(x: np.ndarray, storage: str) -> np.ndarray:
    """The rows as the device stores them, in float64."""
    if storage == "float16":
        return x.astype(np.float16).astype(np.float64)
    return x.astype(np.float64)


def _check(ref: np.ndarray, rows: np.ndarray, scores: np.ndarray, k: int, allowed: np.ndarray, tol: float) -> None:
    kk = min(k, len(allowed))
    assert rows.shape == (kk,) and len(np.unique(rows)) == kk and np.isin(rows, allowed).all()
    kth = np.sort(ref[allowed])[::-1][kk - 1]
    true = ref[rows]
    assert (true >= kth - tol).all(), "a row outside the true top-k"
    np.testing.assert_allclose(scores, true, atol=tol, rtol=0)


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2], ids=lambda m: m.name)
@pytest.mark.parametrize("n,d,k,b", [(20000, 64, 10, 1), (30000, 96, 100, 3), (5000, 32, 1024, 2), (70000, 128, 32, 8)])
def test_recency_search_is_exact_on_the_gemm_path(backend, rng, metric, n, d, k, b):
    x = prepare_rows(rng.standard_normal((n, d), dtype=np.float32), metric)
    m = backend.new_matrix(d, n, metric)
    m.write_rows(np.arange(n), x)
    upd = T0 - rng.integers(0, 3600 * NS, n)
    m.set_times(np.arange(n), upd)
    q = np.ascontiguousarray(prepare_queries(rng.standard_normal((b, d), dtype=np.float32), metric))
    xs, q64 = _stored(x, backend.storage_dtype), q.astype(np.float64)
    sim = q64 @ xs.T
    if metric == Metric.L2:
        sim = 2 * sim - (xs * xs).sum(1)[None] - (q64 * q64).sum(1)[:, None]
    scale = float(np.abs(sim).max())
    # The error bound of the storage's rounding (rows and, on the 16-bit GEMM, queries): as the
    # other GPU tests, relative to |q| max|x| (l2: (|q| + max|x|)^2).
    qn, xn = float(np.linalg.norm(q64, axis=1).max()), float(np.linalg.norm(xs, axis=1).max())
    bound = (qn + xn) ** 2 if metric == Metric.L2 else qn * xn
    for half_life, weight in ((600.0, 0.5 * scale), (60.0, 2.0 * scale), (1e6, -0.3 * scale)):
        decay = Decay(T0, half_life, weight)
        before = backend.stats.count(SearchPath.GEMM)
        rows, scores = m.search(q, n, k, decay=decay)
        assert backend.stats.count(SearchPath.GEMM) == before + 1, "not the GEMM path"
        ref = sim + decay_part(upd, T0, half_life, weight)[None]
        tol = REL_TOL[backend.storage_dtype] * bound + 1e-5 * (scale + abs(weight))
        for i in range(b):
            _check(ref[i], rows[i], scores[i], k, np.arange(n), tol)
    # A moved row carries the time the store sets again (a compaction after a delete).
    m.move_rows(np.array([n - 1]), np.array([0]))
    m.set_times(np.array([0]), upd[n - 1 : n])
    sim2, upd2 = sim[:, : n - 1].copy(), upd[: n - 1].copy()
    sim2[:, 0], upd2[0] = sim[:, n - 1], upd[n - 1]
    decay = Decay(T0, 30.0, 3 * scale)
    rows, scores = m.search(q, n - 1, k, decay=decay)
    ref = sim2 + decay_part(upd2, T0, 30.0, 3 * scale)[None]
    for i in range(b):
        _check(
            ref[i], rows[i], scores[i], k, np.arange(n - 1), REL_TOL[backend.storage_dtype] * scale * 4 + 1e-4 * scale
        )


def test_recency_search_on_the_host_path_and_a_forced_path_is_refused(rng):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype="float32")  # (the default host work: small searches on the CPU)
    try:
        n, d = 200, 16
        x = rng.standard_normal((n, d), dtype=np.float32)
        m = be.new_matrix(d, n, Metric.DOT)
        m.write_rows(np.arange(n), x)
        upd = T0 - rng.integers(0, 100 * NS, n)
        m.set_times(np.arange(n), upd)
        q = rng.standard_normal((1, d), dtype=np.float32)
        decay = Decay(T0, 30.0, 3.0)
        before = be.stats.count(SearchPath.HOST)
        rows, scores = m.search(q, n, 10, decay=decay)
        assert be.stats.count(SearchPath.HOST) == before + 1
        ref = x.astype(np.float64) @ q[0].astype(np.float64) + decay_part(upd, T0, 30.0, 3.0)
        _check(ref, rows[0], scores[0], 10, np.arange(n), 1e-4)
        with pytest.raises(ValueError, match="recency-weighted"):
            m.search(q, n, 10, path=SearchPath.FUSED, decay=decay)
    finally:
        be.close()


@pytest.mark.parametrize("frac", [0.002, 0.05, 0.5, 0.9])
def test_filtered_recency_search_over_fetched_or_gathered(backend, rng, frac):
    n, d, k = 40000, 64, 10
    x = rng.standard_normal((n, d), dtype=np.float32)
    m = backend.new_matrix(d, n, Metric.DOT)
    m.write_rows(np.arange(n), x)
    upd = T0 - rng.integers(0, 600 * NS, n)
    m.set_times(np.arange(n), upd)
    cand = np.sort(rng.choice(n, max(1, int(n * frac)), replace=False)).astype(np.int64)
    q = rng.standard_normal((4, d), dtype=np.float32)
    xs = _stored(x, backend.storage_dtype)
    sim = q.astype(np.float64) @ xs.T
    scale = float(np.abs(sim).max())
    bound = float(np.linalg.norm(q, axis=1).max() * np.linalg.norm(xs, axis=1).max())
    decay = Decay(T0, 120.0, scale)
    before = backend.stats.count(SearchPath.GEMM)
    rows, scores = m.search(q, n, k, within=Subset(cand, ("t", frac)), decay=decay)
    assert backend.stats.count(SearchPath.GEMM) > before, "not the GEMM path"
    ref = sim + decay_part(upd, T0, 120.0, scale)[None]
    for i in range(len(q)):
        _check(ref[i], rows[i], scores[i], k, cand, REL_TOL[backend.storage_dtype] * bound + 2e-5 * scale)


def test_store_recency_with_expiry_and_a_filter_on_cuda(backend, rng):
    clock = [T0]
    store = MemoryStore(backend, 32, Metric.COSINE, clock=lambda: clock[0])
    ns = store.get_or_create("g", capacity=64)
    n = 6000
    x = rng.standard_normal((n, 32), dtype=np.float32)
    upd = T0 - rng.integers(0, 3600 * NS, n)
    exp = np.where(rng.random(n) < 0.3, T0 - 1, 0)  # 30 % expired now, not swept
    ns.upsert(
        np.arange(n), x, [json.dumps({"c": int(i % 3)}).encode() for i in range(n)], Stamps(upd, upd, exp, exp * 0)
    )
    q = rng.standard_normal((2, 32), dtype=np.float32)
    decay = Decay(T0, 900.0, 0.2)
    xs = _stored(x / np.linalg.norm(x, axis=1, keepdims=True), backend.storage_dtype)
    qn = q.astype(np.float64) / np.linalg.norm(q, axis=1, keepdims=True)
    ref = qn @ xs.T + decay_part(upd, T0, 900.0, 0.2)[None]
    alive = np.flatnonzero(exp == 0)
    ids, scores = ns.search(q, 20, decay=decay)
    tol = REL_TOL[backend.storage_dtype] + 1e-5  # (unit rows and queries: |q| |x| = 1)
    for i in range(2):
        _check(ref[i], ids[i], scores[i], 20, alive, tol)
    f = ns.filtered(parse_where({"c": 1}), b"c1")
    ids, scores = ns.search(q, 20, match=f, decay=decay)
    allowed = alive[alive % 3 == 1]
    for i in range(2):
        _check(ref[i], ids[i], scores[i], 20, allowed, tol)
