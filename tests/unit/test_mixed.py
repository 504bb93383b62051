"""The mixed-namespace search without processes (issue 34): ``MemoryStore.search_mixed`` against a
float64 reference per namespace, with namespaces that do not exist, are empty, are smaller than k,
hold expired rows not yet swept, or are larger than the backend's gathered limit; and the route
``classify`` picks for a batch of plain recalls to several namespaces."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kalos.broker.clock import NS
from kalos.broker.layout import Flag, Metric, slot_dtype
from kalos.sidecar_cuda.backends.base import search_each
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
from kalos.sidecar_cuda.backends.sharded import ShardedBackend
from kalos.sidecar_cuda.serving.batching import Limits, Route, classify, group_namespaces, namespace_field
from kalos.sidecar_cuda.storage.durable import commit_and_apply
from kalos.sidecar_cuda.storage.store import MemoryStore, Namespace, Stamps
from kalos.sidecar_cuda.storage.writes import Write, WriteOp

pytestmark = pytest.mark.timeout(60)

T0 = 1_800_000_000 * NS


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> int:
        return self.t


def reference(vecs: np.ndarray, q: np.ndarray, metric: Metric) -> np.ndarray:
    m = vecs.astype(np.float64)
    q64 = q.astype(np.float64)
    if metric == Metric.COSINE:
        m = m / np.linalg.norm(m, axis=1, keepdims=True)
        q64 = q64 / np.linalg.norm(q64)
    if metric == Metric.L2:
        return -((m - q64) ** 2).sum(axis=1)
    out: np.ndarray = m @ q64
    return out


def check(ids: np.ndarray, scores: np.ndarray, model: dict[int, np.ndarray], q: np.ndarray, k: int, metric: Metric):
    """One answer padded to k: its hits are the true top-min(k, n) of ``model`` by score."""
    found = int((ids >= 0).sum())
    assert (ids[:found] >= 0).all() and (ids[found:] == -1).all() and np.isneginf(scores[found:]).all()
    kk = min(k, len(model))
    assert found == kk, (found, kk)
    if not kk:
        return
    keys = np.fromiter(model, np.int64, len(model))
    ref = reference(np.stack([model[i] for i in keys.tolist()]), q, metric)
    by_id = dict(zip(keys.tolist(), ref.tolist()))
    tol = 1e-4 * (np.abs(ref).max() + 1.0)
    kth = np.sort(ref)[::-1][kk - 1]
    got = np.asarray([by_id[i] for i in ids[:kk].tolist()])
    assert len(set(ids[:kk].tolist())) == kk
    assert (got >= kth - tol).all(), "a record outside the true top-k"
    np.testing.assert_allclose(scores[:kk], got, rtol=1e-4, atol=tol)


@pytest.mark.parametrize("metric", [Metric.DOT, Metric.COSINE, Metric.L2])
@pytest.mark.parametrize("mixed_rows", [1 << 62, 64])
def test_search_mixed_is_exact_per_namespace(rng: np.random.Generator, metric: Metric, mixed_rows: int) -> None:
    clock = Clock()
    backend = NumpyBackend()
    backend.mixed_rows = mixed_rows  # 64: the larger namespaces are searched on their own
    store = MemoryStore(backend, 12, metric, clock=clock)
    models: dict[str, dict[int, np.ndarray]] = {}
    for j in range(25):
        name = f"user-{j}"
        n = int(rng.choice([0, 1, 3, 40, 150, 300]))
        ids = rng.choice(10_000, n, replace=False).astype(np.int64)
        vecs = rng.standard_normal((n, 12)).astype(np.float32)
        models[name] = dict(zip(ids.tolist(), vecs))
        if n:
            ttl = 5 * NS if j % 4 == 0 else 0  # every fourth namespace's rows expire below
            w = Write(WriteOp.UPSERT, name, ids=ids, vectors=vecs, payloads=None, now_ns=clock(), ttl_ns=ttl)
            _pos, out = commit_and_apply(None, store, [w])
            assert not isinstance(out[0], Exception)
    # Some rows of the TTL namespaces expire (not swept): a mixed search leaves them out.
    clock.t += 6 * NS
    for j in range(0, 25, 4):
        models[f"user-{j}"] = {}
    # A namespace written afterwards at the new time, with rows that do not expire.
    late = rng.standard_normal((7, 12)).astype(np.float32)
    store.get_or_create("late").upsert(np.arange(7), late, None, Stamps.fresh(7, clock()))
    models["late"] = dict(zip(range(7), late))
    names = [*models, "never-written", "nor-this"]
    spaces: list[Namespace | None] = [store.get(n) for n in names]
    of_query = rng.integers(0, len(names), 200)
    q = rng.standard_normal((200, 12)).astype(np.float32)
    for k in (1, 10, 33):
        ids, scores = store.search_mixed(spaces, of_query, q, k).result()
        assert ids.shape == scores.shape == (200, k)
        for j in range(200):
            check(ids[j], scores[j], models.get(names[of_query[j]], {}), q[j], k, metric)


def test_search_each_matches_one_search_per_matrix(rng: np.random.Generator) -> None:
    """The backends' shared fallback (numpy, sharded) and the reference of the CUDA kernel."""
    backend = NumpyBackend()
    mats = [backend.new_matrix(8, 64, Metric.DOT) for _ in range(5)]
    n = np.asarray([1, 5, 64, 30, 2])
    data = [rng.standard_normal((int(m), 8)).astype(np.float32) for m in n]
    for m, d in zip(mats, data):
        m.write_rows(np.arange(len(d)), d)
    of = rng.integers(0, 5, 40)
    q = rng.standard_normal((40, 8)).astype(np.float32)
    rows, scores = search_each(mats, n, of, q, 6)
    assert np.isneginf(scores[rows < 0]).all()
    for j in range(40):
        i = int(of[j])
        kk = min(6, int(n[i]))
        ref = data[i].astype(np.float64) @ q[j].astype(np.float64)
        assert (rows[j, kk:] == -1).all() and (rows[j, :kk] >= 0).all()
        np.testing.assert_allclose(np.sort(ref)[::-1][:kk], ref[rows[j, :kk]], rtol=1e-5, atol=1e-5)


def test_a_mixed_search_refuses_another_backends_matrix_and_statistics_count_the_live_ones() -> None:
    backend, other = NumpyBackend(), ShardedBackend([NumpyBackend(), NumpyBackend()], ["a", "b"])
    mine = backend.new_matrix(8, 64, Metric.DOT)
    foreign = other.new_matrix(8, 64, Metric.DOT)
    q = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="this backend's matrices"):
        backend.search_mixed([mine, foreign], np.asarray([1, 1]), np.asarray([0, 1]), q, 3)
    assert dict(backend.statistics().memory)["rows"] == mine.nbytes
    del mine
    gc.collect()
    assert dict(backend.statistics().memory)["rows"] == 0  # (held weakly: a dropped matrix is not counted)


class Spaces:
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def __call__(self, key: tuple[bytes, int]) -> object | None:
        name = key[0][: key[1]].decode()
        return type("NS", (), {"n": 10})() if name in self.names else None


def records(names: list[str], *, flags: int = 0, k: int = 5) -> np.ndarray:
    rec = np.zeros(len(names), slot_dtype())
    for i, name in enumerate(names):
        rec[i]["op"] = 1  # RECALL
        rec[i]["nq"] = 1
        rec[i]["k"] = k
        rec[i]["flags"] = flags
        rec[i]["namespace"] = name.encode()
        rec[i]["ns_len"] = len(name)
    return rec


def test_plain_recalls_to_several_namespaces_take_the_mixed_route() -> None:
    limits = Limits(k_limit=64, dim=4, min_work=-1, max_queries=8)
    q = np.ones((3, 4), np.float32)
    lookup = Spaces({"a", "b"})
    plan = classify(records(["a", "b", "zz-new"]), q, lookup, limits)
    assert plan.route is Route.MIXED and plan.reason == "3 namespaces" and plan.k == 5
    assert classify(records(["a", "a", "a"]), q, lookup, limits).route is Route.UNIFORM
    # same bytes, other lengths: other namespaces
    rec = records(["ab", "ab", "ab"])
    rec[1]["ns_len"] = 1
    assert classify(rec, q, lookup, limits).route is Route.MIXED
    bad = q.copy()
    bad[1, 2] = np.nan
    assert classify(records(["a", "b", "a"]), bad, lookup, limits).reason == "non-finite query"
    # payloads (a flag) keep a batch on the general route
    assert classify(records(["a", "b", "a"], flags=int(Flag.WITH_PAYLOAD)), q, lookup, limits).route is Route.GENERAL


def test_a_mixed_plan_groups_its_requests_by_namespace_once() -> None:
    """classify hands the MIXED route each request's namespace among the batch's distinct ones
    (the pipeline searches per distinct namespace): checked against a grouping by name, on
    random names with stale tails past ns_len and names equal but for their length."""
    rng = np.random.default_rng(5)
    limits = Limits(k_limit=64, dim=4, min_work=-1, max_queries=256)
    names = [f"user-{int(i)}" for i in rng.integers(0, 40, 200)]
    rec = records(names)
    for i in rng.choice(len(rec), 50, replace=False):  # stale bytes of a longer name
        rec[i]["namespace"] = (names[i] + "9z").encode()
    plan = classify(rec, np.ones((len(rec), 4), np.float32), Spaces(set(names)), limits)
    assert plan.route is Route.MIXED and plan.groups is not None
    keys, of = plan.groups
    decoded = [key[0][: key[1]].decode() for key in keys]
    assert decoded == list(dict.fromkeys(names))  # distinct, in order of first appearance
    assert [decoded[j] for j in of.tolist()] == names
    assert plan.reason == f"{len(set(names))} namespaces"
    # the same bytes under another length is another namespace
    g = group_namespaces(namespace_field(records(["ab", "ab"])), np.array([2, 1], np.uint32))
    assert len(g.keys) == 2 and g.of_request.tolist() == [0, 1]


def test_bytes_a_longer_name_left_in_the_slot_do_not_split_a_namespace() -> None:
    """A client writes a name's bytes and its length; what a longer name left past that length
    is not part of the name. Before, such a batch (one namespace, stale tails) went to the
    general route as "2 namespaces": a workload of one namespace, through slots that had served
    others, lost the batched route (issue 34: 48.0k -> 27.4k recalls/s with 1,023 loaded)."""
    limits = Limits(k_limit=64, dim=4, min_work=-1, max_queries=8)
    q = np.ones((3, 4), np.float32)
    lookup = Spaces({"user-1"})
    rec = records(["user-1", "user-1", "user-1"])
    rec[1]["namespace"] = b"user-1999"  # a longer name's tail, past ns_len = 6
    rec[2]["namespace"] = b"user-12"
    plan = classify(rec, q, lookup, limits)
    assert plan.route is Route.UNIFORM and plan.namespace is not None, plan
    assert (namespace_field(rec) == namespace_field(records(["user-1"] * 3))).all()


def test_the_sweeper_visits_only_namespaces_with_expiring_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing per pass grows with the namespaces held: finding the namespaces due for a sweep
    asks only those with records that may expire (a heap), not every namespace (before: every
    namespace, every 0.2 s, on the serving thread: 100k namespaces cost ~30 ms a sweep)."""
    clock = Clock()
    store = MemoryStore(NumpyBackend(), 4, Metric.DOT, clock=clock)
    v = np.ones((2, 4), np.float32)
    for j in range(3000):
        store.get_or_create(f"u{j}").upsert(np.arange(2), v, None, Stamps.fresh(2, clock()))
    for j in (5, 77):  # two namespaces with rows that expire in 1 s
        store.get(f"u{j}").upsert(np.arange(2, 4), v, None, Stamps.written(2, clock(), NS))
    asked: list[str] = []
    real = Namespace.next_expiry

    def counted(self: Namespace) -> int:
        asked.append(self.name)
        return real(self)

    monkeypatch.setattr(Namespace, "next_expiry", counted)
    assert store.due(clock()) == [] and asked == []  # nothing due yet: the heap's top says so
    assert store.next_expiry() == clock() + NS
    clock.t += 2 * NS
    assert sorted(store.due(clock())) == ["u5", "u77"]
    assert sorted(asked) == ["u5", "u77"]  # only they were asked, not the 3,000 others
