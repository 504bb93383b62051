"""FusedTopK against numpy float64 on fresh random data (skipped without CuPy or a GPU).

For every query: the float64 scores of the returned rows, sorted, must equal the float64
reference top-k scores within a float32 tolerance (ties aside), the returned scores must be those
rows' scores, and ids must be distinct and in range.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
try:
    _NDEV = cp.cuda.runtime.getDeviceCount()
except Exception:  # no driver
    _NDEV = 0
pytestmark = pytest.mark.skipif(_NDEV < 1, reason="no CUDA device")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused import ALT_CONFIGS, CONFIGS, FusedTopK  # noqa: E402


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def check(x16: np.ndarray, q: np.ndarray, k: int, ids: np.ndarray, scores: np.ndarray,
          what: str) -> None:
    n = x16.shape[0]
    b = q.shape[0]
    kk = min(k, n)
    assert ids.shape == (b, kk) and scores.shape == (b, kk), (what, ids.shape, scores.shape)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    s64 = q.astype(np.float64) @ x16.astype(np.float64).T  # (B, N)
    if kk < n:
        ref = -np.sort(-np.partition(s64, n - kk, axis=1)[:, n - kk:], axis=1)
    else:
        ref = -np.sort(-s64, axis=1)
    xmax = float(np.sqrt((x16.astype(np.float64) ** 2).sum(1)).max())
    tol = 1e-5 * np.linalg.norm(q.astype(np.float64), axis=1) * xmax + 1e-30
    assert (ids >= 0).all() and (ids < n).all(), what
    for i in range(b):
        assert len(set(ids[i].tolist())) == kk, f"{what}: duplicate ids for query {i}"
    got = np.take_along_axis(s64, ids, axis=1)
    err_set = np.abs(-np.sort(-got, axis=1) - ref).max(axis=1)
    bad = np.flatnonzero(err_set > tol)
    assert bad.size == 0, f"{what}: {bad.size} queries wrong, first {bad[:5]}, err {err_set[bad[:5]]}, tol {tol[bad[:5]]}"
    err_sc = np.abs(scores.astype(np.float64) - got).max(axis=1)
    bad = np.flatnonzero(err_sc > tol)
    assert bad.size == 0, f"{what}: reported scores off for {bad.size} queries ({err_sc[bad[:5]]})"
    # best first
    assert (np.diff(scores, axis=1) <= 0).all(), f"{what}: scores not sorted"


def run_case(n: int, d: int, b: int, k: int, scale: float = 1.0) -> FusedTopK:
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = (rng.standard_normal((n, d), dtype=np.float32) * scale).astype(np.float16)
    q = rng.standard_normal((b, d), dtype=np.float32)
    ft = FusedTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), k)
    check(x16, q, k, cp.asnumpy(ids), cp.asnumpy(scores), f"n={n} d={d} b={b} k={k} seed={seed}")
    return ft


@pytest.mark.parametrize("n,d,b,k", [
    (1000, 64, 1, 1),
    (5000, 64, 7, 10),
    (10007, 128, 16, 10),
    (10007, 128, 33, 32),
    (20011, 768, 64, 10),
    (20000, 768, 128, 10),
    (30001, 768, 256, 10),
    (8000, 1536, 40, 10),
    (12345, 768, 100, 100),
    (6000, 128, 256, 100),
    (9000, 64, 200, 1),
    (4000, 128, 5, 64),
])
def test_shapes(n: int, d: int, b: int, k: int) -> None:
    run_case(n, d, b, k)


@pytest.mark.parametrize("n,d,b,k", [(50, 64, 5, 100), (300, 64, 3, 32), (127, 128, 17, 10),
                                     (129, 64, 2, 10)])
def test_small_n(n: int, d: int, b: int, k: int) -> None:
    run_case(n, d, b, k)


def test_dim_not_multiple_of_32() -> None:
    run_case(3000, 100, 9, 10)


def test_scaled_data() -> None:
    # tiny and large magnitudes: the query scaling and the error bound must follow
    run_case(4000, 128, 20, 10, scale=1e-3)
    run_case(4000, 128, 20, 10, scale=300.0)


@pytest.mark.parametrize("cfg", list(CONFIGS.values()) + ALT_CONFIGS, ids=lambda c: c.name())
def test_every_shape(cfg) -> None:  # type: ignore[no-untyped-def]
    seed = _seed()
    rng = np.random.default_rng(seed)
    n, d, b, k = 9001, 128, 150, 10
    x16 = rng.standard_normal((n, d), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((b, d), dtype=np.float32)
    ft = FusedTopK(cp.asarray(x16))
    ft.config_override = cfg
    ids, scores = ft.search(cp.asarray(q), k)
    check(x16, q, k, cp.asnumpy(ids), cp.asnumpy(scores), f"{cfg.name()} seed={seed}")


def test_ties_take_the_fallback() -> None:
    # identical rows: every score ties, the proof cannot hold, the float32 path answers
    seed = _seed()
    rng = np.random.default_rng(seed)
    row = rng.standard_normal(64, dtype=np.float32).astype(np.float16)
    x16 = np.tile(row, (2000, 1))
    q = rng.standard_normal((4, 64), dtype=np.float32)
    ft = FusedTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), 10)
    assert ft.fallbacks == 4
    check(x16, q, 10, cp.asnumpy(ids), cp.asnumpy(scores), f"ties seed={seed}")


def test_duplicates_mixed() -> None:
    # many exact duplicates among random rows: near-ties at the cut
    seed = _seed()
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((300, 128), dtype=np.float32).astype(np.float16)
    x16 = base[rng.integers(0, 300, 20000)]
    q = rng.standard_normal((32, 128), dtype=np.float32)
    ft = FusedTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), 10)
    check(x16, q, 10, cp.asnumpy(ids), cp.asnumpy(scores), f"dups seed={seed}")


def test_repeat_is_stable() -> None:
    # the same search twice gives the same scores (a moving answer would be a race)
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = rng.standard_normal((50000, 256), dtype=np.float32).astype(np.float16)
    q = cp.asarray(rng.standard_normal((96, 256), dtype=np.float32))
    ft = FusedTopK(cp.asarray(x16))
    a = [cp.asnumpy(v) for v in ft.search(q, 10)]
    for _ in range(3):
        b = [cp.asnumpy(v) for v in ft.search(q, 10)]
        np.testing.assert_array_equal(a[1], b[1])


def test_rejects_bad_input() -> None:
    ft = FusedTopK(cp.zeros((100, 64), cp.float16))
    with pytest.raises(ValueError):
        ft.search(cp.zeros((2, 64), cp.float32), 129)
    with pytest.raises(ValueError):
        ft.search(cp.zeros((2, 65), cp.float32), 10)
    with pytest.raises(ValueError):
        FusedTopK(cp.zeros((100, 64), cp.float32))


# ---------------------------------------------------------------------- the wgmma variant
# WgmmaTopK (fused_wgmma.py): same contract, wgmma scoring kernel; needs compute capability 9.0
# and nvcc (or cubins built elsewhere in bench/fused/.cubin).
def _wgmma_ok() -> bool:
    try:
        return str(cp.cuda.Device().compute_capability) == "90"
    except Exception:
        return False


wg = pytest.mark.skipif(not _wgmma_ok(), reason="wgmma needs compute capability 9.0")


def run_case_w(n: int, d: int, b: int, k: int, scale: float = 1.0, cfg=None):  # type: ignore[no-untyped-def]
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = (rng.standard_normal((n, d), dtype=np.float32) * scale).astype(np.float16)
    q = rng.standard_normal((b, d), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ft.wconfig_override = cfg
    ids, scores = ft.search(cp.asarray(q), k)
    check(x16, q, k, cp.asnumpy(ids), cp.asnumpy(scores),
          f"wgmma {cfg.name() if cfg else 'default'} n={n} d={d} b={b} k={k} seed={seed}")
    return ft


@wg
@pytest.mark.parametrize("n,d,b,bq", [(1000, 768, 16, 16), (1000, 768, 40, 64), (3001, 128, 128, 128),
                                      (777, 100, 32, 32), (129, 64, 5, 16), (5000, 1536, 200, 128)])
def test_wgmma_raw_scores(n: int, d: int, b: int, bq: int) -> None:
    # the tiny-GEMM check: the FW_DUMP build writes the raw accumulators (scaled query . row, float32
    # accumulation); they must match float64 products of the same float16 inputs
    from fused_wgmma import WConfig, WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = rng.standard_normal((n, d), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((b, d), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ft.wconfig_override = WConfig(bq, dump=1)
    qy = -(-b // bq)
    dump = cp.full((n, qy * bq), np.nan, cp.float32)
    ft.launch(cp.asarray(q), 10, dump=dump)
    qh = cp.asnumpy(ft._last_work["qh"].view(cp.float16)).astype(np.float64)[:b, :d]
    ref = x16.astype(np.float64) @ qh.T  # (n, b)
    got = cp.asnumpy(dump)[:, :b].astype(np.float64)
    assert np.isfinite(got).all(), f"unwritten scores (seed {seed})"
    tol = 1e-5 * np.sqrt((x16.astype(np.float64) ** 2).sum(1))[:, None] * np.linalg.norm(qh, axis=1)[None, :]
    err = np.abs(got - ref)
    assert (err <= tol + 1e-30).all(), f"seed {seed}: max err {err.max()} at {np.unravel_index(err.argmax(), err.shape)}"


@wg
@pytest.mark.parametrize("n,d,b,k", [
    (1000, 64, 1, 1),
    (5000, 64, 7, 10),
    (10007, 128, 16, 10),
    (10007, 128, 33, 32),
    (20011, 768, 64, 10),
    (20000, 768, 128, 10),
    (30001, 768, 256, 10),
    (8000, 1536, 40, 10),
    (12345, 768, 100, 64),
    (6000, 128, 256, 64),
    (9000, 64, 200, 1),
    (4000, 128, 5, 64),
    (50, 64, 5, 32),
    (127, 128, 17, 10),
    (129, 64, 2, 10),
    (3000, 100, 9, 10),
])
def test_wgmma_shapes(n: int, d: int, b: int, k: int) -> None:
    run_case_w(n, d, b, k)


@wg
def test_wgmma_scaled_data() -> None:
    run_case_w(4000, 128, 20, 10, scale=1e-3)
    run_case_w(4000, 128, 20, 10, scale=300.0)


def _wcfgs():  # type: ignore[no-untyped-def]
    from fused_wgmma import W_ALT_CONFIGS, WCONFIGS
    return list(WCONFIGS.values()) + W_ALT_CONFIGS


@wg
@pytest.mark.parametrize("cfg", _wcfgs(), ids=lambda c: c.name())
@pytest.mark.parametrize("k", [1, 10, 32, 64])
def test_wgmma_every_shape(cfg, k: int) -> None:  # type: ignore[no-untyped-def]
    from fused import CAP, LIST_SMEM, kc_for
    if cfg.bq * (kc_for(k) + CAP) * 8 > LIST_SMEM:
        pytest.skip("list too large for this bq (the planner would shrink bq)")
    run_case_w(9001, 128, 150, k, cfg=cfg)


@wg
def test_wgmma_ties_take_the_fallback() -> None:
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    row = rng.standard_normal(64, dtype=np.float32).astype(np.float16)
    x16 = np.tile(row, (2000, 1))
    q = rng.standard_normal((4, 64), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), 10)
    assert ft.fallbacks == 4
    check(x16, q, 10, cp.asnumpy(ids), cp.asnumpy(scores), f"wgmma ties seed={seed}")


@wg
@pytest.mark.parametrize("b,k", [(32, 10), (100, 1), (64, 64)])
def test_wgmma_duplicates_mixed(b: int, k: int) -> None:
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((300, 128), dtype=np.float32).astype(np.float16)
    x16 = base[rng.integers(0, 300, 20000)]
    q = rng.standard_normal((b, 128), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), k)
    check(x16, q, k, cp.asnumpy(ids), cp.asnumpy(scores), f"wgmma dups b={b} k={k} seed={seed}")


@wg
def test_wgmma_repeat_is_stable() -> None:
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = rng.standard_normal((50000, 256), dtype=np.float32).astype(np.float16)
    q = cp.asarray(rng.standard_normal((96, 256), dtype=np.float32))
    ft = WgmmaTopK(cp.asarray(x16))
    a = [cp.asnumpy(v) for v in ft.search(q, 10)]
    for _ in range(3):
        b = [cp.asnumpy(v) for v in ft.search(q, 10)]
        np.testing.assert_array_equal(a[1], b[1])


@wg
@pytest.mark.parametrize("order", ["best_first", "worst_first"])
def test_wgmma_sampled_gate_ordering(order: str) -> None:
    # the sampled starting gate comes from the first rows: rows sorted by norm (largest first: a
    # high gate; smallest first: a weak one) must not change the answer; compare with the gate off
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40000, 128), dtype=np.float32) * rng.uniform(0.2, 3.0, (40000, 1)).astype(np.float32)
    nrm = np.linalg.norm(x, axis=1)
    x16 = x[np.argsort(-nrm if order == "best_first" else nrm)].astype(np.float16)
    q = rng.standard_normal((64, 128), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), 10)
    check(x16, q, 10, cp.asnumpy(ids), cp.asnumpy(scores), f"wgmma sampled gate {order} seed={seed}")
    ft.sample_min_b = 10**9  # gate off
    ids2, scores2 = ft.search(cp.asarray(q), 10)
    np.testing.assert_array_equal(cp.asnumpy(scores), cp.asnumpy(scores2))


@wg
def test_wgmma_sampled_gate_ties() -> None:
    # the first rows are copies of one row: every group maximum ties; the proof must flag or hold
    from fused_wgmma import WgmmaTopK
    seed = _seed()
    rng = np.random.default_rng(seed)
    x16 = rng.standard_normal((30000, 64), dtype=np.float32).astype(np.float16)
    x16[:8000] = x16[0]
    q = rng.standard_normal((40, 64), dtype=np.float32)
    ft = WgmmaTopK(cp.asarray(x16))
    ids, scores = ft.search(cp.asarray(q), 10)
    check(x16, q, 10, cp.asnumpy(ids), cp.asnumpy(scores), f"wgmma sampled gate ties seed={seed}")
