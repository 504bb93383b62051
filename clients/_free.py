"""A pool's free slots on the event loop (:class:`FreeSlots`): the pure :class:`~._freestack.FreeStack`
keeps the slots and the line of callers and says who gets a freed slot; this module hands it over
and waits."""

from __future__ import annotations

import asyncio

from ._exchange import settled_within
from ._freestack import FreeStack
from ._slots import ClientSlot


class FreeSlots:
    """Free slots, the last released first (its cache lines are warm); callers waiting for one are
    served in arrival order, a released slot going straight to the oldest waiter. A cheaper
    ``asyncio.LifoQueue`` for this one use: a slot handed to a waiter that was cancelled or timed
    out meanwhile is put back, never lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stack: FreeStack[ClientSlot, asyncio.Future[ClientSlot]] = FreeStack()

    @property
    def low(self) -> int:
        """The fewest slots on the stack since :meth:`reset_low` (``FreeStack.low``)."""
        return self.stack.low

    def qsize(self) -> int:
        return len(self.stack)

    def put_nowait(self, slot: ClientSlot) -> None:
        w = self.stack.release(slot)
        if w is not None:
            w.set_result(slot)

    def drain(self) -> None:
        """Forget the free slots (their attachment is gone); waiters keep waiting."""
        self.stack.drain()

    def reset_low(self) -> None:
        self.stack.reset_low()

    def take_oldest(self, n: int) -> list[ClientSlot]:
        """Remove and return the ``n`` slots at the bottom of the stack (released longest ago)."""
        return self.stack.take_oldest(n)

    def waiting(self) -> int:
        """Callers waiting in line for a slot (the coalescing queue counts as one)."""
        return self.stack.waiting()

    def wake_all(self, exc: BaseException) -> None:
        """Fail every waiter with ``exc`` (the pool broke)."""
        for w in self.stack.fail_all():
            w.set_exception(exc)

    def get_nowait(self) -> ClientSlot | None:
        return self.stack.take()

    def add_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Queue ``fut`` for the next released slot, in line with the callers of :meth:`get` (the
        pool's coalescing queue waits as one of them)."""
        self.stack.join(fut)

    def remove_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Take ``fut`` out of line (cancelled); a slot it already holds goes to the next one."""
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self.put_nowait(fut.result())
            return
        self._forget(fut)

    async def get(self, timeout: float | None) -> ClientSlot:
        """Wait for a slot; raises ``asyncio.TimeoutError`` after ``timeout`` seconds (None: no
        limit)."""
        slot = await self.get_within(timeout)
        if slot is None:
            raise asyncio.TimeoutError()
        return slot

    async def get_within(self, timeout: float | None) -> ClientSlot | None:
        """Wait for a slot up to ``timeout`` seconds (None: no limit); None when none came. An
        error a waiter was failed with (:meth:`wake_all`) is raised as itself."""
        fut: asyncio.Future[ClientSlot] = self._loop.create_future()
        self.stack.join(fut)
        try:
            if timeout is None:
                return await fut
            if await settled_within(fut, timeout):
                return fut.result()
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.put_nowait(fut.result())  # handed to us as we gave up: pass it on
            else:
                self._forget(fut)
            raise
        self._forget(fut)
        return None

    def _forget(self, fut: asyncio.Future[ClientSlot]) -> None:
        fut.cancel()
        self.stack.leave(fut)


__all__ = ["FreeSlots"]
