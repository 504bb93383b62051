"""The compiled slot path (clients/_cslot.c) against the Python one, the reference: the same
requests written through both into two segments laid out in bytearrays (clients/fake.py) leave
the same bytes; the same answers, honest or hostile, give the same values and the same errors;
the latency records are the same words; the extension was built against broker/layout.py; its
semaphore type attaches to existing semaphores only. Random data, seeds printed (conftest)."""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType, SimpleNamespace

import numpy as np
import posix_ipc
import pytest

from kalos.broker import layout as L
from kalos.broker.errors import BrokerUnavailable, ConfigError, InvalidRequest, KalosError, ProtocolError
from kalos.broker.layout import Layout, Op, Status
from kalos.broker.positions import Position
from kalos.broker.slotpath import PURE_ENV, REQUIRE_ENV, Choice, SlotPath, choose
from kalos.broker.validation import VectorsFor, as_vectors
from kalos.clients import _exchange, _requests
from kalos.clients._coalesce import Share, split
from kalos.clients._exchange import Completion, Exchange
from kalos.clients._slots import (
    ClientSlot,
    CompiledSlot,
    NativeSemaphore,
    compiled_protocol,
    default_slot_path,
    load_compiled,
)
from kalos.clients.fake import FakeConnection
from kalos.clients.results import Hits

LAY = Layout(n_slots=3, dim=16, max_k=12, max_queries=6, blob_bytes=2048)
PYTHON = Choice(SlotPath.PYTHON, None, "test")


@pytest.fixture(scope="module")
def cslot() -> ModuleType:
    """The extension; a skip where it is not built, a failure where the suite requires it."""
    try:
        return load_compiled()
    except ImportError as e:
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV}=1 and the compiled slot path does not load: {e}")
        pytest.skip(f"the compiled slot path is not built: {e}")


def twins(cslot: ModuleType, layout: Layout = LAY) -> tuple[FakeConnection, FakeConnection]:
    """A segment on each path, the same layout and header (the epoch written alike)."""
    py = FakeConnection(layout, slot_path=PYTHON)
    c = FakeConnection(layout, slot_path=Choice(SlotPath.COMPILED, cslot, "test"))
    c.seg.header["start_epoch_ns"] = py.seg.header["start_epoch_ns"]
    return py, c


def t_post_words(layout: Layout) -> list[int]:
    return [L.slot_field_offset(layout, i, "t_post_ns") for i in range(layout.n_slots)]


def same_bytes(a: FakeConnection, b: FakeConnection, t_before: int, t_after: int) -> None:
    """Every byte alike but the posting times (each path reads the clock), which must both lie
    between ``t_before`` and ``t_after`` where a request was posted since the last look (they
    are then cleared in both segments: nothing reads them but the sidecar's metrics)."""
    for off in t_post_words(a.layout):
        tx, ty = (int.from_bytes(m[off : off + 8], "little") for m in (a.mm, b.mm))
        assert (tx == 0) == (ty == 0)
        if tx:
            assert t_before <= tx <= t_after and t_before <= ty <= t_after
        a.mm[off : off + 8] = b.mm[off : off + 8] = bytes(8)
    x, y = bytes(a.mm), bytes(b.mm)
    if x != y:
        diff = np.flatnonzero(np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8))
        raise AssertionError(f"{len(diff)} bytes differ, the first at offset {int(diff[0])}")


def hits_equal(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            hits_equal(x, y)
        return
    if isinstance(a, Hits):
        assert isinstance(b, Hits)
        for u, v in ((a.ids, b.ids), (a.scores, b.scores)):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)
        assert a.payloads == b.payloads
        return
    if isinstance(a, tuple):  # an export page
        assert isinstance(b, tuple)
        for x, y in zip(a, b):
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y
        return
    if isinstance(a, _requests.Records):
        assert isinstance(b, _requests.Records)
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.missing, b.missing)
        assert a.payloads == b.payloads
        return
    assert a == b and repr(a) == repr(b)


# ------------------------------------------------------------------------------ the build


def test_the_extension_was_built_against_this_layout(cslot):
    want = compiled_protocol()
    assert cslot.PROTOCOL_VERSION == L.PROTOCOL_VERSION
    assert set(cslot.PROTOCOL) <= set(want)
    assert {k: want[k] for k in cslot.PROTOCOL} == dict(cslot.PROTOCOL)
    for name, _t, off in L.SLOT_FIELDS:  # (compiled_protocol itself is layout.py's)
        assert want[f"slot.{name}"] == off


def test_an_extension_built_against_another_layout_is_refused(cslot, monkeypatch):
    monkeypatch.setitem(cslot.PROTOCOL, "slot.n_results", L.slot_field_offset(LAY, 0, "n_results") + 4)
    with pytest.raises(ImportError, match="slot.n_results"):
        load_compiled()
    quiet = choose({}, load_compiled)
    assert quiet.path is SlotPath.PYTHON and "another protocol layout" in quiet.reason
    with pytest.raises(ConfigError, match="not built"):
        choose({REQUIRE_ENV: "1"}, load_compiled)


def test_choose_follows_the_environment(cslot):
    assert choose({}, lambda: cslot).path is SlotPath.COMPILED
    assert choose({PURE_ENV: "1"}, lambda: cslot).path is SlotPath.PYTHON
    assert choose({PURE_ENV: "0"}, lambda: cslot).path is SlotPath.COMPILED

    def missing() -> ModuleType:
        raise ImportError("not built")

    assert choose({}, missing).path is SlotPath.PYTHON
    with pytest.raises(ConfigError):
        choose({REQUIRE_ENV: "1"}, missing)
    with pytest.raises(ConfigError, match="both"):
        choose({REQUIRE_ENV: "1", PURE_ENV: "1"}, lambda: cslot)


def test_the_suite_runs_the_path_its_environment_names():
    """``make test`` runs the suite with KALOS_REQUIRE_COMPILED=1, then the unit and ipc layers
    with KALOS_PURE_PYTHON=1: each run must run the path it claims (the fakes too)."""
    conn = FakeConnection(LAY)
    [slot] = conn.lease(1)
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        assert default_slot_path().path is SlotPath.COMPILED
        assert conn.slot_path.path is SlotPath.COMPILED and type(slot) is CompiledSlot
    elif os.environ.get(PURE_ENV, "") not in ("", "0"):
        assert default_slot_path().path is SlotPath.PYTHON
        assert conn.slot_path.path is SlotPath.PYTHON and type(slot) is ClientSlot
    else:
        assert type(slot) is (CompiledSlot if conn.slot_path.path is SlotPath.COMPILED else ClientSlot)


# ------------------------------------------------------------------------------ requests


def random_request(rng: np.random.Generator, cslot: ModuleType | None) -> _requests.Prepared:
    """One request of any operation, recalls most often, built as the clients build them."""
    ns = [b"default", b"user-7", b"a" * 64, b"x"][int(rng.integers(4))]
    kind = int(rng.integers(10))
    k = int(rng.integers(1, LAY.max_k + 1))
    if kind <= 3:
        return _requests.recall(
            LAY, rng.standard_normal(LAY.dim, dtype=np.float32), k, ns, False, _requests.ONE, None, cslot
        )
    if kind == 4:
        n = int(rng.integers(1, LAY.max_queries + 1))
        q = rng.standard_normal((n, LAY.dim), dtype=np.float32)
        return _requests.recall(LAY, q, k, ns, bool(rng.integers(2)), _requests.ROWS, None, cslot)
    if kind == 5:
        where = {"tag": str(rng.integers(100))}
        return _requests.recall(LAY, rng.standard_normal(LAY.dim), k, ns, False, _requests.ONE, where, cslot)
    if kind == 6:
        n = int(rng.integers(1, LAY.max_queries + 1))
        preps = _requests.upsert(
            LAY, np.arange(n) * 3, rng.standard_normal((n, LAY.dim)), [{"i": i} for i in range(n)], "ns", 1024
        )
        return preps[0]
    if kind == 7:
        return _requests.delete(LAY, rng.integers(0, 1000, 4), "ns")[0]
    if kind == 8:
        p = _requests.get(LAY, rng.integers(0, 1000, 3), "ns", True)[0]
        _requests.wait_after([p], Position(5, 7), 10, None)
        return p
    return _requests.count(LAY, "ns", {"n": {"$gt": 3}})


def answer_for(rng: np.random.Generator):
    """A fixed honest answer per request (drawn once, played to both twins)."""
    ids = rng.integers(0, 10**6, (LAY.max_queries, LAY.max_k)).astype(np.int64)
    scores = rng.standard_normal((LAY.max_queries, LAY.max_k)).astype(np.float32)

    def answer(v, op, k, nq):
        if op == Op.RECALL:
            n = min(k, 7)
            return ids[:nq, :n], scores[:nq, :n]
        if op == Op.COUNT:
            return 42
        return Status.UNKNOWN_NAMESPACE if op == Op.GET else 3

    return answer


def test_requests_leave_the_same_bytes_and_answers_the_same_values(cslot, rng, monkeypatch):
    py, c = twins(cslot)
    sp, sc = py.lease(LAY.n_slots), c.lease(LAY.n_slots)
    assert all(type(s) is ClientSlot for s in sp) and all(type(s) is CompiledSlot for s in sc)
    # The latency a completion records is read off the clock: one fixed clock for both twins.
    clock = SimpleNamespace(monotonic_ns=lambda: 10**12)
    monkeypatch.setattr(_exchange, "time", clock)
    seen_ops = set()
    for _round in range(120):
        i = int(rng.integers(LAY.n_slots))
        state = int(rng.integers(2**32))
        p_py = random_request(np.random.default_rng(state), None)
        p_c = random_request(np.random.default_rng(state), cslot)
        seen_ops.add((p_py.op, p_py.single, bool(p_py.blob)))
        assert p_py.vectors is None or np.array_equal(p_py.vectors, p_c.vectors)
        t0 = int(rng.integers(1, 10**12))
        before = time.monotonic_ns()
        ex_py, ex_c = Exchange(sp[i], p_py, None, t0), Exchange(sc[i], p_c, None, t0)
        ex_py.send()
        ex_c.send()
        same_bytes(py, c, before, time.monotonic_ns())
        answer = answer_for(np.random.default_rng(state))
        assert py.serve(answer) == 1 and c.serve(answer) == 1
        assert sp[i].answered() and sc[i].answered()
        gone = (bool(rng.integers(4) == 0),)
        out_py, out_c = ex_py.complete(gone), ex_c.complete(gone)
        assert out_py[0] is out_c[0] and out_py[3] == out_c[3]
        hits_equal(out_py[1], out_c[1])
        assert type(out_py[2]) is type(out_c[2]) and str(out_py[2]) == str(out_c[2])
        same_bytes(py, c, before, time.monotonic_ns())  # results, stats blocks, states
    assert len(seen_ops) >= 6


def test_a_shared_slot_leaves_the_same_bytes_and_splits_alike(cslot, rng, monkeypatch):
    monkeypatch.setattr(_exchange, "time", SimpleNamespace(monotonic_ns=lambda: 10**12))
    py, c = twins(cslot)
    [a], [b] = py.lease(1), c.lease(1)
    for _ in range(20):
        sizes = [int(x) for x in rng.integers(1, 3, int(rng.integers(2, 4)))]
        while sum(sizes) > LAY.max_queries:
            sizes.pop()
        ks = [int(x) for x in rng.integers(1, LAY.max_k + 1, len(sizes))]
        qs = [rng.standard_normal((n, LAY.dim)).astype(np.float32) for n in sizes]
        state = int(rng.integers(2**32))
        out = []
        for conn, slot, fast in ((py, a, None), (c, b, cslot)):
            preps = [
                _requests.recall(
                    LAY,
                    q[0] if n == 1 else q,
                    k,
                    b"ns",
                    False,
                    (_requests.ONE if n == 1 else _requests.ROWS),
                    None,
                    fast,
                )
                for q, n, k in zip(qs, sizes, ks)
            ]
            parts = [Share(p.nq, p.k, p.single, 5 + j) for j, p in enumerate(preps)]
            ex = Exchange(slot, _requests.recall_group(preps), None, 9, parts)
            ex.send()
            conn.serve(answer_for(np.random.default_rng(state)))
            assert slot.answered()
            out.append(ex.complete([False] * len(parts)))
        assert out[0][0] is out[1][0] is Completion.ANSWERED
        hits_equal(out[0][1], out[1][1])
        same_bytes(py, c, 0, time.monotonic_ns())


# ------------------------------------------------------------------------------ hostile answers

HOSTILE = [
    ("resp_generation", "+1"),
    ("resp_generation", 0),
    ("n_results", "k+1"),
    ("n_results", LAY.max_k + 1),
    ("n_results", 2**32 - 1),
    ("blob_len", LAY.blob_bytes + 1),
    ("blob_len", 2**32 - 1),
    ("status", 99),
    ("status", -(2**31)),  # (an i32 field)
    ("status", -1),
    ("status", int(Status.BAD_REQUEST)),
    ("status", int(Status.NOT_FINITE)),
    ("status", int(Status.PAYLOAD_TOO_LARGE)),
    ("blob_len", LAY.blob_bytes),  # honest: a full blob area (ok unless payloads are decoded)
]


@pytest.mark.parametrize("field,value", HOSTILE)
@pytest.mark.parametrize("shape", ["recall", "recall_many", "with_payload", "shared"])
def test_a_hostile_answer_gives_the_same_error_on_both_paths(cslot, rng, field, value, shape):
    py, c = twins(cslot)
    results = []
    q = rng.standard_normal((3, LAY.dim)).astype(np.float32)
    detail = rng.integers(32, 127, 40).astype(np.uint8)
    for conn in (py, c):
        fast = conn.cslot
        [slot] = conn.lease(1)
        parts = None
        if shape == "recall":
            p = _requests.recall(LAY, q[0], 5, b"ns", False, _requests.ONE, None, fast)
        elif shape == "recall_many":
            p = _requests.recall(LAY, q, 5, b"ns", False, _requests.ROWS, None, fast)
        elif shape == "with_payload":
            p = _requests.recall(LAY, q[0], 5, b"ns", True, _requests.ONE, None, fast)
        else:
            preps = [_requests.recall(LAY, r, 5, b"ns", False, _requests.ONE, None, fast) for r in q]
            parts = [Share(1, 5, True, 1)] * 3
            p = _requests.recall_group(preps)
        ex = Exchange(slot, p, None, 1, parts)
        ex.send()
        conn.serve(answer_for(np.random.default_rng(1)))
        rec = conn.seg.slots[slot.index]
        v = conn.seg.slot[slot.index]
        v.blob[:40] = detail  # an error's detail text, or garbage where payload lines should be
        if field == "resp_generation":
            rec[field] = int(rec["generation"]) + 1 if value == "+1" else value
        elif value == "k+1":
            rec[field] = p.k + 1
        else:
            rec[field] = value
        assert slot.answered()
        results.append(ex.complete([False] * (len(parts) if parts else 1)))
    (cp, vp, ep, _), (cc, vc, ec, _) = results
    assert cp is cc
    assert type(ep) is type(ec) and str(ep) == str(ec)
    if ep is None:
        hits_equal(vp, vc)
    else:
        assert isinstance(ep, KalosError)
        if field != "status" or value < 0 or value == 99:
            assert isinstance(ep, ProtocolError), ep


def test_bounds_are_checked_before_anything_is_copied(cslot):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    assert isinstance(slot, CompiledSlot)
    p = _requests.recall(LAY, np.ones(LAY.dim, np.float32), 4, b"ns", False, _requests.ONE, None, cslot)
    Exchange(slot, p, None, 1).send()
    rec = c.seg.slots[slot.index]
    rec["resp_generation"], rec["status"], rec["blob_len"] = slot.generation, 0, 0
    rec["n_results"] = LAY.max_k * 1000  # would read past the slot's result area
    with pytest.raises(ProtocolError, match="results per query for k=4"):
        slot.read_hits(1, 4, True)
    rec["n_results"] = 4
    with pytest.raises(ValueError):  # the caller's own arguments are checked too
        slot.read_hits(LAY.max_queries + 1, 4, False)
    with pytest.raises(ValueError):
        slot.read_hits(1, LAY.max_k + 1, True)
    assert len(slot.read_hits(1, 4, True)) == 4


# ------------------------------------------------------------------------------ latency records

EDGES = [0, 1, 4999, 5000, 5001, 10**6, 10**10, L.RING_NS_MAX - 1, L.RING_NS_MAX, 2**63 - 1, 2**63, 2**70, -1, -(2**70)]


def test_records_are_the_same_words(cslot, rng):
    py, c = twins(cslot)
    [a], [b] = py.lease(1), c.lease(1)
    lats = EDGES + list(L.LATENCY_BOUNDS_NS) + [x + 1 for x in L.LATENCY_BOUNDS_NS]
    lats += rng.integers(0, 2**40, 200).tolist()
    for lat in lats:
        for op in range(L.LATENCY_OPS):
            ok = bool(rng.integers(4))
            timed_out = bool(rng.integers(2))
            a.record(lat, ok, timed_out, op)
            b.record(lat, ok, timed_out, op)
            same_bytes(py, c, 0, 0)
    assert int(py.seg.stats[0]["lat_count"]) > 0  # (the edges left some records standing)


@pytest.mark.parametrize("field", ["hist", "lat_sum_ns", "lat_count", "err_count", "timeout_count"])
def test_a_counter_left_at_its_limit_resets_the_block_alike(cslot, field):
    """An earlier owner may leave any value in a stats block (untrusted): a counter that cannot
    be incremented starts the block over, on both paths."""
    py, c = twins(cslot)
    for conn in (py, c):
        [slot] = conn.lease(1)
        st = conn.seg.stats[0]
        if field == "hist":
            conn.seg.slot[0].hist[L.L_GET, :] = 2**64 - 1
        elif field == "lat_count":
            st[field] = 2**64 - 1
        else:
            st[field][L.L_GET] = 2**64 - 1 if field != "lat_sum_ns" else 2**64 - 10
        conn.seg.slot[0].ring[3] = 77
        slot.record(12345, field not in ("err_count", "timeout_count"), field == "timeout_count", L.L_GET)
        assert not any(bytes(conn.mm[LAY.stats_base(0) : LAY.stats_base(0) + L.STATS_BYTES]))
    same_bytes(py, c, 0, 0)


def test_record_refuses_an_op_outside_the_table(cslot):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    with pytest.raises(ValueError):
        slot.record(10, True, False, L.LATENCY_OPS)


# ------------------------------------------------------------------------------ answered, post


def test_answered_consumes_a_post_only_when_done(cslot):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    resp = c.resp[slot.index]
    Exchange(slot, _requests.recall(LAY, np.ones(LAY.dim, np.float32), 2, b"ns", False, _requests.ONE), None, 1).send()
    resp.release()  # a stray post (an earlier owner's): not DONE, not taken
    assert not slot.answered() and resp.value == 1
    resp.value = 0
    c.seg.slots[slot.index]["state"] = L.S_DONE  # DONE, its post not there yet
    assert not slot.answered() and slot.is_done()
    resp.release()
    assert slot.answered() and resp.value == 0 and not slot.answered()
    slot.set_free()
    assert int(c.seg.slots[slot.index]["state"]) == L.S_FREE


@pytest.mark.parametrize(
    "rows",
    [
        np.ones((1, LAY.dim + 1), np.float32),
        np.ones((1, LAY.dim), np.float64),
        np.ones((LAY.max_queries + 1, LAY.dim), np.float32),
        np.ones((0, LAY.dim), np.float32),
        np.ones((2, LAY.dim * 2), np.float32)[:, ::2],
        np.ones(LAY.dim, np.float32),
        np.ones((1, LAY.dim), ">f4"),
    ],
    ids=["dim", "float64", "too many", "none", "strided", "1-d", "big-endian"],
)
def test_rows_the_slot_cannot_take_are_refused_before_a_byte_is_written(cslot, rows):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    before = bytes(c.mm)
    p = _requests.Prepared(Op.RECALL, b"ns", k=2, nq=len(rows), vectors=rows)
    with pytest.raises(ValueError, match="rows must be"):
        Exchange(slot, p, None, 1).send()
    assert bytes(c.mm) == before and not p.posted
    with pytest.raises(ValueError, match="namespace"):
        slot.post_rows(np.ones((1, LAY.dim), np.float32), 2, b"n" * 65, 0)
    assert bytes(c.mm[: LAY.data_offset]) == before[: LAY.data_offset]


def test_the_doorbell_is_posted_only_while_the_sidecar_sleeps(cslot):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    p = _requests.recall(LAY, np.ones(LAY.dim, np.float32), 2, b"ns", False, _requests.ONE, None, cslot)
    Exchange(slot, p, None, 1).send()
    assert c.bell.value == 0 and c.req[slot.index].value == 1
    c.seg.header["sidecar_sleeping"] = 1
    c.seg.slots[slot.index]["state"] = L.S_FREE
    Exchange(slot, p, None, 1).send()
    assert c.bell.value == 1 and c.req[slot.index].value == 2


def test_a_slot_is_made_only_over_its_own_segment(cslot):
    buf = bytearray(LAY.total_bytes)
    kw = dict(
        buffer=buf,
        index=0,
        control_base=LAY.control_base(0),
        stats_base=LAY.stats_base(0),
        data_base=LAY.data_base(0),
        slot_bytes=LAY.slot_bytes,
        query_offset=LAY.query_offset,
        ids_offset=LAY.ids_offset,
        result_ids_offset=LAY.result_ids_offset,
        result_scores_offset=LAY.result_scores_offset,
        blob_offset=LAY.blob_offset,
        dim=LAY.dim,
        max_k=LAY.max_k,
        max_queries=LAY.max_queries,
        blob_bytes=LAY.blob_bytes,
        sleeping_offset=L.header_field_offset("sidecar_sleeping"),
        bounds=L.LATENCY_BOUNDS_NS,
        req=None,
        resp=None,
        bell=None,
    )
    cslot.Slot(**kw)
    for change in (
        {"data_base": LAY.data_base(LAY.n_slots)},  # past the end
        {"control_base": LAY.total_bytes - 8},
        {"blob_bytes": LAY.slot_bytes},
        {"max_queries": LAY.max_queries * 100},
        {"result_ids_offset": LAY.result_ids_offset + 4},  # misaligned words
        {"buffer": bytearray(LAY.total_bytes - 1), "data_base": LAY.data_base(LAY.n_slots - 1)},
        {"bounds": L.LATENCY_BOUNDS_NS[:-1]},
    ):
        with pytest.raises(ValueError):
            cslot.Slot(**{**kw, **change})
    with pytest.raises((TypeError, BufferError)):  # read-only
        cslot.Slot(**{**kw, "buffer": bytes(LAY.total_bytes)})


# ------------------------------------------------------------------------------ vectors

GOOD = [
    np.arange(LAY.dim, dtype=np.float32),
    np.full(LAY.dim, 3e38, np.float32),  # finite, though x.x overflows
]


def bad_vectors() -> list[object]:
    nan = np.ones(LAY.dim, np.float32)
    nan[3] = np.nan
    inf = np.ones(LAY.dim, np.float32)
    inf[-1] = -np.inf

    class Sub(np.ndarray):
        pass

    return [
        nan,
        inf,
        np.ones(LAY.dim, np.float64),
        np.ones(LAY.dim, np.int32),
        np.ones(LAY.dim, ">f4"),
        np.ones(LAY.dim * 2, np.float32)[::2],
        np.ones(LAY.dim + 1, np.float32),
        np.ones((1, LAY.dim), np.float32),
        np.ones(LAY.dim, np.float32).view(Sub),
        list(range(LAY.dim)),
        "x" * LAY.dim,
        np.array([1e39] * LAY.dim),
    ]


def test_as_row_takes_what_as_vectors_fast_path_takes_and_nothing_else(cslot):
    for x in GOOD:
        row = cslot.as_row(x, LAY.dim)
        ref = as_vectors(x, LAY.dim, VectorsFor.RECALL, LAY.max_queries)
        assert row.shape == ref.shape == (1, LAY.dim) and row.dtype == ref.dtype
        np.testing.assert_array_equal(row, ref)
        assert np.shares_memory(row, x) and row.flags.c_contiguous
    for x in bad_vectors():
        assert cslot.as_row(x, LAY.dim) is None, x


def test_as_rows_takes_a_finite_float32_matrix_and_nothing_else(cslot, rng):
    q = rng.standard_normal((4, LAY.dim)).astype(np.float32)
    assert cslot.as_rows(q, LAY.dim, LAY.max_queries) is q
    assert as_vectors(q, LAY.dim, VectorsFor.RECALL_MANY, LAY.max_queries) is q
    bad = q.copy()
    bad[1, 2] = np.inf
    for x in (
        bad,
        q[:, :-1],
        q.astype(np.float64),
        q.T.copy().T,
        np.ones((LAY.max_queries + 1, LAY.dim), np.float32),
        np.ones((0, LAY.dim), np.float32),
        q[0],
    ):
        assert cslot.as_rows(x, LAY.dim, LAY.max_queries) is None


@pytest.mark.parametrize("single", [True, False])
def test_recall_encodes_alike_and_refuses_alike_with_the_compiled_check(cslot, single):
    inputs = [*GOOD, *bad_vectors(), np.ones((3, LAY.dim), np.float32), np.ones((3, LAY.dim))]
    for x in inputs:
        outs = []
        for fast in (None, cslot):
            try:
                p = _requests.recall(LAY, x, 3, b"ns", False, (_requests.ONE if single else _requests.ROWS), None, fast)
                outs.append(("ok", p.vectors.shape, p.vectors.dtype, p.vectors.tobytes(), p.nq, p.k))
            except InvalidRequest as e:
                outs.append(("error", str(e)))
        assert outs[0] == outs[1], x


# ------------------------------------------------------------------------------ semaphores


@pytest.fixture
def named_semaphore():
    name = f"/kalos-test-{os.getpid()}-{time.monotonic_ns()}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600)
    yield name, sem
    sem.close()
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def test_the_native_semaphore_attaches_posts_and_waits(cslot, named_semaphore):
    name, theirs = named_semaphore
    ours = NativeSemaphore(name, "test", cslot)
    assert not ours.try_acquire()
    ours.release()
    assert theirs.value == 1 and ours.try_acquire() and theirs.value == 0
    assert not ours.acquire(0.01)  # timed out
    theirs.release()
    assert ours.acquire(5.0)
    threading.Timer(0.05, theirs.release).start()
    assert ours.acquire(5.0)  # woken by another thread's post (the GIL released meanwhile)
    ours.close()
    ours.close()  # twice is fine
    with pytest.raises(BrokerUnavailable, match="test"):
        ours.release()
    with pytest.raises(BrokerUnavailable):
        ours.try_acquire()


def test_the_native_semaphore_never_creates_one(cslot):
    name = f"/kalos-test-missing-{os.getpid()}"
    with pytest.raises(BrokerUnavailable, match="No such file"):
        NativeSemaphore(name, "test", cslot)
    assert not os.path.exists(f"/dev/shm/sem.{name[1:]}")


def test_closing_while_another_thread_waits_waits_for_it(cslot, named_semaphore):
    name, theirs = named_semaphore
    sem = cslot.Sem(name)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(sem.wait(0.3)))
    t.start()
    time.sleep(0.05)
    sem.close()  # deferred: the waiter still uses it
    t.join(5)
    assert got == [False]
    with pytest.raises(OSError):
        sem.post()
    assert theirs.value == 0


def test_shares_that_do_not_add_up_are_refused_as_split_refuses_them(cslot):
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    assert isinstance(slot, CompiledSlot)
    p = _requests.recall(LAY, np.ones((2, LAY.dim), np.float32), 3, b"ns", False, _requests.ROWS, None, cslot)
    Exchange(slot, p, None, 1).send()
    c.serve(answer_for(np.random.default_rng(0)))
    shares = [Share(1, 3, True, 0)]
    with pytest.raises(ValueError) as compiled:
        slot.read_hits(2, 3, False, shares)
    with pytest.raises(ValueError) as python:
        split(slot.read_hits(2, 3, False), shares)
    assert str(compiled.value) == str(python.value) == "2 rows of hits for 1 rows asked"


def test_the_callers_of_a_shared_slot_are_recorded_alike(cslot, rng):
    py, c = twins(cslot)
    [a], [b] = py.lease(1), c.lease(1)
    now = 10**12
    t0s = [now - 1, now - 7000, now, now + 5, 0, -(2**63), 2**63 - 1, *rng.integers(0, now, 40).tolist()]
    for _ in range(60):
        m = int(rng.integers(1, 8))
        shares = [Share(1, 3, bool(rng.integers(2)), int(t0s[int(rng.integers(len(t0s)))])) for _ in range(m)]
        gone = [bool(rng.integers(3) == 0) for _ in range(m)]
        ok = bool(rng.integers(4))
        ops = (int(rng.integers(L.LATENCY_OPS)), int(rng.integers(L.LATENCY_OPS)))
        a.record_shares(now, shares, gone, ok, *ops)
        b.record_shares(now, shares, gone, ok, *ops)
        same_bytes(py, c, 0, 0)
    with pytest.raises(ValueError):
        b.record_shares(now, [Share(1, 3, True, 0)], [], True, 0, 1)


def test_the_module_refuses_misuse_with_clear_errors(cslot):
    with pytest.raises(TypeError):
        cslot.configure(ProtocolError)  # two classes
    with pytest.raises(TypeError):
        cslot.configure(1, 2)
    with pytest.raises(TypeError):
        cslot.as_row(np.ones(3, np.float32))
    with pytest.raises(TypeError):
        cslot.Sem(5)
    _py, c = twins(cslot)
    [slot] = c.lease(1)
    assert isinstance(slot, CompiledSlot)
    with pytest.raises(TypeError):
        slot.native.post(1, 1, "ns", 1, 1, 0, 0)  # the namespace is bytes
    with pytest.raises(ValueError):
        slot.native.post(1, 1, b"ns", -1, 1, 0, 0)  # a u32 field
    with pytest.raises(ValueError):
        slot.native.post(1, 1, b"ns", 1, 2**32, 0, 0)
    assert int(c.seg.slots[slot.index]["state"]) == L.S_FREE  # nothing written
