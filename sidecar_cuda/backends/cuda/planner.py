"""Which path a CUDA search takes, and how big its pieces are. Pure: no CuPy, no device.

:func:`plan` returns a :class:`Plan` (a :class:`SearchPath` and, for the fused kernel, its queries
per block) from the batch, the matrix's traits and the device's :class:`Limits`:

* ``HOST``: work too small to pay for a launch (at most ``host_work`` rows x queries x padded dim,
  ``--host-search-work``) is scored on the sidecar's CPU from a float32 copy of the stored rows;
* ``FUSED``: the fused kernel (k <= 32, and one query or a small score matrix);
* ``WGMMA``: fused float16 tensor-core scoring + exact top-k (``kalos_wgmma.cu``, Hopper only):
  float16 storage, inner product, k <= 16, 2-32 queries, at least ``wgmma_min_rows`` rows (twice
  that above 16 queries) whose padded dim is whole 128-byte lines, where it was measured to beat
  the GEMM paths;
* ``INT8``: the int8 first pass (any storage, k <= 16, at most ``INT8_MAX_B`` queries over at
  least ``int8_min_rows`` rows, ``--int8-pass auto``): cuBLAS scores int8 copies of the rows and
  queries, and only rows whose proven upper bound reaches a float32 threshold are rescored; it
  reads half the bytes of float16 rows, where small batches are bound by reading the rows;
* ``HALF_GEMM``: the half-score GEMM (float16 storage, k <= 16, a large score matrix);
* ``GEMM``: the float32-score GEMM, everything else;
* ``EXACT``: never planned: the wgmma path's redo of the queries it could not prove (float32
  scores of every row); ``REDO`` names each proving path's redo.

A recency-weighted search (a ``Decay``) takes :func:`plan_biased`'s path: the host copy when the
work is that small, else the float32-score GEMM, whose score matrix gets each row's recency part
added before its top-k kernel selects (``recency.py``): the other paths select inside the kernel
that scores, where no bias is added.

:func:`forced` checks a path a caller names (tests, benchmarks) instead. The thresholds were
measured on an H200 (docs/gpu.md).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .kernels import BLOCK, SMALL_QT, WARP_K, Storage


class SearchPath(enum.Enum):
    """How one search runs (backend.py's docstring); the value labels it in statistics."""

    HOST = "host"
    FUSED = "small"  # (the kernels kalos_small_q{QT})
    WGMMA = "wgmma"
    INT8 = "int8"
    HALF_GEMM = "gemmh"
    GEMM = "gemm"
    EXACT = "exact"
    MIXED = "mixed"  # (kalos_mixed: each query over its own namespace's rows, one launch)


@dataclass(frozen=True, slots=True)
class Plan:
    """A search's path; ``qt``: queries per block of the fused kernel (FUSED only, else 0)."""

    path: SearchPath
    qt: int = 0


ROWS_PER_BLOCK = 256  # the fused path gives each block at least this many rows
#: Namespaces of at most this many rows are searched together by kalos_mixed (each query reads
#: its own namespace's rows); larger ones go to the planner's paths, their queries batched.
MIXED_ROWS = 1 << 15
ZERO_COPY_BLOCKS = 4  # at most this many blocks read the request from host memory directly
GEMM_BLOCKS = 528  # top-k blocks aimed for per GEMM chunk (4 per SM on an H100/H200)
SCORE_BUFFER_FLOATS = 1 << 26  # GEMM path: float32 scores per chunk (256 MiB; 32 MiB chunks that
# stay in L2 measured 1.6x slower at 1M x 768, b = 256: many small GEMMs lose more than L2 saves)
GRAPH_CACHE = 256  # CUDA graphs of the fused path kept (one per launch shape)
HALF_K = 16  # half-score path: largest k (the answer is proven exact against 32 candidates)
HALF_WORK_MIN = 1 << 26  # half-score path from this many scores (rows x queries) up: measured on
# the H200 it costs ~60 us more than the GEMM path at 100k rows (any batch), the same at 1M x 64,
# and 17% less at 1M x 256 (docs/gpu.md)
HOST_WORK = 1 << 17  # default --host-search-work: rows x queries x padded dim scored on the host
# copy at most (the host copy won at every shape up to 196 608 and lost from 262 144: docs/gpu.md)
WGMMA_K = 16  # wgmma path: largest k (the answer is proven exact against 32 candidates)
WGMMA_MIN_B, WGMMA_MAX_B = 2, 32  # wgmma path: batch sizes where it was measured to win or tie
# (a lone query takes the fused kernel first; 64 and more lost by 10-20 %): docs/gpu.md
WGMMA_MIN_ROWS = 1 << 19  # wgmma path: from this many rows at b <= 16, twice as many for b = 17-32
# (the 32-query tile lost at 512k rows and won or tied at 1M): docs/gpu.md
WGMMA_ROW_ELEMS = 64  # wgmma path: the padded dim a multiple of this (whole 128-byte float16 lines)
INT8_K = 16  # int8 first pass: largest k
INT8_MAX_B = 16  # int8 first pass: largest batch (cuBLAS's int8 GEMM reads the rows at full bandwidth
# up to 16 queries; at 32 it took 0.6-0.7 ms at 1M x 768 against 0.2: bench/results/h200-2026-12-02g)
INT8_MIN_ROWS = 1 << 19  # int8 first pass: from this many rows
INT8_MAX_WORK = 1 << 27  # int8 first pass: rows x queries at most (one GEMM, 512 MiB of int32)
INT8_CAP_SHIFT = 9  # int8 first pass: it rescores up to n / 2^9 collected rows per query ...
INT8_CAP_MIN, INT8_CAP_MAX = 1024, 8192  # ... within these (random 768-dim rows collect ~1 in 5000)
HALF_SCORE_BYTES = 1 << 29  # half-score path: float16 scores per chunk (512 MiB: one chunk for
# 256 queries x 1M rows, so one large GEMM)

#: Batch size -> queries per block of the fused kernel (the smallest QT >= b).
QT_FOR = {b: next(q for q in SMALL_QT if q >= b) for b in range(1, SMALL_QT[-1] + 1)}

# The plans handed out (a search should not pay for building one).
_PLANS = {path: Plan(path) for path in SearchPath}
_FUSED_PLANS = {qt: Plan(SearchPath.FUSED, qt) for qt in SMALL_QT}

#: The path that redoes the queries a proving path could not prove exact: float32 scores decide.
REDO = {SearchPath.HALF_GEMM: SearchPath.GEMM, SearchPath.WGMMA: SearchPath.EXACT, SearchPath.INT8: SearchPath.GEMM}


@dataclass(frozen=True, slots=True)
class Limits:
    """What the planner needs of the device and the options. ``smem_optin``: the device's opt-in
    shared memory per block; ``small_batch_max`` / ``small_work_max``: the fused kernel serves up
    to this many queries, or up to this many rows x queries (the crossover against the GEMM path
    measured on an H200, docs/gpu.md); ``host_work``: see HOST_WORK (0: never the host);
    ``wgmma_min_rows``: see WGMMA_MIN_ROWS (tests lower it); ``wgmma_built``: the wgmma kernels
    were built (a Hopper device, ``--fused-kernel auto``, float16 storage); ``int8_on``: the int8
    first pass is on (``--int8-pass auto``, checked in the warm-up); ``int8_min_rows``: see
    INT8_MIN_ROWS (tests lower it)."""

    smem_optin: int
    small_batch_max: int = 1
    small_work_max: int = 1 << 12
    host_work: int = HOST_WORK
    wgmma_min_rows: int = WGMMA_MIN_ROWS
    wgmma_built: bool = False
    int8_on: bool = False
    int8_min_rows: int = INT8_MIN_ROWS


@dataclass(frozen=True, slots=True)
class Rows:
    """What the planner needs of the rows searched: storage, padded dim, the metric's l2-ness, a
    bound on every stored row's norm (0 while none is written), and whether an int8 copy of them
    fits on the device (False once it did not: ``int8.ensure``)."""

    storage: Storage
    dpad: int
    l2: bool
    max_norm: float
    int8_room: bool = True


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def small_smem(qt: int, dpad: int) -> int:
    """Dynamic shared memory of the fused kernel for ``qt`` queries of ``dpad`` floats."""
    warps = BLOCK // 32
    return 4 * (qt * dpad + qt) + warps * qt * 32 * 8 + 16


def half_ok(rows: Rows, k: int) -> bool:
    """Can the half-score path serve k over these rows? Float16 storage, row norms bounded."""
    return rows.storage is Storage.FLOAT16 and k <= HALF_K and 0.0 < rows.max_norm < 1e30


def wgmma_ok(rows: Rows, k: int) -> bool:
    """Can the wgmma path (its kernels built) serve k over these rows? Float16 storage, inner
    product (dot, cosine), rows whose norms are bounded, whole 128-byte lines."""
    return (
        rows.storage is Storage.FLOAT16
        and k <= WGMMA_K
        and not rows.l2
        and 0.0 < rows.max_norm < 1e30
        and rows.dpad % WGMMA_ROW_ELEMS == 0
    )


def int8_cap(n: int) -> int:
    """Rows the int8 first pass may collect and rescore per query over n rows (a power of two)."""
    return min(INT8_CAP_MAX, max(INT8_CAP_MIN, next_pow2(n >> INT8_CAP_SHIFT)))


def int8_ok(rows: Rows, k: int) -> bool:
    """Can the int8 first pass serve k over these rows? Row norms bounded, the copy fits."""
    return k <= INT8_K and rows.int8_room and 0.0 < rows.max_norm < 1e30


def plan(b: int, n: int, k: int, rows: Rows, limits: Limits) -> Plan:
    """The path of a batch of b queries for the top-k over rows [0, n) of ``rows``."""
    dpad = rows.dpad
    if b * n * dpad <= limits.host_work:
        return _PLANS[SearchPath.HOST]
    if limits.int8_on and b <= INT8_MAX_B and limits.int8_min_rows <= n and b * n <= INT8_MAX_WORK and int8_ok(rows, k):
        return _PLANS[SearchPath.INT8]
    if k <= WARP_K and (b <= limits.small_batch_max or n * b <= limits.small_work_max):
        qt = QT_FOR[min(b, SMALL_QT[-1])]
        while qt > 1 and small_smem(qt, dpad) > limits.smem_optin:
            qt //= 2
        if small_smem(qt, dpad) <= limits.smem_optin:
            return _FUSED_PLANS[qt]
    if (
        limits.wgmma_built
        and WGMMA_MIN_B <= b <= WGMMA_MAX_B
        and n >= limits.wgmma_min_rows * (1 if b <= 16 else 2)
        and wgmma_ok(rows, k)
    ):
        return _PLANS[SearchPath.WGMMA]
    if n * b >= HALF_WORK_MIN and half_ok(rows, k):
        return _PLANS[SearchPath.HALF_GEMM]
    return _PLANS[SearchPath.GEMM]


#: The paths a recency-weighted search can take.
BIASED_PATHS = (SearchPath.HOST, SearchPath.GEMM)


def plan_biased(b: int, n: int, rows: Rows, limits: Limits) -> Plan:
    """The path of a recency-weighted search of b queries over rows [0, n): the host copy for
    work of at most ``host_work``, else the float32-score GEMM (module docstring)."""
    if b * n * rows.dpad <= limits.host_work:
        return _PLANS[SearchPath.HOST]
    return _PLANS[SearchPath.GEMM]


def forced(path: SearchPath, b: int, k: int, rows: Rows, limits: Limits) -> Plan:
    """The plan of a path named by the caller (tests, benchmarks) instead of :func:`plan`'s choice.
    Raises ValueError when the path cannot serve this search."""
    if path is SearchPath.FUSED:
        if k > WARP_K:
            raise ValueError(f"the fused path serves k <= {WARP_K}")
        return _FUSED_PLANS[QT_FOR[min(b, SMALL_QT[-1])]]
    if path is SearchPath.INT8 and not (limits.int8_on and int8_ok(rows, k)):  # (any n x b: one GEMM)
        raise ValueError(
            f"the int8 path serves k <= {INT8_K} with --int8-pass auto (checked in the warm-up) "
            "where the rows' int8 copy fits"
        )
    if path is SearchPath.HALF_GEMM and not half_ok(rows, k):
        raise ValueError(f"the half-score path serves float16 storage and k <= {HALF_K}")
    if path in (SearchPath.WGMMA, SearchPath.EXACT) and not (limits.wgmma_built and wgmma_ok(rows, k)):
        raise ValueError(
            f"the {path.value} path serves a Hopper device (built), float16 storage, "
            f"dot or cosine, k <= {WGMMA_K} and a padded dim that is a multiple of 64"
        )
    return _PLANS[path]


def cheap_k(path: SearchPath) -> int:
    """The largest k' a filtered search can over-fetch on the path of its unfiltered search:
    HALF_K on the half-score GEMM, the wgmma path and the int8 pass (all serve k <= 16), else
    WARP_K."""
    return HALF_K if path in (SearchPath.HALF_GEMM, SearchPath.WGMMA, SearchPath.INT8) else WARP_K


#: A filtered search over-fetches (top-k' of every row, k' > k) when at least 1/OVERFETCH_FRACTION
#: of the rows match: first with the cheap k' (``cheap_k``: the largest k' that keeps the path of
#: the unfiltered search, WARP_K for the fused kernel and float32 GEMM, HALF_K for the half-score
#: GEMM) when that many rows are expected to hold at least OVERFETCH_FIRST times k matches, then
#: with k' expecting OVERFETCH_MARGIN times k of them (at most OVERFETCH_MAX_K) for the queries the
#: first could not prove; the rest (or every query, when few rows match) search the gathered rows.
#: A batch whose cheap round cannot prove k searches the gathered rows at once when they are (or
#: can be) kept: a larger k' would leave the half-score path for one several times slower.
OVERFETCH_FRACTION = 4
OVERFETCH_FIRST = 1.25
OVERFETCH_MARGIN = 2.0
OVERFETCH_MAX_K = 256
GATHER_CACHE_MIN_BYTES = 64 << 20  # gathered candidate rows kept per matrix: at least this much
GATHER_CACHE_FRACTION = 0.6  # ... and up to this fraction of the matrix (a quarter of free memory at most)


def filtered_plan(
    k: int, matches: int, n: int, k_limit: int, *, cheap_k: int = WARP_K, gather_kept: bool = False
) -> list[int]:
    """The k' of each over-fetch round of a filtered search of ``matches`` rows out of ``n``
    (none: gather at once). ``cheap_k``: see above; ``gather_kept``: the gathered rows are
    cached or would be. Pure."""
    if matches * OVERFETCH_FRACTION < n:
        return []
    cap = min(k_limit, OVERFETCH_MAX_K, n)
    tiers = []
    if k <= cheap_k and cheap_k * matches >= OVERFETCH_FIRST * k * n and cheap_k <= cap:
        tiers.append(cheap_k)
    elif cheap_k < WARP_K and gather_kept:
        return []
    kp = next_pow2(math.ceil(OVERFETCH_MARGIN * k * n / matches))
    kp = max(kp, WARP_K, k)
    if kp <= cap and (not tiers or kp > tiers[-1]):
        tiers.append(kp)
    return tiers
