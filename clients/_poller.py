"""The asyncio pool's poller: one task that finds answers in for the exchanges in flight
(``ClientCore.inflight``) and hands each to the pool's completion.

While answers keep coming it looks at the slots between event-loop turns, for the spin-then-block
policy's window after the last one (``broker.waiting``: back-to-back requests never pay a wake-up);
then the waiter thread (``clients._waiter``) blocks on the oldest exchange's response semaphore
(the sidecar batches every posted slot, so the oldest finishes first) and sets :attr:`wake`; with
nothing in flight the task ends, so an idle pool costs no CPU. The sidecar's liveness is checked
every ``LIVENESS_S`` while blocked.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from ..broker.errors import BrokerUnavailable, KalosError
from ..broker.waiting import SpinThenBlock
from ._core import ClientCore
from ._exchange import Exchange
from ._life import PoolState
from ._queue import Waiting
from ._transport import Connection
from ._waiter import Waiter

LIVENESS_S = 0.1
_CLOSED = PoolState.CLOSED


class Poller:
    """``complete(ex)``: an answered exchange (out of the in-flight table) for the pool to read
    and resolve; ``unavailable(exc)``: the sidecar was found dead or stopped; ``broke(exc)``: the
    poller itself failed (a bug: the pool breaks, its callers fail rather than hang). The pool
    gives it each attachment's connection and waiter thread (:meth:`attach`, :meth:`detach`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        core: ClientCore[Waiting],
        policy: SpinThenBlock,
        complete: Callable[[Exchange[Any, Waiting]], None],
        unavailable: Callable[[BrokerUnavailable], None],
        broke: Callable[[KalosError], None],
    ) -> None:
        self._loop = loop
        self._core = core
        self._policy = policy
        self._complete = complete
        self._unavailable = unavailable
        self._broke = broke
        self.wake = asyncio.Event()  # set by the waiter thread (on the loop) and by a post
        self.conn: Connection | None = None
        self.waiter: Waiter | None = None
        self._task: asyncio.Task[None] | None = None
        self._blocking = False  # waiting for the waiter thread: a post must wake it
        self._last_check_ns = 0  # last liveness check while answers were DONE but not posted

    def attach(self, conn: Connection, waiter: Waiter) -> None:
        self.conn, self.waiter = conn, waiter

    def detach(self) -> None:
        """The attachment is gone: its waiter thread ends (the task ends on its next pass)."""
        if self.waiter is not None:
            self.waiter.close()
        self.conn = self.waiter = None

    def posted(self) -> None:
        """A request was posted: make sure it is looked for (the running task's next pass finds
        it, unless the task is blocked on the waiter thread)."""
        task = self._task
        if task is None or self._blocking or task.done():
            self.kick()

    def kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run())
        elif self._blocking:
            self.wake.set()

    def idle(self) -> bool:
        return self._task is None or self._task.done()

    def resume(self) -> None:
        """Start the task again if it ended while requests are still in flight."""
        if self._core.inflight and self.idle():
            self.kick()

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def forget(self) -> None:
        """In a forked child: the parent's task and thread are not ours."""
        self._task = None
        self.conn = self.waiter = None

    def reap(self) -> bool:
        """Complete every exchange in flight whose answer is in. Returns True if any was."""
        progressed = False
        core = self._core
        for idx, e in list(core.inflight.items()):
            if not e.slot.answered():
                continue
            self._complete(core.answered(idx))
            progressed = True
        return progressed

    async def _run(self) -> None:
        clock = time.monotonic_ns
        spinning = self._policy.spinning
        life, inflight = self._core.life, self._core.inflight
        try:
            last = clock()
            while life.state is not _CLOSED and self.conn is not None:
                if inflight:
                    if self.reap():
                        last = clock()
                    elif not spinning(clock() - last):
                        await self._block()
                        last = clock()
                        continue
                    else:
                        # Nothing arrived: let another process on this core (the sidecar, other
                        # workers) run before the next look; a no-op when the core is ours.
                        os.sched_yield()
                elif not spinning(clock() - last):
                    return
                await asyncio.sleep(0)
        except BrokerUnavailable as e:
            self._unavailable(e)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug: fail the callers rather than hang them
            self._broke(BrokerUnavailable(f"pool poller failed: {type(e).__name__}: {e}"))
            raise

    async def _block(self) -> None:
        conn, waiter = self.conn, self.waiter
        assert conn is not None and waiter is not None
        self.wake.clear()
        self._blocking = True
        waiter.arm(self._core.oldest().slot)
        try:
            if any(e.slot.is_done() for e in self._core.inflight.values()):
                # Answered while arming, or DONE with its response not posted yet (the sidecar
                # may have died in between): look again shortly, checking liveness on schedule.
                await asyncio.sleep(0.0002)
                now = time.monotonic_ns()
                if now - self._last_check_ns > LIVENESS_S * 1e9:
                    self._last_check_ns = now
                    conn.check_alive()
                return
            try:
                await asyncio.wait_for(self.wake.wait(), LIVENESS_S)
            except asyncio.TimeoutError:  # (an Event raises nothing of its own: only wait_for's)
                conn.check_alive()
        finally:
            self._blocking = False
            if self.waiter is not None:
                self.waiter.disarm()


__all__ = ["LIVENESS_S", "Poller"]
