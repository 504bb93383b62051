"""The reaper without a sidecar: its pure decision, and that it never waits for the claim lock
(a real ``flock`` on a real file, held by another open file description as a client's would be),
never frees a slot without it, and frees what needs it once the lock is free."""

from __future__ import annotations

import fcntl
import os
import threading

import numpy as np
import posix_ipc
import pytest

from kalos.broker.layout import (
    OWNER_ABANDONED,
    S_BUSY,
    S_DONE,
    S_FREE,
    S_POSTED,
    slot_dtype,
)
from kalos.sidecar_cuda.serving.leases import Reap, ReapOutcome, needs_reaping, reap_dead_owners


class CountingSem:
    """A semaphore's count (posix_ipc.Semaphore.acquire(0) semantics)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def acquire(self, timeout: float | None = None) -> None:
        if self.value == 0:
            raise posix_ipc.BusyError("empty")
        self.value -= 1


@pytest.mark.parametrize(
    "pid,state,held,want",
    [
        (0, S_FREE, False, False),  # free and unowned
        (0, S_POSTED, False, True),  # a request without an owner (a broken client)
        (0, S_DONE, True, True),
        (1234, S_FREE, True, False),  # a live owner, idle
        (1234, S_BUSY, True, False),  # a live owner, in flight
        (1234, S_POSTED, False, True),  # its lock byte is gone: dead
        (1234, S_FREE, False, True),
        (OWNER_ABANDONED, S_DONE, True, True),  # given up (the byte says nothing then)
        (OWNER_ABANDONED, S_FREE, False, True),
        (-7, S_FREE, True, False),  # any other value a client wrote: the byte decides
        (-7, S_FREE, False, True),
    ],
)
def test_needs_reaping(pid, state, held, want):
    assert needs_reaping(pid, state, held) is want


def slots_of(owners: list[int], states: list[int]) -> np.ndarray:
    s = np.zeros(len(owners), slot_dtype())
    s["owner_pid"] = owners
    s["owner_start"] = [7 if o else 0 for o in owners]
    s["state"] = states
    return s


def reap_in_thread(*args, **kw) -> Reap:
    """Run the reaper on a thread, so that one which waits for the lock fails this test instead of
    hanging it (60 s is generous: it takes microseconds)."""
    out: list[Reap] = []
    t = threading.Thread(target=lambda: out.append(reap_dead_owners(*args, **kw)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the reaper waited for a claim lock another process holds"
    return out[0]


def test_reaper_never_waits_for_a_held_claim_lock_and_frees_on_a_later_pass(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 64)
    sidecar_fd = os.open(path, os.O_RDWR)
    client_fd = os.open(path, os.O_RDWR)  # another open file description: a client's
    try:
        live = {1}
        # slot 0: live owner; 1: dead owner (request posted); 2: abandoned; 3: unowned, POSTED;
        # 4: free
        slots = slots_of([111, 222, OWNER_ABANDONED, 0, 0], [S_BUSY, S_POSTED, S_DONE, S_POSTED, S_FREE])
        before = slots.copy()
        req = [CountingSem(1) for _ in range(5)]
        resp = [CountingSem(2) for _ in range(5)]
        fcntl.flock(client_fd, fcntl.LOCK_EX)
        got = reap_in_thread(slots, sidecar_fd, req, resp, (), held=lambda i: i in {0} | live)
        assert got == Reap(ReapOutcome.LOCK_HELD, 0)
        assert (slots == before).all(), "a slot changed without the claim lock"
        assert [s.value for s in req] == [1] * 5 and [s.value for s in resp] == [2] * 5
        fcntl.flock(client_fd, fcntl.LOCK_UN)  # the client resumes and lets go
        got = reap_in_thread(slots, sidecar_fd, req, resp, (), held=lambda i: i == 0)
        assert got == Reap(ReapOutcome.REAPED, 3)
        assert slots["state"].tolist() == [S_BUSY] + [S_FREE] * 4
        assert slots["owner_pid"].tolist() == [111, 0, 0, 0, 0]
        assert slots["owner_start"].tolist() == [7, 0, 0, 0, 0]
        assert [s.value for s in req] == [1, 0, 0, 0, 1] and [s.value for s in resp] == [2, 0, 0, 0, 2]
        # and the reaper let the lock go: a client takes it without waiting
        fcntl.flock(client_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(client_fd, fcntl.LOCK_UN)
    finally:
        os.close(client_fd)
        os.close(sidecar_fd)


def test_reaper_leaves_the_claim_lock_alone_when_nothing_needs_freeing(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 64)
    sidecar_fd = os.open(path, os.O_RDWR)
    client_fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(client_fd, fcntl.LOCK_EX)
        slots = slots_of([111, 222, 0], [S_FREE, S_POSTED, S_FREE])  # live owners, a free slot
        sems = [CountingSem(0) for _ in range(3)]
        got = reap_in_thread(slots, sidecar_fd, sems, sems, (), held=lambda i: True)
        assert got == Reap(ReapOutcome.IDLE, 0)
        # a dead owner's slot in a batch in flight waits for its answer, lock or not
        got = reap_in_thread(slots, sidecar_fd, sems, sems, {1}, held=lambda i: i == 0)
        assert got == Reap(ReapOutcome.IDLE, 0)
    finally:
        os.close(client_fd)
        os.close(sidecar_fd)


def test_reaper_decides_again_under_the_lock(tmp_path):
    """A slot that looked dead before the lock was taken (its byte not held) but is held when
    looked at under the lock is left alone: the lease fields and bytes seen under the lock decide."""
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 64)
    fd = os.open(path, os.O_RDWR)
    try:
        slots = slots_of([222, 333], [S_FREE, S_FREE])
        looks: dict[int, int] = {}

        def held(i: int) -> bool:
            looks[i] = looks.get(i, 0) + 1
            return i == 0 and looks[i] > 1  # slot 0: taken between the two looks

        sems = [CountingSem(0) for _ in range(2)]
        got = reap_dead_owners(slots, fd, sems, sems, (), held=held)
        assert got == Reap(ReapOutcome.REAPED, 1)
        assert slots["owner_pid"].tolist() == [222, 0] and looks == {0: 2, 1: 2}
    finally:
        os.close(fd)
