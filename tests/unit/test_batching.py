"""The route of a batch (``sidecar_cuda.serving.batching.classify``), alone: control blocks built with
``broker.layout.slot_dtype()``, or one slot of a segment in anonymous process memory read through
word views; namespaces from a dict. No processes, no shared memory."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import numpy as np
import pytest

from kalos.broker.layout import Flag, Layout, Op, SegmentView, SlotWords, slot_dtype, slot_field_offset
from kalos.sidecar_cuda.serving.batching import Blobs, Limits, Plan, Route, SlotRef, classify

DIM = 8
LIMITS = Limits(k_limit=16, dim=DIM, min_work=-1)
NAMESPACES = {"default": SimpleNamespace(n=1000), "other": SimpleNamespace(n=10)}

pytestmark = pytest.mark.timeout(30)


def lookup(key: tuple[bytes, int]) -> SimpleNamespace | None:
    raw, n = key
    return NAMESPACES.get(bytes(raw[:n]).decode(errors="replace")) if 1 <= n <= 64 else None


def records(n: int, **fields: object) -> np.ndarray:
    """n plain one-query recalls of k=5 in "default"; ``fields`` override (a list: per record)."""
    rec = np.zeros(n, slot_dtype())
    rec["op"], rec["nq"], rec["k"], rec["flags"] = int(Op.RECALL), 1, 5, 0
    rec["namespace"], rec["ns_len"] = b"default", 7
    rec["generation"] = np.arange(n) + 1
    for name, value in fields.items():
        rec[name] = value
    return rec


def slot_ref(blob: bytes = b"", **fields: object) -> SlotRef:
    """Slot 1 of a segment holding the request of :func:`records` (one), as the SINGLE route
    reads it: word by word, in place; ``blob`` in its blob area."""
    layout = Layout(n_slots=3, dim=DIM, max_k=16, max_queries=4, blob_bytes=64)
    mem = mmap.mmap(-1, layout.total_bytes)
    seg = SegmentView(memoryview(mem), layout)
    seg.slots[1] = records(1, **fields)[0]
    seg.slot[1].blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    return SlotRef(
        SlotWords(memoryview(mem), layout),
        mem,
        1,
        slot_field_offset(layout, 1, "namespace"),
        layout.data_base(1) + layout.blob_offset,
        layout.blob_bytes,
    )


def queries(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n, DIM)).astype(np.float32)


def test_one_plain_recall_takes_the_single_route(rng):
    plan = classify(slot_ref(k=16), queries(1, rng), lookup, LIMITS)
    assert plan.route is Route.SINGLE and plan.reason == ""
    assert plan.namespace is NAMESPACES["default"] and plan.k == 16


ONE_REQUEST_PROBLEMS = [  # (fields of the one request, reason)
    (dict(flags=int(Flag.WITH_PAYLOAD)), "payloads requested"),
    (dict(flags=4), "flags=0x4"),
    (dict(k=0), "k=0 out of range 1..16"),
    (dict(k=17), "k=17 out of range 1..16"),
    (dict(k=2**32 - 1), "k=4294967295 out of range 1..16"),
    (dict(op=int(Op.UPSERT)), "op UPSERT is not a recall"),
    (dict(op=99), "op 99 is not a recall"),
    (dict(nq=3), "nq=3: not one query"),
    (dict(nq=0), "nq=0: not one query"),
    (dict(namespace=b"nowhere"), "unknown namespace"),
    (dict(ns_len=0), "unknown namespace"),
]


@pytest.mark.parametrize("fields,reason", ONE_REQUEST_PROBLEMS, ids=[r for _f, r in ONE_REQUEST_PROBLEMS])
def test_one_request_off_the_fast_routes_says_why(rng, fields, reason):
    """The same reason whether the request is read through word views (no batch in flight) or
    from its control block (behind a batch in flight)."""
    q = queries(1, rng)
    for batch in (slot_ref(**fields), records(1, **fields)):
        plan = classify(batch, q, lookup, LIMITS)
        assert plan.route is Route.GENERAL and plan.reason == reason, plan
        assert plan.namespace is None


def test_non_finite_queries_go_the_general_way_and_huge_finite_ones_do_not(rng):
    for bad in (np.nan, np.inf, -np.inf):
        q = queries(1, rng)
        q[0, 3] = bad
        assert classify(slot_ref(), q, lookup, LIMITS).reason == "non-finite query"
        qs = queries(6, rng)
        qs[4, 0] = bad
        assert classify(records(6), qs, lookup, LIMITS).reason == "non-finite query"
    big = np.full((1, DIM), 3e38, np.float32)  # the sum overflows; every value is finite
    with np.errstate(over="ignore"):
        assert classify(slot_ref(), big, lookup, LIMITS).route is Route.SINGLE


def test_one_record_is_a_uniform_batch_behind_a_batch_in_flight(rng):
    plan = classify(records(1, k=7), queries(1, rng), lookup, LIMITS)
    assert plan.route is Route.UNIFORM and plan.reason == "a batch is in flight"
    assert plan.k == 7 and plan.namespace is NAMESPACES["default"] and not plan.pipelined


def test_a_uniform_batch_takes_the_largest_k(rng):
    plan = classify(records(5, k=[1, 9, 3, 16, 2]), queries(5, rng), lookup, LIMITS)
    assert plan.route is Route.UNIFORM and plan.reason == "several requests"
    assert plan.k == 16 and plan.namespace is NAMESPACES["default"]


def test_pipelining_follows_the_work_of_the_batch(rng):
    q = queries(5, rng)
    work = NAMESPACES["default"].n * 5 * DIM
    for min_work, expect in ((-1, False), (0, True), (work, True), (work + 1, False)):
        plan = classify(records(5), q, lookup, LIMITS._replace(min_work=min_work))
        assert plan.route is Route.UNIFORM and plan.pipelined is expect, min_work


@pytest.mark.parametrize(
    "fields,reason",
    [
        (dict(namespace=[b"default", b"other", b"default"], ns_len=[7, 5, 7]), "2 namespaces"),
        (dict(namespace=[b"other", b"other", b"other"], ns_len=5), None),
        (dict(ns_len=[7, 7, 6]), "2 namespaces"),  # same bytes, another length: another field
        (dict(flags=[0, int(Flag.WITH_PAYLOAD), 0]), "payloads requested"),
        (dict(k=[3, 0, 4]), "k=0 out of range 1..16"),  # unsigned: k - 1 wraps for 0
        (dict(op=[int(Op.RECALL), int(Op.RECALL), int(Op.DELETE)]), "op DELETE is not a recall"),
        (dict(nq=[1, 2, 1]), "nq=2: not one query"),
        (dict(namespace=b"nowhere"), "unknown namespace"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_batch_off_the_uniform_route_says_why(rng, fields, reason):
    plan = classify(records(3, **fields), queries(3, rng), lookup, LIMITS)
    if reason is None:
        assert plan.route is Route.UNIFORM and plan.namespace is NAMESPACES["other"]
    elif reason.endswith("namespaces"):  # plain recalls to several namespaces: one mixed search
        assert plan.route is Route.MIXED and plan.reason == reason and plan.namespace is None, plan
    else:
        assert plan.route is Route.GENERAL and plan.reason == reason, plan


def test_a_plan_prints_its_route_and_reason():
    assert repr(Plan(Route.GENERAL, "2 namespaces")) == "Plan(GENERAL, '2 namespaces', k=0)"


def _filtered(n: int, blobs: list[bytes], **fields: object) -> tuple[np.ndarray, Blobs]:
    """n filtered recalls in slots 2, 4, 6...; slot i's blob area holds ``blobs[j]`` (j-th record)."""
    areas = np.zeros((2 * n + 2, 64), np.uint8)
    sel = np.arange(2, 2 * n + 2, 2)
    for j, b in enumerate(blobs):
        areas[sel[j], : len(b)] = np.frombuffer(b, np.uint8)
        areas[sel[j], len(b) :] = 7  # bytes past blob_len are not the filter's
    rec = records(n, flags=int(Flag.WHERE), blob_len=[len(b) for b in blobs], **fields)
    return rec, Blobs(areas, sel)


def test_filtered_recalls_with_one_filter_are_a_uniform_batch(rng):
    f = b'{"c":1}'
    rec, blobs = _filtered(4, [f] * 4, k=[3, 12, 5, 1])
    plan = classify(rec, queries(4, rng), lookup, LIMITS, blobs)
    assert plan.route is Route.UNIFORM and plan.reason == "filtered requests, one filter"
    assert plan.where == f and plan.k == 12 and not plan.pipelined
    assert classify(rec, queries(4, rng), lookup, LIMITS).route is Route.GENERAL  # no blobs given


def test_a_lone_filtered_recall_is_a_uniform_batch_of_one(rng):
    """(Its filter's rows come from the cache and one search serves it, without the general
    route's request-by-request bookkeeping.)"""
    f = b'{"c":{"$in":[1,2]}}'
    rec, blobs = _filtered(1, [f], k=7)
    plan = classify(rec, queries(1, rng), lookup, LIMITS, blobs)
    assert plan.route is Route.UNIFORM and plan.where == f and plan.k == 7
    assert classify(rec, queries(1, rng), lookup, LIMITS).reason == "filtered"  # no blobs given
    rec["flags"] = int(Flag.WHERE | Flag.WITH_PAYLOAD)
    assert classify(rec, queries(1, rng), lookup, LIMITS, blobs).route is Route.GENERAL


@pytest.mark.parametrize(
    "blobs,fields,reason",
    [
        ([b'{"c":1}', b'{"c":2}', b'{"c":1}'], {}, "filtered, with different filters"),
        ([b'{"c":1}', b'{"c":11}', b'{"c":1}'], {}, "filtered, with different filters"),  # lengths
        ([b'{"c":1}'] * 3, dict(flags=[int(Flag.WHERE)] * 2 + [0]), "filtered"),  # mixed
        ([b'{"c":1}'] * 3, dict(flags=int(Flag.WHERE | Flag.WITH_PAYLOAD)), "filtered"),
        ([b""] * 3, {}, "filtered, with different filters"),  # no filter bytes at all
        ([b'{"c":1}'] * 3, dict(blob_len=10**6), "filtered, with different filters"),
        ([b'{"c":1}'] * 3, dict(nq=[1, 2, 1]), "filtered"),
    ],
)
def test_filtered_batches_that_are_not_uniform_say_why(rng, blobs, fields, reason):
    rec, bl = _filtered(3, blobs)
    for name, value in fields.items():
        rec[name] = value
    plan = classify(rec, queries(3, rng), lookup, LIMITS, bl)
    assert plan.route is Route.GENERAL and plan.reason == reason, plan


# --------------------------------------------------------------------------- several rows per request

MULTI = LIMITS._replace(max_queries=4)


def test_query_rows_lists_every_row_of_each_request_in_order():
    from kalos.sidecar_cuda.serving.batching import query_rows

    slots, rows = query_rows(np.array([3, 5, 7]), np.array([2, 1, 3], np.uint32), 4)
    assert slots.tolist() == [3, 3, 5, 7, 7, 7] and rows.tolist() == [0, 1, 0, 0, 1, 2]
    assert query_rows(np.array([3, 5]), np.array([1, 1], np.uint32), 4) is None  # row 0 of each
    assert query_rows(np.array([3, 5]), np.array([2, 0], np.uint32), 4) is None  # nq = 0: general
    assert query_rows(np.array([3, 5]), np.array([2, 5], np.uint32), 4) is None  # over max_queries
    assert query_rows(np.array([3]), np.array([2**32 - 1], np.uint32), 4) is None  # huge (unsigned)


def test_recalls_of_several_rows_each_are_one_uniform_batch(rng):
    plan = classify(records(3, nq=[2, 1, 3]), queries(6, rng), lookup, MULTI)
    assert plan.route is Route.UNIFORM and plan.k == 5 and plan.namespace is NAMESPACES["default"]
    one = classify(records(1, nq=3), queries(3, rng), lookup, MULTI)  # alone, behind a batch in flight
    assert one.route is Route.UNIFORM
    # The pipeline decision counts rows, not requests: 6 rows x 1000 x 8 = 48000 multiply-adds.
    at = MULTI._replace(min_work=48_000)
    assert classify(records(3, nq=[2, 1, 3]), queries(6, rng), lookup, at).pipelined
    assert not classify(records(3, nq=[2, 1, 2]), queries(5, rng), lookup, at).pipelined


@pytest.mark.parametrize(
    "nq,rows,reason",
    [
        ([1, 5, 1], 3, "nq=5 outside 1..4"),  # too many rows: first rows only were gathered
        ([1, 0, 1], 3, "nq=0 outside 1..4"),
        ([2, 1, 3], 3, "query rows not gathered"),  # rows and nq disagree: never searched short
    ],
)
def test_a_batch_of_several_rows_off_the_uniform_route_says_why(rng, nq, rows, reason):
    plan = classify(records(3, nq=nq), queries(rows, rng), lookup, MULTI)
    assert plan.route is Route.GENERAL and plan.reason == reason, plan


def test_a_non_finite_row_anywhere_sends_the_batch_to_the_general_route(rng):
    q = queries(6, rng)
    q[4, 2] = np.nan  # the second row of the third request
    plan = classify(records(3, nq=[2, 1, 3]), q, lookup, MULTI)
    assert plan.route is Route.GENERAL and plan.reason == "non-finite query"


def test_a_lone_filtered_recall_takes_the_single_route_with_its_filter_bytes(rng):
    f = b'{"c":{"$gte":2}}'
    plan = classify(slot_ref(f, flags=int(Flag.WHERE), blob_len=len(f), k=9), queries(1, rng), lookup, LIMITS)
    assert plan.route is Route.SINGLE and plan.where == f and plan.k == 9
    assert classify(slot_ref(k=9), queries(1, rng), lookup, LIMITS).where is None


@pytest.mark.parametrize(
    "blob_len,flags",
    [
        (0, int(Flag.WHERE)),  # no filter bytes
        (65, int(Flag.WHERE)),  # past the blob area (a broken client)
        (2**32 - 1, int(Flag.WHERE)),
        (8, int(Flag.WHERE | Flag.WITH_PAYLOAD)),  # payloads: the general route
    ],
)
def test_a_lone_filtered_recall_the_single_route_cannot_take(rng, blob_len, flags):
    plan = classify(slot_ref(b'{"c":1}', flags=flags, blob_len=blob_len), queries(1, rng), lookup, LIMITS)
    assert plan.route is Route.GENERAL and plan.reason == "filtered", plan
