"""The integrations' shared core (kalos.integrations._ids, _filters, _plans, _loops): its pure
pieces on fresh random data (seeds printed) against references written here, the per-loop pool
policy with two event loops (a stand-in pool: the policy is pure bookkeeping), and, on a real
sidecar, each store used from one event loop after another.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from typing import Any

import numpy as np
import pytest

from conftest import slots_free, wait_until
from kalos.broker.errors import InvalidRequest, KalosError, PayloadTooLarge, UnknownNamespace
from kalos.broker.validation import MAX_WHERE_VALUES, parse_where
from kalos.integrations import IdCollision
from kalos.integrations._filters import (
    FieldOp, all_of, any_of, condition, in_chunks, mongo_where, one_of,
)
from kalos.integrations._ids import IdScheme, Probing, claim, find
from kalos.integrations._loops import LoopPools
from kalos.integrations._plans import Step, pack, together
from kalos.sidecar_cuda.filters import PayloadIndex

DIM = 8


# --------------------------------------------------------------------------- ids

def _blake(data: bytes, person: bytes = b"") -> bytes:
    return hashlib.blake2b(data, digest_size=8, person=person).digest()


def random_keys(rng: np.random.Generator, n: int) -> list[str]:
    alphabet = list("abcxyz019-_ éü中")
    return ["".join(rng.choice(alphabet, int(rng.integers(0, 12)))) for _ in range(n)]


def test_the_three_id_schemes_are_the_documented_hashes(rng: np.random.Generator) -> None:
    """The ids records were stored at must never move: each store's scheme against its formula
    (docs/integrations.md), recomputed here, on random keys."""
    for framework in ("langchain_core", "langgraph.store.base", "llama_index.core"):
        pytest.importorskip(framework)
    from kalos.integrations import langchain, langgraph, llamaindex

    mask = (1 << 63) - 1
    for key in random_keys(rng, 200):
        assert langchain.kalos_id(key) == int.from_bytes(_blake(key.encode()), "big") & mask
        assert llamaindex.kalos_id(key) == \
            int.from_bytes(_blake(key.encode(), b"kalos.llama"), "big") & mask
        for a in range(1, llamaindex.MAX_PROBES):
            assert llamaindex.kalos_id(key, a) == int.from_bytes(
                _blake(f"{a}\x00{key}".encode(), b"kalos.llama"), "big") & mask
        ns = tuple(random_keys(rng, int(rng.integers(1, 4))))
        canon = json.dumps([list(ns), key], ensure_ascii=False, separators=(",", ":"))
        base = int.from_bytes(_blake(canon.encode()), "little") % ((1 << 48) - 8)
        assert langgraph.item_id_window(ns, key) == list(range(base, base + 8))
    # pinned values, as the stores' own tests pin them
    assert langchain.kalos_id("foo") == 0x7403_AEA3_9BAF_52FB
    assert llamaindex.kalos_id("00000000-0000-0000-0000-000000000000") == 3357814380515466140


def test_probe_outside_the_scheme_raises() -> None:
    scheme = IdScheme(Probing.REHASH, probes=2)
    with pytest.raises(ValueError, match="attempt 2"):
        scheme.probe("k", 2)
    assert IdScheme(Probing.WINDOW, probes=4, bits=20).ids("k")[-1] < 1 << 20


def test_one_collision_error_under_every_old_name() -> None:
    for framework in ("langchain_core", "langgraph.store.base", "llama_index.core"):
        pytest.importorskip(framework)
    from kalos.integrations.langchain import IdCollisionError
    from kalos.integrations.langgraph import KeyCollision
    from kalos.integrations.llamaindex import IdCollision as LlamaIdCollision

    assert IdCollisionError is KeyCollision is LlamaIdCollision is IdCollision
    # what the old classes were, so that callers' except clauses still catch it
    assert issubclass(IdCollision, KalosError) and issubclass(IdCollision, ValueError)
    assert issubclass(IdCollision, RuntimeError)


def reference_claim(probes: dict[str, list[int]], held: dict[int, str | None]) -> dict[str, int] | None:
    """The placement rule stated plainly: a key's own record wins wherever it is among its
    probes; then keys in order take their first probe that no record and no earlier key holds.
    None when some key finds nothing."""
    out: dict[str, int] = {}
    for key, ids in probes.items():
        for i in ids:
            if held.get(i, "-") == key:
                out[key] = i
                break
    used = set(held) | set(out.values())
    for key, ids in probes.items():
        if key in out:
            continue
        free = [i for i in ids if i not in used]
        if not free:
            return None
        out[key] = free[0]
        used.add(free[0])
    return out


def test_claim_against_the_reference_on_random_tables(rng: np.random.Generator) -> None:
    """Crowded random id spaces (ids 0..15, 1-4 probes a key): claim places keys exactly as the
    plain rule does, never on another key's or a foreign record, never two keys on one id."""
    collisions = 0
    for _ in range(2000):
        keys = [f"k{i}" for i in range(int(rng.integers(1, 8)))]
        probes = {k: rng.choice(16, int(rng.integers(1, 5)), replace=False).tolist() for k in keys}
        held: dict[int, str | None] = {}
        for i in rng.choice(16, int(rng.integers(0, 10)), replace=False).tolist():
            held[i] = str(rng.choice(keys + ["other", "other2"])) if rng.random() < 0.8 else None
        want = reference_claim(probes, held)
        if want is None:
            collisions += 1
            with pytest.raises(IdCollision, match="no free Kalos id"):
                claim(probes, held)
            continue
        got = claim(probes, held)
        assert got == want
        assert len(set(got.values())) == len(got)
        assert all(held.get(i, k) == k for k, i in got.items())
        assert find(probes, held) == {k: i for k, i in got.items() if held.get(i) == k}
    assert 100 < collisions < 1900, collisions  # both outcomes were exercised


def test_claim_names_what_holds_the_ids() -> None:
    with pytest.raises(IdCollision, match=r"'b' \(7 holds 'a', another key of this write\)"):
        claim({"a": [7], "b": [7]}, {})
    with pytest.raises(IdCollision, match=r"'x' \(3 holds 'y', 4 holds a record that is not"):
        claim({"x": [3, 4]}, {3: "y", 4: None})
    assert claim({"x": [3, 4, 5]}, {3: None, 5: "x"}) == {"x": 5}  # its own record, not 4


# --------------------------------------------------------------------------- filters

VALUES: list[Any] = [0, 1, 1.0, 2, 2.5, True, False, None, "x", "y", ""]
FIELDS = ["a", "b", "c"]


def same(stored: Any, v: Any) -> bool:
    """Kalos equality, stated independently: scalars by type and value, 1 == 1.0, true != 1,
    null only equals null; lists and objects equal nothing."""
    kinds = [None if x is None else bool if isinstance(x, bool) else float
             if isinstance(x, (int, float)) else str if isinstance(x, str) else object
             for x in (stored, v)]
    return kinds[0] is kinds[1] and kinds[0] is not object and stored == v


def holds(doc: dict[str, Any], flt: dict[str, Any]) -> bool:
    """A Mongo-style filter on one payload, in Kalos semantics (the reference)."""
    for key, cond in flt.items():
        if key == "$and":
            ok = all(holds(doc, c) for c in cond)
        elif key == "$or":
            ok = any(holds(doc, c) for c in cond)
        elif not isinstance(cond, dict):
            ok = key in doc and same(doc[key], cond)
        else:
            ok = all(op_holds(doc, key, op, arg) for op, arg in cond.items())
        if not ok:
            return False
    return True


def op_holds(doc: dict[str, Any], key: str, op: str, arg: Any) -> bool:
    present, v = key in doc, doc.get(key)
    number = present and isinstance(v, (int, float)) and not isinstance(v, bool)
    return {
        "$eq": lambda: present and same(v, arg),
        "$ne": lambda: not (present and same(v, arg)),
        "$in": lambda: present and any(same(v, a) for a in arg),
        "$nin": lambda: not (present and any(same(v, a) for a in arg)),
        "$gt": lambda: number and v > arg, "$gte": lambda: number and v >= arg,
        "$lt": lambda: number and v < arg, "$lte": lambda: number and v <= arg,
        "$exists": lambda: present == arg,
    }[op]()


def random_filter(rng: np.random.Generator, depth: int = 0) -> dict[str, Any]:
    flt: dict[str, Any] = {}
    for _ in range(int(rng.integers(1, 4))):
        r = rng.random()
        if r < 0.2 and depth < 2:
            flt[str(rng.choice(["$and", "$or"]))] = [random_filter(rng, depth + 1)
                                                    for _ in range(int(rng.integers(1, 3)))]
        elif r < 0.45:
            flt[str(rng.choice(FIELDS))] = VALUES[int(rng.integers(len(VALUES)))]
        else:
            cond: dict[str, Any] = {}
            for _ in range(int(rng.integers(1, 3))):
                op = str(rng.choice([o.value for o in FieldOp]))
                if op in ("$in", "$nin"):
                    cond[op] = [VALUES[i] for i in rng.choice(len(VALUES), 3, replace=False)]
                elif op in ("$gt", "$gte", "$lt", "$lte"):
                    cond[op] = float(rng.choice([0, 1, 1.5, 2]))
                elif op == "$exists":
                    cond[op] = bool(rng.random() < 0.5)
                else:
                    cond[op] = VALUES[int(rng.integers(len(VALUES)))]
            flt[str(rng.choice(FIELDS))] = cond
    return flt


def random_payloads(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        doc: dict[str, Any] = {}
        for f in FIELDS:
            r = rng.random()
            if r < 0.7:
                doc[f] = VALUES[int(rng.integers(len(VALUES)))]
            elif r < 0.8:
                doc[f] = [1, 2]  # present, equal to no scalar
        out.append(doc)
    return out


def test_mongo_filters_match_the_reference_through_the_sidecars_evaluator(
        rng: np.random.Generator) -> None:
    """Random Mongo-style filters ($eq spelled both ways, several operators on one field,
    nested $and/$or) translated by mongo_where, parsed and evaluated by the sidecar's own code
    (broker.validation.parse_where, sidecar_cuda.filters.PayloadIndex) on random payloads: the
    rows that match are exactly those the reference picks."""
    docs = random_payloads(rng, 300)
    index = PayloadIndex(len(docs))
    index.write(np.arange(len(docs)), [json.dumps(d).encode() for d in docs])
    for _ in range(400):
        flt = random_filter(rng)
        where = mongo_where(flt)
        assert "$eq" not in json.dumps(where)  # equality stays the bare value until the sidecar takes $eq
        got = index.mask(parse_where(where), len(docs))
        want = np.array([holds(d, flt) for d in docs])
        assert (got == want).all(), (flt, where)


def test_mongo_where_spelling() -> None:
    assert mongo_where({"a": {"$eq": 1}}) == {"a": 1}
    assert mongo_where({"a": {"$eq": 1, "$gt": 0}}) == {"$and": [{"a": 1}, {"a": {"$gt": 0}}]}
    assert mongo_where({"a": {"$gt": 0}, "b": 2, "$and": [{"a": {"$lt": 5}}]}, "m.{}".format) == \
        {"m.a": {"$gt": 0, "$lt": 5}, "m.b": 2}
    assert mongo_where({"a": {"$in": ("x", "y")}}) == {"a": {"$in": ["x", "y"]}}
    assert mongo_where({"$or": [{"a": 1}]}) == {"a": 1}


@pytest.mark.parametrize("bad", [
    {"a": {"$eq": {"$in": [1, 2]}}},  # a dict after $eq is a value, never operators
    {"a": {"$eq": [1]}}, {"a": [1, 2]}, {"a": {"$regex": "x"}}, {"$not": {"a": 1}},
    {"a": {}}, {}, {"$or": []}, {"$and": "x"},
])
def test_mongo_where_refuses_what_kalos_cannot_say(bad: Any) -> None:
    with pytest.raises(InvalidRequest):
        mongo_where(bad)


def test_combinators() -> None:
    assert all_of([None, None]) is None
    assert all_of([{"a": 1}, None]) == {"a": 1}
    assert all_of([{"a": {"$gt": 1}}, {"a": {"$lt": 3}}, {"b": 2}]) == \
        {"a": {"$gt": 1, "$lt": 3}, "b": 2}
    assert all_of([{"a": {"$gt": 1}}, {"a": {"$gt": 2}}]) == \
        {"$and": [{"a": {"$gt": 1}}, {"a": {"$gt": 2}}]}  # one operator twice: not merged
    assert all_of([{"$and": [{"a": 1}]}, {"$and": [{"b": 1}]}]) == {"$and": [{"a": 1}, {"b": 1}]}
    assert all_of([{"$or": [{"a": 1}, {"b": 1}]}, {"$or": [{"c": 1}, {"b": 2}]}])["$and"]
    with pytest.raises(InvalidRequest):
        any_of([])
    assert condition("f", FieldOp.NIN, {"x"}) == {"f": {"$nin": ["x"]}}


def test_one_of_and_in_chunks_stay_inside_the_sidecars_bounds(rng: np.random.Generator) -> None:
    values = [f"v{i}-" + "x" * int(rng.integers(0, 40)) for i in range(int(rng.integers(1, 4000)))]
    where = one_of("f", values)
    parse_where(where)  # every $in within the sidecar's bound
    listed = [v for c in (where.get("$or") or [where]) for v in c["f"]["$in"]]
    assert listed == values
    chunks = in_chunks(values + values[:3], blob_bytes=8192)
    assert [v for c in chunks for v in c] == values  # each once, in order
    for c in chunks:
        assert len(c) <= MAX_WHERE_VALUES
        assert len(json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode()) <= 8192 // 2 + 1
    assert in_chunks([], 8192) == [] and one_of("f", []) == {"f": {"$in": []}}


# --------------------------------------------------------------------------- plans (pure)

def test_pack() -> None:
    assert pack([10, 10, 10, 30, 5], max_rows=2, max_bytes=25) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert pack([], 8, 100) == []


def test_together_runs_plans_side_by_side() -> None:
    """Each round carries the steps of every unfinished plan; answers go back to their plan."""
    def step(tag: str) -> Step[Any]:
        return Step(lambda _: tag, lambda _: asyncio.sleep(0, tag))

    def plan(n: int) -> Any:
        seen = []
        for r in range(n):
            got = yield [step(f"{n}.{r}.a"), step(f"{n}.{r}.b")]
            seen += got
        return seen

    run = together([plan(0), plan(2), plan(1)])
    rounds = []
    steps = next(run)
    try:
        while True:
            rounds.append(len(steps))
            steps = run.send([s.run(None) for s in steps])  # type: ignore[arg-type]
    except StopIteration as done:
        assert done.value == [[], ["2.0.a", "2.0.b", "2.1.a", "2.1.b"], ["1.0.a", "1.0.b"]]
    assert rounds == [4, 2]


# --------------------------------------------------------------------------- one pool per loop

class StandInPool:
    """What LoopPools needs of a pool: close and terminate, counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closed = self.terminated = False

    async def close(self) -> None:
        assert asyncio.get_running_loop() is self.loop, "closed from another loop"
        self.closed = True

    def terminate(self) -> None:
        self.terminated = True


class Opener:
    def __init__(self, fail: int = 0) -> None:
        self.calls = 0
        self.fail = fail
        self.gate: asyncio.Event | None = None

    async def __call__(self) -> StandInPool:
        self.calls += 1
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        if self.calls <= self.fail:
            raise ConnectionError("no sidecar yet")
        return StandInPool(asyncio.get_running_loop())


def test_one_loop_after_another_reaps_the_ended_loops_pool() -> None:
    opener = Opener()
    pools: LoopPools[StandInPool] = LoopPools(opener)

    async def use() -> StandInPool:
        first = await pools.get()
        assert await pools.get() is first and pools.opened() is first
        return first

    p1 = asyncio.run(use())  # the loop is closed when run returns; its pool was not closed
    assert not p1.terminated and pools.loops() == 1
    p2 = asyncio.run(use())
    assert p2 is not p1 and opener.calls == 2
    assert p1.terminated and not p1.closed  # reaped when the next loop asked
    assert not p2.terminated and pools.loops() == 1
    pools.reap()
    assert p2.terminated and pools.loops() == 0 and pools.opened() is None


def test_two_running_loops_get_a_pool_each() -> None:
    """Loops in two threads at once: one pool each (concurrent first calls in a loop share one
    opening), each closed by its own loop's aclose."""
    opener = Opener()
    pools: LoopPools[StandInPool] = LoopPools(opener)
    both = threading.Barrier(2, timeout=30)
    got: dict[int, StandInPool] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        async def main() -> None:
            a, b, c = await asyncio.gather(pools.get(), pools.get(), pools.get())
            assert a is b is c
            got[i] = a
            both.wait()  # both loops hold their pool at the same time
            assert pools.loops() == 2
            both.wait()
            await pools.aclose()
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got[0] is not got[1] and opener.calls == 2
    assert all(p.closed and not p.terminated for p in got.values())
    assert pools.loops() == 0


def test_a_failed_opening_is_retried() -> None:
    opener = Opener(fail=1)
    pools: LoopPools[StandInPool] = LoopPools(opener)

    async def main() -> None:
        with pytest.raises(ConnectionError):
            await pools.get()
        assert pools.loops() == 0
        assert isinstance(await pools.get(), StandInPool) and opener.calls == 2
        await pools.aclose()
        await pools.aclose()  # twice is fine

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_opening_to_the_next() -> None:
    opener = Opener()
    pools: LoopPools[StandInPool] = LoopPools(opener)

    async def main() -> None:
        opener.gate = asyncio.Event()
        first = asyncio.ensure_future(pools.get())
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.ensure_future(pools.get())
        opener.gate.set()
        pool = await second
        assert opener.calls == 1 and pools.opened() is pool
        await pools.aclose()
        assert pool.closed

    asyncio.run(main())


# --------------------------------------------------------------------------- stores, loop after loop

def _langchain(name: str) -> Any:
    pytest.importorskip("langchain_core")
    from langchain_core.embeddings import DeterministicFakeEmbedding

    from kalos.integrations.langchain import KalosVectorStore

    store = KalosVectorStore(DeterministicFakeEmbedding(size=DIM), name=name, namespace="lc")

    async def use(i: int) -> None:
        await store.aadd_texts([f"text {i}"], ids=[f"id-{i}"])
        assert f"id-{i}" in {d.id for d in await store.asimilarity_search(f"text {i}", k=8)}
    return store, use


def _langgraph(name: str) -> Any:
    pytest.importorskip("langgraph.store.base")
    from kalos.integrations.langgraph import KalosStore

    store = KalosStore(name, namespace="lg")

    async def use(i: int) -> None:
        await store.aput(("loops",), f"k{i}", {"i": i})
        item = await store.aget(("loops",), f"k{i}")
        assert item is not None and item.value == {"i": i}
    return store, use


def _llamaindex(name: str) -> Any:
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from kalos.integrations.llamaindex import KalosLlamaVectorStore

    store = KalosLlamaVectorStore(name, namespace="li", timeout=10.0)

    async def use(i: int) -> None:
        v = np.random.default_rng(i).standard_normal(DIM).tolist()
        await store.async_add([TextNode(text=f"t{i}", id_=f"n{i}", embedding=v)])
        got = await store.aquery(VectorStoreQuery(query_embedding=v, similarity_top_k=1))
        assert got.ids == [f"n{i}"]
    return store, use


@pytest.mark.parametrize("make", [_langchain, _langgraph, _llamaindex],
                         ids=["langchain", "langgraph", "llamaindex"])
def test_a_store_serves_one_event_loop_after_another(sidecar_factory: Any, make: Any) -> None:
    """asyncio.run three times on one store: each loop gets its own pool, and the pool of a
    loop that ended is terminated on the next use, so its slots come back (8 slots hold two
    pools of 4, not three). Before the shared policy LangChain refused a second loop and
    LangGraph kept the ended loop's pool leased."""
    h = sidecar_factory("loops", "--dim", str(DIM), "--slots", "8", "--metric", "cosine",
                        "--backend", "numpy")
    store, use = make(h.name)
    try:
        for i in range(3):
            asyncio.run(use(i))
    finally:
        store.close()  # terminates the last loop's pool (its loop has ended)
    assert wait_until(lambda: slots_free(h.name))


@pytest.mark.asyncio
async def test_plan_errors_reach_the_caller_and_caught_ones_come_back(sidecar_factory: Any) -> None:
    """On both drivers: an error a step catches is its result; any other ends the plan."""
    from kalos.integrations._core import Connections
    from kalos.integrations._plans import GET, fetch_payloads

    h = sidecar_factory("plans", "--dim", str(DIM), "--blob-bytes", "4096", "--backend", "numpy")
    conns = Connections(h.name, timeout=10.0, pool_size=2)

    def plan() -> Any:
        [missing] = yield [GET([1], namespace="nowhere").catching(UnknownNamespace)]
        assert isinstance(missing, UnknownNamespace)
        yield [GET([1], namespace="nowhere")]
        raise AssertionError("not reached")

    with pytest.raises(UnknownNamespace):
        conns.run(plan())
    with pytest.raises(UnknownNamespace):
        await conns.arun(plan())
    # two payloads that overflow one answer together: the read is halved, not refused
    client = conns.client()
    for i, c in ((1, "x"), (2, "y")):
        client.upsert([i], np.ones((1, DIM), np.float32), [{"t": c * 3000}], namespace="big")
    with pytest.raises(PayloadTooLarge):
        client.get([1, 2], namespace="big", with_vectors=False)
    assert set(conns.run(fetch_payloads("big", [1, 2, 3]))) == {1, 2}
    assert set(await conns.arun(fetch_payloads("big", [2, 1]))) == {1, 2}
    await conns.aclose()
    assert not conns.opened
