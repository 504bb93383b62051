"""A pool's free slots as data (:class:`FreeStack`): the stack of free slots and the line of
callers waiting for one, and who gets a slot when one frees up. Pure: no event loop, no clock; a
waiter is anything with ``done()`` (the asyncio driver's futures, ``clients._free``), and the
stack only says which waiter a released slot goes to: handing it over is the driver's.

    event           stack                                   the driver
    release(slot)   oldest waiter not done: out of line      hands ``slot`` to the returned waiter
                    none: ``slot`` on top of the stack       (None returned)
    take()          top slot off (the last released)         uses it (None: none free)
    take_live(s)    top slots not in ``s`` dropped, then     (slots of an attachment lost to an
                    as take()                                outage are never used again)
    join(w)/leave(w) ``w`` into/out of line                  waits on / stops waiting on ``w``
    fail_all()      the line emptied                         fails the waiters returned
    drain()         the stack emptied (its attachment gone)  waiters keep waiting

The stack is LIFO (the last released slot's cache lines are warm), the line FIFO; ``low`` is the
fewest slots on the stack since :meth:`FreeStack.reset_low`: so many at its bottom went untaken
since, idle for that whole time (what ``_leaseplan.LeasePlan.to_return`` reads).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from typing import Generic, Protocol, TypeVar


class Pending(Protocol):
    """A caller waiting in line: done once it has a slot, or went away (cancelled, timed out)."""

    def done(self) -> bool: ...


S = TypeVar("S")
W = TypeVar("W", bound=Pending)


class FreeStack(Generic[S, W]):
    """Free slots (``slots``, the top last) and the callers waiting for one (``line``, oldest
    first); the module docstring has the table of events."""

    __slots__ = ("line", "low", "slots")

    def __init__(self) -> None:
        self.slots: list[S] = []
        self.line: deque[W] = deque()
        self.low = 0

    def __len__(self) -> int:
        return len(self.slots)

    def release(self, slot: S) -> W | None:
        """``slot`` is free: the oldest caller still waiting gets it (returned, out of line), or
        with none waiting it goes on top of the stack (None)."""
        line = self.line
        while line:
            w = line.popleft()
            if not w.done():
                return w
        self.slots.append(slot)
        return None

    def take(self) -> S | None:
        """The slot on top of the stack (released last), or None when none is free."""
        slots = self.slots
        if slots:
            slot = slots.pop()
            if len(slots) < self.low:
                self.low = len(slots)
            return slot
        self.low = 0
        return None

    def take_live(self, live: Container[S]) -> S | None:
        """:meth:`take`, dropping the slots not in ``live`` (of an attachment that is gone)."""
        while (slot := self.take()) is not None:
            if slot in live:
                return slot
        return None

    def take_oldest(self, n: int) -> list[S]:
        """Remove and return the ``n`` slots at the bottom of the stack (released longest ago)."""
        taken = self.slots[:n]
        del self.slots[:n]
        self.low = min(self.low, len(self.slots))
        return taken

    def reset_low(self) -> None:
        self.low = len(self.slots)

    def drain(self) -> None:
        """Forget the free slots (their attachment is gone); the line keeps waiting."""
        self.slots.clear()
        self.low = 0

    def waiting(self) -> int:
        """Callers in line still waiting."""
        return sum(1 for w in self.line if not w.done())

    def join(self, w: W) -> None:
        self.line.append(w)

    def leave(self, w: W) -> None:
        """Take ``w`` out of line (it went away); nothing if it is not in line any more."""
        try:
            self.line.remove(w)
        except ValueError:
            pass

    def fail_all(self) -> list[W]:
        """Empty the line: the callers still waiting, for the driver to fail (the pool broke)."""
        line, self.line = self.line, deque()
        return [w for w in line if not w.done()]


__all__ = ["FreeStack", "Pending"]
