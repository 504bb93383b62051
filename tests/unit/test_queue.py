"""The coalescing queue (clients/_queue.py) on its own, driven through plain functions in place
of a pool: free slots in a list, posting through the real exchange into the fake transport, the
test completing the posted exchanges as the pool's poller would. Answers are checked against a
float64 reference; the pool's own coalescing behaviour is tests/unit/test_coalesce.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk

from kalos.broker.errors import BrokerUnavailable, ClosedError, KalosError, ResponseTimeout
from kalos.broker.layout import Layout
from kalos.clients import _requests
from kalos.clients._exchange import Completion, Exchange
from kalos.clients._queue import CoalescingQueue, NotSent, Waiting
from kalos.clients._slots import ClientSlot
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=4, dim=8, max_k=16, max_queries=4, blob_bytes=1024)
pytestmark = pytest.mark.asyncio


class Pool:
    """What a pool gives its queue (``_queue.Host``), as plain lists."""

    def __init__(self, conn: FakeConnection, free: int) -> None:
        self.conn = conn
        self.slots = conn.lease(LAY.n_slots)
        self.free: list[ClientSlot] = self.slots[:free]
        self.line: list[asyncio.Future[ClientSlot]] = []
        self.posted: list[Exchange[Waiting]] = []
        self.refuse: KalosError | None = None
        self.post_error: BaseException | None = None
        self.bugs: list[Exception] = []
        self.queue = CoalescingQueue(asyncio.get_running_loop(), self, max_rows=LAY.max_queries, max_k=LAY.max_k)

    def take_slot(self) -> ClientSlot | None:
        return self.free.pop() if self.free else None

    def release(self, slot: ClientSlot) -> None:
        self.free.append(slot)

    def wait_for_slot(self, fut: asyncio.Future[ClientSlot]) -> None:
        self.line.append(fut)

    def usable(self, slot: ClientSlot) -> bool:
        return slot in self.slots

    def refusal(self) -> KalosError | None:
        return self.refuse

    def on_bug(self, error: Exception) -> None:
        self.bugs.append(error)

    def withdraw(self, fut: asyncio.Future[ClientSlot]) -> None:
        if fut in self.line:
            self.line.remove(fut)
        if fut.done() and not fut.cancelled():
            self.free.append(fut.result())
        fut.cancel()

    def post(self, ex: Exchange[Waiting]) -> None:
        if self.post_error is not None:
            self.free.append(ex.slot)
            raise self.post_error
        ex.send()
        self.posted.append(ex)

    def complete(self) -> list[Completion]:
        """Play the pool's poller: every posted exchange that is answered, completed, its
        callers resolved, its slot freed."""
        done = []
        for ex in list(self.posted):
            if not ex.slot.answered():
                continue
            self.posted.remove(ex)
            members = ex.waiter if isinstance(ex.waiter, list) else None
            futs = [ex.waiter] if members is None else [m.future for m in members]
            completion, value, error, _ = ex.complete([f.done() for f in futs])
            self.free.append(ex.slot)
            done.append(completion)
            if completion is Completion.RESEND_ALONE:
                assert members is not None
                self.queue.again(members)
                continue
            values = [value] if members is None else value
            for f, v in zip(futs, values):
                if not f.done():
                    if error is None:
                        f.set_result(v)
                    else:
                        f.set_exception(error)
        return done


def recall(q: np.ndarray, k: int, single: bool = True) -> _requests.Prepared:
    return _requests.recall(LAY, q, k, b"ns", False, (_requests.ONE if single else _requests.ROWS))


async def turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_queued_recalls_go_out_at_the_end_of_the_turn_packed_by_key(rng):
    matrix = rng.standard_normal((50, 8)).astype(np.float32)
    pool = Pool(FakeConnection(LAY), free=2)
    qs = rng.standard_normal((6, 8)).astype(np.float32)
    ks = [3, 4, 9, 2, 4, 3]  # k classes 4, 4, 16, 2, 4, 4
    calls = [asyncio.ensure_future(pool.queue.submit(recall(q, k), 1, None, None)) for q, k in zip(qs, ks)]
    many = rng.standard_normal((2, 8)).astype(np.float32)
    calls.append(asyncio.ensure_future(pool.queue.submit(recall(many, 4, False), 1, None, None)))
    await asyncio.sleep(0)
    assert pool.posted == [] and len(pool.queue) == 7  # nothing goes out in the turn it came
    await turn()
    # Two slots: the oldest (k class 4) with the three later of its class (4 rows, full), then
    # the oldest left (k class 16) alone: nothing else shares its class.
    sent = [(int(ex.prep.nq), int(ex.prep.k), isinstance(ex.waiter, list)) for ex in pool.posted]
    assert sent == [(4, 4, True), (1, 9, False)], sent
    assert pool.queue.live() == 2 and pool.line  # k class 2 and the recall_many wait in line
    pool.conn.serve(topk(matrix))
    assert pool.complete() == [Completion.ANSWERED] * 2
    await turn()  # the slots freed went to ... the pool (this test's list); a kick sends the rest
    pool.line.pop().set_result(pool.free.pop())
    await turn()
    while any(not c.done() for c in calls):
        pool.conn.serve(topk(matrix))
        pool.complete()
        await turn()
    for q, k, c in zip(qs, ks, calls):
        h = c.result()
        assert_topk(q, matrix, h.ids, h.scores, k)
    for q, h in zip(many, calls[-1].result()):
        assert_topk(q, matrix, h.ids, h.scores, 4)
    assert pool.queue.live() == 0 and not pool.line and not pool.bugs


async def test_a_caller_still_queued_when_its_budget_runs_out_is_not_sent():
    pool = Pool(FakeConnection(LAY), free=0)
    loop = asyncio.get_running_loop()
    t = asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, 0.02, loop.time() + 0.02))
    await turn()
    assert len(pool.line) == 1  # in line for a slot
    with pytest.raises(NotSent) as e:
        await t
    assert e.value.resent is False
    assert pool.queue.live() == 0 and not pool.line  # it left the line: nobody waits
    assert pool.posted == []


async def test_a_sent_caller_whose_budget_runs_out_gets_a_response_timeout():
    pool = Pool(FakeConnection(LAY), free=1)
    loop = asyncio.get_running_loop()
    with pytest.raises(ResponseTimeout, match="no answer within 0.05 s"):
        await pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, 0.05, loop.time() + 0.05)
    assert len(pool.posted) == 1  # still in flight: the sidecar's answer will be dropped


async def test_callers_of_an_overflowing_slot_go_again_alone_first_in_line(rng):
    matrix = rng.standard_normal((20, 8)).astype(np.float32)
    pool = Pool(FakeConnection(LAY), free=1)
    qs = rng.standard_normal((3, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.queue.submit(recall(q, 3), 1, None, None)) for q in qs]
    await turn()
    [ex] = pool.posted
    members = ex.waiter
    assert isinstance(members, list) and len(members) == 3
    calls[1].cancel()
    await asyncio.sleep(0)
    from kalos.broker.layout import Status

    pool.conn.serve(lambda v, op, k, nq: Status.PAYLOAD_TOO_LARGE)
    assert pool.complete() == [Completion.RESEND_ALONE]
    assert [m.resent and m.key is None for m in members] == [True, False, True]
    await turn()
    alone = [(int(ex.prep.nq), ex.parts) for ex in pool.posted]
    assert alone == [(1, None)], alone  # one slot: the first again, alone
    while not (calls[0].done() and calls[2].done()):
        pool.conn.serve(topk(matrix))
        pool.complete()
        await turn()
        if pool.line and pool.free:
            pool.line.pop().set_result(pool.free.pop())
    for i in (0, 2):
        h = calls[i].result()
        assert_topk(qs[i], matrix, h.ids, h.scores, 3)


async def test_a_pool_that_no_longer_serves_fails_its_queued_callers():
    pool = Pool(FakeConnection(LAY), free=0)
    calls = [
        asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, None, None)) for _ in range(3)
    ]
    await turn()
    assert len(pool.line) == 1
    pool.refuse = ClosedError("pool is closed")
    pool.line[0].set_result(pool.slots[0])  # a slot arrives; the queue finds the pool closed
    await turn()
    errors = [c.exception() for c in calls]
    assert all(isinstance(e, ClosedError) for e in errors) and len({id(e) for e in errors}) == 3
    assert pool.posted == [] and pool.free == [pool.slots[0]]  # the slot it was handed went back


async def test_a_failed_post_fails_its_group_and_the_queue_goes_on():
    pool = Pool(FakeConnection(LAY), free=2)
    pool.post_error = BrokerUnavailable("sidecar found dead before posting")
    first = [
        asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, None, None)) for _ in range(2)
    ]
    await turn()
    for c in first:
        with pytest.raises(BrokerUnavailable, match="found dead"):
            await c
    assert pool.queue.live() == 0 and len(pool.free) == 2 and not pool.bugs


async def test_an_unexpected_error_while_dispatching_is_reported_not_swallowed():
    pool = Pool(FakeConnection(LAY), free=1)
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:

        def broken() -> ClientSlot | None:
            raise RuntimeError("free stack corrupted")

        pool.take_slot = broken  # type: ignore[method-assign]  # the host fails
        t = asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, 0.05, loop.time() + 0.05))
        await turn()
        assert [type(e) for e in pool.bugs] == [RuntimeError]  # the pool would break
        assert seen and isinstance(seen[0]["exception"], RuntimeError)  # and it is logged
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
    finally:
        loop.set_exception_handler(handler)


async def test_fail_and_forget():
    pool = Pool(FakeConnection(LAY), free=0)
    calls = [
        asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, None, None)) for _ in range(2)
    ]
    await turn()
    pool.queue.fail(ClosedError("pool terminated"))
    out = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(e, ClosedError) for e in out)
    assert not pool.line and len(pool.queue) == 0
    t = asyncio.ensure_future(pool.queue.submit(recall(np.ones(8, np.float32), 2), 1, None, None))
    await turn()
    pool.queue.forget()  # a forked child's copy: nothing resolved, nothing given back
    assert len(pool.queue) == 0 and not t.done()
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)


async def test_recalls_waiting_for_a_fleet_position_are_never_packed_together(rng):
    """A shared slot carries one ``after=`` position: recalls given one go alone, each with its
    own position and deadline, even when they would share a key otherwise."""
    from kalos.broker.positions import Position

    pool = Pool(FakeConnection(LAY), free=2)
    qs = rng.standard_normal((3, 8)).astype(np.float32)
    preps = [recall(q, 4) for q in qs]
    for i, p in enumerate(preps[:2]):
        _requests.wait_after([p], Position(100 + i, 7), 0, None)
    calls = [asyncio.ensure_future(pool.queue.submit(p, 1, None, None)) for p in preps]
    await turn()
    sent = [(ex.prep.after, isinstance(ex.waiter, list)) for ex in pool.posted]
    assert sent == [(Position(100, 7), False), (Position(101, 7), False)], sent
    for c in calls:
        c.cancel()
