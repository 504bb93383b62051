"""The sidecar's byte work on the slot path, behind one interface with two implementations: the
compiled :class:`kalos.sidecar_cuda.serving._cserve.SlotIO` and its Python twin :class:`PySlotIO`, which
behave identically (``tests/unit/test_slotio.py`` compares the bytes both write into a segment,
hostile control blocks included). :func:`open_slot_io` makes the one a sidecar uses, once, from the
path :mod:`kalos.broker.slotpath` chose.

Byte work only: which slots, which rows, which answers are decided in Python
(:mod:`~kalos.sidecar_cuda.serving.pipeline`, :mod:`~kalos.sidecar_cuda.serving.batching`) and passed in as index
arrays; nothing here decides anything. The calls, in the order a uniform batch makes them:

==================  ==============================================================================
``scan(out)``       indices of the POSTED slots into ``out`` (int64, n_slots long); returns how many
``take(idx, n)``    try-wait the request semaphore of each of ``idx[:n]`` (the fence before a
                    request is read); the slots taken are compacted into ``idx[:m]``; returns m
``snapshot(...)``   ``(sel, t_pick, rec)``: state BUSY and ``t_pick_ns`` of each slot of ``sel``,
                    then its control block copied into ``rec`` (``slot_dtype()``, one per slot):
                    what the client wrote, read once, for every decision after
``gather(...)``     ``(slots, rows, out)``: query row ``rows[j]`` (row 0 when ``rows`` is None) of
                    slot ``slots[j]`` into ``out[j]`` (float32, (len(slots), dim))
``answer_recalls``  ``(sel, rec, ids, scores, slots, rows)``: the OK answers of a uniform batch
                    (results, status, n_results = min(k, kk), blob_len 0, the generation echoed
                    from ``rec``), not yet published (see :mod:`~kalos.sidecar_cuda.serving.answers`)
``deliver(sel)``    publish: ``batch_size``, ``t_done_ns``, state DONE, then each response post;
                    returns ``t_done_ns``
``answer_single``   ``(slot, ids, scores)``: all of the above for one one-query recall
``map_ids``         ``(tables, rows, out)``: a mixed-namespace search's ids, ``out[j] =
                    tables[j][rows[j]]`` (-1 where a row is -1: no hit); a row past its table is a
                    ValueError (:func:`~kalos.sidecar_cuda.storage.store.map_row_ids` is the twin)
==================  ==============================================================================

Index arguments are int64 arrays (``np.intp``); every slot and row index is checked against the
geometry before anything is written (ValueError otherwise): a value a client wrote never indexes
memory. A response post that fails (only a client that posted its own response semaphore up to the
limit can make one fail) does not keep the other slots of the batch from being posted; the first
failure is raised as OSError after all of them.
"""

from __future__ import annotations

import errno
import importlib
import re
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Protocol

import numpy as np
import posix_ipc

from ...broker.layout import (
    CONTROL_BYTES,
    S_BUSY,
    S_DONE,
    SLOT_FIELDS,
    SegmentView,
    SlotWords,
    Status,
    c_header,
)
from ...broker.slotpath import Choice, SlotPath
from ..storage.store import map_row_ids
from .batching import posted_slots

_OK = int(Status.OK)


class Acquirable(Protocol):
    """A slot's request semaphore (``posix_ipc.Semaphore``)."""

    def acquire(self, timeout: float | None = None) -> None: ...


class Poster(Protocol):
    """A slot's response semaphore (``posix_ipc.Semaphore``)."""

    def release(self) -> None: ...


class SlotIO(Protocol):
    """The byte work of the slot path (see the module docstring for each call)."""

    def scan(self, out: np.ndarray, /) -> int: ...

    def take(self, idx: np.ndarray, n: int, /) -> int: ...

    def snapshot(self, sel: np.ndarray, t_pick: int, rec: np.ndarray, /) -> None: ...

    def gather(self, slots: np.ndarray, rows: np.ndarray | None, out: np.ndarray, /) -> None: ...

    def answer_recalls(
        self,
        sel: np.ndarray,
        rec: np.ndarray,
        ids: np.ndarray,
        scores: np.ndarray,
        slots: np.ndarray | None,
        rows: np.ndarray | None,
        /,
    ) -> None: ...

    def deliver(self, sel: np.ndarray, /) -> int: ...

    def answer_single(self, slot: int, ids: np.ndarray, scores: np.ndarray, /) -> int: ...

    def map_ids(self, tables: list[np.ndarray], rows: np.ndarray, out: np.ndarray, /) -> None: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- the Python twin


class PySlotIO:
    """:class:`SlotIO` in numpy and posix_ipc: what runs where the extension is not built or
    ``KALOS_PURE_PYTHON=1`` asks for it. ``words``: word views of the same segment (the one-slot
    calls go through them: a numpy record field costs ~1 us, a word ~50 ns); ``req``/``resp``:
    each slot's semaphores."""

    def __init__(self, seg: SegmentView, words: SlotWords, req: Sequence[Acquirable], resp: Sequence[Poster]) -> None:
        self.seg = seg
        self._words = words
        L = seg.layout
        self._n_slots, self._max_k, self._max_queries = L.n_slots, L.max_k, L.max_queries
        self._req = req
        self._resp = resp
        self._states = seg.slots["state"]
        self._open = True

    def _check_open(self) -> None:
        if not self._open:
            raise ValueError("the slot I/O is closed")

    def _check(self, idx: np.ndarray, limit: int, what: str) -> None:
        self._check_open()
        if len(idx) and not (0 <= int(idx.min()) and int(idx.max()) < limit):
            bad = int(idx[(idx < 0) | (idx >= limit)][0])
            raise ValueError(f"{what} index {bad} outside 0..{limit - 1}")

    def scan(self, out: np.ndarray, /) -> int:
        self._check_open()
        if len(out) < self._n_slots:
            raise ValueError("out must hold n_slots indices")
        posted = posted_slots(self._states)
        out[: len(posted)] = posted
        return len(posted)

    def take(self, idx: np.ndarray, n: int, /) -> int:
        if not 0 <= n <= len(idx):
            raise ValueError("n outside 0..len(idx)")
        self._check(idx[:n], self._n_slots, "slot")
        req = self._req
        taken: list[int] = []
        for i in idx[:n].tolist():
            try:
                req[i].acquire(0)
            except posix_ipc.BusyError:
                continue  # client between writing POSTED and posting req; the next scan brings it
            taken.append(i)
        idx[: len(taken)] = taken
        return len(taken)

    def snapshot(self, sel: np.ndarray, t_pick: int, rec: np.ndarray, /) -> None:
        self._check(sel, self._n_slots, "slot")
        if rec.nbytes != len(sel) * CONTROL_BYTES:
            raise ValueError("rec must hold one control block per slot of sel")
        slots = self.seg.slots
        slots["state"][sel] = S_BUSY
        slots["t_pick_ns"][sel] = t_pick
        rec[...] = slots[sel]  # a copy of the control blocks: what the clients wrote, read once

    def gather(self, slots: np.ndarray, rows: np.ndarray | None, out: np.ndarray, /) -> None:
        self._check(slots, self._n_slots, "slot")
        if rows is not None:
            self._check(rows, self._max_queries, "row")
            if len(rows) != len(slots):
                raise ValueError("rows must be as long as slots")
        if out.shape != (len(slots), self.seg.layout.dim):
            raise ValueError("out must be a contiguous float32 array of (len(slots), dim)")
        # A fancy index then a contiguous copy: 2.7x faster than np.take(out=) here.
        out[...] = self.seg.all_queries[slots, 0] if rows is None else self.seg.all_queries[slots, rows]

    def answer_recalls(
        self,
        sel: np.ndarray,
        rec: np.ndarray,
        ids: np.ndarray,
        scores: np.ndarray,
        slots: np.ndarray | None,
        rows: np.ndarray | None,
        /,
    ) -> None:
        self._check(sel, self._n_slots, "slot")
        m, kk = ids.shape
        if len(rec) != len(sel):
            raise ValueError("rec must hold one control block per slot of sel")
        if scores.shape != ids.shape or kk > self._max_k:
            raise ValueError("ids and scores must have one shape (queries, kk), kk <= max_k")
        if (slots is None) != (rows is None):
            raise TypeError("slots and rows go together")
        seg, ctl = self.seg, self.seg.slots
        if slots is None or rows is None:
            if m != len(sel):
                raise ValueError("one row of results per query: (slots, rows) or sel")
            seg.all_result_ids[sel, 0, :kk] = ids
            seg.all_result_scores[sel, 0, :kk] = scores
        else:
            if not len(slots) == len(rows) == m:
                raise ValueError("one row of results per query: (slots, rows) or sel")
            self._check(slots, self._n_slots, "slot")
            self._check(rows, self._max_queries, "row")
            seg.all_result_ids[slots, rows, :kk] = ids
            seg.all_result_scores[slots, rows, :kk] = scores
        ctl["status"][sel] = _OK
        ctl["n_results"][sel] = np.minimum(rec["k"], kk)
        ctl["blob_len"][sel] = 0
        ctl["resp_generation"][sel] = rec["generation"]

    def deliver(self, sel: np.ndarray, /) -> int:
        self._check(sel, self._n_slots, "slot")
        ctl = self.seg.slots
        ctl["batch_size"][sel] = len(sel)
        t_done = time.monotonic_ns()
        ctl["t_done_ns"][sel] = t_done
        ctl["state"][sel] = S_DONE  # last field written, then each post (the fence)
        self._post(sel.tolist())
        return t_done

    def answer_single(self, slot: int, ids: np.ndarray, scores: np.ndarray, /) -> int:
        self._check_open()
        if not 0 <= slot < self._n_slots:
            raise ValueError(f"slot index {slot} outside 0..{self._n_slots - 1}")
        kk = ids.shape[1]
        if ids.shape[0] != 1 or scores.shape != ids.shape or kk > self._max_k:
            raise ValueError("ids and scores must have one shape (1, kk), kk <= max_k")
        W = self._words
        u32, u64 = W.u32, W.u64
        sv = self.seg.slot[slot]
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
        self._post([slot])
        return t_done

    def _post(self, slots: list[int]) -> None:
        """Post each slot's response semaphore; a failure (posix_ipc raises OSError EOVERFLOW at
        the limit) is raised once every other slot is posted, as the compiled one does."""
        resp = self._resp
        failed: OSError | None = None
        for i in slots:
            try:
                resp[i].release()
            except (OSError, posix_ipc.Error) as e:
                if failed is None:
                    failed = e if isinstance(e, OSError) else OSError(errno.EIO, str(e))
        if failed is not None:
            raise failed

    def map_ids(self, tables: list[np.ndarray], rows: np.ndarray, out: np.ndarray, /) -> None:
        map_row_ids(tables, rows, out)

    def close(self) -> None:
        self._open = False


# --------------------------------------------------------------------------- the compiled one


#: An integer definition of the generated C header (:func:`kalos.broker.layout.c_header`).
_HEADER_INT = re.compile(r"#define (KALOS_\w+) (0x[0-9a-f]+|\d+)")


def layout_problems(compiled: Mapping[str, object]) -> list[str]:
    """How the values an extension was compiled with (``SlotIO.layout()``) differ from
    :mod:`kalos.broker.layout`; empty when they agree. Pure. ``compiled`` maps each header
    definition the C code uses (``KALOS_...``) to its value, and each control-block field it
    reads or writes to its (offset, width): a header not regenerated, or an extension not rebuilt,
    after a layout change shows here (at load, :func:`load_compiled`, and in a test)."""
    header = {m[1]: int(m[2], 0) for m in _HEADER_INT.finditer(c_header())}
    fields = {name: (off, np.dtype(typ).itemsize) for name, typ, off in SLOT_FIELDS}
    problems = []
    for key, value in compiled.items():
        want: object = header.get(key) if key.startswith("KALOS_") else fields.get(key)
        got = tuple(value) if isinstance(value, (tuple, list)) else value
        if want != got:
            problems.append(f"{key}: compiled {got}, layout {want}")
    return problems


def load_compiled() -> ModuleType:
    """Import the extension and check it was built from this layout. ImportError when it is not
    built, or was built from another layout (a stale build: ``make ext`` rebuilds it)."""
    # (an optional module, loaded by name: ImportError where it is not built)
    _cserve: ModuleType = importlib.import_module(f"{__package__}._cserve")
    problems = layout_problems(_cserve.SlotIO.layout())
    if problems:
        raise ImportError(f"kalos.sidecar_cuda.serving._cserve was built from another layout ({'; '.join(problems)})")
    return _cserve


def open_slot_io(
    choice: Choice,
    seg: SegmentView,
    words: SlotWords,
    buf: memoryview,
    req: Sequence[posix_ipc.Semaphore],
    resp: Sequence[posix_ipc.Semaphore],
) -> SlotIO:
    """The slot I/O of the path chosen: the compiled one over ``buf`` (the mapped segment; its
    semaphores opened again by name), or the Python twin over ``seg`` and ``words``."""
    if choice.path is SlotPath.PYTHON or choice.module is None:
        return PySlotIO(seg, words, req, resp)
    L = seg.layout
    io: SlotIO = choice.module.SlotIO(
        buf,
        n_slots=L.n_slots,
        dim=L.dim,
        max_k=L.max_k,
        max_queries=L.max_queries,
        control_offset=L.control_offset,
        data_offset=L.data_offset,
        slot_bytes=L.slot_bytes,
        query_offset=L.query_offset,
        result_ids_offset=L.result_ids_offset,
        result_scores_offset=L.result_scores_offset,
        req_names=[s.name for s in req],
        resp_names=[s.name for s in resp],
    )
    return io


__all__ = ["PySlotIO", "SlotIO", "layout_problems", "load_compiled", "open_slot_io"]
