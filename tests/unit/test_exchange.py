"""The exchange core (clients/_exchange.py), one request in one slot, on the fake transport: send
writes then posts (and leaves the slot FREE when either fails), complete turns the answer into an
outcome (answered, failed, re-send alone) and records each caller's latency; plus the write
outcome (clients._writes.settle) and the re-send rule both drivers share. The fake plays the
sidecar through the real slot fields; answers are checked against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_topk
from fake_sidecar import topk

from kalos.broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    KalosError,
    PartialWrite,
    PayloadTooLarge,
    ServerError,
)
from kalos.broker.layout import (
    L_RECALL,
    L_RECALL_MANY,
    L_UPSERT,
    S_FREE,
    S_POSTED,
    Flag,
    Layout,
    Op,
    Status,
)
from kalos.clients import _requests
from kalos.clients._coalesce import Share
from kalos.clients._exchange import Completion, Exchange, resend_after_outage
from kalos.clients._writes import Fate, WriteCall, out_of_budget, settle
from kalos.clients.fake import FakeConnection
from kalos.clients.results import Hits

LAY = Layout(n_slots=2, dim=8, max_k=8, max_queries=4, blob_bytes=1024)


def recall(x: np.ndarray, k: int, single: bool = True, where: dict | None = None):
    return _requests.recall(LAY, x, k, b"ns", False, (_requests.ONE if single else _requests.ROWS), where)


def oks(conn: FakeConnection, i: int, op: int) -> int:
    return int(conn.seg.slot[i].hist[op].sum())


def counter(conn: FakeConnection, i: int, field: str, op: int) -> int:
    return int(conn.seg.stats[i][field][op])


def test_send_writes_the_request_then_posts_it(rng):
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    q = rng.standard_normal((3, 8)).astype(np.float32)
    p = recall(q, 5, single=False, where={"tag": "a"})
    gen = slot.generation
    ex = Exchange(slot, p, None)
    ex.send()
    rec = conn.seg.slots[slot.index]
    assert int(rec["state"]) == S_POSTED and int(rec["generation"]) == gen + 1
    assert (int(rec["op"]), int(rec["k"]), int(rec["nq"])) == (Op.RECALL, 5, 3)
    assert int(rec["flags"]) == Flag.WHERE and int(rec["blob_len"]) == len(p.blob)
    np.testing.assert_array_equal(slot.view.queries[:3], q)
    assert bytes(slot.view.blob[: len(p.blob)]) == p.blob
    assert conn.req[slot.index].value == 1  # posted once
    assert p.posted and ex.t0 > 0  # a call timed from its sending (t0 was 0)


def test_a_failed_write_or_post_leaves_the_slot_free_and_raises():
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    bad = _requests.Prepared(Op.RECALL, b"ns", k=2, nq=1, vectors=np.ones((1, 3), np.float32))
    with pytest.raises(ValueError):  # rows of another dim: the copy into the slot fails
        Exchange(slot, bad, None).send()
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE and not bad.posted
    assert conn.req[slot.index].value == 0

    class Broken:
        def release(self) -> None:
            raise BrokerUnavailable("request semaphore vanished")

    conn = FakeConnection(LAY)
    conn.req[0] = Broken()  # type: ignore[call-overload]  # (the slot posts what it was leased with)
    slot = conn.lease(1)[0]
    p = recall(np.ones(8, np.float32), 2)
    with pytest.raises(BrokerUnavailable, match="vanished"):
        Exchange(slot, p, None).send()
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE and not p.posted


def test_complete_reads_the_answer_records_it_and_frees_the_slot(rng):
    matrix = rng.standard_normal((30, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    q = rng.standard_normal(8).astype(np.float32)
    ex = Exchange(slot, recall(q, 6), None, t0=1)
    ex.send()
    conn.resp[slot.index].release()  # a stray post (an earlier owner's): not DONE, not taken
    assert not ex.slot.answered() and conn.resp[slot.index].value == 1
    conn.resp[slot.index].value = 0
    assert conn.serve(topk(matrix)) == 1
    assert ex.slot.answered() and not ex.slot.answered()  # the response post is consumed once
    completion, value, error, round_trip = ex.complete((False,))
    assert completion is Completion.ANSWERED and error is None
    assert isinstance(value, Hits)
    assert_topk(q, matrix, value.ids, value.scores, 6)
    assert round_trip > 0
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE
    assert oks(conn, slot.index, L_RECALL) == 1
    assert counter(conn, slot.index, "timeout_count", L_RECALL) == 0


def test_an_error_answer_fails_the_caller_and_stops_its_write_call(rng):
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    ids = np.arange(4, dtype=np.int64)
    [p] = _requests.upsert(LAY, ids, rng.standard_normal((4, 8)), None, "ns", 1024)
    p.call = WriteCall()
    ex = Exchange(slot, p, None)
    ex.send()
    conn.serve(lambda v, op, k, nq: Status.STORE_ERROR)
    assert ex.slot.answered()
    completion, value, error, _ = ex.complete((False,))
    assert completion is Completion.FAILED and isinstance(error, ServerError)
    assert "STORE_ERROR" in str(error) and value is None
    assert p.call.failed and p.status == Status.STORE_ERROR  # the fate's inputs
    assert counter(conn, slot.index, "err_count", L_UPSERT) == 1
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE


def test_a_caller_that_went_away_is_recorded_as_a_timeout(rng):
    matrix = rng.standard_normal((10, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    ex = Exchange(slot, recall(np.ones(8, np.float32), 2), None, t0=1)
    ex.send()
    conn.serve(topk(matrix))
    assert ex.slot.answered()
    completion, _, _, _ = ex.complete((True,))
    assert completion is Completion.ANSWERED  # the driver drops it: nobody waits
    assert counter(conn, slot.index, "timeout_count", L_RECALL) == 1
    assert oks(conn, slot.index, L_RECALL) == 0


def shared(rng, conn: FakeConnection):
    """Three callers in one slot: recall k=3, recall_many of 2 rows k=5, recall k=1."""
    slot = conn.lease(1)[0]
    qa = rng.standard_normal(8).astype(np.float32)
    qb = rng.standard_normal((2, 8)).astype(np.float32)
    qc = rng.standard_normal(8).astype(np.float32)
    preps = [recall(qa, 3), recall(qb, 5, single=False), recall(qc, 1)]
    parts = [Share(p.nq, p.k, p.single, t0) for p, t0 in zip(preps, (1, 2, 3))]
    ex = Exchange(slot, _requests.recall_group(preps), None, 3, parts)
    ex.send()
    return slot, ex, (qa, qb, qc)


def test_a_shared_slot_is_split_per_caller_each_to_its_own_k(rng):
    matrix = rng.standard_normal((40, 8)).astype(np.float32)
    conn = FakeConnection(LAY)
    slot, ex, (qa, qb, qc) = shared(rng, conn)
    assert int(conn.seg.slots[slot.index]["k"]) == 5 and int(conn.seg.slots[slot.index]["nq"]) == 4
    conn.serve(topk(matrix))
    assert ex.slot.answered()
    completion, value, _, _ = ex.complete([False, True, False])  # recall_many's caller left
    assert completion is Completion.ANSWERED
    a, b, c = value
    assert_topk(qa, matrix, a.ids, a.scores, 3)
    assert isinstance(b, list) and len(b) == 2
    for q, h in zip(qb, b):
        assert_topk(q, matrix, h.ids, h.scores, 5)
    assert_topk(qc, matrix, c.ids, c.scores, 1)
    assert oks(conn, slot.index, L_RECALL) == 2 and oks(conn, slot.index, L_RECALL_MANY) == 0
    assert counter(conn, slot.index, "timeout_count", L_RECALL_MANY) == 1


def test_a_shared_answer_that_overflows_is_resend_alone_and_records_nothing(rng):
    conn = FakeConnection(LAY)
    slot, ex, _ = shared(rng, conn)
    conn.serve(lambda v, op, k, nq: Status.PAYLOAD_TOO_LARGE)
    assert ex.slot.answered()
    completion, _, error, _ = ex.complete([False, False, False])
    assert completion is Completion.RESEND_ALONE and isinstance(error, PayloadTooLarge)
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE
    for field in ("lat_count", "err_count", "timeout_count"):
        assert int(np.asarray(conn.seg.stats[slot.index][field]).sum()) == 0, field
    # one caller's answer that overflows is that caller's error, not a re-send
    single = Exchange(slot, recall(np.ones(8, np.float32), 2), None, 1)
    single.send()
    conn.serve(lambda v, op, k, nq: Status.PAYLOAD_TOO_LARGE)
    assert single.slot.answered()
    completion, _, error, _ = single.complete((False,))
    assert completion is Completion.FAILED and isinstance(error, PayloadTooLarge)


def test_discard_frees_the_slot_without_reading_or_recording(rng):
    conn = FakeConnection(LAY)
    slot = conn.lease(1)[0]
    ex = Exchange(slot, recall(np.ones(8, np.float32), 2), None, 1)
    ex.send()
    conn.serve(lambda v, op, k, nq: Status.BACKEND_ERROR)
    assert ex.slot.answered()
    ex.discard()
    assert int(conn.seg.slots[slot.index]["state"]) == S_FREE
    assert int(np.asarray(conn.seg.stats[slot.index]["err_count"]).sum()) == 0


@pytest.mark.parametrize(
    "op,read",
    [
        (Op.RECALL, True),
        (Op.GET, True),
        (Op.COUNT, True),
        (Op.EXPORT, True),
        (Op.LIST_NAMESPACES, True),
        (Op.UPSERT, False),
        (Op.DELETE, False),
        (Op.DROP_NAMESPACE, False),
    ],
)
def test_only_reads_are_sent_again_after_an_outage_and_only_within_the_budget(op, read):
    p = _requests.Prepared(op, b"ns")
    assert resend_after_outage(p, None, 5.0) is read
    assert resend_after_outage(p, 5.1, 5.0) is read
    assert resend_after_outage(p, 5.0, 5.0) is False and resend_after_outage(p, 4.0, 5.0) is False


def chunk(ids: list[int], posted: bool, status: int | None = None) -> _requests.Prepared:
    p = _requests.Prepared(Op.UPSERT, b"ns", ids=np.array(ids, np.int64))
    p.posted, p.status = posted, status
    return p


def test_settle_sums_a_whole_call_and_raises_what_a_failed_one_means():
    assert settle(Op.UPSERT, [chunk([1], True), chunk([2], True)], [1, 1]) == 2
    cause = ServerError("STORE_ERROR")
    with pytest.raises(ServerError) as e:  # one request: its own error, never a PartialWrite
        settle(Op.UPSERT, [chunk([1, 2], True, Status.STORE_ERROR)], [cause])
    assert e.value is cause
    lost = BrokerUnavailable("gone")
    chunks = [chunk([1, 2], True), chunk([3], True), chunk([4], False), chunk([5], True)]
    with pytest.raises(BrokerUnavailable) as e:
        settle(Op.UPSERT, chunks, [2, lost, None, ServerError("x")])
    err = e.value
    assert isinstance(err, PartialWrite) and err.__cause__ is lost  # the first error is the cause
    assert (err.written, err.unwritten, err.in_doubt) == ((1, 2), (4,), (3, 5))
    nothing = AcquireTimeout("spent")
    with pytest.raises(AcquireTimeout) as e:  # nothing sent at all: the cause as it is
        settle(Op.DELETE, [chunk([1], False), chunk([2], False)], [nothing, None])
    assert e.value is nothing


def test_a_chunk_is_not_sent_once_the_calls_budget_is_spent():
    assert out_of_budget(None, 1e9) is None and out_of_budget(5.0, 4.9) is None
    for now in (5.0, 6.0):
        err = out_of_budget(5.0, now)
        assert isinstance(err, AcquireTimeout) and isinstance(err, KalosError)
        assert "ran out before this part was sent" in str(err)
    assert Fate.NOT_APPLIED.value == "not written"  # what settle names an unsent chunk
