"""CUDA backend: the memory matrix lives on the GPU; exact top-k by the kernels in kalos_topk.cu.

Only the sidecar imports this module, and CuPy is imported lazily, so the module itself imports on
machines without CuPy (``cuda_available()`` then says why the backend is unusable).

Rows are stored in the storage dtype (float32, float16 or bfloat16; 16-bit values are saturated,
never infinite), padded with zeros to a multiple of 16 bytes; the squared norm of every stored row
is kept on the device for l2. Writes, moves and growth are device-side updates of just those rows.

A search takes one of two paths (``_plan``):

* **fused** (k <= 32 and a single query, or a small matrix): one launch of ``kalos_small_q{QT}``
  scores QT queries per block against a slice of the rows, keeps per-warp top-k lists in
  registers, and the last block to finish merges every block's list. The request (a 64-byte
  header with n, B, k, metric, then float32 queries) is staged in pinned host memory; a grid of a
  few blocks reads it in place over PCIe (no copy), a larger one gets it by one H2D copy. The
  kernel writes its answer straight into mapped pinned host memory: no D2H copy. With
  ``use_graphs`` the (copy, kernel) pair is captured into a CUDA graph per launch shape and
  replayed; the kernel reads n, B, k from the header, so one graph serves every such request.
* **GEMM** (batches, or k > 32): one H2D copy of the queries, one kernel rounding them to the
  storage dtype, then per chunk of rows a cuBLAS GEMM (tensor cores for 16-bit storage, float32
  accumulation) into a float32 score buffer, and one top-k launch that reads it back; the last
  block of each query merges the partitions and writes the answer into pinned host memory.
* **half-score GEMM** (float16 storage, k <= 16, batches): as GEMM, but each query is scaled by a
  power of two so no score can overflow float16 and cuBLAS writes float16 scores (half the bytes
  to write and read back); the 32 best rows by those scores are rescored in float32 against the
  float32 query. A bound on the approximation error proves the answer exact; a query where the
  proof fails (near-ties at the 32nd candidate, degenerate data) is redone on the GEMM path.

Results are exact up to ties and the storage dtype's rounding: the fused and half-score paths
multiply float32 queries with widened rows; the GEMM path rounds queries to the storage dtype.

Errors: failures at start (no CuPy, no device, compilation) are ``ConfigError``; CUDA/cuBLAS
failures during work are ``ServerError`` (the server answers BACKEND_ERROR); a search that does not
finish within ``timeout_s`` raises and marks the backend broken rather than hang. One thread at a
time (the sidecar's serving thread) may use a backend.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from broker.errors import ClosedError, ConfigError, KalosError, ServerError
from broker.layout import Metric

log = logging.getLogger("kalos.cuda")

MAX_K = 1024  # largest k served: the block-buffer kernels hold next_pow2(k + 256) entries
WARP_K = 32  # largest k of the fused path (one list entry per lane)
SMALL_QT = (1, 2, 4, 8, 16)  # queries per block of the fused kernel
BLOCK = 256  # threads per block of every search kernel (KALOS_BLOCK in the .cu)
HEADER_BYTES = 64  # request header: 16 int32
ROWS_PER_BLOCK = 256  # the fused path gives each block at least this many rows
ZERO_COPY_BLOCKS = 4  # at most this many blocks read the request from host memory directly
GEMM_BLOCKS = 528  # top-k blocks aimed for per GEMM chunk (4 per SM on an H100/H200)
SCORE_BUFFER_FLOATS = 1 << 26  # GEMM path: float32 scores per chunk (256 MiB; 32 MiB chunks that
# stay in L2 measured 1.6x slower at 1M x 768, b = 256: many small GEMMs lose more than L2 saves)
GRAPH_CACHE = 256
HALF_K = 16  # half-score path: largest k (the answer is proven exact against 32 candidates)
HALF_CAND = 32  # candidates rescored per query (KALOS_HC in the .cu)
HALF_WORK_MIN = 1 << 26  # half-score path from this many scores (rows x queries) up: measured on
# the H200 it costs ~60 us more than the GEMM path at 100k rows (any batch), the same at 1M x 64,
# and 17% less at 1M x 256 (docs/gpu.md)
HALF_SCORE_BYTES = 1 << 29  # half-score path: float16 scores per chunk (512 MiB: one chunk for
# 256 queries x 1M rows, so one large GEMM)

_STORAGE: dict[str, tuple[int, Any, int]] = {
    # name: (KALOS_STORAGE, numpy dtype holding the bits, cudaDataType)
    "float32": (0, np.float32, 0),  # CUDA_R_32F
    "float16": (1, np.uint16, 2),  # CUDA_R_16F
    "bfloat16": (2, np.uint16, 14),  # CUDA_R_16BF
}
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1


def cuda_available() -> str | None:
    """None if CuPy imports and sees a CUDA device, else the reason it cannot be used."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no usable CUDA driver or device ({type(e).__name__}: {e})"
    if count < 1:
        return "no CUDA device"
    return None


def kernel_source() -> str:
    return (Path(__file__).parent / "kalos_topk.cu").read_text()


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# Batch size -> queries per block of the fused kernel (the smallest QT >= b).
_QT_FOR = {b: next(q for q in SMALL_QT if q >= b) for b in range(1, SMALL_QT[-1] + 1)}


def _bucket(b: int) -> str:
    return "1" if b == 1 else "2-8" if b <= 8 else "9-64" if b <= 64 else "65-512" if b <= 512 else ">512"


class _Buffer:
    """A growable device or pinned-host buffer of raw bytes."""

    def __init__(self, cp: Any, pinned: bool, stream: Any = None) -> None:
        self._cp = cp
        self.pinned = pinned
        self._stream = stream
        self.nbytes = 0
        self.mem: Any = None
        self.ptr = 0
        self._views: dict[tuple[Any, int], np.ndarray] = {}

    def ensure(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True if the buffer moved (graphs that use it are stale).
        Only called while no pending search uses this buffer (its set is being enqueued), so
        the old one is free to go (CuPy's pool reuses it in stream order)."""
        if nbytes <= self.nbytes:
            return False
        size = _next_pow2(max(nbytes, 4096))
        if self.pinned:
            self.mem = self._cp.cuda.alloc_pinned_memory(size)
            np.frombuffer(self.mem, np.uint8, size)[:] = 0
        else:
            with self._stream:
                self.mem = self._cp.cuda.alloc(size)
                self.mem.memset_async(0, size, self._stream)
        self.ptr = int(self.mem.ptr)
        self.nbytes = size
        self._views.clear()
        return True

    def view(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        """The first ``count`` items of type ``dtype`` from byte ``offset`` (pinned buffers)."""
        key = (dtype, offset)
        v = self._views.get(key)
        if v is None:
            itemsize = np.dtype(dtype).itemsize
            v = self._views[key] = np.frombuffer(self.mem, dtype, (self.nbytes - offset) // itemsize,
                                                 offset)
        return v[:count]


class _BufferSet:
    """Everything one search writes: two sets let a second search be enqueued behind the first
    (the sidecar's pipeline) without touching the buffers the first is still using."""

    def __init__(self, cp: Any, stream: Any, index: int) -> None:
        self.index = index
        self.epoch = 0  # bumped when a buffer moves: graphs that captured the old one are stale
        self.h_req = _Buffer(cp, pinned=True)  # request header + float32 queries
        self.d_req = _Buffer(cp, pinned=False, stream=stream)
        self.h_out = _Buffer(cp, pinned=True)  # rows, scores (and half-path flags) of the answer
        self.d_cand = _Buffer(cp, pinned=False, stream=stream)
        self.d_counters = _Buffer(cp, pinned=False, stream=stream)
        self.d_q = _Buffer(cp, pinned=False, stream=stream)  # GEMM paths: queries as stored, |q|^2
        self.d_scores = _Buffer(cp, pinned=False, stream=stream)
        self.d_top = _Buffer(cp, pinned=False, stream=stream)  # half path: 32 candidates a query
        self.done = cp.cuda.Event(block=False, disable_timing=True)
        self.busy = False  # a search using these buffers has not been collected yet
        self.seq = 0  # which search (CupyBackend._seq) last used them


class PendingCupySearch:
    """A search enqueued on the backend's stream (see ``CupyBackend.search_async``)."""

    __slots__ = ("backend", "bufs", "m", "q", "n", "k", "kk", "path", "t0", "_value")

    def __init__(self, backend: CupyBackend, bufs: _BufferSet, m: CupyMatrix, q: np.ndarray,
                 n: int, k: int, kk: int, path: str, t0: int) -> None:
        self.backend, self.bufs, self.m, self.q = backend, bufs, m, q
        self.n, self.k, self.kk, self.path, self.t0 = n, k, kk, path, t0
        self._value: tuple[np.ndarray, np.ndarray] | None = None

    def done(self) -> bool:
        try:
            return self._value is not None or bool(self.bufs.done.done)
        except Exception:  # a CUDA error: result() raises it (as ServerError)
            return True

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._value is None:
            self._value = self.backend._collect(self)
        return self._value


class CupyBackend:
    """The CUDA backend (see the module docstring). ``storage_dtype``: float32, float16 or
    bfloat16. ``use_graphs``: replay CUDA graphs for the fused path. ``timeout_s``: the longest a
    search may take before it is abandoned and the backend marked broken."""

    name = "cuda"
    code = 2
    max_k = MAX_K

    def __init__(self, storage_dtype: str = "float32", device: int = 0, *, use_graphs: bool = True,
                 timeout_s: float = 30.0, small_batch_max: int = 1,
                 small_work_max: int = 1 << 12) -> None:
        if storage_dtype not in _STORAGE:
            raise ConfigError(f"storage dtype must be float32, float16 or bfloat16, got {storage_dtype!r}")
        self.storage_dtype = storage_dtype
        self._storage_code, self._np_store, self._cuda_type = _STORAGE[storage_dtype]
        self._itemsize = np.dtype(self._np_store).itemsize
        self._vec = 16 // self._itemsize
        self.use_graphs = use_graphs
        self.timeout_s = timeout_s
        # Fused path for batches up to small_batch_max queries, or up to small_work_max
        # rows x queries: the crossover against the GEMM path measured on an H200 (docs/gpu.md).
        self.small_batch_max = small_batch_max
        self.small_work_max = small_work_max
        self._closed = False
        self._broken: str | None = None
        try:
            import cupy as cp
        except Exception as e:
            raise ConfigError(f"the CUDA backend needs CuPy ({type(e).__name__}: {e})") from None
        self._cp = cp
        rt = cp.cuda.runtime
        self._rt = rt
        try:
            count = rt.getDeviceCount()
        except Exception as e:
            raise ConfigError(f"no usable CUDA device ({type(e).__name__}: {e})") from None
        if not 0 <= device < count:
            raise ConfigError(f"CUDA device {device} does not exist ({count} visible)")
        self.device = device
        try:
            self._dev = cp.cuda.Device(device)
            self._dev.use()
            props = rt.getDeviceProperties(device)
            if not rt.deviceGetAttribute(rt.cudaDevAttrUnifiedAddressing, device):
                raise ConfigError("the CUDA device lacks unified addressing (needed to write "
                                  "results into pinned host memory)")
            self._sms = int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device))
            self._smem_optin = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                          device))
            gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            mem_gib = props["totalGlobalMem"] / 2**30
            self.description = (f"CUDA {gpu} (sm_{props['major']}{props['minor']}, {self._sms} SMs, "
                                f"{mem_gib:.0f} GiB), {storage_dtype} storage, CuPy {cp.__version__}")
            self._stream = cp.cuda.Stream(non_blocking=True)
            t0 = time.perf_counter()
            self._module = cp.RawModule(code=kernel_source(),
                                        options=("-std=c++17", f"-DKALOS_STORAGE={self._storage_code}"))
            self._k_small = {qt: self._module.get_function(f"kalos_small_q{qt}") for qt in SMALL_QT}
            self._k_scores_w = self._module.get_function("kalos_scores_topk_w")
            self._k_scores_b = self._module.get_function("kalos_scores_topk_b")
            self._k_prep = self._module.get_function("kalos_prep_queries")
            self._k_prep_h = self._module.get_function("kalos_prep_queries_h")
            self._k_hscores = {un: self._module.get_function(f"kalos_hscores_top_u{un}")
                               for un in (2, 4, 8)}
            self._k_rescore = self._module.get_function("kalos_rescore_h")
            self._k_write = self._module.get_function("kalos_write_rows")
            self._k_move = self._module.get_function("kalos_move_rows")
            for kern in (*self._k_small.values(), self._k_scores_b):
                kern.max_dynamic_shared_size_bytes = self._smem_optin
            self.compile_s = time.perf_counter() - t0
            self._sets = [_BufferSet(cp, self._stream, i) for i in range(2)]
            self._cur = self._sets[0]  # the set the search being enqueued writes
            self.half_fallbacks = 0  # queries the half-score path could not prove exact
            self.half_unroll = 2  # 16-byte score loads per lane in flight (2, 4 or 8)
            self.half_blocks = GEMM_BLOCKS  # top-k blocks aimed for per half-score chunk
            # Profiling aid (bench/probe_gemm.py): CUDA events recorded between the half-score
            # path's stages (copy, prep, GEMM, top-k, rescore) when set to a list of 6 events.
            self.stage_events: list[Any] | None = None
            self._alpha = np.ones(1, np.float32)
            self._beta = np.zeros(1, np.float32)
            self._graphs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
            # Graphs evicted from the cache, with the number of searches enqueued by then: one
            # may still run until every search up to that number has been collected.
            self._retired: list[tuple[int, Any]] = []
            self._seq = 0  # searches enqueued so far
            self._occupancy: dict[tuple[int, int], int] = {}
            self._pinned: list[tuple[int, int, Any]] = []
            self.search_stats: dict[tuple[str, str], list[int]] = {}
            self._stream.synchronize()
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"the CUDA backend failed to start on device {device}: "
                              f"{type(e).__name__}: {e}") from None
        log.info("CUDA backend: %s; kernels compiled/loaded in %.2f s", self.description, self.compile_s)

    # ------------------------------------------------------------------ Backend protocol
    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> CupyMatrix:
        self._check_usable()
        with self._guard("allocating a matrix"):
            return CupyMatrix(self, dim, capacity, metric)

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """Pinned host memory (searches from it need no staging copy)."""
        self._check_usable()
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = max(1, count * dt.itemsize)
        with self._guard("allocating pinned memory"):
            mem = self._cp.cuda.alloc_pinned_memory(nbytes)
        arr = np.frombuffer(mem, dt, count).reshape(shape)
        self._pinned.append((int(mem.ptr), nbytes, mem))
        return arr

    def close(self) -> None:
        """Wait for the device, then release everything. Closing twice is fine."""
        if self._closed:
            return
        self._closed = True
        log.info("CUDA backend searches: %s", self.stats_line())
        try:
            self._stream.synchronize()
        except Exception:
            pass
        self._graphs.clear()
        try:
            self._cp.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass

    # ------------------------------------------------------------------ machinery
    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("the CUDA backend is closed")
        if self._broken is not None:
            raise ServerError(f"the CUDA backend is broken: {self._broken}")

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """CUDA, cuBLAS and CuPy failures become ServerError (the server maps it to BACKEND_ERROR)."""
        try:
            yield
        except (KalosError, ValueError, IndexError, TypeError):
            raise
        except Exception as e:
            raise ServerError(f"CUDA {what} failed: {type(e).__name__}: {e}") from e

    def _wait(self, ev: Any) -> None:
        """Spin until event ``ev`` has happened (a few microseconds after the kernel ends); sleep
        a little once it has taken 2 ms; give up after timeout_s."""
        if ev.done:
            return
        t0 = time.perf_counter()
        while not ev.done:
            el = time.perf_counter() - t0
            if el > 0.002:
                if el > self.timeout_s:
                    self._broken = f"a search did not finish within {self.timeout_s} s"
                    raise ServerError(self._broken)
                time.sleep(0.00005)

    def _pinned_address(self, a: np.ndarray) -> int | None:
        if not a.flags.c_contiguous:
            return None
        addr: int = a.__array_interface__["data"][0]
        for ptr, nbytes, _mem in self._pinned:
            if ptr <= addr and addr + a.nbytes <= ptr + nbytes:
                return addr
        return None

    def _ensure(self, buf: _Buffer, nbytes: int) -> None:
        if buf.ensure(nbytes):
            self._cur.epoch += 1  # (stale graphs are never replayed, and age out of the cache)

    def _occupancy_of(self, qt: int, smem: int) -> int:
        key = (qt, smem)
        occ = self._occupancy.get(key)
        if occ is None:
            fn = self._k_small[qt].kernel
            occ = int(self._cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, BLOCK, smem))
            self._occupancy[key] = max(1, occ)
        return self._occupancy[key]

    @staticmethod
    def small_smem(qt: int, dpad: int) -> int:
        warps = BLOCK // 32
        return 4 * (qt * dpad + qt) + warps * qt * 32 * 8 + 16

    def stats_line(self) -> str:
        """Searches served and mean wall time (staging, launch, wait, results) per path and batch
        size, in microseconds."""
        parts = [f"{p}/{bk}: {c} x {ns / c / 1e3:.1f} us"
                 for (p, bk), (c, ns) in sorted(self.search_stats.items()) if c]
        if self.half_fallbacks:
            parts.append(f"half-score queries redone in float32: {self.half_fallbacks}")
        return "; ".join(parts) or "no searches"

    def _plan(self, b: int, n: int, k: int, m: CupyMatrix) -> tuple[str, int]:
        """("small", QT), ("gemmh", 0) or ("gemm", 0) for a batch of b queries."""
        dpad = m.dpad
        if k <= WARP_K and (b <= self.small_batch_max or n * b <= self.small_work_max):
            qt = _QT_FOR[min(b, SMALL_QT[-1])]
            while qt > 1 and self.small_smem(qt, dpad) > self._smem_optin:
                qt //= 2
            if self.small_smem(qt, dpad) <= self._smem_optin:
                return "small", qt
        if n * b >= HALF_WORK_MIN and self._half_ok(m, k):
            return "gemmh", 0
        return "gemm", 0

    def _half_ok(self, m: CupyMatrix, k: int) -> bool:
        return self._storage_code == 1 and k <= HALF_K and 0.0 < m.max_norm < 1e30

    # ------------------------------------------------------------------ search
    def search(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int,
               path: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.search_async(m, queries, n, k, path).result()

    def search_async(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int,
                     path: str | None = None) -> PendingCupySearch:
        """Enqueue a search on the stream and return at once; ``result()`` collects it. Two may
        be pending (each uses its own buffer set; the second runs right after the first)."""
        self._check_usable()
        q = queries
        if q.dtype != np.float32 or q.ndim != 2 or not q.flags.c_contiguous:
            q = np.ascontiguousarray(q, np.float32).reshape(len(q), -1)
        b, d = q.shape
        if d != m.dim:
            raise ValueError(f"queries have dim {d}, the matrix {m.dim}")
        if not 1 <= k <= self.max_k:
            raise ValueError(f"k must be in [1, {self.max_k}], got {k}")
        if not 0 <= n <= m.capacity:
            raise ValueError(f"n={n} outside the matrix capacity {m.capacity}")
        kk = min(k, n)
        bufs = next((st for st in self._sets if not st.busy), None)
        if bufs is None:
            raise RuntimeError("two searches are pending already: collect one first")
        p = PendingCupySearch(self, bufs, m, q, n, k, kk, path or "", time.perf_counter_ns())
        if b == 0 or kk == 0:
            p._value = (np.empty((b, kk), np.int64), np.empty((b, kk), np.float32))
            return p
        qt = 0
        if path is None:
            path, qt = self._plan(b, n, k, m)
        elif path == "small":
            if k > WARP_K:
                raise ValueError("the fused path serves k <= 32")
            qt = _QT_FOR[min(b, SMALL_QT[-1])]
        elif path == "gemmh" and not self._half_ok(m, k):
            raise ValueError(f"the half-score path serves float16 storage and k <= {HALF_K}")
        p.path = path
        bufs.busy = True
        try:
            self._enqueue(bufs, path, m, q, n, k, kk, qt)
        except BaseException as e:
            bufs.busy = False
            if isinstance(e, (KalosError, ValueError, IndexError, TypeError)):
                raise
            raise ServerError(f"CUDA search failed: {type(e).__name__}: {e}") from e
        return p

    def _enqueue(self, bufs: _BufferSet, path: str, m: CupyMatrix, q: np.ndarray, n: int, k: int,
                 kk: int, qt: int) -> None:
        self._cur = bufs
        self._seq += 1
        bufs.seq = self._seq
        b = len(q)
        self._ensure(bufs.h_out, 8 * b * kk + 4 * b)
        if path == "small":
            self._search_small(m, q, n, k, qt)
        elif path == "gemmh":
            self._search_gemm_h(m, q, n, kk)
        else:
            self._search_gemm(m, q, n, k, kk)
        bufs.done.record(self._stream)

    def _collect(self, p: PendingCupySearch) -> tuple[np.ndarray, np.ndarray]:
        bufs, b, kk = p.bufs, len(p.q), p.kk
        try:
            self._wait(bufs.done)
            out = bufs.h_out
            rows = out.view(np.int32, b * kk).reshape(b, kk).astype(np.int64)
            scores = out.view(np.float32, 2 * b * kk)[b * kk:].reshape(b, kk).copy()
            if p.path == "gemmh":
                # Flagged by the kernel, or with a row missing (scores beyond float16 even after
                # scaling, for queries of norm ~2^100 and more): the float32 path decides.
                redo = np.flatnonzero(out.view(np.int32, 2 * b * kk + b)[2 * b * kk:]
                                      | (rows < 0).any(axis=1))
                if redo.size:  # not proven exact from 32 candidates: the float32 scores decide
                    self.half_fallbacks += int(redo.size)
                    qr = np.ascontiguousarray(p.q[redo])
                    self._enqueue(bufs, "gemm", p.m, qr, p.n, p.k, kk, 0)
                    self._wait(bufs.done)
                    rows[redo] = out.view(np.int32, len(redo) * kk).reshape(-1, kk)
                    scores[redo] = out.view(np.float32, 2 * len(redo) * kk)[len(redo) * kk:].reshape(-1, kk)
        except (KalosError, ValueError, IndexError, TypeError):
            raise
        except Exception as e:
            raise ServerError(f"CUDA search failed: {type(e).__name__}: {e}") from e
        finally:
            bufs.busy = False
            if self._retired:
                oldest = min((x.seq for x in self._sets if x.busy), default=self._seq + 1)
                self._retired = [(s, g) for s, g in self._retired if s >= oldest]
        st = self.search_stats.setdefault((p.path, _bucket(b)), [0, 0])
        st[0] += 1
        st[1] += time.perf_counter_ns() - p.t0
        return rows, scores

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
        smem = self.small_smem(qt, dpad)
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
        kern = self._k_small[qt]
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

    def _search_gemm(self, m: CupyMatrix, q: np.ndarray, n: int, k: int, kk: int) -> None:
        cp, rt = self._cp, self._rt
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
        self._k_prep((-(-b * 32 // BLOCK),), (BLOCK,),
                     (q32, 0 if self._storage_code == 0 else qs, qn, np.int32(b), np.int32(dpad)),
                     stream=s)
        a_q = q32 if self._storage_code == 0 else qs
        handle = cp.cuda.device.get_cublas_handle()
        from cupy_backends.cuda.libs import cublas

        big_k = k > WARP_K
        C = _next_pow2(k + BLOCK)
        p_off = 0
        with s:  # cuBLAS runs on the current stream
            for (c0, c1), pc in zip(chunks, parts):
                nc = c1 - c0
                cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, nc, b, dpad,
                              self._alpha.ctypes.data, m.data.data.ptr + c0 * dpad * isz,
                              self._cuda_type, dpad, a_q, self._cuda_type, dpad,
                              self._beta.ctypes.data, self._cur.d_scores.ptr, 0, nc,
                              _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
                args = (self._cur.d_scores.ptr, np.int32(nc), np.int64(c0), m.sqn, qn, np.int32(l2),
                        np.int32(k), np.int32(kk), np.int32(pc), np.int32(p_off), np.int32(total),
                        cand_s, cand_r, self._cur.d_counters.ptr, out_s, out_r)
                if big_k:
                    self._k_scores_b((pc, b), (BLOCK,), (*args, np.int32(C)), shared_mem=8 * C + 16,
                                     stream=s)
                else:
                    self._k_scores_w((pc, b), (BLOCK,), args, stream=s)
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
        self._k_prep_h((-(-b * 32 // BLOCK),), (BLOCK,),
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
                self._k_hscores[self.half_unroll]((pc, b), (BLOCK,),
                                (self._cur.d_scores.ptr, np.int32(nc), np.int32(ld), np.int64(c0), m.sqn,
                                 qn, qscale, np.int32(m.l2), np.int32(pc), np.int32(p_off),
                                 np.int32(total), cand_s, cand_r, self._cur.d_counters.ptr, top_s, top_r),
                                stream=s)
                p_off += pc
        if ev:
            ev[4].record(s)
        self._k_rescore((b,), (BLOCK,),
                        (m.data, m.sqn, np.int32(dpad), q32, qn, qscale, np.int32(m.l2), xmax,
                         np.int32(kk), top_s, top_r, out_s, out_r, flags), stream=s)
        if ev:
            ev[5].record(s)


class CupyMatrix:
    """Rows [0, capacity) of one namespace on the GPU (see the module docstring)."""

    def __init__(self, backend: CupyBackend, dim: int, capacity: int, metric: Metric) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        cp = backend._cp
        self.backend = backend
        self.dim = dim
        self.metric = metric
        self.dpad = -(-dim // backend._vec) * backend._vec
        self.capacity = max(1, int(capacity))
        if self.capacity >= 2**31:
            raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
        self.l2 = int(metric == Metric.L2)
        # An upper bound on the norm of every stored row (the half-score path's error bound):
        # raised by writes, never lowered (moves and deletes leave it a valid bound).
        self.max_norm = 0.0
        with backend._stream:
            self.data = cp.zeros((self.capacity, self.dpad), backend._np_store)
            self.sqn = cp.zeros(self.capacity, np.float32)
        self.ptrs = (int(self.data.data.ptr), int(self.sqn.data.ptr))

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        vectors = np.ascontiguousarray(vectors, np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(rows), self.dim):
            raise ValueError(f"vectors of shape {vectors.shape} for {len(rows)} rows of dim {self.dim}")
        if len(rows) == 0:
            return
        if rows.min() < 0 or rows.max() >= self.capacity:
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        norm = float(np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64).max()))
        # Rounding to a 16-bit format lengthens a row by a relative 2^-8 at most, plus 2^-25 per
        # element where float16 values are subnormal.
        self.max_norm = max(self.max_norm, norm * (1.0 + 2.0 ** -7) + math.sqrt(self.dpad) * 2.0 ** -24)
        cp = be._cp
        with be._guard("write_rows"), be._stream:
            d_rows = cp.asarray(rows)
            d_vec = cp.asarray(vectors)
            m = len(rows)
            be._k_write((-(-m * 32 // BLOCK),), (BLOCK,),
                        (self.data, self.sqn, np.int32(self.dpad), d_rows, d_vec, np.int32(m),
                         np.int32(self.dim)), stream=be._stream)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        src = np.ascontiguousarray(src, np.int64).reshape(-1)
        dst = np.ascontiguousarray(dst, np.int64).reshape(-1)
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if len(src) == 0:
            return
        if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= self.capacity:
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        cp = be._cp
        with be._guard("move_rows"), be._stream:
            m = len(src)
            be._k_move((-(-m * 32 // BLOCK),), (BLOCK,),
                       (self.data, self.sqn, np.int32(self.dpad), cp.asarray(src), cp.asarray(dst),
                        np.int32(m)), stream=be._stream)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        if capacity >= 2**31:
            raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
        be = self.backend
        be._check_usable()
        cp = be._cp
        with be._guard(f"growing a matrix to {capacity} rows"), be._stream:
            data = cp.zeros((capacity, self.dpad), be._np_store)
            sqn = cp.zeros(capacity, np.float32)
            data[: self.capacity] = self.data  # device-to-device
            sqn[: self.capacity] = self.sqn
            self.data, self.sqn, self.capacity = data, sqn, capacity
            self.ptrs = (int(data.data.ptr), int(sqn.data.ptr))

    def search(self, queries: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.backend.search(self, queries, n, k)

    def search_async(self, queries: np.ndarray, n: int, k: int) -> PendingCupySearch:
        return self.backend.search_async(self, queries, n, k)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Stored rows as float32 (m, d): the storage dtype's values, widened (for export)."""
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.capacity):
            raise IndexError(f"row outside [0, {self.capacity})")
        be = self.backend
        be._check_usable()
        with be._guard("read_rows"), be._stream:
            sel = self.data[be._cp.asarray(rows)][:, : self.dim]
            raw: np.ndarray = be._cp.asnumpy(sel, stream=be._stream)
            be._stream.synchronize()
        if be._storage_code == 0:
            return np.ascontiguousarray(raw, np.float32)
        if be._storage_code == 1:
            return raw.view(np.float16).astype(np.float32)
        return (raw.astype(np.uint32) << 16).view(np.float32)


__all__ = ["CupyBackend", "CupyMatrix", "cuda_available", "MAX_K", "WARP_K"]
