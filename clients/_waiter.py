"""The waiter thread of an asyncio pool: it blocks on one slot's response semaphore while the
loop has nothing better to do, and wakes the loop (:class:`Waiter`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from ..broker.errors import BrokerUnavailable
from ._slots import ClientSlot


class Waiter:
    """The thread that blocks on the response semaphore of one slot while an asyncio pool has
    nothing better to do, and wakes the loop with ``call_soon_threadsafe``.

    It never consumes an answer (it posts it back: :meth:`ClientSlot.wait_no_consume`), so the
    loop stays the only reader of responses. If waiting fails (the semaphore is gone or broke),
    ``on_error`` gets a BrokerUnavailable on the loop and the thread ends: callers are failed,
    never left hanging.

    A wait outlives :meth:`disarm` by up to its timeout, so a slot the thread may still wait on
    (:meth:`holds`) must keep its lease and its semaphores: given back meanwhile, the slot could
    be leased by another process whose answer this thread would take, and with the handle closed
    it could not post it back (that process would wait for its answer forever)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_wake: Callable[[], None],
        on_error: Callable[[BrokerUnavailable], None],
    ) -> None:
        self._loop = loop
        self._on_wake = on_wake
        self._on_error = on_error
        self._cv = threading.Condition()
        self._target: ClientSlot | None = None
        self._on: ClientSlot | None = None  # the slot the thread waits on now (past disarm too)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kalos-pool-waiter", daemon=True)
        self._thread.start()

    def arm(self, slot: ClientSlot) -> None:
        with self._cv:
            self._target = slot
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._target = None

    def holds(self, slot: ClientSlot) -> bool:
        """Whether the thread is armed on ``slot`` or may still be inside a wait on it: then the
        slot must not be given back (nor its semaphores closed) yet."""
        with self._cv:
            return slot is self._target or slot is self._on

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._target = None
            self._cv.notify()
        # Joined before the semaphores are closed: the thread may be inside sem_timedwait.
        self._thread.join(timeout=2.0)

    def _call(self, fn: Callable[..., None], *args: object) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # loop closed
            return False

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._target is None and not self._closed:
                    self._cv.wait()
                if self._closed or self._target is None:
                    return
                slot = self._on = self._target
            try:
                posted = slot.wait_no_consume(0.05)
            except BrokerUnavailable as e:
                self._call(self._on_error, e)
                return
            finally:
                with self._cv:
                    self._on = None
            if posted:
                with self._cv:  # one wake per arming: the loop re-arms when it waits again
                    if self._target is slot:
                        self._target = None
                if not self._call(self._on_wake):
                    return
