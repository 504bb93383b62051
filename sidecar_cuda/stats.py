"""What the sidecar measures about itself, as plain data (the exporter turns it into metrics)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class BatchRecord:
    size: int  # requests in the batch
    compute_ns: int  # backend work for the whole batch
    queue_ns: list[int]  # per request: posted -> picked up
    t_pick_ns: int = 0  # CLOCK_MONOTONIC when the batch was picked up (0: unknown)


@dataclass
class SidecarStats:
    n_slots: int
    batches: int = 0
    requests: int = 0
    slots_reclaimed: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    #: Observers called with each BatchRecord from the serving thread (the exporter hooks in here).
    observers: list = field(default_factory=list)
    recent_batches: deque[BatchRecord] = field(default_factory=lambda: deque(maxlen=4096))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_batch(self, rec: BatchRecord) -> None:
        # Only the serving thread writes; readers copy the deque (append is atomic under the GIL).
        self.batches += 1
        self.requests += rec.size
        self.recent_batches.append(rec)
        for obs in self.observers:
            obs(rec)

    def record_error(self, status: int) -> None:
        with self.lock:
            self.errors[int(status)] += 1
