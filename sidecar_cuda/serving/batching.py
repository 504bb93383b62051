"""Pure decisions of the sidecar: which slots are ready, which route a batch takes (and why not a
faster one), what a slot asks for, how a batch is grouped and packed.

No I/O here: the sidecar reads shared memory, calls these, and acts on what they return. Routes,
fastest first, as :func:`classify` picks them for the requests taken in one pass:

========  ======================================================================================
SINGLE    one plain recall (one query vector, no payloads, k in range, a namespace that exists,
          a finite query) and no batch in flight: fields read (:class:`SlotRef`) and written
          through word views, the query searched in place; no record is copied.
UNIFORM   every request such a recall, all in one namespace: one gathered search, decided with a
          fixed number of numpy calls whatever the batch size. ``pipelined``: big enough to be
          left in flight while the next batch is taken (``--pipeline``, :func:`pipelined`).
MIXED     every request such a recall, in several namespaces (a namespace per user or agent):
          one gathered search too, each query over its own namespace's rows
          (``MemoryStore.search_mixed``: one launch on CUDA); a namespace that does not exist
          answers no hits.
GENERAL   anything else: each request parsed (:func:`parse_request`), rejected with a status or
          grouped (:func:`plan_batch`): writes first in posting order, then recalls by namespace.
========  ======================================================================================

A plan that is not SINGLE says in ``reason`` why the faster route was not taken ("2 namespaces",
"payloads requested", "k=0 out of range 1..128", "non-finite query", "unknown namespace", ...).
"""

from __future__ import annotations

import enum
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from ...broker.clock import MAX_TTL_NS, check_recency
from ...broker.layout import NAMESPACE_BYTES, S_POSTED, Flag, Layout, Op, SlotWords, Status
from ...broker.lexical import weight_problem
from ...broker.names import decode_namespace

_RECALL = int(Op.RECALL)  # plain ints: cheaper than enum members in comparisons
_WHERE = int(Flag.WHERE)
_OPS = {int(o): o for o in Op}

#: ``--pipeline auto`` pipelines a batch of at least this many multiply-adds (rows x queries x
#: dim). Measured on the H200 (bench/results/README.md): pipelining raised 256 tasks at 1M x 768
#: from ~100-110k to 116-141k recalls/s, but lowered 256 x 128 (339k -> 238k/s) and 100k x 768
#: (237k -> 208k/s), where the host, not the device, bounds a batch.
PIPELINE_MIN_WORK = 1 << 34


def pipelined(work: int, min_work: int) -> bool:
    """Leave a started batch in flight (and take the next one meanwhile)? ``min_work`` < 0: never."""
    return 0 <= min_work <= work


def posted_slots(states: np.ndarray) -> np.ndarray:
    """Indices of slots whose request is complete (state POSTED)."""
    posted: np.ndarray = (states == S_POSTED).nonzero()[0]
    return posted


# --------------------------------------------------------------------------- routes


class Route(enum.Enum):
    SINGLE = "single"
    UNIFORM = "uniform"
    MIXED = "mixed"
    GENERAL = "general"
    EMBED = "embed"  # the text requests of a pass (Op.EMBED), embedded together (serving.embeds)


class HasRows(Protocol):
    """What classify needs of a namespace: its live rows (the pipeline's work estimate)."""

    @property
    def n(self) -> int: ...


N = TypeVar("N", bound=HasRows)
#: (raw namespace bytes, ns_len) as a client wrote them -> the namespace, or None (invalid or absent).
Lookup = Callable[[tuple[bytes, int]], "N | None"]


class Limits(NamedTuple):
    """What a plan depends on besides the requests: fixed for a sidecar's life."""

    k_limit: int  # largest k served: min(layout max_k, backend max_k)
    dim: int
    min_work: int  # pipeline a batch of this many multiply-adds and more; < 0: never
    max_queries: int = 1  # rows a recall of a batch may carry (the layout's max_queries)


class SlotRef(NamedTuple):
    """One slot's request as the SINGLE route reads it: in place, word by word, through word
    views of the segment. Made once per slot, so classifying a request allocates nothing for it."""

    words: SlotWords
    mem: mmap.mmap  # the segment, where the namespace bytes are sliced from
    slot: int
    ns_off: int  # byte offset of the slot's namespace field (broker.layout.slot_field_offset)
    blob_off: int = 0  # byte offset of the slot's blob area (its filter, for a filtered recall)
    blob_bytes: int = 0  # the blob area's size (0: a filtered recall never takes SINGLE)


@dataclass(slots=True, repr=False)
class Plan(Generic[N]):
    """What to do with the requests taken in one pass. ``namespace`` and ``k`` (the largest k
    asked) are set for SINGLE and UNIFORM; ``pipelined`` for UNIFORM only; ``where``: the filter
    bytes of a filtered SINGLE recall, or that every request of a UNIFORM batch of filtered
    recalls carries (not yet parsed). ``groups``: for MIXED, the batch's distinct namespaces
    (:class:`Groups`)."""

    route: Route
    reason: str = ""
    namespace: N | None = None
    k: int = 0
    pipelined: bool = False
    where: bytes | None = None
    groups: Groups | None = None

    def __repr__(self) -> str:
        return f"Plan({self.route.name}, {self.reason!r}, k={self.k}{', pipelined' if self.pipelined else ''})"


def classify(
    batch: SlotRef | np.ndarray, queries: np.ndarray, lookup: Lookup[N], limits: Limits, blobs: Blobs | None = None
) -> Plan[N]:
    """The route of the requests taken in one pass.

    ``batch``: a :class:`SlotRef` (one request, no batch in flight: the SINGLE candidate), or the
    control-block records of the taken slots (``broker.layout.slot_dtype()``: UNIFORM
    candidates). ``queries``: every query row of the requests, in order, (sum of nq, dim) float32
    (gathered, or the slot's own row for a SlotRef; :func:`query_rows` says which rows, and a
    batch whose nq are out of range passes each request's first row only). A batch of recalls
    carrying several rows each (``recall_many``, coalesced clients) is UNIFORM too. ``blobs``: where the records' blob areas are read from (a
    batch of filtered recalls with the same filter is UNIFORM too); None: never."""
    if type(batch) is SlotRef:
        return _classify_slot(batch, queries, lookup, limits)
    assert isinstance(batch, np.ndarray)
    if len(batch) == 1 and (blobs is None or int(batch["flags"][0]) != _WHERE):
        return _classify_record(batch[0], queries, lookup, limits)
    return _classify_many(batch, queries, lookup, limits, blobs)  # (a lone filtered recall too)


class Blobs(NamedTuple):
    """The blob areas of every slot (``SegmentView.all_blobs``) and the rows of the batch's slots."""

    areas: np.ndarray  # uint8 (n_slots, blob_bytes)
    sel: np.ndarray  # the batch's slots, in the order of its records


def shared_filter(rec: np.ndarray, blobs: Blobs) -> bytes | None:
    """The filter bytes of a batch of filtered recalls when every request carries the same ones,
    else None. Reads only the first ``blob_len`` bytes of each slot. Pure over its inputs."""
    n = int(rec["blob_len"][0])
    if not (0 < n <= blobs.areas.shape[1]) or not (rec["blob_len"] == n).all():
        return None
    area = blobs.areas[blobs.sel, :n]
    if not (area == area[0]).all():
        return None
    blob: bytes = area[0].tobytes()
    return blob


def namespace_field(rec: np.ndarray) -> np.ndarray:
    """The namespace fields of control-block records with every byte past each ``ns_len`` zeroed:
    a client need not clear what a longer name left in the slot, so two requests name the same
    namespace exactly when these are equal (with their ``ns_len``). Pure."""
    raw = np.ascontiguousarray(rec["namespace"])
    b = raw.view(np.uint8).reshape(len(rec), NAMESPACE_BYTES)
    past = np.arange(NAMESPACE_BYTES)[None, :] >= rec["ns_len"].astype(np.int64)[:, None]
    if not (b[past] != 0).any():
        return raw
    clean = np.where(past, 0, b).astype(np.uint8)
    out: np.ndarray = clean.view(raw.dtype).reshape(len(rec))
    return out


class Groups(NamedTuple):
    """The distinct namespaces of a MIXED batch: ``keys[j]`` the (namespace field, ns_len) of the
    j-th to appear, and ``of_request[i]`` the index in ``keys`` of request i's."""

    keys: list[tuple[bytes, int]]
    of_request: np.ndarray


def group_namespaces(nsraw: np.ndarray, ns_len: np.ndarray) -> Groups:
    """Each request's namespace among the batch's distinct ones, in order of first appearance
    (``nsraw``: :func:`namespace_field`). One dict probe a request. Pure."""
    index: dict[tuple[bytes, int], int] = {}
    of = [index.setdefault(key, len(index)) for key in zip(nsraw.tolist(), ns_len.tolist())]
    return Groups(list(index), np.array(of, np.intp))


def query_rows(sel: np.ndarray, nq: np.ndarray, max_queries: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(slot, row) of every query of a batch whose requests carry ``nq`` rows each (slots
    ``sel``), in request order; None when every request has one row (its row 0) or some nq is
    outside 1..max_queries (classify then sends the batch to the general route). Pure."""
    if (nq == 1).all() or not (nq - 1 < max_queries).all():  # (unsigned: nq = 0 wraps)
        return None
    counts = nq.astype(np.intp)
    slots = np.repeat(sel, counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return slots, np.arange(len(slots), dtype=np.intp) - starts


def _classify_slot(ref: SlotRef, q: np.ndarray, lookup: Lookup[N], limits: Limits) -> Plan[N]:
    W, i = ref.words, ref.slot
    u32 = W.u32
    k = u32[W.k[i]]
    flags = u32[W.flags[i]]
    where: bytes | None = None
    if flags == _WHERE:  # a lone filtered recall: its filter bytes, parsed when not cached
        n = u32[W.blob_len[i]]
        if 0 < n <= ref.blob_bytes:
            where = ref.mem[ref.blob_off : ref.blob_off + n]
            flags = 0
    if not (u32[W.op[i]] == _RECALL and u32[W.nq[i]] == 1 and flags == 0 and 1 <= k <= limits.k_limit):
        return Plan(Route.GENERAL, _field_problem(u32[W.op[i]], u32[W.nq[i]], u32[W.flags[i]], k, limits.k_limit))
    ns_len = u32[W.ns_len[i]]
    off = ref.ns_off
    ns = lookup((ref.mem[off : off + (ns_len if ns_len < NAMESPACE_BYTES else NAMESPACE_BYTES)], ns_len))
    if ns is None:
        return Plan(Route.GENERAL, "unknown namespace")
    if not math.isfinite(q.sum()) and not np.isfinite(q).all():  # (a finite sum may overflow)
        return Plan(Route.GENERAL, "non-finite query")
    return Plan(Route.SINGLE, "", ns, k, where=where)


def _classify_record(r: np.void, q: np.ndarray, lookup: Lookup[N], limits: Limits) -> Plan[N]:
    """One request behind a batch in flight: its control block read with plain ints."""
    op, nq, flags, k = int(r["op"]), int(r["nq"]), int(r["flags"]), int(r["k"])
    if not (
        op == _RECALL and 1 <= nq <= limits.max_queries and nq == len(q) and flags == 0 and 1 <= k <= limits.k_limit
    ):
        return Plan(Route.GENERAL, _field_problem(op, nq, flags, k, limits.k_limit, limits.max_queries))
    ns = lookup((bytes(r["namespace"]), int(r["ns_len"])))
    if ns is None:
        return Plan(Route.GENERAL, "unknown namespace")
    if not np.isfinite(q).all():
        return Plan(Route.GENERAL, "non-finite query")
    return Plan(Route.UNIFORM, "a batch is in flight", ns, k, pipelined(ns.n * nq * limits.dim, limits.min_work))


def _classify_many(rec: np.ndarray, q: np.ndarray, lookup: Lookup[N], limits: Limits, blobs: Blobs | None) -> Plan[N]:
    k = rec["k"]
    ns_len = rec["ns_len"]
    flags = rec["flags"]
    where: bytes | None = None
    if blobs is not None and flags[0] == _WHERE and (flags == _WHERE).all():
        where = shared_filter(rec, blobs)  # one filter for all: one search of its rows
        if where is None:
            return Plan(Route.GENERAL, "filtered, with different filters")
        flags = flags & ~np.uint32(_WHERE)
    # k and nq are unsigned: k - 1 wraps to a huge value for k = 0 (nq likewise).
    nq = rec["nq"]
    if not ((rec["op"] == _RECALL) & (nq - 1 < limits.max_queries) & (flags == 0) & (k - 1 < limits.k_limit)).all():
        return Plan(Route.GENERAL, _batch_problem(rec, limits))
    if int(nq.sum()) != len(q):  # (the caller gathers every row only for nq in range)
        return Plan(Route.GENERAL, "query rows not gathered")
    nsraw = namespace_field(rec)
    if not ((nsraw == nsraw[0]) & (ns_len == ns_len[0])).all():
        groups = group_namespaces(nsraw, ns_len)
        reason = f"{len(groups.keys)} namespaces"
        if where is not None:
            return Plan(Route.GENERAL, f"filtered, {reason}")
        if not np.isfinite(q).all():
            return Plan(Route.GENERAL, "non-finite query")
        return Plan(Route.MIXED, reason, None, int(k.max()), groups=groups)
    ns = lookup((bytes(nsraw[0]), int(ns_len[0])))
    if ns is None:
        return Plan(Route.GENERAL, "unknown namespace")
    if not np.isfinite(q).all():
        return Plan(Route.GENERAL, "non-finite query")
    if where is not None:  # searched at once (the filter is evaluated then), never pipelined
        return Plan(Route.UNIFORM, "filtered requests, one filter", ns, int(k.max()), where=where)
    return Plan(
        Route.UNIFORM, "several requests", ns, int(k.max()), pipelined(ns.n * len(q) * limits.dim, limits.min_work)
    )


def _field_problem(op: int, nq: int, flags: int, k: int, k_limit: int, max_queries: int = 1) -> str:
    """Why one request's fields keep it off the fast routes (the first reason found)."""
    if op != _RECALL:
        name = _OPS[op].name if op in _OPS else str(op)
        return f"op {name} is not a recall"
    if flags & Flag.WHERE:
        return "filtered"
    if flags & Flag.RECENCY:
        return "recency-weighted"
    if not 1 <= nq <= max_queries:
        return f"nq={nq}: not one query" if max_queries == 1 else f"nq={nq} outside 1..{max_queries}"
    if flags & Flag.WITH_PAYLOAD:
        return "payloads requested"
    if flags & (Flag.TIMES | Flag.REFRESH):
        return "timestamps requested" if flags & Flag.TIMES else "refresh requested"
    if flags:
        return f"flags={flags:#x}"
    return f"k={k} out of range 1..{k_limit}"


def _batch_problem(rec: np.ndarray, limits: Limits) -> str:
    """:func:`_field_problem` of the first request that has one, else the namespaces' lengths."""
    k_limit, mq = limits.k_limit, limits.max_queries
    for r in rec:
        op, nq, flags, k = int(r["op"]), int(r["nq"]), int(r["flags"]), int(r["k"])
        if not (op == _RECALL and 1 <= nq <= mq and flags == 0 and 1 <= k <= k_limit):
            return _field_problem(op, nq, flags, k, k_limit, mq)
    return f"{len(set(zip(rec['namespace'].tolist(), rec['ns_len'].tolist())))} namespaces"


# --------------------------------------------------------------------------- the general route


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
    ttl_ns: int | None = None  # Flag.TTL (UPSERT, TOUCH) or SET_TTL: checked, ns (0: never/none)
    recency: tuple[float, float] | None = None  # Flag.RECENCY: (half_life_s, weight), checked
    hybrid: float | None = None  # Flag.HYBRID: the BM25 part's weight, checked


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
    ttl_ns: int = 0
    half_life_s: float = 0.0
    recency_weight: float = 0.0
    hybrid_weight: float = 0.0


#: Writes that carry a TTL (with Flag.TTL) and SET_TTL, which always does.
_TTL_OPS = frozenset({Op.UPSERT, Op.TOUCH})


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
    where_delete = op == Op.DELETE and f.flags & Flag.WHERE  # (its ids area is not read)
    if op in (Op.RECALL, Op.UPSERT, Op.DELETE, Op.EXPORT, Op.GET, Op.TOUCH) and not where_delete:
        if not 1 <= nq <= layout.max_queries:
            return Rejection(slot, Status.TOO_MANY_QUERIES, f"nq={nq} outside 1..{layout.max_queries}", gen)
    if op == Op.RECALL:
        limit = min(layout.max_k, backend_max_k)
        if not 1 <= k <= limit:
            return Rejection(slot, Status.K_OUT_OF_RANGE, f"k={k} outside 1..{limit}", gen)
    if f.blob_len > layout.blob_bytes:
        return Rejection(slot, Status.BAD_REQUEST, f"blob_len={f.blob_len} > {layout.blob_bytes}", gen)
    ttl: int | None = None
    if op == Op.SET_TTL or (op in _TTL_OPS and f.flags & Flag.TTL):
        if not 0 <= f.ttl_ns <= MAX_TTL_NS:
            return Rejection(slot, Status.BAD_REQUEST, f"ttl_ns={f.ttl_ns} outside 0..{MAX_TTL_NS}", gen)
        ttl = f.ttl_ns
    recency: tuple[float, float] | None = None
    if op == Op.RECALL and f.flags & Flag.RECENCY:
        problem = check_recency(f.half_life_s, f.recency_weight)
        if problem is not None:
            return Rejection(slot, Status.BAD_REQUEST, problem, gen)
        recency = (f.half_life_s, f.recency_weight)
    hybrid: float | None = None
    if op == Op.RECALL and f.flags & Flag.HYBRID:
        problem = weight_problem(f.hybrid_weight)
        if problem is None and nq != 1:
            problem = f"a hybrid recall carries one query, nq={nq}"
        if problem is None and recency is not None:
            problem = "a hybrid recall does not take recency"
        if problem is None and f.blob_len == 0:
            problem = "a hybrid recall's blob holds its query text"
        if problem is not None:
            return Rejection(slot, Status.BAD_REQUEST, problem, gen)
        hybrid = f.hybrid_weight
    return Request(slot, op, ns or "", k, nq, f.flags, f.t_post_ns, gen, ttl, recency, hybrid)


@dataclass
class BatchPlan:
    """Writes first, in posting order (so acknowledged order is apply order), then recalls by
    namespace (one backend call each), then the rest."""

    writes: list[Request] = field(default_factory=list)
    recalls: dict[str, list[Request]] = field(default_factory=dict)
    others: list[Request] = field(default_factory=list)  # filtered and recency recalls among them


_WRITE_OPS = frozenset({Op.UPSERT, Op.DELETE, Op.DROP_NAMESPACE, Op.TOUCH, Op.SET_TTL})
_SEARCH_ALONE = int(Flag.WHERE | Flag.RECENCY | Flag.HYBRID)  # recalls grouped by filter and recency instead


def plan_batch(requests: list[Request]) -> BatchPlan:
    plan = BatchPlan()
    for r in sorted(requests, key=lambda r: r.t_post_ns):
        if r.op == Op.RECALL and not r.flags & _SEARCH_ALONE:
            plan.recalls.setdefault(r.namespace, []).append(r)
        elif r.op in _WRITE_OPS:
            plan.writes.append(r)
        else:
            plan.others.append(r)
    return plan


def write_segments(writes: list[Request]) -> list[list[Request]]:
    """Writes cut before each delete by filter and each touch (their ids are found once every
    write before them is applied) and after each SET_TTL (the writes after it take its default),
    so each segment is made durable and applied before the next is decoded. Pure."""
    out: list[list[Request]] = [[]]
    cut_next = False
    for w in writes:
        if out[-1] and (cut_next or w.op == Op.TOUCH or (w.op == Op.DELETE and w.flags & Flag.WHERE)):
            out.append([])
        out[-1].append(w)
        cut_next = w.op == Op.SET_TTL
    return out


def pack_offsets(nqs: list[int]) -> np.ndarray:
    """Start row of each request's queries in the gathered batch matrix (plus the total). Pure."""
    out = np.zeros(len(nqs) + 1, np.int64)
    np.cumsum(nqs, out=out[1:])
    return out
