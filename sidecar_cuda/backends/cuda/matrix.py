"""The store's :class:`~kalos.sidecar_cuda.backends.base.Matrix` on the GPU: :class:`CupyMatrix`
is the rows (``rows.DeviceRows``, plain data) and the :class:`Device` they live on; each method is
one call into ``rows.py``, ``search.py`` or ``filtered.py`` with that device.
"""

from __future__ import annotations

import numpy as np

from ....broker.layout import Metric
from ..base import Decay, PendingSearch, SearchResult, Subset
from .device import Device
from .filtered import search_within
from .planner import Plan, SearchPath
from .rows import DeviceRows, move, read, set_times, write
from .rows import grow as grow_rows
from .search import plan_for, run, start


class CupyMatrix(DeviceRows):
    """Rows [0, capacity) of one namespace on ``device``."""

    def __init__(self, device: Device, dim: int, capacity: int, metric: Metric) -> None:
        super().__init__(device, dim, capacity, metric)
        self.device = device

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        write(self.device, self, rows, vectors)

    def set_times(self, rows: np.ndarray, times_ns: np.ndarray) -> None:
        set_times(self.device, self, rows, times_ns)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        move(self.device, self, src, dst)

    def grow(self, capacity: int) -> None:
        grow_rows(self.device, self, capacity)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        return read(self.device, self, rows)

    def search(
        self,
        queries: np.ndarray,
        n: int,
        k: int,
        *,
        within: Subset | None = None,
        decay: Decay | None = None,
        path: SearchPath | None = None,
    ) -> SearchResult:
        """``Matrix.search``; ``path``: this path instead of the planner's choice (tests and
        benchmarks; ValueError where it cannot serve the search). A search ``within`` candidates
        takes the rounds of ``filtered.search_within``, each on the planner's path."""
        if within is None:
            return run(self.device, self, queries, n, k, path, decay)
        if path is not None:
            raise ValueError("a filtered search takes the planner's paths (no path= with within=)")
        return search_within(self.device, self, queries, n, k, within, decay)

    def search_start(
        self, queries: np.ndarray, n: int, k: int, *, row_ids: np.ndarray | None = None, path: SearchPath | None = None
    ) -> PendingSearch:
        """``Matrix.search_start`` (a ``search.CudaSearch``); ``path`` as for :meth:`search`."""
        return start(self.device, self, queries, n, k, path, row_ids)

    def plan(self, b: int, n: int, k: int) -> Plan:
        """The path the planner picks for b queries over rows [0, n) with this k."""
        return plan_for(self.device, self, b, n, k)


__all__ = ["CupyMatrix"]
