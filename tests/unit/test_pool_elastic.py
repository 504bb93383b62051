"""Issue 33 item 2: elastic leases. The decisions (:class:`kalos.clients.pool.LeasePlan`) as pure
functions, then the pool on the fake transport (clients.fake): it opens with ``min_size`` slots,
grows while callers wait and the broker has slots free, queues (never fails) when it has none,
asks again while callers wait, gives idle slots back, cedes grown ones to a process waiting for
its first, and waits within ``connect_timeout`` for a first slot. Answers are checked against a
float64 reference. tests/ipc/test_capacity.py has the same with real processes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk as topk_answer

from kalos.broker.errors import SlotsExhausted
from kalos.broker.layout import Layout
from kalos.clients import RecallPool
from kalos.clients._leaseplan import GROW_RETRY_S, IDLE_S, TICK_S, LeasePlan
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=6, dim=8, max_k=8, max_queries=2, blob_bytes=1024)
OTHER = 7  # the pid of "another process" holding slots in the fake segment


# --------------------------------------------------------------------------- the decisions
def test_grow_leases_one_slot_per_waiting_caller_within_size():
    plan = LeasePlan(size=16, min_size=1, idle_s=IDLE_S)
    assert plan.grow(leased=1, waiting=1, now=0.0) == 1
    assert plan.grow(leased=1, waiting=5, now=0.0) == 5
    assert plan.grow(leased=14, waiting=5, now=0.0) == 2  # up to size
    assert plan.grow(leased=16, waiting=5, now=0.0) == 0
    assert plan.grow(leased=3, waiting=0, now=0.0) == 0


def test_after_a_refusal_the_plan_waits_before_asking_again():
    plan = LeasePlan(size=16, min_size=1, idle_s=IDLE_S)
    plan.refused(now=10.0)
    assert plan.grow(leased=1, waiting=3, now=10.0) == 0
    assert plan.grow(leased=1, waiting=3, now=10.0 + GROW_RETRY_S / 2) == 0
    assert plan.grow(leased=1, waiting=3, now=10.0 + GROW_RETRY_S) == 3


def test_while_ceding_the_pool_does_not_grow_and_returns_every_free_grown_slot():
    plan = LeasePlan(size=16, min_size=2, idle_s=IDLE_S, ceding=True)
    assert plan.grow(leased=2, waiting=4, now=0.0) == 0
    plan.start(now=0.0)
    # within the idle period, whatever was idle: every free slot beyond min_size goes
    assert plan.to_return(leased=10, free=3, idle=0, now=0.1) == 3
    assert plan.to_return(leased=10, free=9, idle=0, now=0.1) == 8  # min_size stays
    assert plan.to_return(leased=2, free=2, idle=2, now=0.1) == 0
    plan.ceding = False
    assert plan.grow(leased=2, waiting=4, now=0.0) == 4


def test_under_contention_no_pool_holds_more_than_its_fair_share():
    """Another pool's callers wait for slots the broker could not give: ``share`` is set (the
    broker's slots over the processes holding some); slots above it go back as they free up,
    and the pool grows no further than it. Without contention: up to size again."""
    plan = LeasePlan(size=16, min_size=1, idle_s=IDLE_S, share=64 // 32)
    plan.start(now=0.0)
    assert plan.cap() == 2
    assert plan.grow(leased=1, waiting=10, now=0.0) == 1  # up to the share
    assert plan.grow(leased=2, waiting=10, now=0.0) == 0
    assert plan.to_return(leased=16, free=5, idle=0, now=0.1) == 5  # as they free up ...
    assert plan.to_return(leased=11, free=11, idle=0, now=0.1) == 9  # ... down to the share
    assert plan.to_return(leased=2, free=2, idle=0, now=0.1) == 0
    plan.share = 0  # more processes than slots: min_size still holds
    assert plan.cap() == 1 and plan.to_return(leased=3, free=3, idle=0, now=0.1) == 2
    big = LeasePlan(size=4, min_size=3, idle_s=IDLE_S, share=2)
    assert big.cap() == 3  # never below min_size, never above size
    plan.share = None
    assert plan.cap() == 16 and plan.grow(leased=2, waiting=10, now=0.0) == 10


def test_idle_slots_go_back_at_the_end_of_each_period_down_to_min_size():
    plan = LeasePlan(size=16, min_size=2, idle_s=3.0)
    plan.start(now=100.0)
    assert plan.to_return(leased=8, free=6, idle=6, now=102.9) == 0  # the period is not over
    assert plan.to_return(leased=8, free=6, idle=4, now=103.0) == 4  # unused the whole period
    assert plan.period_end == pytest.approx(106.0)  # a new period began
    assert plan.to_return(leased=4, free=4, idle=4, now=104.0) == 0
    assert plan.to_return(leased=4, free=4, idle=4, now=106.0) == 2  # down to min_size
    assert plan.to_return(leased=2, free=2, idle=2, now=200.0) == 0
    assert plan.to_return(leased=8, free=0, idle=0, now=300.0) == 0  # busy: nothing was idle


# --------------------------------------------------------------------------- on the fake
async def serve_until(conn: FakeConnection, answer, done) -> None:
    while not done():
        conn.serve(answer)
        await asyncio.sleep(0.0005)


def leased(conn: FakeConnection) -> int:
    return int((conn.seg.slots["owner_pid"] == conn.pid).sum())


@pytest.mark.asyncio
async def test_a_pool_opens_with_min_size_and_grows_while_callers_wait(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await RecallPool("fake", size=4, connect=lambda n, u: conn, spin_us=50).open()
    st = pool.statistics()
    assert (st.size, st.min_size, st.max_size, leased(conn)) == (1, 1, 4, 1)
    qs = rng.standard_normal((4, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=5, timeout=5)) for q in qs]
    for _ in range(200):
        await asyncio.sleep(0.001)
        if len(conn.posted()) == 4:
            break
    assert len(conn.posted()) == 4  # one slot per waiting caller, all four sent at once
    assert pool.statistics().size == 4 and leased(conn) == 4
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    for q, c in zip(qs, calls):
        h = c.result()
        assert_topk(q, matrix, h.ids, h.scores, 5)
    # More callers than size: they queue for the pool's slots, none fails, none grows past 4.
    qs = rng.standard_normal((12, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3, timeout=5)) for q in qs]
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    for q, c in zip(qs, calls):
        assert_topk(q, matrix, c.result().ids, c.result().scores, 3)
    st = pool.statistics()
    assert (st.size, st.grown, st.refused, st.errors) == (4, 3, 0, 0)
    await pool.close()
    assert leased(conn) == 0


@pytest.mark.asyncio
async def test_with_no_slot_to_spare_callers_queue_then_the_pool_grows_when_slots_free_up(rng):
    """Other processes hold every other slot: callers queue for the pool's one slot (no error);
    when slots free up while callers still wait, the pool leases them without a new call."""
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"][1:] = OTHER
    pool = await RecallPool("fake", size=4, connect=lambda n, u: conn, spin_us=50).open()
    qs = rng.standard_normal((6, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3, timeout=10)) for q in qs]
    await asyncio.sleep(0.05)
    assert len(conn.posted()) == 1 and pool.statistics().refused >= 1
    conn.seg.slots["owner_pid"][1:] = 0  # the other process gave its slots back
    await asyncio.sleep(GROW_RETRY_S * 4)
    assert len(conn.posted()) == 4, "the pool did not lease the slots that came free"
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    for q, c in zip(qs, calls):
        assert_topk(q, matrix, c.result().ids, c.result().scores, 3)
    assert pool.statistics().errors == 0
    await pool.close()


@pytest.mark.asyncio
async def test_the_coalescing_queue_grows_the_pool_too(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await RecallPool("fake", size=3, connect=lambda n, u: conn, spin_us=50, coalesce=True).open()
    qs = rng.standard_normal((7, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3, timeout=5)) for q in qs]
    await asyncio.sleep(0.02)
    assert len(conn.posted()) == 3  # one alone, then the queue in slots of max_queries (2) rows
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    for q, c in zip(qs, calls):
        assert_topk(q, matrix, c.result().ids, c.result().scores, 3)
    assert pool.statistics().size == 3
    await pool.close()


@pytest.mark.asyncio
async def test_idle_slots_go_back_down_to_min_size_busy_ones_stay(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    idle_s = 0.3
    pool = await RecallPool("fake", size=5, min_size=2, idle_s=idle_s, connect=lambda n, u: conn, spin_us=50).open()
    assert leased(conn) == 2
    q = np.ones(8, np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(5)]
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    assert leased(conn) == 5
    # Busy: one caller after another keeps two slots in use; the three others go idle and back.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * idle_s + 2 * TICK_S:
        pair = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(2)]
        await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in pair))
    st = pool.statistics()
    assert st.size == leased(conn) == 2 and st.returned == 3, st
    # Idle: never below min_size.
    await asyncio.sleep(2 * idle_s + 2 * TICK_S)
    assert pool.statistics().size == leased(conn) == 2
    await pool.close()


@pytest.mark.asyncio
async def test_grown_slots_are_ceded_as_they_free_up_while_a_process_waits_for_its_first(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    waiting = [False]
    conn.pressure = lambda: (waiting[0], False)  # type: ignore[method-assign]  # (the lease file's want byte)
    pool = await RecallPool("fake", size=4, idle_s=60, connect=lambda n, u: conn, spin_us=50).open()
    q = np.ones(8, np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(4)]
    await asyncio.sleep(0.02)
    assert leased(conn) == 4 and len(conn.posted()) == 4
    waiting[0] = True
    await asyncio.sleep(TICK_S * 2)  # the pool looks, and cedes as its slots free up
    more = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(4)]
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls + more))
    for c in calls + more:
        assert_topk(q, matrix, c.result().ids, c.result().scores, 2)
    st = pool.statistics()
    assert st.size == leased(conn) == 1 and st.returned == 3 and st.errors == 0, st
    waiting[0] = False
    await asyncio.sleep(TICK_S * 2)
    calls = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(3)]
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    assert pool.statistics().size == 3  # grows again once nobody waits
    await pool.close()


@pytest.mark.asyncio
async def test_open_waits_for_a_first_slot_within_connect_timeout_then_names_slots():
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"] = OTHER
    t0 = time.monotonic()
    with pytest.raises(SlotsExhausted) as e:
        await RecallPool("fake", connect=lambda n, u: conn, size=4, connect_timeout=0.5).open()
    took = time.monotonic() - t0
    assert 0.4 < took < 3, took
    msg = str(e.value)
    assert "has 6 slots: 6 leased by other pools" in msg and "--slots" in msg
    assert "waited within 0.5 s for other pools to give slots back" in msg

    async def give_one_back() -> None:
        await asyncio.sleep(0.3)
        conn.seg.slots["owner_pid"][4] = 0

    freer = asyncio.ensure_future(give_one_back())
    pool = await RecallPool("fake", connect=lambda n, u: conn, size=4, connect_timeout=10).open()
    await freer
    assert pool.statistics().size == 1 and int(conn.seg.slots["owner_pid"][4]) == conn.pid
    await pool.close()


@pytest.mark.asyncio
async def test_a_pool_over_its_fair_share_gives_slots_back_while_another_pool_waits(rng):
    """Two pools of one fake broker (6 slots): the first grows to 5 while alone; then the
    second's callers wait for slots the broker cannot give (it announces the want, here through
    ``pressure``): the first gives back what it holds beyond its share (6 over 2 holders: 3) as
    its slots free up, the second grows into them, every answer is correct."""
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn_a, conn_b = FakeConnection(LAY), FakeConnection(LAY)
    conn_b.mm, conn_b.seg, conn_b.w32, conn_b.w64 = conn_a.mm, conn_a.seg, conn_a.w32, conn_a.w64  # one segment
    conn_b.req, conn_b.resp, conn_b.pid = conn_a.req, conn_a.resp, 2  # another process
    wanting = [False]
    conn_a.pressure = lambda: (False, wanting[0])  # type: ignore[method-assign]
    a = await RecallPool("fake", size=6, idle_s=60, connect=lambda n, u: conn_a, spin_us=50).open()
    b = await RecallPool("fake", size=6, idle_s=60, connect=lambda n, u: conn_b, spin_us=50).open()
    q = np.ones(8, np.float32)
    first = [asyncio.ensure_future(a.recall(q, k=2, timeout=10)) for _ in range(5)]
    await asyncio.sleep(0.02)
    assert a.statistics().size == 5 and b.statistics().size == 1
    calls = [asyncio.ensure_future(b.recall(q, k=2, timeout=10)) for _ in range(4)]
    await asyncio.sleep(0.02)
    assert b.statistics().refused >= 1 and b._leases._want is None  # (no lease file on the fake)
    wanting[0] = True
    await asyncio.sleep(TICK_S * 2)  # a looks: contended; nothing of it is free yet
    assert a.statistics().size == 5
    mine = [int(i) for i in np.flatnonzero(conn_a.seg.slots["owner_pid"] == conn_a.pid)]
    assert conn_a.serve(topk_answer(matrix), slots=mine) == 5  # a's answers come in ...
    await asyncio.sleep(GROW_RETRY_S * 4)  # ... its freed slots go back, b's waiting callers lease them
    assert a.statistics().size == 3 and a.statistics().returned == 2, a.statistics()
    assert b.statistics().size == 3 and b.statistics().grown == 2, b.statistics()
    more = [asyncio.ensure_future(a.recall(q, k=2, timeout=10)) for _ in range(5)]
    await serve_until(conn_a, topk_answer(matrix), lambda: all(c.done() for c in first + calls + more))
    for c in first + calls + more:
        assert_topk(q, matrix, c.result().ids, c.result().scores, 2)
    assert a.statistics().size == 3  # no growth past the share while contended
    assert b.statistics().errors == 0
    await a.close()
    await b.close()


# --------------------------------------------------------------------------- the waiter thread
class _BlockingSlot:
    """A slot whose response wait blocks until released (what a slow answer looks like to the
    waiter thread): ``entered`` is set while the thread is inside the wait."""

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.go = threading.Event()

    def wait_no_consume(self, timeout: float) -> bool:
        self.entered.set()
        self.go.wait(5)
        return False


@pytest.mark.asyncio
async def test_the_waiter_holds_a_slot_while_inside_a_wait_on_it_even_after_disarm():
    """A wait outlives disarm by up to its timeout; while it lasts, the slot must not be given
    back (another process could lease it, and this thread would take that process's answer)."""
    from kalos.clients._waiter import Waiter

    loop = asyncio.get_running_loop()
    w = Waiter(loop, lambda: None, lambda e: None)
    slot = _BlockingSlot()
    try:
        assert not w.holds(slot)  # type: ignore[arg-type]
        w.arm(slot)  # type: ignore[arg-type]
        assert w.holds(slot)  # type: ignore[arg-type]
        assert slot.entered.wait(5)
        w.disarm()
        assert w.holds(slot)  # type: ignore[arg-type]  # still inside the wait
        slot.go.set()
        for _ in range(500):
            if not w.holds(slot):  # type: ignore[arg-type]
                break
            await asyncio.sleep(0.002)
        assert not w.holds(slot)  # type: ignore[arg-type]
    finally:
        slot.go.set()
        w.close()


@pytest.mark.asyncio
async def test_a_slot_the_waiter_holds_is_not_given_back_until_the_wait_is_over(rng):
    """The CI hang of stop 33 (tests/ipc/test_capacity.py, 32 processes): a pool gave back a slot
    its waiter thread was still waiting on; another process leased it and lost its answer to
    that thread. A give-back now skips such a slot (it stays on the free stack) and takes it
    once the thread is out of the wait."""
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await RecallPool("fake", size=3, connect=lambda n, u: conn, spin_us=50).open()
    qs = rng.standard_normal((3, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3, timeout=5)) for q in qs]
    await serve_until(conn, topk_answer(matrix), lambda: all(c.done() for c in calls))
    for q, c in zip(qs, calls):
        assert_topk(q, matrix, c.result().ids, c.result().scores, 3)
    assert leased(conn) == 3
    waiter, free = pool._leases.waiter, pool._free
    assert waiter is not None and free is not None
    x, y = free.take_oldest(2)
    waiter.arm(x)  # (its response is never posted: the thread waits on it, 50 ms at a time)
    assert pool._leases.give_back([x, y]) is True  # y went back; x stays, on the free stack
    assert leased(conn) == 2 and x in pool._leases.slots and y not in pool._leases.slots
    assert int(conn.seg.slots[x.index]["owner_pid"]) == conn.pid
    waiter.disarm()
    for _ in range(500):
        if not waiter.holds(x):
            break
        await asyncio.sleep(0.002)
    taken = free.take_oldest(free.qsize())
    assert x in taken
    for s in taken:
        if s is not x:
            free.put_nowait(s)
    assert pool._leases.give_back([x]) is True and leased(conn) == 1 and x not in pool._leases.slots
    # The pool still serves from what it kept.
    call = asyncio.ensure_future(pool.recall(qs[0], k=3, timeout=5))
    await serve_until(conn, topk_answer(matrix), call.done)
    assert_topk(qs[0], matrix, call.result().ids, call.result().scores, 3)
    await pool.close()
    assert leased(conn) == 0
