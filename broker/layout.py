"""The shared-memory contract between a Kalos sidecar and its clients.

This module is the only place that knows an offset. The sidecar and every client build their views
of the segment from :class:`Layout`; ``docs/protocol.md`` describes the same thing for other
languages, and ``tests/test_layout.py`` checks the generated C header (:func:`c_header`) against it.

Objects of a broker named ``NAME`` (created by the sidecar, exclusively, mode 0600; the sidecar
unlinks them on exit and ``kalos cleanup NAME`` removes leftovers of a crashed one; the names are
spelt in :mod:`kalos.broker.names`, with the rules for broker and namespace names)::

    /kalos.NAME              shared memory segment (layout below)
    /kalos.NAME.bell         doorbell semaphore: the sidecar sleeps on it when idle (handshake below)
    /kalos.NAME.N.req        request semaphore of slot N  (client posts, sidecar consumes)
    /kalos.NAME.N.resp       response semaphore of slot N (sidecar posts, client consumes)

Segment (all integers little-endian, naturally aligned; byte offsets)::

    0              +-----------------------------------------------+
                   | header (HEADER_BYTES = 4096)                   |  magic "KALOSHM\0", version,
                   |                                                |  geometry, sidecar pid/state,
                   |                                                |  start epoch, heartbeat
    4096           +-----------------------------------------------+
    control_offset | control block of slot 0 (CONTROL_BYTES = 256)  |  state, generation, op, k, nq,
                   | control block of slot 1 ...                    |  lease, status, timestamps,
                   |                                                |  namespace (SLOT_FIELDS)
                   +-----------------------------------------------+  (page aligned)
    stats_offset   | client stats of slot 0 (STATS_BYTES = 2560)    |  written only by the slot's
                   |   +0   counters (STATS_FIELDS)                 |  lease owner: end-to-end
                   |   +64  latency histogram u64[HIST_BUCKETS]     |  latency as callers see it
                   |   +384 latency ring u32[RING_LEN] (ns)         |
                   | client stats of slot 1 ...                     |
                   +-----------------------------------------------+  (page aligned)
    data_offset    | data of slot 0 (slot_bytes, page multiple)     |
                   |   +query_offset   f32 [max_queries][dim]       |  queries / upsert vectors
                   |   +ids_offset     i64 [max_queries]            |  upsert / delete ids
                   |   +result_ids_offset    i64 [max_queries][max_k]
                   |   +result_scores_offset f32 [max_queries][max_k]
                   |   +blob_offset    u8 [blob_bytes]              |  JSON payloads, error text
                   | data of slot 1 ...                             |
                   +-----------------------------------------------+

Control blocks are packed together so that the sidecar's scan for posted slots touches a few
pages, not one page per slot (TLB misses dominated an earlier layout with the header inside each
slot's data).

Waking the sidecar (a Dekker handshake; each semaphore operation is a full memory fence)::

    client:  write request, state = POSTED, post req[i], if header.sidecar_sleeping: post bell
    sidecar: sidecar_sleeping = 1, try-wait bell (fence), scan states; nothing POSTED -> wait bell;
             on waking: sidecar_sleeping = 0, scan, serve, poll for a short window, repeat.

Slot states (``state`` field of a slot; who moves it and when)::

      FREE --client--> WRITING --client--> POSTED --sidecar--> BUSY --sidecar--> DONE
        ^                                                                          |
        +------------------------- client (after consuming resp) ------------------+

    FREE     no request in the slot; the lease owner may start one.
    WRITING  the owner is writing a request; the sidecar ignores the slot.
    POSTED   request complete. Written after every request field (payload first, state last);
             then the owner posts the slot's req semaphore, then the doorbell if the sidecar sleeps.
    BUSY     the sidecar consumed req and is serving the slot.
    DONE     the sidecar wrote results, status and ``resp_generation`` (state last), then posted
             resp. The owner consumes resp, checks ``resp_generation == generation``, copies the
             results out, and sets FREE.

Ownership of a slot is a *lease*: ``owner_pid``/``owner_start`` are written by a client under an
``flock`` of the segment's file descriptor. Only the sidecar clears the lease of a dead owner (its
reaper checks liveness), after draining both semaphores, so nothing a dead client left is ever
served to the next owner. The semaphore post/wait pairs are the memory fences of the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .errors import (
    ConfigError,
    InvalidRequest,
    KalosError,
    PayloadTooLarge,
    PositionTimeout,
    ProtocolError,
    ServerError,
    UnknownNamespace,
)
from .texts import MAX_TEXT_BYTES

MAGIC = b"KALOSHM\x00"
MAGIC_U64 = int.from_bytes(MAGIC, "little")
#: Bumped on every incompatible change of this module. 2: namespaces/upsert/delete ops.
#: 3: leases and sidecar liveness held as locks on the lease file (broker.leases).
#: 4: GET (records by id), COUNT, filters (Flag.WHERE).
#: 5: client latency by kind of call (LatencyOp): per-op counters and histograms, u64 ring entries
#:    tagged with the op (STATS_BYTES 2560 -> 8192); the header's payload_limit; fleet positions:
#:    Flag.AFTER with after_xid/after_seq/after_until_ns, a write's position in pos_xid/pos_seq,
#:    Status.NOT_APPLIED.
#: 6: memory over time: record timestamps and expiry (Op.TOUCH, Op.SET_TTL, Flag.TTL with ttl_ns),
#:    the answer's timestamps (Flag.TIMES: a HIT_META record per hit or record at the start of the
#:    blob), recency-weighted recall (Flag.RECENCY with half_life_s/recency_weight), refresh on
#:    read (Flag.REFRESH), and the sidecar's clock of an answer (now_ns).
PROTOCOL_VERSION = 6

HEADER_BYTES = 4096
CONTROL_BYTES = 256
STATS_BYTES = 8192
PAGE = 4096
NAMESPACE_BYTES = 64

# Client-side end-to-end latency buckets (upper bounds, nanoseconds). Part of the protocol: clients
# increment ``hist[i]`` for the first bound >= latency (the last bucket is +Inf). Microsecond
# resolution where recalls live; Prometheus' default buckets start at 5 ms and would hide them.
LATENCY_BOUNDS_NS: tuple[int, ...] = tuple(
    int(us * 1000)
    for us in (
        5,
        10,
        15,
        20,
        25,
        30,
        40,
        50,
        60,
        75,
        100,
        125,
        150,
        200,
        250,
        300,
        400,
        500,
        600,
        750,
        1000,
        1250,
        1500,
        2000,
        2500,
        3000,
        4000,
        5000,
        7500,
        10_000,
        15_000,
        25_000,
        50_000,
        100_000,
        250_000,
        500_000,
        1_000_000,
        2_500_000,
        5_000_000,
    )
)
HIST_BUCKETS = len(LATENCY_BOUNDS_NS) + 1  # + Inf
HIST_OFFSET = 256  # within a slot's stats block: u64[LATENCY_OPS][HIST_BUCKETS]
RING_OFFSET = 4096
RING_LEN = 512  # u64 entries: LatencyOp << RING_OP_SHIFT | latency in ns
#: A ring entry holds the op class in its top byte and the latency (ns, at most RING_NS_MAX: over
#: two years, so no real latency is clipped) in the rest.
RING_OP_SHIFT = 56
RING_NS_MAX = (1 << RING_OP_SHIFT) - 1


class LatencyOp(IntEnum):
    """The kind of call a client's latency observation belongs to (the ``op`` label of the latency
    metrics), so that bulk writes and admin calls never mix with recalls. See :func:`latency_op`."""

    RECALL = 0  # recall(): one vector
    RECALL_MANY = 1  # recall_many(): several vectors in one request
    UPSERT = 2  # one chunk (up to max_queries rows) of an upsert
    DELETE = 3  # one chunk of a delete by ids, or a delete by filter
    GET = 4  # one chunk of a get by ids
    OTHER = 5  # count, namespaces, drop_namespace, export_page


LATENCY_OPS = len(LatencyOp)
# Plain ints for the clients' hot path (see S_FREE below).
L_RECALL, L_RECALL_MANY, L_UPSERT, L_DELETE, L_GET, L_OTHER = (int(x) for x in LatencyOp)

assert HIST_OFFSET + 8 * LATENCY_OPS * HIST_BUCKETS <= RING_OFFSET
assert RING_OFFSET + 8 * RING_LEN <= STATS_BYTES and LATENCY_OPS <= 255


class SlotState(IntEnum):
    FREE = 0
    WRITING = 1
    POSTED = 2
    BUSY = 3
    DONE = 4


# Plain ints for hot paths: numpy and memoryview handle an IntEnum operand several times slower.
S_FREE, S_WRITING, S_POSTED, S_BUSY, S_DONE = (int(x) for x in SlotState)


class SidecarState(IntEnum):
    STARTING = 0
    READY = 1
    STOPPING = 2
    STOPPED = 3
    FAILED = 4


class Op(IntEnum):
    RECALL = 1
    UPSERT = 2
    DELETE = 3
    DROP_NAMESPACE = 4
    LIST_NAMESPACES = 5
    EXPORT = 6  # page of records with id > ids[0], ascending: ids, vectors, payload lines
    GET = 7  # records of ids[0..nq) that exist, in the order asked: ids, vectors, payload lines
    COUNT = 8  # rows of a namespace (that match the filter, with Flag.WHERE): n_results
    TOUCH = 9  # restart the expiry clock of ids[0..nq) (a new TTL with Flag.TTL): n_results touched
    SET_TTL = 10  # the namespace's default TTL: ttl_ns (0: none), for upserts without Flag.TTL
    EMBED = 11  # nq texts in the blob (broker.texts) -> their vectors in queries[0..nq): n_results = nq


# Indexed by Op value (a tuple: hashing an IntEnum runs Python code, indexing does not).
_LATENCY_OF_OP: tuple[int, ...] = tuple(
    {int(Op.UPSERT): L_UPSERT, int(Op.DELETE): L_DELETE, int(Op.GET): L_GET}.get(v, L_OTHER) for v in range(max(Op) + 1)
)


_OP_RECALL = int(Op.RECALL)  # (a member's attribute lookup costs more than the whole mapping)


def latency_op(op: int, single: bool) -> int:
    """The LatencyOp (as an int) a client records a request of ``op`` under; ``single``: a recall
    of one vector (``recall``) rather than of a matrix (``recall_many``, whatever its rows)."""
    if op == _OP_RECALL:
        return L_RECALL if single else L_RECALL_MANY
    return _LATENCY_OF_OP[op] if 0 <= op < len(_LATENCY_OF_OP) else L_OTHER


class Status(IntEnum):
    """Per-request status the sidecar writes into ``status``; text detail goes to the blob."""

    OK = 0
    BAD_REQUEST = 1  # malformed slot (garbage op/k/nq/namespace, inconsistent lengths)
    DIM_MISMATCH = 2
    K_OUT_OF_RANGE = 3
    TOO_MANY_QUERIES = 4
    NOT_FINITE = 5
    UNKNOWN_NAMESPACE = 6  # no longer answered: a namespace that does not exist reads as empty
    PAYLOAD_TOO_LARGE = 7
    BACKEND_ERROR = 8
    UNKNOWN_OP = 9
    STORE_ERROR = 10
    CAPACITY = 11
    BAD_ID = 12
    SERVER_ERROR = 13  # the sidecar failed on this request unexpectedly (logged); it serves on
    NOT_APPLIED = 14  # Flag.AFTER: the position was not applied here by after_until_ns


_STATUS_ERRORS: dict[int, type[KalosError]] = {
    Status.BAD_REQUEST: ProtocolError,
    Status.DIM_MISMATCH: InvalidRequest,
    Status.K_OUT_OF_RANGE: InvalidRequest,
    Status.TOO_MANY_QUERIES: InvalidRequest,
    Status.NOT_FINITE: InvalidRequest,
    Status.UNKNOWN_NAMESPACE: UnknownNamespace,
    Status.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    Status.BACKEND_ERROR: ServerError,
    Status.UNKNOWN_OP: ProtocolError,
    Status.STORE_ERROR: ServerError,
    Status.CAPACITY: ServerError,
    Status.BAD_ID: InvalidRequest,
    Status.SERVER_ERROR: ServerError,
    Status.NOT_APPLIED: PositionTimeout,
}


def error_for_status(status: int, detail: str) -> KalosError:
    """The exception a caller sees for a sidecar status code (an unknown code: ProtocolError)."""
    cls = _STATUS_ERRORS.get(status, ProtocolError)
    try:
        name = Status(status).name
    except ValueError:
        name = f"status {status}"
    return cls(f"{name}: {detail}" if detail else name)


class Flag(IntEnum):
    WITH_PAYLOAD = 1
    WHERE = 2  # the request's blob holds a filter (compact JSON): RECALL, DELETE, EXPORT, COUNT
    # RECALL, GET, COUNT: serve once the sidecar has applied its fleet's change log up to
    # (after_xid, after_seq); answer NOT_APPLIED at after_until_ns (CLOCK_MONOTONIC; 0: no limit).
    # The sidecar clears the bit before serving, so the routes never see it.
    AFTER = 4
    # UPSERT, TOUCH: ttl_ns is the rows' time to live (ns; 0: never expire). An UPSERT without it
    # takes the namespace's default TTL (Op.SET_TTL); a TOUCH without it restarts each row's own.
    TTL = 8
    # RECALL, GET, EXPORT: the blob of the answer starts with one HIT_META record (timestamps, and
    # the recency part of the score) per hit or record, before any payload lines.
    TIMES = 16
    # RECALL: rank by score + recency_weight * 0.5 ** (age / half_life_s), age = now_ns - updated_at
    # (at least 0), exactly over every matching row; implies TIMES (the answer carries each part).
    RECENCY = 32
    # RECALL, GET: the records answered are touched (their expiry restarts) before the answer.
    REFRESH = 64
    # RECALL (nq 1): hybrid lexical + dense recall (broker.lexical): the blob starts with the query
    # text (NUL-terminated; then the filter with WHERE), hybrid_weight weighs the BM25 part. Only
    # to a sidecar whose header's features carry FEATURE_HYBRID.
    HYBRID = 128


class Dtype(IntEnum):
    FLOAT32 = 1


class Metric(IntEnum):
    DOT = 1
    COSINE = 2
    L2 = 3


def metric_name(code: int) -> str:
    """``"dot"``, ``"cosine"`` or ``"l2"`` for a header's metric code (``"unknown"`` otherwise)."""
    try:
        return Metric(code).name.lower()
    except ValueError:
        return "unknown"


# Header fields: (name, numpy type, offset).
HEADER_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("magic", "<u8", 0),
    ("version", "<u4", 8),
    ("header_bytes", "<u4", 12),
    ("n_slots", "<u4", 16),
    ("dim", "<u4", 20),
    ("max_k", "<u4", 24),
    ("max_queries", "<u4", 28),
    ("dtype", "<u4", 32),
    ("state", "<u4", 36),  # SidecarState
    ("slot_bytes", "<u8", 40),  # stride of slot data areas
    ("data_offset", "<u8", 48),
    ("blob_bytes", "<u8", 56),
    ("sidecar_pid", "<i8", 64),
    ("start_epoch_ns", "<u8", 72),  # CLOCK_REALTIME at start
    ("heartbeat_ns", "<u8", 80),  # CLOCK_MONOTONIC, refreshed every HEARTBEAT_S
    ("batches", "<u8", 88),
    ("metric", "<u4", 96),
    ("hist_buckets", "<u4", 100),
    ("ring_len", "<u4", 104),
    ("backend", "<u4", 108),  # 1 numpy, 2 cuda
    # 1 while the sidecar sleeps on the doorbell. A client that finds it set after posting its
    # slot's req semaphore (a full fence) must post the doorbell; otherwise the sidecar is polling
    # and the post can be skipped. (Posting it anyway is always correct.)
    ("sidecar_sleeping", "<u4", 112),
    # The sidecar's --payload-limit (bytes of one payload's JSON): clients check every payload of
    # a write against it before sending any part of the call.
    ("payload_limit", "<u4", 116),
    # The dimension of the sidecar's embedding model (kalos serve --embed; Op.EMBED), 0: none. A
    # sidecar before it left the word 0: a client reads "no model" there too.
    ("embed_dim", "<u4", 120),
    # What the sidecar serves beyond protocol 6 (FEATURE_* bits); older sidecars left 0 here.
    ("features", "<u4", 124),
)

#: The header's ``features``: hybrid recall (Flag.HYBRID).
FEATURE_HYBRID = 1

# Slot header fields: (name, numpy type, offset within the slot).
SLOT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("state", "<u4", 0),  # SlotState
    ("op", "<u4", 4),  # Op
    ("generation", "<u8", 8),  # request number, written by the client
    ("owner_pid", "<i8", 16),  # lease: 0 = unleased
    ("owner_start", "<u8", 24),  # lease: owner's start time (clock ticks since boot), against pid reuse
    ("k", "<u4", 32),
    ("nq", "<u4", 36),  # number of query rows / ids in the request
    ("status", "<i4", 40),  # Status, written by the sidecar
    ("flags", "<u4", 44),  # Flag bits
    ("t_post_ns", "<u8", 48),  # client: request posted (CLOCK_MONOTONIC)
    ("t_pick_ns", "<u8", 56),  # sidecar: taken into a batch
    ("t_done_ns", "<u8", 64),  # sidecar: results written
    ("blob_len", "<u4", 72),  # bytes used in the blob area (request or response)
    ("n_results", "<u4", 76),  # results per query (recall) or rows affected (writes)
    ("resp_generation", "<u8", 80),  # sidecar echoes `generation` of the request it answered
    ("batch_size", "<u4", 88),  # sidecar: requests in the batch that served this slot
    ("ns_len", "<u4", 92),
    ("namespace", f"S{NAMESPACE_BYTES}", 96),
    # Fleet positions (broker.positions): a read's wait (with Flag.AFTER), a write's answer.
    ("after_xid", "<u8", 160),
    ("after_seq", "<u8", 168),
    ("after_until_ns", "<u8", 176),
    ("pos_xid", "<u8", 184),  # sidecar: position of a write's last change (0, 0: none)
    ("pos_seq", "<u8", 192),
    # Memory over time (protocol 6): a write's TTL, a recall's recency, the sidecar's clock.
    ("ttl_ns", "<i8", 200),  # client: Flag.TTL (UPSERT, TOUCH), Op.SET_TTL; 0: never, < 0 refused
    ("half_life_s", "<f8", 208),  # client: Flag.RECENCY, finite and > 0
    ("recency_weight", "<f8", 216),  # client: Flag.RECENCY, finite
    ("now_ns", "<u8", 224),
    (
        "hybrid_weight",
        "<f8",
        232,
    ),  # client, with HYBRID: the BM25 part's weight (finite, >= 0)  # sidecar: CLOCK_REALTIME the request was served at (writes, flags above)
)
assert SLOT_FIELDS[-1][2] + 8 <= CONTROL_BYTES

# Client stats fields: (name, numpy type, offset within the slot's stats block). The per-op ones
# are arrays indexed by LatencyOp.
STATS_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("lat_count", "<u8", 0),  # latencies written to the ring, every op (the ring's write index)
    ("lat_sum_ns", f"({LATENCY_OPS},)<u8", 8),  # per op: sum of the latencies in its histogram
    ("err_count", f"({LATENCY_OPS},)<u8", 8 + 8 * LATENCY_OPS),  # per op: ended in an error
    # per op: the caller timed out or was cancelled
    ("timeout_count", f"({LATENCY_OPS},)<u8", 8 + 16 * LATENCY_OPS),
)
assert 8 + 24 * LATENCY_OPS <= HIST_OFFSET

#: One record per hit (RECALL) or record (GET, EXPORT) at the start of an answer's blob with
#: Flag.TIMES or Flag.RECENCY, before any payload lines: the record's timestamps (CLOCK_REALTIME
#: ns of the sidecar that took the write; expires_at 0: never) and the recency part of the hit's
#: score (0.0 without Flag.RECENCY; the similarity part is the score minus it).
HIT_META_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("created_at_ns", "<i8", 0),
    ("updated_at_ns", "<i8", 8),
    ("expires_at_ns", "<i8", 16),
    ("recency", "<f8", 24),
)
HIT_META_BYTES = 32

#: ``owner_pid`` of a slot given up by a live client while its request may still be in flight
#: (``RecallPool.terminate``); the sidecar's reaper frees it like the slot of a dead owner.
OWNER_ABANDONED = -1

HEARTBEAT_S = 0.05
#: A sidecar whose heartbeat is older than this is considered dead by clients.
HEARTBEAT_STALE_S = 2.0


#: The geometries a sidecar may serve: (field, lowest, highest). ``Layout.check`` holds a sidecar's
#: options to them, and clients hold a header to them before computing an offset from it (the
#: generated C header carries them as ``KALOS_LIMIT_*``), so no product of fields overflows.
GEOMETRY_LIMITS: tuple[tuple[str, int, int], ...] = (
    ("n_slots", 1, 4096),
    ("dim", 1, 65536),
    ("max_k", 1, 16384),
    ("max_queries", 1, 4096),
    ("blob_bytes", 1024, 1 << 28),
)
#: The alignment of the areas inside a slot's data area (``Layout.ids_offset`` and after).
AREA_ALIGN = 64


def hit_meta_dtype() -> np.dtype:
    """The numpy dtype of one :data:`HIT_META_FIELDS` record (32 bytes, little-endian)."""
    return _fields_dtype(HIT_META_FIELDS, HIT_META_BYTES)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def header_dtype() -> np.dtype:
    return np.dtype(
        {
            "names": [f[0] for f in HEADER_FIELDS],
            "formats": [f[1] for f in HEADER_FIELDS],
            "offsets": [f[2] for f in HEADER_FIELDS],
            "itemsize": HEADER_BYTES,
        }
    )


def _fields_dtype(fields: tuple[tuple[str, str, int], ...], itemsize: int) -> np.dtype:
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[1] for f in fields],
            "offsets": [f[2] for f in fields],
            "itemsize": itemsize,
        }
    )


#: A slot's stats block as one numpy record, built once, at import. Its per-op counters are
#: subarray formats (``"(N,)<u8"``), which numpy parses with ``ast.literal_eval``, and CPython
#: 3.11's AST constructor can fail when threads parse at once ("SystemError: AST constructor
#: recursion depth mismatch", python/cpython#106905): clients attach from many threads.
_STATS_DTYPE = _fields_dtype(STATS_FIELDS, STATS_BYTES)


def slot_dtype(itemsize: int = CONTROL_BYTES) -> np.dtype:
    """Control-block fields; an array of it with itemsize CONTROL_BYTES walks the slots."""
    return _fields_dtype(SLOT_FIELDS, itemsize)


@dataclass(frozen=True)
class Layout:
    """Geometry of one broker's segment. Every offset used anywhere comes from here."""

    n_slots: int
    dim: int
    max_k: int
    max_queries: int
    blob_bytes: int

    @property
    def control_offset(self) -> int:
        return HEADER_BYTES

    @property
    def stats_offset(self) -> int:
        return _align(self.control_offset + self.n_slots * CONTROL_BYTES, PAGE)

    @property
    def data_offset(self) -> int:
        return _align(self.stats_offset + self.n_slots * STATS_BYTES, PAGE)

    # Offsets inside one slot's data area:
    @property
    def query_offset(self) -> int:
        return 0

    @property
    def ids_offset(self) -> int:
        return _align(self.query_offset + 4 * self.max_queries * self.dim, AREA_ALIGN)

    @property
    def result_ids_offset(self) -> int:
        return _align(self.ids_offset + 8 * self.max_queries, AREA_ALIGN)

    @property
    def result_scores_offset(self) -> int:
        return _align(self.result_ids_offset + 8 * self.max_queries * self.max_k, AREA_ALIGN)

    @property
    def blob_offset(self) -> int:
        return _align(self.result_scores_offset + 4 * self.max_queries * self.max_k, AREA_ALIGN)

    @property
    def slot_bytes(self) -> int:
        """Stride of the per-slot data areas."""
        return _align(self.blob_offset + self.blob_bytes, PAGE)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.n_slots * self.slot_bytes

    def control_base(self, i: int) -> int:
        return self.control_offset + i * CONTROL_BYTES

    def stats_base(self, i: int) -> int:
        return self.stats_offset + i * STATS_BYTES

    def data_base(self, i: int) -> int:
        return self.data_offset + i * self.slot_bytes

    def check(self) -> None:
        for field, lo, hi in GEOMETRY_LIMITS:
            v = getattr(self, field)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{field} must be an integer in [{lo}, {hi}], got {v!r}")

    @classmethod
    def from_header(cls, hdr: np.ndarray) -> Layout:
        return cls(
            n_slots=int(hdr["n_slots"]),
            dim=int(hdr["dim"]),
            max_k=int(hdr["max_k"]),
            max_queries=int(hdr["max_queries"]),
            blob_bytes=int(hdr["blob_bytes"]),
        )


class SlotView:
    """Numpy views of one slot inside a mapped segment (no copies; writes go to shared memory)."""

    __slots__ = ("index", "ctl", "queries", "ids", "result_ids", "result_scores", "blob", "hist", "ring")

    def __init__(self, buf: memoryview, layout: Layout, index: int) -> None:
        L = layout
        base = L.data_base(index)
        self.index = index
        self.ctl = np.ndarray((), dtype=slot_dtype(CONTROL_BYTES), buffer=buf, offset=L.control_base(index))
        self.queries = np.ndarray((L.max_queries, L.dim), np.float32, buf, base + L.query_offset)
        self.ids = np.ndarray((L.max_queries,), np.int64, buf, base + L.ids_offset)
        self.result_ids = np.ndarray((L.max_queries, L.max_k), np.int64, buf, base + L.result_ids_offset)
        self.result_scores = np.ndarray((L.max_queries, L.max_k), np.float32, buf, base + L.result_scores_offset)
        self.blob = np.ndarray((L.blob_bytes,), np.uint8, buf, base + L.blob_offset)
        #: Latency histograms, one row per LatencyOp.
        self.hist = np.ndarray((LATENCY_OPS, HIST_BUCKETS), np.uint64, buf, L.stats_base(index) + HIST_OFFSET)
        self.ring = np.ndarray((RING_LEN,), np.uint64, buf, L.stats_base(index) + RING_OFFSET)


class SegmentView:
    """Header, strided all-slots header array, and per-slot views of one mapped segment."""

    def __init__(self, buf: memoryview, layout: Layout) -> None:
        self.layout = layout
        self.header = np.ndarray((), dtype=header_dtype(), buffer=buf, offset=0)
        #: One record per slot's control block; ``slots["state"]`` views every slot's state.
        self.slots = np.ndarray(
            (layout.n_slots,), dtype=slot_dtype(CONTROL_BYTES), buffer=buf, offset=layout.control_offset
        )
        #: Every slot's client stats block (counters; hist and ring are in ``slot[i]``).
        self.stats = np.ndarray((layout.n_slots,), dtype=_STATS_DTYPE, buffer=buf, offset=layout.stats_offset)
        self.slot = [SlotView(buf, layout, i) for i in range(layout.n_slots)]
        L = layout

        def every_slot(offset: int, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
            """The data area at ``offset`` in each slot's data (C order within a slot), slot first."""
            strides = [np.dtype(dtype).itemsize]
            for extent in reversed(shape[1:]):
                strides.insert(0, strides[0] * extent)
            view: np.ndarray = np.ndarray(
                (L.n_slots, *shape), dtype, buf, L.data_offset + offset, (L.slot_bytes, *strides)
            )
            return view

        #: Every slot's data areas as one strided array each (slot index first), so a batch is
        #: gathered or scattered with one fancy-indexing call.
        self.all_queries = every_slot(L.query_offset, (L.max_queries, L.dim), np.float32)
        self.all_result_ids = every_slot(L.result_ids_offset, (L.max_queries, L.max_k), np.int64)
        self.all_result_scores = every_slot(L.result_scores_offset, (L.max_queries, L.max_k), np.float32)
        self.all_blobs = every_slot(L.blob_offset, (L.blob_bytes,), np.uint8)

    def init_header(
        self,
        *,
        metric: int,
        backend: int,
        pid: int,
        start_epoch_ns: int,
        payload_limit: int,
        embed_dim: int = 0,
        features: int = FEATURE_HYBRID,
    ) -> None:
        h = self.header
        L = self.layout
        h["version"] = PROTOCOL_VERSION
        h["header_bytes"] = HEADER_BYTES
        h["n_slots"] = L.n_slots
        h["dim"] = L.dim
        h["max_k"] = L.max_k
        h["max_queries"] = L.max_queries
        h["dtype"] = Dtype.FLOAT32
        h["slot_bytes"] = L.slot_bytes
        h["data_offset"] = L.data_offset
        h["blob_bytes"] = L.blob_bytes
        h["sidecar_pid"] = pid
        h["start_epoch_ns"] = start_epoch_ns
        h["metric"] = metric
        h["backend"] = backend
        h["payload_limit"] = payload_limit
        h["embed_dim"] = embed_dim
        h["features"] = features
        h["hist_buckets"] = HIST_BUCKETS
        h["ring_len"] = RING_LEN
        h["state"] = SidecarState.STARTING
        # Magic last: a client that sees it sees a complete header.
        h["magic"] = MAGIC_U64


def peek_header(buf: memoryview) -> np.ndarray:
    """The header of a segment whose geometry is not known yet (first step of attaching)."""
    hdr: np.ndarray = np.ndarray((), dtype=header_dtype(), buffer=buf, offset=0)
    return hdr


def c_header() -> str:
    """A C header with the same offsets, for clients in other languages."""
    lines = [
        "/* Generated by kalos.broker.layout.c_header(); do not edit. */",
        "#pragma once",
        f"#define KALOS_PROTOCOL_VERSION {PROTOCOL_VERSION}",
        f'#define KALOS_MAGIC 0x{MAGIC_U64:016x}ULL /* "KALOSHM\\0" little-endian */',
        f"#define KALOS_HEADER_BYTES {HEADER_BYTES}",
        f"#define KALOS_CONTROL_BYTES {CONTROL_BYTES}",
        f"#define KALOS_STATS_BYTES {STATS_BYTES}",
        f"#define KALOS_NAMESPACE_BYTES {NAMESPACE_BYTES}",
        f"#define KALOS_HIST_OFFSET {HIST_OFFSET}",
        f"#define KALOS_HIST_BUCKETS {HIST_BUCKETS}",
        f"#define KALOS_RING_OFFSET {RING_OFFSET}",
        f"#define KALOS_RING_LEN {RING_LEN}",
        f"#define KALOS_RING_OP_SHIFT {RING_OP_SHIFT}",
        f"#define KALOS_RING_NS_MAX 0x{RING_NS_MAX:x}ULL",
        f"#define KALOS_LATENCY_OPS {LATENCY_OPS}",
        f"#define KALOS_HIT_META_BYTES {HIT_META_BYTES}",
        f"#define KALOS_MAX_TEXT_BYTES {MAX_TEXT_BYTES} /* Op.EMBED: the most UTF-8 bytes of one text */",
        f"#define KALOS_FEATURE_HYBRID {FEATURE_HYBRID} /* the header's features: Flag.HYBRID served */",
    ]
    for prefix, fields in (
        ("KALOS_HDR", HEADER_FIELDS),
        ("KALOS_SLOT", SLOT_FIELDS),
        ("KALOS_STATS", STATS_FIELDS),
        ("KALOS_HIT_META", HIT_META_FIELDS),
    ):
        for name, _t, off in fields:
            lines.append(f"#define {prefix}_{name.upper()} {off}")
    for enum in (SlotState, SidecarState, Op, Status, Flag, Metric, LatencyOp):
        for m in enum:
            lines.append(f"#define KALOS_{enum.__name__.upper()}_{m.name} {int(m)}")
    return "\n".join(lines) + "\n" + _c_geometry()


def _c_geometry() -> str:
    """The part of the C header that computes: the constants a client needs besides offsets, and
    ``static inline`` functions for :class:`Layout`'s offsets and the latency bucket of
    ``LATENCY_BOUNDS_NS``, for a geometry read from a header (``tests/unit/test_layout_c.py``
    compiles them and compares them with :class:`Layout` over random geometries)."""
    lines = [
        "",
        "/* Computed parts of the protocol (Layout in broker/layout.py). */",
        "#include <stdint.h>",
        f"#define KALOS_PAGE_BYTES {PAGE}",
        f"#define KALOS_AREA_ALIGN {AREA_ALIGN}",
        f"#define KALOS_OWNER_ABANDONED ({OWNER_ABANDONED})",
        f"#define KALOS_HEARTBEAT_NS {round(HEARTBEAT_S * 1e9)}ULL",
        f"#define KALOS_HEARTBEAT_STALE_NS {round(HEARTBEAT_STALE_S * 1e9)}ULL",
    ]
    for m in Dtype:
        lines.append(f"#define KALOS_DTYPE_{m.name} {int(m)}")
    for field, lo, hi in GEOMETRY_LIMITS:
        lines.append(f"#define KALOS_LIMIT_{field.upper()}_MIN {lo}ULL")
        lines.append(f"#define KALOS_LIMIT_{field.upper()}_MAX {hi}ULL")
    checks = " &&\n           ".join(
        f"g->{field} >= KALOS_LIMIT_{field.upper()}_MIN && g->{field} <= KALOS_LIMIT_{field.upper()}_MAX"
        for field, _lo, _hi in GEOMETRY_LIMITS
    )
    bounds = ", ".join(f"{b}ULL" for b in LATENCY_BOUNDS_NS)
    lines.append(
        f"""
/* A broker's geometry, as its header gives it. Check it with kalos_geometry_ok before any other
 * function below: within the limits no product of fields overflows. */
typedef struct kalos_geometry {{
    uint64_t n_slots, dim, max_k, max_queries, blob_bytes;
}} kalos_geometry;

static inline int kalos_geometry_ok(const kalos_geometry *g) {{
    return {checks};
}}

static inline uint64_t kalos_align(uint64_t n, uint64_t a) {{ return (n + a - 1) / a * a; }}

/* The segment: header, control blocks, stats blocks (page aligned), data areas (page aligned). */
static inline uint64_t kalos_control_base(uint64_t i) {{ return KALOS_HEADER_BYTES + i * KALOS_CONTROL_BYTES; }}

static inline uint64_t kalos_stats_offset(const kalos_geometry *g) {{
    return kalos_align(KALOS_HEADER_BYTES + g->n_slots * KALOS_CONTROL_BYTES, KALOS_PAGE_BYTES);
}}

static inline uint64_t kalos_data_offset(const kalos_geometry *g) {{
    return kalos_align(kalos_stats_offset(g) + g->n_slots * KALOS_STATS_BYTES, KALOS_PAGE_BYTES);
}}

static inline uint64_t kalos_stats_base(const kalos_geometry *g, uint64_t i) {{
    return kalos_stats_offset(g) + i * KALOS_STATS_BYTES;
}}

/* Inside one slot's data area: queries f32[max_queries][dim], ids i64[max_queries], result ids
 * i64[max_queries][max_k], result scores f32[max_queries][max_k], blob u8[blob_bytes]. */
static inline uint64_t kalos_query_offset(const kalos_geometry *g) {{
    (void)g;
    return 0;
}}

static inline uint64_t kalos_ids_offset(const kalos_geometry *g) {{
    return kalos_align(kalos_query_offset(g) + 4 * g->max_queries * g->dim, KALOS_AREA_ALIGN);
}}

static inline uint64_t kalos_result_ids_offset(const kalos_geometry *g) {{
    return kalos_align(kalos_ids_offset(g) + 8 * g->max_queries, KALOS_AREA_ALIGN);
}}

static inline uint64_t kalos_result_scores_offset(const kalos_geometry *g) {{
    return kalos_align(kalos_result_ids_offset(g) + 8 * g->max_queries * g->max_k, KALOS_AREA_ALIGN);
}}

static inline uint64_t kalos_blob_offset(const kalos_geometry *g) {{
    return kalos_align(kalos_result_scores_offset(g) + 4 * g->max_queries * g->max_k, KALOS_AREA_ALIGN);
}}

/* The stride of the data areas (the header's slot_bytes). */
static inline uint64_t kalos_slot_bytes(const kalos_geometry *g) {{
    return kalos_align(kalos_blob_offset(g) + g->blob_bytes, KALOS_PAGE_BYTES);
}}

static inline uint64_t kalos_data_base(const kalos_geometry *g, uint64_t i) {{
    return kalos_data_offset(g) + i * kalos_slot_bytes(g);
}}

/* The segment's size. */
static inline uint64_t kalos_total_bytes(const kalos_geometry *g) {{
    return kalos_data_offset(g) + g->n_slots * kalos_slot_bytes(g);
}}

/* The histogram bucket of a latency (ns): the first upper bound >= it; the last is +Inf. */
static inline unsigned kalos_latency_bucket(uint64_t ns) {{
    static const uint64_t bounds[{len(LATENCY_BOUNDS_NS)}] = {{{bounds}}};
    unsigned j = 0;
    while (j < {len(LATENCY_BOUNDS_NS)} && bounds[j] < ns) {{
        j++;
    }}
    return j;
}}"""
    )
    return "\n".join(lines) + "\n"


def header_field_offset(field: str) -> int:
    """Byte offset of a header field."""
    for name, _t, off in HEADER_FIELDS:
        if name == field:
            return off
    raise KeyError(field)


def slot_field_offset(layout: Layout, i: int, field: str) -> int:
    """Absolute byte offset of a control-block or stats field of slot i (for word-indexed access)."""
    for name, _t, off in SLOT_FIELDS:
        if name == field:
            return layout.control_base(i) + off
    for name, _t, off in STATS_FIELDS:
        if name == field:
            return layout.stats_base(i) + off
    raise KeyError(field)


def word_views(buf: memoryview) -> tuple[memoryview, memoryview]:
    """The segment as 4-byte and 8-byte words (``u32``, ``u64``), the views every hot path indexes
    by a field's word offset (:func:`slot_field_offset` // size): made here, for both sides."""
    return buf.cast("I"), buf.cast("Q")


class SlotWords:
    """Word-indexed access to every slot's header fields, for hot paths (a memoryview item costs
    ~50 ns; a numpy record field ~1 us). ``u32[w.state[i]]`` is slot i's state, and so on for every
    4- and 8-byte field (8-byte ones index ``u64``)."""

    def __init__(self, buf: memoryview, layout: Layout) -> None:
        self.u32, self.u64 = word_views(buf)
        for name, typ, _off in SLOT_FIELDS + STATS_FIELDS:
            size = np.dtype(typ).itemsize
            if size in (4, 8):
                setattr(self, name, [slot_field_offset(layout, i, name) // size for i in range(layout.n_slots)])

    def release(self) -> None:
        self.u32.release()
        self.u64.release()

    def __getattr__(self, name: str) -> list[int]:  # for type checkers: fields are set above
        raise AttributeError(name)
