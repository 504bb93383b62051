"""An elastic pool's lease decisions, pure (:class:`LeasePlan`) and the times they run on."""

from __future__ import annotations

from dataclasses import dataclass

#: Default ``idle_s``: a slot leased beyond ``min_size`` goes back once unused this long (it goes
#: back between ``idle_s`` and twice that after its last use).
IDLE_S = 3.0
#: After the broker had no slot to spare, the pool asks again this much later while callers wait.
GROW_RETRY_S = 0.05
#: ... and this much later when the slots' claim lock was held too long by another process (a
#: stopped or frozen client: every try would stall the event loop for ``FLOCK_WAIT_S``).
LOCK_RETRY_S = 1.0
#: How often a pool holding slots beyond its ``min_size`` looks whether another process waits for
#: its first slot (``Connection.pressure``; it then gives those slots back as they free up).
TICK_S = 0.25


@dataclass(slots=True)
class LeasePlan:
    """When an elastic pool leases more slots and when it gives them back: the decisions, pure
    (times are the caller's clock, in seconds; nothing here touches a slot).

    * **Grow** (:meth:`grow`): a caller finds no free slot: lease one per caller waiting, within
      ``size``; not before ``retry_at`` after the broker had none to spare (:meth:`refused`):
      meanwhile callers queue for the pool's own slots.
    * **Idle** (:meth:`to_return`): at the end of each period of ``idle_s``, the slots that stayed
      on the free stack the whole period (its low-water mark; the stack is LIFO, so they are the
      ones at its bottom) go back, down to ``min_size``: idle slots serve other processes.
    * **Cede to a starting process** (``ceding``): while another process waits for its first
      slot of the broker, every slot beyond ``min_size`` goes back as soon as it is free, and
      the pool does not grow.
    * **Fair share under contention** (``share``): while another pool's callers wait for a slot
      the broker could not give it, no pool holds more than ``share`` (the broker's slots over
      the processes holding some; at least ``min_size``): slots beyond it go back as they free
      up, and the pool grows no further. Without contention a busy pool may grow past it, to
      ``size``, into slots nobody else asks for.
    """

    size: int
    min_size: int
    idle_s: float
    retry_at: float = 0.0
    period_end: float = 0.0
    ceding: bool = False
    share: int | None = None

    def cap(self) -> int:
        """The most slots the pool may hold now."""
        if self.ceding:
            return self.min_size
        if self.share is not None:
            return min(self.size, max(self.min_size, self.share))
        return self.size

    def grow(self, leased: int, waiting: int, now: float) -> int:
        """Slots to lease now for ``waiting`` callers without a free slot (0: queue instead)."""
        if now < self.retry_at:
            return 0
        return max(0, min(self.cap() - leased, waiting))

    def refused(self, now: float, wait: float = GROW_RETRY_S) -> None:
        """The broker had no slot to spare: do not ask again for ``wait`` seconds."""
        self.retry_at = now + wait

    def start(self, now: float) -> None:
        """The pool holds slots beyond ``min_size`` again: a new idle period begins."""
        self.period_end = now + self.idle_s

    def to_return(self, leased: int, free: int, idle: int, now: float) -> int:
        """Slots to give back now: ``free`` slots on the stack, ``idle`` of them unused since
        the period began (the low-water mark). Ceding or contended: every free one beyond
        :meth:`cap`; then, at the end of a period, the idle ones down to ``min_size`` (and a
        new period begins)."""
        over = max(0, min(free, leased - self.cap()))
        if now < self.period_end:
            return over
        self.period_end = now + self.idle_s
        return max(over, min(idle, leased - self.min_size))


__all__ = ["GROW_RETRY_S", "IDLE_S", "LOCK_RETRY_S", "TICK_S", "LeasePlan"]
