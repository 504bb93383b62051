"""The float64 reference check every correctness test leans on: it must refuse wrong answers, and
it must take the right answer for an empty namespace (a fleet test once crashed in it there)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_topk


def _case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((50, 16)).astype(np.float32)
    q = rng.standard_normal(16).astype(np.float32)
    ref = m.astype(np.float64) @ q.astype(np.float64)
    best = np.argsort(-ref)[:5]
    return q, m, best, ref[best].astype(np.float32)


def test_the_true_top_k_passes() -> None:
    q, m, ids, scores = _case(1)
    assert_topk(q, m, ids, scores, 5)


def test_an_empty_namespace_takes_no_results_and_refuses_any() -> None:
    q = np.ones(16, np.float32)
    empty = np.empty((0, 16), np.float32)
    assert_topk(q, empty, np.empty(0, np.int64), np.empty(0, np.float32), 10)
    with pytest.raises(AssertionError):
        assert_topk(q, empty, np.array([0]), np.array([1.0], np.float32), 10)


@pytest.mark.parametrize("fault", ["outside", "short", "order", "score"])
def test_a_wrong_answer_is_refused(fault: str) -> None:
    q, m, ids, scores = _case(2)
    if fault == "outside":
        ref = m.astype(np.float64) @ q.astype(np.float64)
        ids, scores = ids.copy(), scores.copy()
        ids[-1] = int(np.argmin(ref))  # the worst row, with its true score: only the rank is wrong
        scores[-1] = np.float32(ref[ids[-1]])
    elif fault == "short":
        ids, scores = ids[:4], scores[:4]
    elif fault == "order":
        ids, scores = ids[::-1].copy(), scores[::-1].copy()
    else:
        scores = scores + 0.5
    with pytest.raises(AssertionError):
        assert_topk(q, m, ids, scores, 5)
