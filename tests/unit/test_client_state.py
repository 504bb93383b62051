"""The client's pure state, without an event loop: the free-slot stack and its line of callers
(clients/_freestack.py), the coalescing queue's backlog (clients/_backlog.py), the words of a
caller's timeout (clients/_refusals.py) and the statistics snapshot (clients/_core.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kalos.broker.errors import AcquireTimeout, BrokerUnavailable, ResponseTimeout
from kalos.broker.layout import Layout
from kalos.broker.positions import ORIGIN
from kalos.clients import _refusals, _requests
from kalos.clients._backlog import Backlog, coalescible
from kalos.clients._coalesce import Key
from kalos.clients._core import ClientCore, Life, SlotCounts
from kalos.clients._freestack import FreeStack
from kalos.clients._life import PoolState

LAY = Layout(n_slots=4, dim=8, max_k=16, max_queries=4, blob_bytes=1024)


@dataclass(eq=False)
class Caller:
    """A waiter in line (what the asyncio driver's future is to the stack)."""

    is_done: bool = False

    def done(self) -> bool:
        return self.is_done


def test_the_stack_is_lifo_and_the_line_fifo():
    st: FreeStack[str, Caller] = FreeStack()
    assert st.take() is None and len(st) == 0
    st.release("a")
    st.release("b")
    assert st.take() == "b" and st.take() == "a"  # the last released first
    first, second = Caller(), Caller()
    st.join(first)
    st.join(second)
    assert st.waiting() == 2
    assert st.release("c") is first and st.release("d") is second  # in arrival order
    assert len(st) == 0 and not st.line


def test_a_released_slot_skips_callers_that_went_away():
    st: FreeStack[str, Caller] = FreeStack()
    gone, waiting = Caller(is_done=True), Caller()
    st.join(gone)
    st.join(waiting)
    assert st.waiting() == 1
    assert st.release("a") is waiting
    gone_too = Caller(is_done=True)
    st.join(gone_too)
    assert st.release("b") is None and st.take() == "b"  # nobody left: onto the stack


def test_leaving_the_line_and_failing_it():
    st: FreeStack[str, Caller] = FreeStack()
    a, b, c = Caller(), Caller(is_done=True), Caller()
    for w in (a, b, c):
        st.join(w)
    st.leave(a)
    st.leave(a)  # (twice is fine)
    assert st.fail_all() == [c] and not st.line


def test_stale_slots_are_dropped_and_the_low_water_mark_follows_the_bottom():
    st: FreeStack[str, Caller] = FreeStack()
    for s in "abcd":
        st.release(s)
    st.reset_low()
    assert st.low == 4
    assert st.take_live({"a", "b"}) == "b"  # d and c belong to an attachment that is gone
    assert st.low == 1 and len(st) == 1
    st.release("e")
    assert st.take_oldest(1) == ["a"] and st.low == 1 and st.slots == ["e"]
    st.drain()
    assert len(st) == 0 and st.take() is None


@dataclass(eq=False)
class Queued:
    """A queued recall (what the asyncio queue's member is to the backlog)."""

    key: Key | None
    rows: int
    sent: bool = False
    resent: bool = False
    left: bool = False

    def gone(self) -> bool:
        return self.left


def recall(k: int = 5, after: bool = False) -> _requests.Prepared:
    p = _requests.recall(LAY, np.ones(LAY.dim, np.float32), k, b"ns", False, _requests.ONE)
    if after:
        p.after = ORIGIN
    return p


def test_keys_are_cached_for_unfiltered_recalls_and_none_for_positions():
    bl: Backlog[Queued] = Backlog(LAY.max_queries, LAY.max_k)
    a, b = recall(5), recall(7)
    assert bl.key_of(a) is bl.key_of(recall(5))  # cached: one object per namespace, flags and k
    assert bl.key_of(a) == bl.key_of(b)  # k 5 and 7: one k class (8)
    assert bl.key_of(recall(9)) != bl.key_of(a)
    assert bl.key_of(recall(5, after=True)) is None  # a fleet position goes alone
    assert coalescible(a) and not coalescible(recall(5, after=True))


def test_groups_come_out_oldest_first_and_fit_the_slot():
    bl: Backlog[Queued] = Backlog(4, 16)
    x, y = Key(b"a", 0, b"", 8), Key(b"b", 0, b"", 8)
    q = [Queued(x, 1), Queued(y, 1), Queued(x, 3), Queued(x, 2)]
    for e in q:
        bl.join(e)
    assert bl.pending() and len(bl) == 4
    assert bl.next_group() == [q[0], q[2]]  # 1 + 3 rows fill the slot; q[3] waits
    assert bl.next_group() == [q[1]]
    assert bl.next_group() == [q[3]] and not bl.pending()


def test_callers_that_went_away_are_dropped_and_the_line_left_with_none_left():
    bl: Backlog[Queued] = Backlog(4, 16)
    a, b = Queued(None, 1), Queued(None, 1)
    bl.join(a)
    bl.join(b)
    b.left = True
    assert bl.live() == [a] and len(bl) == 2
    assert bl.pending() and len(bl) == 1  # b dropped
    assert bl.leave(a) is True and not bl.pending()
    c, d = Queued(None, 1), Queued(None, 1)
    bl.join(c)
    bl.join(d)
    assert bl.leave(c) is False  # d still waits: keep the place in line


def test_an_overflowed_group_goes_again_alone_first_in_line():
    bl: Backlog[Queued] = Backlog(4, 16)
    key = Key(b"a", 0, b"", 8)
    later = Queued(key, 1)
    bl.join(later)
    shared = [Queued(key, 1, sent=True), Queued(key, 1, sent=True, left=True)]
    assert bl.again(shared) is True
    assert bl.entries == [shared[0], later]
    assert shared[0].key is None and shared[0].resent and not shared[0].sent
    assert bl.next_group() == [shared[0]]  # alone, though its old key matches
    assert bl.again([Queued(key, 1, left=True)]) is False
    assert bl.clear() == [later] and len(bl) == 0


def test_what_a_caller_whose_budget_ran_out_gets():
    assert isinstance(_refusals.down("x", 1_500_000_000), BrokerUnavailable)
    assert "down for 1.50 s" in str(_refusals.down("x", 1_500_000_000))
    assert "4 slots leased" in str(_refusals.no_slot(4, 8)) and isinstance(_refusals.no_slot(4, 8), AcquireTimeout)
    assert isinstance(_refusals.not_sent(False, 1.0, 4, 0), AcquireTimeout)
    assert isinstance(_refusals.not_sent(True, 1.0, 4, 0), ResponseTimeout)
    assert "within 0.5 s" in str(_refusals.unanswered(0.5))


def test_statistics_combine_the_slots_with_the_cores_tallies():
    core: ClientCore[None] = ClientCore(Life(1))
    core.life.open()
    core.tally.answered(3, True, True)
    core.tally.answered(1, False, False)
    core.outage(True, True, now_ns=1_000)  # down since 1 us
    st = core.statistics(
        3_000_000_001,
        SlotCounts(size=3, free=2, min_size=1, max_size=8, grown=2, returned=0, refused=1),
        orphaned=0,
        attached=False,
        queued=0,
        slot_path="python",
    )
    assert (st.size, st.free, st.max_size, st.grown, st.refused) == (3, 2, 8, 2, 1)
    assert (st.requests, st.errors, st.coalesced, st.outages) == (4, 1, 3, 1)
    assert st.unavailable_s == pytest.approx(3.0)


@pytest.mark.parametrize("state", list(PoolState))
def test_queued_calls_go_on_while_the_pool_serves(state):
    life = Life(1, state=state)
    if state in (PoolState.OPEN, PoolState.CLOSING):
        assert life.queue_refusal(1) is None  # closing: what is queued is still sent
    else:
        assert life.queue_refusal(1) is not None
