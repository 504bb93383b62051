"""The two drivers over the client core, on the fake transport: the pool's life as a PoolState
(what each state lets a call do: ``refusal``, pure; the transitions open, close, terminate, break,
fork), and the blocking client finishing a timed-out request before its next one."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk

from kalos.broker.errors import (
    BrokerUnavailable,
    ClosedError,
    ForkedPoolError,
    ProtocolError,
    ResponseTimeout,
)
from kalos.broker.layout import L_RECALL, Layout
from kalos.clients import RecallClient, RecallPool
from kalos.clients._life import PoolState, refusal
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=3, dim=8, max_k=8, max_queries=2, blob_bytes=1024)


def test_refusal_says_what_a_call_on_each_state_raises():
    cause = ProtocolError("came back with another geometry")
    assert refusal(PoolState.OPEN, None, 10, 10) is None
    assert refusal(PoolState.BROKEN, cause, 10, 10) is cause  # the cause itself, every call
    forked = refusal(PoolState.FORKED, None, 10, 11)
    assert isinstance(forked, ForkedPoolError) and "process 10" in str(forked)
    assert "process 11" in str(forked)
    new = refusal(PoolState.NEW, None, 10, 10)
    assert isinstance(new, ClosedError) and "not open" in str(new)
    for state in (PoolState.CLOSING, PoolState.CLOSED):
        err = refusal(state, None, 10, 10)
        assert isinstance(err, ClosedError) and str(err) == f"pool is {state.value}"
    assert {s.value for s in PoolState} == {"new", "open", "closing", "closed", "broken", "forked"}


@pytest.mark.asyncio
async def test_the_pools_states_from_open_to_closed():
    conn = FakeConnection(LAY)
    pool = RecallPool("fake", size=2, connect=lambda name, uid: conn)
    assert pool._life.state is PoolState.NEW
    with pytest.raises(ClosedError, match="not open"):
        await pool.recall(np.ones(8, np.float32), k=2)
    await pool.open()
    assert pool._life.state is PoolState.OPEN
    with pytest.raises(ClosedError, match="pool is open: a pool is opened once"):
        await pool.open()
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2, timeout=5))
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(pool.close())
    await asyncio.sleep(0.01)
    assert pool._life.state is PoolState.CLOSING  # waits for the request in flight
    with pytest.raises(ClosedError, match="pool is closing"):
        await pool.recall(np.ones(8, np.float32), k=2)
    ids, scores = np.zeros((1, 2), np.int64), np.zeros((1, 2), np.float32)
    conn.serve(lambda v, op, k, nq: (ids, scores))
    await closing
    assert (await task).ids.tolist() == [0, 0]
    assert pool._life.state is PoolState.CLOSED
    await pool.close()  # twice is fine
    pool.terminate()
    assert pool._life.state is PoolState.CLOSED


@pytest.mark.asyncio
async def test_a_broken_pool_raises_its_cause_until_closed():
    conn = FakeConnection(LAY)
    pool = await RecallPool("fake", size=2, reconnect=False, spin_us=50, connect=lambda name, uid: conn).open()
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))
    await asyncio.sleep(0.02)
    conn.alive = False
    with pytest.raises(BrokerUnavailable, match="dead") as first:
        await asyncio.wait_for(task, 2)
    assert pool._life.state is PoolState.BROKEN
    with pytest.raises(BrokerUnavailable) as later:
        await pool.recall(np.ones(8, np.float32), k=2)
    assert later.value is pool._life.broken and str(later.value) == str(first.value)
    assert pool.statistics().attached is False
    await pool.close()
    assert pool._life.state is PoolState.CLOSED
    with pytest.raises(ClosedError):
        await pool.recall(np.ones(8, np.float32), k=2)


@pytest.mark.asyncio
async def test_a_forked_copy_refuses_every_call_and_touches_nothing():
    conn = FakeConnection(LAY)
    pool = await RecallPool("fake", size=2, min_size=2, connect=lambda name, uid: conn).open()
    pool._forked()  # what the at-fork hook does in a child
    assert pool._life.state is PoolState.FORKED
    with pytest.raises(ForkedPoolError):
        await pool.recall(np.ones(8, np.float32), k=2)
    await pool.close()  # the parent's slots stay leased: not the child's to give back
    assert conn.seg.slots["owner_pid"].tolist() == [1, 1, 0]


def test_a_blocking_clients_timed_out_request_is_finished_before_its_next_one(rng):
    """The timed-out request stays in the one slot; the next call waits for its answer (and
    drops it, uncounted: its timeout was counted when it happened), then sends its own."""
    matrix = rng.standard_normal((20, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    c = RecallClient("fake", connect=lambda name, uid: conn, spin_us=50)
    q1, q2 = rng.standard_normal((2, 8)).astype(np.float32)
    with pytest.raises(ResponseTimeout):
        c.recall(q1, k=3, timeout=0.02)  # nobody serves
    i = conn.posted()[0]
    assert int(conn.seg.stats[i]["timeout_count"][L_RECALL]) == 1
    stop = threading.Event()

    def sidecar() -> None:
        while not stop.is_set():
            conn.serve(topk(matrix))
            stop.wait(0.001)

    t = threading.Thread(target=sidecar, daemon=True)
    t.start()
    try:
        h = c.recall(q2, k=3, timeout=5)
    finally:
        stop.set()
        t.join()
    assert_topk(q2, matrix, h.ids, h.scores, 3)  # its own answer, not the stale one
    assert int(conn.seg.stats[i]["timeout_count"][L_RECALL]) == 1
    assert int(conn.seg.slot[i].hist[L_RECALL].sum()) == 1
    c.close()
    assert conn.seg.slots["owner_pid"].tolist() == [0, 0, 0]
