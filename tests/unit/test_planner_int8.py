"""The planner's rules for the int8 first pass (pure: no CuPy, no device)."""

from __future__ import annotations

import pytest

from kalos.sidecar_cuda.backends.cuda.int8 import copy_bytes, padded_dim, padded_rows
from kalos.sidecar_cuda.backends.cuda.kernels import Storage
from kalos.sidecar_cuda.backends.cuda.planner import (
    INT8_K,
    INT8_MAX_B,
    INT8_MIN_ROWS,
    REDO,
    Limits,
    Rows,
    SearchPath,
    cheap_k,
    forced,
    plan,
)

ON = Limits(smem_optin=227 * 1024, host_work=0, int8_on=True)
OFF = Limits(smem_optin=227 * 1024, host_work=0, int8_on=False)
F16 = Rows(Storage.FLOAT16, 768, False, 30.0)


@pytest.mark.parametrize("storage", list(Storage))
@pytest.mark.parametrize("b", [1, 7, INT8_MAX_B])
def test_small_batches_over_many_rows_take_the_int8_pass(storage: Storage, b: int) -> None:
    rows = Rows(storage, 768, False, 30.0)
    assert plan(b, INT8_MIN_ROWS, 10, rows, ON).path is SearchPath.INT8
    assert plan(b, INT8_MIN_ROWS, 10, Rows(storage, 768, True, 30.0), ON).path is SearchPath.INT8  # l2 too


def test_other_shapes_and_the_switch_keep_it_off() -> None:
    n = INT8_MIN_ROWS
    assert plan(INT8_MAX_B + 1, n, 10, F16, ON).path is not SearchPath.INT8
    assert plan(4, n, INT8_K + 1, F16, ON).path is not SearchPath.INT8
    assert plan(4, n - 1, 10, F16, ON).path is not SearchPath.INT8
    assert plan(4, n, 10, F16, OFF).path is not SearchPath.INT8
    assert plan(4, n, 10, Rows(Storage.FLOAT16, 768, False, 0.0), ON).path is not SearchPath.INT8  # nothing stored
    assert plan(4, n, 10, Rows(Storage.FLOAT16, 768, False, 30.0, int8_room=False), ON).path is not SearchPath.INT8
    lowered = Limits(smem_optin=227 * 1024, host_work=0, int8_on=True, int8_min_rows=1000)
    assert plan(4, 1000, 10, F16, lowered).path is SearchPath.INT8
    # the host path still answers work too small for a launch
    assert plan(1, n, 10, F16, Limits(smem_optin=227 * 1024, int8_on=True)).path is SearchPath.INT8
    assert plan(1, 100, 10, F16, Limits(smem_optin=227 * 1024, int8_on=True, int8_min_rows=10)).path is SearchPath.HOST


def test_forcing_the_path_is_checked() -> None:
    assert forced(SearchPath.INT8, 3, 16, F16, ON).path is SearchPath.INT8
    with pytest.raises(ValueError, match="int8"):
        forced(SearchPath.INT8, 3, 10, F16, OFF)
    with pytest.raises(ValueError, match="int8"):
        forced(SearchPath.INT8, 3, INT8_K + 1, F16, ON)
    with pytest.raises(ValueError, match="int8"):
        forced(SearchPath.INT8, 3, 10, Rows(Storage.FLOAT32, 768, False, 30.0, int8_room=False), ON)


def test_redo_and_over_fetch() -> None:
    assert REDO[SearchPath.INT8] is SearchPath.GEMM
    assert cheap_k(SearchPath.INT8) == INT8_K


@pytest.mark.parametrize(
    ("capacity", "dpad", "want"),
    [(1, 8, 4 * 16 + 32), (1000, 768, 1000 * 768 + 8000), (1001, 100, 1004 * 112 + 8 * 1004)],
)
def test_copy_bytes(capacity: int, dpad: int, want: int) -> None:
    assert padded_rows(capacity) % 4 == 0 and padded_dim(dpad) % 16 == 0
    assert copy_bytes(capacity, dpad) == want


def test_one_gemm_and_the_collection_cap() -> None:
    from kalos.sidecar_cuda.backends.cuda.planner import INT8_CAP_MAX, INT8_CAP_MIN, INT8_MAX_WORK, int8_cap

    b = INT8_MAX_B
    assert plan(b, INT8_MAX_WORK // b, 10, F16, ON).path is SearchPath.INT8
    assert plan(b, INT8_MAX_WORK // b + 1, 10, F16, ON).path is not SearchPath.INT8  # two GEMMs: not this path
    assert int8_cap(1000) == INT8_CAP_MIN
    assert int8_cap(1_000_000) == 2048
    assert int8_cap(2_097_152) == 4096
    assert int8_cap(100_000_000) == INT8_CAP_MAX
    assert all(int8_cap(n) & (int8_cap(n) - 1) == 0 for n in (1, 5000, 777_777, 3_000_000))
