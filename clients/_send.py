"""The asyncio pool's send path (:class:`Sender`): one request from a slot to its answer. A slot is
taken from the pool's leases (or waited for within the call's budget), the request posted in it
(``clients._exchange``: write, then post) and counted in flight (the client core), and its
future awaited; a coalescible recall goes through the coalescing queue instead
(``clients._backlog`` decides what shares a slot). The poller hands each answered exchange to
:meth:`Sender.complete`, which frees the slot and resolves the callers.

Every decision is a pure module's: the life and the in-flight table (``clients._core``), which
free slot and whether the pool grows (``clients._freestack``, ``clients._leaseplan``), which path
a recall takes (``clients._coalesce.route``), what a caller out of budget gets
(``clients._refusals``). What is left here is waiting and handing over.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..broker.errors import BrokerUnavailable, KalosError
from ..broker.layout import Layout
from ..broker.slotpath import SlotPath
from ..broker.waiting import SpinThenBlock
from ._attach import Attachment
from ._backlog import coalescible
from ._coalesce import Path, route
from ._core import ClientCore, PoolStatistics
from ._elastic import Leases
from ._exchange import Completion, Exchange, resend_after_outage, settled_within
from ._fanout import Halted
from ._free import FreeSlots
from ._life import PoolState
from ._poller import Poller
from ._queue import CoalescingQueue, NotSent, Waiting, callers, complete, deliver, fail_callers, orphaned
from ._refusals import down, no_slot, not_sent, unanswered
from ._requests import Prepared
from ._slots import ClientSlot
from ._transport import Connection
from ._waiter import Waiter

R = TypeVar("R")
_OPEN = PoolState.OPEN  # (bound once: read on every call)


class Sender:
    """The send path of the pool named ``name`` (``size``: its most slots; ``coalesce``: queue
    the recalls that would wait anyway). ``conn`` is the live attachment's connection (None
    during an outage), set by the pool; ``on_outage(exc)``: the sidecar was found dead while
    posting. :meth:`start` gives it the loop's pieces once the pool opens."""

    def __init__(
        self,
        name: str,
        size: int,
        coalesce: bool,
        reconnect: bool,
        core: ClientCore[Waiting],
        leases: Leases,
        policy: SpinThenBlock,
        on_outage: Callable[[BrokerUnavailable], None],
    ) -> None:
        self.name, self.size, self.coalesce, self.reconnect = name, size, coalesce, reconnect
        self.core, self.leases, self.policy = core, leases, policy
        self.on_outage = on_outage
        self.conn: Connection | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.free: FreeSlots | None = None
        self.poller: Poller | None = None
        self.queue: CoalescingQueue | None = None
        self._on_bug: Callable[[Exception], None] = lambda error: None

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        free: FreeSlots,
        poller: Poller,
        layout: Layout,
        on_bug: Callable[[Exception], None],
    ) -> CoalescingQueue:
        """The pool opens: its loop, free slots and poller; returns the coalescing queue made for
        its broker's ``layout`` (``on_bug``: dispatching failed unexpectedly)."""
        self.loop, self.free, self.poller, self._on_bug = loop, free, poller, on_bug
        self.queue = CoalescingQueue(loop, self, max_rows=layout.max_queries, max_k=layout.max_k)
        return self.queue

    # ------------------------------------------------------------------ the queue's host (_queue.Host)
    def take_slot(self) -> ClientSlot | None:
        return self.leases.take()

    def release(self, slot: ClientSlot) -> None:
        assert self.free is not None
        self.free.put_nowait(slot)

    def wait_for_slot(self, fut: asyncio.Future[ClientSlot]) -> None:
        assert self.free is not None
        self.free.add_waiter(fut)

    def withdraw(self, fut: asyncio.Future[ClientSlot]) -> None:
        assert self.free is not None
        self.free.remove_waiter(fut)

    def usable(self, slot: ClientSlot) -> bool:
        return self.leases.usable(slot)

    def refusal(self) -> KalosError | None:
        return self.core.life.queue_refusal(os.getpid())

    def on_bug(self, error: Exception) -> None:
        self._on_bug(error)

    def statistics(self, slot_path: SlotPath) -> PoolStatistics:
        """The pool's snapshot: the core's tallies, the leases' counts, the orphans and queue."""
        return self.core.statistics(
            time.monotonic_ns(),
            self.leases.counts(),
            orphaned=sum(1 for e in self.core.inflight.values() if orphaned(e.waiter)),
            attached=self.conn is not None,
            queued=self.queue.live() if self.queue is not None else 0,
            slot_path=slot_path.value,
        )

    # ------------------------------------------------------------------ the attachment
    def attach(self, att: Attachment) -> None:
        """Make an attachment current: its slots free, its waiter thread started."""
        loop, free, poller = self.loop, self.free, self.poller
        assert loop is not None and free is not None and poller is not None
        conn, slots = att
        self.conn = conn
        self.leases.attach(conn, slots, loop, free)
        waiter = self.leases.waiter = Waiter(loop, poller.wake.set, self.on_outage)
        poller.attach(conn, waiter)

    def detach(self, exc: KalosError, *, give_back: bool) -> None:
        """Drop the current attachment: callers in flight get ``exc``; the leases go back (idle
        slots freed, busy ones abandoned to the reaper) when ``give_back``."""
        if self.poller is not None:
            self.poller.detach()
        self.leases.waiter = None
        busy = []
        for e in self.core.lost():
            busy.append(e.slot)
            fail_callers(e.waiter, exc)
        if self.free is not None:
            self.free.drain()
        conn, slots = self.leases.detach()
        self.conn = None
        if conn is not None:
            Attachment(conn, slots).end(busy, give_back=give_back)

    def forget(self) -> None:
        """In a forked child: forget the parent's exchanges, slots, queue and poller without
        touching shared memory (the parent still uses them)."""
        self.core.forget()
        self.conn = None
        self.leases.forget()
        if self.queue is not None:
            self.queue.forget()
        if self.poller is not None:
            self.poller.forget()

    def callers_waiting(self) -> list[asyncio.Future[Any]]:
        """The futures of the callers still waiting for an answer: in flight or queued (an
        orphan's request is the sidecar reaper's, not waited for)."""
        futs = [f for e in self.core.inflight.values() for f in callers(e.waiter) if not f.done()]
        return futs + (self.queue.futures() if self.queue is not None else [])

    # ------------------------------------------------------------------ a request
    def check_usable(self) -> None:
        err = self.core.life.refusal(os.getpid())
        if err is not None:
            raise err

    def down_error(self) -> BrokerUnavailable:
        """What a caller whose budget ran out during an outage gets."""
        return down(self.name, time.monotonic_ns() - self.core.tally.down_since)

    async def execute(self, p: Prepared[R], timeout: float | None, t0: int) -> R:
        """``p``'s answer within ``timeout`` seconds (None: no limit) of now; a read lost to a
        sidecar that went away (in flight, or posted just before the pool noticed) is sent
        again once the pool has re-attached, within the same budget."""
        loop = self.loop
        assert loop is not None
        deadline = None if timeout is None else loop.time() + timeout
        life = self.core.life
        while True:
            try:
                return await self.send(p, timeout, deadline, t0)
            except BrokerUnavailable:
                if not (self.reconnect and life.state is _OPEN and resend_after_outage(p, deadline, loop.time())):
                    raise

    async def send(self, p: Prepared[R], timeout: float | None, deadline: float | None, t0: int) -> R:
        """``p``'s answer, within ``deadline`` (the loop's clock; ``timeout`` seconds from the
        call's start at ``t0``, monotonic ns): in a slot of its own, or queued to share one."""
        queue, free = self.queue, self.free
        assert queue is not None and free is not None
        if (
            self.coalesce
            and coalescible(p)
            and route(True, len(queue), free.qsize(), len(self.core.inflight)) is Path.QUEUE
        ):
            try:  # queued to be sent with others (RecallPool's docstring, "Coalescing")
                return await queue.submit(p, t0, timeout, deadline)
            except NotSent as e:
                raise self._not_sent(e, timeout) from None
        loop = self.loop
        assert loop is not None
        slot = await self.acquire(deadline)
        if p.call is not None and p.call.failed:
            free.put_nowait(slot)
            raise Halted  # another chunk of this write failed: this one is not sent
        fut: asyncio.Future[R] = loop.create_future()
        self.post(Exchange(slot, p, fut, t0))
        if deadline is None:
            return await fut
        if await settled_within(fut, max(0.0, deadline - loop.time())):
            return fut.result()  # the answer, or its own error (a sidecar's timeout status too)
        raise unanswered(timeout)

    async def acquire(self, deadline: float | None) -> ClientSlot:
        """A free slot of the current attachment, waiting (within ``deadline``) for one to be
        answered or for a sidecar to re-attach to."""
        free, loop, leases, life = self.free, self.loop, self.leases, self.core.life
        assert free is not None and loop is not None
        while True:
            slot = leases.take()
            if slot is None:
                slot = await free.get_within(None if deadline is None else max(0.0, deadline - loop.time()))
                if slot is None:
                    self.check_usable()
                    if self.conn is None:
                        raise self.down_error()
                    raise no_slot(len(leases.slots), self.size)
            if life.state is not _OPEN:
                free.put_nowait(slot)
                self.check_usable()
            if leases.usable(slot):  # not a slot of a dead attachment
                return slot

    def _not_sent(self, e: NotSent, timeout: float | None) -> KalosError:
        """The error of a recall whose budget ran out in the coalescing queue."""
        self.check_usable()
        if self.conn is None:
            return self.down_error()
        return not_sent(e.resent, timeout, len(self.leases.slots), self.leases.counts().free)

    def post(self, ex: Exchange[Any, Waiting]) -> None:
        """Send ``ex`` in its slot and count it in flight. On failure the slot goes back on the
        free stack and the error is raised (a sidecar found dead is an outage as well)."""
        slot, conn, free = ex.slot, self.conn, self.free
        assert conn is not None and free is not None
        if conn.quiet():  # the heartbeat is late: is the sidecar still there before we post?
            try:
                conn.check_alive()
            except BrokerUnavailable as e:
                free.put_nowait(slot)
                self.on_outage(e)
                raise
        try:
            ex.send()
        except BaseException:
            free.put_nowait(slot)
            raise
        self.core.posted(ex)
        assert self.poller is not None
        self.poller.posted()

    def complete(self, ex: Exchange[Any, Waiting]) -> None:
        """An answer is in: the exchange's outcome goes to its callers (those still waiting);
        the slot is free again, and only now (the sidecar is done with it)."""
        completion, value, error, round_trip = complete(ex)
        self.policy.observe(round_trip)
        self.leases.release(ex.slot)
        waiting = ex.waiter
        if completion is Completion.RESEND_ALONE:
            assert self.queue is not None and isinstance(waiting, list)
            self.queue.again(waiting)
            return
        if isinstance(waiting, list):  # (callers shared the slot)
            self.core.tally.answered(len(waiting), error is None, True)
        else:
            self.core.tally.answered(1, error is None, False)
        deliver(waiting, value, error)


__all__ = ["Sender"]
