"""The reaper: slots leased by clients that died or gave them up come back to FREE.

A lease is alive while its holder keeps the slot's byte of the lease file locked
(:mod:`kalos.broker.leases`): the kernel drops the lock when the holder dies, in any PID namespace.
Every lease field was written by a client, so nothing in them is trusted: the pid is only for
diagnostics, and a slot that is not FREE without an owner is freed too (only a broken client
leaves one).

The reaper frees slots only under the claim lock clients lease under (docs/protocol.md, "Leases"),
so it never races a claim or a give-back; but it runs on the serving thread and a client can hold
that lock for as long as it likes (stopped, frozen, or on purpose), so it never waits for it: it
looks first without the lock, tries the lock only when a slot needs freeing, and when the lock is
held it tries again on its next pass. A held lock delays reaping, never serving.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import posix_ipc

from ...broker.layout import OWNER_ABANDONED, S_FREE
from ...broker.leases import release_claim_lock, try_claim_lock

#: Seconds between two passes of the reaper (the serving loop runs it on time, busy or not).
REAP_S = 0.25


class Drainable(Protocol):
    """A slot's semaphore (``posix_ipc.Semaphore``)."""

    def acquire(self, timeout: float | None = None) -> None: ...


class ReapOutcome(enum.Enum):
    IDLE = "idle"  # no slot needed freeing: the claim lock was not tried
    REAPED = "reaped"  # looked again under the claim lock and freed what still needed it
    LOCK_HELD = "lock_held"  # a slot needs freeing but a client holds the claim lock: next pass


@dataclass(frozen=True, slots=True)
class Reap:
    outcome: ReapOutcome
    freed: int = 0


def needs_reaping(owner_pid: int, state: int, lease_held: bool) -> bool:
    """Whether a slot must be freed: its lease is abandoned, or its owner's lease lock is gone
    (dead), or it is in a state other than FREE without an owner. ``owner_pid`` and ``state`` are
    what a client wrote (any values); ``lease_held``: the kernel's word on the slot's lock byte.
    Pure."""
    if owner_pid == 0:
        return state != S_FREE
    if owner_pid == OWNER_ABANDONED:
        return True
    return not lease_held


def reap_dead_owners(
    slots: np.ndarray,
    lock_fd: int,
    req: Sequence[Drainable],
    resp: Sequence[Drainable],
    skip: Collection[int],
    held: Callable[[int], bool],
) -> Reap:
    """Free the slots whose owner is dead (or abandoned them), and slots left in a state other
    than FREE without an owner: drain both semaphores, then state FREE and the lease cleared.
    ``slots``: the control blocks (``SegmentView.slots``); ``lock_fd``: the segment's descriptor
    (the claim lock); ``skip``: slots of a batch in flight, left alone until it is answered;
    ``held(i)``: whether slot i's lease lock is held by a live process. Never waits: when a client
    holds the claim lock, nothing is freed and the outcome says LOCK_HELD. Raises OSError from
    the lock calls (not expected)."""
    suspects = np.flatnonzero((slots["owner_pid"] != 0) | (slots["state"] != S_FREE))
    # A first look without the lock: slots of live owners (nearly always all of them) need
    # nothing, so the claim lock is tried only when there is something to free.
    candidates = [
        i
        for i in suspects.tolist()
        if i not in skip and needs_reaping(int(slots[i]["owner_pid"]), int(slots[i]["state"]), held(i))
    ]
    if not candidates:
        return Reap(ReapOutcome.IDLE)
    if not try_claim_lock(lock_fd):
        return Reap(ReapOutcome.LOCK_HELD)
    freed = 0
    try:
        for i in candidates:
            # Again under the lock, where no client changes the lease fields: the first look
            # read them while a client could (give the slot back, say).
            if not needs_reaping(int(slots[i]["owner_pid"]), int(slots[i]["state"]), held(i)):
                continue
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
        release_claim_lock(lock_fd)
    return Reap(ReapOutcome.REAPED, freed)
