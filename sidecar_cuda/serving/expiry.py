"""The sweeper: expired records deleted durably, a bounded pass at a time, on the serving thread.

Expiry itself needs no sweeper: every read leaves out the records expired at its ``now``
(:mod:`kalos.sidecar_cuda.storage.store`), so a record is never answered after its ``expires_at`` whether
it was deleted yet or not. The sweeper frees what they hold and keeps the durable store (and, in a
fleet, every replica through the change log, as DELETEs) in step: every :data:`SWEEP_S` seconds,
busy or not, the namespaces whose earliest expiry has passed (:func:`due`, pure) get one EXPIRE
write each, of at most :data:`SWEEP_ROWS` ids in all per pass, resolved against memory when it is
committed (in a fleet under the write lock, after catching up, so a record another node touched or
wrote again meanwhile is left alone), then applied. A batch in flight on the backend is answered
first: no write may move rows under a search.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..storage.durable import Durable, StoreError, commit_and_apply
from ..storage.store import MemoryStore
from ..storage.writes import Write, WriteOp
from .stats import SidecarStats

log = logging.getLogger("kalos.sidecar")

#: Seconds between two sweeps.
SWEEP_S = 0.2
#: Records deleted per sweep at most (a pass is one commit; the rest go in the next passes).
SWEEP_ROWS = 4096
#: After a failed commit the next pass waits this long, doubling per failure up to the most.
RETRY_S, RETRY_MAX_S = 1.0, 30.0


def due(store: MemoryStore, now: int) -> list[str]:
    """The namespaces that may hold records expired at ``now`` (their earliest expiry, a lower
    bound, has passed): ``MemoryStore.due``, which visits only namespaces with expiring records."""
    return store.due(now)


@dataclass(eq=False)
class Sweeper:
    """Deletes expired records (module docstring). ``before_write``: answers the batches in flight
    (the pipeline's ``finish_inflight``); ``clock``: CLOCK_REALTIME ns."""

    store: MemoryStore
    persist: Durable | None
    before_write: Callable[[], int]
    stats: SidecarStats
    clock: Callable[[], int]
    rows: int = SWEEP_ROWS
    failures: int = field(default=0, init=False)  # failed commits in a row
    _retry_at: float = field(default=0.0, init=False)  # (time.monotonic) no pass before this after a failure

    def sweep(self) -> int:
        """One pass; returns the records deleted. Raises StoreError when the commit fails (the
        records stay, hidden from every read; the next pass that tries again is RETRY_S later,
        doubling per failure up to RETRY_MAX_S, so a store that is away costs no commit a pass)."""
        if self.failures and time.monotonic() < self._retry_at:
            return 0
        now = self.clock()
        names = due(self.store, now)
        if not names:
            return 0
        budget = self.rows
        writes = []
        for name in names:
            ns = self.store.namespaces[name]
            live = ns.live(now)  # (exact again when nothing expired: the namespace is not due)
            if live is None or budget <= 0:
                continue
            m = min(budget, ns.n - len(live.rows))
            writes.append(Write(WriteOp.EXPIRE, name, now_ns=now, limit=m))
            budget -= m
        if not writes:
            return 0
        self.before_write()
        try:
            _positions, outcomes = commit_and_apply(self.persist, self.store, writes)
        except StoreError:
            self.failures += 1
            self._retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_S * 2 ** (self.failures - 1))
            raise
        self.failures = 0
        gone = 0
        for w, n in zip(writes, outcomes):
            if isinstance(n, Exception):
                log.error("applying the expiry of %r failed", w.namespace, exc_info=n)
            elif w.ids is not None:
                gone += len(w.ids)
        self.stats.records_expired += gone
        return gone


__all__ = ["SWEEP_ROWS", "SWEEP_S", "Sweeper", "due"]
