"""Backends without a GPU: searches under way are ``concurrent.futures.Future`` objects (numpy's
worker thread, finished ones, the polled kind the CUDA backend and its pipeline use), the CUDA
path planner, and the constants the kernels are compiled with."""

from __future__ import annotations

import dataclasses
import gc
import re
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from conftest import assert_topk

from kalos.broker.errors import ConfigError
from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends import blas
from kalos.sidecar_cuda.backends.base import PolledFuture, Subset, completed, size_bucket
from kalos.sidecar_cuda.backends.cuda import WARP_K, Storage, kernels, planner
from kalos.sidecar_cuda.backends.numpy_backend import INLINE_WORK, SMALL_WORK, NumpyBackend, blas_threads
from kalos.sidecar_cuda.storage.store import MemoryStore

pytestmark = pytest.mark.timeout(30)


# --------------------------------------------------------------------------- futures


class Device(PolledFuture[int]):
    """A polled search whose device is a flag the test sets."""

    def __init__(self, fail_poll: bool = False, fail_collect: bool = False) -> None:
        super().__init__()
        self.finished = False
        self.collects = 0
        self.fail_poll, self.fail_collect = fail_poll, fail_collect

    def _poll(self) -> bool:
        if self.fail_poll:
            raise RuntimeError("device lost")
        return self.finished

    def _collect(self) -> int:
        self.collects += 1
        if self.fail_collect or self.fail_poll:
            raise RuntimeError("search failed")
        return 42


def test_a_polled_future_polls_without_blocking_and_collects_once():
    f = Device()
    seen: list[int] = []
    f.add_done_callback(lambda fut: seen.append(fut.result()))
    assert isinstance(f, Future)
    assert not f.done() and not f.done()  # asks the device, never waits
    assert f.collects == 0
    f.finished = True
    assert f.done() and f.collects == 0  # done() means result() will not wait; it collects nothing
    assert f.result() == 42 and f.result() == 42 and f.collects == 1
    assert seen == [42] and f.exception() is None


def test_a_polled_future_reports_failures_from_result():
    f = Device(fail_poll=True)
    assert f.done()  # a failed device counts as done: result() raises
    with pytest.raises(RuntimeError, match="search failed"):
        f.result()
    with pytest.raises(RuntimeError, match="search failed"):
        f.result()
    assert f.collects == 1 and isinstance(f.exception(), RuntimeError)
    g = Device(fail_collect=True)
    g.finished = True
    with pytest.raises(RuntimeError):
        g.result()


def test_result_waits_for_work_that_has_not_finished():
    """result() on an unfinished search collects it (the backend waits for its device)."""
    f = Device()
    assert f.result() == 42 and f.done()


def test_completed_and_numpy_searches_are_futures(rng):
    f = completed(np.zeros((2, 0), np.int64), np.zeros((2, 0), np.float32))
    assert isinstance(f, Future) and f.done() and f.result()[0].shape == (2, 0)
    be = NumpyBackend()
    try:
        m = be.new_matrix(8, 64, Metric.DOT)
        x = rng.standard_normal((50, 8)).astype(np.float32)
        m.write_rows(np.arange(50), x)
        q = rng.standard_normal((3, 8)).astype(np.float32)
        pending = m.search_start(q, 50, 5)
        assert isinstance(pending, Future)
        rows, scores = pending.result(timeout=10)
        ref_rows, ref_scores = m.search(q, 50, 5)
        np.testing.assert_array_equal(rows, ref_rows)
        np.testing.assert_array_equal(scores, ref_scores)
        # Rows come back as ids when the store's row -> id map is given.
        row_ids = np.arange(1000, 1050)
        ids, _s = m.search_start(q, 50, 5, row_ids=row_ids).result(timeout=10)
        np.testing.assert_array_equal(ids, row_ids[ref_rows])
        # The search ran on the backend's worker thread.
        where = be.submit(lambda: (threading.current_thread().name, None)).result(timeout=10)
        assert where[0].startswith("kalos-search")
    finally:
        be.close()


def test_small_searches_run_at_once_and_large_ones_on_the_worker(rng):
    """Handing a small search to a thread and back costs more than the search: it runs on the
    calling thread (errors come back in the future); from INLINE_WORK on it is the worker's."""
    be = NumpyBackend()
    try:
        dim = 128
        n_big = INLINE_WORK // (64 * dim)
        m = be.new_matrix(dim, n_big, Metric.DOT)
        x = rng.standard_normal((n_big, dim)).astype(np.float32)
        m.write_rows(np.arange(n_big), x)
        names: list[str] = []
        real = m._search_ids

        def spy(*a: object) -> object:
            names.append(threading.current_thread().name)
            return real(*a)  # type: ignore[arg-type]

        m._search_ids = spy  # type: ignore[method-assign]
        q = rng.standard_normal((64, dim)).astype(np.float32)
        for n, where in ((n_big - 1, threading.current_thread().name), (n_big, "kalos-search")):
            rows, scores = m.search_start(q, n, 10).result(timeout=30)
            assert names[-1].startswith(where)
            for i in range(len(q)):  # by score against float64 (a near-tie at 10th place may swap)
                assert_topk(q[i], x[:n], rows[i], scores[i], 10)
        bad = m.search_start(np.zeros((2, dim + 1), np.float32), 10, 3)  # wrong width: fails
        assert bad.done() and isinstance(bad.exception(), ValueError)
    finally:
        be.close()


def test_blas_threads_policy():
    assert blas_threads(SMALL_WORK - 1, 8, others_busy=False) == 1
    assert blas_threads(SMALL_WORK, 8, others_busy=False) == 8
    assert blas_threads(SMALL_WORK - 1, 8, others_busy=True) is None  # a worker is inside BLAS
    assert blas_threads(SMALL_WORK, 8, others_busy=True) == 8
    assert blas_threads(10, 1, others_busy=True) == 1


def test_loaded_openblas_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /site/numpy.libs/libscipy_openblas64_-32a4b2a6.so\n"
        "7f03-7f04 r--p 00001000 08:01 13 /site/numpy.libs/libscipy_openblas64_-32a4b2a6.so\n"
        "7f05-7f06 rw-p 00000000 00:00 0 \n"
        "7f07-7f08 r-xp 00000000 08:01 14 /opt/openblas/include/openblas_config.h\n"
    )
    assert blas.loaded_openblas(str(maps)) == ["/site/numpy.libs/libscipy_openblas64_-32a4b2a6.so"]
    assert blas.loaded_openblas(str(tmp_path / "missing")) == []


def test_small_products_run_on_one_blas_thread_and_large_ones_on_all(rng):
    """Against the library numpy really loaded: its own getter reports what the backend set."""
    be = NumpyBackend()
    ctl = be.blas
    if ctl is None or ctl.default == 1:
        pytest.skip("numpy is not linked to an OpenBLAS here, or it runs one thread anyway")
    try:
        m = be.new_matrix(64, 256, Metric.DOT)
        m.write_rows(np.arange(256), rng.standard_normal((256, 64)).astype(np.float32))
        m.search(rng.standard_normal((4, 64)).astype(np.float32), 256, 5)
        assert ctl.current == 1 and _library_threads(ctl) == 1
        be.threads_for(SMALL_WORK)
        assert ctl.current == ctl.default and _library_threads(ctl) == ctl.default
    finally:
        be.close()
    assert _library_threads(ctl) == ctl.default  # close() restores the library's default


def test_the_blas_count_is_not_lowered_while_a_worker_may_be_inside_blas(rng):
    """The setting is process-wide: while a search runs on a worker thread (of this or another
    backend: sharded numpy has several), a small product elsewhere leaves it alone."""
    a, b = NumpyBackend(), NumpyBackend()
    ctl = a.blas
    if ctl is None or ctl.default == 1:
        pytest.skip("numpy is not linked to an OpenBLAS here, or it runs one thread anyway")
    assert b.blas is ctl  # one control per process
    release = threading.Event()
    try:
        b.threads_for(SMALL_WORK)
        assert ctl.current == ctl.default
        job = b.submit(lambda: (release.wait(10), None))  # a worker search "inside BLAS"
        assert ctl.busy == 1
        a.threads_for(SMALL_WORK - 1)
        assert ctl.current == ctl.default and _library_threads(ctl) == ctl.default
        release.set()
        job.result(timeout=10)
        for _ in range(3000):  # (the done callback runs on the worker thread, just after)
            if ctl.busy == 0:
                break
            threading.Event().wait(0.01)
        assert ctl.busy == 0
        a.threads_for(SMALL_WORK - 1)
        assert ctl.current == 1 and _library_threads(ctl) == 1
    finally:
        release.set()
        a.close()
        b.close()


def _library_threads(ctl: blas.BlasThreads) -> int:
    import ctypes

    lib = ctypes.CDLL(ctl.library)
    for name in (
        "scipy_openblas_get_num_threads64_",
        "openblas_get_num_threads64_",
        "scipy_openblas_get_num_threads",
        "openblas_get_num_threads",
    ):
        f = getattr(lib, name, None)
        if f is not None:
            return int(f())
    raise AssertionError("no getter")


def test_a_namespace_search_started_gives_ids(rng):
    store = MemoryStore(NumpyBackend(), 8, Metric.COSINE)
    ns = store.get_or_create("x")
    q = rng.standard_normal((2, 8)).astype(np.float32)
    empty = ns.search_start(q, 4)
    assert empty.done() and empty.result()[0].shape == (2, 0)
    ids = rng.choice(10**6, 300, replace=False)
    ns.upsert(ids, rng.standard_normal((300, 8)).astype(np.float32), None)
    got_ids, got_scores = ns.search_start(q, 7).result(timeout=10)
    ref_ids, ref_scores = ns.search(q, 7)
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(got_scores, ref_scores)
    assert set(got_ids.ravel().tolist()) <= set(ids.tolist())
    store.backend.close()


def test_ensure_capacity_is_public_and_keeps_rows(rng):
    store = MemoryStore(NumpyBackend(), 4, Metric.L2)  # (l2: a row is its own nearest)
    ns = store.get_or_create("x", capacity=4)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    ns.upsert(np.array([5, 6, 7]), x, None)
    cap = ns.matrix.capacity
    ns.ensure_capacity(cap + 1)
    assert ns.matrix.capacity >= cap + 1 and ns.n == 3
    got, _ = ns.search(x[:1], 1)
    assert got.tolist() == [[5]]


# --------------------------------------------------------------------------- CUDA planning

LIMITS = planner.Limits(smem_optin=227 * 1024, small_batch_max=1, small_work_max=1 << 12, host_work=0)
F16, F32 = Storage.FLOAT16, Storage.FLOAT32
P = planner.SearchPath


def rows(dpad: int, storage: Storage = F16, *, l2: bool = False, max_norm: float = 3.0) -> planner.Rows:
    return planner.Rows(storage, dpad, l2, max_norm)


def plan(
    b: int, n: int, k: int, dpad: int, *, half: bool = False, wgmma: bool = False, **limits: int
) -> tuple[str, int]:
    """The plan as (path label, qt): ``half`` picks float16 rows (else float32), ``wgmma`` says
    the wgmma kernels are built."""
    lim = dataclasses.replace(LIMITS, wgmma_built=wgmma, **limits)
    p = planner.plan(b, n, k, rows(dpad, F16 if half else F32), lim)
    assert isinstance(p, planner.Plan) and isinstance(p.path, planner.SearchPath)
    return p.path.value, p.qt


def test_the_cuda_planner_picks_the_measured_paths():
    assert plan(1, 1_000_000, 10, 768) == ("small", 1)
    assert plan(3, 1000, 10, 128) == ("small", 4)  # 3000 scores
    assert plan(1, 1000, 33, 128) == ("gemm", 0)  # k > 32
    assert plan(64, 100_000, 10, 768, half=True) == ("gemm", 0)
    assert plan(256, 1_000_000, 10, 768, half=True) == ("gemmh", 0)
    assert plan(256, 1_000_000, 10, 768, half=False) == ("gemm", 0)
    assert plan(256, 1_000_000, 17, 768, half=True) == ("gemm", 0)  # k > 16
    # A query too wide for the shared memory of 16 per block: fewer per block.
    big = plan(16, 200, 10, 4096, smem_optin=100 * 1024)
    assert big[0] == "small" and planner.small_smem(big[1], 4096) <= 100 * 1024 and big[1] < 16
    # Work up to host_work (rows x queries x padded dim) is scored on the host copy; 0: never.
    hw = planner.HOST_WORK
    assert plan(1, hw // 128, 10, 128, host_work=hw) == ("host", 0)
    assert plan(2, hw // 128, 10, 128, host_work=hw)[0] == "small"
    assert plan(1, hw // 128 + 1, 10, 128, host_work=hw)[0] == "small"
    assert plan(1, 256, 100, 128, host_work=hw) == ("host", 0)  # any k
    assert plan(1, 256, 10, 128, host_work=0)[0] == "small"
    assert planner.half_ok(rows(768), 16) and not planner.half_ok(rows(768), 17)
    assert not planner.half_ok(rows(768, F32), 10) and not planner.half_ok(rows(768, max_norm=0.0), 10)
    assert not planner.half_ok(rows(768, Storage.BFLOAT16), 10)


def test_the_cuda_planner_picks_the_wgmma_path_where_it_was_measured_to_win():
    big = planner.WGMMA_MIN_ROWS
    assert big == 1 << 19
    for b in (2, 5, 15, 16, 17, 32):
        for k in (1, 10, 16):
            assert plan(b, 2 * big, k, 768, half=True, wgmma=True) == ("wgmma", 0), (b, k)
    for b in (2, 8, 16):
        assert plan(b, 1_000_000, 10, 768, half=True, wgmma=True) == ("wgmma", 0)
        assert plan(b, big, 10, 768, half=True, wgmma=True) == ("wgmma", 0)
    for dpad in (384, 1024, 1536):
        assert plan(32, 2 * big, 10, dpad, half=True, wgmma=True) == ("wgmma", 0)
    # Outside the measured range the other paths decide exactly as without it.
    outside = [
        (33, 1_000_000, 10, 768),
        (64, 1_000_000, 10, 768),
        (256, 1_000_000, 10, 768),
        (16, big - 1, 10, 768),
        (16, 1_000_000, 17, 768),
        (16, 1_000_000, 32, 768),
        (16, 1_000_000, 10, 776),
        (32, 1_000_000, 10, 100),
        (17, 2 * big - 1, 10, 768),
        (32, 1_000_000, 10, 768),  # the 32-query tile: 2x rows
        (1, 1_000_000, 10, 768),
        (16, 2000, 10, 64),
        (2, big - 1, 10, 768),
    ]
    for b, n, k, dpad in outside:
        want = plan(b, n, k, dpad, half=True)
        assert plan(b, n, k, dpad, half=True, wgmma=True) == want, (b, n, k, dpad)
        assert want[0] != "wgmma"
    # Not built, or rows it cannot serve (float32, l2): the plan without it.
    assert plan(16, 1_000_000, 10, 768, half=True) == ("gemm", 0)
    assert plan(32, 1_000_000, 10, 768, half=False, wgmma=True) == ("gemm", 0)
    on = dataclasses.replace(LIMITS, wgmma_built=True)
    assert planner.plan(16, 1_000_000, 10, rows(768, l2=True), on).path is P.GEMM
    # The threshold is injectable (the GPU tests lower it).
    assert plan(16, 2000, 10, 64, half=True, wgmma=True, wgmma_min_rows=1000) == ("wgmma", 0)
    assert plan(17, 2000, 10, 64, half=True, wgmma=True, wgmma_min_rows=1000) == ("wgmma", 0)
    assert plan(17, 1999, 10, 64, half=True, wgmma=True, wgmma_min_rows=1000)[0] != "wgmma"
    assert planner.wgmma_ok(rows(768), 16) and not planner.wgmma_ok(rows(768), 17)
    assert not planner.wgmma_ok(rows(768, F32), 10) and not planner.wgmma_ok(rows(768, Storage.BFLOAT16), 10)
    assert not planner.wgmma_ok(rows(768, l2=True), 10)
    assert not planner.wgmma_ok(rows(768, max_norm=0.0), 10) and not planner.wgmma_ok(rows(776), 10)


def test_a_forced_path_is_checked_against_what_it_serves():
    """The path a caller names (tests, benchmarks) is refused where it cannot run, and the fused
    kernel gets the smallest tile that holds the batch."""
    on = dataclasses.replace(LIMITS, wgmma_built=True)
    assert planner.forced(P.FUSED, 3, 32, rows(128), LIMITS) == planner.Plan(P.FUSED, 4)
    assert planner.forced(P.FUSED, 40, 10, rows(128), LIMITS) == planner.Plan(P.FUSED, 16)
    with pytest.raises(ValueError, match="fused"):
        planner.forced(P.FUSED, 1, 33, rows(128), LIMITS)
    assert planner.forced(P.HALF_GEMM, 8, 16, rows(768), LIMITS) == planner.Plan(P.HALF_GEMM)
    with pytest.raises(ValueError, match="half-score"):
        planner.forced(P.HALF_GEMM, 8, 17, rows(768), LIMITS)
    with pytest.raises(ValueError, match="half-score"):
        planner.forced(P.HALF_GEMM, 8, 10, rows(768, F32), LIMITS)
    assert planner.forced(P.WGMMA, 8, 10, rows(768), on) == planner.Plan(P.WGMMA)
    for path in (P.WGMMA, P.EXACT):
        with pytest.raises(ValueError, match=path.value):
            planner.forced(path, 8, 10, rows(768), LIMITS)  # not built
        with pytest.raises(ValueError, match=path.value):
            planner.forced(path, 8, 10, rows(768, l2=True), on)
    for path in (P.HOST, P.GEMM):  # serve anything
        assert planner.forced(path, 300, planner.HALF_K + 100, rows(100, F32), LIMITS) == planner.Plan(path)


def test_redo_paths_and_the_cheap_overfetch_k_follow_the_proving_paths():
    assert planner.REDO == {P.HALF_GEMM: P.GEMM, P.WGMMA: P.EXACT, P.INT8: P.GEMM}
    assert planner.cheap_k(P.HALF_GEMM) == planner.cheap_k(P.WGMMA) == planner.cheap_k(P.INT8) == planner.HALF_K == 16
    assert {planner.cheap_k(p) for p in (P.HOST, P.FUSED, P.GEMM, P.EXACT)} == {WARP_K} == {32}
    # The value labels statistics and logs: one per path, the old spellings kept.
    assert {p.value for p in P} == {"host", "small", "wgmma", "int8", "gemmh", "gemm", "exact", "mixed"}


def test_storage_traits_and_parsing():
    assert [(s.code, s.itemsize, s.vec, s.cuda_type) for s in Storage] == [(0, 4, 4, 0), (1, 2, 8, 2), (2, 2, 8, 14)]
    assert Storage.parse("float16") is Storage.FLOAT16 and Storage.parse(Storage.BFLOAT16) is Storage.BFLOAT16
    assert np.dtype(Storage.FLOAT32.bits) == np.float32 and np.dtype(Storage.BFLOAT16.bits) == np.uint16
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        Storage.parse("float64")


def test_the_wgmma_shapes_fit_hopper():
    from kalos.sidecar_cuda.backends.cuda import wgmma

    optin = 227 * 1024
    for bq in wgmma.QUERY_TILES:
        st = wgmma.stages_for(bq, optin)
        assert st >= 3 and wgmma.smem_fused(bq, st) <= optin, bq
    assert [wgmma.bq_for(b) for b in (1, 16, 17, 32, 33, 64, 65, 200)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert wgmma.parts_for(1_000_000, 1, 132) == 132
    assert wgmma.parts_for(300, 1, 132) == 3  # one part per 128-row tile at most
    assert wgmma.parts_for(10**9, 1, 10**6) * 8 * wgmma.KC <= wgmma.MERGE_SMEM
    src = wgmma.kernel_source(32)
    opts = dict(o[2:].split("=") for o in wgmma.compile_options(32, 8) if o.startswith("-D"))
    assert opts["FW_BQ"] == "32" and opts["FT_KC"] == str(wgmma.KC) and "m64n32k16" in src
    for name in opts:  # every constant comes from Python; the .cu stops without them
        assert not re.search(rf"^\s*#\s*define\s+{name}\b", src, re.M), name
        assert f"!defined({name})" in src, name
    assert "// @FW_MMA@" not in src and "#error" in src
    assert [planner.next_pow2(x) for x in (1, 2, 3, 257, 1024)] == [1, 2, 4, 512, 1024]


def test_kernel_constants_come_from_python_only():
    """Every constant the host shares with the kernels reaches the .cu as a -D option; the .cu
    defines none of them and stops without them; its kernels are the ones the host looks up."""
    src = kernels.kernel_source()
    opts = kernels.compile_options(Storage.FLOAT16)
    defined = dict(o[2:].split("=") for o in opts if o.startswith("-D"))
    assert defined == {
        "KALOS_STORAGE": "1",
        "KALOS_VEC": "8",
        "KALOS_BLOCK": str(kernels.BLOCK),
        "KALOS_HEADER_INTS": str(kernels.HEADER_BYTES // 4),
        "KALOS_HC": str(kernels.HALF_CAND),
    }
    assert (
        dict(o[2:].split("=") for o in kernels.compile_options(Storage.FLOAT32) if o.startswith("-D"))["KALOS_VEC"]
        == "4"
    )
    for name in defined:
        assert not re.search(rf"^\s*#\s*define\s+{name}\b", src, re.M), name
        assert f"!defined({name})" in src, name
    assert "#error" in src
    instantiated = [int(x) for x in re.findall(r"^KALOS_SMALL_KERNEL\((\d+)\)", src, re.M)]
    assert tuple(instantiated) == kernels.SMALL_QT
    unrolls = [int(x) for x in re.findall(r"^KALOS_HSCORES_KERNEL\((\d+)\)", src, re.M)]
    assert unrolls == [kernels.HSCORE_UNROLL]
    for fn in (
        "kalos_scores_topk_w",
        "kalos_scores_topk_b",
        "kalos_prep_queries",
        "kalos_prep_queries_h",
        "kalos_rescore_h",
        "kalos_write_rows",
        "kalos_move_rows",
    ):
        assert re.search(rf"\b{fn}\(", src), fn


def test_numpy_statistics_count_searches_where_they_ran_and_the_rows_bytes(rng):
    be = NumpyBackend()
    try:
        dim = 64
        n_big = INLINE_WORK // (8 * dim)  # 8 queries over every row: the worker's
        m = be.new_matrix(dim, n_big, Metric.DOT)
        m.write_rows(np.arange(n_big), rng.standard_normal((n_big, dim)).astype(np.float32))
        assert be.statistics().searches == ()
        q = rng.standard_normal((8, dim)).astype(np.float32)
        m.search_start(q[:1], 1000, 5).result(timeout=30)  # inline, batch 1
        m.search_start(q[:3], 1000, 5).result(timeout=30)  # inline, batch 3
        m.search_start(q, n_big, 5).result(timeout=30)  # worker, batch 8
        m.search(q[:1], n_big, 5, within=Subset(np.arange(0, n_big, 3)))  # a filtered search: inline
        st = be.statistics()
        got = {(ps.path, ps.batch): ps.searches for ps in st.searches}
        assert got == {("inline", "1"): 2, ("inline", "2-8"): 1, ("worker", "2-8"): 1}
        assert all(ps.seconds > 0 for ps in st.searches)
        assert st.redone == ()
        assert st.memory == (("rows", n_big * (dim * 4 + 4 + 8)),)  # float32 rows, norms, times (float64)
        m.grow(2 * n_big)
        assert be.statistics().memory == (("rows", 2 * n_big * (dim * 4 + 4 + 8)),)
        del m
        gc.collect()
        assert be.statistics().memory == (("rows", 0),)  # a dropped matrix is not counted
    finally:
        be.close()


def test_cuda_search_stats_snapshot_names_every_path_and_redo_by_its_label():
    """The CUDA backend's counts (``device.SearchStats``, plain data: no device needed) as the
    statistics the exporter reads: labels are the SearchPath values, buckets size_bucket's."""
    from kalos.sidecar_cuda.backends.cuda.device import SearchStats

    st = SearchStats()
    assert st.snapshot().searches == ()
    for path, b, ns in ((planner.SearchPath.INT8, 1, 300_000), (planner.SearchPath.INT8, 1, 100_000)):
        st.add(path, b, ns)
    st.add(planner.SearchPath.HALF_GEMM, 256, 1_200_000)
    st.add(planner.SearchPath.FUSED, 8, 50_000)
    st.half_fallbacks, st.int8_fallbacks, st.wgmma_fallbacks = 2, 3, 5
    snap = st.snapshot((("rows", 7),))
    assert [(p.path, p.batch, p.searches) for p in snap.searches] == [
        ("gemmh", "65-512", 1),
        ("int8", "1", 2),
        ("small", "2-8", 1),
    ]
    assert [p.seconds for p in snap.searches] == pytest.approx([1.2e-3, 4e-4, 5e-5])
    assert dict(snap.redone) == {"gemmh": 2, "int8": 3, "wgmma": 5} and snap.memory == (("rows", 7),)
    assert [size_bucket(b) for b in (1, 2, 8, 9, 64, 65, 512, 513)] == [
        "1",
        "2-8",
        "2-8",
        "9-64",
        "9-64",
        "65-512",
        "65-512",
        ">512",
    ]
