"""A client's life, one model for both drivers (``RecallPool`` and ``RecallClient``): its state
(:class:`PoolState`) and what a call in each state raises (:func:`refusal`). Pure."""

from __future__ import annotations

import enum

from ..broker.errors import ClosedError, ForkedPoolError, KalosError


class PoolState(enum.Enum):
    """A client's life: NEW -> OPEN -> CLOSING -> CLOSED; BROKEN from OPEN or CLOSING when it can
    serve no more (an outage with ``reconnect=False``, a sidecar of another geometry, a bug);
    FORKED: the copy of an open client in a forked child. (``RecallClient`` opens in its
    constructor and closes at once: it is never NEW nor CLOSING.)"""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"  # close() waits for what is in flight or queued; no new calls
    CLOSED = "closed"
    BROKEN = "broken"
    FORKED = "forked"


class Driver(enum.Enum):
    """Which driver a refusal speaks of (its words and its remedy)."""

    POOL = "pool"
    CLIENT = "client"


def refusal(
    state: PoolState, broken: KalosError | None, opened_in: int, pid: int, driver: Driver = Driver.POOL
) -> KalosError | None:
    """What a call in ``state`` raises; None when it may go ahead (OPEN). ``broken``: the cause
    of a BROKEN client; ``opened_in`` / ``pid``: the process that opened it, this one."""
    if state is PoolState.OPEN:
        return None
    if state is PoolState.BROKEN and broken is not None:
        return broken
    if state is PoolState.FORKED:
        if driver is Driver.CLIENT:
            return ForkedPoolError(
                f"this client was opened in process {opened_in} and cannot be used in process "
                f"{pid} (a fork): open one in each worker after forking"
            )
        return ForkedPoolError(
            f"this pool was opened in process {opened_in} and cannot be used in process {pid} "
            "(a fork): open a RecallPool in each worker after forking (e.g. in the FastAPI "
            "lifespan or gunicorn's post_fork)"
        )
    if state is PoolState.NEW:
        return ClosedError(f"{driver.value} is not open (use `async with RecallPool(...)` or await open())")
    return ClosedError(f"{driver.value} is {state.value}")


__all__ = ["Driver", "PoolState", "refusal"]
