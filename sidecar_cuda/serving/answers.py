"""The one writer of answers: every route, and every error path, answers a slot through here.

A client reads its answer as soon as it sees ``state == DONE`` (polling) or its ``resp``
semaphore wakes it (docs/protocol.md, "A request"). What it reads must therefore be complete
before either, so for every slot the writes happen in this order, and only here:

1. the answer: results (hits, blob, exported rows), ``status``, ``n_results``, ``blob_len``,
   ``resp_generation`` (the request's generation, so a late answer is recognised);
2. the stamps: ``batch_size``, ``t_done_ns``;
3. ``state = DONE``, the last field written;
4. ``sem_post(resp[i])``, the fence that publishes 1-3 to the client's process.

Step 1 is :meth:`AnswerWriter.answer` and its relatives (a batch writes the answers of all its
slots first); steps 2-4 are :meth:`AnswerWriter.deliver`, called once the whole batch is written;
:meth:`AnswerWriter.answer_single` does all four for the one request of the SINGLE route. Nothing
else in the sidecar writes these fields or posts ``resp``.

The calls every recall makes (a uniform batch's answers, the publishing of every batch, the SINGLE
route's answer) are byte work of the sidecar's :class:`~kalos.sidecar_cuda.serving.slotio.SlotIO`: compiled
(``_cserve``) or its Python twin, in the same order. The rarer answers (errors, blobs, exported
rows, the general route's hits) are written here in Python on either path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...broker.layout import Layout, SegmentView, SlotWords, Status
from ...broker.positions import Position
from .slotio import SlotIO


class AnswerWriter:
    """Writes answers into a segment and posts them (see the module docstring for the order).

    ``io``: the slot path's byte work, which posts each slot's response semaphore (the only
    posts of them); ``count_error``: called with the status of every answer that is not OK (the
    sidecar's error counters)."""

    def __init__(self, seg: SegmentView, words: SlotWords, io: SlotIO, count_error: Callable[[int], None]) -> None:
        self.seg = seg
        self.layout: Layout = seg.layout
        self._words = words
        self._io = io
        self._count_error = count_error

    # ------------------------------------------------------------------ 1. the answer
    def answer(self, slot: int, generation: int, status: Status, detail: str = "", n_results: int = 0) -> None:
        """A request's outcome without a blob of results: ``detail`` (UTF-8, cut to the blob area)
        is the blob of an error, empty for OK."""
        data = detail.encode()[: self.layout.blob_bytes]
        if data:
            self.seg.slot[slot].blob[: len(data)] = np.frombuffer(data, np.uint8)
        self._fields(slot, generation, status, n_results, len(data))

    def answer_blob(self, slot: int, generation: int, n_results: int, blob: bytes) -> None:
        """An OK answer that carries a blob (payloads of the hits, the namespace list, exported
        payloads); the caller checked that it fits the slot."""
        self.seg.slot[slot].blob[: len(blob)] = np.frombuffer(blob, np.uint8)
        self._fields(slot, generation, Status.OK, n_results, len(blob))

    def position(self, slot: int, position: Position) -> None:
        """A write's place in its fleet's change log, ``ORIGIN`` for none (the status follows
        with :meth:`answer`)."""
        W = self._words
        W.u64[W.pos_xid[slot]] = position.xid
        W.u64[W.pos_seq[slot]] = position.seq

    def now(self, slot: int, now_ns: int) -> None:
        """The sidecar's clock the request was served at (``now_ns``: expiry and ages were decided
        at it, a write stamped it), for the answers that carry it (the status follows)."""
        W = self._words
        W.u64[W.now_ns[slot]] = now_ns

    def hits(self, slot: int, ids: np.ndarray, scores: np.ndarray) -> None:
        """Result ids and scores (nq, kr) of a recall (the status follows with :meth:`answer`)."""
        sv = self.seg.slot[slot]
        nq, kr = ids.shape
        sv.result_ids[:nq, :kr] = ids
        sv.result_scores[:nq, :kr] = scores

    def rows(self, slot: int, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Exported records: ids and vectors into the slot's ids and queries areas."""
        sv = self.seg.slot[slot]
        sv.ids[: len(ids)] = ids
        sv.queries[: len(ids)] = vectors

    def answer_recalls(
        self,
        sel: np.ndarray,
        rec: np.ndarray,
        ids: np.ndarray,
        scores: np.ndarray,
        rows: tuple[np.ndarray, np.ndarray] | None = None,
        found: np.ndarray | None = None,
    ) -> None:
        """The OK answers of a UNIFORM or MIXED batch in one call: slots ``sel``, their control
        blocks ``rec`` as read when taken; ``ids``, ``scores`` (queries, kk), one query per slot,
        or the (slot, row) of each query in ``rows``. ``n_results`` is min(k asked, kk), and
        ``found[i]`` when given (the hits of request i: a MIXED batch's namespaces differ)."""
        ids = np.ascontiguousarray(ids, np.int64)
        scores = np.ascontiguousarray(scores, np.float32)
        if rows is None:
            self._io.answer_recalls(sel, rec, ids, scores, None, None)
        else:
            self._io.answer_recalls(sel, rec, ids, scores, rows[0], rows[1])
        if found is not None:  # (before deliver: its state DONE and post publish this too)
            ctl = self.seg.slots
            ctl["n_results"][sel] = np.minimum(ctl["n_results"][sel], found)

    def _fields(self, slot: int, generation: int, status: Status, n_results: int, blob_len: int) -> None:
        W = self._words
        W.u32[W.blob_len[slot]] = blob_len
        W.u32[W.status[slot]] = int(status)
        W.u32[W.n_results[slot]] = n_results
        W.u64[W.resp_generation[slot]] = generation
        if status != Status.OK:
            self._count_error(status)

    # ------------------------------------------------------------------ 2-4. stamp, DONE, post
    def deliver(self, sel: np.ndarray) -> int:
        """Publish the written answers of a batch, slots ``sel`` (an int64 index array): stamps,
        DONE, then each post. Returns the ``t_done_ns`` stamped (CLOCK_MONOTONIC)."""
        return self._io.deliver(sel)

    # ------------------------------------------------------------------ 1-4 at once
    def answer_single(self, slot: int, ids: np.ndarray, scores: np.ndarray) -> int:
        """Answer and publish one one-query recall (the SINGLE route) in one call: ``ids``,
        ``scores`` (1, kk). Returns the ``t_done_ns`` stamped."""
        return self._io.answer_single(
            slot, np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(scores, np.float32)
        )
