"""The CUDA backend's int8 first pass against a numpy float64 reference of the stored rows.

Rows and queries are quantised to int8 (one scale per row / per query), cuBLAS scores them with an
int8 GEMM, every row whose proven upper bound reaches a float32 threshold is rescored in float32
from the stored rows, and a query that collects more than ``planner.int8_cap(n)`` rows is redone
on the float32 path (counted in ``stats.int8_fallbacks``). So the answer is the float32 top-k of
the rows *as stored*.

The planner's row threshold is lowered (``int8_min_rows``) so small matrices take the path, and
``host_work=0`` keeps tiny searches off the host copy; every test asserts the path that ran through
the backend's ``stats``. Fresh random data (the seed is printed). Skipped at collection where CuPy
or a CUDA device is missing, and on a device below compute capability 7.5 (no int8 GEMM).

The names of the path (``SearchPath.INT8``, ``options.Int8Pass``, ``planner.INT8_*``) are looked up
when a test runs, not at import: collection never fails where the backend cannot run.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_reference import check, queries

from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends import options
from kalos.sidecar_cuda.backends.base import prepare_rows
from kalos.sidecar_cuda.backends.cuda import SearchPath, cuda_available, planner


def _why() -> str | None:
    why = cuda_available()
    if why is not None:
        return f"CUDA backend unavailable: {why}"
    import cupy

    cc = str(cupy.cuda.Device(0).compute_capability)
    if int(cc) < 75:
        return f"the int8 path needs int8 GEMM (compute capability >= 7.5), device 0 is {cc}"
    return None


_WHY = _why()
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600), pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]

STORAGES = ("float16", "float32", "bfloat16")
METRICS = (Metric.DOT, Metric.COSINE, Metric.L2)
MIN_ROWS = 1000  # the planner's row threshold in these tests (int8_min_rows)
# Proven answers: float32 accumulation of float32 queries x stored rows, relative to |q||x| (dot,
# cosine; as in test_gpu_wgmma.py) or (|q| + |x|)^2 (l2; as the half-score path's l2 checks).
TIGHT = {Metric.DOT: 2.0**-16, Metric.COSINE: 2.0**-16, Metric.L2: 2e-5}
# Queries redone on the float32 GEMM path: that path may round the queries to the storage dtype
# (test_gpu_backend.py's tolerances, which also cover the rows' rounding).
LOOSE = {"float32": 2e-5, "float16": 3 * 2.0**-11, "bfloat16": 4.5 * 2.0**-9}


def _int8() -> SearchPath:
    return SearchPath.INT8


@pytest.fixture(scope="module")
def backends():
    """``get(storage)``: one int8-enabled backend per storage dtype, made on first use."""
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    made: dict[str, object] = {}

    def get(storage: str):
        if storage not in made:
            be = CupyBackend(
                storage_dtype=storage, host_work=0, int8_pass=options.Int8Pass.AUTO, int8_min_rows=MIN_ROWS
            )
            made[storage] = be
            assert be.int8_on, f"the int8 path is off on a {storage} backend (see the log)"
        return made[storage]

    yield get
    for be in made.values():
        be.close()


def fill(
    be, rng, n: int, d: int, metric: Metric = Metric.DOT, capacity: int | None = None, x: np.ndarray | None = None
):
    """A matrix holding rows [0, n) (random unless ``x``), written in chunks as the sidecar does."""
    if x is None:
        x = rng.standard_normal((n, d), dtype=np.float32)
    x = prepare_rows(np.ascontiguousarray(x, np.float32), metric)
    m = be.new_matrix(d, capacity or n, metric)
    for lo in range(0, n, 65536):
        m.write_rows(np.arange(lo, min(n, lo + 65536)), x[lo : lo + 65536])
    return m


def stored(m, n: int) -> np.ndarray:
    """Rows [0, n) exactly as stored (the storage dtype's values, as float32)."""
    return m.read_rows(np.arange(n))


def rel_for(be, metric: Metric, redone: bool) -> float:
    """The tolerance of an answer: proven (float32) unless some query was redone."""
    return LOOSE[be.storage_dtype] if redone else TIGHT[metric]


def candidates(n: int) -> int:
    """Rows the path may collect and rescore per query over n rows (more: the query is redone)."""
    return int(planner.int8_cap(n))


def count(be, path: SearchPath) -> int:
    return be.stats.count(path)


def int8_search(be, m, q: np.ndarray, n: int, k: int):
    """A search the planner sends down the int8 path; asserts that it ran there (once). Returns
    rows, scores and whether any of its queries was redone on the float32 path."""
    b = len(q)
    assert m.plan(b, n, k).path is _int8(), f"b={b} n={n} k={k}: planned {m.plan(b, n, k)}"
    before, fb = count(be, _int8()), be.stats.int8_fallbacks
    rows, scores = m.search(q, n, k)
    assert count(be, _int8()) == before + 1, "the search did not take the int8 path"
    return rows, scores, be.stats.int8_fallbacks > fb


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def best_rows(q: np.ndarray, metric: Metric, xmax: float) -> np.ndarray:
    """Rows that score above every row of norm <= xmax for their query (ties with copies of it)."""
    if metric == Metric.DOT:  # (no longer than the longest row: the bound on row norms stays)
        return (xmax * unit(q)).astype(np.float32)
    return np.ascontiguousarray(q, np.float32)  # cosine: the unit query itself; l2: distance 0


def worst_rows(q: np.ndarray, metric: Metric, xmax: float) -> np.ndarray:
    """Rows that score below every row of norm <= xmax for their query."""
    if metric == Metric.COSINE:
        return np.ascontiguousarray(-q, np.float32)
    return (-xmax * unit(q)).astype(np.float32)


# ---------------------------------------------------------------- answers against float64
# The whole storage x metric grid at k = 10, b = 7 over three shapes (dims 64, 100 and 768), and
# k x b on float16 dot product.
GRID = [(s, metric, 10, 7) for s in STORAGES for metric in METRICS]
KB = [("float16", Metric.DOT, k, b) for k in (1, 10, 16) for b in (1, 7, planner.INT8_MAX_B) if (k, b) != (10, 7)]
SHAPES = [(2100, 64), (5077, 100), (20011, 768)]


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize(
    "storage,metric,k,b", GRID + KB, ids=lambda v: v.name.lower() if isinstance(v, Metric) else str(v)
)
def test_answers_match_float64(backends, rng, storage, metric, k, b, n, d):
    be = backends(storage)
    # Rows past n are each query's best: only rows [0, n) may come back.
    m = fill(be, rng, n, d, metric, capacity=n + 64)
    x = stored(m, n)
    q = queries(rng, b, d, metric)
    m.write_rows(np.arange(n, n + b), best_rows(q, metric, float(np.linalg.norm(x, axis=1).max())))
    assert m.int8_bytes == 0
    rows, scores, redone = int8_search(be, m, q, n, k)
    assert m.int8_bytes > 0
    what = f"{storage} {metric.name} n={n} d={d} k={k} b={b}"
    check(q, x, metric, k, rows, scores, rel_for(be, metric, redone), what)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("metric", (Metric.DOT, Metric.L2), ids=lambda m: m.name.lower())
def test_random_data_is_proven_without_redo(backends, rng, storage, metric):
    """Random rows collect far fewer rows than the cap: (nearly) no query is redone, and the answer
    is float32-exact."""
    be = backends(storage)
    for n, d in ((20011, 768), (5077, 100)):
        m = fill(be, rng, n, d, metric)
        x = stored(m, n)
        b = planner.INT8_MAX_B
        q = queries(rng, b, d, metric)
        fb = be.stats.int8_fallbacks
        rows, scores, _redone = int8_search(be, m, q, n, planner.INT8_K)
        assert be.stats.int8_fallbacks - fb <= 2, f"{be.stats.int8_fallbacks - fb} of {b} random queries redone"
        if be.stats.int8_fallbacks == fb:
            check(q, x, metric, planner.INT8_K, rows, scores, TIGHT[metric], f"random n={n} d={d}")
        else:
            check(q, x, metric, planner.INT8_K, rows, scores, LOOSE[storage], f"random n={n} d={d} (redone)")


# ---------------------------------------------------------------- the int8 copy follows the rows
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("metric", METRICS, ids=lambda m: m.name.lower())
def test_writes_moves_and_growth_after_a_search_are_seen(backends, rng, storage, metric):
    be = backends(storage)
    n, d, b, k = 3000, 100, 7, 10
    cap = n + 64
    m = fill(be, rng, n, d, metric, capacity=cap)
    x = stored(m, n)
    xmax = float(np.linalg.norm(x, axis=1).max())
    q = queries(rng, b, d, metric)
    assert m.int8_bytes == 0, "the int8 copy exists before the first int8 search"
    rows, scores, redone = int8_search(be, m, q, n, k)
    check(q, x, metric, k, rows, scores, rel_for(be, metric, redone), "before")
    built = m.int8_bytes
    assert built > 0, "no int8 copy after an int8 search"

    # Writes: rows inside [0, n) that become the best of queries 0-3, rows n..n+2 (never
    # searched yet) the best of queries 4-6, and row 0 the worst of query 1.
    mid = rng.choice(np.arange(1, n), size=4, replace=False)
    m.write_rows(mid, best_rows(q[:4], metric, xmax))
    m.write_rows(np.arange(n, n + 3), best_rows(q[4:], metric, xmax))
    m.write_rows(np.array([0]), worst_rows(q[1:2], metric, xmax))
    n1 = n + 3
    x1 = stored(m, n1)
    rows, scores, redone = int8_search(be, m, q, n1, k)
    check(q, x1, metric, k, rows, scores, rel_for(be, metric, redone), "after writes")
    np.testing.assert_array_equal(rows[:, 0], np.concatenate([mid, np.arange(n, n + 3)]))

    # Moves: query 0's best row copied onto five other rows, and row 0 (query 1's worst) onto
    # query 1's best row.
    others = np.setdiff1d(np.arange(1, n), mid)
    dst = rng.choice(others, size=5, replace=False)
    m.move_rows(np.concatenate([np.repeat(mid[:1], 5), [0]]), np.concatenate([dst, mid[1:2]]))
    x2 = stored(m, n1)
    rows, scores, redone = int8_search(be, m, q, n1, k)
    check(q, x2, metric, k, rows, scores, rel_for(be, metric, redone), "after moves")
    assert set(rows[0, :6].tolist()) == {int(mid[0]), *dst.tolist()}, (rows[0], mid[0], dst)
    assert mid[1] not in rows[1], "a row moved over is still found with its old value"

    # Growth: rows just past the old capacity (queries 0-3) and at the new end (queries 4-6),
    # every row [0, new capacity) searched (the rest past n1 are zeros).
    big = cap + 70_000
    m.grow(big)
    assert m.capacity == big
    assert m.int8_bytes > built, f"the int8 copy did not grow with the matrix ({m.int8_bytes} <= {built} bytes)"
    new = np.concatenate([np.arange(cap, cap + 4), np.arange(big - 3, big)])
    m.write_rows(new, best_rows(q, metric, xmax))
    x3 = stored(m, big)
    rows, scores, redone = int8_search(be, m, q, big, k)
    check(q, x3, metric, k, rows, scores, rel_for(be, metric, redone), "after growth")
    for i in range(b):
        assert new[i] in rows[i], f"query {i}: row {new[i]} written after growth not found: {rows[i]}"


# ---------------------------------------------------------------- the float32 redo
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("metric", (Metric.DOT, Metric.L2), ids=lambda m: m.name.lower())
def test_identical_rows_force_the_float32_redo(backends, rng, storage, metric):
    """More exact copies of every query's best row than the path may collect: each copy's bound
    reaches the threshold, the query is redone on the float32 path and the answer is k copies of
    that row."""
    be = backends(storage)
    n, d, b = 4000, 128, 6
    copies = candidates(n) + 200
    assert copies < n
    x = rng.standard_normal((n, d), dtype=np.float32)
    xmax = float(np.linalg.norm(x, axis=1).max())
    c = rng.standard_normal(d).astype(np.float32)
    noise = rng.standard_normal((b, d), dtype=np.float32)
    if metric == Metric.L2:
        strong = c  # every query lies within 0.05 |noise| of it, the other rows ~sqrt(2d) away
        q = np.ascontiguousarray(c + 0.05 * noise, np.float32)
    else:
        strong = 2.0 * xmax * unit(c)
        q = np.ascontiguousarray(c + 0.3 * noise, np.float32)
    hot = np.sort(rng.choice(n, size=copies, replace=False))
    x[hot] = strong
    m = fill(be, rng, n, d, metric, x=x)
    xs = stored(m, n)
    for k in (1, 10, planner.INT8_K):
        rows, scores, redone = int8_search(be, m, q, n, k)
        assert redone, f"k={k}: {copies} tied rows, yet stats.int8_fallbacks did not grow"
        # k copies of the strong row (every copy scores the same), with its score.
        assert np.isin(rows, hot).all(), f"k={k}: rows other than the copies: {rows[~np.isin(rows, hot)]}"
        check(q, xs, metric, k, rows, scores, LOOSE[storage], f"identical rows k={k}")


# ---------------------------------------------------------------- off, and the planner's limits
def test_int8_pass_off_never_takes_the_path(rng):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = CupyBackend(storage_dtype="float16", host_work=0, int8_pass=options.Int8Pass.OFF, int8_min_rows=MIN_ROWS)
    try:
        assert not be.int8_on
        n, d = 3000, 128
        for metric in METRICS:
            m = fill(be, rng, n, d, metric)
            for b in (1, 7, planner.INT8_MAX_B):
                for k in (1, 10, planner.INT8_K):
                    assert m.plan(b, n, k).path is not _int8(), (metric, b, k)
            q = queries(rng, 7, d, metric)
            with pytest.raises(ValueError):
                m.search(q, n, 10, path=_int8())
            rows, scores = m.search(q, n, 10)
            check(q, stored(m, n), metric, 10, rows, scores, LOOSE["float16"], f"off {metric.name}")
            assert m.int8_bytes == 0
        assert count(be, _int8()) == 0
        assert be.stats.int8_fallbacks == 0
    finally:
        be.close()


def test_the_planner_keeps_other_shapes_off_the_path(backends, rng):
    be = backends("float16")
    n = 3000
    for metric in METRICS:
        for d in (64, 100):
            m = fill(be, rng, n, d, metric)
            for b in (1, 2, 16, planner.INT8_MAX_B):
                for k in (1, 10, planner.INT8_K):
                    assert m.plan(b, n, k).path is _int8(), (metric, d, b, k, m.plan(b, n, k))
            assert m.plan(planner.INT8_MAX_B + 1, n, 10).path is not _int8()  # too many queries
            assert m.plan(7, n, planner.INT8_K + 1).path is not _int8()  # k too large
            assert m.plan(7, MIN_ROWS - 1, 10).path is not _int8()  # too few rows
            assert m.plan(7, MIN_ROWS, 10).path is _int8()
    # No row written: the row-norm bound is 0, nothing to prove against.
    empty = be.new_matrix(64, n, Metric.DOT)
    assert empty.plan(7, n, 10).path is not _int8()
    # Shapes off the path still answer (on another path), and no int8 copy is built for them.
    m = fill(be, rng, n, 64)
    x = stored(m, n)
    before = count(be, _int8())
    for b, k, nn in ((planner.INT8_MAX_B + 1, 10, n), (7, planner.INT8_K + 1, n), (7, 10, MIN_ROWS - 1)):
        q = queries(rng, b, 64)
        rows, scores = m.search(q, nn, k)
        check(q, x[:nn], Metric.DOT, k, rows, scores, LOOSE["float16"], f"off the path b={b} k={k} n={nn}")
    assert count(be, _int8()) == before
    assert m.int8_bytes == 0


# ---------------------------------------------------------------- pipelining, degenerate rows
def test_two_pending_searches(backends, rng):
    """Two searches in flight, both on the int8 path (the first builds the int8 copy), collected
    in the opposite order; the second maps its rows through row_ids."""
    be = backends("float16")
    n, d = 5000, 256
    m = fill(be, rng, n, d)
    x = stored(m, n)
    q1, q2 = queries(rng, 7, d), queries(rng, planner.INT8_MAX_B, d)
    assert m.plan(7, n, 10).path is _int8() and m.plan(len(q2), n, planner.INT8_K).path is _int8()
    ids = rng.choice(10**9, n, replace=False).astype(np.int64)
    before, fb = count(be, _int8()), be.stats.int8_fallbacks
    f1 = m.search_start(q1, n, 10)
    f2 = m.search_start(q2, n, planner.INT8_K, row_ids=ids)
    got2, s2 = f2.result()
    rows1, s1 = f1.result()
    assert count(be, _int8()) == before + 2
    rel = rel_for(be, Metric.DOT, be.stats.int8_fallbacks > fb)
    order = np.argsort(ids)
    rows2 = order[np.searchsorted(ids, got2, sorter=order)]
    np.testing.assert_array_equal(ids[rows2], got2)
    check(q2, x, Metric.DOT, planner.INT8_K, rows2, s2, rel, "second (row_ids)")
    check(q1, x, Metric.DOT, 10, rows1, s1, rel, "first")
    assert m.int8_bytes > 0


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("metric", (Metric.DOT, Metric.L2), ids=lambda m: m.name.lower())
def test_zero_and_tiny_rows(backends, rng, storage, metric):
    """Rows of zeros (0-199) and of norm 1e-3 (200-599) beside rows of norm ~10 (the rest), all of
    those in one orthant, the opposite of s. Queries near large rows are answered by large rows
    (zero and tiny rows quantised beside them, the proof holds); unit queries |h| * s are answered
    by tiny rows (matrix 1, tiny rows in random directions) or by zero rows (matrix 2, every
    nonzero row opposite to s): the bound scales with the largest row, so every zero and tiny row
    (600, under ``int8_cap``) is collected and rescored in float32, and the answer is checked to a
    tolerance relative to the tiny rows' norm (a redo, if any, is allowed but not expected). Matrix 3 holds zeros and rows of
    norm ~1e-3 only, searched by queries of norm ~1e-3: the path is scale-free, the proof holds."""
    be = backends(storage)
    n, d, b, k = 3000, 100, 4, 10
    zero, tiny, large = np.arange(200), np.arange(200, 600), np.arange(600, n)
    s = np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float32)
    for which in ("tiny best", "zeros best", "tiny only"):
        what = f"{storage} {metric.name} {which}"
        x = -np.abs(rng.standard_normal((n, d), dtype=np.float32)) * s
        x[zero] = 0.0
        t = rng.standard_normal((len(tiny), d), dtype=np.float32)
        if which == "zeros best":
            t = -np.abs(t) * s
        x[tiny] = 1e-3 * unit(t)
        if which == "tiny only":
            x[large] = 1e-3 / np.sqrt(d) * rng.standard_normal((len(large), d), dtype=np.float32)
        m = fill(be, rng, n, d, metric, x=x)
        xs = stored(m, n)
        if which == "tiny only":
            q = (1e-3 / np.sqrt(d) * rng.standard_normal((2 * b, d))).astype(np.float32)
            fb = be.stats.int8_fallbacks
            rows, scores, redone = int8_search(be, m, q, n, k)
            assert be.stats.int8_fallbacks - fb <= 1, f"{what}: {be.stats.int8_fallbacks - fb} of {2 * b} redone"
            check(q, xs, metric, k, rows, scores, rel_for(be, metric, redone), what, atol=0.0)
            assert np.isfinite(scores).all()
            continue
        # Near large rows: those answer.
        src = rng.choice(large, size=b, replace=False)
        q = np.ascontiguousarray(x[src] + 0.3 * rng.standard_normal((b, d), dtype=np.float32))
        fb = be.stats.int8_fallbacks
        rows, scores, redone = int8_search(be, m, q, n, k)
        assert be.stats.int8_fallbacks - fb <= 1, f"{what}: {be.stats.int8_fallbacks - fb} of {b} redone"
        check(q, xs, metric, k, rows, scores, rel_for(be, metric, redone), what + " near large rows")
        assert np.isin(rows, large).all(), f"{what}: {rows}"
        # Opposite to every large row: tiny or zero rows answer.
        h = unit(np.abs(rng.standard_normal((b, d), dtype=np.float32)) * s)
        rows, scores, redone = int8_search(be, m, h, n, k)
        xn_tiny = float(np.linalg.norm(xs[tiny], axis=1).max())
        check(h, xs, metric, k, rows, scores, rel_for(be, metric, redone), what, xn=xn_tiny, atol=0.0)
        assert np.isfinite(scores).all()
        want = tiny if which == "tiny best" else zero
        assert np.isin(rows, want).all(), f"{what}: {rows}"


def test_statistics_report_the_int8_searches_and_the_copys_bytes(backends, rng):
    """``statistics()`` (what /metrics exports as kalos_backend_*): the int8 searches by batch
    bucket, the queries it redid, and the copy's bytes beside the rows'."""
    be = backends("float16")
    n, d = 4000, 128
    m = fill(be, rng, n, d)

    def by(st, path: str, batch: str) -> int:
        return sum(ps.searches for ps in st.searches if (ps.path, ps.batch) == (path, batch))

    st0 = be.statistics()
    m.search(queries(rng, 1, d), n, 10)
    m.search(queries(rng, 5, d), n, 10)
    assert count(be, _int8()) > 0
    st = be.statistics()
    assert by(st, "int8", "1") == by(st0, "int8", "1") + 1
    assert by(st, "int8", "2-8") == by(st0, "int8", "2-8") + 1
    assert dict(st.redone) == {
        "gemmh": be.stats.half_fallbacks,
        "int8": be.stats.int8_fallbacks,
        "wgmma": be.stats.wgmma_fallbacks,
    }
    memory = dict(st.memory)
    assert memory["int8"] >= m.int8_bytes > 0  # (the module's other matrices may hold copies too)
    assert memory["rows"] >= n * d * 2  # float16 rows at least
    del m
    import gc

    gc.collect()
    assert dict(be.statistics().memory)["int8"] <= memory["int8"] - 1
