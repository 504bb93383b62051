"""The asyncio pool's write of several chunks (an upsert or delete over the slot's size): every
chunk sent at once within the call's one budget, and after the first failure no further chunk
posted. What became of every id is decided by the pure ``clients._writes.settle``; the blocking
client sends its chunks in turn instead (``clients.blocking``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..broker.errors import KalosError
from ._requests import Prepared
from ._writes import WriteCall, out_of_budget
from .results import Written

#: ``send(prep, timeout, t0)``: the driver's one request (its ``_execute``); raises :class:`Halted`
#: when the chunk is not posted because another chunk of its call failed.
Send = Callable[[Prepared[Written], "float | None", int], Awaitable[Written]]


class Halted(Exception):
    """A write chunk not posted because another chunk of its call failed (not an error)."""


async def write_chunks(
    loop: asyncio.AbstractEventLoop, preps: list[Prepared[Written]], deadline: float | None, t0: int, send: Send
) -> list[Written | KalosError | None]:
    """Each chunk's count, or the KalosError it failed with, or None (not sent). ``deadline``: the
    loop's clock (None: no limit); ``t0``: the call's start, for a lone chunk (several are timed
    each from its own sending: what a chunk waits for a slot behind the others is no latency of
    the broker's)."""
    results: list[Written | KalosError | None] = [None] * len(preps)
    if len(preps) == 1:
        results[0] = await _chunk(loop, preps[0], deadline, t0, send)
        return results
    if not preps:
        return results
    call = WriteCall()
    for p in preps:
        p.call = call
    tasks = [loop.create_task(_chunk(loop, p, deadline, 0, send)) for p in preps]

    def stop_unposted(_done: asyncio.Task[Any]) -> None:
        if call.failed:  # chunks still waiting for a slot (or a sidecar) give up now
            for t, p in zip(tasks, preps):
                if not t.done() and not p.posted:
                    t.cancel()

    for t in tasks:
        t.add_done_callback(stop_unposted)
    settled = await asyncio.gather(*tasks, return_exceptions=True)
    for i, r in enumerate(settled):
        if isinstance(r, (asyncio.CancelledError, Halted)):
            continue  # stopped before it was posted: not sent
        if isinstance(r, BaseException) and not isinstance(r, KalosError):
            raise r  # a bug, not an outcome (_chunk returns Kalos errors)
        results[i] = r
    return results


async def _chunk(
    loop: asyncio.AbstractEventLoop, p: Prepared[Written], deadline: float | None, t0: int, send: Send
) -> Written | KalosError:
    """One chunk of a write: its count, or the KalosError it failed with (an outcome)."""
    now = loop.time()
    try:
        spent = out_of_budget(deadline, now)
        if spent is not None:
            raise spent
        return await send(p, None if deadline is None else deadline - now, t0)
    except KalosError as e:
        if p.call is not None:
            p.call.failed = True
        return e


__all__ = ["Halted", "Send", "write_chunks"]
