"""The search paths (see backend.py's docstring) as free functions: each takes the :class:`Device`,
the :class:`BufferSet` the search writes, the rows and typed parameters, and enqueues its work on
the device's stream (the host path answers at once). :func:`enqueue` runs a :class:`Plan`; the
answer is read by ``search.collect`` once the set's ``done`` event has happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..base import Decay, SearchResult
from ..numpy_backend import topk_rows
from .buffers import BufferSet
from .device import Device
from .int8 import ROWS_ALIGN, padded_rows
from .int8 import ensure as ensure_int8
from .kernels import BLOCK, HALF_CAND, HEADER_BYTES, WARP_K, Storage
from .planner import (
    GEMM_BLOCKS,
    HALF_SCORE_BYTES,
    ROWS_PER_BLOCK,
    SCORE_BUFFER_FLOATS,
    ZERO_COPY_BLOCKS,
    Plan,
    SearchPath,
    int8_cap,
    next_pow2,
    small_smem,
)
from .recency import add_recency
from .rows import DeviceRows, host_copy, host_times
from .wgmma import KC as WGMMA_KC
from .wgmma import MERGE_THREADS as WGMMA_MERGE_THREADS
from .wgmma import PREP_THREADS as WGMMA_PREP_THREADS
from .wgmma import THREADS as WGMMA_THREADS
from .wgmma import parts_for

log = logging.getLogger("kalos.cuda")

_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_COMPUTE_32I = 72
_CUBLAS_GEMM_DEFAULT = -1
_CUDA_R_32F, _CUDA_R_8I, _CUDA_R_32I = 0, 3, 10
# cuBLAS reads alpha and beta from host memory; int32 for an int32 computation.
_ONE_I32 = np.ones(1, np.int32)
INT8_THREADS = 1024  # kalos_i8_threshold and kalos_i8_final: a block of 32 warps per query
INT8_CHAMPIONS = 128  # int8 first pass: slices per query, each giving its best row (<= 256)
_ZERO_I32 = np.zeros(1, np.int32)


def search_host(dev: Device, m: DeviceRows, q: np.ndarray, n: int, k: int, decay: Decay | None = None) -> SearchResult:
    """Exact top-k of float32 queries over rows [0, n), scored on the CPU from the host copy of
    the stored rows (work too small to pay a launch). The formulas are the kernels': q.x, or
    2 q.x - |x|^2 - |q|^2 for l2; ``decay``: plus each row's recency part."""
    with dev.guard("a search of the host copy"):
        stored, sqn = host_copy(dev, m, n)
    scores: np.ndarray = q.dot(stored[:n].T)
    if m.l2:
        qn = np.einsum("ij,ij->i", q, q)
        scores = 2.0 * scores - sqn[None, :n] - qn[:, None]
    if decay is not None:
        scores += decay.bias(host_times(dev, m, n))
    return topk_rows(scores, k)


def enqueue(
    dev: Device,
    bufs: BufferSet,
    plan: Plan,
    m: DeviceRows,
    q: np.ndarray,
    n: int,
    k: int,
    kk: int,
    decay: Decay | None = None,
) -> None:
    """Enqueue the search of float32 queries ``q`` (b, dim) over rows [0, n) of ``m`` on
    ``plan``'s path (not HOST), writing into ``bufs``, and record ``bufs.done`` after it.
    ``decay``: a recency-weighted search (the GEMM path only: ``planner.plan_biased``)."""
    dev.seq += 1
    bufs.seq = dev.seq
    b = len(q)
    bufs.make_room(bufs.h_out, 8 * b * kk + 4 * b)
    path = plan.path
    if decay is not None and path is not SearchPath.GEMM:
        raise ValueError(f"a recency-weighted search does not take the {path.value} path")
    if path is SearchPath.FUSED:
        search_fused(dev, bufs, m, q, n, k, plan.qt)
    elif path is SearchPath.HALF_GEMM:
        search_half_gemm(dev, bufs, m, q, n, kk)
    elif path is SearchPath.WGMMA:
        search_wgmma(dev, bufs, m, q, n, kk)
    elif path is SearchPath.INT8:
        search_int8(dev, bufs, m, q, n, kk)
    elif path is SearchPath.EXACT:
        search_gemm(dev, bufs, m, q, n, k, kk, exact=True)
    elif path is SearchPath.GEMM:
        search_gemm(dev, bufs, m, q, n, k, kk, decay=decay)
    else:
        raise ValueError(f"{path} is not enqueued on the device")
    bufs.done.record(dev.stream)


def _stage_queries(bufs: BufferSet, q: np.ndarray, dpad: int, header: tuple[int, ...] | None) -> None:
    """Copy the queries into the pinned request buffer as float32 rows of dpad values (zeros
    past dim), after the header when one is given."""
    b, d = q.shape
    bufs.make_room(bufs.h_req, HEADER_BYTES + 4 * b * dpad)
    if header is not None:
        bufs.h_req.view(np.int32, 4)[:] = header
    if d == dpad:
        bufs.h_req.view(np.float32, b * d, HEADER_BYTES)[:] = q.reshape(-1)
    else:
        dst = bufs.h_req.view(np.float32, b * dpad, HEADER_BYTES).reshape(b, dpad)
        dst[:, :d] = q
        dst[:, d:] = 0.0


def _host_queries(dev: Device, bufs: BufferSet, q: np.ndarray, dpad: int) -> int:
    """Host address of the queries as float32 rows of dpad values, for one H2D copy: in place when
    they already sit in pinned memory, else staged into the request buffer."""
    src = dev.pinned_address(q) if q.shape[1] == dpad else None
    if src is None:
        _stage_queries(bufs, q, dpad, None)
        src = bufs.h_req.ptr + HEADER_BYTES
    return src


def search_fused(dev: Device, bufs: BufferSet, m: DeviceRows, q: np.ndarray, n: int, k: int, qt: int) -> None:
    """The fused kernel, ``qt`` queries per block; captured into a CUDA graph per launch shape
    and replayed when the device's graphs are on."""
    b = len(q)
    dpad = m.dpad
    tiles = -(-b // qt)
    smem = small_smem(qt, dpad)
    per_sm = dev.occupancy(dev.kernels.small[qt].kernel, BLOCK, smem, (qt, smem))
    parts = max(1, min(-(-n // ROWS_PER_BLOCK), per_sm * dev.sms // tiles))
    zero_copy = tiles * parts <= ZERO_COPY_BLOCKS
    req_bytes = HEADER_BYTES + 4 * tiles * qt * dpad
    bufs.make_room(bufs.h_req, req_bytes)
    if not zero_copy:
        bufs.make_room(bufs.d_req, req_bytes)
    if parts > 1:
        bufs.make_room(bufs.d_cand, 8 * tiles * qt * parts * k)
        bufs.make_room(bufs.d_counters, 4 * tiles)
    _stage_queries(bufs, q, dpad, (n, b, k, m.l2))
    kk = min(k, n)
    s = dev.stream
    key = None
    if dev.graphs.enabled:
        # Everything a graph bakes in: shapes, the rows and every buffer's address (the epoch
        # changes when one moves). Scores follow the b * kk rows in the output.
        key = (qt, tiles, parts, zero_copy, dpad, m.ptrs, b * kk, bufs.index, bufs.epoch)
        g = dev.graphs.get(key)
        if g is not None:
            g.launch(s)
            return
    kern = dev.kernels.small[qt]
    out = bufs.h_out
    cand_r = bufs.d_cand.ptr + 4 * tiles * qt * parts * k
    args = (
        m.data,
        m.sqn,
        np.int32(dpad),
        bufs.h_req.ptr if zero_copy else bufs.d_req.ptr,
        bufs.d_cand.ptr,
        cand_r,
        bufs.d_counters.ptr,
        out.ptr + 4 * b * kk,
        out.ptr,
    )
    rt = dev.rt

    def launch() -> None:
        if not zero_copy:
            rt.memcpyAsync(bufs.d_req.ptr, bufs.h_req.ptr, req_bytes, rt.memcpyHostToDevice, s.ptr)
        kern((tiles, parts), (BLOCK,), args, shared_mem=smem, stream=s)

    if key is None:
        launch()
        return
    g = _capture(dev, launch)
    if g is None:
        return  # capture failed and was reported; the work ran directly
    dev.graphs.put(key, g, dev.seq)
    g.launch(s)


def search_mixed(
    dev: Device, bufs: BufferSet, mats: Sequence[DeviceRows], n: np.ndarray, of_query: np.ndarray, q: np.ndarray, k: int
) -> None:
    """``kalos_mixed``: query j over rows [0, n[i]) of ``mats[i]``, i = ``of_query[j]``, in one
    launch (no graph: the rows' addresses change from batch to batch). The answer: k entries per
    query in ``bufs.h_out`` (rows int32, then scores), row -1 past a namespace's rows."""
    dev.seq += 1
    bufs.seq = dev.seq
    b, d = q.shape
    dpad = mats[0].dpad
    smem = small_smem(1, dpad)
    per_sm = dev.occupancy(dev.kernels.mixed.kernel, BLOCK, smem, (-1, smem))
    most = int(n.max())
    parts = max(1, min(-(-most // ROWS_PER_BLOCK), per_sm * dev.sms // b))
    q_bytes = 4 * b * dpad
    req_bytes = q_bytes + 20 * b
    bufs.make_room(bufs.h_req, req_bytes)
    bufs.make_room(bufs.d_req, req_bytes)
    bufs.make_room(bufs.h_out, 8 * b * k)
    if parts > 1:
        bufs.make_room(bufs.d_cand, 8 * b * parts * k)
        bufs.make_room(bufs.d_counters, 4 * b)
    dst = bufs.h_req.view(np.float32, b * dpad).reshape(b, dpad)
    dst[:, :d] = q
    if d < dpad:
        dst[:, d:] = 0.0
    xs = np.fromiter((m.ptrs[0] for m in mats), np.uint64, len(mats))
    sqns = np.fromiter((m.ptrs[1] for m in mats), np.uint64, len(mats))
    bufs.h_req.view(np.uint64, b, q_bytes)[:] = xs[of_query]
    bufs.h_req.view(np.uint64, b, q_bytes + 8 * b)[:] = sqns[of_query]
    bufs.h_req.view(np.int32, b, q_bytes + 16 * b)[:] = n[of_query]
    s = dev.stream
    rt = dev.rt
    rt.memcpyAsync(bufs.d_req.ptr, bufs.h_req.ptr, req_bytes, rt.memcpyHostToDevice, s.ptr)
    out = bufs.h_out
    dev.kernels.mixed(
        (b, parts),
        (BLOCK,),
        (
            bufs.d_req.ptr,
            np.int32(b),
            np.int32(dpad),
            np.int32(k),
            np.int32(mats[0].l2),
            bufs.d_cand.ptr,
            bufs.d_cand.ptr + 4 * b * parts * k,
            bufs.d_counters.ptr,
            out.ptr + 4 * b * k,
            out.ptr,
        ),
        shared_mem=smem,
        stream=s,
    )
    bufs.done.record(s)


def _capture(dev: Device, launch: Callable[[], None]) -> Any:
    """A CUDA graph of what ``launch`` enqueues; None (graphs off for good, the work launched
    directly) when capturing fails."""
    s = dev.stream
    try:
        s.begin_capture()
        try:
            launch()
        finally:
            g = s.end_capture()
        return g
    except Exception as e:
        log.warning("CUDA graph capture failed (%s: %s); launching directly from now on", type(e).__name__, e)
        dev.graphs.enabled = False
        launch()
        return None


def search_gemm(
    dev: Device,
    bufs: BufferSet,
    m: DeviceRows,
    q: np.ndarray,
    n: int,
    k: int,
    kk: int,
    *,
    exact: bool = False,
    decay: Decay | None = None,
) -> None:
    """The GEMM path; ``exact`` (float16 storage, the wgmma path's redo of the queries it could not
    prove): the scores are the float32 queries times the stored rows, accumulated in float32 by
    kw_exact instead of cuBLAS with the queries rounded to float16. ``decay``: each chunk's scores
    get the rows' recency parts added before its top-k kernel selects."""
    cp, rt = dev.cp, dev.rt
    exact_fn = None
    if exact:
        assert dev.wgmma is not None and dev.wgmma.shapes, "the wgmma kernels are not built"
        exact_fn = next(iter(dev.wgmma.shapes.values())).exact
    b, _d = q.shape
    dpad = m.dpad
    s = dev.stream
    src = _host_queries(dev, bufs, q, dpad)
    isz = dev.storage.itemsize
    f32 = dev.storage is Storage.FLOAT32
    qs_bytes = -(-(b * dpad * isz) // 256) * 256
    bufs.make_room(bufs.d_q, 4 * b * dpad + qs_bytes + 4 * b)
    q32 = bufs.d_q.ptr
    qs = q32 + 4 * b * dpad
    qn = qs + qs_bytes
    chunk = max(1, min(n, SCORE_BUFFER_FLOATS // b))
    bufs.make_room(bufs.d_scores, 4 * b * chunk)
    chunks = [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]
    parts = []
    for c0, c1 in chunks:
        nc = c1 - c0
        parts.append(max(1, min(-(-GEMM_BLOCKS // b), nc // max(4 * k, 256) or 1, nc)))
    total = sum(parts)
    bufs.make_room(bufs.d_cand, 8 * b * total * k)
    bufs.make_room(bufs.d_counters, 4 * b)
    cand_s = bufs.d_cand.ptr
    cand_r = cand_s + 4 * b * total * k
    out_r = bufs.h_out.ptr
    out_s = out_r + 4 * b * kk
    l2 = m.l2
    rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
    dev.kernels.prep(
        (-(-b * 32 // BLOCK),), (BLOCK,), (q32, 0 if f32 else qs, qn, np.int32(b), np.int32(dpad)), stream=s
    )
    a_q = q32 if f32 else qs
    handle = cp.cuda.device.get_cublas_handle()

    big_k = k > WARP_K
    C = next_pow2(k + BLOCK)
    p_off = 0
    with s:  # cuBLAS runs on the current stream
        for (c0, c1), pc in zip(chunks, parts):
            nc = c1 - c0
            if exact_fn is not None:  # scores[q][r] as cuBLAS would write them
                blocks = max(1, min(-(-nc // (WGMMA_PREP_THREADS // 32)), 4 * dev.sms))
                exact_fn(
                    (blocks, b),
                    (WGMMA_PREP_THREADS,),
                    (m.data.data.ptr + c0 * dpad * isz, np.int32(nc), np.int32(dpad), q32, bufs.d_scores.ptr),
                    stream=s,
                )
            else:
                _gemm_scores(dev, bufs, handle, m.data.data.ptr + c0 * dpad * isz, nc, a_q, b, dpad, _CUDA_R_32F, nc)
            if decay is not None:
                add_recency(dev, bufs.d_scores.ptr, b, nc, c0, m.times, decay, bool(l2))
            args = (
                bufs.d_scores.ptr,
                np.int32(nc),
                np.int64(c0),
                m.sqn,
                qn,
                np.int32(l2),
                np.int32(k),
                np.int32(kk),
                *_merge_args(pc, p_off, total, cand_s, cand_r, bufs.d_counters.ptr),
                out_s,
                out_r,
            )
            if big_k:
                dev.kernels.scores_b((pc, b), (BLOCK,), (*args, np.int32(C)), shared_mem=8 * C + 16, stream=s)
            else:
                dev.kernels.scores_w((pc, b), (BLOCK,), args, stream=s)
            p_off += pc


def _gemm_scores(
    dev: Device,
    bufs: BufferSet,
    handle: int,
    rows: int,
    nc: int,
    queries: int,
    b: int,
    dpad: int,
    out_type: int,
    ld: int,
) -> None:
    """cuBLAS, on the current stream: the scores of ``nc`` stored rows from device address ``rows``
    against ``b`` queries at ``queries`` (both in the storage type, ``dpad`` apart), accumulated in
    float32, into ``bufs.d_scores`` as one row of ``ld`` scores of type ``out_type`` per query."""
    from cupy_backends.cuda.libs import cublas

    cublas.gemmEx(
        handle,
        _CUBLAS_OP_T,
        _CUBLAS_OP_N,
        nc,
        b,
        dpad,
        dev.alpha.ctypes.data,
        rows,
        dev.storage.cuda_type,
        dpad,
        queries,
        dev.storage.cuda_type,
        dpad,
        dev.beta.ctypes.data,
        bufs.d_scores.ptr,
        out_type,
        ld,
        _CUBLAS_COMPUTE_32F,
        _CUBLAS_GEMM_DEFAULT,
    )


def _merge_args(pc: int, p_off: int, total: int, cand_s: int, cand_r: int, counters: int) -> tuple[Any, ...]:
    """The arguments the top-k kernels of a chunk share (``Pc, p_off, P, cand_s, cand_r,
    counters`` in ``kalos_topk.cu``): the chunk's ``pc`` blocks, the first of them ``p_off``
    among ``total``, where each block leaves its candidates (scores, rows) and the per-query
    counters that tell the last block to merge them."""
    return (np.int32(pc), np.int32(p_off), np.int32(total), cand_s, cand_r, counters)


def search_half_gemm(dev: Device, bufs: BufferSet, m: DeviceRows, q: np.ndarray, n: int, kk: int) -> None:
    """The half-score GEMM (float16 storage, k <= 16): float16 scores of power-of-two scaled
    queries, the 32 best rows per query rescored in float32, with proof flags for the redo."""
    cp, rt = dev.cp, dev.rt
    b, _d = q.shape
    dpad = m.dpad
    s = dev.stream
    src = _host_queries(dev, bufs, q, dpad)
    qs_bytes = -(-(b * dpad * 2) // 256) * 256
    bufs.make_room(bufs.d_q, 4 * b * dpad + qs_bytes + 8 * b)
    q32 = bufs.d_q.ptr
    qs = q32 + 4 * b * dpad
    qn = qs + qs_bytes
    qscale = qn + 4 * b
    # Row stride of the scores a multiple of 8 (16-byte loads); chunks of rows likewise.
    n8 = -(-n // 8) * 8
    chunk = max(8, min(n8, (HALF_SCORE_BYTES // 2 // b) // 8 * 8))
    bufs.make_room(bufs.d_scores, 2 * b * chunk)
    chunks = [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]
    parts = [max(1, min(-(-GEMM_BLOCKS // b), -(-(c1 - c0) // 8) // 64 or 1)) for c0, c1 in chunks]
    total = sum(parts)
    bufs.make_room(bufs.d_cand, 8 * b * total * HALF_CAND)
    bufs.make_room(bufs.d_counters, 4 * b)
    bufs.make_room(bufs.d_top, 8 * b * HALF_CAND)
    cand_s = bufs.d_cand.ptr
    cand_r = cand_s + 4 * b * total * HALF_CAND
    top_s = bufs.d_top.ptr
    top_r = top_s + 4 * b * HALF_CAND
    out_r = bufs.h_out.ptr
    out_s = out_r + 4 * b * kk
    flags = out_s + 4 * b * kk
    xmax = np.float32(m.max_norm)
    rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
    dev.kernels.prep_h(
        (-(-b * 32 // BLOCK),), (BLOCK,), (q32, qs, qn, qscale, np.int32(b), np.int32(dpad), xmax), stream=s
    )
    handle = cp.cuda.device.get_cublas_handle()

    p_off = 0
    with s:  # cuBLAS runs on the current stream
        for (c0, c1), pc in zip(chunks, parts):
            nc = c1 - c0
            ld = -(-nc // 8) * 8
            _gemm_scores(dev, bufs, handle, m.data.data.ptr + c0 * dpad * 2, nc, qs, b, dpad, dev.storage.cuda_type, ld)
            dev.kernels.hscores(
                (pc, b),
                (BLOCK,),
                (
                    bufs.d_scores.ptr,
                    np.int32(nc),
                    np.int32(ld),
                    np.int64(c0),
                    m.sqn,
                    qn,
                    qscale,
                    np.int32(m.l2),
                    *_merge_args(pc, p_off, total, cand_s, cand_r, bufs.d_counters.ptr),
                    top_s,
                    top_r,
                ),
                stream=s,
            )
            p_off += pc
    dev.kernels.rescore(
        (b,),
        (BLOCK,),
        (
            m.data,
            m.sqn,
            np.int32(dpad),
            q32,
            qn,
            qscale,
            np.int32(m.l2),
            xmax,
            np.int32(kk),
            top_s,
            top_r,
            out_s,
            out_r,
            flags,
        ),
        stream=s,
    )


def search_int8(dev: Device, bufs: BufferSet, m: DeviceRows, q: np.ndarray, n: int, kk: int) -> None:
    """The int8 first pass (k <= 16; ``kalos_topk.cu``): int32 products of the int8 copies of the
    queries and rows (cuBLAS), the row of highest upper bound in each of 128 slices rescored in
    float32 for a threshold, every row whose bound reaches it collected, rescored and sorted; a
    query that collects more than ``int8_cap(n)`` rows is flagged for the redo."""
    cp, rt = dev.cp, dev.rt
    i8 = ensure_int8(dev, m)
    b, _d = q.shape
    dpad, dp8 = m.dpad, i8.dp8
    bp = -(-b // ROWS_ALIGN) * ROWS_ALIGN  # (cuBLAS int8: n a multiple of 4; zero queries)
    s = dev.stream
    src = _host_queries(dev, bufs, q, dpad)
    q8_bytes = -(-(bp * dp8) // 256) * 256
    bufs.make_room(bufs.d_q, 4 * b * dpad + q8_bytes + 16 * bp)
    q32 = bufs.d_q.ptr
    q8 = q32 + 4 * b * dpad  # (16-byte aligned: dpad is whole 16-byte vectors of float32 or less)
    qi = q8 + q8_bytes
    n4 = min(padded_rows(n), i8.capacity)  # rows multiplied (one GEMM: planner.INT8_MAX_WORK)
    cap = int8_cap(n)
    parts = INT8_CHAMPIONS
    bufs.make_room(bufs.d_scores, 4 * bp * n4)
    bufs.make_room(bufs.d_top, 8 * b * parts + 8 * b + 4 * b * cap)
    champ_s = bufs.d_top.ptr
    champ_r = champ_s + 4 * b * parts
    thr = champ_r + 4 * b * parts
    cnt = thr + 4 * b
    col = cnt + 4 * b
    out_r = bufs.h_out.ptr
    out_s = out_r + 4 * b * kk
    flags = out_s + 4 * b * kk
    xmax = np.float32(m.max_norm)
    l2 = np.int32(m.l2)
    rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
    k = dev.kernels
    k.i8_queries(
        (-(-bp * 32 // BLOCK),),
        (BLOCK,),
        (q32, np.int32(b), np.int32(bp), np.int32(dpad), np.int32(dp8), xmax, q8, qi),
        stream=s,
    )
    handle = cp.cuda.device.get_cublas_handle()
    from cupy_backends.cuda.libs import cublas

    with s:  # cuBLAS runs on the current stream
        cublas.gemmEx(
            handle,
            _CUBLAS_OP_T,
            _CUBLAS_OP_N,
            n4,
            bp,
            dp8,
            _ONE_I32.ctypes.data,
            i8.data.data.ptr,
            _CUDA_R_8I,
            dp8,
            q8,
            _CUDA_R_8I,
            dp8,
            _ZERO_I32.ctypes.data,
            bufs.d_scores.ptr,
            _CUDA_R_32I,
            n4,
            _CUBLAS_COMPUTE_32I,
            _CUBLAS_GEMM_DEFAULT,
        )
    S, nn = bufs.d_scores.ptr, np.int32(n)
    k.i8_champions(
        (parts, b),
        (BLOCK,),
        (S, np.int32(n4), nn, i8.scale, qi, m.sqn, l2, np.int32(parts), champ_s, champ_r),
        stream=s,
    )
    k.i8_threshold(
        (b,),
        (INT8_THREADS,),
        (m.data, m.sqn, np.int32(dpad), q32, qi, l2, xmax, np.int32(kk), np.int32(parts), champ_r, thr, cnt),
        stream=s,
    )
    blocks = max(1, min(-(-16 * dev.sms // b), -(-n // (4 * BLOCK))))
    k.i8_collect(
        (blocks, b), (BLOCK,), (S, np.int32(n4), nn, i8.scale, qi, m.sqn, l2, thr, cnt, col, np.int32(cap)), stream=s
    )
    k.i8_final(
        (b,),
        (INT8_THREADS,),
        (m.data, m.sqn, np.int32(dpad), q32, qi, l2, np.int32(kk), cnt, col, np.int32(cap), out_s, out_r, flags),
        shared_mem=8 * cap,
        stream=s,
    )


def search_wgmma(dev: Device, bufs: BufferSet, m: DeviceRows, q: np.ndarray, n: int, kk: int) -> None:
    """The wgmma path (float16 storage, k <= 16): one H2D copy of the float32 queries, then
    kw_prep (scaled float16 queries, |q|^2, gates), kw_fused (scores and candidate lists of rows
    [0, n) of the stored matrix, in place) and kw_merge (float32 rescore, answer and proof flags
    straight into the pinned answer buffer); search.collect redoes flagged queries."""
    assert dev.wgmma is not None, "the wgmma kernels are not built"
    rt = dev.rt
    b = len(q)
    dpad = m.dpad
    s = dev.stream
    sh = dev.wgmma.shape(b)
    qy = -(-b // sh.bq)
    bpad = qy * sh.bq
    parts = parts_for(n, qy, sh.resident)
    src = _host_queries(dev, bufs, q, dpad)
    q32_bytes = -(-(4 * b * dpad) // 256) * 256
    qh_bytes = -(-(2 * bpad * dpad) // 256) * 256
    bufs.make_room(bufs.d_q, q32_bytes + qh_bytes + 12 * b)
    q32 = bufs.d_q.ptr
    qh = q32 + q32_bytes
    qn = qh + qh_bytes
    qscale = qn + 4 * b
    gate = qscale + 4 * b
    bufs.make_room(bufs.d_cand, 8 * b * parts * WGMMA_KC)
    cand_s = bufs.d_cand.ptr
    cand_r = cand_s + 4 * b * parts * WGMMA_KC
    out_r = bufs.h_out.ptr
    out_s = out_r + 4 * b * kk
    flags = out_s + 4 * b * kk
    i32 = np.int32
    rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
    sh.prep((bpad,), (WGMMA_PREP_THREADS,), (q32, i32(b), i32(dpad), i32(bpad), qh, qn, qscale, gate), stream=s)
    sh.fused(
        (parts * qy,),
        (WGMMA_THREADS,),
        (m.data, i32(n), i32(dpad), qh, i32(b), i32(qy), i32(parts), gate, cand_s, cand_r),
        shared_mem=sh.smem,
        stream=s,
    )
    sh.merge(
        (b,),
        (WGMMA_MERGE_THREADS,),
        (
            cand_s,
            cand_r,
            i32(parts),
            m.data,
            i32(dpad),
            q32,
            qn,
            qscale,
            np.float32(m.max_norm * (1.0 + 2.0**-20)),
            i32(kk),
            out_r,
            out_s,
            flags,
        ),
        shared_mem=8 * parts * WGMMA_KC + 8 * WGMMA_KC,
        stream=s,
    )


__all__ = ["enqueue", "search_fused", "search_gemm", "search_half_gemm", "search_host", "search_int8", "search_wgmma"]
