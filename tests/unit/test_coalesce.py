"""Client-side coalescing: the pure decisions (clients._coalesce) and the pool's use of them on the
in-memory fake transport (clients.fake), where every slot the pool posts can be inspected. The
real-sidecar behaviour is in tests/ipc/test_coalescing.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk

from kalos.broker.errors import AcquireTimeout, ClosedError, ResponseTimeout
from kalos.broker.layout import Flag, Layout, SlotView, Status
from kalos.clients import RecallPool
from kalos.clients._coalesce import (
    Key,
    Path,
    Share,
    Waiting,
    coalesce_key,
    k_class,
    pick_group,
    route,
    split,
)
from kalos.clients.fake import FakeConnection
from kalos.clients.results import Hits

# --------------------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    "coalesce,queued,free,in_flight,path",
    [
        (True, 0, 3, 0, Path.DIRECT),  # a lone caller: today's path
        (True, 0, 3, 1, Path.QUEUE),  # the pool already waits for the sidecar
        (True, 0, 0, 0, Path.QUEUE),  # no free slot (all leased slots busy or being re-attached)
        (True, 2, 3, 0, Path.QUEUE),  # others are queued: join them, never overtake them
        (False, 5, 0, 9, Path.DIRECT),  # coalescing off
    ],
)
def test_route(coalesce, queued, free, in_flight, path):
    assert route(coalesce, queued, free, in_flight) is path


def test_k_class_rounds_up_to_a_power_of_two_within_max_k():
    assert [k_class(k, False, 128) for k in (1, 2, 3, 4, 5, 9, 10, 16, 17, 100, 128)] == [
        1,
        2,
        4,
        4,
        8,
        16,
        16,
        16,
        32,
        128,
        128,
    ]
    assert k_class(40, False, 50) == 50  # never beyond what the broker serves
    assert k_class(50, False, 50) == 50
    assert k_class(10, True, 128) == 10  # with payloads: the same k only


def test_coalesce_key_separates_what_cannot_share_a_slot():
    base = coalesce_key(b"a", 0, b"", 10, 64)
    assert base == coalesce_key(b"a", 0, b"", 12, 64)  # same class (16)
    assert base != coalesce_key(b"a", 0, b"", 17, 64)
    assert base != coalesce_key(b"b", 0, b"", 10, 64)
    assert base != coalesce_key(b"a", int(Flag.WITH_PAYLOAD), b"", 10, 64)
    w = int(Flag.WHERE)
    assert coalesce_key(b"a", w, b'{"g":1}', 10, 64) != coalesce_key(b"a", w, b'{"g":2}', 10, 64)
    assert coalesce_key(b"a", int(Flag.WITH_PAYLOAD), b"", 9, 64) != coalesce_key(
        b"a", int(Flag.WITH_PAYLOAD), b"", 10, 64
    )


A = Key(b"a", 0, b"", 16)
B = Key(b"b", 0, b"", 16)


def test_pick_group_takes_the_oldest_and_its_kind_in_order():
    q = [Waiting(A, 1), Waiting(B, 1), Waiting(A, 1), Waiting(A, 2), Waiting(B, 1)]
    assert pick_group(q, 8) == [0, 2, 3]
    assert pick_group(q[1:], 8) == [0, 3]
    assert pick_group([], 8) == []


def test_pick_group_fills_a_slot_and_skips_what_does_not_fit():
    q = [Waiting(A, 3), Waiting(A, 4), Waiting(A, 2), Waiting(A, 1), Waiting(A, 1)]
    assert pick_group(q, 6) == [0, 2, 3]  # 3 + 2 + 1: the 4 does not fit, later ones do
    assert pick_group([Waiting(A, 1)] * 10, 4) == [0, 1, 2, 3]


def test_pick_group_sends_a_recall_marked_alone_alone():
    assert pick_group([Waiting(None, 1), Waiting(A, 1)], 8) == [0]
    assert pick_group([Waiting(A, 1), Waiting(None, 1), Waiting(A, 1)], 8) == [0, 2]


def _hits(rows: int, n: int, payloads: bool = False) -> list[Hits]:
    return [
        Hits(
            np.arange(n, dtype=np.int64) + 100 * r,
            -np.arange(n, dtype=np.float32),
            [f"p{r}.{j}" for j in range(n)] if payloads else None,
        )
        for r in range(rows)
    ]


def test_split_scatters_rows_and_cuts_each_to_its_k():
    out = split(_hits(4, 8), [Share(1, 3, True), Share(2, 8, False), Share(1, 5, True)])
    a, b, c = out
    assert isinstance(a, Hits) and a.ids.tolist() == [0, 1, 2]
    assert isinstance(b, list) and [h.ids.tolist() for h in b] == [list(range(100, 108)), list(range(200, 208))]
    assert isinstance(c, Hits) and c.ids.tolist() == [300, 301, 302, 303, 304]
    assert c.scores.tolist() == [0, -1, -2, -3, -4]


def test_split_cuts_payloads_and_keeps_short_answers_whole():
    (a, b) = split(_hits(2, 3, payloads=True), [Share(1, 2, True), Share(1, 10, True)])
    assert isinstance(a, Hits) and a.payloads == ["p0.0", "p0.1"]
    assert isinstance(b, Hits) and len(b) == 3 and b.payloads == ["p1.0", "p1.1", "p1.2"]


def test_split_refuses_a_row_count_that_does_not_add_up():
    with pytest.raises(ValueError):
        split(_hits(3, 2), [Share(1, 2, True)])


# --------------------------------------------------------------------------- the pool, on the fake

LAY = Layout(n_slots=4, dim=8, max_k=16, max_queries=8, blob_bytes=4096)


async def serve_forever(conn: FakeConnection, answer) -> None:
    while True:
        conn.serve(answer)
        await asyncio.sleep(0.0005)


async def open_pool(conn: FakeConnection, size: int, **kw) -> RecallPool:
    kw.setdefault("coalesce", True)
    return await RecallPool("fake", size=size, connect=lambda name, uid: conn, spin_us=50, **kw).open()


@pytest.mark.asyncio
async def test_a_lone_caller_is_sent_at_once_alone(rng):
    matrix = rng.standard_normal((30, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 2)
    log: list[tuple[int, int]] = []
    server = asyncio.ensure_future(serve_forever(conn, topk(matrix, log)))
    for _ in range(5):  # one after the other: nothing queued, nothing in flight
        q = rng.standard_normal(8).astype(np.float32)
        task = asyncio.ensure_future(pool.recall(q, k=5, timeout=2))
        await asyncio.sleep(0)  # one turn: the request is already posted (no deferral)
        assert conn.posted() and pool.statistics().queued == 0
        h = await task
        assert_topk(q, matrix, h.ids, h.scores, 5)
    st = pool.statistics()
    assert (st.requests, st.posted, st.coalesced) == (5, 5, 0)
    assert log == [(1, 5)] * 5
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_waiting_recalls_share_slots_and_each_gets_its_own_answer(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    log: list[tuple[int, int]] = []
    qs = rng.standard_normal((20, 8)).astype(np.float32)
    ks = [int(k) for k in rng.integers(1, 17, size=20)]
    many = rng.standard_normal((3, 8)).astype(np.float32)
    calls = [pool.recall(q, k=k, timeout=5) for q, k in zip(qs, ks)]
    calls.append(pool.recall_many(many, k=4, timeout=5))
    server = asyncio.ensure_future(serve_forever(conn, topk(matrix, log)))
    out = await asyncio.gather(*calls)
    for q, k, h in zip(qs, ks, out):
        assert_topk(q, matrix, h.ids, h.scores, k)
    for q, h in zip(many, out[-1]):
        assert_topk(q, matrix, h.ids, h.scores, 4)
    st = pool.statistics()
    assert st.requests == 21 and st.errors == 0 and st.posted == len(log) < 21
    assert st.coalesced > 0 and st.queued == 0 and st.free == 1 and st.in_flight == 0
    assert all(nq <= LAY.max_queries for nq, _ in log)
    assert sum(nq for nq, _ in log) == 23  # every row sent once
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_coalesce_false_sends_every_recall_alone(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 2, coalesce=False)
    log: list[tuple[int, int]] = []
    server = asyncio.ensure_future(serve_forever(conn, topk(matrix, log)))
    qs = rng.standard_normal((10, 8)).astype(np.float32)
    out = await asyncio.gather(*(pool.recall(q, k=3, timeout=5) for q in qs))
    for q, h in zip(qs, out):
        assert_topk(q, matrix, h.ids, h.scores, 3)
    st = pool.statistics()
    assert (st.requests, st.posted, st.coalesced) == (10, 10, 0) and log == [(1, 3)] * 10
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_a_queued_caller_times_out_alone_and_the_others_are_served(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    qs = rng.standard_normal((4, 8)).astype(np.float32)
    first = asyncio.ensure_future(pool.recall(qs[0], k=3, timeout=5))  # takes the only slot
    await asyncio.sleep(0)
    short = asyncio.ensure_future(pool.recall(qs[1], k=3, timeout=0.05))  # queued, no slot
    rest = [asyncio.ensure_future(pool.recall(q, k=3, timeout=5)) for q in qs[2:]]
    with pytest.raises(AcquireTimeout):
        await short
    assert pool.statistics().queued == 2
    server = asyncio.ensure_future(serve_forever(conn, topk(matrix)))
    for q, t in zip([qs[0], *qs[2:]], [first, *rest]):
        h = await t
        assert_topk(q, matrix, h.ids, h.scores, 3)
    st = pool.statistics()
    assert (st.requests, st.posted, st.coalesced, st.queued, st.free) == (3, 2, 2, 0, 1)
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_cancelled_and_timed_out_members_of_a_sent_slot_leave_the_others_alone(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    qs = rng.standard_normal((6, 8)).astype(np.float32)
    first = asyncio.ensure_future(pool.recall(qs[0], k=3, timeout=5))
    await asyncio.sleep(0)  # posted alone
    # The one with a timeout still waits when the shared slot is sent (~25 ms later; 1 s on a loaded machine too).
    tasks = [asyncio.ensure_future(pool.recall(q, k=3, timeout=1.0 if i == 1 else 10)) for i, q in enumerate(qs[1:])]
    await asyncio.sleep(0.01)
    assert (pool.statistics().in_flight, pool.statistics().queued) == (1, 5)
    assert conn.serve(topk(matrix)) == 1
    h = await first
    assert_topk(qs[0], matrix, h.ids, h.scores, 3)
    await asyncio.sleep(0.01)  # the freed slot carries the five queued recalls together
    assert (pool.statistics().in_flight, pool.statistics().queued) == (1, 0)
    tasks[0].cancel()
    with pytest.raises(ResponseTimeout):
        await tasks[1]  # its deadline passes while the shared slot is in flight
    assert pool.statistics().orphaned == 0  # three callers still wait on that slot
    assert conn.serve(topk(matrix)) == 1
    for q, t in zip(qs[3:], tasks[2:]):
        h = await t
        assert_topk(q, matrix, h.ids, h.scores, 3)
    assert tasks[0].cancelled()
    await asyncio.sleep(0.01)
    st = pool.statistics()
    assert (st.posted, st.requests, st.coalesced, st.free, st.in_flight) == (2, 6, 5, 1, 0)
    assert int(np.asarray(conn.seg.stats["timeout_count"]).sum()) == 2  # the two that left
    await pool.close()


@pytest.mark.asyncio
async def test_cancelled_while_queued_restores_the_free_count():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    held = await pool._sender.acquire(None)
    tasks = [asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert pool.statistics().queued == 3
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pool._free.put_nowait(held)
    st = pool.statistics()
    assert st.free == 1 and st.queued == 0 and not pool._free.stack.line
    pool.terminate()


@pytest.mark.asyncio
async def test_payloads_that_overflow_together_are_asked_again_alone(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    log: list[tuple[int, int]] = []
    plain = topk(matrix, log)

    def answer(v: SlotView, op: int, k: int, nq: int):
        if nq > 1:  # a shared slot's payloads do not fit its blob area; one caller's do
            log.append((nq, k))
            return Status.PAYLOAD_TOO_LARGE
        return plain(v, op, k, nq)

    qs = rng.standard_normal((4, 8)).astype(np.float32)
    # (the fake writes no payload lines: plain recalls stand in for with_payload=True ones here;
    # tests/ipc/test_coalescing.py overflows real payloads)
    calls = [pool.recall(q, k=3, timeout=5) for q in qs]
    server = asyncio.ensure_future(serve_forever(conn, answer))
    out = await asyncio.gather(*calls)
    for q, h in zip(qs, out):
        assert_topk(q, matrix, h.ids, h.scores, 3)
    st = pool.statistics()
    assert st.errors == 0 and st.requests == 4
    assert (3, 3) in log and log.count((1, 3)) == 4  # once together, then each alone
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_a_caller_asked_again_alone_times_out_as_sent_not_as_queued(rng):
    """After a shared slot overflowed, its callers wait again in the queue; one whose budget
    runs out there was sent already: ResponseTimeout, not AcquireTimeout."""
    from kalos.broker.errors import AcquireTimeout, ResponseTimeout

    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    log: list[tuple[int, int]] = []
    plain = topk(matrix, log)

    def answer(v: SlotView, op: int, k: int, nq: int):
        return Status.PAYLOAD_TOO_LARGE if nq > 1 else plain(v, op, k, nq)

    qs = rng.standard_normal((3, 8)).astype(np.float32)
    calls = [asyncio.ensure_future(pool.recall(q, k=3, timeout=0.5)) for q in qs]
    for _ in range(2):  # the first caller alone (answered), then the other two shared (overflow)
        while not conn.posted():
            await asyncio.sleep(0.001)
        conn.serve(answer)
    # ... after which the sidecar answers nothing more: both wait again, one sent, one queued.
    out = await asyncio.gather(*calls, return_exceptions=True)
    assert_topk(qs[0], matrix, out[0].ids, out[0].scores, 3)
    assert log[0] == (1, 3)
    assert all(isinstance(e, ResponseTimeout) and not isinstance(e, AcquireTimeout) for e in out[1:]), out
    pool.terminate()


@pytest.mark.asyncio
async def test_an_error_answer_reaches_every_member(rng):
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    qs = rng.standard_normal((4, 8)).astype(np.float32)
    calls = [pool.recall(q, k=3, timeout=5, namespace="nope") for q in qs]
    server = asyncio.ensure_future(serve_forever(conn, lambda v, op, k, nq: Status.UNKNOWN_NAMESPACE))
    out = await asyncio.gather(*calls, return_exceptions=True)
    from kalos.broker.errors import UnknownNamespace

    assert all(isinstance(e, UnknownNamespace) for e in out)
    assert len({id(e) for e in out}) == 4  # each caller its own exception object
    st = pool.statistics()
    assert st.errors == st.requests == 4 and st.posted < 4
    server.cancel()
    await pool.close()


@pytest.mark.asyncio
async def test_terminate_fails_queued_callers():
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    first = asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2))
    await asyncio.sleep(0)
    queued = [asyncio.ensure_future(pool.recall(np.ones(8, np.float32), k=2)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert pool.statistics().queued == 2
    pool.terminate()
    for t in [first, *queued]:
        with pytest.raises(ClosedError):
            await t


@pytest.mark.asyncio
async def test_close_sends_queued_recalls_before_closing(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    pool = await open_pool(conn, 1)
    qs = rng.standard_normal((5, 8)).astype(np.float32)
    tasks = [asyncio.ensure_future(pool.recall(q, k=3, timeout=5)) for q in qs]
    await asyncio.sleep(0)
    server = asyncio.ensure_future(serve_forever(conn, topk(matrix)))
    await pool.close()
    for q, t in zip(qs, tasks):
        h = t.result()
        assert_topk(q, matrix, h.ids, h.scores, 3)
    server.cancel()
