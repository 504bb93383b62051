"""What the sidecar measures about itself, as plain data (the exporter turns it into metrics)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batching import Route


class BatchRecord:
    """One served batch, as the serving thread reports it: cheap to make (no arrays are built);
    the exporter derives the per-request stage times from it, off the serving path."""

    __slots__ = ("size", "compute_ns", "t_pick_ns", "t_post_ns", "t_done_ns")

    def __init__(
        self, size: int, compute_ns: int, t_pick_ns: int, t_post_ns: Sequence[int] | np.ndarray, t_done_ns: int = 0
    ) -> None:
        self.size = size  # requests in the batch
        self.compute_ns = compute_ns  # backend work for the whole batch
        self.t_pick_ns = t_pick_ns  # CLOCK_MONOTONIC when the batch was taken
        self.t_post_ns = t_post_ns  # per request: CLOCK_MONOTONIC when the client posted it
        self.t_done_ns = t_done_ns  # CLOCK_MONOTONIC when the results were written (0: unknown)


#: The routes a batch is served by, as metric labels.
ROUTES = tuple(r.value for r in Route)


@dataclass
class SidecarStats:
    n_slots: int
    batches: int = 0
    requests: int = 0
    slots_reclaimed: int = 0
    records_expired: int = 0  # deleted by the sweeper once expired (sidecar_cuda.serving.expiry)
    internal_errors: int = 0  # unexpected errors the serving loop caught (each logged)
    errors: Counter[int] = field(default_factory=Counter)
    #: Batches per route ("single", "uniform", "general"), written by the serving thread only.
    routes: Counter[str] = field(default_factory=Counter)
    #: Observers called with each BatchRecord from the serving thread (the exporter hooks in here).
    observers: list[Callable[[BatchRecord], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_batch(self, rec: BatchRecord, route: str = "general") -> None:
        # Only the serving thread writes these counters; observers get every record.
        self.batches += 1
        self.routes[route] += 1
        self.requests += rec.size
        for obs in self.observers:
            obs(rec)

    def record_error(self, status: int) -> None:
        with self.lock:
            self.errors[int(status)] += 1
