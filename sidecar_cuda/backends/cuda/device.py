"""The resources handle of the CUDA backend: one :class:`Device` per backend, passed explicitly to
every function that touches the GPU (``rows.py``, ``paths.py``, ``search.py``), as FAISS passes
its ``GpuResources`` and cuVS its ``resources``.

It holds what a search needs and nothing about any one matrix: CuPy and its runtime, the device's
properties, the stream every piece of work goes on, the compiled kernels, the two buffer sets, the
CUDA graphs of the fused path, the pinned allocations handed out, the planner's :class:`Limits`,
and the per-path statistics. It also owns the backend's health: ``guard`` maps CUDA failures to
ServerError, ``wait`` gives up after ``timeout_s`` and marks the device broken.

Importing this module needs no CuPy (the backend imports it, and CuPy, when it starts).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from ....broker.errors import ClosedError, ConfigError, KalosError, ServerError
from ..base import BackendStatistics, SearchCounts
from .buffers import BufferSet
from .kernels import Kernels, Storage
from .planner import GRAPH_CACHE, Limits, SearchPath
from .wgmma import WgmmaKernels

log = logging.getLogger("kalos.cuda")


class GraphCache:
    """CUDA graphs of the fused path, one per launch shape (least recently added first out).

    A graph evicted while a search that replayed it may still run is kept until every search
    enqueued before its eviction has been collected (:meth:`prune`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # off for good once a capture fails
        self._graphs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._retired: list[tuple[int, Any]] = []  # (searches enqueued at eviction, graph)

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: tuple[Any, ...]) -> Any:
        return self._graphs.get(key)

    def put(self, key: tuple[Any, ...], graph: Any, seq: int) -> None:
        """Keep ``graph`` under ``key``; ``seq``: searches enqueued so far."""
        self._graphs[key] = graph
        while len(self._graphs) > GRAPH_CACHE:
            self._retired.append((seq, self._graphs.popitem(last=False)[1]))

    def prune(self, oldest_pending: int) -> None:
        """Destroy the evicted graphs no pending search (``seq`` >= ``oldest_pending``) may run."""
        if self._retired:
            self._retired = [(s, g) for s, g in self._retired if s >= oldest_pending]

    def clear(self) -> None:
        self._graphs.clear()


class SearchStats(SearchCounts[SearchPath]):
    """Searches served per (path, batch-size bucket): [count, wall ns from start to answer], and
    the queries the proving paths could not prove exact (redone in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.half_fallbacks = self.wgmma_fallbacks = self.int8_fallbacks = 0

    def clear(self) -> None:
        super().clear()
        self.half_fallbacks = self.wgmma_fallbacks = self.int8_fallbacks = 0

    def snapshot(self, memory: tuple[tuple[str, int], ...] = ()) -> BackendStatistics:
        """These counts as a frozen snapshot (``memory``: the backend's bytes by part)."""
        return BackendStatistics(
            self.searches(),
            (
                (SearchPath.HALF_GEMM.value, self.half_fallbacks),
                (SearchPath.INT8.value, self.int8_fallbacks),
                (SearchPath.WGMMA.value, self.wgmma_fallbacks),
            ),
            memory,
        )

    def line(self) -> str:
        """Searches served and mean wall time per path and batch size, in microseconds."""
        parts = [f"{s.path}/{s.batch}: {s.searches} x {s.seconds / s.searches * 1e6:.1f} us" for s in self.searches()]
        if self.half_fallbacks:
            parts.append(f"half-score queries redone in float32: {self.half_fallbacks}")
        if self.wgmma_fallbacks:
            parts.append(f"wgmma queries redone in float32: {self.wgmma_fallbacks}")
        if self.int8_fallbacks:
            parts.append(f"int8 queries redone in float32: {self.int8_fallbacks}")
        return "; ".join(parts) or "no searches"


class Device:
    """One CUDA device opened for searches (see the module docstring). ``storage``: how rows are
    stored; ``use_graphs``: replay CUDA graphs on the fused path; ``timeout_s``: the longest a
    search may take before the device is marked broken; ``limits``: the planner's, without the
    device's shared memory (filled in here). Raises ConfigError when the device cannot be used.
    The kernels of the wgmma path are not built here (:meth:`set_wgmma`)."""

    def __init__(self, ordinal: int, storage: Storage, *, use_graphs: bool, timeout_s: float, limits: Limits) -> None:
        try:
            import cupy as cp
        except Exception as e:
            raise ConfigError(f"the CUDA backend needs CuPy ({type(e).__name__}: {e})") from None
        self.cp: Any = cp
        rt = cp.cuda.runtime
        self.rt: Any = rt
        try:
            count = rt.getDeviceCount()
        except Exception as e:
            raise ConfigError(f"no usable CUDA device ({type(e).__name__}: {e})") from None
        if not 0 <= ordinal < count:
            raise ConfigError(f"CUDA device {ordinal} does not exist ({count} visible)")
        self.ordinal = ordinal
        self.storage = storage
        self.timeout_s = timeout_s
        self.closed = False
        self.broken: str | None = None
        self.stats = SearchStats()
        self.seq = 0  # searches enqueued so far
        self.wgmma: WgmmaKernels | None = None  # the wgmma path's kernels (None: the path is off)
        self.recency_kernel: Any = None  # recency.py's kernel, built by the first recency search
        self._pinned: list[tuple[int, int, Any]] = []  # (address, bytes, allocation)
        self._occupancy: dict[tuple[int, int], int] = {}
        # cuBLAS reads alpha and beta from host memory.
        self.alpha = np.ones(1, np.float32)
        self.beta = np.zeros(1, np.float32)
        self.cuda: Any = cp.cuda.Device(ordinal)
        self.cuda.use()
        props = rt.getDeviceProperties(ordinal)
        if not rt.deviceGetAttribute(rt.cudaDevAttrUnifiedAddressing, ordinal):
            raise ConfigError(
                "the CUDA device lacks unified addressing (needed to write results into pinned host memory)"
            )
        self.sms = int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, ordinal))
        self.smem_optin = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal))
        self.cc_major = int(props["major"])
        self.limits = replace(limits, smem_optin=self.smem_optin, wgmma_built=False)
        gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        mem_gib = props["totalGlobalMem"] / 2**30
        self.description = (
            f"CUDA {gpu} (sm_{props['major']}{props['minor']}, {self.sms} SMs, "
            f"{mem_gib:.0f} GiB), {storage.value} storage, CuPy {cp.__version__}"
        )
        self.stream: Any = cp.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        self.kernels = Kernels(cp, storage, self.smem_optin)
        self.compile_s = time.perf_counter() - t0
        self.sets = (BufferSet(cp, self.stream, 0), BufferSet(cp, self.stream, 1))
        self.graphs = GraphCache(use_graphs)

    def set_int8(self, on: bool) -> None:
        """Turn the int8 first pass on (checked in the warm-up) or off."""
        self.limits = replace(self.limits, int8_on=on)

    def set_wgmma(self, kernels: WgmmaKernels | None) -> None:
        """Turn the wgmma path on (its kernels, built and checked) or off (None)."""
        self.wgmma = kernels
        self.limits = replace(self.limits, wgmma_built=kernels is not None)

    # ------------------------------------------------------------------ health
    def check_usable(self) -> None:
        if self.closed:
            raise ClosedError("the CUDA backend is closed")
        if self.broken is not None:
            raise ServerError(f"the CUDA backend is broken: {self.broken}")

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """CUDA, cuBLAS and CuPy failures become ServerError (the server maps it to BACKEND_ERROR).
        The work inside runs with this device current (a sidecar may drive several)."""
        try:
            with self.cuda:
                yield
        except (KalosError, ValueError, IndexError, TypeError):
            raise
        except Exception as e:
            raise ServerError(f"CUDA {what} failed: {type(e).__name__}: {e}") from e

    def wait(self, ev: Any) -> None:
        """Spin until event ``ev`` has happened (a few microseconds after the kernel ends); sleep
        a little once it has taken 2 ms; give up after timeout_s (ServerError, device broken)."""
        if ev.done:
            return
        t0 = time.perf_counter()
        while not ev.done:
            el = time.perf_counter() - t0
            if el > 0.002:
                if el > self.timeout_s:
                    self.broken = f"a search did not finish within {self.timeout_s} s"
                    raise ServerError(self.broken)
                time.sleep(0.00005)

    # ------------------------------------------------------------------ memory
    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
        """Pinned host memory (searches from it need no staging copy: :meth:`pinned_address`)."""
        self.check_usable()
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = max(1, count * dt.itemsize)
        with self.guard("allocating pinned memory"):
            mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        arr = np.frombuffer(mem, dt, count).reshape(shape)
        self._pinned.append((int(mem.ptr), nbytes, mem))
        return arr

    def pinned_address(self, a: np.ndarray) -> int | None:
        """The address of ``a`` if it lies whole in pinned memory this device handed out (a copy
        from it needs no staging), else None."""
        if not a.flags.c_contiguous:
            return None
        addr: int = a.__array_interface__["data"][0]
        for ptr, nbytes, _mem in self._pinned:
            if ptr <= addr and addr + a.nbytes <= ptr + nbytes:
                return addr
        return None

    def free_bytes(self) -> int:
        """Device memory free for new arrays: the driver's free bytes plus CuPy's pooled ones."""
        with self.cuda:
            free, _total = self.rt.memGetInfo()
            return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    def occupancy(self, kernel: Any, threads: int, smem: int, key: tuple[int, int]) -> int:
        """Blocks of ``kernel`` resident per SM with ``smem`` bytes of shared memory (cached
        under ``key``; at least 1)."""
        occ = self._occupancy.get(key)
        if occ is None:
            occ = self._occupancy[key] = max(
                1, int(self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, smem))
            )
        return occ

    def close(self) -> None:
        """Wait for the device, then release everything. Closing twice is fine."""
        if self.closed:
            return
        self.closed = True
        with self.cuda:
            try:
                self.stream.synchronize()
            except Exception:
                pass
            self.graphs.clear()
            try:
                self.cp.get_default_memory_pool().free_all_blocks()
            except Exception:
                pass


__all__ = ["Device", "GraphCache", "SearchStats"]
