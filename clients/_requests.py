"""Requests as data: how each operation is validated, encoded into a slot's data areas and
decoded from its answer. Pure with respect to I/O: it reads and writes numpy views of a slot
(``broker.layout.SlotView``) and never touches a semaphore; the transport posts and consumes.

Shared by the async pool and the blocking client; validation happens before a slot is claimed.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final, Generic, Protocol, TypeVar

import numpy as np

from ..broker.clock import Recency, expiry_seconds, seconds, ttl_groups, ttl_ns
from ..broker.errors import ConfigError, InvalidRequest, ProtocolError
from ..broker.layout import (
    FEATURE_HYBRID,
    HIT_META_BYTES,
    Flag,
    Layout,
    Op,
    SlotView,
    Status,
    error_for_status,
    hit_meta_dtype,
)
from ..broker.lexical import Hybrid, encode_hybrid_blob
from ..broker.names import validate_namespace
from ..broker.positions import ORIGIN, Position, as_position
from ..broker.texts import text_problem
from ..broker.validation import (
    VectorsFor,
    as_ids,
    as_vectors,
    check_k,
    encode_where,
    payload_lines,
)
from ._writes import WriteCall, last_wins, pack
from .results import Hits, Records, Written


class _Default(enum.Enum):
    """The type of :data:`DEFAULT`."""

    TIMEOUT = 0

    def __repr__(self) -> str:
        return "DEFAULT"


#: "Use the pool's (or client's) default timeout": the default of every call's ``timeout``.
DEFAULT: Final = _Default.TIMEOUT
#: A call's time budget: seconds, None for no limit, or DEFAULT.
Timeout = float | None | _Default


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    return default if isinstance(timeout, _Default) else timeout


#: Operations that only read: sent again to the next sidecar when the one they were posted to
#: went away before answering (a write may have been applied: the caller decides).
READS: Final = frozenset({Op.RECALL, Op.LIST_NAMESPACES, Op.EXPORT, Op.GET, Op.COUNT})


R = TypeVar("R")
#: How an answer's words become a call's result: (the slot's views, n_results, blob_len, the
#: request) -> the result; each operation's encoder names its own (:class:`Prepared`).
Decoder = Callable[[SlotView, int, int, "Prepared[R]"], R]


def _by_op(v: SlotView, n: int, blob_len: int, p: Prepared[Any]) -> Any:
    """The decoder of a request built without one (a unit test's hand-made Prepared): by op."""
    if p.op == Op.RECALL:
        hits = _recall_hits(v, n, blob_len, p)
        return hits[0] if p.single else hits
    return _DECODERS[p.op](v, n, blob_len, p)


@dataclass(slots=True)
class Prepared(Generic[R]):
    """One request, encoded (and checked) before a slot is taken: its header fields, its arrays,
    and ``decode``, which turns its answer into the call's result (``R``: ``Hits`` for a recall,
    ``Written`` for a write, ...), so a driver returns ``R`` without a cast."""

    op: Op
    ns: bytes
    k: int = 0
    nq: int = 0
    flags: int = 0
    vectors: np.ndarray | None = None
    ids: np.ndarray | None = None
    blob: bytes = b""
    single: bool = False
    with_vectors: bool = True  # GET: copy the vectors out of the answer
    # What became of it, for a write that fails (clients._writes.fate): posted to a slot, and
    # the error status the sidecar answered (None: none was read).
    posted: bool = False
    status: int | None = None
    call: WriteCall | None = None  # a chunk sent with others: not posted once one has failed
    after: Position | None = None  # Flag.AFTER: served once the sidecar has applied this
    after_until_ns: int = 0  # ... or answered NOT_APPLIED at this CLOCK_MONOTONIC time (0: never)
    ttl_ns: int | None = None  # ttl_ns field: Flag.TTL (UPSERT, TOUCH) or Op.SET_TTL; None: not written
    recency: Recency | None = None  # Flag.RECENCY: half_life_s, recency_weight
    hybrid: float | None = None  # Flag.HYBRID: hybrid_weight (the query text leads the blob)
    decode: Decoder[R] = field(default=_by_op, kw_only=True)


#: A read given after= asks the sidecar to give up this much before the caller's own deadline
#: (at most this share of the budget), so the caller gets NOT_APPLIED, which names the positions,
#: rather than a bare ResponseTimeout.
_AFTER_MARGIN_S = 0.2
_AFTER_MARGIN_SHARE = 0.2


def wait_after(preps: Sequence[Prepared[Any]], after: Any, t0_ns: int, budget_s: float | None) -> None:
    """Make reads wait for a fleet position (``after=``: a Position, its string, or None) within
    the call's budget (seconds from ``t0_ns``, CLOCK_MONOTONIC; None: no limit). Raises
    InvalidRequest for anything else than a position."""
    pos = as_position(after)
    if pos is None or pos == ORIGIN:
        return
    until = 0
    if budget_s is not None:
        margin = min(_AFTER_MARGIN_S, _AFTER_MARGIN_SHARE * budget_s)
        until = max(1, t0_ns + int((budget_s - margin) * 1e9))
    for p in preps:
        p.after, p.after_until_ns = pos, until
        p.flags |= Flag.AFTER


class NamespaceCache(dict[str, bytes]):
    """Validated namespace names -> encoded bytes (the regex check runs once per name)."""

    LIMIT = 4096

    def encode(self, namespace: str) -> bytes:
        b = self.get(namespace)
        if b is None:
            b = validate_namespace(namespace)
            if len(self) < self.LIMIT:
                self[namespace] = b
        return b


class FastRows(Protocol):
    """The compiled slot path's check of float32 vectors (``clients/_cslot.c``: the module is
    one): what ``broker.validation.as_vectors`` returns for a finite float32 vector of shape
    ``(dim,)`` (``as_row``: a ``(1, dim)`` view) or matrix of shape ``(n, dim)`` with ``n`` in
    ``1..max_rows`` (``as_rows``: the matrix itself), and None for anything else, which then
    goes through ``as_vectors`` (and its errors)."""

    def as_row(self, x: Any, dim: int, /) -> np.ndarray | None: ...

    def as_rows(self, x: Any, dim: int, max_rows: int, /) -> np.ndarray | None: ...


class CompiledRows:
    """:class:`FastRows` over the compiled module (``clients/_cslot``), its two checks bound once."""

    __slots__ = ("as_row", "as_rows")

    def __init__(self, module: ModuleType) -> None:
        self.as_row: Callable[[Any, int], np.ndarray | None] = module.as_row
        self.as_rows: Callable[[Any, int, int], np.ndarray | None] = module.as_rows


def fast_rows(module: ModuleType | None) -> FastRows | None:
    """The compiled checks of a connection's slot path (None on the Python path)."""
    return None if module is None else CompiledRows(module)


@dataclass(frozen=True, slots=True)
class Shape(Generic[R]):
    """What a recall sends and gets back: :data:`ONE` vector and one :class:`Hits`, or
    :data:`ROWS` of a matrix and one Hits per row."""

    single: bool
    decode: Decoder[R]


def recall(
    layout: Layout,
    x: Any,
    k: int,
    namespace: bytes,
    with_payload: bool,
    shape: Shape[R],
    where: Any = None,
    fast: FastRows | None = None,
    *,
    recency: Recency | None = None,
    with_times: bool = False,
    refresh_ttl: bool = False,
) -> Prepared[R]:
    """A recall of ``x`` in ``shape`` (:data:`ONE` or :data:`ROWS`). ``namespace`` is already
    validated and encoded (NamespaceCache.encode); ``fast``: the compiled check of the common
    vectors (None: ``as_vectors`` only; the result is the same). A recall with payloads carries
    the hits' timestamps too (Flag.TIMES), as does one ``with_times``; a ``recency`` recall
    carries both parts of each score; ``refresh_ttl`` touches the hits."""
    single = shape.single
    q = None
    if fast is not None:
        q = fast.as_row(x, layout.dim) if single else fast.as_rows(x, layout.dim, layout.max_queries)
    if q is None:
        q = as_vectors(x, layout.dim, VectorsFor.RECALL if single else VectorsFor.RECALL_MANY, layout.max_queries)
    if type(k) is not int or not 1 <= k <= layout.max_k:
        k = check_k(k, layout.max_k)
    p = Prepared(
        Op.RECALL,
        namespace,
        k,
        len(q),
        Flag.WITH_PAYLOAD if with_payload else 0,
        vectors=q,
        single=single,
        decode=shape.decode,
    )
    if where is not None:
        p.blob = encode_where(where, layout.blob_bytes)
        p.flags |= Flag.WHERE
    if with_payload or with_times or recency is not None or refresh_ttl:
        p.flags |= _time_flags(recency, with_payload or with_times, refresh_ttl)
        p.recency = recency
    return p


def hybrid_recall(
    layout: Layout,
    x: Any,
    text: str,
    hybrid: Hybrid,
    k: int,
    namespace: bytes,
    features: int,
    where: Any = None,
    *,
    refresh_ttl: bool = False,
) -> Prepared[Hits]:
    """A hybrid recall (Flag.HYBRID, ``broker.lexical``) of one vector ``x`` (the embedding of
    ``text``) with payloads: the query text leads the blob, then the filter. ConfigError when
    the sidecar does not serve it (``features``: its header's)."""
    if not isinstance(hybrid, Hybrid):
        raise InvalidRequest(f"hybrid must be a kalos.Hybrid, got {type(hybrid).__name__}")
    if not features & FEATURE_HYBRID:
        raise ConfigError("this sidecar does not serve hybrid recall (an older version): upgrade it")
    p = recall(layout, x, k, namespace, True, ONE, where, None, refresh_ttl=refresh_ttl)
    p.blob = encode_hybrid_blob(text, p.blob)
    if len(p.blob) > layout.blob_bytes:
        raise InvalidRequest(
            f"the query text and filter take {len(p.blob)} bytes, a slot's blob area holds {layout.blob_bytes}"
        )
    p.flags |= Flag.HYBRID
    p.hybrid = float(hybrid.weight)
    return p


def _time_flags(recency: Any, with_times: bool, refresh_ttl: bool) -> int:
    """The flags of a read's time options; InvalidRequest for a recency that is not a Recency."""
    flags = 0
    if recency is not None:
        if not isinstance(recency, Recency):
            raise InvalidRequest(f"recency takes a kalos.Recency(half_life=..., weight=...), got {recency!r}")
        flags |= Flag.RECENCY | Flag.TIMES
    if with_times:
        flags |= Flag.TIMES
    if refresh_ttl:
        flags |= Flag.REFRESH
    return flags


def recall_group(preps: list[Prepared[Any]]) -> Prepared[list[Hits]]:
    """One multi-query recall carrying the rows of ``preps``, in order: recalls that may share a
    slot (one namespace, the same flags and filter: ``clients._coalesce``), asking for the largest
    k among them (each gets its own first k back: ``clients._coalesce.split``)."""
    first = preps[0]
    rows = []
    k = 0
    for p in preps:
        assert p.vectors is not None
        rows.append(p.vectors)
        k = max(k, p.k)
    q = np.concatenate(rows)
    return Prepared(Op.RECALL, first.ns, k, len(q), first.flags, vectors=q, blob=first.blob, decode=decode_hits_list)


def upsert(
    layout: Layout, ids: Any, vectors: Any, payloads: Any, namespace: str, payload_limit: int, ttl: Any = None
) -> list[Prepared[Written]]:
    """One request per chunk of rows (sent concurrently by the pool): every row, id, payload and
    TTL is checked here, before anything is sent. Chunks hold at most max_queries rows and as many
    payload bytes as a slot's blob area; duplicate ids keep their last row (the chunks of a call
    may be served in any order). ``ttl``: None (the namespace's default), seconds, math.inf
    (never), or one of those per row: rows of one TTL share chunks (``broker.clock.ttl_groups``)."""
    ns = validate_namespace(namespace)
    v = as_vectors(vectors, layout.dim, VectorsFor.UPSERT)
    n = len(v)
    idarr = as_ids(ids, n)
    lines = None if payloads is None else payload_lines(payloads, n)
    groups = ttl_groups(ttl, n)
    keep = last_wins(idarr)
    if keep is not None:
        v, idarr = v[keep], idarr[keep]
        if lines is not None:
            lines = [lines[i] for i in keep.tolist()]
        if len(groups) > 1:  # each kept row stays in its TTL's group
            slot_of = np.full(n, -1, np.intp)
            slot_of[keep] = np.arange(len(keep))
            groups = [(t, slot_of[rows][slot_of[rows] >= 0]) for t, rows in groups]
            groups = [(t, np.sort(rows)) for t, rows in groups if len(rows)]
        else:
            groups = [(groups[0][0], np.arange(len(idarr)))]
    out = []
    for code, rows in groups:
        gv, gid = v[rows], idarr[rows]
        glines = None if lines is None else [lines[i] for i in rows.tolist()]
        for lo, hi in pack(glines, len(gid), layout.max_queries, layout.blob_bytes, payload_limit):
            p = Prepared(Op.UPSERT, ns, nq=hi - lo, vectors=gv[lo:hi], ids=gid[lo:hi], decode=_decode_written)
            if glines is not None:
                p.blob = b"\n".join(glines[lo:hi])
            if code is not None:
                p.ttl_ns, p.flags = code, Flag.TTL
            out.append(p)
    return out


def touch(layout: Layout, ids: Any, namespace: str, ttl: Any = None) -> list[Prepared[Written]]:
    """Restart the expiry clock of ``ids`` (``ttl``: None, each row's own TTL; seconds, a new
    one; math.inf, never expire): one request per max_queries ids (duplicates dropped)."""
    ns = validate_namespace(namespace)
    code = None if ttl is None else ttl_ns(ttl)
    idarr = as_ids(ids)
    keep = last_wins(idarr)
    if keep is not None:
        idarr = idarr[keep]
    step = layout.max_queries
    out = []
    for lo in range(0, len(idarr), step):
        p = Prepared(Op.TOUCH, ns, nq=len(idarr[lo : lo + step]), ids=idarr[lo : lo + step], decode=_decode_written)
        if code is not None:
            p.ttl_ns, p.flags = code, Flag.TTL
        out.append(p)
    return out


def set_ttl(namespace: str, ttl: Any) -> Prepared[Written]:
    """The namespace's default TTL (seconds; None or math.inf: none)."""
    return Prepared(
        Op.SET_TTL, validate_namespace(namespace), ttl_ns=0 if ttl is None else ttl_ns(ttl), decode=_decode_written
    )


def delete(layout: Layout, ids: Any, namespace: str, where: Any = None) -> list[Prepared[Written]]:
    """By filter: one request. By ids: one request per max_queries ids (duplicates dropped)."""
    ns = validate_namespace(namespace)
    if (ids is None) == (where is None):
        raise InvalidRequest("delete takes ids or where=, one of them")
    if where is not None:
        return [
            Prepared(
                Op.DELETE, ns, flags=Flag.WHERE, blob=encode_where(where, layout.blob_bytes), decode=_decode_written
            )
        ]
    idarr = as_ids(ids)
    keep = last_wins(idarr)
    if keep is not None:
        idarr = idarr[keep]
    step = layout.max_queries
    return [
        Prepared(Op.DELETE, ns, nq=len(idarr[lo : lo + step]), ids=idarr[lo : lo + step], decode=_decode_written)
        for lo in range(0, len(idarr), step)
    ]


def get(
    layout: Layout, ids: Any, namespace: str, with_vectors: bool, refresh_ttl: bool = False
) -> list[Prepared[Records]]:
    """One request per slot-full of ids (answers come back in the slot's ids/queries areas, each
    record's timestamps at the start of the blob: Flag.TIMES); ``refresh_ttl``: the records
    found are touched."""
    ns = validate_namespace(namespace)
    idarr = as_ids(ids)
    step = layout.max_queries
    flags = Flag.TIMES | (Flag.REFRESH if refresh_ttl else 0)
    return [
        Prepared(
            Op.GET,
            ns,
            nq=len(idarr[lo : lo + step]),
            flags=flags,
            ids=idarr[lo : lo + step],
            with_vectors=with_vectors,
            decode=_records,
        )
        for lo in range(0, len(idarr), step)
    ]


def merge_records(asked: list[Prepared[Records]], parts: list[Records], dim: int) -> Records:
    """One :class:`Records` from the answers of :func:`get`'s chunks, in the order asked."""
    if len(parts) == 1:
        return parts[0]
    vecs = None
    if asked[0].with_vectors:
        vecs = np.concatenate([p.vectors for p in parts if p.vectors is not None])
    return Records(
        np.concatenate([p.ids for p in parts]),
        vecs,
        [x for p in parts for x in p.payloads],
        np.concatenate([p.missing for p in parts]),
        created_at=_joined([p.created_at for p in parts]),
        updated_at=_joined([p.updated_at for p in parts]),
        expires_at=_joined([p.expires_at for p in parts]),
        served_at_ns=max((p.served_at_ns or 0 for p in parts), default=0) or None,
    )


def _joined(arrays: list[np.ndarray | None]) -> np.ndarray | None:
    return None if any(a is None for a in arrays) else np.concatenate(arrays)  # type: ignore[arg-type]


def drop(namespace: str) -> Prepared[Written]:
    return Prepared(Op.DROP_NAMESPACE, validate_namespace(namespace), decode=_decode_written)


def export_page(layout: Layout, namespace: str, after: int, where: Any = None) -> Prepared[ExportPage]:
    p = Prepared(
        Op.EXPORT,
        validate_namespace(namespace),
        nq=layout.max_queries,
        ids=np.array([after], np.int64),
        decode=_decode_export,
    )
    if where is not None:
        p.blob = encode_where(where, layout.blob_bytes)
        p.flags = Flag.WHERE
    return p


def count(layout: Layout, namespace: str, where: Any = None) -> Prepared[int]:
    p = Prepared(Op.COUNT, validate_namespace(namespace), decode=_decode_count)
    if where is not None:
        p.blob = encode_where(where, layout.blob_bytes)
        p.flags = Flag.WHERE
    return p


def list_namespaces() -> Prepared[dict[str, int]]:
    return Prepared(Op.LIST_NAMESPACES, b"", decode=_decode_listing)


#: The payload field ``upsert_text`` keeps a record's text in (``Hit.text`` reads it back).
TEXT_FIELD: Final = "text"


def embed(layout: Layout, texts: Any, embed_dim: int, name: str) -> list[Prepared[np.ndarray]]:
    """Op.EMBED requests for ``texts`` (a sequence of str), in chunks of at most max_queries
    texts and a slot's blob area each (``broker.texts``). ConfigError when the sidecar ``name``
    serves no model (``embed_dim`` 0); InvalidRequest for a bad text, before anything is sent."""
    if not embed_dim:
        raise ConfigError(f"broker {name!r}: the sidecar serves no embedding model (start it with --embed DIR)")
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) or not texts:
        raise InvalidRequest("texts must be a non-empty sequence of str (one text: [text])")
    blobs = []
    for i, t in enumerate(texts):
        problem = text_problem(t)
        if problem is not None:
            raise InvalidRequest(f"text {i} {problem}")
        b = t.encode("utf-8") + b"\x00"
        if len(b) > layout.blob_bytes:
            raise InvalidRequest(f"text {i} takes {len(b)} bytes, a slot's blob area holds {layout.blob_bytes}")
        blobs.append(b)
    out: list[Prepared[np.ndarray]] = []
    start = 0
    while start < len(blobs):
        end, size = start, 0
        while end < len(blobs) and end - start < layout.max_queries and size + len(blobs[end]) <= layout.blob_bytes:
            size += len(blobs[end])
            end += 1
        out.append(Prepared(Op.EMBED, b"", nq=end - start, blob=b"".join(blobs[start:end]), decode=_decode_vectors))
        start = end
    return out


def _decode_vectors(v: SlotView, n: int, blob_len: int, p: Prepared[np.ndarray]) -> np.ndarray:
    if n != p.nq:
        raise ProtocolError(f"slot {v.index}: {n} vectors for {p.nq} texts")
    out: np.ndarray = v.queries[:n].copy()
    return out


def text_payloads(texts: Any, payloads: list[Any] | None) -> list[dict[str, Any]]:
    """The payloads ``upsert_text`` writes: each record's own (a dict, or None for none) with
    its text in :data:`TEXT_FIELD`. InvalidRequest for anything else, before anything is sent."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise InvalidRequest("texts must be a sequence of str")
    if payloads is not None and len(payloads) != len(texts):
        raise InvalidRequest(f"{len(payloads)} payloads for {len(texts)} texts")
    out = []
    for i, t in enumerate(texts):
        p = None if payloads is None else payloads[i]
        if p is None:
            out.append({TEXT_FIELD: t})
        elif isinstance(p, dict):
            if TEXT_FIELD in p and p[TEXT_FIELD] != t:
                raise InvalidRequest(
                    f"payload {i} has a {TEXT_FIELD!r} field other than its text: upsert_text keeps the text there"
                )
            out.append({**p, TEXT_FIELD: t})
        else:
            raise InvalidRequest(f"payload {i} is a {type(p).__name__}: upsert_text takes dict payloads (or None)")
    return out


def remaining(budget: float | None, t0_ns: int, now_ns: int) -> float | None:
    """What is left of a call's ``budget`` (seconds from ``t0_ns``; None: no limit) at ``now_ns``."""
    return None if budget is None else max(0.0, budget - (now_ns - t0_ns) / 1e9)


def rows_only(p: Prepared[Any]) -> bool:
    """Is the request its rows and header fields alone (a recall without a filter blob or a
    fleet position)? Such a request may be written and posted in one compiled call
    (``ClientSlot.post_rows``); any other goes through :func:`write` (a recency recall too: its
    parameters are slot fields)."""
    return p.op is Op.RECALL and not p.blob and p.after is None and p.recency is None


def hits_only(p: Prepared[Any]) -> bool:
    """Is the answer ids and scores alone (a recall without payloads)? Such an answer may be
    checked and decoded in one compiled call (``ClientSlot.read_hits``); any other, and every
    error status, goes through :func:`read` (one with timestamps too: its blob holds them)."""
    return p.op is Op.RECALL and not p.flags & _BLOB_ANSWER


#: Recall flags whose answer carries a blob (payload lines, HIT_META records).
_BLOB_ANSWER: Final = Flag.WITH_PAYLOAD | Flag.TIMES | Flag.RECENCY


def write(v: SlotView, p: Prepared[Any]) -> int:
    """Copy the request's arrays into the slot's data areas; returns blob_len."""
    if p.vectors is not None:
        v.queries[: p.nq] = p.vectors
    if p.ids is not None:
        v.ids[: len(p.ids)] = p.ids
    if p.blob:
        v.blob[: len(p.blob)] = np.frombuffer(p.blob, np.uint8)
    if p.after is not None:  # (the slot's header: before post() writes POSTED)
        v.ctl["after_xid"] = p.after.xid
        v.ctl["after_seq"] = p.after.seq
        v.ctl["after_until_ns"] = p.after_until_ns
    if p.ttl_ns is not None:
        v.ctl["ttl_ns"] = p.ttl_ns
    if p.recency is not None:
        v.ctl["half_life_s"] = p.recency.half_life
        v.ctl["recency_weight"] = p.recency.weight
    if p.hybrid is not None:
        v.ctl["hybrid_weight"] = p.hybrid
    return len(p.blob)


def read(v: SlotView, outcome: tuple[int, int, int], p: Prepared[R]) -> R:
    """Result of a consumed response whose (status, n_results, blob_len) is ``outcome``, as the
    request's own decoder makes it (Hits, list[Hits], Written, Records, ...). Raises the mapped
    error of an error status."""
    status, n, blob_len = outcome
    if status != Status.OK:
        p.status = status
        raise error_for_status(status, _blob(v, blob_len).decode(errors="replace"))
    return p.decode(v, n, blob_len, p)


def _recall_hits(v: SlotView, n: int, blob_len: int, p: Prepared[Any]) -> list[Hits]:
    """A recall's hits, one Hits per query row."""
    if n > p.k:  # (an untrusted word: never more hits than asked for, never beyond max_k)
        raise ProtocolError(f"slot {v.index}: {n} results per query for k={p.k}")
    if p.single and not p.flags:  # the common case, with the fewest calls
        return [Hits(v.result_ids[0, :n].copy(), v.result_scores[0, :n].copy())]
    ids = v.result_ids[: p.nq, :n].copy()
    scores = v.result_scores[: p.nq, :n].copy()
    payloads = None
    meta, start = None, 0
    if p.flags & Flag.TIMES:
        meta, start = _meta(v, p.nq * n, blob_len)
    if p.flags & Flag.WITH_PAYLOAD:
        flat = _json_lines(v, blob_len, start)
        if len(flat) != p.nq * n:
            raise ProtocolError(f"slot {v.index}: {len(flat)} payloads for {p.nq * n} hits")
        payloads = [flat[i * n : (i + 1) * n] for i in range(p.nq)]
    if meta is None:
        return [Hits(ids[i], scores[i], None if payloads is None else payloads[i]) for i in range(p.nq)]
    rec = p.flags & Flag.RECENCY
    served = int(v.ctl["now_ns"])
    return [
        Hits(
            ids[i],
            scores[i],
            None if payloads is None else payloads[i],
            recency=meta["recency"][i * n : (i + 1) * n].copy() if rec else None,
            created_at=seconds(meta["created_at_ns"][i * n : (i + 1) * n]),
            updated_at=seconds(meta["updated_at_ns"][i * n : (i + 1) * n]),
            expires_at=expiry_seconds(meta["expires_at_ns"][i * n : (i + 1) * n]),
            served_at_ns=served,
        )
        for i in range(p.nq)
    ]


def decode_hits(v: SlotView, n: int, blob_len: int, p: Prepared[Hits]) -> Hits:
    """``recall``: the one query's hits."""
    return _recall_hits(v, n, blob_len, p)[0]


def decode_hits_list(v: SlotView, n: int, blob_len: int, p: Prepared[list[Hits]]) -> list[Hits]:
    """``recall_many`` (and a coalesced group): one Hits per row."""
    return _recall_hits(v, n, blob_len, p)


#: A recall of one vector: its answer is one Hits.
ONE: Final[Shape[Hits]] = Shape(True, decode_hits)
#: A recall of several rows in one slot: its answer is one Hits per row.
ROWS: Final[Shape[list[Hits]]] = Shape(False, decode_hits_list)


def _decode_listing(v: SlotView, n: int, blob_len: int, p: Prepared[dict[str, int]]) -> dict[str, int]:
    listing = _json_lines(v, blob_len)
    if len(listing) != 1 or not isinstance(listing[0], dict):
        raise ProtocolError(f"slot {v.index}: namespace listing is not one JSON object")
    return listing[0]


#: An export page: (ids int64, vectors float32 as stored, payloads).
ExportPage = tuple[np.ndarray, np.ndarray, list[Any]]


def _decode_export(v: SlotView, n: int, blob_len: int, p: Prepared[ExportPage]) -> ExportPage:
    return v.ids[:n].copy(), v.queries[:n].copy(), _json_lines(v, blob_len) if n else []


def _decode_written(v: SlotView, n: int, blob_len: int, p: Prepared[Written]) -> Written:
    return Written(n, _position(v))


def _decode_count(v: SlotView, n: int, blob_len: int, p: Prepared[int]) -> int:
    return n


_WRITES = frozenset({Op.UPSERT, Op.DELETE, Op.DROP_NAMESPACE, Op.TOUCH, Op.SET_TTL})


def _position(v: SlotView) -> Position | None:
    """The position a write's answer carries (None: the sidecar has no change log)."""
    xid, seq = int(v.ctl["pos_xid"]), int(v.ctl["pos_seq"])
    if xid == 0 and seq == 0:
        return None
    try:
        return Position(xid, seq)
    except ValueError:
        raise ProtocolError(f"slot {v.index}: write position ({xid}, {seq}) out of range") from None


def _records(v: SlotView, n: int, blob_len: int, p: Prepared[Records]) -> Records:
    assert p.ids is not None
    if n > p.nq:
        raise ProtocolError(f"slot {v.index}: {n} records for {p.nq} ids asked")
    ids = v.ids[:n].copy()
    meta, start = _meta(v, n, blob_len) if p.flags & Flag.TIMES else (None, 0)
    payloads = _json_lines(v, blob_len, start) if n else []
    if len(payloads) != n:
        raise ProtocolError(f"slot {v.index}: {len(payloads)} payloads for {n} records")
    found = set(ids.tolist())
    if not found <= set(p.ids.tolist()):
        raise ProtocolError(f"slot {v.index}: the answer holds ids that were not asked for")
    missing = np.array([i for i in p.ids.tolist() if i not in found], np.int64)
    vectors = v.queries[:n].copy() if p.with_vectors else None
    if meta is None:
        return Records(ids, vectors, payloads, missing)
    return Records(
        ids,
        vectors,
        payloads,
        missing,
        seconds(meta["created_at_ns"]),
        seconds(meta["updated_at_ns"]),
        expiry_seconds(meta["expires_at_ns"]),
        int(v.ctl["now_ns"]),
    )


_META = hit_meta_dtype()


def _meta(v: SlotView, m: int, blob_len: int) -> tuple[np.ndarray, int]:
    """The ``m`` HIT_META records at the start of an answer's blob (a copy), and where the payload
    lines start; ProtocolError if the blob is too short to hold them."""
    size = m * HIT_META_BYTES
    if size > blob_len:
        raise ProtocolError(f"slot {v.index}: {blob_len} blob bytes cannot hold the timestamps of {m} records")
    return np.frombuffer(v.blob[:size].tobytes(), _META), size


def _blob(v: SlotView, n: int) -> bytes:
    return bytes(v.blob[:n].tobytes())


def _json_lines(v: SlotView, blob_len: int, start: int = 0) -> list[Any]:
    """The JSON values of a response blob from byte ``start``, one per line; ProtocolError if it
    is not JSON lines."""
    if blob_len <= start:
        return []
    try:
        return [json.loads(line) for line in _blob(v, blob_len)[start:].split(b"\n")]
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"slot {v.index}: response blob is not JSON lines: {e}") from None


_DECODERS: dict[Op, Decoder[Any]] = {
    Op.LIST_NAMESPACES: _decode_listing,
    Op.EXPORT: _decode_export,
    Op.GET: _records,
    Op.COUNT: _decode_count,
    **dict.fromkeys(_WRITES, _decode_written),
}
