"""An asyncio pool's leases, elastic (:class:`Leases`): the slots it holds on its attachment,
leased beyond ``min_size`` while callers wait, given back when idle, ceded to a process waiting
for its first slot, held to a fair share under contention. The decisions are
:class:`~._leaseplan.LeasePlan`'s (pure); this module does what they say, on the event loop.

The pool attaches it (:meth:`Leases.attach`) and detaches it; slots it leases go onto the pool's
free stack, slots it gives back come off it. It calls nothing of the pool."""

from __future__ import annotations

import asyncio

from ..broker.errors import BrokerUnavailable
from ._core import SlotCounts
from ._free import FreeSlots
from ._leaseplan import GROW_RETRY_S, LOCK_RETRY_S, TICK_S, LeasePlan
from ._slots import ClientSlot
from ._transport import Connection, LockBusy, SlotWant
from ._waiter import Waiter


class Leases:
    """The slots of a pool's current attachment (``slots``; ``current``: the same as a set, what a
    slot of an attachment lost to an outage is not in) and their elastic life. ``open``: the pool
    takes new calls (it grows only then); ``waiter``: the pool's waiter thread, whose slot is never
    given back while it may still wait on it (:meth:`~._waiter.Waiter.holds`)."""

    def __init__(self, size: int, min_size: int, idle_s: float) -> None:
        self.size = size
        self.min_size = min_size
        self.plan = LeasePlan(size, min_size, idle_s)
        self.slots: list[ClientSlot] = []
        self.current: frozenset[ClientSlot] = frozenset()
        self.ceding = False  # (the plan's, read on every answer)
        self.open = False
        self.waiter: Waiter | None = None
        self.grown = self.returned = self.refused = 0
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free: FreeSlots | None = None
        self._ticker: asyncio.TimerHandle | None = None  # idle and ceding checks, while grown
        self._regrower: asyncio.TimerHandle | None = None  # asks again after a refusal
        self._want: SlotWant | None = None  # our callers wait for slots the broker could not give

    # ------------------------------------------------------------------ the attachment
    def attach(
        self, conn: Connection, slots: list[ClientSlot], loop: asyncio.AbstractEventLoop, free: FreeSlots
    ) -> None:
        """Make an attachment's slots the pool's, all free."""
        self._conn, self._loop, self._free = conn, loop, free
        self.slots = list(slots)
        self.current = frozenset(slots)
        self.plan.ceding, self.plan.share, self.ceding = False, None, False
        for s in slots:
            free.put_nowait(s)
        self._arm_ticker()

    def detach(self) -> tuple[Connection | None, list[ClientSlot]]:
        """Forget the attachment (its timers stopped, its want withdrawn); returns its connection
        and slots, for the pool to end."""
        for timer in (self._ticker, self._regrower):
            if timer is not None:
                timer.cancel()
        self._ticker = self._regrower = None
        self.stop_wanting()
        conn, slots = self._conn, self.slots
        self._conn, self.slots, self.current = None, [], frozenset()
        return conn, slots

    def forget(self) -> None:
        """In a forked child: drop everything without touching a slot, a timer or a lock (the
        parent's loop never runs here; the want's descriptor is the parent's as well)."""
        self._conn, self.slots, self.current = None, [], frozenset()
        self._ticker = self._regrower = None
        self._want = None
        self.waiter = None

    # ------------------------------------------------------------------ the pool's use
    def take(self) -> ClientSlot | None:
        """A free slot of the live attachment now (one more leased if none is free and the pool
        may grow), or None. Free slots of an attachment lost to an outage are dropped."""
        free = self._free
        if free is None:
            return None
        slot = free.stack.take_live(self.current)
        if slot is None and self.grow(1):  # (a slot leased goes to the oldest caller waiting, maybe not us)
            slot = free.stack.take_live(self.current)
        return slot

    def usable(self, slot: ClientSlot) -> bool:
        """A slot of the live attachment (not one of an attachment lost to an outage)."""
        return slot in self.current

    def release(self, slot: ClientSlot) -> None:
        """The slot of an answered request: back to the broker while the plan cedes slots and the
        pool holds more than it may (:meth:`cede`), else on the free stack."""
        if self.ceding:
            self.cede(slot)
        else:
            assert self._free is not None
            self._free.put_nowait(slot)

    def counts(self) -> SlotCounts:
        """The slot side of the pool's statistics."""
        free = self._free.qsize() if self._free is not None else 0
        return SlotCounts(len(self.slots), free, self.min_size, self.size, self.grown, self.returned, self.refused)

    # ------------------------------------------------------------------ growing
    def grow(self, extra: int) -> int:
        """Lease more slots for the callers waiting for one (``extra``: those not in line yet),
        as :meth:`LeasePlan.grow` decides; each goes to the oldest caller waiting. Returns how
        many were leased: 0 at ``size``, while ceding, or when the broker had none to spare
        (then asked again shortly, while callers still wait)."""
        if len(self.slots) >= self.size:
            return 0
        conn, loop, free = self._conn, self._loop, self._free
        if conn is None or not self.open or loop is None or free is None:
            return 0
        now = loop.time()
        n = self.plan.grow(len(self.slots), free.waiting() + extra, now)
        if n <= 0:
            return 0
        wait = GROW_RETRY_S
        try:
            got = conn.lease(n)
        except LockBusy:  # another process held the claim lock for FLOCK_WAIT_S
            got, wait = [], LOCK_RETRY_S
        except BrokerUnavailable:  # the sidecar going away: the liveness check's to find
            got = []
        if not got:
            self.refused += 1
            self.plan.refused(now, wait)
            if self._want is None:  # pools over their fair share give slots back (LeasePlan)
                self._want = conn.want_slots(first=False)
            if self._regrower is None:
                self._regrower = loop.call_later(GROW_RETRY_S, self._regrow)
            return 0
        self.slots.extend(got)
        self.current = self.current.union(got)
        self.grown += len(got)
        self._arm_ticker()
        for s in got:
            free.put_nowait(s)
        return len(got)

    def _regrow(self) -> None:
        """A while after a refusal: ask again while callers still wait for a slot; once none
        does, stop asking (and stop announcing the want to other pools)."""
        self._regrower = None
        free, loop = self._free, self._loop
        if free is None or loop is None or not free.waiting() or len(self.slots) >= self.size:
            self.stop_wanting()
            return
        if loop.time() + GROW_RETRY_S / 2 >= self.plan.retry_at:
            self.plan.retry_at = 0.0  # (the timer may fire a hair before the plan's retry time)
            self.grow(0)
        if self._regrower is None and self._conn is not None:
            self._regrower = loop.call_later(GROW_RETRY_S, self._regrow)

    def stop_wanting(self) -> None:
        want, self._want = self._want, None
        if want is not None:
            want.release()

    # ------------------------------------------------------------------ giving back
    def _arm_ticker(self) -> None:
        """While the pool holds slots beyond ``min_size``: look every TICK_S for idle ones and
        for a process waiting for its first slot."""
        if self._ticker is None and len(self.slots) > self.min_size and self._loop is not None:
            assert self._free is not None
            self.plan.start(self._loop.time())
            self._free.reset_low()
            self._ticker = self._loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        conn, loop, free = self._conn, self._loop, self._free
        if conn is None or loop is None or free is None:
            return
        if len(self.slots) <= self.min_size:
            self.plan.ceding, self.plan.share, self.ceding = False, None, False
            return
        first, more = conn.pressure()
        self.plan.ceding = first
        self.plan.share = conn.layout.n_slots // max(1, conn.holders()) if more else None
        self.ceding = first or more
        period = self.plan.period_end
        n = self.plan.to_return(len(self.slots), free.qsize(), free.low, loop.time())
        if n:
            self.give_back(free.take_oldest(n))
        if self.plan.period_end != period:  # a new idle period began
            free.reset_low()
        if len(self.slots) > self.min_size:
            self._ticker = loop.call_later(TICK_S, self._tick)
        else:
            self.plan.ceding, self.plan.share, self.ceding = False, None, False

    def cede(self, slot: ClientSlot) -> None:
        """A slot just freed while another process waits for its first, or other pools' callers
        wait for slots: back to the broker if the pool holds more than it may
        (:meth:`LeasePlan.cap`), else on the free stack."""
        assert self._free is not None
        if len(self.slots) > self.plan.cap():
            self.give_back([slot])  # (on the free stack if the broker cannot take it now)
        else:
            self._free.put_nowait(slot)

    def give_back(self, idle: list[ClientSlot]) -> bool:
        """End the leases of free slots (no request in them). False (and they go back on the
        free stack) if the broker could not take them now. A slot the waiter thread may still be
        waiting on stays (on the free stack) for a later give-back (:meth:`Waiter.holds`)."""
        conn, free = self._conn, self._free
        assert free is not None
        waiter = self.waiter
        if waiter is not None:  # the waiter thread may still be inside a wait on one of them
            held = {s for s in idle if waiter.holds(s)}
            for s in held:
                free.put_nowait(s)
            idle = [s for s in idle if s not in held]
        if not idle:
            return False
        try:
            if conn is None:
                raise BrokerUnavailable("no attachment")
            conn.give_back(idle, [])
        except BrokerUnavailable:
            for s in idle:
                free.put_nowait(s)
            return False
        gone = set(idle)
        self.slots = [s for s in self.slots if s not in gone]
        self.current = self.current.difference(gone)
        self.returned += len(idle)
        return True


__all__ = ["Leases"]
