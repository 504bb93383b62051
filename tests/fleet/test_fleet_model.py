"""Three sidecars on one PostgreSQL store stand for three nodes; writers on each do random upserts,
deletes and deletes by filter (with payloads) on the same records. The model is the acknowledged
writes applied in the order of their positions; after the writers stop, every node's export must
equal it (0 lost, 0 resurrected, 0 phantom) and recalls, filtered or not, must be exact against
numpy float64. Then the same while sidecars are killed with SIGKILL and restarted, and while
PostgreSQL is stopped with ``pg_ctl stop -m immediate`` and started again.

A write that failed (store down, sidecar killed under it) may or may not have been committed: the
writer sends it again until it is acknowledged, as an application would (writes are idempotent).
The retry comes after the first attempt, so the model of acknowledged writes stays exact."""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from conftest import assert_topk
from fleetkit import Node, PgServer, fleet, fleet_dsn, pg, pg_server  # noqa: F401 (fixtures)

from kalos import KalosError, Position, RecallClient, UsageError, Written

pytestmark = pytest.mark.timeout(240)

DIM = 16
NS, SCRATCH = "m", "s"
N_IDS = 120
TAGS = 4
WARMUP_OPS = 20  # acknowledged writes per writer before the faults begin


class Kind(enum.Enum):
    UPSERT = 1
    DELETE = 2
    DELETE_WHERE = 3
    DROP = 4


@dataclass
class Op:
    kind: Kind
    ns: str
    ids: list[int] = field(default_factory=list)
    vecs: np.ndarray | None = None
    payloads: list[dict[str, Any]] | None = None
    tag: int = 0
    position: Position | None = None
    noop: bool = False  # a delete that removed nothing (ordered after the change at its position)


def random_op(rng: np.random.Generator, wid: int, k: int) -> Op:
    r = rng.random()
    if r < 0.5:
        n = int(rng.integers(1, 5))
        ids = rng.choice(N_IDS, n, replace=False).tolist()
        return Op(
            Kind.UPSERT,
            NS,
            ids,
            rng.standard_normal((n, DIM)).astype(np.float32),
            [{"tag": int(rng.integers(TAGS)), "w": wid, "k": k} for _ in ids],
        )
    if r < 0.72:
        return Op(Kind.DELETE, NS, rng.choice(N_IDS, int(rng.integers(1, 4)), replace=False).tolist())
    if r < 0.82:
        return Op(Kind.DELETE_WHERE, NS, tag=int(rng.integers(TAGS)))
    if r < 0.97:
        ids = rng.choice(40, 2, replace=False).tolist()
        return Op(
            Kind.UPSERT,
            SCRATCH,
            ids,
            rng.standard_normal((2, DIM)).astype(np.float32),
            [{"tag": 0, "w": wid, "k": k}] * 2,
        )
    return Op(Kind.DROP, SCRATCH)


def send(c: RecallClient, op: Op) -> Written:
    if op.kind is Kind.UPSERT:
        return c.upsert(op.ids, op.vecs, op.payloads, namespace=op.ns)
    if op.kind is Kind.DELETE:
        return c.delete(op.ids, namespace=op.ns)
    if op.kind is Kind.DELETE_WHERE:
        return c.delete(where={"tag": op.tag}, namespace=op.ns)
    return c.drop_namespace(op.ns)


class Writer(threading.Thread):
    """Random writes through one node until ``stop`` (or ``n_ops``), each sent again until it is
    acknowledged; the acknowledged ops with their positions go to ``done``."""

    def __init__(self, node: str, wid: int, seed: int, stop: threading.Event, n_ops: int) -> None:
        super().__init__(daemon=True)
        self.node, self.wid, self.rng = node, wid, np.random.default_rng(seed)
        self.stop, self.n_ops = stop, n_ops
        self.done: list[Op] = []
        self.retries = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with RecallClient(self.node, timeout=5, connect_timeout=60) as c:
                for k in range(self.n_ops):
                    if self.stop.is_set():
                        return
                    op = random_op(self.rng, self.wid, k)
                    deadline = time.monotonic() + 90
                    while True:
                        try:
                            w = send(c, op)
                            break
                        except UsageError:
                            raise
                        except KalosError:  # store down, sidecar killed: maybe applied; again
                            self.retries += 1
                            assert time.monotonic() < deadline, "a write never got through"
                            time.sleep(0.05)
                    assert w.position is not None
                    op.position = w.position
                    op.noop = op.kind in (Kind.DELETE, Kind.DELETE_WHERE) and int(w) == 0
                    self.done.append(op)
        except BaseException as e:
            self.error = e


def build_model(ops: list[Op]) -> tuple[dict[str, dict[int, tuple[np.ndarray, dict[str, Any]]]], set[tuple[str, int]]]:
    """The records after the acknowledged ops in position order, and every (ns, id) ever written."""
    model: dict[str, dict[int, tuple[np.ndarray, dict[str, Any]]]] = {NS: {}, SCRATCH: {}}
    written: set[tuple[str, int]] = set()
    for op in sorted(ops, key=lambda o: (o.position, o.noop)):
        recs = model[op.ns]
        if op.kind is Kind.UPSERT:
            assert op.vecs is not None and op.payloads is not None
            for i, v, p in zip(op.ids, op.vecs, op.payloads):
                recs[i] = (v, p)
                written.add((op.ns, i))
        elif op.kind is Kind.DELETE:
            for i in op.ids:
                recs.pop(i, None)
        elif op.kind is Kind.DELETE_WHERE:
            for i in [i for i, (_v, p) in recs.items() if p["tag"] == op.tag]:
                del recs[i]
        else:
            recs.clear()
    return model, written


def export_all(c: RecallClient, ns: str) -> dict[int, tuple[np.ndarray, dict[str, Any]]]:
    out: dict[int, tuple[np.ndarray, dict[str, Any]]] = {}
    after = -1
    while True:
        ids, vecs, pls = c.export_page(ns, after)  # (a namespace never written, or dropped: none)
        if len(ids) == 0:
            return out
        for i, v, p in zip(ids.tolist(), vecs, pls):
            out[i] = (v.copy(), p)
        after = int(ids[-1])


def check_node(node: str, model, written, last: Position, rng: np.random.Generator) -> dict[str, int]:
    with RecallClient(node, timeout=30, connect_timeout=60) as c:
        c.count(NS, after=last, timeout=60)  # every acknowledged write is applied here
        lost = resurrected = phantom = wrong = 0
        for ns in (NS, SCRATCH):
            got, want = export_all(c, ns), model[ns]
            lost += len(want.keys() - got.keys())
            extra = got.keys() - want.keys()
            resurrected += sum(1 for i in extra if (ns, i) in written)
            phantom += sum(1 for i in extra if (ns, i) not in written)
            for i in want.keys() & got.keys():
                if not (np.array_equal(want[i][0], got[i][0]) and want[i][1] == got[i][1]):
                    wrong += 1
        ids = np.array(sorted(model[NS]), np.int64)
        mat = np.stack([model[NS][i][0] for i in ids]) if len(ids) else np.empty((0, DIM), np.float32)
        for _ in range(3):
            q = rng.standard_normal(DIM).astype(np.float32)
            hits = c.recall(q, k=10, namespace=NS)
            assert_topk(q, mat, np.searchsorted(ids, hits.ids), hits.scores, 10)
            tag = int(rng.integers(TAGS))
            sel = np.array([model[NS][i][1]["tag"] == tag for i in ids], bool)
            hits = c.recall(q, k=10, namespace=NS, where={"tag": tag})
            sub_ids = ids[sel]
            assert set(hits.ids.tolist()) <= set(sub_ids.tolist())
            if len(sub_ids):
                assert_topk(q, mat[sel], np.searchsorted(sub_ids, hits.ids), hits.scores, 10)
            else:
                assert len(hits) == 0
    return {"lost": lost, "resurrected": resurrected, "phantom": phantom, "wrong": wrong}


def run_fleet(nodes: list[Node], seed: int, n_ops: int, chaos=None) -> dict[str, Any]:
    stop = threading.Event()
    writers = [Writer(n.name, 2 * j + h, seed + 2 * j + h, stop, n_ops) for j, n in enumerate(nodes) for h in range(2)]
    t0 = time.monotonic()
    for w in writers:
        w.start()
    if chaos is not None:  # faults only once every writer is writing (connecting is slow on 2 cores)
        deadline = time.monotonic() + 120
        while any(len(w.done) < WARMUP_OPS and w.is_alive() for w in writers):
            assert time.monotonic() < deadline, "the writers never got going"
            time.sleep(0.05)
    faults = chaos() if chaos is not None else {}
    if chaos is not None:
        stop.set()  # the writers stop once the faults are over (and their last op is acknowledged)
    for w in writers:
        w.join(timeout=150)
        assert not w.is_alive(), "a writer hung"
        if w.error is not None:
            raise w.error
    secs = time.monotonic() - t0
    ops = [op for w in writers for op in w.done]
    model, written = build_model(ops)
    last = max(op.position for op in ops if op.position is not None)
    rng = np.random.default_rng(seed)
    report: dict[str, Any] = {
        "acknowledged_writes": len(ops),
        "retries": sum(w.retries for w in writers),
        "seconds": round(secs, 2),
        "rows": len(model[NS]) + len(model[SCRATCH]),
        **faults,
    }
    for n in nodes:
        report[n.name] = check_node(n.name, model, written, last, rng)
        assert report[n.name] == {"lost": 0, "resurrected": 0, "phantom": 0, "wrong": 0}, report
    print(json.dumps(report))
    return report


def test_three_nodes_equal_the_model_of_acknowledged_writes(fleet, seed):
    nodes = [fleet(f"node{j}") for j in range(3)]
    run_fleet(nodes, seed, n_ops=60)


def test_three_nodes_converge_through_kill9_and_store_restart(pg: PgServer, fleet, seed):
    nodes = [fleet(f"node{j}") for j in range(3)]
    rng = np.random.default_rng(seed)

    def chaos() -> dict[str, Any]:
        kills = 0
        for _round in range(2):  # SIGKILL a node under its writers; it comes back and catches up
            time.sleep(1.0)
            victim = nodes[int(rng.integers(3))]
            victim.kill9()
            kills += 1
            time.sleep(0.3)
            victim.start()
        time.sleep(0.5)
        t = time.monotonic()
        pg.stop("immediate")  # every write fails meanwhile; recalls go on
        time.sleep(1.5)
        pg.start()
        down = time.monotonic() - t
        time.sleep(1.5)  # writes get through again
        return {"kills": kills, "store_down_s": round(down, 2)}

    report = run_fleet(nodes, seed, n_ops=10_000, chaos=chaos)
    assert report["retries"] > 0  # the faults did hit writes
