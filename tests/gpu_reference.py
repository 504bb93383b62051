"""The float64 reference that the CUDA backend's GPU tests check answers against (test_gpu_backend.py,
test_gpu_int8.py): scores of prepared queries against the rows as stored, and the top-k check up to
ties within a tolerance relative to each score's scale."""

from __future__ import annotations

import numpy as np

from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.base import prepare_queries


def queries(rng: np.random.Generator, b: int, d: int, metric: Metric = Metric.DOT) -> np.ndarray:
    """b fresh random queries of dimension d, prepared for the metric (as the sidecar does)."""
    return np.ascontiguousarray(prepare_queries(rng.standard_normal((b, d), dtype=np.float32), metric))


def reference(q: np.ndarray, x: np.ndarray, metric: Metric) -> np.ndarray:
    """Float64 scores (b, n) of prepared queries against prepared rows."""
    q64, x64 = q.astype(np.float64), x.astype(np.float64)
    dots = q64 @ x64.T
    if metric == Metric.L2:
        return 2.0 * dots - (x64 * x64).sum(1)[None, :] - (q64 * q64).sum(1)[:, None]
    return dots


def check(
    q: np.ndarray,
    x: np.ndarray,
    metric: Metric,
    k: int,
    rows: np.ndarray,
    scores: np.ndarray,
    rel: float,
    what: str,
    *,
    xn: float | np.ndarray | None = None,
    atol: float = 1e-6,
) -> None:
    """The top-k under float64 scores of the rows ``x``, up to ties within the tolerance (``rel``
    times |q||x|, or (|q| + |x|)^2 for l2, with |x| the largest row norm or ``xn``); the scores
    returned are those rows' scores within the tolerance, sorted best first."""
    ref = reference(q, x, metric)
    b, n = ref.shape
    kk = min(k, n)
    assert rows.shape == (b, kk) and scores.shape == (b, kk), (what, rows.shape, scores.shape)
    assert rows.dtype == np.int64 and scores.dtype == np.float32, what
    qn = np.linalg.norm(q.astype(np.float64), axis=1)
    if xn is None:
        xn = np.linalg.norm(x.astype(np.float64), axis=1).max()
    scale = (qn + xn) ** 2 if metric == Metric.L2 else qn * xn
    tol = rel * scale + atol
    kth = -np.partition(-ref, kk - 1, axis=1)[:, kk - 1]
    for i in range(b):
        r = rows[i]
        assert ((r >= 0) & (r < n)).all(), f"{what}: row out of range in query {i}: {r}"
        assert len(np.unique(r)) == kk, f"{what}: duplicate rows in query {i}: {r}"
        true = ref[i, r]
        bad = true < kth[i] - tol[i]
        assert not bad.any(), (
            f"{what}: query {i} got rows {r[bad]} outside the top-{kk}: scores {true[bad]} < k-th {kth[i]} - tol {tol[i]}"
        )
        err = np.abs(scores[i].astype(np.float64) - true)
        assert (err <= tol[i]).all(), f"{what}: query {i} score error {err.max()} > {tol[i]} ({scores[i]} vs {true})"
        assert (np.diff(scores[i]) <= 0).all(), f"{what}: query {i} not sorted best first: {scores[i]}"
