"""Pure logic, no processes: validation, batch planning, top-k, the namespace store on numpy."""

from __future__ import annotations

import numpy as np
import pytest

from kalos.broker.errors import InvalidRequest
from kalos.broker.layout import Layout, Metric, Op, Status
from kalos.broker.validation import VectorsFor, as_ids, as_vectors, check_k, payload_lines
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend, topk_rows
from kalos.sidecar_cuda.serving.batching import (
    Rejection,
    Request,
    SlotFields,
    pack_offsets,
    parse_request,
    plan_batch,
    posted_slots,
)
from kalos.sidecar_cuda.storage.store import MemoryStore, compaction_moves, last_wins

LAY = Layout(n_slots=4, dim=8, max_k=16, max_queries=4, blob_bytes=1024)


def fields(**kw):
    base = dict(op=1, k=5, nq=1, flags=0, blob_len=0, ns_len=7, namespace=b"default", generation=3, t_post_ns=10)
    base.update(kw)
    return SlotFields(**base)


def test_as_vectors_accepts_and_refuses():
    v = np.arange(8, dtype=np.float32)
    R, M = VectorsFor.RECALL, VectorsFor.RECALL_MANY
    assert as_vectors(v, 8, R, 4).shape == (1, 8)
    assert as_vectors(v.astype(np.float64), 8, R, 4).dtype == np.float32
    assert as_vectors(list(range(8)), 8, R, 4).shape == (1, 8)
    assert as_vectors(np.ones((3, 8)), 8, M, 4).shape == (3, 8)
    for top in (3e38, 2e19):  # x.x overflows (and at 3e38 the sum), the values are finite
        big = np.full(8, top, np.float32)
        with np.errstate(over="ignore"):
            assert as_vectors(big, 8, R, 4).shape == (1, 8)
    for bad, use in [
        (np.ones(7), R),
        (np.ones((2, 8)), R),
        (np.ones((5, 8)), M),
        (np.ones((0, 8)), M),
        (np.array([True] * 8), R),
        (np.array(["x"] * 8), R),
        (np.ones((2, 2, 8)), M),
    ]:
        with pytest.raises(InvalidRequest):
            as_vectors(bad, 8, use, 4)
    for val in (np.nan, np.inf, -np.inf):
        v = np.ones(8, np.float32)
        v[3] = val
        with pytest.raises(InvalidRequest, match="NaN"):
            as_vectors(v, 8, R, 4)


def test_check_k_ids_payloads():
    assert check_k(np.int64(3), 16) == 3
    for k in (0, 17, -1, 2.0, True, "3"):
        with pytest.raises(InvalidRequest):
            check_k(k, 16)
    assert as_ids([1, 2, 3], 3).dtype == np.int64
    for ids, n in (([1, 2], 3), ([-1], 1), ([1.5], 1), ([], 0), ([2**64 - 1], 1)):
        with pytest.raises(InvalidRequest):
            as_ids(ids, n)
    assert payload_lines([{"a": 1}, None], 2) == [b'{"a":1}', b"null"]
    with pytest.raises(InvalidRequest, match="2 payloads for 3"):
        payload_lines([{}, {}], 3)
    with pytest.raises(InvalidRequest, match="row 1"):
        payload_lines([{}, object()], 2)
    with pytest.raises(InvalidRequest, match="row 0"):
        payload_lines([float("nan")], 1)


def test_posted_slots_and_parse():
    states = np.array([0, 2, 3, 2, 4], np.uint32)
    assert posted_slots(states).tolist() == [1, 3]
    r = parse_request(0, fields(), LAY, backend_max_k=1000)
    assert isinstance(r, Request) and r.op == Op.RECALL and r.namespace == "default"
    cases = {
        Status.UNKNOWN_OP: fields(op=42),
        Status.K_OUT_OF_RANGE: fields(k=17),
        Status.TOO_MANY_QUERIES: fields(nq=5),
        Status.BAD_REQUEST: fields(ns_len=0),
    }
    for status, f in cases.items():
        rej = parse_request(2, f, LAY, backend_max_k=1000)
        assert isinstance(rej, Rejection) and rej.status == status and rej.generation == 3
    assert isinstance(parse_request(0, fields(k=10), LAY, backend_max_k=8), Rejection)
    assert isinstance(parse_request(0, fields(blob_len=5000), LAY, 1000), Rejection)
    assert isinstance(parse_request(0, fields(op=int(Op.LIST_NAMESPACES), ns_len=0, namespace=b""), LAY, 1000), Request)


def test_plan_batch_orders_writes_by_post_time_and_groups_recalls():
    reqs = [
        Request(0, Op.RECALL, "a", 5, 1, 0, 30, 1),
        Request(1, Op.UPSERT, "a", 0, 1, 0, 20, 1),
        Request(2, Op.DELETE, "a", 0, 1, 0, 10, 1),
        Request(3, Op.RECALL, "b", 5, 1, 0, 5, 1),
        Request(4, Op.RECALL, "a", 5, 2, 0, 1, 1),
        Request(5, Op.LIST_NAMESPACES, "", 0, 0, 0, 2, 1),
    ]
    plan = plan_batch(reqs)
    assert [r.slot for r in plan.writes] == [2, 1]
    assert {ns: [r.slot for r in g] for ns, g in plan.recalls.items()} == {"a": [4, 0], "b": [3]}
    assert [r.slot for r in plan.others] == [5]
    assert pack_offsets([2, 1, 3]).tolist() == [0, 2, 3, 6]


def test_topk_rows_against_float64(rng):
    for b, n, k in [(1, 1, 1), (1, 5, 10), (3, 100, 7), (1, 1000, 100), (5, 17, 17), (2, 64, 1)]:
        s = rng.standard_normal((b, n)).astype(np.float32)
        rows, vals = topk_rows(s, k)
        kk = min(k, n)
        assert rows.shape == vals.shape == (b, kk)
        ref = np.sort(s.astype(np.float64), axis=1)[:, ::-1][:, :kk]
        np.testing.assert_array_equal(vals, ref.astype(np.float32))
        np.testing.assert_array_equal(np.take_along_axis(s, rows, axis=1), vals)
        for row in rows:
            assert len(set(row.tolist())) == kk


def test_last_wins_and_compaction_moves(rng):
    ids = np.array([5, 3, 5, 9, 3, 3])
    keep = last_wins(ids)
    assert ids[keep].tolist() == [5, 9, 3] and keep.tolist() == [2, 3, 5]
    assert last_wins(np.array([7])).tolist() == [0]
    for _ in range(200):
        n = int(rng.integers(1, 50))
        holes = rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
        src, dst = compaction_moves(holes, n)
        live = np.setdiff1d(np.arange(n), holes)
        new_n = n - len(holes)
        after = np.arange(n)
        after[dst] = after[src]
        assert sorted(after[:new_n].tolist()) == live.tolist()


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2], ids=["dot", "cosine", "l2"])
def test_store_upsert_delete_search_match_reference(rng, metric):
    """The store on the numpy backend against a dict of vectors, through grow and compaction."""
    store = MemoryStore(NumpyBackend(), 6, metric)
    ns = store.get_or_create("x", capacity=4)
    ref: dict[int, np.ndarray] = {}
    for _step in range(60):
        if rng.random() < 0.6 or not ref:
            ids = rng.integers(0, 300, size=int(rng.integers(1, 20)))
            vecs = rng.standard_normal((len(ids), 6)).astype(np.float32)
            ns.upsert(ids, vecs, None)
            for i, v in zip(ids.tolist(), vecs):
                ref[i] = v
        else:
            ids = rng.choice(list(ref) + [999, 1000], size=int(rng.integers(1, 10)))
            removed = ns.delete(ids)
            assert removed == len({i for i in ids.tolist() if i in ref})
            for i in ids.tolist():
                ref.pop(i, None)
        assert ns.n == len(ref)
        q = rng.standard_normal((2, 6)).astype(np.float32)
        got_ids, got_scores = ns.search(q, 8)
        if not ref:
            assert got_ids.shape == (2, 0)
            continue
        keys = np.array(sorted(ref))
        m = np.stack([ref[i] for i in keys]).astype(np.float64)
        q64 = q.astype(np.float64)
        if metric == Metric.COSINE:
            m /= np.linalg.norm(m, axis=1, keepdims=True)
            q64 /= np.linalg.norm(q64, axis=1, keepdims=True)
        s = -((m[None] - q64[:, None]) ** 2).sum(-1) if metric == Metric.L2 else q64 @ m.T
        kk = min(8, len(keys))
        for j in range(2):
            kth = np.sort(s[j])[::-1][kk - 1]
            pos = np.searchsorted(keys, got_ids[j])
            assert (keys[pos] == got_ids[j]).all(), "an id that is not stored"
            assert (s[j][pos] >= kth - 1e-4).all()
            np.testing.assert_allclose(got_scores[j], s[j][pos], rtol=1e-4, atol=1e-4)
    assert ns.matrix.capacity >= ns.n


def test_pipeline_decision():
    from kalos.sidecar_cuda.serving.batching import PIPELINE_MIN_WORK, pipelined

    assert not pipelined(10**15, -1)  # --pipeline off
    assert pipelined(0, 0) and pipelined(1, 0)  # --pipeline on
    assert not pipelined(PIPELINE_MIN_WORK - 1, PIPELINE_MIN_WORK)  # auto: small batches stay serial
    assert pipelined(PIPELINE_MIN_WORK, PIPELINE_MIN_WORK)
    # The sizes measured on the H200: 1M x 768 with ~115 queries a batch is pipelined, 100k x 768
    # with ~128 and 256 x 128 with ~124 are not.
    assert pipelined(1_000_000 * 115 * 768, PIPELINE_MIN_WORK)
    assert not pipelined(100_000 * 128 * 768, PIPELINE_MIN_WORK)
    assert not pipelined(256 * 124 * 128, PIPELINE_MIN_WORK)
