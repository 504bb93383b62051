"""The reaper: slots leased by clients that died or gave them up come back to FREE.

A lease is alive while its holder keeps the slot's byte of the lease file locked
(:mod:`kalos.broker.leases`): the kernel drops the lock when the holder dies, in any PID namespace.
Every lease field was written by a client, so nothing in them is trusted: the pid is only for
diagnostics, and a slot that is not FREE without an owner is freed too (only a broken client
leaves one). The reaper works under the same ``flock`` clients lease under (docs/protocol.md,
"Leases").
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import numpy as np
import posix_ipc

from ..broker.layout import OWNER_ABANDONED, S_FREE

#: Seconds between two passes of the reaper (the serving loop runs it on time, busy or not).
REAP_S = 0.25


class Drainable(Protocol):
    """A slot's semaphore (``posix_ipc.Semaphore``)."""

    def acquire(self, timeout: float | None = None) -> None: ...


def reap_dead_owners(slots: np.ndarray, lock_fd: int, req: Sequence[Drainable],
                     resp: Sequence[Drainable], skip: Collection[int],
                     held: Callable[[int], bool]) -> int:
    """Free the slots whose owner is dead (or abandoned them), and slots left in a state other
    than FREE without an owner: drain both semaphores, then state FREE and the lease cleared.
    ``slots``: the control blocks (``SegmentView.slots``); ``lock_fd``: the segment's descriptor
    (the lease lock); ``skip``: slots of a batch in flight, left alone until it is answered;
    ``held(i)``: whether slot i's lease lock is held by a live process.
    Returns the number of slots freed."""
    owners = slots["owner_pid"]
    suspects = np.flatnonzero((owners != 0) | (slots["state"] != S_FREE))
    if len(suspects) == 0:
        return 0
    freed = 0
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        for i in suspects.tolist():
            if i in skip:
                continue
            pid = int(slots[i]["owner_pid"])
            if pid == 0 and int(slots[i]["state"]) == S_FREE:
                continue  # given back meanwhile
            if pid not in (0, OWNER_ABANDONED) and held(i):
                continue  # its holder lives
            for sem in (req[i], resp[i]):
                while True:
                    try:
                        sem.acquire(0)
                    except posix_ipc.BusyError:
                        break
            slots[i]["state"] = S_FREE
            slots[i]["owner_start"] = 0
            slots[i]["owner_pid"] = 0
            freed += 1
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
    return freed
