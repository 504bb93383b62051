"""The GENERAL route: any batch, request by request. Every op is served here (writes, payloads,
several namespaces, listing, export) and every request a broken client wrote gets its own status.

Each request is parsed (:func:`~kalos.sidecar_cuda.batching.parse_request`); a rejected one is answered
at once with its status; the rest are grouped (:func:`~kalos.sidecar_cuda.batching.plan_batch`): writes
first in posting order (made durable, then applied), then one search per namespace, then the other
ops. An unexpected error in a group answers that group SERVER_ERROR (logged) and the rest of the
batch is served as usual. Answers are written through the :class:`~kalos.sidecar_cuda.answers.AnswerWriter`
and published by the caller once the whole batch is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial

import numpy as np

from ..broker.errors import InvalidRequest
from ..broker.layout import Flag, Op, SegmentView, Status
from ..broker.positions import ORIGIN
from ..broker.validation import WhereNode, decode_where, payload_problem
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
from .persist import Durable, StoreError
from .store import MemoryStore, Namespace
from .writes import Write, WriteOp, apply_write

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
            )
            p = parse_request(i, f, self.layout, self._backend_max_k)
            if isinstance(p, Rejection):
                self._answer(p, p.status, p.detail)
            else:
                reqs.append(p)
        plan = plan_batch(reqs)
        for segment in write_segments(plan.writes) if plan.writes else []:
            self._guarded(segment, partial(self._serve_writes, segment))
        for ns, group in plan.recalls.items():
            self._guarded(group, partial(self._serve_recalls, ns, group))
        filtered: dict[tuple[str, bytes], list[Request]] = {}
        for r in plan.others:
            if r.op == Op.RECALL:  # a filtered recall: grouped with those of the same filter
                filtered.setdefault((r.namespace, self._blob(r)), []).append(r)
            else:
                self._guarded([r], partial(self._serve_other, r))
        for (ns, blob), group in filtered.items():
            self._guarded(group, partial(self._serve_filtered, ns, blob, group))

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

    # ------------------------------------------------------------------ recalls
    def _serve_recalls(self, ns_name: str, group: list[Request]) -> None:
        ns = self.store.get(ns_name)
        if ns is None:
            for r in group:
                self._answer(r, Status.UNKNOWN_NAMESPACE, f"no namespace {ns_name!r}")
            return
        group, q, offs = self._gather_queries(group)
        if not group:
            return
        kmax = group[0].k if len(group) == 1 else max(r.k for r in group)
        try:
            ids, scores = ns.search(q, kmax)
        except Exception as e:  # backend failure: every caller gets a clean error status
            self._backend_failed(group, e)
            return
        self._answer_group(group, offs, ns, ids, scores)

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
        self, group: list[Request], offs: list[int], ns: Namespace, ids: np.ndarray, scores: np.ndarray
    ) -> None:
        """Each request's share of a group's hits (its rows, cut to its own k)."""
        kk = ids.shape[1]
        for r, o in zip(group, offs):
            kr = min(r.k, kk)
            self._answer_hits(r, ns, ids[o : o + r.nq, :kr], scores[o : o + r.nq, :kr])

    def _answer_hits(self, r: Request, ns: Namespace, hit_ids: np.ndarray, scores: np.ndarray) -> None:
        """A recall's OK answer: hits (nq, kr), and their payloads if asked for."""
        kr = hit_ids.shape[1]
        self.writer.hits(r.slot, hit_ids, scores)
        if r.flags & Flag.WITH_PAYLOAD:
            blob = b"\n".join(ns.payloads.get(i, b"null") for i in hit_ids.ravel().tolist())
            if len(blob) > self.layout.blob_bytes:
                self._answer(
                    r,
                    Status.PAYLOAD_TOO_LARGE,
                    f"payloads of the hits take {len(blob)} bytes, the slot holds "
                    f"{self.layout.blob_bytes}; lower k or raise --blob-bytes",
                )
                return
            self.writer.answer_blob(r.slot, r.generation, kr, blob)
            return
        self._answer(r, Status.OK, n_results=kr)

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

    def _serve_filtered(self, ns_name: str, blob: bytes, group: list[Request]) -> None:
        """Recalls of one namespace with the same filter (its bytes ``blob``): the filter is
        evaluated once (and kept until the namespace's next write), then one search over the
        rows it matches (exact; k clipped to the matches)."""
        try:
            node = decode_where(blob)
        except InvalidRequest as e:
            for r in group:
                self._answer(r, Status.BAD_REQUEST, f"filter: {e}")
            return
        ns = self.store.get(ns_name)
        if ns is None:
            for r in group:
                self._answer(r, Status.UNKNOWN_NAMESPACE, f"no namespace {ns_name!r}")
            return
        group, q, offs = self._gather_queries(group)
        if not group:
            return
        match = ns.filtered(node, blob)
        if len(match.rows) == 0:  # nothing matches: no search
            for r in group:
                self._answer(r, Status.OK, n_results=0)
            return
        try:
            ids, scores = ns.search_where(q, max(r.k for r in group), match)
        except Exception as e:
            self._backend_failed(group, e)
            return
        self._answer_group(group, offs, ns, ids, scores)

    # ------------------------------------------------------------------ writes
    def _decode_write(self, r: Request) -> Write | tuple[Status, str]:
        """Read and check an upsert/delete/drop from its slot (a broken client may have written it)."""
        sv = self.seg.slot[r.slot]
        if r.op == Op.DROP_NAMESPACE:
            return Write(WriteOp.DROP, r.namespace)
        if r.op == Op.DELETE and r.flags & Flag.WHERE:
            try:
                node = self._where(r)
            except InvalidRequest as e:
                return (Status.BAD_REQUEST, f"filter: {e}")
            assert node is not None
            # Resolved to ids by the durable store, once the memory is the state it applies to
            # (in a fleet: after the changes other nodes committed before it).
            return Write(WriteOp.DELETE_WHERE, r.namespace, where=node)
        ids = sv.ids[: r.nq].copy()
        if (ids < 0).any():
            return (Status.BAD_ID, "ids must be >= 0")
        if r.op == Op.DELETE:
            return Write(WriteOp.DELETE, r.namespace, ids=ids)
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
        return Write(WriteOp.UPSERT, r.namespace, ids=ids, vectors=vecs, payloads=payloads)

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
        positions = None
        if self.persist is not None:
            try:
                positions = self.persist.commit([w for _r, w in accepted], self.store)
            except StoreError as e:
                log.error("store commit failed: %s", e)
                for r, _w in accepted:
                    self._answer(r, Status.STORE_ERROR, str(e))
                return
        else:
            for _r, w in accepted:
                w.resolve(self.store)
        failed = False
        for j, (r, w) in enumerate(accepted):
            try:
                n = apply_write(self.store, w)
            except Exception as e:
                log.exception("applying a write failed")
                self._answer(r, Status.BACKEND_ERROR, f"{type(e).__name__}: {e}")
                failed = True
                continue
            # (before the status and state, like every part of an answer)
            self.writer.position(r.slot, positions[j] if positions else ORIGIN)
            self._answer(r, Status.OK, n_results=n)
        if self.persist is not None:
            # A write that failed to apply here is applied again from the change log (where
            # there is one): the store's cursor then stays before this batch.
            self.persist.applied_through(None if failed or not positions else positions[-1])

    # ------------------------------------------------------------------ the rest
    def _serve_other(self, r: Request) -> None:
        try:
            node = self._where(r)
        except InvalidRequest as e:
            self._answer(r, Status.BAD_REQUEST, f"filter: {e}")
            return
        if r.op == Op.LIST_NAMESPACES:
            blob = json.dumps(self.store.counts(), separators=(",", ":")).encode()
            if len(blob) > self.layout.blob_bytes:
                self._answer(r, Status.PAYLOAD_TOO_LARGE, "namespace list exceeds the slot")
                return
            self.writer.answer_blob(r.slot, r.generation, len(self.store.namespaces), blob)
        elif r.op == Op.EXPORT:
            ns = self.store.get(r.namespace)
            if ns is None:
                self._answer(r, Status.UNKNOWN_NAMESPACE, f"no namespace {r.namespace!r}")
                return
            ids, vecs, pls = ns.export_page(
                int(self.seg.slot[r.slot].ids[0]), r.nq, None if node is None else ns.filtered(node, self._blob(r)).mask
            )
            blob = b"\n".join(pls)
            while len(blob) > self.layout.blob_bytes and len(ids) > 1:  # fewer rows per page
                ids, vecs, pls = ids[: len(ids) // 2], vecs[: len(ids) // 2], pls[: len(ids) // 2]
                blob = b"\n".join(pls)
            if len(blob) > self.layout.blob_bytes:
                self._answer(r, Status.PAYLOAD_TOO_LARGE, "a payload exceeds the slot's blob area")
                return
            self.writer.rows(r.slot, ids, vecs)
            self.writer.answer_blob(r.slot, r.generation, len(ids), blob)
        elif r.op == Op.GET:
            self._serve_get(r)
        elif r.op == Op.COUNT:
            ns = self.store.get(r.namespace)
            if ns is None:
                self._answer(r, Status.UNKNOWN_NAMESPACE, f"no namespace {r.namespace!r}")
                return
            n = ns.n if node is None else len(ns.filtered(node, self._blob(r)).rows)
            self._answer(r, Status.OK, n_results=n)
        else:
            self._answer(r, Status.UNKNOWN_OP, f"op {int(r.op)} not served")

    def _serve_get(self, r: Request) -> None:
        """Records of the asked ids that exist, in the order asked, into the slot's ids and
        queries areas (the asked ids are read first: the answer overwrites them)."""
        ns = self.store.get(r.namespace)
        if ns is None:
            self._answer(r, Status.UNKNOWN_NAMESPACE, f"no namespace {r.namespace!r}")
            return
        asked = self.seg.slot[r.slot].ids[: r.nq].copy()
        if (asked < 0).any():
            self._answer(r, Status.BAD_ID, "ids must be >= 0")
            return
        ids, vecs, pls = ns.get(asked)
        blob = b"\n".join(pls)
        if len(blob) > self.layout.blob_bytes:
            self._answer(
                r,
                Status.PAYLOAD_TOO_LARGE,
                f"payloads of the records take {len(blob)} bytes, the slot holds "
                f"{self.layout.blob_bytes}; ask for fewer ids or raise --blob-bytes",
            )
            return
        self.writer.rows(r.slot, ids, vecs)
        self.writer.answer_blob(r.slot, r.generation, len(ids), blob)
