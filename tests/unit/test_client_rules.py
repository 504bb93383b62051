"""The clients' rules as pure functions (no processes): the one vector rule, how writes are
chunked and what a failed write means per id, and attaching within a budget (driven by a fake
clock, so "no pause past the deadline" is checked exactly, not timed)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kalos.broker.errors import (
    BrokerUnavailable,
    ConfigError,
    InvalidRequest,
    PartialWrite,
    PayloadTooLarge,
    ResponseTimeout,
    ServerError,
    SlotsExhausted,
    UntrustedBroker,
)
from kalos.broker.layout import Layout, Op, SidecarState, Status
from kalos.broker.validation import VectorsFor, as_vectors
from kalos.clients import _requests
from kalos.clients._attach import BACKOFF_MAX_S, attach, pause_within
from kalos.clients._transport import Connection
from kalos.clients._writes import Fate, failure, fate, last_wins, pack
from kalos.clients.fake import FakeConnection

LAY = Layout(n_slots=4, dim=8, max_k=8, max_queries=4, blob_bytes=64)
R, M, U = VectorsFor.RECALL, VectorsFor.RECALL_MANY, VectorsFor.UPSERT


# --------------------------------------------------------------------------- the vector rule


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.int64, np.uint16, np.longdouble])
def test_any_real_dtype_is_converted_to_float32(rng, dtype):
    x = (rng.standard_normal(8) * 50).astype(dtype)
    for use, arr, shape in ((R, x, (1, 8)), (M, np.stack([x, x]), (2, 8)), (U, np.stack([x, x, x]), (3, 8))):
        out = as_vectors(arr, 8, use, 4)
        assert out.dtype == np.float32 and out.shape == shape and out.flags.c_contiguous
        np.testing.assert_array_equal(out[0], x.astype(np.float32))


def test_shapes_are_exact_and_the_message_names_both():
    cases = [
        (
            R,
            np.ones((1, 8)),
            r"recall takes one vector of shape \(8,\); got \(1, 8\): use "
            r"recall_many for several queries, or vec\[0\]",
        ),
        (R, np.ones((3, 8)), r"got \(3, 8\): use recall_many"),
        (R, np.ones(7), r"shape \(8,\); got \(7,\): dimension mismatch, the broker serves dim=8"),
        (R, np.float32(1.0), r"shape \(8,\); got \(\)"),
        (
            M,
            np.ones(8),
            r"recall_many takes a matrix of shape \(n, 8\); got \(8,\): use recall "
            r"for one vector, or vec\[None\]",
        ),
        (M, np.ones((5, 8)), r"5 rows in one request; this broker allows 1..4"),
        (M, np.ones((0, 8)), r"got \(0, 8\): no rows"),
        (M, np.ones((2, 7)), r"dimension mismatch"),
        (
            U,
            np.ones(8),
            r"upsert takes a matrix of shape \(n, 8\), one row per id; got \(8,\): "
            r"pass vec\[None\] for one record",
        ),
        (U, np.ones((2, 2, 8)), r"got \(2, 2, 8\)"),
    ]
    for use, x, msg in cases:
        with pytest.raises(InvalidRequest, match=msg):
            as_vectors(x, 8, use, 4)


def test_refusals_are_invalid_request_with_a_reason():
    big = np.ones(8)
    big[2] = 1e39  # finite in float64, infinite in float32
    bad = [
        (np.ones(8, bool), "real numbers"),
        (np.ones(8, complex), "real numbers"),
        (np.array(["1"] * 8), "real numbers"),
        (np.array([{}] * 8, dtype=object), "real numbers"),
        (big, "does not fit in float32"),
        ([[1.0] * 8, [1.0] * 7], "numeric array"),
        (np.full(8, np.nan), "NaN"),
        (np.full(8, np.inf, np.float64), "NaN"),
    ]
    for x, why in bad:
        for use in (R, M, U):
            arr = x if use is R or not isinstance(x, np.ndarray) else x[None]
            with pytest.raises(InvalidRequest, match=why):
                as_vectors(arr, 8, use, 4)


def test_recall_and_upsert_requests_apply_the_rule():
    """The request builders of both clients go through as_vectors: recall of a (1, dim) array
    and upsert of one (dim,) vector are refused, float64 rows are stored as float32."""
    ns = b"default"
    with pytest.raises(InvalidRequest, match="vec\\[0\\]"):
        _requests.recall(LAY, np.ones((1, 8)), 3, ns, False, _requests.ONE)
    with pytest.raises(InvalidRequest, match="vec\\[None\\]"):
        _requests.recall(LAY, np.ones(8), 3, ns, False, _requests.ROWS)
    with pytest.raises(InvalidRequest, match="vec\\[None\\]"):
        _requests.upsert(LAY, [1], np.ones(8), None, "default", 16384)
    (p,) = _requests.upsert(LAY, [1, 2], np.full((2, 8), 0.1), None, "default", 16384)
    assert p.vectors is not None and p.vectors.dtype == np.float32


# --------------------------------------------------------------------------- write chunks


def test_pack_respects_rows_and_blob_bytes(rng):
    for _ in range(200):
        n = int(rng.integers(1, 40))
        lines = [b"x" * int(rng.integers(1, 30)) for _ in range(n)]
        max_rows, blob = int(rng.integers(1, 6)), int(rng.integers(30, 80))
        chunks = pack(lines, n, max_rows, blob, 1 << 20)
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))  # consecutive, no gaps
        for lo, hi in chunks:
            assert 1 <= hi - lo <= max_rows
            assert len(b"\n".join(lines[lo:hi])) <= blob
            if hi < n:  # a chunk is cut only when the next row would not fit
                assert hi - lo == max_rows or len(b"\n".join(lines[lo : hi + 1])) > blob
    assert pack(None, 10, 4, 8, 16) == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(PayloadTooLarge, match="row 2 takes 9 bytes; a request carries at most 8"):
        pack([b"1", b"2", b"x" * 9], 3, 4, 8, 16)


def test_upsert_is_validated_whole_before_any_chunk(rng):
    """A bad row anywhere fails the call while building it: nothing exists to be sent."""
    vecs = rng.standard_normal((10, 8))
    pls: list[object] = [{"i": i} for i in range(10)]
    for mutate, err in [
        (lambda v, p, i: v.__setitem__((9, 3), np.nan), InvalidRequest),
        (lambda v, p, i: i.__setitem__(9, -1), InvalidRequest),
        (lambda v, p, i: p.__setitem__(9, {"x": object()}), InvalidRequest),
        (lambda v, p, i: p.__setitem__(9, "y" * 100), PayloadTooLarge),
    ]:
        v, p, ids = vecs.copy(), list(pls), list(range(10))
        mutate(v, p, ids)
        with pytest.raises(err, match="row 9|NaN|>= 0"):
            _requests.upsert(LAY, ids, v, p, "default", 16384)


def test_duplicate_ids_keep_their_last_row_across_chunks(rng):
    ids = np.array([5, 1, 2, 5, 3, 1, 4, 6, 5])
    keep = last_wins(ids)
    assert keep is not None and ids[keep].tolist() == [2, 3, 1, 4, 6, 5]
    assert last_wins(np.array([1, 2, 3])) is None
    vecs = rng.standard_normal((9, 8)).astype(np.float32)
    preps = _requests.upsert(LAY, ids, vecs, [{"row": r} for r in range(9)], "default", 16384)
    got_ids = np.concatenate([p.ids for p in preps])
    got_vecs = np.concatenate([p.vectors for p in preps])
    assert got_ids.tolist() == [2, 3, 1, 4, 6, 5]
    np.testing.assert_array_equal(got_vecs, vecs[keep])
    assert b"\n".join(p.blob for p in preps).count(b'"row":8') == 1  # id 5's last row


def test_pack_refuses_a_payload_over_the_sidecars_limit_before_anything_is_built():
    lines = [b"1", b"x" * 300, b"2"]
    assert pack(lines, 3, 4, 4096, 300) == [(0, 3)]
    with pytest.raises(PayloadTooLarge, match="row 1 takes 301 bytes, over the sidecar's --payload-limit of 300"):
        pack([b"1", b"x" * 301, b"2"], 3, 4, 4096, 300)
    with pytest.raises(PayloadTooLarge, match="row 6 takes"):
        _requests.upsert(
            LAY, np.arange(9), np.ones((9, 8)), [None] * 6 + [{"t": "x" * 30}] + [None] * 2, "default", payload_limit=20
        )


def test_fate_of_a_chunk():
    assert fate(True, True, None) is Fate.APPLIED
    assert fate(False, False, None) is Fate.NOT_APPLIED  # never posted
    assert fate(False, True, None) is Fate.IN_DOUBT  # posted, never answered
    for s in (
        Status.PAYLOAD_TOO_LARGE,
        Status.STORE_ERROR,
        Status.CAPACITY,
        Status.BAD_ID,
        Status.NOT_FINITE,
        Status.BAD_REQUEST,
    ):
        assert fate(False, True, s) is Fate.NOT_APPLIED, s
    for s in (Status.BACKEND_ERROR, Status.SERVER_ERROR, 99):  # after the commit, or unknown
        assert fate(False, True, s) is Fate.IN_DOUBT, s


def test_failure_is_the_cause_when_nothing_happened_else_a_partial_write():
    ids = [np.array([1, 2]), np.array([3, 4]), np.array([5])]
    cause = PayloadTooLarge("PAYLOAD_TOO_LARGE: a payload of 20008 bytes exceeds the limit")
    nothing = [Fate.NOT_APPLIED] * 3
    assert failure(Op.UPSERT, cause, ids, nothing) is cause
    e = failure(Op.UPSERT, BrokerUnavailable("gone"), ids, [Fate.APPLIED, Fate.IN_DOUBT, Fate.NOT_APPLIED])
    assert isinstance(e, PartialWrite) and isinstance(e, BrokerUnavailable)
    assert (e.written, e.in_doubt, e.unwritten) == ((1, 2), (3, 4), (5,))
    assert "of 5 ids in 3 requests stopped part way: 2 written, 1 not, 2 in doubt" in str(e)
    assert "BrokerUnavailable: gone" in str(e)
    one = BrokerUnavailable("in flight")  # one request: the sidecar applies it whole or not
    assert failure(Op.UPSERT, one, ids[:1], [Fate.IN_DOUBT]) is one
    t = failure(Op.DELETE, ResponseTimeout("late"), ids, [Fate.APPLIED] * 2 + [Fate.IN_DOUBT])
    assert isinstance(t, TimeoutError) and isinstance(t, PartialWrite) and "2 deleted" not in str(t)
    assert "4 deleted" in str(t)
    s = failure(Op.UPSERT, ServerError("STORE_ERROR"), ids, [Fate.IN_DOUBT] + [Fate.NOT_APPLIED] * 2)
    assert isinstance(s, ServerError) and s.written == () and s.in_doubt == (1, 2)


# --------------------------------------------------------------------------- attaching


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drive(steps, clock: Clock, deadline: float | None) -> tuple[object, list[float]]:
    """Run an attach generator, advancing the fake clock by each pause; every pause must fit
    in what is left of the budget at the moment it is asked for."""
    pauses = []
    try:
        while True:
            pause = next(steps)
            assert pause > 0
            if deadline is not None:
                assert clock.now + pause <= deadline + 1e-12, (clock.now, pause, deadline)
            pauses.append(pause)
            clock.now += pause
    except StopIteration as done:
        return done.value, pauses


def absent(clock: Clock, cost: float):
    """A connect that finds no sidecar, each attempt costing ``cost`` seconds of the clock."""

    def connect(name, uid):
        clock.now += cost
        raise BrokerUnavailable(f"no sidecar serves broker {name!r}")

    return connect


@pytest.mark.parametrize("budget", [0.0, 0.003, 0.05, 0.31, 2.0])
def test_reattach_never_pauses_past_the_deadline(budget, seed):
    """The root cause of issue 22 item 17: the blocking client checked its deadline, then slept
    a full backoff (up to 0.2 s) before giving up. Now each pause is clipped to the budget
    left, so a call ends at most one attempt after its deadline."""
    for trial in range(50):
        clock, cost = Clock(), 0.001
        deadline = clock.now + budget
        steps = attach(
            absent(clock, cost),
            "n",
            None,
            size=1,
            min_size=1,
            deadline=deadline,
            wait_for_sidecar=True,
            within="within the budget",
            clock=clock,
            rng=random.Random(seed + trial),
        )
        with pytest.raises(BrokerUnavailable, match="no sidecar served it within the budget"):
            drive(steps, clock, deadline)
        assert clock.now - deadline <= cost + 1e-12  # over by one attempt at most


def test_pause_within():
    assert pause_within(0.2, None, 5.0) == 0.2
    assert pause_within(0.2, 5.05, 5.0) == pytest.approx(0.05)
    assert pause_within(0.01, 6.0, 5.0) == 0.01
    assert pause_within(0.2, 5.0, 5.0) is None and pause_within(0.2, 4.0, 5.0) is None
    # the unclipped backoff the old loop slept is what overran: up to BACKOFF_MAX_S
    assert BACKOFF_MAX_S >= 0.1


def test_without_reconnect_no_sidecar_fails_at_once_with_a_command_that_works():
    clock = Clock()
    steps = attach(
        lambda name, uid: Connection(name),
        "t-nosuch-unit",
        None,
        size=1,
        min_size=1,
        deadline=clock.now + 30,
        wait_for_sidecar=False,
        within="within 30 s",
        clock=clock,
        rng=random.Random(1),
    )
    with pytest.raises(BrokerUnavailable) as e:
        drive(steps, clock, clock.now + 30)
    assert clock.now == 100.0  # not one pause
    msg = str(e.value)
    assert "`kalos serve --name t-nosuch-unit --ephemeral --dim DIM --metric METRIC`" in msg and "--data-dir DIR" in msg
    assert "DIM the length of your vectors, METRIC dot, cosine or l2" in msg
    assert "reconnect=False" in msg


def test_a_loading_sidecar_is_waited_for_within_the_budget_even_without_reconnect():
    clock = Clock()
    conn = FakeConnection(LAY)
    conn.seg.header["state"] = SidecarState.STARTING
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=2,
        min_size=1,
        deadline=clock.now + 0.1,
        wait_for_sidecar=False,
        within="within 0.1 s",
        clock=clock,
        rng=random.Random(1),
    )
    with pytest.raises(BrokerUnavailable, match="still starting .* not ready within 0.1 s"):
        drive(steps, clock, clock.now + 0.1)
    assert conn.closed and clock.now == pytest.approx(100.1)
    conn2 = FakeConnection(LAY)
    conn2.seg.header["state"] = SidecarState.STARTING
    steps = attach(
        lambda name, uid: conn2,
        "f",
        None,
        size=2,
        min_size=1,
        deadline=None,
        wait_for_sidecar=False,
        within="",
        clock=clock,
        rng=random.Random(1),
    )
    assert next(steps) > 0
    conn2.seg.header["state"] = SidecarState.READY  # loaded
    (got, slots), _ = drive(steps, clock, None)
    assert got is conn2 and len(slots) == 2


def test_size_above_the_slot_count_is_a_config_error_naming_both():
    conn = FakeConnection(LAY)
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=5,
        min_size=1,
        deadline=None,
        wait_for_sidecar=True,
        within="",
        clock=Clock(),
        rng=random.Random(1),
        for_pool=True,
    )
    with pytest.raises(ConfigError, match=r"size=5 asks for more slots than broker 'f' has \(4\).*--slots"):
        drive(steps, Clock(), None)
    assert conn.closed and conn.seg.slots["owner_pid"].tolist() == [0, 0, 0, 0]


def test_slots_held_by_live_processes_fail_at_once_as_slots_exhausted():
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"] = [0, 7, 7, 8]
    clock = Clock()
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=3,
        min_size=2,
        deadline=clock.now + 10,
        wait_for_sidecar=True,
        within="within 10 s",
        clock=clock,
        rng=random.Random(1),
        for_pool=True,
    )
    with pytest.raises(SlotsExhausted) as e:
        drive(steps, clock, clock.now + 10)
    assert not isinstance(e.value, BrokerUnavailable) and clock.now == 100.0
    msg = str(e.value)
    assert "has 4 slots: 3 leased by other pools (of this or other processes), 1 free" in msg
    assert "needs at least 2" in msg and "--slots" in msg and "waited" not in msg
    assert conn.seg.slots["owner_pid"].tolist() == [0, 7, 7, 8]  # the one free slot given back
    conn.seg.slots["owner_pid"] = [7, 7, 7, 8]
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=1,
        min_size=1,
        deadline=None,
        wait_for_sidecar=True,
        within="",
        clock=clock,
        rng=random.Random(1),
    )
    with pytest.raises(SlotsExhausted, match="4 leased by other pools .* a RecallClient needs one"):
        drive(steps, clock, None)


def test_slots_being_reclaimed_are_waited_for():
    conn = FakeConnection(LAY)
    conn.seg.slots["owner_pid"] = [7, 7, 8, 8]
    conn.dead = {8}  # exited: the sidecar's reaper will free its slots
    clock = Clock()
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=2,
        min_size=2,
        deadline=clock.now + 1,
        wait_for_sidecar=True,
        within="within 1 s",
        clock=clock,
        rng=random.Random(1),
    )
    with pytest.raises(SlotsExhausted, match="2 being reclaimed.*waited within 1 s"):
        drive(steps, clock, clock.now + 1)
    clock = Clock()
    steps = attach(
        lambda name, uid: conn,
        "f",
        None,
        size=2,
        min_size=2,
        deadline=clock.now + 1,
        wait_for_sidecar=True,
        within="within 1 s",
        clock=clock,
        rng=random.Random(1),
    )
    next(steps)
    conn.seg.slots["owner_pid"] = [7, 7, 0, 0]  # the reaper ran
    (_got, slots), _ = drive(steps, clock, clock.now + 1)
    assert sorted(s.index for s in slots) == [2, 3]


def test_an_untrusted_broker_is_never_waited_for():
    clock = Clock()

    def squatted(name, uid):
        raise UntrustedBroker("owned by uid 1234")

    steps = attach(
        squatted,
        "f",
        None,
        size=1,
        min_size=1,
        deadline=clock.now + 10,
        wait_for_sidecar=True,
        within="",
        clock=clock,
        rng=random.Random(1),
    )
    with pytest.raises(UntrustedBroker):
        drive(steps, clock, None)
    assert clock.now == 100.0


def test_a_segment_still_being_created_is_retried_not_fatal():
    """A sidecar creates its segment, sizes it and writes the magic last. A client arriving in
    between used to sleep 50 ms (unclipped) and then fail for good with ProtocolError, which
    broke a pool re-attaching to a restarting sidecar; now it is BrokerUnavailable, which the
    attach loop retries within the budget. A wrong (non-zero) magic is still a ProtocolError."""
    import mmap
    import os

    import posix_ipc

    from kalos.broker.errors import ProtocolError
    from kalos.broker.names import shm_name

    name = f"t{os.getpid()}-starting"
    shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        with pytest.raises(BrokerUnavailable, match="still starting"):
            Connection(name)
        os.ftruncate(shm.fd, LAY.total_bytes)
        with pytest.raises(BrokerUnavailable, match="still starting"):
            Connection(name)
        clock = Clock()
        steps = attach(
            lambda n, uid: Connection(n),
            name,
            None,
            size=1,
            min_size=1,
            deadline=clock.now + 0.05,
            wait_for_sidecar=True,
            within="within 0.05 s",
            clock=clock,
            rng=random.Random(1),
        )
        with pytest.raises(BrokerUnavailable, match="no sidecar served it within 0.05 s"):
            drive(steps, clock, clock.now + 0.05)
        with mmap.mmap(shm.fd, LAY.total_bytes) as mm:
            mm[:8] = b"NOTKALOS"
        with pytest.raises(ProtocolError, match="bad magic"):
            Connection(name)
    finally:
        shm.close_fd()
        shm.unlink()
