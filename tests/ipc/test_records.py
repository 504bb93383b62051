"""Records by id (GET) and filtered operations against a real sidecar, checked against what was
upserted (and a numpy float64 reference for recalls)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import wait_until

import kalos.clients._requests as _requests
from kalos.broker.errors import InvalidRequest, PayloadTooLarge, ProtocolError
from kalos.broker.layout import HIT_META_BYTES, Flag, Layout, Op, SegmentView, Status
from kalos.clients import RecallClient, RecallPool, Records
from kalos.clients._slots import ClientSlot
from kalos.clients._transport import Connection

pytestmark = pytest.mark.timeout(120)

DIM = 16


@pytest.fixture
def small(sidecar_factory):
    """An empty numpy sidecar: dim 16, max_queries 8 (so gets of more ids are chunked)."""
    return sidecar_factory(
        "rec", "--dim", str(DIM), "--slots", "8", "--max-k", "64", "--max-queries", "8", "--backend", "numpy"
    )


def records(rng: np.random.Generator, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray, list[object]]:
    ids = np.arange(start, start + n, dtype=np.int64) * 3 + 1
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    pls: list[object] = [None if j % 5 == 0 else {"j": int(j), "tag": f"t{j % 7}", "x": [j, "y"]} for j in range(n)]
    return ids, vecs, pls


@pytest.mark.asyncio
async def test_get_returns_records_in_the_order_asked_and_the_missing(small, rng):
    ids, vecs, pls = records(rng, 50)
    async with RecallPool(small.name, size=4) as pool:
        await pool.upsert(ids, vecs, pls, namespace="n")
        order = rng.permutation(len(ids))
        asked = np.concatenate([ids[order[:20]], [2, 5, 10**12], ids[order[20:23]], ids[order[:1]]])
        got = await pool.get(asked, namespace="n")
        assert isinstance(got, Records)
        want = [i for i in asked.tolist() if i in set(ids.tolist())]
        assert got.ids.tolist() == want  # order asked, 25 ids over 4 chunks of 8
        assert got.missing.tolist() == [2, 5, 10**12]
        pos = {int(i): j for j, i in enumerate(ids.tolist())}
        assert got.vectors is not None and got.vectors.dtype == np.float32
        np.testing.assert_allclose(got.vectors, vecs[[pos[i] for i in want]], rtol=1e-6, atol=0)
        assert got.payloads == [pls[pos[i]] for i in want]
        none = await pool.get([3, 8], namespace="n", with_vectors=False)
        assert len(none) == 0 and none.vectors is None and none.missing.tolist() == [3, 8]
        lean = await pool.get(ids[:3], namespace="n", with_vectors=False)
        assert lean.vectors is None and lean.ids.tolist() == ids[:3].tolist()
        # a delete and a replacement are seen by the next get
        await pool.delete(ids[:1], namespace="n")
        await pool.upsert(ids[1:2], vecs[2:3], [{"new": True}], namespace="n")
        after = await pool.get(ids[:2], namespace="n")
        assert after.ids.tolist() == [int(ids[1])] and after.missing.tolist() == [int(ids[0])]
        assert after.payloads == [{"new": True}]
        np.testing.assert_allclose(after.vectors, vecs[2:3], rtol=1e-6)


def test_get_blocking_client_and_cosine_rows_as_stored(sidecar_factory, rng):
    h = sidecar_factory("cos", "--dim", str(DIM), "--metric", "cosine", "--max-queries", "4", "--backend", "numpy")
    ids, vecs, pls = records(rng, 10)
    with RecallClient(h.name, timeout=10) as c:
        c.upsert(ids, vecs, pls)
        got = c.get(ids[::-1])
        unit = vecs / np.linalg.norm(vecs.astype(np.float64), axis=1, keepdims=True)
        assert got.ids.tolist() == ids[::-1].tolist() and got.missing.size == 0
        np.testing.assert_allclose(got.vectors, unit[::-1], rtol=1e-5, atol=1e-6)
        assert got.payloads == pls[::-1]
        nope = c.get([1, 2], namespace="nope")  # a namespace never written: no record, no error
        assert nope.ids.tolist() == [] and nope.missing.tolist() == [1, 2] and nope.payloads == []
        assert nope.vectors is not None and nope.vectors.shape == (0, DIM)


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [[], [-1], [1.5], [[1, 2]], ["a"], np.array([2**64 - 1], np.uint64)])
async def test_get_bad_ids_fail_before_shared_memory(small, bad):
    async with RecallPool(small.name, size=1) as pool:
        with pytest.raises(InvalidRequest):
            await pool.get(bad)
        with pytest.raises(InvalidRequest):
            await pool.get([1], namespace="no spaces")
        assert pool.statistics().requests == 0  # nothing was sent


@pytest.mark.asyncio
async def test_get_of_an_unknown_namespace_is_empty_and_payloads_too_large(sidecar_factory, rng):
    h = sidecar_factory("big", "--dim", str(DIM), "--blob-bytes", "4096", "--max-queries", "8", "--backend", "numpy")
    async with RecallPool(h.name, size=2) as pool:
        nope = await pool.get(np.arange(20), namespace="nope")  # (3 chunks, each answered empty)
        assert nope.ids.tolist() == [] and nope.missing.tolist() == list(range(20)) and nope.payloads == []
        ids = np.arange(8)
        for lo in (0, 4):  # 4 payloads fit a request, 8 do not
            await pool.upsert(ids[lo : lo + 4], rng.standard_normal((4, DIM)), [{"s": "x" * 900}] * 4)
        with pytest.raises(PayloadTooLarge):
            await pool.get(ids)
        got = await pool.get(ids[:2])
        assert got.payloads == [{"s": "x" * 900}] * 2


def raw_get(
    c: Connection, slot: ClientSlot, ids: list[int], ns: bytes, flags: int = 0, blob: bytes = b"", op: int = int(Op.GET)
) -> tuple[int, int, str]:
    """A request written by hand (no client-side checks): (status, n_results, detail)."""
    slot.view.ids[: len(ids)] = ids
    slot.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    slot.post(op, ns, 1, len(ids), flags, len(blob), 0)
    assert wait_until(lambda: slot.is_done() and slot.try_consume(), 10)
    status, n, blen = slot.outcome()
    detail = slot.blob_text(blen).decode(errors="replace")
    slot.set_free()
    return status, n, detail


def test_get_written_by_hand_negative_ids_and_nq_out_of_range(small, rng):
    with RecallClient(small.name) as client:
        client.upsert([1, 2], rng.standard_normal((2, DIM)))
        c = Connection(small.name)
        slot = c.lease(1)[0]
        try:
            assert raw_get(c, slot, [1, -5], b"default")[0] == Status.BAD_ID
            assert raw_get(c, slot, [], b"default")[0] == Status.TOO_MANY_QUERIES
            assert raw_get(c, slot, [2, 3, 1], b"default")[:2] == (Status.OK, 2)
            # A namespace never written: its ids are checked all the same, and none exists.
            assert raw_get(c, slot, [1, -5], b"nope")[0] == Status.BAD_ID
            assert raw_get(c, slot, [2, 3, 1], b"nope")[:2] == (Status.OK, 0)
        finally:
            c.give_back([slot], [])
            c.close()
        assert small.proc.poll() is None


def _answer(ids_out: list[int], blob: bytes, asked: list[int], meta: int | None = None) -> object:
    """A GET answer read by the client: ``ids_out``, then ``meta`` HIT_META records (default:
    one per id, as the sidecar writes them with Flag.TIMES) and the payload lines ``blob``."""
    L = Layout(n_slots=1, dim=2, max_k=2, max_queries=4, blob_bytes=1024)
    seg = SegmentView(memoryview(bytearray(L.total_bytes)), L)
    v = seg.slot[0]
    v.ids[: len(ids_out)] = ids_out
    blob = bytes(HIT_META_BYTES * (len(ids_out) if meta is None else meta)) + blob
    v.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    p = _requests.get(L, asked, "default", True)[0]
    return _requests.read(v, (int(Status.OK), len(ids_out), len(blob)), p)


@pytest.mark.parametrize(
    "ids_out, blob, asked",
    [
        ([1, 2, 3], b"null\nnull\nnull", [1, 2]),  # more records than ids asked
        ([1, 2], b"null", [1, 2]),  # payload lines do not match
        ([1, 9], b"null\nnull", [1, 2]),  # an id that was not asked for
        ([1, 2], b"", [1, 2]),  # timestamps cut short (below)
    ],
)
def test_get_answer_that_breaks_the_protocol(ids_out, blob, asked):
    with pytest.raises(ProtocolError):
        _answer(ids_out, blob, asked, meta=None if blob else 1)
    ok = _answer([2], b'{"a":1}', [1, 2])
    assert isinstance(ok, Records) and ok.ids.tolist() == [2] and ok.missing.tolist() == [1]


# --------------------------------------------------------------------------- filtered operations

_ABSENT = object()


def _eq(a: object, b: object) -> bool:
    """Reference equality of a payload value and a filter scalar (bools are not numbers)."""
    if isinstance(a, (list, dict)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return a == b


def ref_match(doc: object, where: dict) -> bool:
    """An independent reference of the documented filter semantics, on the decoded payload."""
    for key, cond in where.items():
        if key == "$or":
            if not any(ref_match(doc, c) for c in cond):
                return False
            continue
        if key == "$and":
            if not all(ref_match(doc, c) for c in cond):
                return False
            continue
        v = doc.get(key, _ABSENT) if isinstance(doc, dict) else _ABSENT
        present = v is not _ABSENT
        conds = cond.items() if isinstance(cond, dict) else [("$eq", cond)]
        for op, arg in conds:
            num = present and isinstance(v, (int, float)) and not isinstance(v, bool)
            ok = {
                "$eq": lambda: present and _eq(v, arg),
                "$ne": lambda: not (present and _eq(v, arg)),
                "$in": lambda: present and any(_eq(v, a) for a in arg),
                "$nin": lambda: not (present and any(_eq(v, a) for a in arg)),
                "$exists": lambda: present == arg,
                "$gt": lambda: num and v > arg,
                "$gte": lambda: num and v >= arg,
                "$lt": lambda: num and v < arg,
                "$lte": lambda: num and v <= arg,
            }[op]()
            if not ok:
                return False
    return True


def random_payload(rng: np.random.Generator, j: int) -> object:
    r = rng.random()
    if r < 0.05:
        return None
    if r < 0.08:
        return [1, 2]  # not an object: matches no condition on a field
    doc: dict[str, object] = {}
    if rng.random() < 0.85:
        doc["color"] = f"c{int(rng.integers(20))}"
    x = rng.random()
    doc["n"] = (
        int(rng.integers(100))
        if x < 0.6
        else float(rng.integers(100)) + 0.5
        if x < 0.75
        else None
        if x < 0.85
        else True
        if x < 0.9
        else "7"
    )
    if x >= 0.95:
        del doc["n"]
    doc["flag"] = bool(rng.integers(2))
    if rng.random() < 0.3:
        doc["tags"] = ["a", "b"] if rng.random() < 0.5 else "a"
    doc["uid"] = j
    return doc


FILTERS: list[dict] = (
    [
        {},
        {"color": "c3"},
        {"color": "nope"},
        {"n": 7},
        {"n": 7.0},
        {"n": True},
        {"n": None},
        {"n": "7"},
        {"flag": False},
        {"tags": "a"},
    ]
    + [  # selectivities from 0 to 100 %
        {"color": {"$in": [f"c{i}" for i in range(k)]}} for k in (0, 1, 2, 5, 10, 19, 20)
    ]
    + [
        {"color": {"$nin": ["c1", "c2"]}},
        {"color": {"$ne": "c1"}},
        {"n": {"$ne": None}},
        {"n": {"$gt": 50}},
        {"n": {"$gte": 50, "$lt": 60}},
        {"n": {"$lte": 0.5}},
        {"n": {"$lt": -1}},
        {"n": {"$exists": False}},
        {"color": {"$exists": True}, "flag": True},
        {"$or": [{"color": "c1"}, {"n": {"$gt": 90}}]},
        {"$and": [{"flag": True}, {"$or": [{"n": {"$in": [1, 2, 3, None]}}, {"tags": {"$exists": True}}]}]},
        {"uid": {"$gte": 100, "$lt": 103}},
        {"uid": 5, "color": {"$ne": "zzz"}},
    ]
)


def check_filtered(
    q: np.ndarray,
    vecs: np.ndarray,
    ids: np.ndarray,
    match: np.ndarray,
    hits_ids: np.ndarray,
    hits_scores: np.ndarray,
    k: int,
    what: str,
) -> None:
    """Hits against a float64 reference restricted to the matching rows."""
    m = int(match.sum())
    assert len(hits_ids) == min(k, m), (what, len(hits_ids), m)
    if not m:
        return
    pos = {int(i): j for j, i in enumerate(ids.tolist())}
    got = np.array([pos[int(i)] for i in hits_ids])
    assert match[got].all(), f"{what}: a hit outside the filter"
    assert len(set(got.tolist())) == len(got), what
    ref = vecs.astype(np.float64) @ q.astype(np.float64)
    kth = np.sort(ref[match])[::-1][min(k, m) - 1]
    tol = 1e-5 * (np.abs(ref).max() + 1)
    assert (ref[got] >= kth - tol).all(), f"{what}: hits outside the top-{k} of the matches"
    np.testing.assert_allclose(hits_scores, ref[got], atol=tol, err_msg=what)


async def _load(
    pool: RecallPool, rng: np.random.Generator, n: int, ns: str = "f"
) -> tuple[np.ndarray, np.ndarray, list[object]]:
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    pls = [random_payload(rng, j) for j in range(n)]
    await pool.upsert(ids, vecs, pls, namespace=ns)
    return ids, vecs, pls


@pytest.fixture
def fsc(sidecar_factory):
    return sidecar_factory(
        "flt", "--dim", str(DIM), "--slots", "8", "--max-k", "128", "--max-queries", "64", "--backend", "numpy"
    )


@pytest.mark.asyncio
async def test_filtered_recall_count_export_match_the_reference(fsc, rng):
    async with RecallPool(fsc.name, size=4) as pool:
        ids, vecs, pls = await _load(pool, rng, 1500)
        for where in FILTERS:
            match = np.array([ref_match(p, where) for p in pls])
            what = f"where={where} ({match.sum()} match)"
            assert await pool.count("f", where) == match.sum(), what
            q = rng.standard_normal(DIM).astype(np.float32)
            for k in (1, 10, 128):
                h = await pool.recall(q, k, namespace="f", where=where)
                check_filtered(q, vecs, ids, match, h.ids, h.scores, k, f"{what} k={k}")
            qs = rng.standard_normal((3, DIM)).astype(np.float32)
            many = await pool.recall_many(qs, 20, namespace="f", where=where, with_payload=True)
            pos = {int(i): j for j, i in enumerate(ids.tolist())}
            for qq, h in zip(qs, many):
                check_filtered(qq, vecs, ids, match, h.ids, h.scores, 20, what + " many")
                assert h.payloads == [pls[pos[int(i)]] for i in h.ids]
            exported: list[int] = []
            after = -1
            while True:
                page_ids, _page_vecs, page_pls = await pool.export_page("f", after, where=where)
                if not len(page_ids):
                    break
                exported += page_ids.tolist()
                assert page_pls == [pls[pos[int(i)]] for i in page_ids]
                after = int(page_ids[-1])
            assert exported == sorted(ids[match].tolist()), what
        assert await pool.count("f") == len(ids)


@pytest.mark.asyncio
async def test_filters_follow_writes_deletes_and_compaction(fsc, rng):
    async with RecallPool(fsc.name, size=8) as pool:
        ids, vecs, pls = await _load(pool, rng, 600)
        where = {"color": {"$in": ["c1", "c2", "c3"]}}
        for step in range(4):
            gone = rng.choice(len(ids), 60, replace=False)  # deletes move tail rows into holes
            # concurrent writes and reads: deletes and payload changes beside filtered recalls
            changed = rng.choice(np.setdiff1d(np.arange(len(ids)), gone), 40, replace=False)
            new_pls = [{"color": "c1", "step": step} for _ in changed]
            q = rng.standard_normal(DIM).astype(np.float32)
            await asyncio.gather(
                pool.delete(ids[gone], namespace="f"),
                pool.upsert(ids[changed], vecs[changed], new_pls, namespace="f"),
                *(pool.recall(q, 5, namespace="f", where=where) for _ in range(8)),
            )
            for j, p in zip(changed, new_pls):
                pls[j] = p
            keep = np.setdiff1d(np.arange(len(ids)), gone)
            ids, vecs, pls = ids[keep], vecs[keep], [pls[j] for j in keep]
            # read your writes: the next filtered read sees every acknowledged write
            match = np.array([ref_match(p, where) for p in pls])
            assert await pool.count("f", where) == match.sum()
            h = await pool.recall(q, 50, namespace="f", where=where)
            check_filtered(q, vecs, ids, match, h.ids, h.scores, 50, f"step {step}")
            h = await pool.recall(q, 50, namespace="f", where={"step": step})
            stepped = np.array([ref_match(p, {"step": step}) for p in pls])
            assert stepped.sum() == 40 and set(h.ids.tolist()) == set(ids[stepped].tolist())


@pytest.mark.asyncio
async def test_delete_where_and_restart_rebuilds_the_index(sidecar_factory, rng, tmp_path):
    args = (
        "--dim",
        str(DIM),
        "--max-queries",
        "64",
        "--max-k",
        "128",
        "--backend",
        "numpy",
        "--data-dir",
        str(tmp_path),
    )
    h = sidecar_factory("fdd", *args, ephemeral=False)
    async with RecallPool(h.name, size=4) as pool:
        ids, vecs, pls = await _load(pool, rng, 800)
        victims = {"$or": [{"color": "c4"}, {"n": {"$lt": 10}}]}
        match = np.array([ref_match(p, victims) for p in pls])
        assert await pool.delete(where=victims, namespace="f") == match.sum()
        assert await pool.delete(where=victims, namespace="f") == 0
        assert await pool.delete(where={"x": 1}, namespace="never") == 0
        assert (await pool.get(ids[match], namespace="f")).missing.size == match.sum()
        ids, vecs, pls = ids[~match], vecs[~match], [p for p, m in zip(pls, match) if not m]
        q = rng.standard_normal(DIM).astype(np.float32)
        before = {
            str(w): (await pool.count("f", w), (await pool.recall(q, 30, namespace="f", where=w)).scores)
            for w in FILTERS
        }
    h.stop()
    h2 = sidecar_factory("fdd", *args, name=h.name, ephemeral=False)
    async with RecallPool(h2.name, size=4) as pool:
        assert await pool.count("f", victims) == 0
        for w in FILTERS:
            match = np.array([ref_match(p, w) for p in pls])
            n, hit_scores = before[str(w)]
            assert await pool.count("f", w) == n == match.sum(), w
            hh = await pool.recall(q, 30, namespace="f", where=w)
            check_filtered(q, vecs, ids, match, hh.ids, hh.scores, 30, str(w))
            # The same answer as before the restart, by score: rows reload in id order, so equal
            # scores may come back in another order (ids compared exactly failed on ties).
            np.testing.assert_allclose(hh.scores, hit_scores, rtol=1e-5, atol=1e-6)


BAD_FILTERS: list[object] = [
    [],
    "color",
    {"color": [1]},
    {"color": {"a": 1}},
    {"color": {}},
    {"$foo": 1},
    {"": 1},
    {"n": {"$gt": "5"}},
    {"n": {"$gt": True}},
    {"n": {"$gt": float("nan")}},
    {"n": float("inf")},
    {"n": {"$in": 3}},
    {"n": {"$in": [[1]]}},
    {"n": {"$exists": 1}},
    {"n": {"$ne": {}}},
    {"$or": []},
    {"$or": {"a": 1}},
    {"$or": [1]},
    {1: 2},
    {"n": {"$in": list(range(2000))}},
    {"$or": [{"$or": [{"$or": [{"$or": [{"$or": [{"$or": [{"$or": [{"$or": [{"$or": [{"a": 1}]}]}]}]}]}]}]}]}]},
]


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", BAD_FILTERS, ids=range(len(BAD_FILTERS)))
async def test_bad_filters_fail_before_shared_memory(fsc, bad):
    async with RecallPool(fsc.name, size=1) as pool:
        q = np.zeros(DIM, np.float32)
        for call in (
            lambda: pool.recall(q, 1, where=bad),
            lambda: pool.count("default", bad),
            lambda: pool.delete(where=bad),
            lambda: pool.export_page("default", where=bad),
            lambda: pool.recall_many(q[None], 1, where=bad),
        ):
            with pytest.raises(InvalidRequest):
                await call()
        with pytest.raises(InvalidRequest):
            await pool.delete([1], where={"a": 1})
        with pytest.raises(InvalidRequest):
            await pool.delete()
        assert pool.statistics().requests == 0


def test_filters_blocking_client_and_unknown_namespace(fsc, rng):
    """Filtered operations through the blocking client; on a namespace never written they find
    nothing (no error)."""
    with RecallClient(fsc.name, timeout=10) as c:
        c.upsert([1, 2, 3], rng.standard_normal((3, DIM)), [{"a": 1}, {"a": 2}, {"a": 1}], namespace="b")
        assert c.count("b", {"a": 1}) == 2 and c.count("b") == 3
        h = c.recall(np.ones(DIM, np.float32), 10, namespace="b", where={"a": 2})
        assert h.ids.tolist() == [2]
        assert [x.ids.tolist() for x in c.recall_many(np.ones((2, DIM)), 10, namespace="b", where={"a": 3})] == [[], []]
        assert c.export_page("b", where={"a": 1})[0].tolist() == [1, 3]
        assert c.delete(where={"a": 1}, namespace="b") == 2 and c.count("b") == 1
        assert c.count("nope") == 0 and c.count("nope", {"a": 1}) == 0
        assert c.recall(np.ones(DIM), 1, namespace="nope", where={"a": 1}).ids.tolist() == []
        assert [len(x) for x in c.recall_many(np.ones((2, DIM)), 3, namespace="nope", where={"a": 1})] == [0, 0]
        ids, vecs, pls = c.export_page("nope", where={"a": 1})
        assert ids.tolist() == [] and vecs.shape == (0, DIM) and pls == []
        assert c.delete(where={"a": 1}, namespace="nope") == 0
        assert "nope" not in c.namespaces()  # reading a namespace does not create it


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not json",
        b"[1]",
        b'{"a":{"$gt":"x"}}',
        b"\xff\xfe",
        b"[" * 5000 + b"]" * 5000,
        b'{"a":NaN}',
        b'{"a":{"$in":[[1]]}}',
    ],
)
def test_malformed_filters_written_by_hand_get_bad_request(fsc, rng, blob):
    with RecallClient(fsc.name, timeout=10) as client:
        client.upsert([1, 2], rng.standard_normal((2, DIM)), [{"a": 1}, None])
        c = Connection(fsc.name)
        slot = c.lease(1)[0]
        try:
            for op, ids in ((Op.RECALL, [0]), (Op.COUNT, []), (Op.DELETE, []), (Op.EXPORT, [-1])):
                status, _n, detail = raw_get(c, slot, ids, b"default", int(Flag.WHERE), blob, int(op))
                assert status == Status.BAD_REQUEST and "filter" in detail, (op, detail)
            slot.view.queries[0] = np.nan
            assert (
                raw_get(c, slot, [0], b"default", int(Flag.WHERE), b'{"a":1}', int(Op.RECALL))[0] == Status.NOT_FINITE
            )
        finally:
            c.give_back([slot], [])
            c.close()
        assert fsc.proc.poll() is None and client.count("default") == 2


@pytest.mark.asyncio
async def test_concurrent_filtered_recalls_grouped_by_filter_each_get_their_own_k(fsc, rng):
    """Filtered recalls that reach the sidecar together are served one search per (namespace,
    filter) with the largest k, then cut per caller: mixed filters and k in flight at once, each
    checked against the float64 reference; a filter result kept between batches is dropped by a
    write (the next recalls see the new rows)."""
    async with RecallPool(fsc.name, size=8) as pool:
        ids, vecs, pls = await _load(pool, rng, 1200)
        wheres = FILTERS[:4]
        matches = [np.array([ref_match(p, w) for p in pls]) for w in wheres]
        for _round in range(2):
            jobs = [
                (j % len(wheres), (1, 5, 10, 64, 128)[j % 5], rng.standard_normal(DIM).astype(np.float32))
                for j in range(40)
            ]
            hits = await asyncio.gather(*(pool.recall(q, k, namespace="f", where=wheres[w]) for w, k, q in jobs))
            for (w, k, q), h in zip(jobs, hits):
                check_filtered(q, vecs, ids, matches[w], h.ids, h.scores, k, f"where={wheres[w]} k={k}")
            # replace a third of the rows: new vectors and payloads, so new matches
            sel = rng.choice(len(ids), len(ids) // 3, replace=False)
            vecs[sel] = rng.standard_normal((len(sel), DIM)).astype(np.float32)
            for j in sel.tolist():
                pls[j] = random_payload(rng, j + 7)
            await pool.upsert(ids[sel], vecs[sel], [pls[j] for j in sel.tolist()], namespace="f")
            matches = [np.array([ref_match(p, w) for p in pls]) for w in wheres]


@pytest.mark.parametrize("blob", [b"not json", b'{"a":{"$gt":"x"}}', b'{"a":1}'])
def test_filtered_batch_written_by_hand_same_filter_in_every_slot(fsc, rng, blob):
    """Several slots posted at once with the same filter bytes (the batch a UNIFORM filtered
    search serves): a malformed filter is BAD_REQUEST for each, a good one answers each with its
    own k, and garbage past blob_len is not part of the filter."""
    with RecallClient(fsc.name, timeout=10) as client:
        vecs = rng.standard_normal((3, DIM)).astype(np.float32)
        client.upsert([1, 2, 3], vecs, [{"a": 1}, None, {"a": 1}])
        c = Connection(fsc.name)
        slots = c.lease(6)
        try:
            for j, s in enumerate(slots):
                s.view.queries[0] = vecs[0]
                s.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
                s.view.blob[len(blob) : len(blob) + 8] = j  # past blob_len: differs per slot
            for j, s in enumerate(slots):
                s.post(int(Op.RECALL), b"default", 1 + j % 3, 1, int(Flag.WHERE), len(blob), 0)
            for j, s in enumerate(slots):
                assert wait_until(lambda: s.is_done() and s.try_consume(), 10)
                status, n, blen = s.outcome()
                detail = s.blob_text(blen).decode(errors="replace")
                if blob == b'{"a":1}':
                    assert status == Status.OK and n == min(1 + j % 3, 2), (j, detail)
                    assert set(s.view.result_ids[0, :n].tolist()) <= {1, 3}
                else:
                    assert status == Status.BAD_REQUEST and "filter" in detail, (j, detail)
                s.set_free()
        finally:
            c.give_back(slots, [])
            c.close()
        assert fsc.proc.poll() is None and client.count("default") == 3
