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
