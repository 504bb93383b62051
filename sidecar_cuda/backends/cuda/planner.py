"""Which path a CUDA search takes, and how big its pieces are. Pure: no CuPy, no device.

* ``small``: the fused kernel (k <= 32, and one query or a small score matrix);
* ``gemmh``: the half-score GEMM (float16 storage, k <= 16, a large score matrix);
* ``wgmma``: fused float16 tensor-core scoring + exact top-k (``kalos_wgmma.cu``, Hopper only):
  float16 storage, inner product, k <= 16, 2-32 queries, at least ``wgmma_min_rows`` rows (twice
  that above 16 queries) whose padded dim is whole 128-byte lines, where it was measured to beat
  the GEMM paths;
* ``gemm``: the float32-score GEMM, everything else;
* ``host``: work too small to pay for a launch (at most ``host_work`` rows x queries x padded dim,
  ``--host-search-work``) is scored on the sidecar's CPU from a float32 copy of the stored rows.

The thresholds were measured on an H200 (docs/gpu.md).
"""

from __future__ import annotations

import math

from .kernels import BLOCK, SMALL_QT, WARP_K

ROWS_PER_BLOCK = 256  # the fused path gives each block at least this many rows
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
# copy at most. Measured in-process on the H200's host (bench/results/h200-2026-12-01e/
# probe-host-path.json): the host copy wins at every shape up to 196 608 (by 10-60 %) and loses
# at 262 144 (by 10-25 %)
WGMMA_K = 16  # wgmma path: largest k (the answer is proven exact against 32 candidates)
WGMMA_MIN_B, WGMMA_MAX_B = 2, 32  # wgmma path: batch sizes where it was measured to win or tie
# (a lone query takes the small fused kernel first). Through the backend (x 768 float16, k = 10,
# H200; its GPU time over the faster GEMM path's, wall in brackets): b = 2-12: 0.85-0.93 (0.89-0.94)
# at 1M and 2M rows (bench/results/h200-2026-12-02/); b = 16: 0.85-0.93 at 1M (0.88-0.94), 0.85 at
# 512k (0.95), 0.94 at 256k (1.02); b = 24-32: 0.89-0.98 at 1M (0.92-1.00) and 0.85 at 2M (0.89),
# 1.02 at 512k (1.09), 1.05 at 256k (h200-2026-12-01f/); b = 64: 1.10-1.20 everywhere (the
# prototype's sampled starting gate is not in this path); b = 17-32 run the 32-query tile
WGMMA_MIN_ROWS = 1 << 19  # wgmma path: from this many rows at b <= 16, twice as many for b = 17-32
# (the 32-query tile): the wall time wins from 512k rows at b = 16, and at b = 32 loses at 512k
# and wins or ties at 1M
WGMMA_ROW_ELEMS = 64  # wgmma path: the padded dim a multiple of this (whole 128-byte float16 lines)
HALF_SCORE_BYTES = 1 << 29  # half-score path: float16 scores per chunk (512 MiB: one chunk for
# 256 queries x 1M rows, so one large GEMM)

#: Batch size -> queries per block of the fused kernel (the smallest QT >= b).
QT_FOR = {b: next(q for q in SMALL_QT if q >= b) for b in range(1, SMALL_QT[-1] + 1)}


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def small_smem(qt: int, dpad: int) -> int:
    """Dynamic shared memory of the fused kernel for ``qt`` queries of ``dpad`` floats."""
    warps = BLOCK // 32
    return 4 * (qt * dpad + qt) + warps * qt * 32 * 8 + 16


def half_ok(storage_code: int, k: int, max_norm: float) -> bool:
    """Can the half-score path serve k over rows whose norms are bounded by ``max_norm``?"""
    return storage_code == 1 and k <= HALF_K and 0.0 < max_norm < 1e30


def wgmma_ok(storage_code: int, k: int, l2: bool, max_norm: float, dpad: int) -> bool:
    """Can the wgmma path (its kernels built) serve k over these rows? Float16 storage, inner
    product (dot, cosine), rows whose norms are bounded by ``max_norm``, whole 128-byte lines."""
    return (storage_code == 1 and k <= WGMMA_K and not l2 and 0.0 < max_norm < 1e30
            and dpad % WGMMA_ROW_ELEMS == 0)


def plan_path(b: int, n: int, k: int, dpad: int, *, smem_optin: int, small_batch_max: int,
              small_work_max: int, half: bool, host_work: int = 0, wgmma: bool = False,
              wgmma_min_rows: int = WGMMA_MIN_ROWS) -> tuple[str, int]:
    """("host", 0), ("small", QT), ("wgmma", 0), ("gemmh", 0) or ("gemm", 0) for a batch of b
    queries over n rows. ``half``: :func:`half_ok` for this matrix and k; ``host_work``: see
    HOST_WORK; ``wgmma``: :func:`wgmma_ok` for this matrix and k, and the kernels are built
    (a Hopper device, ``--fused-kernel auto``); ``wgmma_min_rows``: see WGMMA_MIN_ROWS."""
    if b * n * dpad <= host_work:
        return "host", 0
    if k <= WARP_K and (b <= small_batch_max or n * b <= small_work_max):
        qt = QT_FOR[min(b, SMALL_QT[-1])]
        while qt > 1 and small_smem(qt, dpad) > smem_optin:
            qt //= 2
        if small_smem(qt, dpad) <= smem_optin:
            return "small", qt
    if (wgmma and WGMMA_MIN_B <= b <= WGMMA_MAX_B and n >= wgmma_min_rows * (1 if b <= 16 else 2)
            and k <= WGMMA_K and dpad % WGMMA_ROW_ELEMS == 0):
        return "wgmma", 0
    if n * b >= HALF_WORK_MIN and half:
        return "gemmh", 0
    return "gemm", 0


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


def filtered_plan(k: int, matches: int, n: int, k_limit: int, *, cheap_k: int = WARP_K,
                  gather_kept: bool = False) -> list[int]:
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


def size_bucket(b: int) -> str:
    """Batch-size bucket of the per-path search statistics."""
    return "1" if b == 1 else "2-8" if b <= 8 else "9-64" if b <= 64 else "65-512" if b <= 512 else ">512"
