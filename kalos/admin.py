"""What the admin commands (``kalos namespaces``, ``export``, ``import``) share: one time budget
for the whole command, connecting included, and what to say when no sidecar serves the name.

A command runs as one coroutine under :meth:`Budget.run`; ``asyncio.wait_for`` bounds it, so the
budget holds even while the pool waits between attach attempts, and the pool's own
``connect_timeout`` is what is left of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from enum import Enum
from typing import TypeVar

from kalos.broker.errors import BrokerUnavailable, KalosTimeout
from kalos.clients.pool import RecallPool
from kalos.sidecar_cuda.serving.objects import leftover_names

T = TypeVar("T")
#: Seconds connecting may take when the command has no time budget (RecallPool's default).
CONNECT_S = 10.0


class Phase(Enum):
    STARTING = "starting"
    CONNECTING = "connecting"
    ATTACHED = "attached"


class CommandTimeout(KalosTimeout):
    """A command's ``--timeout`` ran out after it had attached to the sidecar."""


def start_hint(name: str, dim: int | None = None, metric: str | None = None) -> str:
    """A command that starts a sidecar for ``name`` (``--ephemeral``: it needs no path), with the
    ``dim`` and ``metric`` the command needs where it knows them (an import: those of its export),
    else placeholders that say what to put there: a sidecar started without them serves dim 128
    and dot, which fits few models."""
    what = []
    if dim is None:
        what.append("DIM: the length of your vectors")
    if metric is None:
        what.append("METRIC: dot, cosine or l2, your embedding model's similarity")
    return (
        f"start one: `kalos serve --name {name} --ephemeral --dim {dim if dim is not None else 'DIM'} "
        f"--metric {metric if metric is not None else 'METRIC'}` ({'; '.join(what + [''])}memory only; "
        "--data-dir DIR instead of --ephemeral keeps the memories)"
    )


class Budget:
    """The time one command may take, in seconds from :meth:`run` (None: no limit), for broker
    ``name``."""

    def __init__(self, name: str, timeout: float | None, *, dim: int | None = None, metric: str | None = None) -> None:
        self.name = name
        self.timeout = timeout
        self.dim, self.metric = dim, metric  # what the command needs of a sidecar, where known (start_hint)
        self.phase = Phase.STARTING
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def remaining(self) -> float | None:
        return None if self.timeout is None else max(0.0, self.timeout - self.elapsed())

    def run(self, main: Callable[[Budget], Awaitable[T]]) -> T:
        """``main(self)`` on a fresh event loop, within the budget. Raises BrokerUnavailable when
        no sidecar could be attached in time (with :func:`start_hint` when none exists at all),
        CommandTimeout when the budget ran out later, and whatever ``main`` raises."""

        async def bounded() -> T:
            self._t0 = time.monotonic()
            try:
                return await asyncio.wait_for(main(self), self.timeout)
            except KalosTimeout:
                raise
            except asyncio.TimeoutError:  # wait_for's own: the budget ran out
                if self.phase is not Phase.ATTACHED:
                    raise self._unavailable(None) from None
                raise CommandTimeout(f"not done within --timeout {self.timeout:g} s") from None

        return asyncio.run(bounded())

    @asynccontextmanager
    async def pool(self, size: int = 1) -> AsyncIterator[RecallPool]:
        """A pool of ``size`` slots on the broker, attached within what is left of the budget."""
        left = self.remaining()
        pool = RecallPool(self.name, size=size, connect_timeout=CONNECT_S if left is None else left)
        self.phase = Phase.CONNECTING
        try:
            await pool.open()
        except BrokerUnavailable as e:
            raise self._unavailable(e) from None
        self.phase = Phase.ATTACHED
        try:
            yield pool
        finally:
            await pool.close()

    def _unavailable(self, e: BrokerUnavailable | None) -> BrokerUnavailable:
        # Nothing of the name in /dev/shm: no sidecar was started, and the useful answer is the
        # command that starts one. Otherwise the client's reason (loading, dead, untrusted) says more.
        if not leftover_names(self.name):
            return BrokerUnavailable(
                f"no sidecar serves broker {self.name!r} (waited {self.elapsed():.1f} s); "
                f"{start_hint(self.name, self.dim, self.metric)}"
            )
        if e is not None:
            return e
        return BrokerUnavailable(f"broker {self.name!r}: no sidecar became ready within {self.elapsed():.1f} s")


async def list_namespaces(budget: Budget) -> dict[str, int]:
    async with budget.pool() as pool:
        return await pool.namespaces()


__all__ = ["Budget", "CommandTimeout", "Phase", "list_namespaces", "start_hint", "CONNECT_S"]
