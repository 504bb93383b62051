"""An in-memory stand-in for the shared-memory transport, for unit tests of the pool's logic
(free-slot stack, timeouts, cancellation, orphan draining, a broken waiter) without a sidecar.

:class:`FakeConnection` lays out a real segment (``broker.layout``) in a bytearray and gives out
real :class:`~kalos.clients._slots.ClientSlot` objects whose semaphores are counters; the test plays
the sidecar with :meth:`FakeConnection.serve`::

    conn = FakeConnection(Layout(n_slots=2, dim=4, max_k=4, max_queries=2, blob_bytes=1024))
    pool = RecallPool("fake", size=2, connect=lambda name, uid: conn)
    ...
    conn.serve(lambda view, op, k, nq: (ids, scores))   # answers every posted request

Its slots run the slot path a real connection of this process would (``slot_path``: the
environment's choice, ``broker.slotpath``), so the unit tests cover the compiled byte work where
it is built, and the Python one with ``KALOS_PURE_PYTHON=1``; a test may name either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from ..broker.errors import BrokerUnavailable
from ..broker.layout import (
    S_BUSY,
    S_DONE,
    S_FREE,
    S_POSTED,
    Layout,
    SegmentView,
    SidecarState,
    SlotView,
    Status,
    header_field_offset,
    word_views,
)
from ..broker.slotpath import Choice
from ._slots import ClientSlot, make_slot
from ._transport import Connection, SlotCensus

#: What the fake sidecar computes for one request: (ids, scores) of shape (nq, n) for a recall,
#: an int (rows affected) for a write, or a Status to answer with an error.
Answer = Callable[[SlotView, int, int, int], "tuple[np.ndarray, np.ndarray] | int | Status"]


class FakeSemaphore:
    """A counting semaphore in one process (what posix_ipc gives across processes)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.value = 0
        self.broken: BrokerUnavailable | None = None

    def try_acquire(self) -> bool:
        return self.acquire(0.0)

    def acquire(self, timeout: float) -> bool:
        with self._cv:
            if self.broken is not None:
                raise self.broken
            if self.value == 0 and timeout > 0:
                self._cv.wait_for(lambda: self.value > 0 or self.broken is not None, timeout)
            if self.broken is not None:
                raise self.broken
            if self.value == 0:
                return False
            self.value -= 1
            return True

    def release(self) -> None:
        with self._cv:
            self.value += 1
            self._cv.notify()

    def close(self) -> None:
        pass

    def break_(self, e: BrokerUnavailable) -> None:
        with self._cv:
            self.broken = e
            self._cv.notify_all()


class FakeConnection(Connection):
    """A transport over a bytearray: same interface as :class:`Connection`, no OS objects."""

    def __init__(
        self, layout: Layout, name: str = "fake", payload_limit: int = 16 * 1024, slot_path: Choice | None = None
    ) -> None:  # (super().__init__ not called: no OS objects)
        self.name = name
        self._set_slot_path(slot_path)
        self.layout = layout
        self.metric = "dot"
        self.payload_limit = payload_limit
        self.embed_dim = 0  # (no embedding model)
        self.features = 0
        self.mm = bytearray(layout.total_bytes)  # type: ignore[assignment]
        self.seg = SegmentView(memoryview(self.mm), layout)
        self.seg.init_header(metric=1, backend=1, pid=0, start_epoch_ns=time.time_ns(), payload_limit=payload_limit)
        self.seg.header["state"] = SidecarState.READY
        self.w32, self.w64 = word_views(memoryview(self.mm))
        self.bell = FakeSemaphore()  # type: ignore[assignment]
        self.req = [FakeSemaphore() for _ in range(layout.n_slots)]
        self.resp = [FakeSemaphore() for _ in range(layout.n_slots)]
        self.pid = 1
        self.start_ticks = 0
        self.closed = False
        self.alive = True  # set False to play a dead sidecar
        self.epoch = int(self.seg.header["start_epoch_ns"])
        self._heartbeat_word = header_field_offset("heartbeat_ns") // 8
        self.seg.header["heartbeat_ns"] = 2**62  # never quiet: liveness is ``alive``
        self.leased: list[int] = []
        self.dead: set[int] = set()  # owner pids to count as exited processes (census)

    def check_alive(self) -> None:
        if not self.alive:
            raise BrokerUnavailable(f"broker {self.name!r}: fake sidecar is dead")

    def lease(self, n: int) -> list[ClientSlot]:
        slots = self.seg.slots
        free = np.flatnonzero((slots["owner_pid"] == 0) & (slots["state"] == S_FREE))[:n].tolist()
        for i in free:
            slots[i]["owner_pid"] = self.pid
        self.leased += free
        return [make_slot(self, i, self.req[i], self.resp[i]) for i in free]

    def census(self) -> SlotCensus:
        """Like the real one, with a slot's owner alive while ``owner_pid`` is not in ``dead``."""
        slots = self.seg.slots
        free = leased = reclaimable = 0
        for owner, state in zip(slots["owner_pid"].tolist(), slots["state"].tolist()):
            if owner == 0 and state == S_FREE:
                free += 1
            elif owner in (0, -1) or owner in self.dead:
                reclaimable += 1
            else:
                leased += 1
        return SlotCensus(self.layout.n_slots, free, leased, reclaimable)

    def give_back(self, idle: list[ClientSlot], busy: list[ClientSlot]) -> None:
        for s in idle:
            self.seg.slots[s.index]["owner_pid"] = 0
        for s in busy:
            self.seg.slots[s.index]["owner_pid"] = -1

    def close(self) -> None:
        self.closed = True

    def posted(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.seg.slots["state"] == S_POSTED)]

    def serve(self, answer: Answer, slots: list[int] | None = None) -> int:
        """Play the sidecar once: answer every posted request (in slot order; only those of
        ``slots`` if given) through the real protocol fields: results, status,
        resp_generation, DONE, then the response post."""
        served = 0
        for i in self.posted():
            if slots is not None and i not in slots:
                continue
            if not self.req[i].try_acquire():
                continue
            rec = self.seg.slots[i]
            rec["state"] = S_BUSY
            v = self.seg.slot[i]
            out = answer(v, int(rec["op"]), int(rec["k"]), int(rec["nq"]))
            if isinstance(out, Status):
                rec["status"], rec["n_results"], rec["blob_len"] = int(out), 0, 0
            elif isinstance(out, int):
                rec["status"], rec["n_results"], rec["blob_len"] = int(Status.OK), out, 0
            else:
                ids, scores = out
                kk = ids.shape[1]
                v.result_ids[: len(ids), :kk] = ids
                v.result_scores[: len(ids), :kk] = scores
                rec["status"], rec["n_results"], rec["blob_len"] = int(Status.OK), kk, 0
            rec["resp_generation"] = rec["generation"]
            rec["state"] = S_DONE
            self.resp[i].release()
            served += 1
        return served


__all__ = ["Answer", "FakeConnection", "FakeSemaphore"]
