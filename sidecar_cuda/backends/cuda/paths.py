"""The launch sequences of the CUDA backend's search paths (see backend.py's docstring):
staging the request, the fused kernel (captured into CUDA graphs), the GEMM and half-score GEMM
paths, and the wgmma path (``kalos_wgmma.cu``, Hopper) with its float32 redo.
:class:`SearchPaths` is a part of :class:`~kalos.sidecar_cuda.backends.cuda.backend.CupyBackend`: its
methods enqueue work on the backend's stream into the buffer set being enqueued (``_cur``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .buffers import Buffer, BufferSet
from .kernels import BLOCK, HALF_CAND, HEADER_BYTES, WARP_K, Kernels
from .matrix import CupyMatrix
from .planner import (
    GEMM_BLOCKS, GRAPH_CACHE, HALF_SCORE_BYTES, ROWS_PER_BLOCK, SCORE_BUFFER_FLOATS,
    ZERO_COPY_BLOCKS, next_pow2, small_smem,
)
from .wgmma import KC as WGMMA_KC
from .wgmma import MERGE_THREADS as WGMMA_MERGE_THREADS
from .wgmma import PREP_THREADS as WGMMA_PREP_THREADS
from .wgmma import THREADS as WGMMA_THREADS
from .wgmma import WgmmaKernels, parts_for

log = logging.getLogger("kalos.cuda")

_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1


class SearchPaths:
    """Enqueueing the paths; the state is the backend's (set in its ``__init__``)."""

    _cp: Any
    _rt: Any
    _stream: Any
    _kern: Kernels
    _wg: WgmmaKernels | None  # the wgmma path's kernels (None: not built, the path is off)
    _cur: BufferSet  # the set the search being enqueued writes
    _sms: int
    _itemsize: int
    _storage_code: int
    _cuda_type: int
    _alpha: np.ndarray
    _beta: np.ndarray
    _graphs: OrderedDict[tuple[Any, ...], Any]
    _retired: list[tuple[int, Any]]
    _seq: int
    _occupancy: dict[tuple[int, int], int]
    _pinned: list[tuple[int, int, Any]]
    use_graphs: bool
    half_unroll: int
    half_blocks: int
    stage_events: list[Any] | None

    def _ensure(self, buf: Buffer, nbytes: int) -> None:
        if buf.ensure(nbytes):
            self._cur.epoch += 1  # (stale graphs are never replayed, and age out of the cache)

    def _pinned_address(self, a: np.ndarray) -> int | None:
        if not a.flags.c_contiguous:
            return None
        addr: int = a.__array_interface__["data"][0]
        for ptr, nbytes, _mem in self._pinned:
            if ptr <= addr and addr + a.nbytes <= ptr + nbytes:
                return addr
        return None

    def _occupancy_of(self, qt: int, smem: int) -> int:
        key = (qt, smem)
        occ = self._occupancy.get(key)
        if occ is None:
            fn = self._kern.small[qt].kernel
            occ = int(self._cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, BLOCK, smem))
            self._occupancy[key] = max(1, occ)
        return self._occupancy[key]

    def _stage_queries(self, q: np.ndarray, dpad: int, header: tuple[int, ...] | None) -> None:
        b, d = q.shape
        self._ensure(self._cur.h_req, HEADER_BYTES + 4 * b * dpad)
        if header is not None:
            self._cur.h_req.view(np.int32, 4)[:] = header
        if d == dpad:
            self._cur.h_req.view(np.float32, b * d, HEADER_BYTES)[:] = q.reshape(-1)
        else:
            dst = self._cur.h_req.view(np.float32, b * dpad, HEADER_BYTES).reshape(b, dpad)
            dst[:, :d] = q
            dst[:, d:] = 0.0

    def _search_small(self, m: CupyMatrix, q: np.ndarray, n: int, k: int, qt: int) -> None:
        b = len(q)
        dpad = m.dpad
        tiles = -(-b // qt)
        smem = small_smem(qt, dpad)
        per_sm = self._occupancy_of(qt, smem)
        parts = max(1, min(-(-n // ROWS_PER_BLOCK), per_sm * self._sms // tiles))
        zero_copy = tiles * parts <= ZERO_COPY_BLOCKS
        req_bytes = HEADER_BYTES + 4 * tiles * qt * dpad
        self._ensure(self._cur.h_req, req_bytes)
        if not zero_copy:
            self._ensure(self._cur.d_req, req_bytes)
        if parts > 1:
            self._ensure(self._cur.d_cand, 8 * tiles * qt * parts * k)
            self._ensure(self._cur.d_counters, 4 * tiles)
        self._stage_queries(q, dpad, (n, b, k, m.l2))
        kk = min(k, n)
        s = self._stream
        key = None
        if self.use_graphs:
            # Everything a graph bakes in: shapes, the matrix and every buffer's address (the
            # epoch changes when one moves). Scores follow the b * kk rows in the output.
            key = (qt, tiles, parts, zero_copy, dpad, m.ptrs, b * kk, self._cur.index,
                   self._cur.epoch)
            g = self._graphs.get(key)
            if g is not None:
                g.launch(s)
                return
        kern = self._kern.small[qt]
        out = self._cur.h_out
        cand_r = self._cur.d_cand.ptr + 4 * tiles * qt * parts * k
        args = (m.data, m.sqn, np.int32(dpad), self._cur.h_req.ptr if zero_copy else self._cur.d_req.ptr,
                self._cur.d_cand.ptr, cand_r, self._cur.d_counters.ptr, out.ptr + 4 * b * kk, out.ptr)

        def enqueue() -> None:
            if not zero_copy:
                self._rt.memcpyAsync(self._cur.d_req.ptr, self._cur.h_req.ptr, req_bytes,
                                     self._rt.memcpyHostToDevice, s.ptr)
            kern((tiles, parts), (BLOCK,), args, shared_mem=smem, stream=s)

        if key is None:
            enqueue()
            return
        g = self._capture(enqueue)
        if g is None:
            return  # capture failed and was reported; the work ran directly
        self._graphs[key] = g
        while len(self._graphs) > GRAPH_CACHE:
            # A graph may still run for a pending search: it is destroyed once every search
            # enqueued before its eviction has been collected (_collect).
            self._retired.append((self._seq, self._graphs.popitem(last=False)[1]))
        g.launch(s)

    def _capture(self, enqueue: Callable[[], None]) -> Any:
        s = self._stream
        try:
            s.begin_capture()
            try:
                enqueue()
            finally:
                g = s.end_capture()
            return g
        except Exception as e:
            log.warning("CUDA graph capture failed (%s: %s); launching directly from now on",
                        type(e).__name__, e)
            self.use_graphs = False
            enqueue()
            return None

    def _host_queries(self, q: np.ndarray, dpad: int) -> int:
        """Host address of the queries as float32 rows of dpad values, for one H2D copy: in
        place when they already sit in pinned memory, else staged into the request buffer."""
        src = self._pinned_address(q) if q.shape[1] == dpad else None
        if src is None:
            self._stage_queries(q, dpad, None)
            src = self._cur.h_req.ptr + HEADER_BYTES
        return src

    def _search_gemm(self, m: CupyMatrix, q: np.ndarray, n: int, k: int, kk: int, *,
                     exact: bool = False) -> None:
        """The GEMM path; ``exact`` (float16 storage, the wgmma path's redo of the queries it
        could not prove): the scores are the float32 queries times the stored rows, accumulated in
        float32 by kw_exact instead of cuBLAS with the queries rounded to float16."""
        cp, rt = self._cp, self._rt
        exact_fn = None
        if exact:
            assert self._wg is not None and self._wg.shapes, "the wgmma kernels are not built"
            exact_fn = next(iter(self._wg.shapes.values())).exact
        b, d = q.shape
        dpad = m.dpad
        s = self._stream
        src = self._host_queries(q, dpad)
        isz = self._itemsize
        qs_bytes = -(-(b * dpad * isz) // 256) * 256
        self._ensure(self._cur.d_q, 4 * b * dpad + qs_bytes + 4 * b)
        q32 = self._cur.d_q.ptr
        qs = q32 + 4 * b * dpad
        qn = qs + qs_bytes
        chunk = max(1, min(n, SCORE_BUFFER_FLOATS // b))
        self._ensure(self._cur.d_scores, 4 * b * chunk)
        chunks = [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]
        parts = []
        for c0, c1 in chunks:
            nc = c1 - c0
            parts.append(max(1, min(-(-GEMM_BLOCKS // b), nc // max(4 * k, 256) or 1, nc)))
        total = sum(parts)
        self._ensure(self._cur.d_cand, 8 * b * total * k)
        self._ensure(self._cur.d_counters, 4 * b)
        cand_s = self._cur.d_cand.ptr
        cand_r = cand_s + 4 * b * total * k
        out_r = self._cur.h_out.ptr
        out_s = out_r + 4 * b * kk
        l2 = m.l2
        rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
        self._kern.prep((-(-b * 32 // BLOCK),), (BLOCK,),
                     (q32, 0 if self._storage_code == 0 else qs, qn, np.int32(b), np.int32(dpad)),
                     stream=s)
        a_q = q32 if self._storage_code == 0 else qs
        handle = cp.cuda.device.get_cublas_handle()
        from cupy_backends.cuda.libs import cublas

        big_k = k > WARP_K
        C = next_pow2(k + BLOCK)
        p_off = 0
        with s:  # cuBLAS runs on the current stream
            for (c0, c1), pc in zip(chunks, parts):
                nc = c1 - c0
                if exact_fn is not None:  # scores[q][r] as cuBLAS would write them
                    blocks = max(1, min(-(-nc // (WGMMA_PREP_THREADS // 32)), 4 * self._sms))
                    exact_fn((blocks, b), (WGMMA_PREP_THREADS,),
                             (m.data.data.ptr + c0 * dpad * isz, np.int32(nc), np.int32(dpad), q32,
                              self._cur.d_scores.ptr), stream=s)
                else:
                    cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, nc, b, dpad,
                                  self._alpha.ctypes.data, m.data.data.ptr + c0 * dpad * isz,
                                  self._cuda_type, dpad, a_q, self._cuda_type, dpad,
                                  self._beta.ctypes.data, self._cur.d_scores.ptr, 0, nc,
                                  _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
                args = (self._cur.d_scores.ptr, np.int32(nc), np.int64(c0), m.sqn, qn, np.int32(l2),
                        np.int32(k), np.int32(kk), np.int32(pc), np.int32(p_off), np.int32(total),
                        cand_s, cand_r, self._cur.d_counters.ptr, out_s, out_r)
                if big_k:
                    self._kern.scores_b((pc, b), (BLOCK,), (*args, np.int32(C)), shared_mem=8 * C + 16,
                                     stream=s)
                else:
                    self._kern.scores_w((pc, b), (BLOCK,), args, stream=s)
                p_off += pc

    def _search_gemm_h(self, m: CupyMatrix, q: np.ndarray, n: int, kk: int) -> None:
        cp, rt = self._cp, self._rt
        b, d = q.shape
        dpad = m.dpad
        s = self._stream
        src = self._host_queries(q, dpad)
        qs_bytes = -(-(b * dpad * 2) // 256) * 256
        self._ensure(self._cur.d_q, 4 * b * dpad + qs_bytes + 8 * b)
        q32 = self._cur.d_q.ptr
        qs = q32 + 4 * b * dpad
        qn = qs + qs_bytes
        qscale = qn + 4 * b
        # Row stride of the scores a multiple of 8 (16-byte loads); chunks of rows likewise.
        n8 = -(-n // 8) * 8
        chunk = max(8, min(n8, (HALF_SCORE_BYTES // 2 // b) // 8 * 8))
        self._ensure(self._cur.d_scores, 2 * b * chunk)
        chunks = [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]
        parts = [max(1, min(-(-self.half_blocks // b), -(-(c1 - c0) // 8) // 64 or 1))
                 for c0, c1 in chunks]
        total = sum(parts)
        self._ensure(self._cur.d_cand, 8 * b * total * HALF_CAND)
        self._ensure(self._cur.d_counters, 4 * b)
        self._ensure(self._cur.d_top, 8 * b * HALF_CAND)
        cand_s = self._cur.d_cand.ptr
        cand_r = cand_s + 4 * b * total * HALF_CAND
        top_s = self._cur.d_top.ptr
        top_r = top_s + 4 * b * HALF_CAND
        out_r = self._cur.h_out.ptr
        out_s = out_r + 4 * b * kk
        flags = out_s + 4 * b * kk
        xmax = np.float32(m.max_norm)
        ev = self.stage_events
        if ev:
            ev[0].record(s)
        rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
        if ev:
            ev[1].record(s)
        self._kern.prep_h((-(-b * 32 // BLOCK),), (BLOCK,),
                       (q32, qs, qn, qscale, np.int32(b), np.int32(dpad), xmax), stream=s)
        handle = cp.cuda.device.get_cublas_handle()
        from cupy_backends.cuda.libs import cublas

        if ev:
            ev[2].record(s)
        p_off = 0
        with s:  # cuBLAS runs on the current stream
            for (c0, c1), pc in zip(chunks, parts):
                nc = c1 - c0
                ld = -(-nc // 8) * 8
                cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, nc, b, dpad,
                              self._alpha.ctypes.data, m.data.data.ptr + c0 * dpad * 2,
                              self._cuda_type, dpad, qs, self._cuda_type, dpad,
                              self._beta.ctypes.data, self._cur.d_scores.ptr, self._cuda_type, ld,
                              _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
                if ev:
                    ev[3].record(s)
                self._kern.hscores[self.half_unroll]((pc, b), (BLOCK,),
                                (self._cur.d_scores.ptr, np.int32(nc), np.int32(ld), np.int64(c0), m.sqn,
                                 qn, qscale, np.int32(m.l2), np.int32(pc), np.int32(p_off),
                                 np.int32(total), cand_s, cand_r, self._cur.d_counters.ptr, top_s, top_r),
                                stream=s)
                p_off += pc
        if ev:
            ev[4].record(s)
        self._kern.rescore((b,), (BLOCK,),
                        (m.data, m.sqn, np.int32(dpad), q32, qn, qscale, np.int32(m.l2), xmax,
                         np.int32(kk), top_s, top_r, out_s, out_r, flags), stream=s)
        if ev:
            ev[5].record(s)

    def _search_wgmma(self, m: CupyMatrix, q: np.ndarray, n: int, kk: int) -> None:
        """The wgmma path (float16 storage, k <= 16): one H2D copy of the float32 queries, then
        kw_prep (scaled float16 queries, |q|^2, gates), kw_fused (scores and candidate lists of
        rows [0, n) of the stored matrix, in place) and kw_merge (float32 rescore, answer and
        proof flags straight into the pinned answer buffer); _collect redoes flagged queries."""
        assert self._wg is not None, "the wgmma kernels are not built"
        rt = self._rt
        b = len(q)
        dpad = m.dpad
        s = self._stream
        sh = self._wg.shape(b)
        qy = -(-b // sh.bq)
        bpad = qy * sh.bq
        parts = parts_for(n, qy, sh.resident)
        src = self._host_queries(q, dpad)
        q32_bytes = -(-(4 * b * dpad) // 256) * 256
        qh_bytes = -(-(2 * bpad * dpad) // 256) * 256
        self._ensure(self._cur.d_q, q32_bytes + qh_bytes + 12 * b)
        q32 = self._cur.d_q.ptr
        qh = q32 + q32_bytes
        qn = qh + qh_bytes
        qscale = qn + 4 * b
        gate = qscale + 4 * b
        self._ensure(self._cur.d_cand, 8 * b * parts * WGMMA_KC)
        cand_s = self._cur.d_cand.ptr
        cand_r = cand_s + 4 * b * parts * WGMMA_KC
        out_r = self._cur.h_out.ptr
        out_s = out_r + 4 * b * kk
        flags = out_s + 4 * b * kk
        i32 = np.int32
        rt.memcpyAsync(q32, src, 4 * b * dpad, rt.memcpyHostToDevice, s.ptr)
        sh.prep((bpad,), (WGMMA_PREP_THREADS,),
                (q32, i32(b), i32(dpad), i32(bpad), qh, qn, qscale, gate), stream=s)
        sh.fused((parts * qy,), (WGMMA_THREADS,),
                 (m.data, i32(n), i32(dpad), qh, i32(b), i32(qy), i32(parts), gate, cand_s, cand_r),
                 shared_mem=sh.smem, stream=s)
        sh.merge((b,), (WGMMA_MERGE_THREADS,),
                 (cand_s, cand_r, i32(parts), m.data, i32(dpad), q32, qn, qscale,
                  np.float32(m.max_norm * (1.0 + 2.0**-20)), i32(kk), out_r, out_s, flags),
                 shared_mem=8 * parts * WGMMA_KC + 8 * WGMMA_KC, stream=s)
