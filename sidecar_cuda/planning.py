"""Pure decisions of the sidecar: which slots are ready, what a slot asks for, how a batch is packed.

No I/O here: the server reads shared memory, calls these, and acts on what they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from broker.layout import S_POSTED, Layout, Op, Status
from broker.names import decode_namespace


def posted_slots(states: np.ndarray) -> np.ndarray:
    """Indices of slots whose request is complete (state POSTED)."""
    posted: np.ndarray = (states == S_POSTED).nonzero()[0]
    return posted


@dataclass(slots=True)
class Request:
    slot: int
    op: Op
    namespace: str
    k: int
    nq: int
    flags: int
    t_post_ns: int
    generation: int


@dataclass(slots=True)
class Rejection:
    slot: int
    status: Status
    detail: str
    generation: int


@dataclass(slots=True)
class SlotFields:
    """A slot's request header as read from shared memory (any values a client could write)."""

    op: int
    k: int
    nq: int
    flags: int
    blob_len: int
    ns_len: int
    namespace: bytes
    generation: int
    t_post_ns: int


_OPS = {int(o): o for o in Op}


def parse_request(slot: int, f: SlotFields, layout: Layout, backend_max_k: int) -> Request | Rejection:
    """Check a slot's header fields as a broken client could have written them."""
    gen = f.generation
    op = _OPS.get(f.op)
    if op is None:
        return Rejection(slot, Status.UNKNOWN_OP, f"unknown op {f.op}", gen)
    ns = decode_namespace(f.namespace, f.ns_len)
    if ns is None and op != Op.LIST_NAMESPACES:
        return Rejection(slot, Status.BAD_REQUEST, "invalid namespace field", gen)
    nq = f.nq
    k = f.k
    if op in (Op.RECALL, Op.UPSERT, Op.DELETE, Op.EXPORT):
        if not 1 <= nq <= layout.max_queries:
            return Rejection(slot, Status.TOO_MANY_QUERIES,
                             f"nq={nq} outside 1..{layout.max_queries}", gen)
    if op == Op.RECALL:
        limit = min(layout.max_k, backend_max_k)
        if not 1 <= k <= limit:
            return Rejection(slot, Status.K_OUT_OF_RANGE, f"k={k} outside 1..{limit}", gen)
    if f.blob_len > layout.blob_bytes:
        return Rejection(slot, Status.BAD_REQUEST, f"blob_len={f.blob_len} > {layout.blob_bytes}", gen)
    return Request(slot, op, ns or "", k, nq, f.flags, f.t_post_ns, gen)


@dataclass
class BatchPlan:
    """Writes first, in posting order (so acknowledged order is apply order), then recalls by
    namespace (one backend call each), then the rest."""

    writes: list[Request] = field(default_factory=list)
    recalls: dict[str, list[Request]] = field(default_factory=dict)
    others: list[Request] = field(default_factory=list)


def plan_batch(requests: list[Request]) -> BatchPlan:
    plan = BatchPlan()
    for r in sorted(requests, key=lambda r: r.t_post_ns):
        if r.op == Op.RECALL:
            plan.recalls.setdefault(r.namespace, []).append(r)
        elif r.op in (Op.UPSERT, Op.DELETE, Op.DROP_NAMESPACE):
            plan.writes.append(r)
        else:
            plan.others.append(r)
    return plan


def pack_offsets(nqs: list[int]) -> np.ndarray:
    """Start row of each request's queries in the gathered batch matrix (plus the total). Pure."""
    out = np.zeros(len(nqs) + 1, np.int64)
    np.cumsum(nqs, out=out[1:])
    return out
