"""The CUDA backend's host path: tiny searches scored on the CPU from a copy of the stored rows.

Checked against a numpy float64 reference of the rows *as stored* (read back from the device), and
against the fused kernel on the same rows; the copy must follow every write, move and growth.
Skipped at collection where CuPy or a CUDA device is missing (CI has neither).
"""

from __future__ import annotations

import numpy as np
import pytest

from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.base import Subset
from kalos.sidecar_cuda.backends.cuda import WARP_K, SearchPath, cuda_available
from kalos.sidecar_cuda.backends.cuda.planner import HALF_K, HALF_WORK_MIN, HOST_WORK, cheap_k

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]


@pytest.fixture(scope="module", params=("float32", "float16", "bfloat16"))
def backend(request):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype=request.param)  # the default --host-search-work
    assert be.host_work == HOST_WORK > 0
    assert be.warm_s > 0 and be.stats.by_path == {} and len(be.device.graphs) == 0  # warmed up, nothing left over
    yield be
    be.close()


def ref_topk(q: np.ndarray, x: np.ndarray, l2: bool, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 scores of q against the stored rows x, and the k-th best per query."""
    s = q.astype(np.float64) @ x.astype(np.float64).T
    if l2:
        s = 2 * s - (x.astype(np.float64) ** 2).sum(1)[None, :] - (q.astype(np.float64) ** 2).sum(1)[:, None]
    kk = min(k, x.shape[0])
    return s, -np.partition(-s, kk - 1, axis=1)[:, kk - 1]


def assert_exact(q: np.ndarray, x: np.ndarray, l2: bool, k: int, rows: np.ndarray, scores: np.ndarray) -> None:
    s, kth = ref_topk(q, x, l2, k)
    scale = np.abs(s).max() + 1.0
    tol = 1e-5 * scale
    for i in range(len(q)):
        assert len(set(rows[i].tolist())) == rows.shape[1]
        true = s[i, rows[i]]
        assert (true >= kth[i] - tol).all(), (i, true, kth[i])
        assert np.abs(true - scores[i]).max() <= tol
        assert (np.diff(scores[i]) <= 0).all()


@pytest.mark.parametrize("metric", (Metric.DOT, Metric.L2))
def test_a_lone_tiny_search_takes_the_host_path_and_is_exact(backend, metric, seed):
    rng = np.random.default_rng(seed)
    n, d = 256, 100  # padded to 104 (float32) / 104 (16-bit): 26 624 <= HOST_WORK
    m = backend.new_matrix(d, 300, metric)
    m.write_rows(np.arange(n), rng.standard_normal((n, d), dtype=np.float32) * 3)
    stored = m.read_rows(np.arange(n))
    backend.stats.clear()
    for k in (1, 10, 64, 300):  # any k, up to more than the rows
        q = rng.standard_normal((1, d), dtype=np.float32)
        rows, scores = m.search(q, n, k)
        assert rows.shape == (1, min(k, n)) and rows.dtype == np.int64 and scores.dtype == np.float32
        assert_exact(q, stored, metric == Metric.L2, k, rows, scores)
    assert set(backend.stats.by_path) == {(SearchPath.HOST, "1")}, backend.stats.by_path
    # The same answers as the fused kernel on the same rows.
    q = rng.standard_normal((1, d), dtype=np.float32)
    _r_host, s_host = m.search(q, n, 10)
    _r_gpu, s_gpu = m.search(q, n, 10, path=SearchPath.FUSED)
    assert np.allclose(s_host, s_gpu, rtol=1e-5, atol=1e-4)
    assert (SearchPath.FUSED, "1") in backend.stats.by_path


def test_the_host_copy_follows_writes_moves_and_growth(backend, seed):
    rng = np.random.default_rng(seed)
    d = 32
    m = backend.new_matrix(d, 64, Metric.DOT)
    x = rng.standard_normal((64, d), dtype=np.float32)
    m.write_rows(np.arange(64), x)
    q = rng.standard_normal((1, d), dtype=np.float32)
    m.search(q, 64, 1, path=SearchPath.HOST)  # (takes the copy)
    # A write makes row 5 the clear best; the copy taken above must not answer any more.
    m.write_rows(np.array([5]), (q * 100).astype(np.float32))
    assert m.search(q, 64, 1, path=SearchPath.HOST)[0][0, 0] == 5
    # A move: row 5's vector goes to row 40.
    m.move_rows(np.array([5]), np.array([40]))
    assert m.search(q, 64, 1, path=SearchPath.HOST)[0][0, 0] == 40
    # Growth, then a row past the old end: a search over more rows than the copy held.
    m.grow(200)
    m.write_rows(np.array([150]), (q * 1000).astype(np.float32))
    rows, _ = m.search(q, 151, 3, path=SearchPath.HOST)
    assert rows[0, :2].tolist() == [150, 40]
    # A shorter n than the copy holds is served from the copy: rows >= n never answer.
    rows, _ = m.search(q, 40, 64, path=SearchPath.HOST)
    assert rows.max() < 40


def test_row_ids_and_async_on_the_host_path(backend, seed):
    rng = np.random.default_rng(seed)
    d = 16
    m = backend.new_matrix(d, 50, Metric.DOT)
    x = rng.standard_normal((50, d), dtype=np.float32)
    m.write_rows(np.arange(50), x)
    ids = np.arange(1000, 1050, dtype=np.int64)
    q = rng.standard_normal((3, d), dtype=np.float32)
    fut = m.search_start(q, 50, 5, row_ids=ids)
    assert fut.done()  # answered on the host at once
    rows, scores = fut.result()
    assert rows.min() >= 1000
    assert_exact(q, m.read_rows(np.arange(50)), False, 5, rows - 1000, scores)


def test_larger_work_stays_on_the_gpu(backend, seed):
    rng = np.random.default_rng(seed)
    d = 128
    n = HOST_WORK // d + 1  # one row more than the host path takes for one query
    m = backend.new_matrix(d, n, Metric.DOT)
    m.write_rows(np.arange(n), rng.standard_normal((n, d), dtype=np.float32))
    backend.stats.clear()
    m.search(rng.standard_normal((1, d), dtype=np.float32), n, 10)
    m.search(rng.standard_normal((1, d), dtype=np.float32), n - 1, 10)
    assert set(backend.stats.by_path) == {(SearchPath.FUSED, "1"), (SearchPath.HOST, "1")}, backend.stats.by_path


def test_filtered_search_of_every_row_is_the_plain_search(backend, seed):
    rng = np.random.default_rng(seed)
    d, n = 24, 120
    m = backend.new_matrix(d, n, Metric.DOT)
    m.write_rows(np.arange(n), rng.standard_normal((n, d), dtype=np.float32))
    q = rng.standard_normal((2, d), dtype=np.float32)
    before = m.filter_stats.get("all_rows", 0)
    got = m.search(q, n, 7, within=Subset(np.arange(n)))
    assert m.filter_stats["all_rows"] == before + 2
    want = m.search(q, n, 7)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    # A subset still answers only candidates, exactly.
    cand = np.sort(rng.choice(n, 30, replace=False))
    rows, scores = m.search(q, n, 7, within=Subset(cand))
    assert np.isin(rows, cand).all()
    assert_exact(q, m.read_rows(cand), False, 7, np.searchsorted(cand, rows), scores)


def test_cheap_overfetch_k_follows_the_half_score_path(backend, seed):
    """HALF_K only where the unfiltered search would take the half-score GEMM (float16 storage,
    at least HALF_WORK_MIN scores); elsewhere the float32 paths over-fetch 32 as cheaply."""
    m = backend.new_matrix(8, 16, Metric.DOT)
    m.write_rows(np.arange(16), np.random.default_rng(seed).standard_normal((16, 8), dtype=np.float32))
    big_n = HALF_WORK_MIN // 64
    want_big = HALF_K if backend.storage_dtype == "float16" else WARP_K
    assert cheap_k(m.plan(64, big_n, HALF_K).path) == want_big
    assert cheap_k(m.plan(64, big_n // 4, HALF_K).path) == WARP_K  # below HALF_WORK_MIN: the float32 GEMM
    assert cheap_k(m.plan(1, 16, HALF_K).path) == WARP_K  # host path
