"""One pool per event loop: the policy every store follows for its async methods.

A ``RecallPool`` belongs to the loop that opened it (its futures, poller and waiter wake that
loop), so a store used from several loops (``asyncio.run`` twice, a loop per thread) needs one pool
for each. :class:`LoopPools` opens a loop's pool on the first use there; concurrent first calls in
that loop share one opening, and one that fails or is cancelled is forgotten, so the next call
tries again. A pool whose loop has since closed can no longer be closed politely: it is terminated
(its slots go back to the sidecar) the next time the store is used or closed, from any loop or
thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar


class Closable(Protocol):
    """What the policy needs of a pool (``RecallPool`` has it)."""

    async def close(self) -> None: ...

    def terminate(self) -> None: ...


P = TypeVar("P", bound=Closable)


class LoopPools(Generic[P]):
    """The pools a store opened, one per event loop that used it. Thread-safe."""

    def __init__(self, open_pool: Callable[[], Coroutine[Any, Any, P]]) -> None:
        self._open = open_pool
        self._lock = threading.Lock()
        self._tasks: dict[asyncio.AbstractEventLoop, asyncio.Task[P]] = {}

    async def get(self) -> P:
        """The running loop's pool, opened on first use (no time limit of its own: opening waits
        as the pool's ``connect_timeout`` says). Raises what opening raises (BrokerUnavailable,
        ...). Cancelling a caller does not cancel an opening that other callers share."""
        loop = asyncio.get_running_loop()
        self.reap()
        with self._lock:
            task = self._tasks.get(loop)
            if task is None:
                task = self._tasks[loop] = loop.create_task(self._open())
                task.add_done_callback(self._forget_failed)
        return await asyncio.shield(task)

    def opened(self) -> P | None:
        """An open pool of any loop (None if none is)."""
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                return task.result()
        return None

    def loops(self) -> int:
        """How many loops hold a pool (or an opening)."""
        with self._lock:
            return len(self._tasks)

    async def aclose(self) -> None:
        """Close the running loop's pool, if one was opened there: waits for its requests (as
        ``RecallPool.close``, which falls back to terminating it if cancelled)."""
        with self._lock:
            task = self._tasks.pop(asyncio.get_running_loop(), None)
        if task is None:
            return
        try:
            pool = await task
        except Exception:  # it never opened: nothing to close
            return
        await pool.close()

    def reap(self) -> None:
        """Terminate the pools of loops that have closed."""
        with self._lock:
            gone = [self._tasks.pop(loop) for loop in list(self._tasks) if loop.is_closed()]
        for task in gone:
            _terminate(task)

    def _forget_failed(self, task: asyncio.Task[P]) -> None:
        """A failed or cancelled opening is dropped (the next call opens again); reading its
        exception here keeps asyncio from reporting it as never retrieved."""
        if task.cancelled() or task.exception() is not None:
            with self._lock:
                for loop in [lp for lp, t in self._tasks.items() if t is task]:
                    del self._tasks[loop]


def _terminate(task: asyncio.Task[P]) -> None:
    """Terminate the pool of a loop that has ended, if it opened."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return
    try:
        task.result().terminate()
    except RuntimeError:  # it touched its closed loop: its leases go when the process exits
        pass
