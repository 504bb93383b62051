"""The integrations' shared core (kalos.integrations._ids, _filters, _plans, _loops): its pure
pieces on fresh random data (seeds printed) against references written here, the per-loop pool
policy with two event loops (a stand-in pool: the policy is pure bookkeeping), and, on a real
sidecar, each store used from one event loop after another.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import threading
import urllib.request
from typing import Any

import numpy as np
import pytest
from conftest import free_port, slots_free, wait_until

from kalos.broker.errors import InvalidRequest, KalosError, PayloadTooLarge
from kalos.broker.validation import MAX_WHERE_VALUES, parse_where
from kalos.integrations import IdCollision
from kalos.integrations._filters import (
    FieldOp,
    all_of,
    any_of,
    condition,
    in_chunks,
    mongo_where,
    one_of,
)
from kalos.integrations._ids import IdScheme, Probing, Reading, Reads, claim, find, next_reads
from kalos.integrations._loops import LoopPools
from kalos.integrations._plans import Step, pack, together
from kalos.sidecar_cuda.storage.filters import PayloadIndex

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
        assert llamaindex.kalos_id(key) == int.from_bytes(_blake(key.encode(), b"kalos.llama"), "big") & mask
        for a in range(1, llamaindex.MAX_PROBES):
            assert (
                llamaindex.kalos_id(key, a)
                == int.from_bytes(_blake(f"{a}\x00{key}".encode(), b"kalos.llama"), "big") & mask
            )
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


def reference_find(probes: dict[str, list[int]], held: dict[int, str | None]) -> dict[str, int]:
    """Each key's first probe holding its own record, stated plainly."""
    return {
        k: next(i for i in ids if held.get(i, "-") == k)
        for k, ids in probes.items()
        if any(held.get(i, "-") == k for i in ids)
    }


def read_in_rounds(
    probes: dict[str, list[int]],
    truth: dict[int, str | None],
    *,
    place: list[str] | None = None,
    can_locate: bool = False,
    per_request: int = 0,
) -> tuple[Reading[str], list[Reads[str]]]:
    """Drive next_reads against a table known in full, as _plans.read_probes drives it against
    a sidecar: ids are read by id, located keys yield every record naming them."""
    seen: Reading[str] = Reading()
    rounds: list[Reads[str]] = []
    for _ in range(64):
        reads = next_reads(probes, seen, place=place, can_locate=can_locate, per_request=per_request)
        if not reads:
            return seen, rounds
        assert not seen.read & set(reads.ids), "an id read twice"
        assert not seen.located & set(reads.locate), "a key looked up twice"
        records = {i: truth[i] for i in reads.ids if i in truth}
        records.update({i: k for i, k in truth.items() if k in reads.locate})
        seen.learn(reads.ids, records, reads.locate)
        rounds.append(reads)
    raise AssertionError("next_reads never settled")


def test_reading_in_rounds_places_as_if_every_probe_was_read(rng: np.random.Generator) -> None:
    """Crowded random tables (ids 0..11, 1-6 probes a key, rehashed or a window; keys stored
    anywhere, twice, or where an earlier probe has since freed up): what next_reads has read
    gives find and claim (over all keys or a subset) the answers, and the same IdCollision
    message, that they give with every id read, with or without look-ups by key."""
    outcomes = {"placed": 0, "collision": 0, "located": 0, "walked": 0}
    for _ in range(3000):
        keys = [f"k{i}" for i in range(int(rng.integers(1, 7)))]
        n = int(rng.integers(1, 7))
        if rng.random() < 0.5:
            probes = {k: rng.choice(12, n, replace=False).tolist() for k in keys}
        else:
            probes = {k: list(range(b, b + n)) for k, b in zip(keys, rng.integers(0, 12 - n + 1, len(keys)))}
        truth: dict[int, str | None] = {}
        for i in rng.choice(12, int(rng.integers(0, 10)), replace=False).tolist():
            truth[i] = str(rng.choice(keys + ["other"])) if rng.random() < 0.85 else None
        place = None if rng.random() < 0.5 else [k for k in keys if rng.random() < 0.7]
        can_locate = bool(rng.random() < 0.6)
        seen, rounds = read_in_rounds(
            probes, truth, place=place, can_locate=can_locate, per_request=int(rng.choice([0, 0, 8, 32]))
        )
        assert seen.read <= {i for ids in probes.values() for i in ids} | set(truth)
        assert all(seen.held[i] == truth[i] for i in seen.held)
        assert find(probes, seen.held) == reference_find(probes, truth)
        placing = {k: v for k, v in probes.items() if place is None or k in place}
        want = reference_claim(placing, truth)
        if want is None:
            outcomes["collision"] += 1
            with pytest.raises(IdCollision) as full:
                claim(placing, truth)
            with pytest.raises(IdCollision) as partial:
                claim(placing, seen.held)
            assert str(partial.value) == str(full.value)
        else:
            outcomes["placed"] += 1
            assert claim(placing, seen.held) == want
        outcomes["located"] += any(r.locate for r in rounds)
        outcomes["walked"] += len(rounds) > 2
    print(outcomes)
    assert min(outcomes.values()) > 50, outcomes  # every path was exercised


def test_new_keys_read_one_id_each_and_are_looked_up_by_key() -> None:
    """The cost the rounds exist for: new keys (first probes free) read their first probe, then
    one look-up names them all; without look-ups every probe is read; when every probe fits
    one request, one round reads them all."""
    probes = {f"k{i}": [100 * i + a for a in range(8)] for i in range(40)}
    seen, rounds = read_in_rounds(probes, {}, can_locate=True, per_request=32)
    assert [(r.ids, r.locate) for r in rounds] == [([100 * i for i in range(40)], []), ([], list(probes))]
    assert seen.read == {100 * i for i in range(40)}
    seen, rounds = read_in_rounds(probes, {}, can_locate=False, per_request=32)
    assert len(rounds) == 2 and seen.read == {i for ids in probes.values() for i in ids}
    few = {k: probes[k] for k in ["k0", "k1", "k2", "k3"]}
    seen, rounds = read_in_rounds(few, {}, can_locate=True, per_request=32)
    assert len(rounds) == 1 and len(seen.read) == 32
    # stored at their first probe: settled there, nothing else read
    truth: dict[int, str | None] = {100 * i: f"k{i}" for i in range(40)}
    seen, rounds = read_in_rounds(probes, truth, can_locate=True, per_request=32)
    assert len(rounds) == 1 and claim(probes, seen.held) == {f"k{i}": 100 * i for i in range(40)}


def test_a_key_is_found_where_it_went_after_its_first_probe_freed_up() -> None:
    """'b' went to its second probe while 'a' held the first; 'a' is gone: a look-up finds 'b'
    at 2, so it is written there again, not copied to the free 1 (no tombstones)."""
    probes = {"b": [1, 2, 3]}
    for can_locate in (True, False):
        seen, rounds = read_in_rounds(probes, {2: "b"}, can_locate=can_locate)
        assert claim(probes, seen.held) == {"b": 2}
        assert (rounds[1].locate == ["b"]) is can_locate


def test_the_claim_walk_reads_an_id_it_would_take_unread() -> None:
    """'c' collides at 1 and goes on to 5, the first probe of new 'u': 'u' must take its second
    probe, 9, which only the third round reads (it holds another record: 'u' takes 10)."""
    probes = {"c": [1, 5], "u": [5, 9, 10]}
    truth: dict[int, str | None] = {1: "other", 9: "other"}
    seen, rounds = read_in_rounds(probes, truth, can_locate=True)
    assert [(r.ids, r.locate) for r in rounds] == [([1, 5], []), ([], ["u"]), ([9, 10], [])]
    assert claim(probes, seen.held) == {"c": 5, "u": 10}
    assert claim(probes, seen.held) == reference_claim(probes, truth)


# --------------------------------------------------------------------------- filters

VALUES: list[Any] = [0, 1, 1.0, 2, 2.5, True, False, None, "x", "y", ""]
FIELDS = ["a", "b", "c"]


def same(stored: Any, v: Any) -> bool:
    """Kalos equality, stated independently: scalars by type and value, 1 == 1.0, true != 1,
    null only equals null; lists and objects equal nothing."""
    kinds = [
        None
        if x is None
        else bool
        if isinstance(x, bool)
        else float
        if isinstance(x, (int, float))
        else str
        if isinstance(x, str)
        else object
        for x in (stored, v)
    ]
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
        "$gt": lambda: number and v > arg,
        "$gte": lambda: number and v >= arg,
        "$lt": lambda: number and v < arg,
        "$lte": lambda: number and v <= arg,
        "$exists": lambda: present == arg,
    }[op]()


def random_filter(rng: np.random.Generator, depth: int = 0) -> dict[str, Any]:
    flt: dict[str, Any] = {}
    for _ in range(int(rng.integers(1, 4))):
        r = rng.random()
        if r < 0.2 and depth < 2:
            flt[str(rng.choice(["$and", "$or"]))] = [
                random_filter(rng, depth + 1) for _ in range(int(rng.integers(1, 3)))
            ]
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


def test_mongo_filters_match_the_reference_through_the_sidecars_evaluator(rng: np.random.Generator) -> None:
    """Random Mongo-style filters ($eq spelled both ways, several operators on one field,
    nested $and/$or) translated by mongo_where, parsed and evaluated by the sidecar's own code
    (broker.validation.parse_where, sidecar_cuda.storage.filters.PayloadIndex) on random payloads: the
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
    assert mongo_where({"a": {"$gt": 0}, "b": 2, "$and": [{"a": {"$lt": 5}}]}, "m.{}".format) == {
        "m.a": {"$gt": 0, "$lt": 5},
        "m.b": 2,
    }
    assert mongo_where({"a": {"$in": ("x", "y")}}) == {"a": {"$in": ["x", "y"]}}
    assert mongo_where({"$or": [{"a": 1}]}) == {"a": 1}


@pytest.mark.parametrize(
    "bad",
    [
        {"a": {"$eq": {"$in": [1, 2]}}},  # a dict after $eq is a value, never operators
        {"a": {"$eq": [1]}},
        {"a": [1, 2]},
        {"a": {"$regex": "x"}},
        {"$not": {"a": 1}},
        {"a": {}},
        {},
        {"$or": []},
        {"$and": "x"},
    ],
)
def test_mongo_where_refuses_what_kalos_cannot_say(bad: Any) -> None:
    with pytest.raises(InvalidRequest):
        mongo_where(bad)


def test_combinators() -> None:
    assert all_of([None, None]) is None
    assert all_of([{"a": 1}, None]) == {"a": 1}
    assert all_of([{"a": {"$gt": 1}}, {"a": {"$lt": 3}}, {"b": 2}]) == {"a": {"$gt": 1, "$lt": 3}, "b": 2}
    assert all_of([{"a": {"$gt": 1}}, {"a": {"$gt": 2}}]) == {
        "$and": [{"a": {"$gt": 1}}, {"a": {"$gt": 2}}]
    }  # one operator twice: not merged
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


@pytest.mark.parametrize("make", [_langchain, _langgraph, _llamaindex], ids=["langchain", "langgraph", "llamaindex"])
def test_a_store_serves_one_event_loop_after_another(sidecar_factory: Any, make: Any) -> None:
    """asyncio.run three times on one store: each loop gets its own pool, and the pool of a
    loop that ended is terminated on the next use, so its slots come back (8 slots hold two
    pools of 4, not three). Before the shared policy LangChain refused a second loop and
    LangGraph kept the ended loop's pool leased."""
    h = sidecar_factory("loops", "--dim", str(DIM), "--slots", "8", "--metric", "cosine", "--backend", "numpy")
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
    client = conns.client()
    for i, c in ((1, "x"), (2, "y")):
        client.upsert([i], np.ones((1, DIM), np.float32), [{"t": c * 3000}], namespace="big")

    def plan() -> Any:
        # (a namespace that was never written is no error: its records are none)
        [missing] = yield [GET([1], namespace="nowhere")]
        assert missing.ids.tolist() == [] and missing.missing.tolist() == [1]
        [overflow] = yield [GET([1, 2], namespace="big", with_vectors=False).catching(PayloadTooLarge)]
        assert isinstance(overflow, PayloadTooLarge)
        yield [GET([1, 2], namespace="big", with_vectors=False)]
        raise AssertionError("not reached")

    with pytest.raises(PayloadTooLarge):
        conns.run(plan())
    with pytest.raises(PayloadTooLarge):
        await conns.arun(plan())
    # two payloads that overflow one answer together: the read is halved, not refused
    with pytest.raises(PayloadTooLarge):
        client.get([1, 2], namespace="big", with_vectors=False)
    assert set(conns.run(fetch_payloads("big", [1, 2, 3]))) == {1, 2}
    assert set(await conns.arun(fetch_payloads("big", [2, 1]))) == {1, 2}
    await conns.aclose()
    assert not conns.opened


# --------------------------------------------------------------------------- round trips of a write

N_NEW = 320
MAX_Q = 32


def served(port: int) -> int:
    """Requests the sidecar has served (every op, errors too), from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        m = re.search(r"^kalos_requests_total (\S+)$", r.read().decode(), re.MULTILINE)
    assert m is not None, "no kalos_requests_total"
    return int(float(m.group(1)))


@pytest.fixture
def counting_sidecar(sidecar_factory: Any) -> tuple[str, int]:
    """A sidecar (slots of 32 queries) that counts what it serves: (name, metrics port)."""
    for attempt in range(3):  # another process may take the free port before the sidecar binds it
        port = free_port()
        try:
            h = sidecar_factory(
                "trips",
                "--dim",
                str(DIM),
                "--max-queries",
                str(MAX_Q),
                "--metric",
                "cosine",
                "--metrics-port",
                str(port),
                "--backend",
                "numpy",
            )
            return h.name, port
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class LlamaWrites:
    """Adds of LlamaIndex nodes named by the keys (8 probes each, looked up by ``_node_id``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        pytest.importorskip("llama_index.core")
        from kalos.integrations import llamaindex

        self.mod = llamaindex
        self.rng = rng

    def store(self, name: str, pool: Any) -> Any:
        return self.mod.KalosLlamaVectorStore(name, namespace="trips", timeout=30.0, pool=pool)

    def nodes(self, keys: list[str]) -> list[Any]:
        from llama_index.core.schema import TextNode

        vectors = self.rng.standard_normal((len(keys), DIM)).tolist()
        return [TextNode(text=k, id_=k, embedding=v) for k, v in zip(keys, vectors)]

    def add(self, store: Any, keys: list[str]) -> None:
        store.add(self.nodes(keys))

    async def aadd(self, store: Any, keys: list[str]) -> None:
        await store.async_add(self.nodes(keys))

    def first_id(self, key: str) -> int:
        return int(self.mod.kalos_id(key))

    def key_of(self, payload: Any) -> Any:
        return payload.get(self.mod.NODE_ID_KEY)


class LangChainWrites:
    """Adds of LangChain texts whose ids are the keys (one probe each)."""

    def __init__(self, rng: np.random.Generator) -> None:
        pytest.importorskip("langchain_core")
        from kalos.integrations import langchain

        self.mod = langchain

    def store(self, name: str, pool: Any) -> Any:
        from langchain_core.embeddings import DeterministicFakeEmbedding

        return self.mod.KalosVectorStore(
            DeterministicFakeEmbedding(size=DIM), name=name, namespace="trips", timeout=30.0, pool=pool
        )

    def add(self, store: Any, keys: list[str]) -> None:
        store.add_texts(keys, ids=keys)

    async def aadd(self, store: Any, keys: list[str]) -> None:
        await store.aadd_texts(keys, ids=keys)

    def first_id(self, key: str) -> int:
        return int(self.mod.kalos_id(key))

    def key_of(self, payload: Any) -> Any:
        return self.mod.stored_id(payload)


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("writes", [LlamaWrites, LangChainWrites], ids=["llamaindex", "langchain"])
def test_adding_new_keys_reads_one_id_each(
    counting_sidecar: tuple[str, int], writes: Any, driver: str, rng: np.random.Generator
) -> None:
    """Round trips of adds of N keys, counted by the sidecar (and by the pool): into a namespace
    that does not exist yet, one read request (its count: none) and then the writes; new keys
    into a namespace that exists, a read of their first ids per slot, one look-up by key and the
    writes; the same keys again, reads and writes. Every key ends up once, at its first id.
    (Reading all 8 probes of every LlamaIndex node took 90 requests for the first add; since a
    namespace never written answers as empty, reading its probes took a request per slot.)"""
    name, port = counting_sidecar
    w = writes(rng)
    a, b = [f"a{i}" for i in range(N_NEW)], [f"b{i}" for i in range(N_NEW)]
    phases = [("fresh", a), ("new", b), ("again", a)]
    slots = math.ceil(N_NEW / MAX_Q)
    trips: dict[str, int] = {}
    if driver == "sync":
        store = w.store(name, None)
        try:
            for label, keys in phases:
                before = served(port)
                w.add(store, keys)
                assert wait_until(lambda t0=before: served(port) - t0 >= slots, timeout=30)
                trips[label] = served(port) - before
        finally:
            store.close()
    else:
        from kalos.clients.pool import RecallPool

        async def main() -> None:
            async with RecallPool(name, size=4, timeout=30.0) as pool:
                store = w.store(name, pool)
                for label, keys in phases:
                    before, posted = served(port), pool.statistics().posted
                    await w.aadd(store, keys)
                    trips[label] = pool.statistics().posted - posted
                    # the sidecar saw as many (it counts a request just after answering it)
                    n = trips[label]
                    assert wait_until(lambda t0=before, n=n: served(port) - t0 == n, timeout=30)

        asyncio.run(main())
    print(f"{writes.__name__} {driver}: {trips} round trips for {N_NEW} keys, {slots} slots each")
    assert slots <= trips["fresh"] <= slots + 1
    assert slots <= trips["new"] <= 2 * slots + 2
    assert slots <= trips["again"] <= 2 * slots
    from kalos.clients.blocking import RecallClient

    with RecallClient(name) as c:
        assert c.count("trips") == 2 * N_NEW
        got = c.get([w.first_id(k) for k in a + b], namespace="trips", with_vectors=False)
        assert [w.key_of(p) for p in got.payloads] == a + b
