"""A pool's free slots: a LIFO stack, its callers waiting in arrival order (:class:`FreeSlots`)."""

from __future__ import annotations

import asyncio
from collections import deque

from ._exchange import settled_within
from ._slots import ClientSlot


class FreeSlots:
    """Free slots, the last released first (its cache lines are warm); callers waiting for one are
    served in arrival order, a released slot going straight to the oldest waiter. A cheaper
    ``asyncio.LifoQueue`` for this one use: a slot handed to a waiter that was cancelled or timed
    out meanwhile is put back, never lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slots: list[ClientSlot] = []
        self._waiters: deque[asyncio.Future[ClientSlot]] = deque()
        #: The fewest slots on the stack since it was last reset (:meth:`reset_low`): so many at
        #: its bottom were not taken since (the stack is LIFO), idle for that whole time.
        self.low = 0

    def qsize(self) -> int:
        return len(self._slots)

    def put_nowait(self, slot: ClientSlot) -> None:
        waiters = self._waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(slot)
                return
        self._slots.append(slot)

    def drain(self) -> None:
        """Forget the free slots (their attachment is gone); waiters keep waiting."""
        self._slots.clear()
        self.low = 0

    def reset_low(self) -> None:
        self.low = len(self._slots)

    def take_oldest(self, n: int) -> list[ClientSlot]:
        """Remove and return the ``n`` slots at the bottom of the stack (released longest ago)."""
        taken = self._slots[:n]
        del self._slots[:n]
        self.low = min(self.low, len(self._slots))
        return taken

    def waiting(self) -> int:
        """Callers waiting in line for a slot (the coalescing queue counts as one)."""
        return sum(1 for w in self._waiters if not w.done())

    def wake_all(self, exc: BaseException) -> None:
        """Fail every waiter with ``exc`` (the pool broke)."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(exc)

    def get_nowait(self) -> ClientSlot | None:
        slots = self._slots
        if slots:
            slot = slots.pop()
            if len(slots) < self.low:
                self.low = len(slots)
            return slot
        self.low = 0
        return None

    def add_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Queue ``fut`` for the next released slot, in line with the callers of :meth:`get` (the
        pool's coalescing queue waits as one of them)."""
        self._waiters.append(fut)

    def remove_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Take ``fut`` out of line (cancelled); a slot it already holds goes to the next one."""
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self.put_nowait(fut.result())
            return
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

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
        self._waiters.append(fut)
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
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass


__all__ = ["FreeSlots"]
