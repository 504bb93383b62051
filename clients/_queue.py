"""The pool's coalescing queue (``RecallPool(coalesce=True)``): a recall that would wait anyway
waits here instead of for a slot of its own, and the queue goes out as few shared slots as the
recalls' coalescing keys allow, at the end of the event-loop turn or when a slot frees up.

The queue's state and decisions are the pure :class:`~._backlog.Backlog`'s (the recalls waiting,
their keys, the next group: ``clients._coalesce``); sending a group is an
``clients._exchange.Exchange``. What the queue needs of its pool
(its free slots, posting, whether it still serves) is a declared :class:`Host`.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, Union

from ..broker.errors import KalosError
from ._backlog import Backlog
from ._coalesce import Key, Share
from ._exchange import Exchange, Outcome, settled_within
from ._refusals import unanswered
from ._requests import Prepared, recall_group
from ._slots import ClientSlot

#: Who waits for a posted exchange (``Exchange.waiter``): its one caller's future, or the
#: callers sharing its slot.
Waiting = Union["asyncio.Future[Any]", "list[Member]"]
#: ``post(exchange)``: send it and count it in flight, or raise with the slot back among the
#: free ones.
Post = Callable[["Exchange[Any, Waiting]"], None]

R = TypeVar("R")


@dataclass(slots=True, eq=False)
class Member:
    """A queued recall (then riding in a shared slot): its request, its caller's future, when
    its call began, and its coalescing key (None: it goes alone)."""

    prep: Prepared[Any]
    future: asyncio.Future[Any]
    t0: int
    key: Key | None
    rows: int  # prep.nq (what clients._coalesce.pick_group reads)
    sent: bool = False
    resent: bool = False  # sent once in a shared slot that overflowed; queued again alone

    def gone(self) -> bool:
        return self.future.done()


class NotSent(Exception):
    """A queued recall's budget ran out before it was sent (the pool says why, in its terms).
    ``resent``: it had been sent in a shared slot that overflowed, and was waiting to go again."""

    def __init__(self, resent: bool) -> None:
        self.resent = resent


class Host(Protocol):
    """What the queue needs of its pool's send path (``clients._send.Sender``): the queue holds
    no reference to the pool, and a test drives it with a plain object."""

    def take_slot(self) -> ClientSlot | None:
        """A free slot of the live attachment, or None."""

    def release(self, slot: ClientSlot) -> None:
        """Put ``slot`` back among the free ones."""

    def wait_for_slot(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Put the queue in line for the next free slot (``fut`` gets it)."""

    def withdraw(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Take the queue out of that line again (a slot ``fut`` already got goes back)."""

    def usable(self, slot: ClientSlot) -> bool:
        """Is ``slot`` a slot of the live attachment?"""

    def post(self, exchange: Exchange[Any, Waiting]) -> None:
        """:data:`Post`."""

    def refusal(self) -> KalosError | None:
        """None while the pool serves, else the error for queued callers."""

    def on_bug(self, error: Exception) -> None:
        """Dispatching failed unexpectedly: the pool breaks (callers fail rather than hang)."""


class CoalescingQueue:
    """Recalls waiting to share slots, oldest first. ``max_rows`` / ``max_k``: the broker's
    max_queries and max_k; ``host``: the pool's side (:class:`Host`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: Host, *, max_rows: int, max_k: int) -> None:
        self._loop = loop
        self._host = host
        self._backlog: Backlog[Member] = Backlog(max_rows, max_k)
        self._dispatch_soon = False  # a dispatch is scheduled for the end of this turn
        self._slot_waiter: asyncio.Future[ClientSlot] | None = None  # the queue's place in line

    def __len__(self) -> int:
        """Entries, those of callers that went away included (what ``_coalesce.route`` reads)."""
        return len(self._backlog)

    def live(self) -> int:
        """Callers still waiting in the queue."""
        return len(self._backlog.live())

    def futures(self) -> list[asyncio.Future[Any]]:
        """The futures of the callers still waiting in the queue."""
        return [m.future for m in self._backlog.live()]

    async def submit(self, p: Prepared[R], t0: int, timeout: float | None, deadline: float | None) -> R:
        """Queue the recall ``p`` (its call began at ``t0``, monotonic ns) and await its share of
        a slot's answer until ``deadline`` (the loop's clock, ``timeout`` seconds from the call's
        start; None: no limit). Raises its own error, ResponseTimeout (sent, not answered in
        time), NotSent (still queued when the budget ran out)."""
        loop = self._loop
        fut: asyncio.Future[R] = loop.create_future()
        m = Member(p, fut, t0, self._backlog.key_of(p), p.nq)
        self._backlog.join(m)
        self._schedule()
        try:
            if deadline is None:
                return await fut
            answered = await settled_within(fut, max(0.0, deadline - loop.time()))
        except BaseException:
            if not m.sent:
                self._unqueue(m)
            raise
        if answered:
            return fut.result()  # its value, or its own error (a sidecar's timeout status too)
        if m.sent:
            raise unanswered(timeout)
        self._unqueue(m)
        raise NotSent(m.resent)

    def again(self, members: Sequence[Member]) -> None:
        """A shared slot overflowed (Completion.RESEND_ALONE): its callers still waiting go to the
        front of the queue, each to be sent alone."""
        if self._backlog.again(members):
            self._schedule()

    def fail(self, exc: BaseException) -> None:
        """Fail every queued caller with (a copy of) ``exc``, and leave the line for a slot."""
        queue = self._backlog.clear()
        w, self._slot_waiter = self._slot_waiter, None
        if w is not None:
            self._host.withdraw(w)
        _fail(queue, exc)

    def forget(self) -> None:
        """In a forked child: drop everything without touching a slot or a future."""
        self._backlog.clear()
        self._slot_waiter = None

    # ------------------------------------------------------------------ dispatch
    def _unqueue(self, m: Member) -> None:
        """Take a caller that went away out of the queue; with no caller left, the queue leaves
        the line for a slot (so the pool's free count is restored at once)."""
        none_left = self._backlog.leave(m)
        w = self._slot_waiter
        if w is not None and none_left:
            self._slot_waiter = None
            self._host.withdraw(w)

    def _schedule(self) -> None:
        """Send the queue at the end of this event-loop turn (once, however many join it)."""
        if not self._dispatch_soon:
            self._dispatch_soon = True
            self._loop.call_soon(self._dispatch_now)

    def _dispatch_now(self) -> None:
        self._dispatch_soon = False
        self._dispatch_guarded(None)

    def _on_slot(self, fut: asyncio.Future[ClientSlot]) -> None:
        """The queue's turn in line for a slot came (or the pool broke while it waited)."""
        if self._slot_waiter is not fut:
            return  # withdrawn (its slot, if it got one, was passed on then)
        self._slot_waiter = None
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.fail(exc)
            return
        self._dispatch_guarded(fut.result())

    def _dispatch_guarded(self, slot: ClientSlot | None) -> None:
        try:
            self._dispatch(slot)
        except Exception as e:
            self._host.on_bug(e)
            raise

    def _dispatch(self, slot: ClientSlot | None) -> None:
        """Send the queue, one group per slot, while there are slots (``slot``: one handed to the
        queue); then wait in line for the next one. Callers that went away are dropped first."""
        while self._backlog.pending():
            refusal = self._host.refusal()
            if refusal is not None:
                self.fail(refusal)
                break
            if slot is None:
                slot = self._host.take_slot()
                if slot is None:
                    if self._slot_waiter is None:
                        w: asyncio.Future[ClientSlot] = self._loop.create_future()
                        w.add_done_callback(self._on_slot)
                        self._host.wait_for_slot(w)
                        self._slot_waiter = w
                    return
            elif not self._host.usable(slot):
                slot = None  # a slot of an attachment that is gone
                continue
            self._send(slot, self._backlog.next_group())
            slot = None
        if slot is not None:
            self._host.release(slot)  # handed to the queue with nothing left to send

    def _send(self, slot: ClientSlot, group: list[Member]) -> None:
        """Write a group (one recall, or several sharing the slot) and post it."""
        ex: Exchange[Any, Waiting]
        if len(group) == 1:  # completes as a call of its own
            m = group[0]
            ex = Exchange(slot, m.prep, m.future, m.t0)
        else:
            ex = Exchange(
                slot,
                recall_group([m.prep for m in group]),
                group,
                group[-1].t0,
                [Share(m.prep.nq, m.prep.k, m.prep.single, m.t0) for m in group],
            )
        try:
            self._host.post(ex)
        except BaseException as e:
            _fail(group, e)  # reads: each caller sends again after a re-attach
            if not isinstance(e, Exception):
                raise
            return
        for m in group:
            m.sent = True


def _fail(members: Sequence[Member], exc: BaseException) -> None:
    for m in members:
        if not m.future.done():
            m.future.set_exception(copy.copy(exc))


# ---------------------------------------------------------------------- who waits for an exchange
def callers(w: Waiting) -> list[asyncio.Future[Any]]:
    """The futures of the callers waiting for one posted exchange."""
    return [m.future for m in w] if isinstance(w, list) else [w]


def orphaned(w: Waiting) -> bool:
    """Every caller of a posted exchange went away (cancelled or timed out)."""
    return all(m.future.done() for m in w) if isinstance(w, list) else w.done()


def complete(ex: Exchange[Any, Waiting]) -> Outcome:
    """Read the answer of ``ex`` (``Exchange.complete``; a caller that went away is recorded as a
    timeout) and free its slot."""
    w = ex.waiter
    if isinstance(w, list):
        return ex.complete([m.future.done() for m in w])
    return ex.answer(w.done())


def deliver(w: Waiting, value: Any, error: KalosError | None) -> None:
    """An answer to the callers still waiting: ``value`` (a shared slot: each caller its share,
    in order), or ``error`` (a copy each when shared)."""
    if not isinstance(w, list):
        if not w.done():
            if error is None:
                w.set_result(value)
            else:
                w.set_exception(error)
        return
    for i, m in enumerate(w):
        if not m.future.done():
            if error is None:
                m.future.set_result(value[i])
            else:
                m.future.set_exception(copy.copy(error))


def fail_callers(w: Waiting, exc: KalosError) -> None:
    """Fail the callers still waiting with a copy of ``exc`` each (their answer cannot come)."""
    for f in callers(w):
        if not f.done():
            f.set_exception(copy.copy(exc))


__all__ = [
    "CoalescingQueue",
    "Member",
    "NotSent",
    "Post",
    "Waiting",
    "callers",
    "complete",
    "deliver",
    "fail_callers",
    "orphaned",
]
