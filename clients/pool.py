"""The asyncio driver of the client core: :class:`RecallPool`.

Slots are leased elastically (as asyncpg and psycopg_pool keep between ``min_size`` and
``max_size`` connections): ``min_size`` at open, more up to ``size`` while callers wait for one
and the broker has free slots, given back once idle (:class:`LeasePlan`, pure). Leased slots sit
on a free stack. A call takes a slot, sends its request in it (``clients._exchange``: write, then post) and awaits
a future; one poller task per pool finds answers in and resolves the futures from each exchange's
outcome. The poller checks the slot states between event-loop turns while answers keep coming,
for the window of the spin-then-block policy (``broker.waiting``), then a waiter thread blocks on
the oldest request's response semaphore (the sidecar batches every posted slot, so the oldest
finishes first) and wakes the loop with ``call_soon_threadsafe``; the loop also checks the
sidecar's liveness every ``LIVENESS_S``. An idle pool costs no CPU.

Cancellation and timeouts never leak a slot: a slot whose caller went away stays in flight until
the sidecar answers; the poller then drops the answer and only then frees the slot. Closing never
waits for such a slot: it is abandoned to the sidecar's reaper, which frees it once answered.

What the pool drives, each written once: ``clients._attach`` (attach, re-attach after an outage,
detach), ``clients._send`` (a request from a slot to its answer; ``clients._exchange``: one request
in one slot), ``clients._queue`` (the coalescing queue), ``clients._writes`` (a write of several
chunks), ``broker.waiting`` (spin, then block). Its state and decisions are pure modules':
``clients._core`` (life, requests in flight, tallies, outages), ``clients._freestack`` (free
slots and the callers waiting for one), ``clients._backlog`` (the queue), ``clients._leaseplan``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..broker.errors import BrokerUnavailable, ClosedError, ConfigError, KalosError
from ..broker.layout import Layout, Op
from ..broker.slotpath import SlotPath
from ..broker.waiting import DEFAULT_SPIN_US, MAX_SPIN_US, SpinThenBlock
from ._attach import Attacher, Attachment, drive_async
from ._core import ClientCore, Life, PoolStatistics, Step
from ._elastic import Leases
from ._fanout import write_chunks
from ._forks import track, untrack
from ._free import FreeSlots
from ._leaseplan import IDLE_S, LeasePlan
from ._life import PoolState
from ._ops import AsyncOps
from ._poller import LIVENESS_S, Poller
from ._queue import CoalescingQueue, Waiting
from ._requests import (
    DEFAULT,
    FastRows,
    NamespaceCache,
    Prepared,
    Timeout,
    fast_rows,
    resolve_timeout,
)
from ._send import Sender
from ._transport import Connection
from ._writes import settle
from .results import Written

R = TypeVar("R")
#: Default ``close_timeout``: how long close() waits for callers still waiting on an answer.
CLOSE_TIMEOUT_S = 10.0
log = logging.getLogger("kalos.clients.pool")


# Bound once for the per-call checks: reading an enum member off its class costs ~50 ns on
# CPython 3.11.
_OPEN = PoolState.OPEN


class RecallPool(AsyncOps):
    """A pool of leased slots of one broker, for asyncio (default loop or uvloop).

    **Elastic leases.** :meth:`open` leases ``min_size`` slots (default 1; fewer free than that:
    it waits within ``connect_timeout`` for other pools to give slots back, then
    SlotsExhausted, naming the sidecar's ``--slots``). A call that finds no free slot leases
    another, up to ``size`` (at most the sidecar's slot count, else ConfigError at open), while
    the broker has one free; when it has none, the call queues for the pool's own slots (within
    its timeout: AcquireTimeout) and the pool asks again every ``GROW_RETRY_S`` while callers
    wait (``statistics().refused`` counts the refusals). Slots beyond ``min_size`` go back to the
    broker once unused for ``idle_s`` seconds (default 3), and at once, as they free up, while
    another process waits for its first slot. So idle pools hold ``min_size`` slots each, and a
    busy one grows to what it uses (README, "Sizing": slots against worker processes).
    ``timeout`` is the default time budget in seconds for each call (None: no limit; a dead
    sidecar is still detected within about a tenth of a second). ``close_timeout``: how long
    :meth:`close` waits for callers still waiting on an answer (None: as long as they wait).
    ``spin_us`` and ``max_spin_us`` bound how long the pool polls shared memory after a
    completion before it blocks.
    ``sidecar_uid``: the user the sidecar runs as, if not this process's (its objects must belong
    to it and be closed to other users; raises UntrustedBroker otherwise).

    **Coalescing** (``coalesce=True``; off by default: it pays when one process has many
    concurrent callers, README "API"). A lone recall (a free slot, nothing queued, nothing of
    this pool in flight) is sent at once, in a slot of its own, as without coalescing.
    A recall that would wait anyway, because no slot is free, other recalls are already queued,
    or this pool already has requests in flight (the sidecar is busy with them), is queued
    instead; the queue is sent at the end of the current event-loop turn, or as soon as a slot
    frees up, packing the recalls that share a namespace, payload flag, filter and k class (the
    same k with payloads; k rounded up to a power of two without, each caller getting its own
    first k hits) into one multi-query slot, up to the broker's max_queries rows, oldest first.
    ``recall_many`` calls are packed the same way. Fewer round trips and less Python per recall;
    the sidecar serves the rows in one search, as it would have in one batch. Each caller keeps
    its own semantics: validation (InvalidRequest) happens before it is queued; its timeout
    covers the queue (AcquireTimeout if it was still queued when the budget ran out,
    ResponseTimeout once sent); a caller cancelled or timed out leaves the others untouched
    (its share of the answer is dropped); a shared answer whose payloads overflow the slot's blob
    area is asked again for each caller alone. ``statistics()`` counts calls in ``requests`` and
    round trips in ``posted``; ``coalesced`` counts the recalls that shared a slot. The client
    latency recorded for the sidecar's metrics is each caller's own. ``coalesce=False`` sends
    every recall in its own slot.

    **Restarts.** With ``reconnect=True`` (the default) the pool survives its sidecar: when it
    finds the sidecar dead or stopped, requests in flight fail with BrokerUnavailable (their
    answers can no longer come), and the pool re-attaches to the next sidecar that serves the name
    (jittered backoff, off the event loop's critical path). Calls made meanwhile wait for it
    within their own timeout (then BrokerUnavailable). Reads (recall, recall_many, get, count,
    namespaces, export_page) lost with the old sidecar are sent again to the new one within their
    timeout; writes in flight fail with BrokerUnavailable. A sidecar that comes back with another
    geometry (dim, max_k, max_queries, blob size) is a ProtocolError, not a silent re-attach,
    and one with fewer slots than ``size`` a ConfigError. ``reconnect=False``: the first outage
    breaks the pool for good (BrokerUnavailable), and :meth:`open` does not wait for a sidecar
    that is not there. Upserts and deletes are idempotent: one that failed with
    BrokerUnavailable may or may not have been applied (PartialWrite names the ids when the call
    had several chunks), and retrying it is safe.

    **Processes.** A pool belongs to the process (and event loop) that opened it; after ``fork``
    the child's copy raises ForkedPoolError. Open one pool per worker, after forking. ``connect(name,
    sidecar_uid)`` makes the transport (default: :class:`kalos.clients._transport.Connection`; tests
    inject :class:`kalos.clients.fake.FakeConnection`).
    """

    def __init__(
        self,
        name: str = "default",
        *,
        size: int = 16,
        min_size: int = 1,
        timeout: float | None = None,
        connect_timeout: float = 10.0,
        idle_s: float = IDLE_S,
        close_timeout: float | None = CLOSE_TIMEOUT_S,
        spin_us: float = DEFAULT_SPIN_US,
        max_spin_us: float = MAX_SPIN_US,
        sidecar_uid: int | None = None,
        reconnect: bool = True,
        coalesce: bool = False,
        connect: Callable[[str, int | None], Connection] | None = None,
    ) -> None:
        if size < 1 or min_size < 1 or min_size > size:
            raise ConfigError(f"need 1 <= min_size <= size, got size={size} min_size={min_size}")
        if not idle_s > 0:
            raise ConfigError(f"idle_s must be > 0 seconds, got {idle_s}")
        self.name = name
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._close_timeout = close_timeout
        self._reconnect = reconnect
        self._leases = Leases(size, min_size, idle_s)  # the attachment's slots, elastic
        self._attacher = Attacher(
            connect or _connect,
            name,
            sidecar_uid,
            size=size,
            min_size=min_size,
            for_pool=True,
            rng=random.Random(),
            initial=min_size,
            wait_for_slots=True,
        )
        self._policy = SpinThenBlock(spin_us, max_spin_us)
        # Its life, its exchanges in flight and its tallies: the client core (no I/O).
        self._core: ClientCore[Waiting] = ClientCore(Life(os.getpid()))
        self._life = self._core.life
        self._loop: asyncio.AbstractEventLoop | None = None
        # The send path; its connection is the live attachment's (None during an outage).
        self._sender = Sender(
            name, size, coalesce, reconnect, self._core, self._leases, self._policy, self._unavailable
        )
        self._free: FreeSlots | None = None  # the free slots (the leases': self._leases)
        self._payload_limit = 0  # the sidecar's --payload-limit (bytes)
        self._embed_dim = 0  # the dimension of the sidecar's embedding model (0: none)
        self._features = 0  # the sidecar's header's features (FEATURE_*)
        self._queue: CoalescingQueue | None = None
        self._poller: Poller | None = None  # finds the answers in (set by open())
        self._reattacher: asyncio.Task[None] | None = None
        self._ns = NamespaceCache()
        self._layout: Layout = None  # type: ignore[assignment]  # set by open()
        self._metric = "unknown"  # set by open()
        self._slot_path = SlotPath.PYTHON  # set by open(): the connection's (broker.slotpath)
        self._fast: FastRows | None = None  # the compiled path's vector check

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> RecallPool:
        """Attach to the sidecar and lease ``min_size`` slots.

        Waits up to ``connect_timeout`` seconds for a sidecar that is loading, for slots (the
        sidecar reclaiming them from processes that exited, other pools giving theirs back: they
        do, as they free up, while a process waits for its first), and (with
        ``reconnect=True``) while no sidecar serves the name yet or a dead one is being replaced;
        with ``reconnect=False`` no live sidecar fails at once. Raises BrokerUnavailable (no
        sidecar, or none ready in time), SlotsExhausted (fewer than ``min_size`` slots came free
        in time: other processes hold them), ConfigError (``size`` is above the sidecar's slot
        count), UntrustedBroker, ProtocolError.
        """
        if self._life.state is not PoolState.NEW:
            self._life.open()  # (raises: a pool is opened once)
        loop = self._loop = asyncio.get_running_loop()
        free = self._free = FreeSlots(loop)
        poller = self._poller = Poller(
            loop, self._core, self._policy, self._sender.complete, self._unavailable, self._break
        )
        att = await drive_async(
            self._attacher.attach(
                time.monotonic() + self._connect_timeout, self._reconnect, f"within {self._connect_timeout} s"
            )
        )
        self._layout = att.conn.layout
        self._metric = att.conn.metric
        self._slot_path = att.conn.slot_path.path
        self._fast = fast_rows(att.conn.cslot)
        log.info("kalos pool %r: %s slot path (%s)", self.name, self._slot_path.value, att.conn.slot_path.reason)
        self._queue = self._sender.start(loop, free, poller, self._layout, self._dispatcher_failed)
        self._install(att)
        self._life.open()
        self._leases.open = True
        track(self)  # (a fork's child gets ForkedPoolError from its copy)
        return self

    def _install(self, att: Attachment) -> None:
        """Make an attachment current (``Sender.attach``), with what its sidecar serves."""
        self._sender.attach(att)
        self._payload_limit = att.conn.payload_limit
        self._embed_dim = att.conn.embed_dim
        self._features = att.conn.features

    async def __aenter__(self) -> RecallPool:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def layout(self) -> Layout:
        self._check_usable()
        return self._layout

    @property
    def metric(self) -> str:
        """The sidecar's ``--metric`` (``"dot"``, ``"cosine"`` or ``"l2"``): what the scores mean."""
        self._check_usable()
        return self._metric

    async def close(self, timeout: Timeout = DEFAULT) -> None:
        """Wait for the callers still waiting on an answer (their requests in flight or queued)
        for at most ``timeout`` seconds (default: the pool's ``close_timeout``; None: as long as
        they wait), then :meth:`terminate`: callers left get ClosedError, idle slots go back,
        slots still in flight are abandoned to the sidecar's reaper (freed once answered).
        Requests whose callers went away (cancelled, timed out) are never waited for, whatever
        the sidecar does with them (a read held for a fleet position may never be answered).
        Closing twice is fine. If the wait is cancelled or fails, falls back to terminate."""
        step = self._life.close()
        if step is Step.NOTHING:
            return
        if step is Step.TERMINATE:
            self.terminate()
            return
        self._leases.open = False
        loop = self._loop
        assert loop is not None
        budget = resolve_timeout(timeout, self._close_timeout)
        deadline = None if budget is None else loop.time() + budget
        try:
            while self._life.state is PoolState.CLOSING and self._sender.conn is not None:
                futs = self._sender.callers_waiting()
                left = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - loop.time())
                if not futs or left <= 0:
                    break  # no caller waits (orphans are the reaper's), or the budget ran out
                await asyncio.wait(futs, timeout=left)
                if self._poller is not None:
                    self._poller.resume()  # (answers in flight are still found)
        except BaseException:
            self.terminate()
            raise
        self.terminate()

    def terminate(self) -> None:
        """Close now: pending callers get ClosedError; slots still in flight are handed to the
        sidecar's reaper (freed once it has answered them)."""
        if self._life.terminate() is Step.NOTHING:
            return
        untrack(self)
        if self._poller is not None:
            self._poller.cancel()
        if self._reattacher is not None and not self._reattacher.done():
            self._reattacher.cancel()
        self._sender.detach(ClosedError("pool terminated"), give_back=True)
        if self._queue is not None:
            self._queue.fail(ClosedError("pool terminated"))
        if self._free is not None:  # callers waiting for a slot: none will come
            self._free.wake_all(ClosedError("pool terminated"))

    def _forked(self) -> None:
        """In a child after fork: the parent's slots, threads and loop are not ours. Forget them
        without touching shared memory (the parent still uses them)."""
        self._sender.forget()
        self._reattacher = None

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's slots, requests, outages and queue (``PoolStatistics``)."""
        return self._sender.statistics(self._slot_path)

    def spin_window_ns(self) -> int:
        """How long the poller polls after the last completion (``broker.waiting``)."""
        return self._policy.window_ns()

    # ------------------------------------------------------------------ machinery
    def _gate(self) -> None:
        if self._life.state is not _OPEN:
            self._check_usable()

    def _check_usable(self) -> None:
        self._sender.check_usable()

    def _dispatcher_failed(self, e: Exception) -> None:
        """A bug: fail the callers rather than hang them (as the poller does)."""
        self._break(BrokerUnavailable(f"pool dispatcher failed: {type(e).__name__}: {e}"))

    async def _write(self, op: Op, preps: list[Prepared[Written]], budget: Timeout, t0: int) -> Written:
        """Send the chunks of one upsert or delete at once, within one budget (``clients._fanout``;
        every row and payload was checked when they were built)."""
        self._check_usable()
        loop = self._loop
        assert loop is not None
        timeout = resolve_timeout(budget, self._timeout)
        deadline = None if timeout is None else loop.time() + timeout
        return settle(op, preps, await write_chunks(loop, preps, deadline, t0, self._execute))

    async def _execute_all(self, preps: list[Prepared[R]], timeout: Timeout, t0: int) -> list[R]:
        if len(preps) == 1:
            return [await self._execute(preps[0], timeout, t0)]
        # Chunks are timed each from its own sending (t0=0), not from the call: what a chunk
        # waits for a slot behind the call's other chunks is no latency of the broker's.
        return list(await asyncio.gather(*(self._execute(p, timeout, 0) for p in preps)))

    def _execute(self, p: Prepared[R], budget: Timeout, t0: int) -> Coroutine[Any, Any, R]:
        # (not a coroutine itself: the caller awaits the sender's, one frame fewer per recall)
        if self._life.state is not _OPEN:
            self._check_usable()
        return self._sender.execute(p, resolve_timeout(budget, self._timeout), t0)

    # ------------------------------------------------------------------ outages
    def _unavailable(self, exc: BrokerUnavailable) -> None:
        """The sidecar is dead or stopped (or its objects broke). Fail what was in flight, and
        re-attach in the background (or break for good without ``reconnect``)."""
        step = self._core.outage(self._sender.conn is not None, self._reconnect, time.monotonic_ns())
        if step is Step.BREAK:
            self._break(exc)
        if step is not Step.REATTACH:
            return
        # The dead sidecar's segment is gone with it; leases in it need no giving back, but the
        # locks are released by closing the attachment.
        self._sender.detach(
            BrokerUnavailable(f"{exc} (the request was in flight; the pool re-attaches)"), give_back=False
        )
        assert self._loop is not None
        self._reattacher = self._loop.create_task(self._reattach())

    async def _reattach(self) -> None:
        try:
            att = await drive_async(self._attacher.reattach(self._layout))
        except KalosError as e:  # UntrustedBroker, ProtocolError (another geometry), ConfigError
            self._break(e)
            return
        if self._core.reattached(time.monotonic_ns()) is Step.END:
            att.end()
            return
        self._install(att)

    def _break(self, exc: KalosError) -> None:
        """No more service from this pool: fail every caller now; later calls raise ``exc``."""
        self._life.break_(exc)
        self._sender.detach(exc, give_back=True)
        if self._free is not None:
            self._free.wake_all(exc)
        if self._queue is not None:
            self._queue.fail(exc)


def _connect(name: str, sidecar_uid: int | None) -> Connection:
    return Connection(name, sidecar_uid=sidecar_uid)


__all__ = ["DEFAULT_SPIN_US", "IDLE_S", "MAX_SPIN_US", "LeasePlan", "PoolState", "PoolStatistics", "RecallPool"]
