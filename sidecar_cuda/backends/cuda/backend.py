"""CUDA backend: the memory matrix lives on the GPU; exact top-k by the kernels in kalos_topk.cu.

Files: this one (the backend: device, buffers in use, searches as Futures), ``matrix.py`` (rows of
a namespace), ``planner.py`` (which path a search takes), ``paths.py`` (the launch sequences),
``buffers.py``, ``kernels.py`` (the ``.cu`` and the constants it is compiled with).

Only the sidecar imports this module, and CuPy is imported lazily, so the module itself imports on
machines without CuPy (``cuda_available()`` then says why the backend is unusable).

Rows are stored in the storage dtype (float32, float16 or bfloat16; 16-bit values are saturated,
never infinite), padded with zeros to a multiple of 16 bytes; the squared norm of every stored row
is kept on the device for l2. Writes, moves and growth are device-side updates of just those rows.

A search takes one of five paths (``planner.plan_path``):

* **host** (tiny work: at most ``host_work`` rows x queries x padded dim, ``--host-search-work``):
  a launch, its completion and the copies cost more than the arithmetic (an empty launch plus
  sync is 11-15 us on the H200's host, a 256 x 128 search 34 us in-process), so the rows are
  scored on the CPU from a float32 copy of the stored values (``CupyMatrix.host_search``: read
  back once, exactly as stored, and dropped by the next write, move or growth).

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
* **wgmma** (Hopper only: float16 storage, inner product, k <= 16, 2-32 queries, many rows;
  ``wgmma.py``, ``kalos_wgmma.cu``): one H2D copy of the queries, then three launches: scaled
  float16 queries; one wave of CTAs that stream the stored rows through shared memory, score them
  with wgmma tensor-core instructions and keep per-query candidate lists (no score matrix); and a
  merge that rescores the 32 best candidates in float32 against the float32 query and writes the
  answer into pinned host memory. The same kind of error bound proves it exact; a query where the
  proof fails is redone with float32 scores of every row (``kw_exact``) and the GEMM path's top-k.
  Compiled by NVRTC for sm_90a in the warm-up; ``fused_kernel="off"`` (``--fused-kernel off``), a
  non-Hopper device or a failed build leave it out.

Results are exact up to ties and the storage dtype's rounding: the fused, half-score and wgmma
paths multiply float32 queries with widened rows; the GEMM path rounds queries to the storage dtype.

Errors: failures at start (no CuPy, no device, compilation) are ``ConfigError``; CUDA/cuBLAS
failures during work are ``ServerError`` (the server answers BACKEND_ERROR); a search that does not
finish within ``timeout_s`` raises and marks the backend broken rather than hang. One thread at a
time (the sidecar's serving thread) may use a backend.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ....broker.errors import ClosedError, ConfigError, KalosError, ServerError
from ....broker.layout import Metric
from ..base import PolledFuture, SearchResult
from .buffers import BufferSet
from .kernels import MAX_K, SMALL_QT, STORAGE, WARP_K, Kernels, vec_elements
from .matrix import CupyMatrix
from .paths import SearchPaths
from .planner import (
    GEMM_BLOCKS, HALF_K, HOST_WORK, QT_FOR, WGMMA_K, WGMMA_MIN_ROWS, half_ok, plan_path,
    size_bucket, wgmma_ok,
)
from .wgmma import WgmmaKernels

log = logging.getLogger("kalos.cuda")


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


def device_count() -> int:
    """CUDA devices visible to this process (0 where CuPy or the driver is unusable)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class _Launch:
    """One search as enqueued: what collecting it needs (``value``: answered without the device)."""

    __slots__ = ("bufs", "m", "q", "n", "k", "kk", "path", "t0", "row_ids", "value")

    def __init__(self, bufs: BufferSet, m: CupyMatrix, q: np.ndarray, n: int, k: int, kk: int,
                 path: str, t0: int) -> None:
        self.bufs, self.m, self.q = bufs, m, q
        self.n, self.k, self.kk, self.path, self.t0 = n, k, kk, path, t0
        self.row_ids: np.ndarray | None = None  # rows come back as row_ids[rows]
        self.value: SearchResult | None = None


class CudaSearch(PolledFuture[SearchResult]):
    """A search enqueued on the backend's stream (``CupyBackend.search_async``): ``done()`` asks
    its CUDA event without blocking (a CUDA error counts as done: ``result()`` raises it as
    ServerError); ``result()`` waits for it and reads the answer."""

    def __init__(self, backend: CupyBackend, launch: _Launch) -> None:
        super().__init__()
        self._backend = backend
        self._launch = launch

    def _poll(self) -> bool:
        return self._launch.value is not None or bool(self._launch.bufs.done.done)

    def _collect(self) -> SearchResult:
        return self._backend._collect(self._launch)


class CupyBackend(SearchPaths):
    """The CUDA backend (see the module docstring). ``storage_dtype``: float32, float16 or
    bfloat16. ``use_graphs``: replay CUDA graphs for the fused path. ``timeout_s``: the longest a
    search may take before it is abandoned and the backend marked broken. ``host_work``: searches
    of at most this many rows x queries x padded dim run on the host copy (0: never).
    ``fused_kernel``: "auto" builds the wgmma path where it can run (a compute capability 9.x
    device, float16 storage), "off" never; ``wgmma_min_rows``: the planner's row threshold of that
    path (tests lower it)."""

    name = "cuda"
    code = 2
    max_k = MAX_K

    def __init__(self, storage_dtype: str = "float32", device: int = 0, *, use_graphs: bool = True,
                 timeout_s: float = 30.0, small_batch_max: int = 1,
                 small_work_max: int = 1 << 12, host_work: int = HOST_WORK,
                 fused_kernel: str = "auto", wgmma_min_rows: int = WGMMA_MIN_ROWS) -> None:
        if storage_dtype not in STORAGE:
            raise ConfigError(f"storage dtype must be float32, float16 or bfloat16, got {storage_dtype!r}")
        self.storage_dtype = storage_dtype
        self._storage_code, self._np_store, self._cuda_type = STORAGE[storage_dtype]
        self._itemsize = np.dtype(self._np_store).itemsize
        self._vec = vec_elements(storage_dtype)
        self.use_graphs = use_graphs
        self.timeout_s = timeout_s
        # Fused path for batches up to small_batch_max queries, or up to small_work_max
        # rows x queries: the crossover against the GEMM path measured on an H200 (docs/gpu.md).
        self.small_batch_max = small_batch_max
        self.small_work_max = small_work_max
        if host_work < 0:
            raise ConfigError(f"--host-search-work must be >= 0, got {host_work}")
        self.host_work = host_work
        if fused_kernel not in ("auto", "off"):
            raise ConfigError(f"--fused-kernel must be auto or off, got {fused_kernel!r}")
        self.fused_kernel = fused_kernel
        self.wgmma_min_rows = wgmma_min_rows
        self._wg: WgmmaKernels | None = None
        self.wgmma_fallbacks = 0  # queries the wgmma path could not prove exact (redone)
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
        self.placement = f"cuda:{device}"
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
            self._cc_major = int(props["major"])
            gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            mem_gib = props["totalGlobalMem"] / 2**30
            self.description = (f"CUDA {gpu} (sm_{props['major']}{props['minor']}, {self._sms} SMs, "
                                f"{mem_gib:.0f} GiB), {storage_dtype} storage, CuPy {cp.__version__}")
            self._stream = cp.cuda.Stream(non_blocking=True)
            t0 = time.perf_counter()
            self._kern = Kernels(cp, storage_dtype, self._smem_optin)
            self.compile_s = time.perf_counter() - t0
            self._sets = [BufferSet(cp, self._stream, i) for i in range(2)]
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
            t0 = time.perf_counter()
            self._warm_up()
            self.warm_s = time.perf_counter() - t0
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"the CUDA backend failed to start on device {device}: "
                              f"{type(e).__name__}: {e}") from None
        log.info("CUDA backend: %s; kernels compiled/loaded in %.2f s, every path warmed up in %.2f s",
                 self.description, self.compile_s, self.warm_s)

    def _warm_up(self) -> None:
        """Run every path once on a scratch matrix, so that no request pays for what a first use
        costs: loading kernels (CUDA loads modules lazily), creating the cuBLAS handle and its
        workspace, compiling CuPy's own kernels (the host copy's gather), capturing a graph."""
        m = CupyMatrix(self, 64, 64, Metric.DOT)
        rng = np.random.default_rng(0)
        m.write_rows(np.arange(64), rng.standard_normal((64, 64), dtype=np.float32))
        q = rng.standard_normal((2, 64), dtype=np.float32)
        runs = [("host", 1, 10), ("small", 1, 10), ("gemm", 2, 10), ("gemm", 2, 64)]
        if self._half_ok(m, HALF_K):
            runs.append(("gemmh", 2, 10))
        for path, b, k in runs:
            self.search(m, q[:b], 64, k, path=path)
        self._warm_up_wgmma(m, rng)
        m.move_rows(np.array([0]), np.array([1]))
        self._stream.synchronize()
        self._graphs.clear()  # (they name the scratch matrix)
        self.search_stats.clear()
        self.half_fallbacks = 0
        self.wgmma_fallbacks = 0

    def _warm_up_wgmma(self, m: CupyMatrix, rng: np.random.Generator) -> None:
        """Build the wgmma path's kernels for the batch sizes the planner sends it, and check
        them once against the host path (and the float32 redo on identical rows): on any failure
        the path stays off, with one log line, and the backend keeps its other paths."""
        if self.fused_kernel == "off" or self._storage_code != 1 or self._cc_major != 9:
            return
        self._wg = WgmmaKernels(self._cp, self._smem_optin, self._sms)
        try:
            for b in (16, 32):  # the two query tiles the planner uses (b = 2-16 and 17-32)
                q = rng.standard_normal((b, m.dim), dtype=np.float32)
                got = self.search(m, q, 64, 10, path="wgmma")
                want = m.host_search(q, 64, 10)
                if not np.array_equal(got[0], want[0]):
                    raise RuntimeError(f"its answer differs from the host path's (b={b})")
            self._enqueue(self._sets[0], "exact", m, q[:1], 64, 10, 10, 0)  # (the redo)
            self._wait(self._sets[0].done)
        except Exception as e:
            log.warning("the wgmma search path is off: %s: %s", type(e).__name__, e)
            self._wg = None
            return
        log.info("wgmma search path ready (sm_90a, NVRTC %.2f s)", self._wg.compile_s)

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
        with self._dev:
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
        """CUDA, cuBLAS and CuPy failures become ServerError (the server maps it to BACKEND_ERROR).
        The work inside runs with this backend's device current (a sidecar may drive several)."""
        try:
            with self._dev:
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

    def stats_line(self) -> str:
        """Searches served and mean wall time (staging, launch, wait, results) per path and batch
        size, in microseconds."""
        parts = [f"{p}/{bk}: {c} x {ns / c / 1e3:.1f} us"
                 for (p, bk), (c, ns) in sorted(self.search_stats.items()) if c]
        if self.half_fallbacks:
            parts.append(f"half-score queries redone in float32: {self.half_fallbacks}")
        if self.wgmma_fallbacks:
            parts.append(f"wgmma queries redone in float32: {self.wgmma_fallbacks}")
        return "; ".join(parts) or "no searches"

    def _plan(self, b: int, n: int, k: int, m: CupyMatrix) -> tuple[str, int]:
        """("host", 0), ("small", QT), ("wgmma", 0), ("gemmh", 0) or ("gemm", 0) for b queries."""
        return plan_path(b, n, k, m.dpad, smem_optin=self._smem_optin,
                         small_batch_max=self.small_batch_max, small_work_max=self.small_work_max,
                         half=self._half_ok(m, k), host_work=self.host_work,
                         wgmma=self._wgmma_ok(m, k), wgmma_min_rows=self.wgmma_min_rows)

    def free_bytes(self) -> int:
        """Device memory free for new arrays: the driver's free bytes plus CuPy's pooled ones."""
        with self._dev:
            free, _total = self._cp.cuda.runtime.memGetInfo()
            return int(free) + int(self._cp.get_default_memory_pool().free_bytes())

    def _half_ok(self, m: CupyMatrix, k: int) -> bool:
        return half_ok(self._storage_code, k, m.max_norm)

    def _wgmma_ok(self, m: CupyMatrix, k: int) -> bool:
        return self._wg is not None and wgmma_ok(self._storage_code, k, bool(m.l2), m.max_norm, m.dpad)

    # ------------------------------------------------------------------ search
    def search(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int,
               path: str | None = None) -> SearchResult:
        """Exact top-k of ``queries`` over rows [0, n) of ``m`` (see ``Matrix.search``), waited for.
        ``path`` forces one (tests, probes) instead of the planner's choice."""
        return self._collect(self._start(m, queries, n, k, path))

    def search_async(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int,
                     path: str | None = None, *, row_ids: np.ndarray | None = None) -> CudaSearch:
        """Enqueue a search on the stream and return at once a Future of it: ``done()`` asks its
        CUDA event, ``result()`` collects it. Two may be pending (each uses its own buffer set;
        the second runs right after the first); a third raises RuntimeError. ``row_ids``: see
        ``Matrix.search_async``."""
        launch = self._start(m, queries, n, k, path)
        launch.row_ids = row_ids
        return CudaSearch(self, launch)

    def _start(self, m: CupyMatrix, queries: np.ndarray, n: int, k: int,
               path: str | None) -> _Launch:
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
        p = _Launch(bufs, m, q, n, k, kk, path or "", time.perf_counter_ns())
        if b == 0 or kk == 0:
            p.value = (np.empty((b, kk), np.int64), np.empty((b, kk), np.float32))
            return p
        qt = 0
        if path is None:
            path, qt = self._plan(b, n, k, m)
        elif path == "small":
            if k > WARP_K:
                raise ValueError("the fused path serves k <= 32")
            qt = QT_FOR[min(b, SMALL_QT[-1])]
        elif path == "gemmh" and not self._half_ok(m, k):
            raise ValueError(f"the half-score path serves float16 storage and k <= {HALF_K}")
        elif path == "wgmma" and not self._wgmma_ok(m, k):
            raise ValueError(f"the wgmma path serves a Hopper device (built), float16 storage, "
                             f"dot or cosine, k <= {WGMMA_K} and a padded dim that is a multiple of 64")
        p.path = path
        if path == "host":  # answered now, from the host copy (read back first if stale)
            with self._guard("a search of the host copy"):
                p.value = m.host_search(q, n, k)
            return p
        bufs.busy = True
        try:
            with self._dev:
                self._enqueue(bufs, path, m, q, n, k, kk, qt)
        except BaseException as e:
            bufs.busy = False
            if isinstance(e, (KalosError, ValueError, IndexError, TypeError)):
                raise
            raise ServerError(f"CUDA search failed: {type(e).__name__}: {e}") from e
        return p

    def _enqueue(self, bufs: BufferSet, path: str, m: CupyMatrix, q: np.ndarray, n: int, k: int,
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
        elif path == "wgmma":
            self._search_wgmma(m, q, n, kk)
        elif path == "exact":  # (the wgmma path's redo)
            self._search_gemm(m, q, n, k, kk, exact=True)
        else:
            self._search_gemm(m, q, n, k, kk)
        bufs.done.record(self._stream)

    def _collect(self, p: _Launch) -> SearchResult:
        """Wait for a launch and read its answer (redoing unproven half-score queries)."""
        if p.value is not None:
            if p.path != "host":
                return p.value  # (empty: nothing to look up in row_ids)
            return self._answer(p, *p.value)
        bufs, b, kk = p.bufs, len(p.q), p.kk
        try:
            self._wait(bufs.done)
            out = bufs.h_out
            rows = out.view(np.int32, b * kk).reshape(b, kk).astype(np.int64)
            scores = out.view(np.float32, 2 * b * kk)[b * kk:].reshape(b, kk).copy()
            if p.path in ("gemmh", "wgmma"):
                # Flagged by the kernel, or with a row missing (scores beyond float16 even after
                # scaling, for queries of norm ~2^100 and more): the float32 path decides.
                redo = np.flatnonzero(out.view(np.int32, 2 * b * kk + b)[2 * b * kk:]
                                      | (rows < 0).any(axis=1))
                if redo.size:  # not proven exact from 32 candidates: the float32 scores decide
                    if p.path == "gemmh":
                        self.half_fallbacks += int(redo.size)
                    else:
                        self.wgmma_fallbacks += int(redo.size)
                    qr = np.ascontiguousarray(p.q[redo])
                    with self._dev:
                        self._enqueue(bufs, "gemm" if p.path == "gemmh" else "exact", p.m, qr,
                                      p.n, p.k, kk, 0)
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
        return self._answer(p, rows, scores)

    def _answer(self, p: _Launch, rows: np.ndarray, scores: np.ndarray) -> SearchResult:
        """A collected search: counted in ``search_stats``, its rows looked up in ``row_ids``."""
        st = self.search_stats.setdefault((p.path, size_bucket(len(p.q))), [0, 0])
        st[0] += 1
        st[1] += time.perf_counter_ns() - p.t0
        if p.row_ids is not None:
            rows = p.row_ids[rows]
        return rows, scores


__all__ = ["CupyBackend", "CudaSearch", "cuda_available", "device_count"]
