"""From posted slots to answers: one pass of the serving loop (:meth:`Pipeline.serve_pending`).

A pass answers the oldest batch in flight if it has finished, takes every posted slot as one
batch once the launch policy says it leaves (:mod:`kalos.sidecar_cuda.serving.launch`, ``--launch``),
lets :func:`~kalos.sidecar_cuda.serving.batching.classify` pick its route, and runs it:

* SINGLE: searched in place and answered at once;
* UNIFORM: one search of the gathered queries, started on the backend; a pipelined batch is left
  in flight while the loop goes on (the callers answered by the batch before it re-post and are
  started as the next batch, queued right behind it), any other is answered at once (a batch of
  filtered recalls that all carry the same filter is UNIFORM too: searched over its rows at once);
* GENERAL: what is in flight is answered first (so a write never moves rows under a search, and
  answers leave in order), then the batch is served request by request (:mod:`kalos.sidecar_cuda.serving.general`).

At most :data:`PIPELINE_DEPTH` batches are in flight. Answers go through the
:class:`~kalos.sidecar_cuda.serving.answers.AnswerWriter`. The byte work (finding and taking the posted
slots, the snapshot of their control blocks, gathering their queries, writing and publishing
answers) is the :class:`~kalos.sidecar_cuda.serving.slotio.SlotIO`'s, compiled or not; every decision is
made here and in :mod:`~kalos.sidecar_cuda.serving.batching`, on either path.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...broker.layout import S_BUSY, Flag, Op, SegmentView, SlotWords, Status, slot_dtype, slot_field_offset
from ...broker.names import decode_namespace
from ..backends.base import PendingSearch
from ..storage.store import MemoryStore, Namespace
from .answers import AnswerWriter
from .batching import (
    Blobs,
    Limits,
    Plan,
    Route,
    SlotRef,
    classify,
    pipelined,
    query_rows,
)
from .embeds import EmbedRoute
from .general import GeneralRoute
from .launch import LaunchPolicy, Returning
from .slotio import SlotIO
from .stats import BatchRecord, SidecarStats
from .waits import HeldReads

log = logging.getLogger("kalos.sidecar")
_RECALL = int(Op.RECALL)
_EMBED = int(Op.EMBED)
_WHERE = int(Flag.WHERE)

PIPELINE_DEPTH = 2  # uniform recall batches in flight at most (a backend holds two searches)
# A batch in flight this long: wait for it in result(), where the backend's timeout applies (a
# hung device then becomes BACKEND_ERROR answers instead of a loop polling forever).
_BLOCK_AFTER_NS = 500_000_000


@dataclass(slots=True)
class InFlight:
    """A uniform recall batch started on the backend, not yet answered."""

    sel: np.ndarray  # its slots
    rec: np.ndarray  # their control blocks as read when the batch was taken
    taken: list[int]
    t_pick: int  # CLOCK_MONOTONIC when taken
    t0: int  # perf_counter_ns when started
    staging: int  # which staging buffer holds its queries
    pending: PendingSearch
    work: int  # rows x queries x dim
    rows: tuple[np.ndarray, np.ndarray] | None = None  # (slot, row) per query; None: row 0 of each
    t_start: int = 0  # CLOCK_MONOTONIC when handed to the backend
    route: Route = Route.UNIFORM  # MIXED: hits padded with id -1 past a namespace's rows


@dataclass(slots=True)
class Taken:
    """A recall batch taken and gathered, about to be started (UNIFORM or MIXED)."""

    sel: np.ndarray  # its slots
    rec: np.ndarray  # their control blocks as read when taken
    taken: list[int]
    t_pick: int  # CLOCK_MONOTONIC when taken
    t0: int  # perf_counter_ns when started
    staging: int  # which staging buffer holds its queries
    q: np.ndarray  # the queries, in that buffer
    rows: tuple[np.ndarray, np.ndarray] | None  # (slot, row) per query; None: row 0 of each

    def started(self, pending: PendingSearch, work: int, t_start: int, route: Route) -> InFlight:
        """This batch, handed to the backend at ``t_start`` as ``pending``."""
        return InFlight(
            self.sel, self.rec, self.taken, self.t_pick, self.t0, self.staging, pending, work, self.rows, t_start, route
        )


class Pipeline:
    """Serves the posted slots of one segment (see the module docstring).

    ``io``: the slot path's byte work (the same object the writer answers through); ``mem``: the
    mapped segment (namespace bytes are read from it); ``stagings``: :data:`PIPELINE_DEPTH` buffers
    for gathered queries (pinned on CUDA); ``launch``: decides when the next batch leaves
    (:mod:`kalos.sidecar_cuda.serving.launch`, ``--launch``);
    ``on_unexpected(what, error)``: logs and counts an error nothing expected."""

    def __init__(
        self,
        seg: SegmentView,
        words: SlotWords,
        mem: mmap.mmap,
        io: SlotIO,
        writer: AnswerWriter,
        general: GeneralRoute,
        store: MemoryStore,
        stats: SidecarStats,
        stagings: list[np.ndarray],
        limits: Limits,
        *,
        launch: LaunchPolicy,
        batches_word: int,
        on_unexpected: Callable[[str, BaseException], None],
        hold: HeldReads,
        embeds: EmbedRoute,
    ) -> None:
        self.seg = seg
        self.embeds = embeds  # text requests (Op.EMBED), taken out of a batch before it is classified
        self._words = words
        self._io = io
        self.writer = writer
        self.general = general
        self.store = store
        self.stats = stats
        self._stagings = stagings
        self.limits = limits
        self.launch = launch
        self._batches_word = batches_word
        self._on_unexpected = on_unexpected
        self.hold = hold  # reads waiting for a fleet position (after=)
        self._posted = np.empty(seg.layout.n_slots, np.intp)  # scan's output, reused by every pass
        self._rec_dtype = slot_dtype()
        self._ns_names: dict[tuple[bytes, int], str] = {}
        self._lookup = self._namespace  # (bound once: the SINGLE route runs per request)
        # Per slot, made once: its request read in place, and its first query row.
        L = seg.layout
        self._refs = [
            SlotRef(words, mem, i, slot_field_offset(L, i, "namespace"), L.data_base(i) + L.blob_offset, L.blob_bytes)
            for i in range(L.n_slots)
        ]
        self._query1 = [sv.queries[:1] for sv in seg.slot]
        self.inflight: deque[InFlight] = deque()
        self.returning = Returning(L.n_slots)  # callers answered, not yet back

    # ------------------------------------------------------------------ one pass
    def serve_pending(self) -> int:
        """Answer a finished batch in flight, if any, and take every posted slot as a new batch:
        a uniform recall batch is started and maybe left in flight, anything else is served now.
        Returns the number of requests answered."""
        inflight = self.inflight
        served = 0
        if inflight and (inflight[0].pending.done() or time.monotonic_ns() - inflight[0].t_pick > _BLOCK_AFTER_NS):
            served += self.finish_uniform(inflight.popleft())
        if len(inflight) >= PIPELINE_DEPTH:
            return served
        n_posted = self._io.scan(self._posted)
        ready: list[int] = []
        if self.hold.held:
            ready, expired = self.hold.release()
            served += expired
        if n_posted == 0 and not ready:
            return served
        taken, t_pick = self._take(n_posted) if n_posted else ([], 0)
        if taken:
            taken = self.hold.admit(taken, t_pick)
        if ready:  # held reads whose position is applied now join this batch
            taken = ready + taken
            t_pick = t_pick or time.monotonic_ns()
        if not taken:
            return served
        plan: Plan[Namespace] | None = None
        if not inflight and len(taken) == 1:
            i = taken[0]
            q = self._query1[i]
            plan = classify(self._refs[i], q, self._lookup, self.limits)
            if plan.route is Route.SINGLE:
                return served + self._serve_single(i, t_pick, plan, q)
            if self._words.u32[self._words.nq[i]] != 1:
                plan = None  # several rows (recall_many): the batch route may still take it
        # Every other route starts from the control blocks, read once: the slots are marked BUSY
        # and their blocks copied out (what the clients wrote, read once) in one call.
        sel = np.asarray(taken, np.intp)
        rec = np.empty(len(sel), self._rec_dtype)
        self._io.snapshot(sel, t_pick, rec)
        self.launch.turnarounds(rec["t_post_ns"], rec["t_done_ns"])
        t0 = time.perf_counter_ns()
        texts = rec["op"] == _EMBED
        if texts.any():  # every text request of the pass: one forward pass, answered at once
            served += self._serve_embeds(sel[texts], rec[texts], t_pick, t0)
            if texts.all():
                return served
            keep = ~texts
            sel, rec = sel[keep], rec[keep]
            taken = sel.tolist()
            plan = None
            t0 = time.perf_counter_ns()
        if plan is None:
            # Gather the first query of each request into a staging buffer no batch in flight uses
            # (pinned: the CUDA backend copies it to the device from there). Requests of several
            # rows each (recall_many, coalescing clients): every row, in order.
            st = 1 - inflight[0].staging if inflight else 0
            rows = None  # (only plain recalls can take the uniform route: gather their rows)
            if (rec["op"] == _RECALL).all() and not (rec["flags"] & ~np.uint32(_WHERE)).any():
                rows = query_rows(sel, rec["nq"], self.limits.max_queries)
            if rows is None:
                q = self._stagings[st][: len(sel)]
                self._io.gather(sel, None, q)
            else:
                q = self._stagings[st][: len(rows[0])]
                self._io.gather(rows[0], rows[1], q)
            plan = classify(rec, q, self._lookup, self.limits, Blobs(self.seg.all_blobs, sel))
            if plan.route is Route.MIXED:
                batch = self._start_mixed(plan, Taken(sel, rec, taken, t_pick, t0, st, q, rows))
                if batch is not None:
                    inflight.append(batch)
                    if not batch.work or not pipelined(batch.work, self.limits.min_work):
                        served += self.finish_inflight()
                    return served
                plan = Plan(Route.GENERAL, "a namespace field is invalid, or the backend refused the search")
            if plan.route is Route.UNIFORM:
                if plan.where is not None:  # searched synchronously: answer the batch in flight first
                    served += self.finish_inflight()
                batch = self._start_uniform(plan, Taken(sel, rec, taken, t_pick, t0, st, q, rows))
                if batch is not None:
                    inflight.append(batch)
                    if not plan.pipelined:  # answer it now
                        served += self.finish_inflight()
                    return served
                plan = Plan(Route.GENERAL, "the backend refused the search")
        served += self.finish_inflight()
        return served + self._serve_general(sel, taken, rec, t_pick, t0, plan.reason)

    def _take(self, n_posted: int) -> tuple[list[int], int]:
        """Of the ``n_posted`` slots the last scan found posted (in ``_posted``), those whose
        request semaphore could be taken (the try-wait is the fence before reading the request),
        and when they were taken; none while the launch policy holds them back."""
        n = self._when(n_posted)
        if n is None:
            return [], 0
        t_pick = time.monotonic_ns()
        # Slots between writing POSTED and posting req are not taken: the next scan brings them.
        n = self._io.take(self._posted, n)
        taken: list[int] = self._posted[:n].tolist()
        self.returning.back(taken)
        return taken, t_pick

    def _when(self, n_posted: int) -> int | None:
        """Ask the launch policy whether the ``n_posted`` posted slots leave now: how many are
        posted then (scanned into ``_posted``), or None to hold them back. With a batch in
        flight the loop asks again on its next pass (answering that batch meanwhile); with none
        this polls the slots, yielding the CPU to the callers turning around, until the policy
        says go (its waits are bounded)."""
        launch = self.launch
        while True:
            now = time.monotonic_ns()
            returning, answered_ns = self.returning.count(self._posted[:n_posted], now, launch)
            flights = [(len(b.taken), b.t_start) for b in self.inflight] if self.inflight else ()
            if launch.decide(now, n_posted, returning, answered_ns, flights).launch:
                return n_posted
            if flights:
                return None
            os.sched_yield()
            n_posted = self._io.scan(self._posted)

    def _namespace(self, key: tuple[bytes, int]) -> Namespace | None:
        """The namespace named by a slot's (raw bytes, length), decoded once per distinct key;
        None if the bytes are not a valid name or the namespace does not exist."""
        name = self._ns_names.get(key)
        if name is None:
            name = decode_namespace(*key)
            if name is None:
                return None
            if len(self._ns_names) < 4096:
                self._ns_names[key] = name
        return self.store.get(name)

    # ------------------------------------------------------------------ SINGLE
    def _serve_single(self, i: int, t_pick: int, plan: Plan[Namespace], q: np.ndarray) -> int:
        """One plain recall: every field read and written through word views and the query
        searched in place, so it costs a handful of numpy calls."""
        W = self._words
        u32, u64 = W.u32, W.u64
        ns = plan.namespace
        assert ns is not None
        u32[W.state[i]] = S_BUSY
        u64[W.t_pick_ns[i]] = t_pick
        self.launch.turnaround(int(u64[W.t_post_ns[i]]), int(u64[W.t_done_ns[i]]))
        t0 = time.perf_counter_ns()
        try:
            # (a filter: its rows, cached until the next write, then one search of them)
            match = None if plan.where is None else ns.filtered_bytes(plan.where)
            ids, scores = ns.search(q, plan.k, match=match)
        except Exception as e:  # the general route searches again and reports it (a bad filter too)
            sel = np.asarray([i], np.intp)
            rec = self.seg.slots[sel]
            return self._serve_general(sel, [i], rec, t_pick, t0, f"search failed ({type(e).__name__})")
        t1 = time.perf_counter_ns()
        self.launch.device_done(1, t_pick, time.monotonic_ns())
        t_done = self.writer.answer_single(i, ids, scores)
        self.launch.answered(1, t1 - t0, t_done)
        self.returning.answered_one(i, t_done)
        self.stats.record_batch(BatchRecord(1, t1 - t0, t_pick, (u64[W.t_post_ns[i]],), t_done), "single")
        u64[self._batches_word] = self.stats.batches
        return 1

    # ------------------------------------------------------------------ UNIFORM
    def _start_uniform(self, plan: Plan[Namespace], b: Taken) -> InFlight | None:
        """Start the batch's search; None if the backend refused it (the general route then
        searches again and reports per request)."""
        ns = plan.namespace
        assert ns is not None
        t_start = time.monotonic_ns()  # (before: a filtered batch is searched right here)
        try:
            # (the same filter for all: evaluated once, cached until a write, and searched now)
            match = None if plan.where is None else ns.filtered_bytes(plan.where)
            pending = ns.search_start(b.q, plan.k, match=match)
        except Exception:  # (a malformed filter too: the general route answers BAD_REQUEST)
            return None
        self.launch.launched(len(b.taken), b.t_pick, t_start, plan.pipelined)
        return b.started(pending, ns.n * len(b.q) * self.limits.dim, t_start, Route.UNIFORM)

    # ------------------------------------------------------------------ MIXED
    def _start_mixed(self, plan: Plan[Namespace], b: Taken) -> InFlight | None:
        """Start a batch of plain recalls to several namespaces as one search
        (``MemoryStore.search_mixed``); None if a namespace field is not a valid name (the
        general route answers it) or the backend refused the search."""
        assert plan.groups is not None  # (classify groups every MIXED batch)
        keys, of_req = plan.groups
        spaces: list[Namespace | None] = []
        sizes_list: list[int] = []
        names, namespaces = self._ns_names, self.store.namespaces
        for key in keys:  # (per distinct namespace, not per request)
            name = names.get(key)
            ns = namespaces.get(name) if name is not None else self._lookup(key)
            if ns is None and name is None and decode_namespace(*key) is None:
                return None
            spaces.append(ns)
            sizes_list.append(0 if ns is None else ns.n)
        of_query = of_req if b.rows is None else np.repeat(of_req, b.rec["nq"].astype(np.intp))
        t_start = time.monotonic_ns()
        try:
            pending = self.store.search_mixed(spaces, of_query, b.q, plan.k, map_ids=self._io.map_ids)
        except Exception:
            return None
        work = int(np.asarray(sizes_list, np.int64)[of_query].sum()) * self.limits.dim
        self.launch.launched(len(b.taken), b.t_pick, t_start, pipelined(work, self.limits.min_work))
        return b.started(pending, work, t_start, Route.MIXED)

    def finish_inflight(self) -> int:
        """Answer every batch in flight (waiting for the device)."""
        served = 0
        while self.inflight:
            served += self.finish_uniform(self.inflight.popleft())
        return served

    def finish_uniform(self, b: InFlight) -> int:
        """Write a started batch's answers (waiting for the device if need be) and post them."""
        try:
            return self._finish_uniform_unguarded(b)
        except Exception as e:  # its slots are no longer in flight: answer them now
            self._on_unexpected("answering a batch failed", e)
            return self.answer_stranded(e)

    def _finish_uniform_unguarded(self, b: InFlight) -> int:
        try:
            ids, scores = b.pending.result()
        except Exception as e:  # the general route searches again and reports per request
            served = self.finish_inflight()  # (it stages queries where a later batch may have)
            return served + self._serve_general(
                b.sel, b.taken, b.rec, b.t_pick, b.t0, f"search failed ({type(e).__name__})"
            )
        self.launch.device_done(len(b.taken), b.t_start, time.monotonic_ns())
        if b.route is Route.MIXED:  # each request's hits: those of its namespace (first row's)
            found = (ids >= 0).sum(axis=1)
            if b.rows is not None:
                found = found[np.cumsum(b.rec["nq"].astype(np.intp)) - b.rec["nq"].astype(np.intp)]
            self.writer.answer_recalls(b.sel, b.rec, ids, scores, b.rows, found)
        else:
            self.writer.answer_recalls(b.sel, b.rec, ids, scores, b.rows)
        return self._complete(b.sel, b.taken, b.rec, b.t_pick, b.t0, b.route.value)

    # ------------------------------------------------------------------ EMBED
    def _serve_embeds(self, sel: np.ndarray, rec: np.ndarray, t_pick: int, t0: int) -> int:
        taken = sel.tolist()
        self.embeds.serve(taken, rec)
        # (not told to the launch policy: its model is of recall batches' device time)
        return self._complete(sel, taken, rec, t_pick, t0, route=Route.EMBED.value, launch=False)

    # ------------------------------------------------------------------ GENERAL
    def _serve_general(
        self, sel: np.ndarray, taken: list[int], rec: np.ndarray, t_pick: int, t0: int, reason: str
    ) -> int:
        """Serve a batch request by request (nothing may be in flight) and publish it."""
        log.debug("%d request(s) served one by one: %s", len(taken), reason)
        self.general.serve(taken, rec)
        return self._complete(sel, taken, rec, t_pick, t0)

    def _complete(
        self,
        sel: np.ndarray,
        taken: list[int],
        rec: np.ndarray,
        t_pick: int,
        t0: int,
        route: str = "general",
        launch: bool = True,
    ) -> int:
        """Answers are written: publish them and record the batch (``launch``: in the launch
        policy's model of recall batches too)."""
        t1 = time.perf_counter_ns()
        n = len(taken)
        t_done = self.writer.deliver(sel)
        if launch:
            self.launch.answered(n, t1 - t0, t_done)
        self.returning.answered(sel, t_done)
        self.stats.record_batch(BatchRecord(n, t1 - t0, t_pick, rec["t_post_ns"], t_done), route)
        self._words.u64[self._batches_word] = self.stats.batches
        return n

    # ------------------------------------------------------------------ errors
    def inflight_slots(self) -> set[int]:
        return {i for b in self.inflight for i in b.taken} | self.hold.slots()

    def answer_stranded(self, e: BaseException) -> int:
        """Answer SERVER_ERROR to every slot taken into a batch (BUSY) that no batch in flight
        will answer. Between two passes of the loop those are exactly the requests an error
        left behind."""
        slots = self.seg.slots
        busy = set(np.flatnonzero(slots["state"] == S_BUSY).tolist()) - self.inflight_slots()
        if not busy:
            return 0
        detail = f"the sidecar failed serving this request ({type(e).__name__}); it was logged"
        stranded = sorted(busy)
        for i in stranded:
            self.writer.answer(i, int(slots[i]["generation"]), Status.SERVER_ERROR, detail)
        self.writer.deliver(np.asarray(stranded, np.intp))
        return len(stranded)
