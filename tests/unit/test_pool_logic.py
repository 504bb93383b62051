"""The pool's logic on the in-memory fake transport (clients.fake): free-slot stack, timeouts,
cancellation, orphan draining, a dead sidecar and a broken waiter, without processes or a sidecar.
The fake plays the sidecar through the real slot fields, so answers are still checked against a
float64 reference."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk as topk_answer

from kalos.broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    ClosedError,
    PartialWrite,
    PayloadTooLarge,
    ProtocolError,
    ResponseTimeout,
    ServerError,
)
from kalos.broker.layout import Layout, SlotView, Status
from kalos.clients import RecallPool
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=3, dim=8, max_k=8, max_queries=2, blob_bytes=1024)
pytestmark = pytest.mark.asyncio


async def open_pool(conn: FakeConnection, size: int = 3, **kw) -> RecallPool:
    kw.setdefault("min_size", size)  # (these tests hold every slot from the start)
    pool = RecallPool("fake", size=size, connect=lambda name, uid: conn, spin_us=50, **kw)
    return await pool.open()


async def until(pred, timeout: float = 30.0) -> None:  # (a guard against a hang, not a bound)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.001)


async def serve_soon(conn: FakeConnection, answer, n: int = 1) -> None:
    """Answer the next ``n`` posted requests as they arrive."""
    served = 0
    while served < n:
        served += conn.serve(answer)
        await asyncio.sleep(0.0005)


async def test_recall_through_the_fake_matches_float64(rng):
    matrix = rng.standard_normal((20, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn)
    q = rng.standard_normal(8).astype(np.float32)
    server = asyncio.ensure_future(serve_soon(conn, topk_answer(matrix)))
    hits = await pool.recall(q, k=5, timeout=2)
    await server
    assert_topk(q, matrix, hits.ids, hits.scores, 5)
    st = pool.statistics()
    assert (st.requests, st.errors, st.free, st.in_flight) == (1, 0, 3, 0)
    await pool.close()
    assert conn.seg.slots["owner_pid"].tolist() == [0, 0, 0]  # leases given back


async def test_free_slots_are_lifo_and_waiters_fifo():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn)
    order = []
    a = await pool._sender.acquire(None)
    b = await pool._sender.acquire(None)
    pool._free.put_nowait(b)
    pool._free.put_nowait(a)
    assert (await pool._sender.acquire(None)) is a  # last released, first reused
    c = await pool._sender.acquire(None)
    d = await pool._sender.acquire(None)  # the third slot
    assert {c.index, d.index, a.index} == {0, 1, 2}

    async def want(tag):
        s = await pool._sender.acquire(None)
        order.append((tag, s.index))

    w1 = asyncio.ensure_future(want("first"))
    await asyncio.sleep(0)
    w2 = asyncio.ensure_future(want("second"))
    await asyncio.sleep(0)
    pool._free.put_nowait(c)
    pool._free.put_nowait(d)
    await asyncio.gather(w1, w2)
    assert order == [("first", c.index), ("second", d.index)]
    pool.terminate()


async def test_timeouts_then_the_orphan_is_drained_and_the_slot_reused(rng):
    matrix = rng.standard_normal((10, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1)
    q = np.ones(8, np.float32)
    with pytest.raises(ResponseTimeout):
        await pool.recall(q, k=3, timeout=0.05)  # nobody serves
    st = pool.statistics()
    assert (st.free, st.in_flight, st.orphaned) == (0, 1, 1)
    with pytest.raises(AcquireTimeout):
        await pool.recall(q, k=3, timeout=0.02)  # the only slot is still in flight
    assert conn.serve(topk_answer(matrix)) == 1  # the late answer arrives ...
    await until(lambda: pool.statistics().free == 1)  # ... is dropped, the slot comes back
    st = pool.statistics()
    assert (st.in_flight, st.orphaned, st.requests) == (0, 0, 1)
    server = asyncio.ensure_future(serve_soon(conn, topk_answer(matrix)))
    h = await pool.recall(q, k=3, timeout=2)  # and serves a fresh, correct answer
    await server
    assert_topk(q, matrix, h.ids, h.scores, 3)
    assert int(np.asarray(conn.seg.stats["timeout_count"]).sum()) == 1
    await pool.close()


async def test_cancel_mid_acquire_restores_the_free_count():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1)
    held = await pool._sender.acquire(None)
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool._free.put_nowait(held)
    assert pool.statistics().free == 1 and not pool._free.stack.line
    pool.terminate()


async def test_error_status_reaches_the_caller_and_is_counted():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn)
    server = asyncio.ensure_future(serve_soon(conn, lambda v, op, k, nq: Status.BACKEND_ERROR))
    from kalos.broker.errors import ServerError

    with pytest.raises(ServerError, match="BACKEND_ERROR"):
        await pool.recall(np.ones(8, np.float32), k=2, timeout=2)
    await server
    assert pool.statistics().errors == 1 and pool.statistics().free == 3
    await pool.close()


async def test_dead_sidecar_without_reconnect_breaks_the_pool():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, reconnect=False)
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))
    await asyncio.sleep(0.05)  # past the spin window: the pool blocks and checks liveness
    conn.alive = False
    with pytest.raises(BrokerUnavailable, match="dead"):
        await asyncio.wait_for(task, 30)  # no timeout of its own: without the liveness check, a hang
    with pytest.raises(BrokerUnavailable):
        await pool.recall(np.ones(8, np.float32), k=2)
    pool.terminate()
    with pytest.raises(ClosedError):
        await pool.recall(np.ones(8, np.float32), k=2)


async def test_dead_sidecar_fails_writes_in_flight_resends_reads_and_reattaches(rng):
    """In flight when the sidecar dies: a write fails with BrokerUnavailable (it may or may not
    have been applied); a read waits and is sent again to the next sidecar. During the outage
    calls wait within their timeout. A new sidecar (a new FakeConnection): the pool attaches by
    itself and serves again."""
    matrix = rng.standard_normal((10, 8)).astype(np.float32)
    first, second = FakeConnection(LAY), FakeConnection(LAY)
    sidecars = [first]
    pool = RecallPool("fake", size=2, min_size=2, spin_us=50, connect=lambda name, uid: sidecars[-1])
    await pool.open()
    q = np.ones(8, np.float32)
    write = asyncio.ensure_future(pool.upsert([1], q[None]))
    read = asyncio.ensure_future(pool.recall(q, k=2, timeout=5))
    await asyncio.sleep(0.05)
    first.alive = False
    with pytest.raises(BrokerUnavailable, match="in flight"):
        await asyncio.wait_for(write, 30)
    with pytest.raises(BrokerUnavailable, match="no sidecar within the time budget"):
        await pool.recall(q, k=2, timeout=0.1)
    st = pool.statistics()
    assert st.outages == 1 and not st.attached and st.unavailable_s > 0.09 and not read.done()
    sidecars.append(second)  # a new sidecar serves the name
    server = asyncio.ensure_future(serve_soon(second, topk_answer(matrix)))
    h = await read  # the read lost with the first sidecar, answered by the second
    await server
    assert_topk(q, matrix, h.ids, h.scores, 2)
    st = pool.statistics()
    assert st.attached and st.reattaches == 1 and st.outages == 1
    assert second.seg.slots["owner_pid"].tolist() == [1, 1, 0]  # leased the new sidecar's slots
    await pool.close()


async def test_a_new_sidecar_with_another_geometry_is_an_error_not_a_reattach():
    first = FakeConnection(LAY)
    other = FakeConnection(Layout(n_slots=3, dim=16, max_k=8, max_queries=2, blob_bytes=1024))
    sidecars = [first]
    pool = RecallPool("fake", size=1, spin_us=50, connect=lambda name, uid: sidecars[-1])
    await pool.open()
    sidecars.append(other)
    first.alive = False
    pool._unavailable(BrokerUnavailable("gone"))
    await until(lambda: pool._life.broken is not None)
    with pytest.raises(ProtocolError, match="dim 16"):
        await pool.recall(np.ones(8, np.float32), k=2, timeout=1)
    pool.terminate()


async def test_a_broken_waiter_thread_fails_the_callers_at_once():
    """The waiter thread's semaphore breaks: callers get BrokerUnavailable well before the
    liveness check, never a silent hang."""
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1, reconnect=False)
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))
    await asyncio.sleep(0.03)  # blocking phase: the waiter thread sits on the response semaphore
    slot = pool._leases.slots[0]
    conn.resp[slot.index].break_(BrokerUnavailable("resp semaphore vanished"))
    with pytest.raises(BrokerUnavailable, match="vanished"):  # the waiter's error, not liveness
        await asyncio.wait_for(task, 30)
    pool.terminate()


async def test_done_but_never_posted_then_dead_is_noticed_not_spun_on():
    """The sidecar marked the slot DONE and died before posting its response: the pool notices
    the dead sidecar (within its liveness period) instead of spinning until the caller's timeout."""
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, size=1, reconnect=False)
    task = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))  # no timeout at all
    await until(lambda: len(conn.posted()) == 1)
    i = conn.posted()[0]
    conn.req[i].try_acquire()
    conn.seg.slots[i]["state"] = 4  # DONE, and no response post: the sidecar died right here
    conn.alive = False
    with pytest.raises(BrokerUnavailable, match="dead"):
        await asyncio.wait_for(task, 30)  # no timeout of its own: spinning on DONE would hang
    pool.terminate()


async def test_every_async_test_runs_under_the_strict_loop_fixture():
    """conftest applies strict_loop to async tests without a marker: its handler is installed."""
    assert asyncio.get_running_loop().get_exception_handler() is not None


# --------------------------------------------------------------------------- writes in chunks

WLAY = Layout(n_slots=4, dim=8, max_k=8, max_queries=2, blob_bytes=1024)
LIMIT = 100  # the fake sidecar's --payload-limit (in its header, as a real one writes it)


class WriteSidecar:
    """A fake sidecar's write path: refuses a chunk with a payload line over LIMIT
    (PAYLOAD_TOO_LARGE) or whose ids are in ``refuse`` (with that status), else applies it.
    ``applied`` holds what it wrote; ``seen`` every chunk's ids in the order served."""

    def __init__(self, conn: FakeConnection, refuse: dict[int, Status] | None = None) -> None:
        self.conn = conn
        self.refuse = refuse or {}
        self.applied: dict[int, np.ndarray] = {}
        self.seen: list[list[int]] = []

    def __call__(self, v: SlotView, op: int, k: int, nq: int):
        ids = v.ids[:nq].tolist()
        self.seen.append(ids)
        for i in ids:
            if i in self.refuse:
                return self.refuse[i]
        blob_len = int(self.conn.seg.slots["blob_len"][v.index])
        lines = bytes(v.blob[:blob_len]).split(b"\n")
        if any(len(line) > LIMIT for line in lines):
            return Status.PAYLOAD_TOO_LARGE
        for j, i in enumerate(ids):
            self.applied[i] = v.queries[j].copy()
        return nq


def wrows(rng, n: int):
    return np.arange(n, dtype=np.int64) * 10 + 1, rng.standard_normal((n, 8)).astype(np.float32)


async def test_an_upsert_refused_for_one_payload_writes_nothing(rng):
    """Issue 22 item 2 on the fake: a payload over the sidecar's limit (read from the segment
    header) fails the call before any chunk is posted (before: the other chunks, sent at the
    same time, were applied); within the limit, every chunk goes at once."""
    conn = FakeConnection(WLAY, payload_limit=LIMIT)
    pool = await open_pool(conn, size=4)
    side = WriteSidecar(conn)
    ids, vecs = wrows(rng, 8)
    pls = [{"i": i} for i in range(8)]
    pls[5] = {"t": "x" * 200}
    with pytest.raises(PayloadTooLarge, match=f"row 5 takes .* over the sidecar's --payload-limit of {LIMIT}") as e:
        await pool.upsert(ids, vecs, pls, timeout=2)
    assert not isinstance(e.value, PartialWrite)
    await asyncio.sleep(0.02)
    assert conn.posted() == [] and side.seen == [] and side.applied == {}
    assert pool.statistics().free == 4
    pls[5] = {"t": "short"}
    task = asyncio.ensure_future(pool.upsert(ids, vecs, pls, timeout=2))
    await until(lambda: len(conn.posted()) == 4)  # every chunk at once
    conn.serve(side)
    assert await task == 8
    assert sorted(side.applied) == ids.tolist()
    for i, v in zip(ids.tolist(), vecs):
        np.testing.assert_array_equal(side.applied[i], v)
    await pool.close()


async def test_a_store_failure_midway_names_the_ids_by_fate(rng):
    conn = FakeConnection(WLAY)
    pool = await open_pool(conn, size=2)
    ids, vecs = wrows(rng, 12)  # 6 chunks, 2 slots
    side = WriteSidecar(conn, refuse={int(ids[2]): Status.STORE_ERROR})
    task = asyncio.ensure_future(pool.upsert(ids, vecs, timeout=5))
    await until(lambda: len(conn.posted()) == 2)
    while not task.done():
        conn.serve(side)
        await asyncio.sleep(0.001)
    e = task.exception()
    assert isinstance(e, PartialWrite) and isinstance(e, ServerError), e
    assert "STORE_ERROR" in str(e)
    assert sorted(e.written) == sorted(side.applied)  # exactly what the sidecar applied
    assert set(ids[2:4].tolist()) <= set(e.unwritten) and e.in_doubt == ()
    assert sorted(e.written + e.unwritten) == ids.tolist()
    # Both posted chunks were answered together; the slot the good one freed went to the next
    # chunk, which was not posted: the failure was known by then. The rest never got a slot.
    assert len(side.seen) == 2, side.seen
    await until(lambda: pool.statistics().free == 2)
    await pool.close()


async def test_an_outage_midway_leaves_the_chunks_in_flight_in_doubt(rng):
    conn = FakeConnection(WLAY)
    pool = await open_pool(conn, size=2)
    ids, vecs = wrows(rng, 12)
    side = WriteSidecar(conn)
    task = asyncio.ensure_future(pool.upsert(ids, vecs, timeout=5))
    await until(lambda: len(conn.posted()) == 2)
    first = conn.posted()[0]
    conn.serve(side, slots=[first])
    await until(lambda: len(conn.posted()) == 2)  # the next chunk took the freed slot
    in_flight = sorted(int(i) for s in conn.posted() for i in conn.seg.slot[s].ids[:2])
    conn.alive = False  # the sidecar dies with two chunks posted, unanswered
    with pytest.raises(BrokerUnavailable) as e:
        await asyncio.wait_for(task, 2)
    err = e.value
    assert isinstance(err, PartialWrite)
    assert sorted(err.written) == sorted(side.applied) and len(err.written) == 2
    assert sorted(err.in_doubt) == in_flight
    assert sorted(err.unwritten) == sorted(set(ids.tolist()) - set(err.written) - set(in_flight))
    pool.terminate()


async def test_writes_and_the_vector_rule_in_the_blocking_client(rng):
    """RecallClient: the same rule for vectors, the payload limit checked before anything is
    sent, chunks in turn, nothing sent after a failure, PartialWrite naming the ids."""
    import threading

    from kalos.broker.errors import InvalidRequest
    from kalos.clients import RecallClient

    conn = FakeConnection(WLAY, payload_limit=LIMIT)
    side = WriteSidecar(conn)
    stop = threading.Event()

    def sidecar() -> None:
        while not stop.is_set():
            conn.serve(side)
            stop.wait(0.0005)

    t = threading.Thread(target=sidecar, daemon=True)
    t.start()
    try:
        c = await asyncio.to_thread(RecallClient, "fake", connect=lambda name, uid: conn, timeout=2)
        with pytest.raises(InvalidRequest, match=r"got \(1, 8\): use recall_many"):
            c.recall(np.ones((1, 8)), k=2)
        with pytest.raises(InvalidRequest, match=r"pass vec\[None\]"):
            c.upsert([1], np.ones(8))
        ids, vecs = wrows(rng, 8)
        pls = [{"i": i} for i in range(8)]
        pls[6] = {"t": "x" * 200}
        with pytest.raises(PayloadTooLarge) as e:
            await asyncio.to_thread(c.upsert, ids, vecs, pls)
        assert not isinstance(e.value, PartialWrite)
        assert side.seen == [] and side.applied == {}
        side.refuse = {int(ids[4]): Status.CAPACITY}
        with pytest.raises(ServerError) as e:
            await asyncio.to_thread(c.upsert, ids, vecs)
        err = e.value
        assert isinstance(err, PartialWrite)
        assert err.written == tuple(ids[:4].tolist()) and err.unwritten == tuple(ids[4:].tolist())
        assert side.seen == [ids[0:2].tolist(), ids[2:4].tolist(), ids[4:6].tolist()]
        side.refuse = {}
        assert await asyncio.to_thread(c.delete, np.concatenate([ids, ids[:3]])) == 8
        c.close()
    finally:
        stop.set()
        t.join()


async def test_a_blocking_call_waiting_for_another_threads_call_keeps_its_budget():
    """Calls of several threads share the client's one slot; waiting for it is part of a call's
    budget: AcquireTimeout while the other call is still running, not after it."""
    await asyncio.to_thread(two_threads_one_client)


def two_threads_one_client() -> None:
    import threading

    from kalos.clients import RecallClient

    conn = FakeConnection(WLAY)
    c = RecallClient("fake", connect=lambda name, uid: conn)
    first: list[BaseException] = []

    def slow() -> None:
        try:
            c.recall(np.ones(8, np.float32), k=2, timeout=1.5)  # nobody answers
        except BaseException as e:
            first.append(e)

    t = threading.Thread(target=slow)
    t.start()
    assert wait_posted(conn)
    with pytest.raises(AcquireTimeout, match="another thread's call"):
        c.recall(np.ones(8, np.float32), k=2, timeout=0.05)
    assert t.is_alive() and not first  # the first call was still waiting for its answer
    t.join()
    assert isinstance(first[0], ResponseTimeout)
    c.close()


def wait_posted(conn: FakeConnection, timeout: float = 5.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not conn.posted():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


async def test_the_budget_running_out_between_chunks_is_a_partial_timeout(rng):
    """One budget for the whole call: the chunk that was answered is written, the one posted and
    never answered is in doubt, the one that never got a slot is not written."""
    conn = FakeConnection(WLAY)
    pool = await open_pool(conn, size=1)
    ids, vecs = wrows(rng, 6)  # 3 chunks over 1 slot
    side = WriteSidecar(conn)
    task = asyncio.ensure_future(pool.upsert(ids, vecs, timeout=1.5))  # (the first chunk is answered well inside)
    await until(lambda: len(conn.posted()) == 1)
    conn.serve(side)  # the first chunk is answered; the second then waits for nobody
    with pytest.raises(ResponseTimeout) as e:
        await task
    err = e.value
    assert isinstance(err, PartialWrite) and isinstance(err, TimeoutError)
    assert sorted(err.written) == sorted(side.applied) and len(err.written) == 2
    assert len(err.in_doubt) == 2 and len(err.unwritten) == 2
    assert sorted(err.written + err.in_doubt + err.unwritten) == ids.tolist()
    pool.terminate()
