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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..broker.layout import S_DONE, Layout, SegmentView, SlotWords, Status
from ..broker.positions import Position

_OK = int(Status.OK)


class Poster(Protocol):
    """A slot's response semaphore (``posix_ipc.Semaphore``): only ever posted here."""

    def release(self) -> None: ...


class AnswerWriter:
    """Writes answers into a segment and posts them (see the module docstring for the order).

    ``resp``: each slot's response semaphore; ``count_error``: called with the status of every
    answer that is not OK (the sidecar's error counters)."""

    def __init__(
        self, seg: SegmentView, words: SlotWords, resp: Sequence[Poster], count_error: Callable[[int], None]
    ) -> None:
        self.seg = seg
        self.layout: Layout = seg.layout
        self._words = words
        self._resp = resp
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
    ) -> None:
        """The OK answers of a UNIFORM batch in a fixed number of numpy calls: slots ``sel``, their
        control blocks ``rec`` as read when taken; ``ids``, ``scores`` (queries, kk), one query
        per slot, or the (slot, row) of each query in ``rows``."""
        kk = ids.shape[1]
        seg, slots = self.seg, self.seg.slots
        if rows is None:
            seg.all_result_ids[sel, 0, :kk] = ids
            seg.all_result_scores[sel, 0, :kk] = scores
        else:
            seg.all_result_ids[rows[0], rows[1], :kk] = ids
            seg.all_result_scores[rows[0], rows[1], :kk] = scores
        slots["status"][sel] = _OK
        slots["n_results"][sel] = np.minimum(rec["k"], kk)
        slots["blob_len"][sel] = 0
        slots["resp_generation"][sel] = rec["generation"]

    def _fields(self, slot: int, generation: int, status: Status, n_results: int, blob_len: int) -> None:
        W = self._words
        W.u32[W.blob_len[slot]] = blob_len
        W.u32[W.status[slot]] = int(status)
        W.u32[W.n_results[slot]] = n_results
        W.u64[W.resp_generation[slot]] = generation
        if status != Status.OK:
            self._count_error(status)

    # ------------------------------------------------------------------ 2-4. stamp, DONE, post
    def deliver(self, sel: np.ndarray, slots: Sequence[int]) -> int:
        """Publish the written answers of a batch (``sel``: the same slots as an index array).
        Returns the ``t_done_ns`` stamped (CLOCK_MONOTONIC)."""
        ctl = self.seg.slots
        ctl["batch_size"][sel] = len(slots)
        t_done = time.monotonic_ns()
        ctl["t_done_ns"][sel] = t_done
        ctl["state"][sel] = S_DONE  # last field written, then each post (the fence)
        resp = self._resp
        for i in slots:
            resp[i].release()
        return t_done

    # ------------------------------------------------------------------ 1-4 at once
    def answer_single(self, slot: int, ids: np.ndarray, scores: np.ndarray) -> int:
        """Answer and publish one one-query recall (the SINGLE route), every field through word
        views: ``ids``, ``scores`` (1, kk). Returns the ``t_done_ns`` stamped."""
        W = self._words
        u32, u64 = W.u32, W.u64
        sv = self.seg.slot[slot]
        kk = ids.shape[1]
        sv.result_ids[0, :kk] = ids[0]  # 1. the answer
        sv.result_scores[0, :kk] = scores[0]
        u32[W.status[slot]] = _OK
        u32[W.n_results[slot]] = kk
        u32[W.blob_len[slot]] = 0
        u64[W.resp_generation[slot]] = u64[W.generation[slot]]
        u32[W.batch_size[slot]] = 1  # 2. the stamps
        t_done = time.monotonic_ns()
        u64[W.t_done_ns[slot]] = t_done
        u32[W.state[slot]] = S_DONE  # 3. last field written, then 4. the post (the fence)
        self._resp[slot].release()
        return t_done
