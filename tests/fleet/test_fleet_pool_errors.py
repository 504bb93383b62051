"""Issue 33 items 3 and 4 on a real fleet sidecar (PostgreSQL store): a read given ``after=`` a
position the node has not applied is held by the sidecar, then answered NOT_APPLIED.

3. The async pool's caller gets that answer as ``PositionTimeout`` (what RecallClient raises),
   not ``ResponseTimeout``, under Python 3.10's and 3.11+'s ``asyncio.TimeoutError`` alike.
4. With ``timeout=None``, a held read whose caller was cancelled (``asyncio.wait_for``) no longer
   keeps ``async with RecallPool(...)`` from exiting: close() abandons its slot to the sidecar's
   reaper, which frees it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import slots_free, wait_until
from fleetkit import fleet, fleet_dsn, pg, pg_server  # noqa: F401 (fixtures)

from kalos import KalosTimeout, Position, PositionTimeout, RecallClient, RecallPool

pytestmark = pytest.mark.timeout(180)


class Py310AsyncioTimeout(Exception):
    """``asyncio.TimeoutError`` as Python 3.10 has it: not the builtin TimeoutError."""


@pytest.fixture(params=["py310", "py311+"])
def timeout_semantics(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    cls = Py310AsyncioTimeout if request.param == "py310" else TimeoutError
    monkeypatch.setattr(asyncio, "TimeoutError", cls)
    monkeypatch.setattr(asyncio.exceptions, "TimeoutError", cls)
    assert issubclass(PositionTimeout, asyncio.TimeoutError) == (request.param == "py311+")
    return str(request.param)


def ahead_of(node_name: str) -> Position:
    """A position far past anything the node's store has written: after one write through the
    blocking client, its position plus 10**9 transactions."""
    with RecallClient(node_name, timeout=10) as c:
        w = c.upsert([1], np.ones((1, 16), np.float32), namespace="shared")
    assert isinstance(w.position, Position)
    return Position(w.position.xid + 10**9, 1)


@pytest.mark.asyncio
async def test_the_pool_raises_position_timeout_as_the_blocking_client_does(fleet, timeout_semantics):
    """The issue's call: ``await pool.count(ns, after=<not applied>, timeout=1.0)`` on both
    drivers. Before the fix the pool raised ``ResponseTimeout: no answer within 1.0 s``."""
    node = fleet("a")
    ahead = ahead_of(node.name)
    with RecallClient(node.name) as c:
        with pytest.raises(PositionTimeout, match="NOT_APPLIED.*up to kpos:") as blocking:
            c.count("shared", after=ahead, timeout=1.0)
    for coalesce in (False, True):
        async with RecallPool(node.name, size=2, coalesce=coalesce) as pool:
            calls = {
                "count": lambda: pool.count("shared", after=ahead, timeout=1.0),
                "recall": lambda: pool.recall(
                    np.ones(16, np.float32), k=1, namespace="shared", after=ahead, timeout=1.0
                ),
                "get": lambda: pool.get([1], namespace="shared", after=ahead, timeout=1.0),
            }
            for what, call in calls.items():
                t0 = time.monotonic()
                with pytest.raises(KalosTimeout) as e:
                    await call()
                took = time.monotonic() - t0
                print(
                    f"\n[{timeout_semantics} coalesce={coalesce}] {what}: {type(e.value).__name__} after {took:.3f} s"
                )
                assert type(e.value) is PositionTimeout, f"{what}: {type(e.value).__name__}: {e.value}"
                assert str(e.value).split(":")[0] == str(blocking.value).split(":")[0] == "NOT_APPLIED"
                assert took < 1.0  # answered by the sidecar before the caller's own budget ran out
            assert await pool.count("shared", timeout=10) == 1  # the pool goes on


@pytest.mark.asyncio
async def test_async_with_exits_after_a_cancelled_held_read(fleet, timeout_semantics):
    """Issue 33 item 4, as reported: timeout=None, the held read cancelled by wait_for. Before
    the fix close() waited for it for ever; now the pool closes at once and the sidecar frees the
    abandoned slot (it answers a held read whose client let go of its lease, then reaps it)."""
    node = fleet("a")
    ahead = ahead_of(node.name)

    async def scenario() -> None:
        async with RecallPool(node.name) as pool:  # timeout=None: the default
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pool.count("shared", after=ahead), 1.0)

    t0 = time.monotonic()
    await asyncio.wait_for(scenario(), 60)
    took = time.monotonic() - t0
    print(f"\n[close] async with exited {took:.3f} s after entering (the call was cancelled at 1 s)")
    assert took < 5
    assert wait_until(lambda: slots_free(node.name), 10), "the abandoned slot was not freed"
