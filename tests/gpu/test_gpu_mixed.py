"""The CUDA backend's mixed-namespace search (``kalos_mixed``: each query over its own
namespace's rows, one launch) against a numpy float64 reference, on fresh random data; and the
store's ``search_mixed`` on a CUDA backend, asserting the path that ran (issue 34).

Skipped at collection where CuPy or a CUDA device is missing (CI has neither)."""

from __future__ import annotations

import numpy as np
import pytest

from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.base import prepare_queries, prepare_rows
from kalos.sidecar_cuda.backends.cuda import SearchPath, cuda_available
from kalos.sidecar_cuda.storage.store import MemoryStore

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]

REL_TOL = {"float32": 2e-5, "float16": 3 * 2.0**-11, "bfloat16": 4.5 * 2.0**-9}


@pytest.fixture(scope="module", params=("float32", "float16", "bfloat16"))
def backend(request):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype=request.param, host_work=0)
    yield be
    be.close()


def exact(rows_ref: np.ndarray, q: np.ndarray, metric: Metric) -> np.ndarray:
    m = rows_ref.astype(np.float64)
    q64 = q.astype(np.float64)
    if metric == Metric.L2:
        out: np.ndarray = -((m - q64) ** 2).sum(axis=1)
        return out
    return m @ q64


def check_one(rows, scores, stored, q, k, metric, tol_rel):
    """rows/scores: one query's k entries (row -1 past n); stored: the rows as stored (float32)."""
    n = len(stored)
    kk = min(k, n)
    assert (rows[kk:] == -1).all() and np.isneginf(scores[kk:]).all()
    got = rows[:kk]
    assert (got >= 0).all() and (got < n).all() and len(set(got.tolist())) == kk
    ref = exact(stored, q, metric)
    scale = (np.linalg.norm(q) + np.linalg.norm(stored, axis=1).max()) ** 2
    tol = tol_rel * scale + 1e-6
    kth = np.sort(ref)[::-1][kk - 1]
    assert (ref[got] >= kth - tol).all(), "a row outside the true top-k"
    np.testing.assert_allclose(scores[:kk], ref[got], atol=tol, rtol=0)
    assert (np.diff(scores[:kk]) <= tol).all(), "not best first"


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2])
@pytest.mark.parametrize("d", [1, 24, 768])
def test_kalos_mixed_is_exact_per_namespace(backend, rng, metric, d):
    sizes = [1, 3, 31, 256, 1000, 5000] + [int(x) for x in rng.integers(1, 3000, 20)]
    mats, stored = [], []
    for n in sizes:
        x = prepare_rows(rng.standard_normal((n, d), dtype=np.float32), metric)
        m = backend.new_matrix(d, n + int(rng.integers(0, 50)), metric)
        m.write_rows(np.arange(n), x)
        mats.append(m)
        stored.append(m.read_rows(np.arange(n)))
    n = np.asarray(sizes, np.int64)
    before = backend.stats.count(SearchPath.MIXED)
    for b, k in ((1, 1), (7, 10), (300, 32), (64, 5)):
        of = rng.integers(0, len(mats), b)
        q = prepare_queries(rng.standard_normal((b, d), dtype=np.float32), metric)
        rows, scores = backend.search_mixed(mats, n, of, q, k).result()
        assert rows.shape == scores.shape == (b, k)
        for j in range(b):
            i = int(of[j])
            check_one(rows[j], scores[j], stored[i], q[j], k, metric, REL_TOL[backend.storage_dtype])
    assert backend.stats.count(SearchPath.MIXED) == before + 4  # every batch was one launch


def test_store_search_mixed_on_cuda_takes_the_kernel_and_the_large_namespaces_apart(backend, rng):
    d = 64
    store = MemoryStore(backend, d, Metric.DOT)
    data = {}
    for j, n in enumerate([5, 40_000, 700, 1, 2000]):  # 40,000 rows: more than mixed_rows
        x = rng.standard_normal((n, d), dtype=np.float32)
        ids = rng.choice(1 << 40, n, replace=False).astype(np.int64)
        store.get_or_create(f"u{j}").upsert(ids, x, None)
        ns = store.get(f"u{j}")
        data[f"u{j}"] = (ids, ns.matrix.read_rows(np.arange(n)), ns.row_ids[:n].copy())
    names = [*data, "nobody"]
    spaces = [store.get(x) for x in names]
    of = rng.integers(0, len(names), 120)
    q = rng.standard_normal((120, d), dtype=np.float32)
    before = backend.stats.count(SearchPath.MIXED)
    ids, scores = store.search_mixed(spaces, of, q, 10).result()
    assert backend.stats.count(SearchPath.MIXED) == before + 1
    for j in range(120):
        name = names[int(of[j])]
        if name == "nobody":
            assert (ids[j] == -1).all()
            continue
        _ids, stored, row_ids = data[name]
        row_of = {int(i): r for r, i in enumerate(row_ids.tolist())}
        rows = np.asarray([row_of.get(int(i), -1) for i in ids[j].tolist()])
        rows[ids[j] < 0] = -1
        check_one(rows, scores[j], stored, q[j], 10, Metric.DOT, REL_TOL[backend.storage_dtype])
