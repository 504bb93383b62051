"""Memory over time without processes: TTLs, timestamps, expiry and the sweeper on a fake clock;
recency-weighted search against a float64 reference; the SQLite store's schema 2 and its
migration; what the client encodes and the sidecar refuses (issue 26)."""

from __future__ import annotations

import json
import math
import sqlite3
import time

import numpy as np
import pytest

from kalos.broker.clock import NS, Recency, decay_part, ttl_groups, ttl_ns
from kalos.broker.errors import InvalidRequest
from kalos.broker.layout import HIT_META_BYTES, Flag, Layout, Metric, Op, SegmentView, Status, hit_meta_dtype
from kalos.broker.validation import encode_where, parse_where
from kalos.clients import _requests
from kalos.sidecar_cuda.backends.base import Decay
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
from kalos.sidecar_cuda.backends.sharded import ShardedBackend
from kalos.sidecar_cuda.serving.batching import Rejection, Request, SlotFields, parse_request, write_segments
from kalos.sidecar_cuda.serving.expiry import Sweeper, due
from kalos.sidecar_cuda.serving.stats import SidecarStats
from kalos.sidecar_cuda.storage.durable import StoreError, commit_and_apply
from kalos.sidecar_cuda.storage.sqlite import Persistence
from kalos.sidecar_cuda.storage.store import NO_EXPIRY, MemoryStore, Namespace, Stamps
from kalos.sidecar_cuda.storage.writes import Write, WriteOp

pytestmark = pytest.mark.timeout(60)

T0 = 1_800_000_000 * NS  # the fake clock's start (ns)
S = NS  # one second


class FakeClock:
    def __init__(self, t: int = T0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> int:
        self.t += round(seconds * NS)
        return self.t


def store_with(clock: FakeClock, dim: int = 8, metric: Metric = Metric.DOT, backend=None) -> MemoryStore:
    return MemoryStore(backend or NumpyBackend(), dim, metric, clock=clock)


def write(store: MemoryStore, w: Write) -> int:
    """A write as the serving thread makes one (resolved, applied; no durable store)."""
    _positions, out = commit_and_apply(None, store, [w])
    assert not isinstance(out[0], Exception)
    return out[0]


def upsert(store, clock, ns, ids, vecs, ttl_s=None, payloads=None) -> int:
    return write(
        store,
        Write(
            WriteOp.UPSERT,
            ns,
            ids=np.asarray(ids, np.int64),
            vectors=np.asarray(vecs, np.float32),
            payloads=payloads,
            now_ns=clock(),
            ttl_ns=None if ttl_s is None else (0 if ttl_s == math.inf else round(ttl_s * NS)),
        ),
    )


# --------------------------------------------------------------------------- pure parts


def test_ttls_in_seconds_become_protocol_nanoseconds_or_are_refused() -> None:
    assert ttl_ns(1.5) == 1_500_000_000 and ttl_ns(math.inf) == 0 and ttl_ns(1e-12) == 1
    for bad in (0, -1, math.nan, "1", True, None, 1e12):
        with pytest.raises(InvalidRequest):
            ttl_ns(bad)
    assert [(t, r.tolist()) for t, r in ttl_groups(None, 3)] == [(None, [0, 1, 2])]
    assert [(t, r.tolist()) for t, r in ttl_groups(2, 2)] == [(2 * NS, [0, 1])]
    got = [(t, r.tolist()) for t, r in ttl_groups([1, None, 1, math.inf], 4)]
    assert got == [(NS, [0, 2]), (None, [1]), (0, [3])]
    with pytest.raises(InvalidRequest, match="3 ttls for 2 rows"):
        ttl_groups([1, 2, 3], 2)


def test_langchains_decay_rate_is_a_half_life() -> None:
    r = Recency.from_decay_rate(0.01)
    hours = np.array([0.0, 1.0, 10.0, 100.0])
    ours = decay_part(T0 - (hours * 3600 * NS).astype(np.int64), T0, r.half_life, r.weight)
    np.testing.assert_allclose(ours, 0.99**hours, rtol=1e-12)
    assert Recency(60, 0.5).part(np.array([T0 - 60 * NS, T0 + 5 * NS]), T0).tolist() == [0.25, 0.5]  # (future: age 0)
    for bad in (dict(half_life=0), dict(half_life=math.inf), dict(half_life=1, weight=math.nan), dict(half_life="1")):
        with pytest.raises(InvalidRequest):
            Recency(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        Recency.from_decay_rate(1.0)


def test_time_fields_in_filters_take_range_operators_on_seconds() -> None:
    node = parse_where({"$updated_at": {"$gte": 1.5e9, "$lt": 2e9}, "a": 1})
    assert ("gte", "$updated_at", 1.5e9) in node[1] and ("lt", "$updated_at", 2e9) in node[1]
    for bad in (
        {"$updated_at": 5},
        {"$created_at": {"$eq": 5}},
        {"$expires_at": {"$gt": "x"}},
        {"$expires_at": {"$gt": math.inf}},
        {"$deleted_at": {"$gt": 1}},
    ):
        with pytest.raises(InvalidRequest):
            parse_where(bad)


# --------------------------------------------------------------------------- the store on a fake clock


def test_expired_rows_are_never_read_even_before_the_sweep(rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    v = rng.standard_normal((6, 8)).astype(np.float32)
    upsert(store, clock, "a", [0, 1, 2], v[:3], ttl_s=1.0, payloads=[b'{"k":1}'] * 3)
    upsert(store, clock, "a", [3, 4, 5], v[3:], payloads=[b'{"k":1}'] * 3)
    ns = store.get("a")
    assert ns is not None and ns.next_expiry() == T0 + S
    assert ns.live(clock()) is None  # nothing expired: the plain path
    ids, _ = ns.search(v[:1], 6)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3, 4, 5]
    clock.advance(1.0)  # expires_at <= now: expired
    for ids in (
        ns.search(v[:1], 6)[0][0],
        ns.search(v[:1], 6, match=ns.filtered(parse_where({"k": 1}), b"k1"))[0][0],
        ns.search_start(v[:1], 6).result()[0][0],
        ns.get(np.arange(6))[0],
        ns.export_page(-1, 100)[0],
    ):
        assert sorted(ids.tolist()) == [3, 4, 5]
    assert ns.live_count(clock()) == 3 and store.counts() == {"a": 3}
    assert due(store, clock()) == ["a"]
    # The sweeper deletes them (a write through the same path as any other).
    sw = Sweeper(store, None, lambda: 0, SidecarStats(1), clock)
    assert sw.sweep() == 3 and ns.n == 3 and sw.stats.records_expired == 3
    assert sw.sweep() == 0  # (the bound is a lower one: made exact by the next look)
    assert ns.next_expiry() == NO_EXPIRY and due(store, clock()) == []


def test_the_sweeper_is_bounded_per_pass_and_keeps_what_was_touched(rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    upsert(store, clock, "a", np.arange(10), rng.standard_normal((10, 8)), ttl_s=2.0)
    clock.advance(1.0)
    assert write(store, Write(WriteOp.TOUCH, "a", ids=np.array([0, 1, 99]), now_ns=clock())) == 2  # own TTL: +2 s
    assert write(store, Write(WriteOp.TOUCH, "a", ids=np.array([2]), now_ns=clock(), ttl_ns=0)) == 1  # never
    clock.advance(1.5)  # 3..9 expired (at T0 + 2 s); 0, 1 expire at T0 + 3 s; 2 never
    ns = store.get("a")
    assert ns is not None and sorted(ns.get(np.arange(10))[0].tolist()) == [0, 1, 2]
    assert write(store, Write(WriteOp.TOUCH, "a", ids=np.array([5]), now_ns=clock())) == 0  # expired: not revived
    sw = Sweeper(store, None, lambda: 0, SidecarStats(1), clock, rows=4)
    assert sw.sweep() == 4 and sw.sweep() == 3 and sw.sweep() == 0
    clock.advance(1.0)
    assert sw.sweep() == 2 and sorted(ns.id_row) == [2]
    assert ns.expires[ns.id_row[2]] == 0 and ns.ttl[ns.id_row[2]] == 0


def test_timestamps_created_kept_updated_moved_and_the_default_ttl(rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    v = rng.standard_normal((4, 8)).astype(np.float32)
    write(store, Write(WriteOp.SET_TTL, "a", now_ns=clock(), ttl_ns=5 * S))
    upsert(store, clock, "a", [1, 2, 3, 4], v)  # the default: 5 s
    upsert(store, clock, "a", [4], v[:1], ttl_s=math.inf)  # never, whatever the default
    clock.advance(1.0)
    upsert(store, clock, "a", [2], v[1:2], ttl_s=10)  # rewritten: created kept, updated now
    ns = store.get("a")
    assert ns is not None
    m = ns.meta(np.array([1, 2, 4]), clock())
    assert m["created_at_ns"].tolist() == [T0, T0, T0]
    assert m["updated_at_ns"].tolist() == [T0, T0 + S, T0]
    assert m["expires_at_ns"].tolist() == [T0 + 5 * S, T0 + 11 * S, 0]
    write(store, Write(WriteOp.DELETE, "a", ids=np.array([1]), now_ns=clock()))  # 3 or 4 moves into the hole
    m2 = ns.meta(np.array([2, 3, 4]), clock())
    assert m2["updated_at_ns"].tolist() == [T0 + S, T0, T0] and m2["expires_at_ns"].tolist() == [
        T0 + 11 * S,
        T0 + 5 * S,
        0,
    ]
    np.testing.assert_array_equal(ns.matrix.times[: ns.n], ns.updated[: ns.n])  # the matrix's copy follows
    clock.advance(20.0)
    upsert(store, clock, "a", [2], v[1:2])  # expired, then written again: a new record
    assert ns.meta(np.array([2]), clock())["created_at_ns"].tolist() == [clock()]
    # Dropping a namespace forgets its default.
    write(store, Write(WriteOp.DROP, "a", now_ns=clock()))
    upsert(store, clock, "a", [7], v[:1])
    assert store.get("a").expires[0] == 0  # type: ignore[union-attr]


def test_time_fields_filter_on_the_records_timestamps(rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    upsert(store, clock, "a", [0, 1], rng.standard_normal((2, 8)), ttl_s=100)
    clock.advance(10)
    upsert(store, clock, "a", [2, 3], rng.standard_normal((2, 8)))
    ns = store.get("a")
    assert ns is not None
    t = T0 / NS

    def ids(where: dict) -> list[int]:
        return sorted(ns.row_ids[: ns.n][ns.where(parse_where(where))].tolist())

    assert ids({"$updated_at": {"$gte": t + 5}}) == [2, 3]
    assert ids({"$created_at": {"$lt": t + 5}}) == [0, 1]
    assert ids({"$expires_at": {"$lt": t + 1000}}) == [0, 1]  # never expiring: +inf
    assert ids({"$expires_at": {"$gt": t + 1000}}) == [2, 3]
    assert ids({"$or": [{"$updated_at": {"$lte": t}}, {"$expires_at": {"$gte": 1e300}}]}) == [0, 1, 2, 3]


def _reference(vecs: np.ndarray, upd_ns: np.ndarray, q: np.ndarray, now: int, rec: Recency, metric: Metric):
    x = vecs.astype(np.float64)
    q64 = q.astype(np.float64)
    if metric is Metric.COSINE:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        q64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
    sim = -((q64[:, None, :] - x[None]) ** 2).sum(-1) if metric is Metric.L2 else q64 @ x.T
    return sim + rec.part(upd_ns, now)[None, :]


def check_exact(ref_row: np.ndarray, ids: np.ndarray, scores: np.ndarray, k: int, allowed: np.ndarray) -> None:
    """The answer is the top-k of the float64 reference over ``allowed`` rows, by score."""
    r = ref_row[allowed]
    kk = min(k, len(allowed))
    assert len(ids) == kk and len(set(ids.tolist())) == kk
    assert set(ids.tolist()) <= set(allowed.tolist())
    tol = 1e-5 * (np.abs(r).max() + 1.0)
    kth = np.sort(r)[::-1][kk - 1]
    true = ref_row[ids]
    assert (true >= kth - tol).all(), "a row outside the true top-k"
    assert np.all(np.diff(true) <= tol), "not best first"
    np.testing.assert_allclose(scores, true, rtol=1e-4, atol=tol)


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2])
@pytest.mark.parametrize("shards", [0, 3])
def test_recency_weighted_search_is_exact_against_float64(
    rng: np.random.Generator, metric: Metric, shards: int
) -> None:
    clock = FakeClock()
    n, dim = 3000, 16
    backend = (
        ShardedBackend([NumpyBackend() for _ in range(shards)], [f"s{i}" for i in range(shards)], block=256)
        if shards
        else None
    )
    store = store_with(clock, dim, metric, backend)
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    pls = [json.dumps({"c": int(c)}).encode() for c in rng.integers(0, 4, n)]
    upd = np.empty(n, np.int64)
    for lo in range(0, n, 500):  # written over ten minutes, some with TTLs
        clock.advance(float(rng.uniform(0, 120)))
        ttl = float(rng.choice([60.0, math.inf]))
        upsert(store, clock, "a", np.arange(lo, lo + 500), vecs[lo : lo + 500], ttl_s=ttl, payloads=pls[lo : lo + 500])
        upd[lo : lo + 500] = clock()
    clock.advance(30)  # some rows expired now (not swept)
    ns = store.get("a")
    assert ns is not None
    live = ns.live(clock())
    alive = np.arange(n) if live is None else np.sort(ns.row_ids[live.rows])
    q = rng.standard_normal((3, dim)).astype(np.float32)
    for rec in (Recency(300.0, 0.5), Recency(30.0, 5.0), Recency(1e6, -1.0)):
        ref = _reference(vecs, upd, q, clock(), rec, metric)
        decay = Decay(clock(), rec.half_life, rec.weight)
        for k in (1, 10, 64):
            ids, scores = ns.search(q, k, decay=decay)
            for b in range(len(q)):
                check_exact(ref[b], ids[b], scores[b], k, alive)
            where = {"c": {"$in": [1, 2]}}
            match = ns.filtered(parse_where(where), encode_where(where, 1024))
            fids, fscores = ns.search(q, k, match=match, decay=decay)
            allowed = np.intersect1d(alive, [i for i in range(n) if json.loads(pls[i])["c"] in (1, 2)])
            for b in range(len(q)):
                check_exact(ref[b], fids[b], fscores[b], k, allowed)
        # The parts reported: the recency part of each hit, the similarity the rest.
        m = ns.meta(ids[0], clock(), decay)
        np.testing.assert_allclose(m["recency"], rec.part(upd[ids[0]], clock()), rtol=1e-12)


@pytest.mark.parametrize("half_life", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("shards", [0, 2])
def test_recency_ranks_with_the_exact_part_it_reports(rng: np.random.Generator, half_life: float, shards: int) -> None:
    """The ranking adds the same recency part the answer reports (decay_part over the exact
    nanoseconds, rounded once to float32): each hit's score is float32(similarity + part), so
    score - part is its similarity within one rounding of that sum, at any half-life. Before,
    the ranking aged rows from float64 seconds in float32 (6.9 float32 ulps off at 0.1 s)."""
    clock = FakeClock(T0 + 123_456_789)
    n, dim = 600, 16
    backend = (
        ShardedBackend([NumpyBackend() for _ in range(shards)], [f"s{i}" for i in range(shards)], block=128)
        if shards
        else None
    )
    store = store_with(clock, dim, Metric.DOT, backend)
    # Small integers: every similarity is exact in float32 whatever the summation order, so the
    # only rounding left in a score is that of adding the recency part.
    vecs = rng.integers(-3, 4, (n, dim)).astype(np.float32)
    upd = np.empty(n, np.int64)
    for lo in range(0, n, 50):  # written a few ms apart: ages of a few half-lives
        clock.t += int(rng.integers(1, 4 * half_life * NS / 12))
        upsert(store, clock, "a", np.arange(lo, lo + 50), vecs[lo : lo + 50])
        upd[lo : lo + 50] = clock()
    clock.t += 7_777_777
    ns = store.get("a")
    assert ns is not None
    q = rng.integers(-3, 4, (4, dim)).astype(np.float32)
    decay = Decay(clock(), half_life, 3.0)
    part32 = decay_part(upd, clock(), half_life, 3.0).astype(np.float32)
    sim32 = vecs @ q.T  # exact
    ids, scores = ns.search(q, 20, decay=decay)
    for b in range(len(q)):
        got = scores[b]
        expect = sim32[ids[b], b] + part32[ids[b]]  # one float32 rounding
        ulp = np.spacing(np.abs(expect))
        assert (got == expect).all(), np.abs(got - expect) / ulp
        # reported part: the same float64 formula
        m = ns.meta(ids[b], clock(), decay)
        np.testing.assert_array_equal(m["recency"].astype(np.float32), part32[ids[b]])
        # the ranking is the top-20 under that very score: no row outside the hits beats one
        full = sim32[:, b] + part32
        kth = np.sort(full)[::-1][19]
        assert (full[ids[b]] >= kth).all()


# --------------------------------------------------------------------------- the SQLite store


def test_sqlite_keeps_timestamps_ttls_touches_and_defaults(tmp_path, rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    p = Persistence(str(tmp_path), 8, "dot")
    v = rng.standard_normal((5, 8)).astype(np.float32)
    for w in (
        Write(WriteOp.SET_TTL, "a", now_ns=clock(), ttl_ns=50 * S),
        Write(WriteOp.UPSERT, "a", ids=np.arange(5), vectors=v, now_ns=clock()),
        Write(WriteOp.TOUCH, "a", ids=np.array([1]), now_ns=clock.advance(5), ttl_ns=7 * S),
        Write(WriteOp.SET_TTL, "empty", now_ns=clock(), ttl_ns=3 * S),
    ):
        commit_and_apply(p, store, [w])
    clock.advance(100)  # 0, 2, 3, 4 expired; 1 too (touched: 12 s)
    write(store, Write(WriteOp.UPSERT, "a", ids=np.array([9]), vectors=v[:1], now_ns=clock()))  # memory only
    sw = Sweeper(store, p, lambda: 0, SidecarStats(1), clock)
    assert sw.sweep() == 5
    commit_and_apply(p, store, [Write(WriteOp.UPSERT, "a", ids=np.array([3]), vectors=v[:1], now_ns=clock())])
    p.close()
    again = store_with(clock)
    p2 = Persistence(str(tmp_path), 8, "dot")
    p2.load_into(again)
    a, e = again.get("a"), again.get("empty")
    assert a is not None and e is not None and sorted(a.id_row) == [3] and e.n == 0
    assert a.default_ttl == 50 * S and e.default_ttl == 3 * S
    m = a.meta(np.array([3]), clock())
    assert m["created_at_ns"].tolist() == [clock()] and m["expires_at_ns"].tolist() == [clock() + 50 * S]
    p2.close()


def test_a_schema_1_store_is_migrated_without_loss(tmp_path, rng: np.random.Generator) -> None:
    v = rng.standard_normal((3, 8)).astype(np.float32)
    db = sqlite3.connect(str(tmp_path / "kalos.sqlite3"))
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute(
        "CREATE TABLE records (ns TEXT NOT NULL, id INTEGER NOT NULL, vec BLOB NOT NULL, payload BLOB, "
        "PRIMARY KEY (ns, id)) WITHOUT ROWID"
    )
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("schema", "1"), ("dim", "8"), ("metric", "dot")])
    db.executemany(
        "INSERT INTO records VALUES ('a', ?, ?, ?)", [(i, v[i].tobytes(), b'{"i":%d}' % i) for i in range(3)]
    )
    db.commit()
    db.close()
    (tmp_path / "kalos.sqlite3").chmod(0o600)
    clock = FakeClock()
    before = time.time_ns()
    p = Persistence(str(tmp_path), 8, "dot")
    after = time.time_ns()
    store = store_with(clock)
    rows, _s = p.load_into(store)
    ns = store.get("a")
    assert rows == 3 and ns is not None
    ids, vecs, pls = ns.get(np.arange(3))
    np.testing.assert_array_equal(vecs, v)
    assert pls == [b'{"i":0}', b'{"i":1}', b'{"i":2}']
    m = ns.meta(ids, clock())
    assert (m["created_at_ns"] == m["updated_at_ns"]).all() and before <= m["created_at_ns"][0] <= after
    assert (m["expires_at_ns"] == 0).all()
    assert dict(p.db.execute("SELECT key, value FROM meta").fetchall())["schema"] == "2"
    p.close()
    Persistence(str(tmp_path), 8, "dot").close()  # opened again: schema 2, nothing to do


# --------------------------------------------------------------------------- slots: client and sidecar


def _fields(**kw) -> SlotFields:
    base = dict(op=int(Op.RECALL), k=5, nq=1, flags=0, blob_len=0, ns_len=1, namespace=b"a", generation=7, t_post_ns=0)
    base.update(kw)
    return SlotFields(**base)  # type: ignore[arg-type]


LAYOUT = Layout(n_slots=2, dim=4, max_k=16, max_queries=4, blob_bytes=4096)


@pytest.mark.parametrize(
    "fields, detail",
    [
        (dict(op=int(Op.UPSERT), flags=int(Flag.TTL), ttl_ns=-1), "ttl_ns=-1"),
        (dict(op=int(Op.TOUCH), flags=int(Flag.TTL), ttl_ns=2**62), "ttl_ns="),
        (dict(op=int(Op.SET_TTL), ttl_ns=-5), "ttl_ns=-5"),
        (dict(flags=int(Flag.RECENCY), half_life_s=math.nan, recency_weight=1.0), "half_life_s"),
        (dict(flags=int(Flag.RECENCY), half_life_s=0.0, recency_weight=1.0), "half_life_s"),
        (dict(flags=int(Flag.RECENCY), half_life_s=1.0, recency_weight=math.inf), "recency_weight"),
        (dict(op=int(Op.TOUCH), nq=0), "nq=0"),
    ],
)
def test_the_sidecar_refuses_bad_time_fields_a_client_wrote(fields: dict, detail: str) -> None:
    r = parse_request(3, _fields(**fields), LAYOUT, 1 << 30)
    assert isinstance(r, Rejection) and detail in r.detail
    assert r.status in (Status.BAD_REQUEST, Status.TOO_MANY_QUERIES)


def test_good_time_fields_are_parsed() -> None:
    r = parse_request(3, _fields(op=int(Op.UPSERT), flags=int(Flag.TTL), ttl_ns=0), LAYOUT, 1 << 30)
    assert isinstance(r, Request) and r.ttl_ns == 0
    r = parse_request(3, _fields(op=int(Op.UPSERT), ttl_ns=-1), LAYOUT, 1 << 30)  # (no Flag.TTL: not read)
    assert isinstance(r, Request) and r.ttl_ns is None
    r = parse_request(3, _fields(flags=int(Flag.RECENCY), half_life_s=2.0, recency_weight=-0.5), LAYOUT, 1 << 30)
    assert isinstance(r, Request) and r.recency == (2.0, -0.5)


def test_writes_are_cut_before_touches_and_after_default_ttls() -> None:
    def req(op: Op, i: int) -> Request:
        return Request(i, op, "a", 0, 1, 0, i, i)

    segs = write_segments(
        [req(Op.UPSERT, 0), req(Op.TOUCH, 1), req(Op.SET_TTL, 2), req(Op.UPSERT, 3), req(Op.DELETE, 4)]
    )
    assert [[r.slot for r in s] for s in segs] == [[0], [1, 2], [3, 4]]


def test_the_client_encodes_ttls_recency_and_reads_timestamps(rng: np.random.Generator) -> None:
    v = rng.standard_normal((6, 4)).astype(np.float32)
    preps = _requests.upsert(LAYOUT, np.arange(6), v, None, "a", 1 << 14, ttl=[1, None, 1, math.inf, None, 1])
    got = [(p.ttl_ns, p.flags, p.ids.tolist()) for p in preps]  # type: ignore[union-attr]
    assert got == [(NS, int(Flag.TTL), [0, 2, 5]), (None, 0, [1, 4]), (0, int(Flag.TTL), [3])]
    # duplicate ids: the last row wins, in its own TTL's group
    preps = _requests.upsert(LAYOUT, [7, 7], v[:2], None, "a", 1 << 14, ttl=[1, 2])
    assert [(p.ttl_ns, p.ids.tolist()) for p in preps] == [(2 * NS, [7])]  # type: ignore[union-attr]
    assert [p.nq for p in _requests.touch(LAYOUT, np.arange(9), "a", ttl=5)] == [4, 4, 1]
    with pytest.raises(InvalidRequest):
        _requests.recall(LAYOUT, v[0], 3, b"a", False, _requests.ONE, recency=(1, 2))  # type: ignore[arg-type]
    p = _requests.recall(LAYOUT, v[0], 3, b"a", False, _requests.ONE, recency=Recency(10, 0.5), refresh_ttl=True)
    assert p.flags == Flag.RECENCY | Flag.TIMES | Flag.REFRESH
    assert _requests.recall(LAYOUT, v[0], 3, b"a", True, _requests.ONE).flags == Flag.WITH_PAYLOAD | Flag.TIMES
    # An answer: 2 hits with their timestamps and recency parts, then the payload lines.
    seg = SegmentView(memoryview(bytearray(LAYOUT.total_bytes)), LAYOUT)
    sv = seg.slot[0]
    _requests.write(sv, p)
    assert float(sv.ctl["half_life_s"]) == 10.0 and float(sv.ctl["recency_weight"]) == 0.5
    sv.result_ids[0, :2] = [4, 2]
    sv.result_scores[0, :2] = [3.0, 2.5]
    meta = np.zeros(2, hit_meta_dtype())
    meta["created_at_ns"] = [T0, T0 + S]
    meta["updated_at_ns"] = [T0 + S, T0 + 2 * S]
    meta["expires_at_ns"] = [0, T0 + 9 * S]
    meta["recency"] = [0.5, 0.25]
    blob = meta.tobytes()
    sv.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    sv.ctl["now_ns"] = T0 + 3 * S
    hits = _requests.read(sv, (int(Status.OK), 2, len(blob)), p)
    assert hits.served_at_ns == T0 + 3 * S and hits.expires_at.tolist() == [math.inf, T0 / NS + 9]
    h = hits[0]
    assert (h.id, h.score, h.recency, h.similarity, h.updated_at) == (4, 3.0, 0.5, 2.5, T0 / NS + 1)
    i, s, pl = h  # still the three-tuple it was
    assert (i, s, pl) == (4, 3.0, None)
    with pytest.raises(Exception, match="cannot hold the timestamps"):
        _requests.read(sv, (int(Status.OK), 2, HIT_META_BYTES), p)


def test_a_namespace_without_ttls_never_reads_the_clock(rng: np.random.Generator) -> None:
    """The plain path costs what it did: no clock, no mask, while nothing may expire."""

    def no_clock() -> int:
        raise AssertionError("the clock was read")

    ns = Namespace("a", NumpyBackend(), 8, Metric.DOT, clock=no_clock)
    v = rng.standard_normal((20, 8)).astype(np.float32)
    ns.upsert(np.arange(20), v, None, Stamps.fresh(20, T0))
    ns.search(v[:2], 5)
    ns.search_start(v[:2], 5).result()
    ns.search(v[:2], 5, match=np.ones(20, bool))
    ns.get(np.arange(3))
    ns.export_page(-1, 5)


class FailingStore:
    """A durable store that is away (the sweeper's commit fails)."""

    def __init__(self) -> None:
        self.commits = 0

    def begin(self, store) -> None:  # type: ignore[no-untyped-def]
        pass

    def commit(self, writes):  # type: ignore[no-untyped-def]
        self.commits += 1
        raise StoreError("the store is away")

    def abort(self) -> None:
        raise AssertionError("commit() ends what begin() began, failed or not")

    def applied_through(self, position) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("nothing was committed")


def test_a_failed_sweep_leaves_the_records_hidden_and_backs_off(rng: np.random.Generator) -> None:
    clock = FakeClock()
    store = store_with(clock)
    upsert(store, clock, "a", np.arange(5), rng.standard_normal((5, 8)), ttl_s=1.0)
    clock.advance(2)
    away = FailingStore()
    sw = Sweeper(store, away, lambda: 0, SidecarStats(1), clock)  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        sw.sweep()
    assert sw.sweep() == 0 and away.commits == 1 and sw.failures == 1  # backing off: no commit
    ns = store.get("a")
    assert (
        ns is not None and ns.n == 5 and ns.live_count(clock()) == 0 and len(ns.search(np.ones((1, 8)), 5)[0][0]) == 0
    )
    sw._retry_at = 0.0  # (the back-off has passed)
    sw.persist = None
    assert sw.sweep() == 5 and sw.failures == 0
