"""CUDA backend: the memory matrix lives on the GPU; exact top-k by the kernels in kalos_topk.cu.

Files: this one (the backend: options, start-up and warm-up, matrices, statistics), ``device.py``
(the resources handle every function takes: stream, kernels, buffer sets, graphs), ``rows.py``
(a matrix's rows as plain data; writes, moves, growth, reads), ``matrix.py`` (the store's Matrix
over them), ``planner.py`` (which path a search takes: a typed Plan, pure), ``search.py`` (start,
Future, collect), ``paths.py`` (the launch sequences, free functions), ``filtered.py`` (searches
over candidate rows), ``buffers.py``, ``kernels.py`` (the ``.cu`` and the constants it is compiled
with), ``wgmma.py``.

Only the sidecar imports this module, and CuPy is imported lazily, so the module itself imports on
machines without CuPy (``cuda_available()`` then says why the backend is unusable).

Rows are stored in the storage dtype (float32, float16 or bfloat16; 16-bit values are saturated,
never infinite), padded with zeros to a multiple of 16 bytes; the squared norm of every stored row
is kept on the device for l2. Writes, moves and growth are device-side updates of just those rows.

A search takes one of five paths (``planner.plan``; ``CupyMatrix.search(path=...)`` names one):

* **host** (tiny work: at most ``host_work`` rows x queries x padded dim, ``--host-search-work``):
  a launch, its completion and the copies cost more than the arithmetic (an empty launch plus
  sync is 11-15 us on the H200's host, a 256 x 128 search 34 us in-process), so the rows are
  scored on the CPU from a float32 copy of the stored values (``paths.search_host``: read back
  once, exactly as stored, and dropped by the next write, move or growth).

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
  proof fails is redone with float32 scores of every row (``kw_exact``, the EXACT path) and the
  GEMM path's top-k. Compiled by NVRTC for sm_90a in the warm-up; ``FusedKernel.OFF``
  (``--fused-kernel off``), a non-Hopper device or a failed build leave it out.
* **int8** (any storage, k <= 16, small batches over many rows; ``int8.py``): the rows' int8 copy
  (one scale per row, built by the first such search and kept current by every write) and int8
  queries multiplied by cuBLAS into exact int32 products, half the bytes of float16 rows to read;
  the 256 rows with the highest proven upper bound per query are rescored in float32 against the
  float32 query. A query whose proof fails is redone on the GEMM path. ``Int8Pass.OFF``
  (``--int8-pass off``) or a failed check in the warm-up leave it out.

Results are exact up to ties and the storage dtype's rounding: the fused, half-score, wgmma and
int8 paths multiply float32 queries with widened rows; the GEMM path rounds queries to the storage dtype.

Errors: failures at start (no CuPy, no device, compilation) are ``ConfigError``; CUDA/cuBLAS
failures during work are ``ServerError`` (the server answers BACKEND_ERROR); a search that does not
finish within ``timeout_s`` raises and marks the backend broken rather than hang. One thread at a
time (the sidecar's serving thread) may use a backend.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ....broker.errors import ConfigError
from ....broker.layout import Metric
from ..base import BackendStatistics, Made, Matrix, PendingSearch, completed, search_each
from ..options import FusedKernel, Int8Pass
from .device import Device, SearchStats
from .kernels import MAX_K, WARP_K, Storage
from .matrix import CupyMatrix
from .paths import enqueue
from .planner import (
    HALF_K,
    HOST_WORK,
    INT8_MIN_ROWS,
    MIXED_ROWS,
    WGMMA_MIN_ROWS,
    Limits,
    Plan,
    SearchPath,
    half_ok,
)
from .search import start_mixed
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


class CupyBackend:
    """The CUDA backend (see the module docstring). ``storage_dtype``: float32, float16 or
    bfloat16. ``use_graphs``: replay CUDA graphs for the fused path. ``timeout_s``: the longest a
    search may take before it is abandoned and the backend marked broken. ``host_work``: searches
    of at most this many rows x queries x padded dim run on the host copy (0: never).
    ``fused_kernel``: AUTO builds the wgmma path where it can run (a compute capability 9.x
    device, float16 storage), OFF never. ``int8_pass``: AUTO turns the int8 first pass on (checked
    in the warm-up), OFF never. ``small_batch_max``, ``small_work_max``, ``wgmma_min_rows`` and
    ``int8_min_rows``: the planner's thresholds (``planner.Limits``; tests lower the last two).
    Raises ConfigError when CuPy or the device cannot be used."""

    name = "cuda"
    code = 2
    max_k = MAX_K
    mixed_rows = MIXED_ROWS

    def __init__(
        self,
        storage_dtype: Storage | str = Storage.FLOAT32,
        device: int = 0,
        *,
        use_graphs: bool = True,
        timeout_s: float = 30.0,
        small_batch_max: int = 1,
        small_work_max: int = 1 << 12,
        host_work: int = HOST_WORK,
        fused_kernel: FusedKernel = FusedKernel.AUTO,
        wgmma_min_rows: int = WGMMA_MIN_ROWS,
        int8_pass: Int8Pass = Int8Pass.AUTO,
        int8_min_rows: int = INT8_MIN_ROWS,
    ) -> None:
        storage = Storage.parse(storage_dtype)
        self.storage_dtype = storage.value
        self.fused_kernel = fused_kernel
        self.int8_pass = int8_pass
        limits = Limits(
            smem_optin=0,
            small_batch_max=small_batch_max,
            small_work_max=small_work_max,
            host_work=host_work,
            wgmma_min_rows=wgmma_min_rows,
            int8_min_rows=int8_min_rows,
        )
        # The store's matrices (not the warm-up's), for the memory statistics; the lock keeps a
        # scrape's copy of the set and a new matrix apart.
        self._matrices = Made(CupyMatrix)
        try:
            self.device = Device(device, storage, use_graphs=use_graphs, timeout_s=timeout_s, limits=limits)
            self.device.stream.synchronize()
            t0 = time.perf_counter()
            self._warm_up()
            self.warm_s = time.perf_counter() - t0
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"the CUDA backend failed to start on device {device}: {type(e).__name__}: {e}") from None
        self.placement = f"cuda:{device}"
        self.description = self.device.description
        self.compile_s = self.device.compile_s
        log.info(
            "CUDA backend: %s; kernels compiled/loaded in %.2f s, every path warmed up in %.2f s",
            self.description,
            self.compile_s,
            self.warm_s,
        )

    # ------------------------------------------------------------------ what tests and tools read
    @property
    def host_work(self) -> int:
        return self.device.limits.host_work

    @property
    def stats(self) -> SearchStats:
        """Searches served per path and batch size, and the queries redone in float32."""
        return self.device.stats

    @property
    def wgmma_built(self) -> bool:
        """The wgmma path is on (built and checked in the warm-up)."""
        return self.device.wgmma is not None

    @property
    def int8_on(self) -> bool:
        """The int8 first pass is on (``--int8-pass auto``, checked in the warm-up)."""
        return self.device.limits.int8_on

    @property
    def stream(self) -> object:
        """The CuPy stream every search is enqueued on (benchmarks record CUDA events on it)."""
        return self.device.stream

    def stats_line(self) -> str:
        """Searches served and mean wall time per path and batch size, in microseconds."""
        return self.device.stats.line()

    # ------------------------------------------------------------------ Backend protocol
    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> CupyMatrix:
        self.device.check_usable()
        with self.device.guard("allocating a matrix"):
            return self._matrices.add(CupyMatrix(self.device, dim, capacity, metric))

    def search_mixed(
        self, matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> PendingSearch:
        """``Backend.search_mixed`` in one launch (``kalos_mixed``): each query reads only its own
        namespace's rows."""
        mats = self._matrices.own(matrices)
        if k > WARP_K:  # (the fused kernel keeps warp lists: one search per namespace instead)
            return completed(*search_each(matrices, n, of_query, queries, k))
        return start_mixed(self.device, mats, n, of_query, queries, k)

    def statistics(self) -> BackendStatistics:
        """Searches by path and batch size, queries redone in float32 by path, and the bytes the
        store's matrices hold by part (rows, int8 copies, gathered rows, host copies)."""
        matrices = self._matrices.alive()
        memory: Counter[str] = Counter({"rows": 0, "int8": 0, "gathered": 0, "host_copy": 0})
        for m in matrices:
            memory.update(m.memory())
        return self.device.stats.snapshot(tuple(sorted(memory.items())))

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """Pinned host memory (searches from it need no staging copy)."""
        return self.device.host_buffer(shape, dtype)

    def free_bytes(self) -> int:
        """Device memory free for new arrays."""
        return self.device.free_bytes()

    def close(self) -> None:
        """Wait for the device, then release everything. Closing twice is fine."""
        if not self.device.closed:
            log.info("CUDA backend searches: %s", self.stats_line())
        self.device.close()

    # ------------------------------------------------------------------ warm-up
    def _warm_up(self) -> None:
        """Run every path once on a scratch matrix, so that no request pays for what a first use
        costs: loading kernels (CUDA loads modules lazily), creating the cuBLAS handle and its
        workspace, compiling CuPy's own kernels (the host copy's gather), capturing a graph."""
        dev = self.device
        m = CupyMatrix(dev, 64, 64, Metric.DOT)
        rng = np.random.default_rng(0)
        m.write_rows(np.arange(64), rng.standard_normal((64, 64), dtype=np.float32))
        q = rng.standard_normal((2, 64), dtype=np.float32)
        runs = [(SearchPath.HOST, 1, 10), (SearchPath.FUSED, 1, 10), (SearchPath.GEMM, 2, 10), (SearchPath.GEMM, 2, 64)]
        if half_ok(m.traits, HALF_K):
            runs.append((SearchPath.HALF_GEMM, 2, 10))
        for path, b, k in runs:
            m.search(q[:b], 64, k, path=path)
        self._warm_up_wgmma(m, rng)
        self._warm_up_int8(m, rng)
        m.move_rows(np.array([0]), np.array([1]))
        dev.stream.synchronize()
        dev.graphs.clear()  # (they name the scratch matrix)
        dev.stats.clear()

    def _warm_up_int8(self, m: CupyMatrix, rng: np.random.Generator) -> None:
        """Check the int8 first pass once against the host path (cuBLAS int8, the kernels, and a
        proof that fails on identical rows and is redone): on any failure it stays off, with one
        log line."""
        dev = self.device
        if self.int8_pass is Int8Pass.OFF:
            return
        dev.set_int8(True)
        try:
            for b in (1, 5):
                q = rng.standard_normal((b, m.dim), dtype=np.float32)
                got = m.search(q, 64, 10, path=SearchPath.INT8)
                want = m.search(q, 64, 10, path=SearchPath.HOST)
                if not np.array_equal(got[0], want[0]):
                    raise RuntimeError(f"its answer differs from the host path's (b={b})")
        except Exception as e:
            log.warning("the int8 first pass is off: %s: %s", type(e).__name__, e)
            dev.set_int8(False)
            return
        log.info("int8 first pass ready (copy of a matrix: %d bytes for 64 rows)", m.int8_bytes)

    def _warm_up_wgmma(self, m: CupyMatrix, rng: np.random.Generator) -> None:
        """Build the wgmma path's kernels for the batch sizes the planner sends it, and check
        them once against the host path (and the float32 redo on identical rows): on any failure
        the path stays off, with one log line, and the backend keeps its other paths."""
        dev = self.device
        if self.fused_kernel is FusedKernel.OFF or dev.storage is not Storage.FLOAT16 or dev.cc_major != 9:
            return
        kernels = WgmmaKernels(dev.cp, dev.smem_optin, dev.sms)
        dev.set_wgmma(kernels)
        try:
            for b in (16, 32):  # the two query tiles the planner uses (b = 2-16 and 17-32)
                q = rng.standard_normal((b, m.dim), dtype=np.float32)
                got = m.search(q, 64, 10, path=SearchPath.WGMMA)
                want = m.search(q, 64, 10, path=SearchPath.HOST)
                if not np.array_equal(got[0], want[0]):
                    raise RuntimeError(f"its answer differs from the host path's (b={b})")
            bufs = dev.sets[0]
            enqueue(dev, bufs, Plan(SearchPath.EXACT), m, q[:1], 64, 10, 10)  # (the redo)
            dev.wait(bufs.done)
        except Exception as e:
            log.warning("the wgmma search path is off: %s: %s", type(e).__name__, e)
            dev.set_wgmma(None)
            return
        log.info("wgmma search path ready (sm_90a, NVRTC %.2f s)", kernels.compile_s)


__all__ = ["CupyBackend", "cuda_available", "device_count"]
