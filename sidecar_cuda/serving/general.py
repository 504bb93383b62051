"""The GENERAL route: any batch, request by request. Every op is served here (writes, payloads,
several namespaces, listing, export) and every request a broken client wrote gets its own status.

Each request is parsed (:func:`~kalos.sidecar_cuda.serving.batching.parse_request`); a rejected one is answered
at once with its status; the rest are grouped (:func:`~kalos.sidecar_cuda.serving.batching.plan_batch`): writes
first in posting order (made durable, then applied), then one search per namespace, then the other
ops. An unexpected error in a group answers that group SERVER_ERROR (logged) and the rest of the
batch is served as usual.

Time: one ``now`` (the store's clock, CLOCK_REALTIME ns) per batch decides expiry and ages for
every read and stamps every write of it; answers that ask for it (``_CLOCKED``) or write carry it
in ``now_ns``. Recalls are grouped by (namespace, filter, recency): one search each. Reads with
Flag.REFRESH touch what they answered, durably, once the batch's reads are written (a failed
touch turns their answers into STORE_ERROR before anything is published).

Answers are written through the :class:`~kalos.sidecar_cuda.serving.answers.AnswerWriter` and published
by the caller once the whole batch is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial

import numpy as np

from ...broker.errors import InvalidRequest
from ...broker.layout import Flag, Metric, Op, SegmentView, Status
from ...broker.lexical import decode_hybrid_blob
from ...broker.positions import ORIGIN
from ...broker.texts import TextError
from ...broker.validation import WhereNode, decode_where, payload_problem
from ..backends.base import Decay, prepare_queries
from ..storage.durable import Durable, StoreError, commit_and_apply
from ..storage.store import MemoryStore, Namespace
from ..storage.writes import Write, WriteOp
from .answers import AnswerWriter
from .batching import (
    Rejection,
    Request,
    SlotFields,
    pack_offsets,
    parse_request,
    plan_batch,
    write_segments,
)

#: Flags whose answers carry the sidecar's clock (``now_ns``).
_CLOCKED = int(Flag.TTL | Flag.TIMES | Flag.RECENCY | Flag.REFRESH)
#: Flags whose answers carry a HIT_META record per hit or record (RECENCY implies TIMES).
_TIMES = int(Flag.TIMES | Flag.RECENCY)
#: Ops whose every answer carries it.
_CLOCKED_OPS = frozenset({Op.UPSERT, Op.DELETE, Op.DROP_NAMESPACE, Op.TOUCH, Op.SET_TTL})

log = logging.getLogger("kalos.sidecar")


class GeneralRoute:
    """Serves batches request by request (see the module docstring).

    ``staging``: room for every query of a batch (only used while no batch is in flight);
    ``on_unexpected(what, error)``: logs and counts an error nothing expected."""

    def __init__(
        self,
        seg: SegmentView,
        writer: AnswerWriter,
        store: MemoryStore,
        persist: Durable | None,
        staging: np.ndarray,
        *,
        backend_max_k: int,
        payload_limit: int,
        on_unexpected: Callable[[str, BaseException], None],
    ) -> None:
        self.seg = seg
        self.layout = seg.layout
        self.writer = writer
        self.store = store
        self.persist = persist
        self._staging = staging
        self._backend_max_k = backend_max_k
        self._payload_limit = payload_limit
        self._on_unexpected = on_unexpected
        self._now = 0  # the batch's clock (CLOCK_REALTIME ns), read once per batch
        # Reads with Flag.REFRESH answered in this batch: (request, namespace, the ids answered).
        self._refresh: list[tuple[Request, str, np.ndarray]] = []

    def serve(self, taken: list[int], rec: np.ndarray) -> None:
        """Answer (not yet publish) the requests of slots ``taken``, whose control blocks were read
        into ``rec`` when they were taken."""
        reqs: list[Request] = []
        for i, r in zip(taken, rec):
            f = SlotFields(
                op=int(r["op"]),
                k=int(r["k"]),
                nq=int(r["nq"]),
                flags=int(r["flags"]),
                blob_len=int(r["blob_len"]),
                ns_len=int(r["ns_len"]),
                namespace=bytes(r["namespace"]),
                generation=int(r["generation"]),
                t_post_ns=int(r["t_post_ns"]),
                ttl_ns=int(r["ttl_ns"]),
                half_life_s=float(r["half_life_s"]),
                recency_weight=float(r["recency_weight"]),
                hybrid_weight=float(r["hybrid_weight"]),
            )
            p = parse_request(i, f, self.layout, self._backend_max_k)
            if isinstance(p, Rejection):
                self._answer(p, p.status, p.detail)
            else:
                reqs.append(p)
        self._now = now = self.store.clock()
        self._refresh = []
        for r in reqs:
            if r.flags & _CLOCKED or r.op in _CLOCKED_OPS:
                self.writer.now(r.slot, now)
        plan = plan_batch(reqs)
        for segment in write_segments(plan.writes) if plan.writes else []:
            self._guarded(segment, partial(self._serve_writes, segment))
        for ns, group in plan.recalls.items():
            self._guarded(group, partial(self._serve_recalls, ns, group))
        searched: dict[tuple[str, bytes | None, tuple[float, float] | None], list[Request]] = {}
        for r in plan.others:
            if r.op == Op.RECALL and r.hybrid is not None:
                self._guarded([r], partial(self._serve_hybrid, r))
            elif r.op == Op.RECALL:  # filtered or recency-weighted: grouped by both
                blob = self._blob(r) if r.flags & Flag.WHERE else None
                searched.setdefault((r.namespace, blob, r.recency), []).append(r)
            else:
                self._guarded([r], partial(self._serve_other, r))
        for (ns, blob, recency), group in searched.items():
            self._guarded(group, partial(self._serve_searched, ns, blob, recency, group))
        if self._refresh:
            self._guarded([r for r, _ns, _ids in self._refresh], self._serve_refresh)

    def _guarded(self, group: list[Request], serve: Callable[[], None]) -> None:
        """Serve a group of requests; an unexpected error answers the whole group SERVER_ERROR
        (logged) and the rest of the batch is served as usual."""
        try:
            serve()
        except Exception as e:
            self._on_unexpected(f"serving {len(group)} request(s) failed", e)
            for r in group:
                self._answer(
                    r,
                    Status.SERVER_ERROR,
                    f"the sidecar failed serving this request ({type(e).__name__}); it was logged",
                )

    def _answer(self, r: Request | Rejection, status: Status, detail: str = "", n_results: int = 0) -> None:
        self.writer.answer(r.slot, r.generation, status, detail, n_results)

    def _answer_empty(self, group: list[Request]) -> None:
        """Recalls of a namespace that does not exist: OK, no hits (the rule of LangGraph's store
        and mem0 for a user with no memories yet; docs/protocol.md)."""
        for r in group:
            self._answer(r, Status.OK, n_results=0)

    # ------------------------------------------------------------------ recalls
    def _serve_recalls(self, ns_name: str, group: list[Request]) -> None:
        ns = self.store.get(ns_name)
        if ns is None:  # never written (or dropped): no memories, as for an empty one
            self._answer_empty(group)
            return
        group, q, offs = self._gather_queries(group)
        if not group:
            return
        kmax = group[0].k if len(group) == 1 else max(r.k for r in group)
        try:
            ids, scores = ns.search(q, kmax, now=self._now)
        except Exception as e:  # backend failure: every caller gets a clean error status
            self._backend_failed(group, e)
            return
        self._answer_group(group, offs, ns, ids, scores, None)

    def _gather_queries(self, group: list[Request]) -> tuple[list[Request], np.ndarray, list[int]]:
        """The queries of a group of recalls as one matrix (read in place for a lone request),
        with each request's first row. A request whose queries are not all finite (a broken
        client wrote them) is answered NOT_FINITE and left out of the returned group."""
        if len(group) == 1:  # read the queries in place: no gather copy
            q = self.seg.slot[group[0].slot].queries[: group[0].nq]
            if np.isfinite(q).all():
                return group, q, [0]
            self._answer(group[0], Status.NOT_FINITE, "query contains NaN or infinity")
            return [], q[:0], [0]
        offs = pack_offsets([r.nq for r in group]).tolist()
        q = self._staging[: offs[-1]]
        for r, o in zip(group, offs):
            q[o : o + r.nq] = self.seg.slot[r.slot].queries[: r.nq]
        if np.isfinite(q).all():
            return group, q, offs
        good = []
        for r, o in zip(group, offs):
            if np.isfinite(q[o : o + r.nq]).all():
                good.append(r)
            else:
                self._answer(r, Status.NOT_FINITE, "query contains NaN or infinity")
        return self._gather_queries(good) if good else ([], q[:0], [0])

    def _backend_failed(self, group: list[Request], e: Exception) -> None:
        log.exception("backend search failed")
        for r in group:
            self._answer(r, Status.BACKEND_ERROR, f"{type(e).__name__}: {e}")

    def _answer_group(
        self,
        group: list[Request],
        offs: list[int],
        ns: Namespace,
        ids: np.ndarray,
        scores: np.ndarray,
        decay: Decay | None,
    ) -> None:
        """Each request's share of a group's hits (its rows, cut to its own k)."""
        kk = ids.shape[1]
        for r, o in zip(group, offs):
            kr = min(r.k, kk)
            self._answer_hits(r, ns, ids[o : o + r.nq, :kr], scores[o : o + r.nq, :kr], decay)

    def _answer_hits(
        self, r: Request, ns: Namespace, hit_ids: np.ndarray, scores: np.ndarray, decay: Decay | None = None
    ) -> None:
        """A recall's OK answer: hits (nq, kr), then (Flag.TIMES, RECENCY) a HIT_META record per
        hit and (WITH_PAYLOAD) their payload lines in the blob."""
        kr = hit_ids.shape[1]
        self.writer.hits(r.slot, hit_ids, scores)
        flat = hit_ids.ravel()
        if r.flags & Flag.REFRESH and len(flat):
            self._refresh.append((r, ns.name, flat.copy()))  # (an answer that fails below too)
        if r.flags & (Flag.WITH_PAYLOAD | _TIMES):
            blob = self._records_blob(r, ns, flat, decay)
            if not self._fits(r, blob, "payloads and timestamps of the hits take", "lower k or raise --blob-bytes"):
                return
            self.writer.answer_blob(r.slot, r.generation, kr, blob)
            return
        self._answer(r, Status.OK, n_results=kr)

    def _records_blob(
        self, r: Request, ns: Namespace, ids: np.ndarray, decay: Decay | None = None, rows: np.ndarray | None = None
    ) -> bytes:
        """The blob of an answer naming records ``ids`` (their ``rows`` when known): HIT_META
        records first with Flag.TIMES (docs/protocol.md), then payload lines with WITH_PAYLOAD (or
        always: ``payload_lines`` ops)."""
        parts = []
        if r.flags & _TIMES:
            meta = ns.meta(ids, self._now, decay) if rows is None else ns.meta_rows(rows, self._now, decay)
            parts.append(meta.tobytes())
        if r.flags & Flag.WITH_PAYLOAD or r.op in (Op.GET, Op.EXPORT):
            parts.append(b"\n".join(ns.payloads.get(i, b"null") for i in ids.tolist()))
        return b"".join(parts)

    # ------------------------------------------------------------------ filters
    def _blob(self, r: Request) -> bytes:
        blob_len = int(self.seg.slots["blob_len"][r.slot])  # (parse_request checked its bound)
        blob: bytes = self.seg.slot[r.slot].blob[:blob_len].tobytes()
        return blob

    def _where(self, r: Request) -> WhereNode | None:
        """The parsed filter of a request that carries one (Flag.WHERE), else None. A filter a
        client wrote is untrusted: anything malformed raises InvalidRequest (BAD_REQUEST)."""
        if not r.flags & Flag.WHERE:
            return None
        return decode_where(self._blob(r))

    def _serve_searched(
        self, ns_name: str, blob: bytes | None, recency: tuple[float, float] | None, group: list[Request]
    ) -> None:
        """Recalls of one namespace with the same filter (its bytes ``blob``, None: none) and the
        same recency (``(half_life_s, weight)``, None: none): the filter is evaluated once (and
        kept until the namespace's next write), then one search over the rows it matches
        (exact; k clipped to the matches), ranked with the recency part if asked."""
        node: WhereNode | None = None
        if blob is not None:
            try:
                node = decode_where(blob)
            except InvalidRequest as e:
                for r in group:
                    self._answer(r, Status.BAD_REQUEST, f"filter: {e}")
                return
        ns = self.store.get(ns_name)
        if ns is None:  # never written (or dropped): no memories, as for an empty one
            self._answer_empty(group)
            return
        group, q, offs = self._gather_queries(group)
        if not group:
            return
        decay = None if recency is None else Decay(self._now, recency[0], recency[1])
        k = max(r.k for r in group)
        try:
            match = None
            if node is not None:
                assert blob is not None  # (a parsed filter comes with its bytes)
                match = ns.filtered(node, blob)
            if match is not None and len(match.rows) == 0:  # nothing matches: no search
                for r in group:
                    self._answer(r, Status.OK, n_results=0)
                return
            ids, scores = ns.search(q, k, match=match, decay=decay, now=self._now)
        except Exception as e:
            self._backend_failed(group, e)
            return
        self._answer_group(group, offs, ns, ids, scores, decay)

    def _serve_hybrid(self, r: Request) -> None:
        """A hybrid recall (Flag.HYBRID; broker/lexical.py): every row its filter and expiry admit,
        ranked by ``similarity + weight * max(bm25, 0) / max_bm25``, exactly: the rows with a
        positive BM25 are scored one by one (their stored vectors), and the dense top k of the
        admitted rows comes from the search a dense recall makes. Every other row scores its
        similarity alone, at most the k-th of that top k, whose fused scores are no lower."""
        assert r.hybrid is not None
        try:
            text, where = decode_hybrid_blob(self._blob(r))
            if where and not r.flags & Flag.WHERE:
                raise InvalidRequest("bytes after the query text without a filter (Flag.WHERE)")
            node = decode_where(where) if r.flags & Flag.WHERE else None
        except (TextError, InvalidRequest) as e:
            self._answer(r, Status.BAD_REQUEST, f"hybrid: {e}")
            return
        ns = self.store.get(r.namespace)
        if ns is None:
            self._answer_empty([r])
            return
        group, q, _offs = self._gather_queries([r])
        if not group:
            return
        now = self._now
        match = None if node is None else ns.filtered(node, where)
        rows, lex = ns.lexical(now).scores(text)
        keep = lex > 0
        if match is not None:
            keep &= match.mask[rows]
        live = ns.live(now)
        if live is not None:
            keep &= ~live.dead[rows]
        rows, lex = rows[keep], lex[keep]
        try:
            sim = dense_scores(ns.matrix.read_rows(rows) if len(rows) else np.empty((0, ns.dim)), q[0], ns.metric)
            d_ids, d_scores = ns.search(q, r.k, match=match, now=now)
        except Exception as e:
            self._backend_failed([r], e)
            return
        top = float(lex.max()) if len(lex) else 0.0
        fused = sim + (r.hybrid * lex / top if top > 0 else 0.0)
        s_ids = ns.row_ids[rows]
        # The dense top k's rows that are not among ``rows`` (ascending): theirs are fused above.
        d_rows = np.array([ns.id_row[i] for i in d_ids[0].tolist()], np.int64)
        at = np.minimum(np.searchsorted(rows, d_rows), max(len(rows) - 1, 0))
        dense_only = ~(rows[at] == d_rows) if len(rows) else np.ones(len(d_rows), bool)
        ids = np.concatenate([s_ids, d_ids[0][dense_only]])
        scores = np.concatenate([fused, d_scores[0][dense_only].astype(np.float64)])
        near = np.arange(len(scores))
        if len(scores) > r.k:  # the k best (and any tied with the k-th) in linear time, then sorted
            near = np.flatnonzero(scores >= np.partition(scores, len(scores) - r.k)[len(scores) - r.k])
        best = near[np.lexsort((ids[near], -scores[near]))][: r.k]  # (ties: the smaller id first)
        self._answer_hits(r, ns, ids[best][None, :], scores[best].astype(np.float32)[None, :])

    # ------------------------------------------------------------------ writes
    def _decode_write(self, r: Request) -> Write | tuple[Status, str]:
        """Read and check an upsert/delete/drop from its slot (a broken client may have written it)."""
        sv = self.seg.slot[r.slot]
        now = self._now
        if r.op == Op.DROP_NAMESPACE:
            return Write(WriteOp.DROP, r.namespace, now_ns=now)
        if r.op == Op.SET_TTL:
            return Write(WriteOp.SET_TTL, r.namespace, now_ns=now, ttl_ns=r.ttl_ns)
        if r.op == Op.DELETE and r.flags & Flag.WHERE:
            try:
                node = self._where(r)
            except InvalidRequest as e:
                return (Status.BAD_REQUEST, f"filter: {e}")
            assert node is not None
            # Resolved to ids by the durable store, once the memory is the state it applies to
            # (in a fleet: after the changes other nodes committed before it).
            return Write(WriteOp.DELETE_WHERE, r.namespace, where=node, now_ns=now)
        ids = sv.ids[: r.nq].copy()
        if (ids < 0).any():
            return (Status.BAD_ID, "ids must be >= 0")
        if r.op == Op.DELETE:
            return Write(WriteOp.DELETE, r.namespace, ids=ids, now_ns=now)
        if r.op == Op.TOUCH:
            return Write(WriteOp.TOUCH, r.namespace, ids=ids, now_ns=now, ttl_ns=r.ttl_ns)
        vecs = sv.queries[: r.nq].copy()
        if not np.isfinite(vecs).all():
            return (Status.NOT_FINITE, "vectors contain NaN or infinity")
        payloads: list[bytes | None] | None = None
        blob_len = int(self.seg.slots["blob_len"][r.slot])
        if blob_len:
            lines = sv.blob[:blob_len].tobytes().split(b"\n")
            if len(lines) != r.nq:
                return (Status.BAD_REQUEST, f"{len(lines)} payload lines for {r.nq} vectors")
            payloads = []
            for line in lines:
                if len(line) > self._payload_limit:
                    return (
                        Status.PAYLOAD_TOO_LARGE,
                        f"a payload of {len(line)} bytes exceeds the limit of {self._payload_limit}",
                    )
                problem = payload_problem(line)
                if problem is not None:
                    return (Status.BAD_REQUEST, problem)
                payloads.append(None if line == b"null" else line)
        return Write(WriteOp.UPSERT, r.namespace, ids=ids, vectors=vecs, payloads=payloads, now_ns=now, ttl_ns=r.ttl_ns)

    def _serve_writes(self, writes: list[Request]) -> None:
        accepted: list[tuple[Request, Write]] = []
        for r in writes:
            w = self._decode_write(r)
            if isinstance(w, tuple):
                self._answer(r, *w)
            else:
                accepted.append((r, w))
        if not accepted:
            return
        # Capacity first, so nothing can fail in memory once the writes are durable.
        need: dict[str, int] = {}
        for _r, w in accepted:
            if w.op is WriteOp.UPSERT:
                assert w.ids is not None
                need[w.namespace] = need.get(w.namespace, 0) + len(w.ids)
        try:
            for name, extra in need.items():
                ns = self.store.get_or_create(name)
                ns.ensure_capacity(ns.n + extra)
        except Exception as e:
            log.exception("growing capacity failed")
            for r, _w in accepted:
                self._answer(r, Status.CAPACITY, f"{type(e).__name__}: {e}")
            return
        try:
            positions, outcomes = commit_and_apply(self.persist, self.store, [w for _r, w in accepted])
        except StoreError as e:
            log.error("store commit failed: %s", e)
            for r, _w in accepted:
                self._answer(r, Status.STORE_ERROR, str(e))
            return
        for j, ((r, _w), n) in enumerate(zip(accepted, outcomes)):
            if isinstance(n, Exception):
                log.error("applying a write failed", exc_info=n)
                self._answer(r, Status.BACKEND_ERROR, f"{type(n).__name__}: {n}")
                continue
            # (before the status and state, like every part of an answer)
            self.writer.position(r.slot, positions[j] if positions else ORIGIN)
            self._answer(r, Status.OK, n_results=n)

    def _serve_refresh(self) -> None:
        """Touch what the batch's reads with Flag.REFRESH answered (one touch per namespace),
        durably, before their answers are published; if it cannot be made durable those reads
        are answered STORE_ERROR instead (their caller asked for the refresh)."""
        by_ns: dict[str, list[np.ndarray]] = {}
        for _r, name, ids in self._refresh:
            by_ns.setdefault(name, []).append(ids)
        writes = [
            Write(WriteOp.TOUCH, name, ids=np.unique(np.concatenate(parts)), now_ns=self._now)
            for name, parts in by_ns.items()
        ]
        try:
            _positions, outcomes = commit_and_apply(self.persist, self.store, writes)
        except StoreError as e:
            log.error("store commit of a refresh failed: %s", e)
            for r, _name, _ids in self._refresh:
                self._answer(r, Status.STORE_ERROR, f"the refresh of the records answered failed: {e}")
            return
        for n in outcomes:
            if isinstance(n, Exception):
                log.error("applying a refresh failed", exc_info=n)

    # ------------------------------------------------------------------ the rest
    def _serve_other(self, r: Request) -> None:
        try:
            node = self._where(r)
        except InvalidRequest as e:
            self._answer(r, Status.BAD_REQUEST, f"filter: {e}")
            return
        if r.op == Op.LIST_NAMESPACES:
            blob = json.dumps(self.store.counts(self._now), separators=(",", ":")).encode()
            if not self._fits(r, blob, "the namespace list takes", "raise --blob-bytes"):
                return
            self.writer.answer_blob(r.slot, r.generation, len(self.store.namespaces), blob)
        elif r.op == Op.EXPORT:
            ns = self.store.get(r.namespace)
            if ns is None:  # no records: the end of an export
                self.writer.answer_blob(r.slot, r.generation, 0, b"")
                return
            ids, vecs, _pls, rows = ns.export_rows(
                int(self.seg.slot[r.slot].ids[0]),
                r.nq,
                None if node is None else ns.filtered(node, self._blob(r)).mask,
                self._now,
            )
            blob = self._records_blob(r, ns, ids, rows=rows)
            while len(blob) > self.layout.blob_bytes and len(ids) > 1:  # fewer rows per page
                half = len(ids) // 2
                ids, vecs, rows = ids[:half], vecs[:half], rows[:half]
                blob = self._records_blob(r, ns, ids, rows=rows)
            if not self._fits(r, blob, "a record's payload takes", "raise --blob-bytes"):
                return
            self.writer.rows(r.slot, ids, vecs)
            self.writer.answer_blob(r.slot, r.generation, len(ids), blob)
        elif r.op == Op.GET:
            self._serve_get(r)
        elif r.op == Op.COUNT:
            ns = self.store.get(r.namespace)
            if ns is None:
                self._answer(r, Status.OK, n_results=0)
                return
            live = ns.live(self._now)
            if node is None:
                n = ns.n if live is None else len(live.rows)
            else:
                rows = ns.filtered(node, self._blob(r)).rows
                n = len(rows) if live is None else int((~live.dead[rows]).sum())
            self._answer(r, Status.OK, n_results=n)
        else:
            self._answer(r, Status.UNKNOWN_OP, f"op {int(r.op)} not served")

    def _serve_get(self, r: Request) -> None:
        """Records of the asked ids that exist, in the order asked, into the slot's ids and
        queries areas (the asked ids are read first: the answer overwrites them)."""
        asked = self.seg.slot[r.slot].ids[: r.nq].copy()
        if (asked < 0).any():
            self._answer(r, Status.BAD_ID, "ids must be >= 0")
            return
        ns = self.store.get(r.namespace)
        if ns is None:  # none of the ids exists
            self.writer.answer_blob(r.slot, r.generation, 0, b"")
            return
        ids, vecs, _pls, rows = ns.get_rows(asked, self._now)
        blob = self._records_blob(r, ns, ids, rows=rows)
        if r.flags & Flag.REFRESH and len(ids):
            self._refresh.append((r, ns.name, ids))
        if not self._fits(r, blob, "payloads of the records take", "ask for fewer ids or raise --blob-bytes"):
            return
        self.writer.rows(r.slot, ids, vecs)
        self.writer.answer_blob(r.slot, r.generation, len(ids), blob)

    def _fits(self, r: Request, blob: bytes, what: str, fix: str) -> bool:
        """Whether an answer's ``blob`` fits the slot's blob area; if not, the request is answered
        PAYLOAD_TOO_LARGE: ``what`` (ending in its verb) so many bytes against the area, and ``fix``."""
        if len(blob) <= self.layout.blob_bytes:
            return True
        self._answer(
            r,
            Status.PAYLOAD_TOO_LARGE,
            f"{what} {len(blob)} bytes, the slot holds {self.layout.blob_bytes}; {fix}",
        )
        return False


def dense_scores(vectors: np.ndarray, query: np.ndarray, metric: Metric) -> np.ndarray:
    """Scores of stored rows ``vectors`` for one query, in float32 as the backends compute them,
    returned as float64: dot product (dot; cosine: the rows are unit, the query is made unit), or
    minus the squared L2 distance (l2)."""
    q = prepare_queries(np.asarray(query, np.float32)[None, :], metric)[0]
    v = np.asarray(vectors, np.float32)
    if metric == Metric.L2:
        out: np.ndarray = -((v - q) ** 2).sum(axis=1)
    else:
        out = v @ q
    return out.astype(np.float64)
