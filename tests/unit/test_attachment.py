"""The attachment module (clients/_attach.py) beyond the attach loop (tests/unit/test_client_rules.py):
detaching (leases given back or left to the reaper), the geometry check, the pool's patient
re-attach (backoff before every attempt, slots held by others waited out), the two drivers of the
generators, and the blocking client breaking for good on another geometry. On the fake transport,
with a fake clock where time matters."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from kalos.broker.errors import BrokerUnavailable, ProtocolError, SlotsExhausted
from kalos.broker.layout import Layout
from kalos.clients._attach import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    Attacher,
    Attachment,
    drive,
    drive_async,
    geometry_error,
)
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=4, dim=8, max_k=8, max_queries=4, blob_bytes=1024)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(steps, clock: Clock):
    """Drive an attach generator on the fake clock; returns (value, pauses)."""
    pauses = []
    try:
        while True:
            pause = next(steps)
            pauses.append(pause)
            clock.now += pause
    except StopIteration as done:
        return done.value, pauses


def test_end_gives_idle_slots_back_and_leaves_busy_ones_to_the_reaper():
    conn = FakeConnection(LAY)
    slots = conn.lease(3)
    Attachment(conn, slots).end([slots[1]])
    assert conn.seg.slots["owner_pid"].tolist() == [0, -1, 0, 0]  # -1: the fake's abandoned
    assert conn.closed
    gone = FakeConnection(LAY)
    held = gone.lease(2)
    Attachment(gone, held).end(held, give_back=False)  # the sidecar is gone: nothing to give
    assert gone.seg.slots["owner_pid"].tolist() == [1, 1, 0, 0] and gone.closed

    class Vanished(FakeConnection):
        def give_back(self, idle, busy) -> None:
            raise BrokerUnavailable("its objects went away")

    v = Vanished(LAY)
    Attachment(v, v.lease(1)).end()  # not an error: the leases went with the sidecar
    assert v.closed


@pytest.mark.parametrize("field", ["dim", "max_k", "max_queries", "blob_bytes"])
def test_another_geometry_is_a_protocol_error_naming_old_and_new(field):
    assert (
        geometry_error("b", LAY, Layout(n_slots=9, dim=8, max_k=8, max_queries=4, blob_bytes=1024), "the pool") is None
    )
    changed = {"n_slots": 4, "dim": 8, "max_k": 8, "max_queries": 4, "blob_bytes": 1024}
    changed[field] *= 2
    new = Layout(**changed)
    err = geometry_error("b", LAY, new, "the client")
    assert isinstance(err, ProtocolError)
    msg = str(err)
    assert "'b' came back with another geometry" in msg and msg.endswith("reopen the client")
    short = "blob" if field == "blob_bytes" else field
    assert f"{short} {changed[field]}" in msg and f"{short} {changed[field] // 2}" in msg


def test_a_pool_reattaches_patiently_with_a_backoff_before_every_attempt(seed):
    """No sidecar for three attempts, then one whose slots live processes hold, then free
    slots: every pause is a jittered backoff within its bounds, the first one comes before the
    first attempt, and the attachment comes back leased."""
    clock = Clock()
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"] = [7, 7, 7, 7]  # held by others: SlotsExhausted
    tries: list[str] = []

    def connect(name, uid):
        tries.append("absent" if len(tries) < 3 else "present")
        if len(tries) <= 3:
            raise BrokerUnavailable(f"no sidecar serves broker {name!r}")
        if len(tries) == 5:
            conn.seg.slots["owner_pid"] = [7, 7, 0, 0]  # two came free
        return conn

    a = Attacher(connect, "b", None, size=2, min_size=1, for_pool=True, rng=random.Random(seed), clock=clock)
    steps = a.reattach(LAY)
    assert next(steps) > 0 and tries == []  # a pause first: no stampede on a starting sidecar
    att, pauses = run(steps, clock)
    assert tries == ["absent"] * 3 + ["present"] * 2
    assert all(BACKOFF_MIN_S / 2 <= p <= BACKOFF_MAX_S for p in pauses), pauses
    assert att.conn is conn and sorted(s.index for s in att.slots) == [2, 3]


def test_a_reattach_to_another_geometry_gives_the_new_leases_back():
    other = FakeConnection(Layout(n_slots=4, dim=16, max_k=8, max_queries=4, blob_bytes=1024))
    a = Attacher(
        lambda name, uid: other, "b", None, size=2, min_size=1, for_pool=True, rng=random.Random(1), clock=Clock()
    )
    with pytest.raises(ProtocolError, match="dim 16.*was dim 8.*reopen the pool"):
        run(a.reattach(LAY), Clock())
    assert other.closed and other.seg.slots["owner_pid"].tolist() == [0, 0, 0, 0]
    same = FakeConnection(LAY)
    b = Attacher(
        lambda name, uid: same, "b", None, size=1, min_size=1, for_pool=False, rng=random.Random(1), clock=Clock()
    )
    att, _ = run(b.attach(None, True, ""), Clock())
    assert b.check_geometry(att, LAY) is att and not same.closed


def test_slots_held_by_others_fail_a_blocking_attach_at_once():
    """Only the pool's re-attach waits for slots held by live processes; a call's attach fails
    with SlotsExhausted (its budget is the caller's)."""
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"] = [7, 7, 7, 7]
    a = Attacher(
        lambda name, uid: conn, "b", None, size=1, min_size=1, for_pool=False, rng=random.Random(1), clock=Clock()
    )
    with pytest.raises(SlotsExhausted, match="a RecallClient needs one"):
        run(a.attach(Clock().now + 5, True, "within 5 s"), Clock())


def pauses_then(value: object, log: list[str]):
    try:
        yield 0.001
        yield 0.002
        return value
    finally:
        log.append("closed")


def test_drive_sleeps_the_pauses_and_returns_the_value():
    log: list[str] = []
    assert drive(pauses_then("att", log)) == "att" and log == ["closed"]


@pytest.mark.asyncio
async def test_drive_async_awaits_the_pauses_and_closes_a_cancelled_attach():
    log: list[str] = []
    assert await drive_async(pauses_then("att", log)) == "att" and log == ["closed"]

    def forever():
        try:
            while True:
                yield 10.0
        finally:
            log.append("half-made attachment closed")

    task = asyncio.ensure_future(drive_async(forever()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log[-1] == "half-made attachment closed"


def test_a_blocking_client_breaks_for_good_on_another_geometry():
    """The blocking driver: its sidecar dies under a read, the next sidecar has another dim: the
    read fails with ProtocolError and so does every later call (the same error), the new
    sidecar's slot given back."""
    from kalos.clients import RecallClient

    first = FakeConnection(LAY)
    other = FakeConnection(Layout(n_slots=4, dim=16, max_k=8, max_queries=4, blob_bytes=1024))
    sidecars = [first]
    c = RecallClient("fake", connect=lambda name, uid: sidecars[-1], timeout=5)
    first.alive = False
    sidecars.append(other)
    with pytest.raises(ProtocolError, match="another geometry .* reopen the client") as e:
        c.recall(np.ones(8, np.float32), k=2)
    with pytest.raises(ProtocolError) as again:
        c.recall(np.ones(8, np.float32), k=2)
    assert again.value is e.value
    assert other.closed and other.seg.slots["owner_pid"].tolist() == [0, 0, 0, 0]
    c.close()
