"""Issue 33 items 3 and 4 on the fake transport (clients.fake): every error a sidecar answers
reaches the async pool's caller as its own class, under the asyncio timeout semantics of Python
3.10 (``asyncio.TimeoutError`` a class of its own) and of 3.11+ (it *is* the builtin
``TimeoutError``, which every ``KalosTimeout`` subclasses); and closing a pool is bounded
whatever the sidecar does with a request. tests/fleet/test_fleet_pool_errors.py has the same on
a real fleet sidecar (a held read, PostgreSQL)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from fake_sidecar import topk as topk_answer

from kalos.broker.errors import (
    AcquireTimeout,
    ClosedError,
    KalosTimeout,
    PositionTimeout,
    ResponseTimeout,
    UnknownNamespace,
)
from kalos.broker.layout import OWNER_ABANDONED, Layout, Status
from kalos.broker.positions import Position
from kalos.clients import RecallClient, RecallPool
from kalos.clients._exchange import settled_within
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=3, dim=8, max_k=8, max_queries=2, blob_bytes=1024)
FAR = Position(10**12, 1)  # a fleet position no sidecar has applied


class Py310AsyncioTimeout(Exception):
    """``asyncio.TimeoutError`` as Python 3.10 has it: not the builtin TimeoutError."""


@pytest.fixture(params=["py310", "py311+"])
def timeout_semantics(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test under both relations of ``asyncio.TimeoutError`` to ``TimeoutError``:
    ``asyncio.wait_for`` raises ``asyncio.exceptions.TimeoutError``, and code catches
    ``asyncio.TimeoutError``: both are set, as the interpreter of that version has them."""
    cls = Py310AsyncioTimeout if request.param == "py310" else TimeoutError
    monkeypatch.setattr(asyncio, "TimeoutError", cls)
    monkeypatch.setattr(asyncio.exceptions, "TimeoutError", cls)
    assert issubclass(PositionTimeout, asyncio.TimeoutError) == (request.param == "py311+")
    return str(request.param)


async def open_pool(conn: FakeConnection, **kw) -> RecallPool:
    kw.setdefault("size", 3)
    return await RecallPool("fake", connect=lambda name, uid: conn, spin_us=50, **kw).open()


async def answer_soon(conn: FakeConnection, answer, n: int = 1) -> None:
    """Play the sidecar: answer the next ``n`` requests posted."""
    served = 0
    while served < n:
        served += conn.serve(answer)
        await asyncio.sleep(0.0005)


def not_applied(v, op, k, nq) -> Status:
    return Status.NOT_APPLIED


# --------------------------------------------------------------------------- item 3
@pytest.mark.asyncio
async def test_settled_within_tells_a_carried_timeout_error_from_the_budget(timeout_semantics):
    """The drivers' bounded wait: a future done with a TimeoutError of its own is settled (its
    error read from it, as itself); the budget running out is False with the future cancelled;
    cancelling the wait cancels the future."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, fut.set_exception, PositionTimeout("NOT_APPLIED: held"))
    assert await settled_within(fut, 5) is True
    with pytest.raises(PositionTimeout):
        fut.result()
    fut = loop.create_future()
    loop.call_later(0.01, fut.set_result, 7)
    assert await settled_within(fut, 5) is True and fut.result() == 7
    fut = loop.create_future()
    assert await settled_within(fut, 0.01) is False and fut.cancelled()
    fut = loop.create_future()
    waiting = asyncio.ensure_future(settled_within(fut, 5))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert fut.cancelled()


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["count", "recall", "get"])
async def test_a_sidecar_answered_position_timeout_reaches_the_pool_caller_as_itself(timeout_semantics, call):
    """The sidecar answers NOT_APPLIED (PositionTimeout, a KalosTimeout, so a TimeoutError)
    within the caller's budget: the caller gets exactly that, never ResponseTimeout. Before
    the fix, 3.11+ semantics turned it into ``ResponseTimeout: no answer within 5 s``."""
    conn = FakeConnection(LAY)
    pool = await open_pool(conn)
    calls = {
        "count": lambda: pool.count("default", after=FAR, timeout=5),
        "recall": lambda: pool.recall(np.ones(8, np.float32), k=2, after=FAR, timeout=5),
        "get": lambda: pool.get([1, 2], after=FAR, timeout=5),
    }
    server = asyncio.ensure_future(answer_soon(conn, not_applied))
    t0 = time.monotonic()
    with pytest.raises(KalosTimeout) as e:
        await calls[call]()
    await server
    assert type(e.value) is PositionTimeout, f"{type(e.value).__name__}: {e.value}"
    assert "NOT_APPLIED" in str(e.value)
    assert time.monotonic() - t0 < 4  # the sidecar's answer, not the budget running out
    await pool.close()


@pytest.mark.asyncio
async def test_a_queued_recall_gets_the_sidecar_errors_as_themselves(timeout_semantics):
    """The coalescing queue's path: recalls queued behind one in flight, answered with an error
    status, each caller gets that error's class (a timeout status included)."""
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1, coalesce=True)
    q = np.ones(8, np.float32)
    first = asyncio.ensure_future(pool.recall(q, k=2, timeout=5))
    await asyncio.sleep(0.01)
    queued = [asyncio.ensure_future(pool.recall(q, k=2, timeout=5)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert pool.statistics().queued == 3
    await answer_soon(conn, not_applied, 3)  # the first alone, then the three in two slots (max_queries 2)
    for t in [first, *queued]:
        e = await asyncio.wait_for(asyncio.gather(t, return_exceptions=True), 5)
        assert type(e[0]) is PositionTimeout, e
    server = asyncio.ensure_future(answer_soon(conn, lambda v, op, k, nq: Status.UNKNOWN_NAMESPACE))
    with pytest.raises(UnknownNamespace):
        await pool.recall(q, k=2, timeout=5)
    await server
    await pool.close()


@pytest.mark.asyncio
async def test_the_budget_running_out_is_still_response_and_acquire_timeout(timeout_semantics):
    """The other side of the distinction: nothing answered within the budget is ResponseTimeout
    (sent) or AcquireTimeout (no slot), whichever the asyncio semantics, on the direct path and
    through the coalescing queue."""
    conn = FakeConnection(LAY)
    for coalesce in (False, True):
        pool = await open_pool(conn, size=1, min_size=1, coalesce=coalesce)
        q = np.ones(8, np.float32)
        with pytest.raises(ResponseTimeout) as e:
            await pool.recall(q, k=2, timeout=0.05)  # nobody serves
        assert type(e.value) is ResponseTimeout
        with pytest.raises(AcquireTimeout):
            await pool.recall(q, k=2, timeout=0.05)  # its only slot is still in flight
        pool.terminate()
        conn = FakeConnection(LAY)


def test_the_blocking_client_gets_position_timeout_as_itself():
    conn = FakeConnection(LAY)
    stop = threading.Event()

    def sidecar() -> None:
        while not stop.is_set():
            conn.serve(not_applied)
            time.sleep(0.0005)

    t = threading.Thread(target=sidecar, daemon=True)
    t.start()
    try:
        with RecallClient("fake", connect=lambda name, uid: conn, spin_us=50) as c:
            with pytest.raises(KalosTimeout) as e:
                c.count("default", after=FAR, timeout=5)
            assert type(e.value) is PositionTimeout and "NOT_APPLIED" in str(e.value)
    finally:
        stop.set()
        t.join()


# --------------------------------------------------------------------------- item 4
@pytest.mark.asyncio
async def test_close_does_not_wait_for_a_request_whose_caller_went_away():
    """The issue's case: timeout=None, the call cancelled by ``asyncio.wait_for``, its request
    never answered (a held read). ``async with`` used to wait for it for ever; now the slot is
    abandoned to the sidecar's reaper at once."""
    conn = FakeConnection(LAY)

    async def scenario() -> None:
        async with RecallPool("fake", size=2, connect=lambda name, uid: conn, spin_us=50) as pool:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.count("shared", after=FAR), 0.2)
            assert pool.statistics().orphaned == 1

    t0 = time.monotonic()
    await asyncio.wait_for(scenario(), 10)  # (before the fix: for ever)
    took = time.monotonic() - t0
    print(f"\n[close] exited {took * 1000:.0f} ms after entering (the call was cancelled at 200 ms)")
    assert took < 2
    [posted] = conn.posted()
    assert int(conn.seg.slots["owner_pid"][posted]) == OWNER_ABANDONED  # the reaper frees it once answered


@pytest.mark.asyncio
async def test_close_waits_for_live_callers_within_its_budget_then_terminates():
    """A caller still waiting (timeout=None) on a request the sidecar never answers: close waits
    for it for its budget, then fails it with ClosedError and abandons the slot; a caller
    waiting for a slot behind it is failed too rather than left hanging."""
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1, min_size=1)
    q = np.ones(8, np.float32)
    stuck = asyncio.ensure_future(pool.recall(q, k=2))
    await asyncio.sleep(0.02)
    behind = asyncio.ensure_future(pool.recall(q, k=2))
    await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await asyncio.wait_for(pool.close(timeout=0.3), 10)
    took = time.monotonic() - t0
    assert 0.25 < took < 2, took
    for t in (stuck, behind):
        with pytest.raises(ClosedError):
            await asyncio.wait_for(t, 5)
    [posted] = conn.posted()
    assert int(conn.seg.slots["owner_pid"][posted]) == OWNER_ABANDONED


@pytest.mark.asyncio
async def test_close_still_waits_for_answers_that_come_within_its_budget(rng):
    matrix = rng.standard_normal((10, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=2, close_timeout=5)
    q = rng.standard_normal(8).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3)) for _ in range(2)]
    await asyncio.sleep(0.02)

    async def late() -> None:
        await asyncio.sleep(0.2)
        await answer_soon(conn, topk_answer(matrix), 2)

    server = asyncio.ensure_future(late())
    await pool.close()
    await server
    for t in calls:
        assert (await t).ids.tolist() == np.argsort(-(matrix.astype(np.float64) @ q))[:3].tolist()
    assert conn.seg.slots["owner_pid"].tolist() == [0, 0, 0]  # answered: given back, not abandoned
