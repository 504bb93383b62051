"""One request in one slot, written once for both clients: send it (write, then post) and complete
it (read the answer into an :data:`Outcome`).

No event loop, no thread, no waiting: a driver (the asyncio pool, the blocking client) decides
when to send, finds the answer in (``ClientSlot.answered``, or a blocking wait on the response
semaphore: either consumes the response post, the fence before reading), and acts on the outcome.
A slot may carry the recalls of several callers (the pool's coalescing): their rows in order, the
answer split among them (``clients._coalesce.split``), each caller's latency recorded as its own.

    FREE --send()--> POSTED --(sidecar)--> DONE --(consumed)--> complete(gone) --> FREE, Outcome
                                                             \\-> discard() -----> FREE

Recording belongs here too: the slot's stats block (read by the sidecar's metrics) gets each
caller's latency when its answer is read, or a timeout for a caller that had gone by then.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..broker.errors import KalosError, PayloadTooLarge
from ..broker.layout import latency_op
from ._coalesce import Share, split
from ._requests import READS, Prepared, read
from ._slots import ClientSlot


class Completion(enum.Enum):
    """What became of a request whose answer was read."""

    ANSWERED = "answered"  # the value: the answer (a list, one per caller, when shared)
    FAILED = "failed"  # the error: what every caller gets
    RESEND_ALONE = "resend alone"  # a shared answer overflowed the slot: send each caller alone


#: What :meth:`Exchange.complete` returns: ``(completion, value, error, round_trip_ns)``; the
#: value when ANSWERED, the error when FAILED (and the cause of a RESEND_ALONE), and the time from
#: the request's t0 to its answer read (what the spin policy follows). A plain tuple: one is made
#: for every answer.
Outcome = tuple[Completion, Any, KalosError | None, int]
R = TypeVar("R")
W = TypeVar("W")


# Bound once: reading an enum member off its class costs ~50 ns on CPython 3.11, and every
# answer is completed here.
_ANSWERED, _FAILED, _RESEND_ALONE = Completion.ANSWERED, Completion.FAILED, Completion.RESEND_ALONE


@dataclass(slots=True, eq=False)
class Exchange(Generic[R, W]):
    """``prep`` in ``slot``. ``waiter``: the driver's own record of who waits for the answer
    (the pool: its caller's future, or a shared slot's callers; the blocking client: None);
    ``t0``: when the call began (monotonic ns; 0: timed from its sending, as the chunks of a
    bulk call are); ``parts``: the callers sharing the slot, in row order
    (``clients._coalesce.Share``: rows, k, recall or recall_many, t0; None: one caller)."""

    slot: ClientSlot
    prep: Prepared[R]
    waiter: W
    t0: int = 0
    parts: list[Share] | None = None

    def send(self) -> None:
        """Write the request into the slot's data areas, then post it (header fields, POSTED, the
        request semaphore, the doorbell if the sidecar sleeps: ``ClientSlot.post_request``, which
        the compiled slot path does in one call for a recall of rows alone). If
        either step fails the slot is FREE again and the error is raised; the driver keeps the
        slot."""
        slot, p = self.slot, self.prep
        try:
            slot.post_request(p, self.t0)
        except BaseException:
            slot.set_free()
            raise
        p.posted = True
        if not self.t0:
            self.t0 = time.monotonic_ns()

    def complete(self, gone: Sequence[bool]) -> Outcome:
        """Read the answer (its response post consumed) and free the slot. ``gone``: per caller,
        whether it went away (cancelled, timed out): its latency is recorded as a timeout and
        its share of the answer is the driver's to drop. A failed chunk of a write marks its
        call failed before the slot is free to carry the call's next chunk. One caller: as
        :meth:`answer`; a shared slot: the value is each caller's share, in order."""
        if self.parts is None:
            return self.answer(gone[0])
        slot, parts = self.slot, self.parts
        p: Prepared[Any] = self.prep  # a group of recalls (``_requests.recall_group``)
        error: KalosError | None = None
        shares: list[Any] | None = None
        try:
            # The compiled path: the checks, the Hits and the split among the callers in one call.
            shares = slot.fast_hits(p, parts)  # (None: decoded here, an error status too)
            if shares is None:
                shares = split(read(slot.view, slot.outcome(), p), parts)
        except KalosError as e:
            error = e
        now = time.monotonic_ns()
        slot.set_free()
        if isinstance(error, PayloadTooLarge):
            # Together their payloads overflowed the slot; each alone may fit, as it would have
            # without coalescing. Nothing is recorded: each caller's request is not over.
            return _RESEND_ALONE, None, error, now - self.t0
        # Each caller's own latency and kind; a caller that went away, a timeout.
        slot.record_shares(now, parts, gone, error is None, latency_op(p.op, True), latency_op(p.op, False))
        if error is None:
            return _ANSWERED, shares, None, now - self.t0
        return _FAILED, None, error, now - self.t0

    def answer(self, gone: bool) -> tuple[Completion, R | None, KalosError | None, int]:
        """:meth:`complete` for a slot of one caller, typed: the value is what ``prep`` decodes
        to (``Prepared[R]``)."""
        slot, p = self.slot, self.prep
        error: KalosError | None = None
        value: R | None = None
        try:
            value = slot.fast_hits(p, None)  # (None: decoded here, an error status too)
            if value is None:
                value = read(slot.view, slot.outcome(), p)
        except KalosError as e:
            error = e
            if p.call is not None:
                p.call.failed = True
        now = time.monotonic_ns()
        op = latency_op(p.op, p.single)
        if gone:
            slot.record(now - self.t0, ok=False, timed_out=True, op=op)
        else:
            slot.record(now - self.t0, ok=error is None, op=op)
        slot.set_free()
        if error is None:
            return _ANSWERED, value, None, now - self.t0
        return _FAILED, None, error, now - self.t0

    def discard(self) -> None:
        """Free the slot of an answered request whose caller was told already (the blocking
        client's timed-out request, finished before its next one): nothing read or recorded."""
        self.slot.set_free()


async def settled_within(fut: asyncio.Future[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``fut``: True once it is done (read its result, or
    its own error, from it), False when the budget ran out first (``fut`` is then cancelled: its
    caller went away). Cancelling the wait cancels ``fut`` too.

    The drivers' one way of bounding a wait on an answer, instead of ``asyncio.wait_for`` and
    ``except asyncio.TimeoutError``: that clause also catches every error the future carries
    that is a TimeoutError (a sidecar's NOT_APPLIED answer is PositionTimeout, a KalosTimeout) on
    Python 3.11+, where ``asyncio.TimeoutError is TimeoutError``, and not on 3.10. Here nothing
    is caught: whether the budget ran out is whether ``fut`` is done, whatever the relation
    between those two classes."""
    if fut.done():
        return True
    loop = fut.get_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    fut.add_done_callback(wake)
    timer = loop.call_later(timeout, wake)
    try:
        await woken
    except BaseException:  # the waiting task was cancelled
        fut.cancel()
        raise
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    if fut.done():
        return True
    fut.cancel()
    return False


def resend_after_outage(p: Prepared[Any], deadline: float | None, now: float) -> bool:
    """Send ``p`` again to the next sidecar after the one it was posted to went away? Reads
    only (idempotent; a write may have been applied: its caller decides), and only within the
    call's budget (``deadline``, ``now``: seconds on one monotonic clock; None: no limit)."""
    return p.op in READS and (deadline is None or now < deadline)


__all__ = ["Completion", "Exchange", "Outcome", "resend_after_outage", "settled_within"]
