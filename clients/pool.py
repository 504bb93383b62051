"""The asyncio client pool.

Slots are leased up front (like asyncpg's pool creates its connections) and sit on an
``asyncio.LifoQueue``. A request claims a slot, writes the query in place, posts, and awaits a future.
One poller task per pool resolves the futures:

* **spin phase**: it checks the states of in-flight slots in shared memory between event-loop turns
  (``await asyncio.sleep(0)``) for a bounded window after the last completion: ``spin_us``, widened
  to twice the pool's typical round trip (so a 0.5 ms GPU recall is still caught by polling) but
  never beyond ``max_spin_us``. No threads, no wake-ups: this is what makes a round trip cost only
  a little more than the sidecar's own work.
* **blocking phase**: after the window, a waiter thread blocks on the response semaphore of the
  oldest in-flight slot (the sidecar batches every posted slot, so the oldest finishes first) and
  wakes the loop with ``call_soon_threadsafe``; the loop also checks the sidecar's liveness every
  ``LIVENESS_S``. Idle pools cost no CPU.

Cancellation and timeouts never leak a slot: a slot whose caller went away stays in flight until the
sidecar answers; the poller then discards the answer (its generation no longer has a caller) and only
then puts the slot back on the queue.

**Coalescing** (``coalesce=True``): a recall that would wait anyway (no free slot, other recalls
queued, or requests of this pool already in flight) joins a queue instead of taking a slot of its
own; at the end of the event-loop turn, or when a slot frees up, the queue goes out as few
multi-query slots as its coalescing keys allow, and each slot's answer is split among its callers.
The decisions (which path, which key, which group, how the answer scatters) are the pure
functions of ``clients._coalesce``; this module does the I/O around them.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..broker.errors import (
    AcquireTimeout, BrokerUnavailable, ClosedError, ConfigError, ForkedPoolError, KalosError,
    PayloadTooLarge, ProtocolError, ResponseTimeout, SlotsExhausted,
)
from ..broker.layout import Layout, Op, latency_op
from ..broker.positions import Position
from ._coalesce import Key, Path, Share, coalesce_key, pick_group, route, split
from ._requests import (
    DEFAULT, Timeout, resolve_timeout, NamespaceCache, Prepared, count as encode_count, delete as encode_delete, drop as encode_drop, export_page as encode_export_page, get as encode_get, list_namespaces as encode_list_namespaces, merge_records, read as read_slot, recall as encode_recall, recall_group as encode_recall_group, upsert as encode_upsert, wait_after, write as write_slot,
)
from ._attach import attach, backoff_s
from ._writes import WriteCall, failure, fate
from ._transport import ClientSlot, Connection, Waiter
from .results import Hits, Records, Written, written

LIVENESS_S = 0.1
#: Operations that only read: re-sent after a re-attach if the sidecar went away under them.
_READS = frozenset({Op.RECALL, Op.LIST_NAMESPACES, Op.EXPORT, Op.GET, Op.COUNT})
DEFAULT_SPIN_US = 250.0
MAX_SPIN_US = 2000.0
_NO_IDS = np.empty(0, np.int64)  # a delete by filter names no ids


class _Halted(Exception):
    """A write chunk not posted because another chunk of its call failed (not an error)."""



@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool's state."""

    size: int  # slots leased
    free: int  # slots ready for a new request
    in_flight: int  # posted, not answered yet (includes orphaned)
    orphaned: int  # in flight whose caller was cancelled or timed out
    requests: int  # completed calls (each recall counts once, coalesced or not)
    errors: int  # completed with an error
    outages: int = 0  # times the sidecar was found dead or stopped
    reattaches: int = 0  # times the pool attached to a new sidecar after an outage
    unavailable_s: float = 0.0  # time spent without a sidecar (the current outage included)
    attached: bool = False  # attached to a serving sidecar now
    queued: int = 0  # recalls waiting to be coalesced into a slot
    posted: int = 0  # requests written into a slot and posted (round trips to the sidecar)
    coalesced: int = 0  # completed recalls that shared their slot with other recalls


_POOLS: weakref.WeakSet[RecallPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Pools opened before a fork belong to the parent: the child's copies must never touch the
    parent's slots, so they are marked forked (every use raises ForkedPoolError at once) and
    dropped without giving anything back."""
    for pool in list(_POOLS):
        pool._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(slots=True, eq=False)
class _Member:
    """A recall queued to be coalesced (then riding in a shared slot): its own request, future,
    start time and coalescing key (None: it goes alone)."""

    prep: Prepared
    future: asyncio.Future[Any]
    t0: int
    key: Key | None
    rows: int  # prep.nq (what clients._coalesce.pick_group reads)
    sent: bool = False
    resent: bool = False  # sent once in a shared slot whose payloads overflowed; queued again alone


@dataclass(slots=True)
class _Inflight:
    slot: ClientSlot
    prep: Prepared
    future: asyncio.Future[Any]  # a shared slot: its first member's (each member has its own)
    t0: int
    members: list[_Member] | None = None  # the recalls sharing this slot (None: one caller)

    def futures(self) -> list[asyncio.Future[Any]]:
        return [self.future] if self.members is None else [m.future for m in self.members]

    def orphaned(self) -> bool:
        """Every caller of this request went away (cancelled or timed out)."""
        if self.members is None:
            return self.future.done()
        return all(m.future.done() for m in self.members)


class _FreeSlots:
    """Free slots, the last released first (its cache lines are warm); callers waiting for one are
    served in arrival order, a released slot going straight to the oldest waiter. A cheaper
    ``asyncio.LifoQueue`` for this one use: a slot handed to a waiter that was cancelled or timed
    out meanwhile is put back, never lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slots: list[ClientSlot] = []
        self._current: frozenset[ClientSlot] = frozenset()  # the slots of the live attachment
        self._waiters: deque[asyncio.Future[ClientSlot]] = deque()

    def qsize(self) -> int:
        return len(self._slots)

    def put_nowait(self, slot: ClientSlot) -> None:
        waiters = self._waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(slot)
                return
        self._slots.append(slot)

    def drain(self) -> None:
        """Forget the free slots (their attachment is gone); waiters keep waiting."""
        self._slots.clear()

    def wake_all(self, exc: BaseException) -> None:
        """Fail every waiter with ``exc`` (the pool broke)."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(exc)

    def get_nowait(self) -> ClientSlot | None:
        return self._slots.pop() if self._slots else None

    def add_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Queue ``fut`` for the next released slot, in line with the callers of :meth:`get` (the
        pool's coalescing queue waits as one of them)."""
        self._waiters.append(fut)

    def remove_waiter(self, fut: asyncio.Future[ClientSlot]) -> None:
        """Take ``fut`` out of line (cancelled); a slot it already holds goes to the next one."""
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self.put_nowait(fut.result())
            return
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    async def get(self, timeout: float | None) -> ClientSlot:
        """Wait for a slot; raises TimeoutError after ``timeout`` seconds (None: no limit)."""
        fut: asyncio.Future[ClientSlot] = self._loop.create_future()
        self._waiters.append(fut)
        try:
            if timeout is None:
                return await fut
            return await asyncio.wait_for(fut, timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.put_nowait(fut.result())  # handed to us as we gave up: pass it on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise


class RecallPool:
    """A pool of leased slots of one broker, for asyncio (default loop or uvloop).

    ``size`` slots are leased at :meth:`open` (at most the sidecar's slot count, else ConfigError;
    at least ``min_size``, else SlotsExhausted);
    ``timeout`` is the default time budget in seconds for each call (None: no limit; a dead
    sidecar is still detected within about a tenth of a second). ``spin_us`` and ``max_spin_us``
    bound how long the pool polls shared memory after a completion before it blocks.
    ``sidecar_uid``: the user the sidecar runs as, if not this process's (its objects must belong
    to it and be closed to other users; raises UntrustedBroker otherwise).

    **Coalescing** (``coalesce=True``; off by default: measured on a 2-vCPU host it raised 64
    tasks in one process by a quarter but 64 tasks in four processes by nothing beyond noise, and
    on an H200 at 1M rows it was slower, there measured before multi-row slots took the sidecar's
    uniform route; bench/results/README.md). A lone recall (a free slot, nothing queued,
    nothing of this pool in flight) is sent at once, in a slot of its own, as without coalescing.
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
    within their own timeout (then BrokerUnavailable). Reads (recall, recall_many, namespaces,
    export_page) lost with the old sidecar are sent again to the new one within their timeout;
    writes in flight fail with BrokerUnavailable. A sidecar that comes back with another
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

    def __init__(self, name: str = "default", *, size: int = 16, min_size: int = 1,
                 timeout: float | None = None, connect_timeout: float = 10.0,
                 spin_us: float = DEFAULT_SPIN_US, max_spin_us: float = MAX_SPIN_US,
                 sidecar_uid: int | None = None, reconnect: bool = True, coalesce: bool = False,
                 connect: Callable[[str, int | None], Connection] | None = None) -> None:
        if size < 1 or min_size < 1 or min_size > size:
            raise ConfigError(f"need 1 <= min_size <= size, got size={size} min_size={min_size}")
        self.name = name
        self._size = size
        self._min_size = min_size
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._sidecar_uid = sidecar_uid
        self._connect = connect or _connect
        self._reconnect = reconnect
        self._coalesce = coalesce
        self._queue: list[_Member] = []  # recalls waiting to be coalesced, oldest first
        self._keys: dict[tuple[bytes, int, int], Key] = {}  # coalescing keys of unfiltered recalls
        self._dispatch_soon = False  # a dispatch of the queue is scheduled for this turn
        self._slot_waiter: asyncio.Future[ClientSlot] | None = None  # the queue's place in line
        self._posted = 0
        self._coalesced = 0
        self._rng = random.Random()
        self._payload_limit = 0  # the sidecar's --payload-limit (bytes), set when attached
        self._attached: asyncio.Event | None = None  # set while attached to a serving sidecar
        self._reattacher: asyncio.Task[None] | None = None
        self._outages = 0
        self._reattaches = 0
        self._unavailable_ns = 0
        self._down_since = 0  # monotonic ns when the current outage began (0: none)
        self._pid = os.getpid()
        self._last_check_ns = 0  # last liveness check while answers were DONE but not posted
        self._spin_ns = int(spin_us * 1000)
        self._max_spin_ns = max(self._spin_ns, int(max_spin_us * 1000))
        self._rt_ewma_ns = 0.0  # typical post -> answer time of this pool
        self._conn: Connection | None = None
        self._slots: list[ClientSlot] = []
        self._free: _FreeSlots | None = None
        self._inflight: dict[int, _Inflight] = {}
        self._poller: asyncio.Task[None] | None = None
        self._waiter: Waiter | None = None
        self._wake: asyncio.Event | None = None
        self._blocking = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "new"  # new -> open -> closing -> closed; "forked" in a child process
        self._broken: KalosError | None = None
        self._requests = 0
        self._errors = 0
        self._ns = NamespaceCache()
        self._layout: Layout = None  # type: ignore[assignment]  # set by open()
        self._metric = "unknown"  # set by open()

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> RecallPool:
        """Attach to the sidecar and lease slots.

        Waits up to ``connect_timeout`` seconds for a sidecar that is loading, for slots the
        sidecar is reclaiming from processes that exited, and (with ``reconnect=True``) while no
        sidecar serves the name yet or a dead one is being replaced; with ``reconnect=False`` no
        live sidecar fails at once. Raises BrokerUnavailable (no sidecar, or none ready in time),
        SlotsExhausted (other processes hold the slots: fewer than ``min_size`` are free),
        ConfigError (``size`` is above the sidecar's slot count), UntrustedBroker, ProtocolError.
        """
        if self._state != "new":
            raise ClosedError(f"pool is {self._state}: a pool is opened once")
        self._loop = asyncio.get_running_loop()
        self._free = _FreeSlots(self._loop)
        self._wake = asyncio.Event()
        self._attached = asyncio.Event()
        conn, slots = await self._attach(time.monotonic() + self._connect_timeout,
                                         self._reconnect, f"within {self._connect_timeout} s")
        self._layout = conn.layout
        self._metric = conn.metric
        self._install(conn, slots)
        self._state = "open"
        _POOLS.add(self)
        return self

    async def _attach(self, deadline: float | None, wait_for_sidecar: bool,
                      within: str) -> tuple[Connection, list[ClientSlot]]:
        """Drive :func:`clients._attach.attach` on the loop (its pauses are asyncio sleeps)."""
        steps = attach(self._connect, self.name, self._sidecar_uid, size=self._size,
                       min_size=self._min_size, deadline=deadline,
                       wait_for_sidecar=wait_for_sidecar, within=within, clock=time.monotonic,
                       rng=self._rng, for_pool=True)
        try:
            while True:
                await asyncio.sleep(next(steps))
        except StopIteration as done:
            return cast("tuple[Connection, list[ClientSlot]]", done.value)
        finally:
            steps.close()  # cancelled while pausing: the half-made attachment is closed

    def _install(self, conn: Connection, slots: list[ClientSlot]) -> None:
        """Make an attachment current: its slots free, its waiter thread started."""
        assert self._loop is not None and self._free is not None and self._wake is not None
        assert self._attached is not None
        self._conn = conn
        self._slots = slots
        self._current = frozenset(slots)
        for s in slots:
            self._free.put_nowait(s)
        self._payload_limit = conn.payload_limit
        self._waiter = conn.waiter(self._loop, self._wake.set, self._unavailable)
        self._attached.set()

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

    async def close(self) -> None:
        """Wait for in-flight requests, then give the slots back. Closing twice is fine. If the
        wait is cancelled or fails, falls back to :meth:`terminate`."""
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        if self._state == "forked":
            return
        self._state = "closing"
        try:
            while ((self._inflight or self._live_queue()) and self._broken is None
                   and self._conn is not None):
                futs = [f for e in self._inflight.values() for f in e.futures() if not f.done()]
                futs += [m.future for m in self._queue if not m.future.done()]
                if futs:
                    await asyncio.wait(futs, timeout=LIVENESS_S)
                else:
                    await asyncio.sleep(0.001)
                if self._poller is None or self._poller.done():
                    self._kick()
        except BaseException:
            self.terminate()
            raise
        self.terminate()

    def terminate(self) -> None:
        """Close now: pending callers get ClosedError; slots still in flight are handed to the
        sidecar's reaper (freed once it has answered them)."""
        if self._state in ("closed", "forked"):
            self._state = "closed"
            return
        self._state = "closed"
        _POOLS.discard(self)
        for task in (self._poller, self._reattacher):
            if task is not None and not task.done():
                task.cancel()
        self._detach(ClosedError("pool terminated"), give_back=True)
        self._fail_queue(ClosedError("pool terminated"))

    def _detach(self, exc: KalosError, *, give_back: bool) -> None:
        """Drop the current attachment: callers in flight get ``exc``; the leases go back (idle
        slots freed, busy ones abandoned to the reaper) when ``give_back``."""
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        busy = [e.slot for e in self._inflight.values()]
        for e in self._inflight.values():
            if e.prep.call is not None:
                e.prep.call.failed = True  # its call's other chunks are not posted (_write)
            for f in e.futures():
                if not f.done():
                    f.set_exception(copy.copy(exc))
        self._inflight.clear()
        if self._free is not None:
            self._free.drain()
        if self._attached is not None:
            self._attached.clear()
        conn, self._conn, slots, self._slots = self._conn, None, self._slots, []
        self._current = frozenset()
        if conn is not None:
            busy_idx = {s.index for s in busy}
            try:
                if give_back:
                    conn.give_back([s for s in slots if s.index not in busy_idx], busy)
            except BrokerUnavailable:
                pass  # the sidecar's objects are gone: so are the leases
            finally:
                conn.close()

    def _forked(self) -> None:
        """In a child after fork: the parent's slots, threads and loop are not ours. Forget them
        without touching shared memory (the parent still uses them)."""
        self._state = "forked"
        self._conn = None
        self._slots = []
        self._inflight = {}
        self._queue = []
        self._slot_waiter = None
        self._waiter = None
        self._poller = self._reattacher = None

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            size=len(self._slots), free=self._free.qsize() if self._free else 0,
            in_flight=len(self._inflight),
            orphaned=sum(1 for e in self._inflight.values() if e.orphaned()),
            requests=self._requests, errors=self._errors, outages=self._outages,
            reattaches=self._reattaches,
            unavailable_s=(self._unavailable_ns + (time.monotonic_ns() - self._down_since
                                                   if self._down_since else 0)) / 1e9,
            attached=self._conn is not None, queued=self._live_queue(), posted=self._posted,
            coalesced=self._coalesced)

    # ------------------------------------------------------------------ public operations
    async def recall(self, vector: Any, k: int = 10, *, namespace: str = "default",
                     timeout: Timeout = DEFAULT, with_payload: bool = False,
                     where: dict[str, Any] | None = None, after: Position | str | None = None) -> Hits:
        """Exact top-``k`` of one vector (shape (dim,)) in ``namespace``, best first.

        ``where``: only records whose payload matches the filter (README, "Filters"); fewer than
        ``k`` hits when fewer match, none when nothing does.

        ``after``: a write's ``Written.position`` (from any node of a fleet sharing one
        PostgreSQL store): served once this sidecar has applied the change log up to it, within
        ``timeout`` (then PositionTimeout, a ResponseTimeout). No wait without a fleet store.

        ``timeout`` (seconds, None = no limit; default: the pool's) covers waiting for a free slot
        and for the answer. Raises InvalidRequest (bad vector/k/namespace name, before anything is
        sent), UnknownNamespace, AcquireTimeout, ResponseTimeout, BrokerUnavailable, ClosedError.
        """
        t0 = time.monotonic_ns()
        if self._state != "open" or self._broken is not None:
            self._check_usable()
        p = encode_recall(self._layout, vector, k, self._ns.encode(namespace), with_payload,
                             single=True, where=where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast(Hits, await self._execute(p, timeout, t0))

    async def recall_many(self, vectors: Any, k: int = 10, *, namespace: str = "default",
                          timeout: Timeout = DEFAULT, with_payload: bool = False,
                          where: dict[str, Any] | None = None,
                          after: Position | str | None = None) -> list[Hits]:
        """Top-``k`` for each row of ``vectors`` (n, dim), n <= the broker's max_queries, in one
        slot and one round trip (``where``: one filter for every row; ``after``: as in
        :meth:`recall`). Same errors as :meth:`recall`."""
        t0 = time.monotonic_ns()
        self._check_usable()
        p = encode_recall(self._layout, vectors, k, self._ns.encode(namespace), with_payload,
                             single=False, where=where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast("list[Hits]", await self._execute(p, timeout, t0))

    async def upsert(self, ids: Any, vectors: Any, payloads: list[Any] | None = None, *,
                     namespace: str = "default", timeout: Timeout = DEFAULT) -> Written:
        """Insert or replace records (vector and payload together); returns the rows written
        (a :class:`Written`: an int with the fleet ``position`` of the write, for ``after=``).

        ``vectors``: shape (n, dim), one row per id (README, "Vectors"); duplicate ids: the last
        wins. Every row, id and payload is checked before anything is sent (InvalidRequest,
        PayloadTooLarge). Rows go in chunks (max_queries rows, a slot's blob area of payloads),
        concurrently over the pool's slots; each chunk is durable (with ``--data-dir``) before
        it is acknowledged (with ``--data-dir`` or ``--store``); a payload over the sidecar's
        ``--payload-limit`` (read from its header) fails the call before anything is sent. ``timeout`` (seconds, None = no limit) is one budget for
        the whole call. A failure after part of the call was applied (an outage, a store failure
        or the budget running out between chunks) raises PartialWrite, also an instance of the
        error that stopped it (BrokerUnavailable, ServerError, KalosTimeout ...), naming the ids
        written, not written and in doubt.
        """
        t0 = time.monotonic_ns()
        preps = encode_upsert(self.layout, ids, vectors, payloads, namespace, self._payload_limit)
        return await self._write(Op.UPSERT, preps, timeout, t0)

    async def delete(self, ids: Any = None, *, where: dict[str, Any] | None = None,
                     namespace: str = "default", timeout: Timeout = DEFAULT) -> Written:
        """Delete records by id, or every record whose payload matches ``where`` (one of the two);
        returns how many existed (a :class:`Written`, as :meth:`upsert`). Unknown ids/namespace: 0, no error. More ids than max_queries
        go in chunks, as for :meth:`upsert` (PartialWrite if the call fails part way)."""
        t0 = time.monotonic_ns()
        preps = encode_delete(self.layout, ids, namespace, where)
        return await self._write(Op.DELETE, preps, timeout, t0)

    async def get(self, ids: Any, *, namespace: str = "default", with_vectors: bool = True,
                  timeout: Timeout = DEFAULT, after: Position | str | None = None) -> Records:
        """The records of ``ids`` that exist, in the order asked (id, vector as stored, payload),
        and the ids that do not (``Records.missing``; not an error). More ids than max_queries are
        sent in chunks, concurrently. Raises InvalidRequest (bad ids, before anything is sent),
        UnknownNamespace, PayloadTooLarge (the payloads of one chunk exceed the slot's blob area),
        and the errors of :meth:`recall`."""
        t0 = time.monotonic_ns()
        preps = encode_get(self.layout, ids, namespace, with_vectors)
        if after is not None:  # (``after``: as in :meth:`recall`)
            wait_after(preps, after, t0, resolve_timeout(timeout, self._timeout))
        parts = cast("list[Records]", await self._execute_all(preps, timeout, t0))
        return merge_records(preps, parts, self.layout.dim)

    async def drop_namespace(self, namespace: str, *, timeout: Timeout = DEFAULT) -> Written:
        """Remove a namespace and all its records; returns the rows it held (0 if unknown; a
        :class:`Written`, as :meth:`upsert`)."""
        return cast(Written, await self._execute(encode_drop(namespace), timeout, time.monotonic_ns()))

    async def namespaces(self, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Every namespace with its row count."""
        return cast("dict[str, int]", await self._execute(encode_list_namespaces(), timeout,
                                                           time.monotonic_ns()))

    async def export_page(self, namespace: str, after: int = -1, *,
                          where: dict[str, Any] | None = None,
                          timeout: Timeout = DEFAULT) -> tuple[Any, Any, list[Any]]:
        """Up to max_queries records with id > ``after`` in ascending id order (those matching
        ``where``, if given): (ids int64, vectors float32 as stored, payloads). Raises
        UnknownNamespace."""
        return cast("tuple[Any, Any, list[Any]]", await self._execute(
            encode_export_page(self.layout, namespace, after, where), timeout, time.monotonic_ns()))

    async def count(self, namespace: str = "default", where: dict[str, Any] | None = None, *,
                    timeout: Timeout = DEFAULT, after: Position | str | None = None) -> int:
        """Records in ``namespace`` (those matching ``where``, if given; ``after``: as in
        :meth:`recall`). Raises UnknownNamespace."""
        t0 = time.monotonic_ns()
        p = encode_count(self.layout, namespace, where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast(int, await self._execute(p, timeout, t0))

    # ------------------------------------------------------------------ machinery
    def _down_error(self) -> BrokerUnavailable:
        """What a caller whose budget ran out during an outage gets."""
        return BrokerUnavailable(
            f"broker {self.name!r}: no sidecar within the time budget (down for "
            f"{(time.monotonic_ns() - self._down_since) / 1e9:.2f} s; the pool "
            "re-attaches as soon as one serves the name)")

    def _check_usable(self) -> None:
        if self._state != "open":
            if self._state == "forked":
                raise ForkedPoolError(
                    f"this pool was opened in process {self._pid} and cannot be used in process "
                    f"{os.getpid()} (a fork): open a RecallPool in each worker after forking "
                    "(e.g. in the FastAPI lifespan or gunicorn's post_fork)")
            raise ClosedError(f"pool is {self._state}" if self._state != "new" else
                              "pool is not open (use `async with RecallPool(...)` or await open())")
        if self._broken is not None:
            raise self._broken

    async def _write(self, op: Op, preps: list[Prepared], budget: Timeout, t0: int) -> Written:
        """Send the chunks of one upsert or delete within one budget, at once (every row and
        payload was checked when they were built). After the first failure no
        further chunk is posted; the chunks in flight are awaited, and the error says what
        became of every id (clients._writes.failure)."""
        self._check_usable()
        loop = self._loop
        assert loop is not None
        timeout = resolve_timeout(budget, self._timeout)
        deadline = None if timeout is None else loop.time() + timeout
        if len(preps) > 1:
            t0 = 0  # each chunk timed from its own sending (_execute_once), not from the call
        results: list[Any] = [None] * len(preps)
        rest = list(range(len(preps)))
        if len(rest) == 1:
            results[rest[0]] = await self._chunk(preps[rest[0]], deadline, t0)
        elif rest:
            call = WriteCall()
            for i in rest:
                preps[i].call = call
            tasks = [loop.create_task(self._chunk(preps[i], deadline, t0)) for i in rest]

            def stop_unposted(_done: asyncio.Task[Any]) -> None:
                if call.failed:  # chunks still waiting for a slot (or a sidecar) give up now
                    for t, i in zip(tasks, rest):
                        if not t.done() and not preps[i].posted:
                            t.cancel()

            for t in tasks:
                t.add_done_callback(stop_unposted)
            settled = await asyncio.gather(*tasks, return_exceptions=True)
            for i, r in zip(rest, settled):
                if isinstance(r, (asyncio.CancelledError, _Halted)):
                    continue  # stopped before it was posted: not sent
                if isinstance(r, BaseException) and not isinstance(r, KalosError):
                    raise r  # a bug, not an outcome (_chunk returns Kalos errors)
                results[i] = r
        if all(isinstance(r, int) for r in results):
            return written(results)
        cause = next(r for r in results if isinstance(r, KalosError))
        fates = [fate(isinstance(r, int), p.posted, p.status) for p, r in zip(preps, results)]
        err = failure(op, cause, [p.ids if p.ids is not None else _NO_IDS for p in preps], fates)
        if err is cause:
            raise cause
        raise err from cause

    async def _chunk(self, p: Prepared, deadline: float | None, t0: int) -> Any:
        """One chunk of a write: its count, or the KalosError it failed with (an outcome)."""
        assert self._loop is not None
        left = None if deadline is None else deadline - self._loop.time()
        try:
            if left is not None and left <= 0:  # never post what nobody will wait for
                raise AcquireTimeout("the call's time budget ran out before this part was sent")
            return await self._execute(p, left, t0)
        except KalosError as e:
            if p.call is not None:
                p.call.failed = True
            return e

    async def _execute_all(self, preps: list[Prepared], timeout: Timeout, t0: int) -> list[Any]:
        if len(preps) == 1:
            return [await self._execute(preps[0], timeout, t0)]
        # Chunks are timed each from its own sending (t0=0), not from the call: what a chunk
        # waits for a slot behind the call's other chunks is no latency of the broker's.
        return list(await asyncio.gather(*(self._execute(p, timeout, 0) for p in preps)))

    async def _acquire(self, deadline: float | None) -> ClientSlot:
        """A free slot of the current attachment, waiting (within ``deadline``) for one to be
        answered or for a sidecar to re-attach to."""
        assert self._free is not None and self._loop is not None
        while True:
            slot = self._free.get_nowait()
            if slot is None:
                try:
                    slot = await self._free.get(None if deadline is None
                                                else max(0.0, deadline - self._loop.time()))
                except asyncio.TimeoutError:
                    self._check_usable()
                    if self._conn is None:
                        raise self._down_error() from None
                    raise AcquireTimeout(f"no free slot within the time budget ({len(self._slots)} "
                                         "slots, all in flight)") from None
            if self._state != "open" or self._broken is not None:
                self._free.put_nowait(slot)
                self._check_usable()
            if self._conn is not None and slot in self._current:  # not a slot of a dead attachment
                return slot

    async def _execute(self, p: Prepared, budget: Timeout, t0: int) -> Any:
        self._check_usable()
        loop = self._loop
        assert loop is not None and self._free is not None
        timeout = resolve_timeout(budget, self._timeout)
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            try:
                if (self._coalesce and p.op is Op.RECALL and p.after is None
                        and route(True, len(self._queue), self._free.qsize(), len(self._inflight))
                        is Path.QUEUE):
                    return await self._execute_queued(p, timeout, deadline, t0)
                return await self._execute_once(p, timeout, deadline, t0)
            except BrokerUnavailable:
                # A read lost to a sidecar that went away (in flight, or posted just before the
                # pool noticed) is sent again once the pool has re-attached, within the same
                # budget: reads are idempotent. Writes are not retried (they may have been
                # applied; retrying them is the caller's call, and safe).
                if not (self._reconnect and p.op in _READS and self._broken is None
                        and self._state == "open"
                        and (deadline is None or loop.time() < deadline)):
                    raise

    async def _execute_once(self, p: Prepared, timeout: float | None,
                            deadline: float | None, t0: int) -> Any:
        loop = self._loop
        assert loop is not None and self._free is not None
        slot = await self._acquire(deadline)
        if p.call is not None and p.call.failed:
            self._free.put_nowait(slot)
            raise _Halted  # another chunk of this write failed: this one is not sent
        conn = self._conn
        assert conn is not None
        if conn.quiet():  # the heartbeat is late: is the sidecar still there before we post?
            try:
                conn.check_alive()
            except BrokerUnavailable as e:
                self._free.put_nowait(slot)
                self._unavailable(e)
                raise
        try:
            blob_len = write_slot(slot.view, p)
            slot.post(p.op, p.ns, p.k, p.nq, p.flags, blob_len, t0)
        except BaseException:
            slot.set_free()
            self._free.put_nowait(slot)
            raise
        p.posted = True
        fut: asyncio.Future[Any] = loop.create_future()
        # t0 == 0: a chunk of a bulk call, timed from its sending (see _execute_all).
        self._inflight[slot.index] = _Inflight(slot, p, fut, t0 or time.monotonic_ns())
        self._posted += 1
        self._kick()
        if deadline is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise ResponseTimeout(f"no answer within {timeout} s (request stays in flight until the "
                                  "sidecar finishes it; the slot is then reused)") from None

    # ------------------------------------------------------------------ coalescing
    async def _execute_queued(self, p: Prepared, timeout: float | None,
                              deadline: float | None, t0: int) -> Any:
        """Queue a recall to be sent with others (see the class docstring) and await its share."""
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[Any] = loop.create_future()
        m = _Member(p, fut, t0, self._key_of(p), p.nq)
        self._queue.append(m)
        self._schedule_dispatch()
        try:
            if deadline is None:
                return await fut
            return await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError as e:
            if isinstance(e, KalosError):  # the caller's own error, not the budget running out
                raise
            if m.sent:
                raise ResponseTimeout(f"no answer within {timeout} s (request stays in flight until "
                                      "the sidecar finishes it; the slot is then reused)") from None
            self._unqueue(m)
            self._check_usable()
            if self._conn is None:
                raise self._down_error() from None
            if m.resent:
                raise ResponseTimeout(f"no answer within {timeout} s (sent in a shared slot whose "
                                      "payloads overflowed it, then queued again alone)") from None
            raise AcquireTimeout(f"not sent within the time budget (queued to be coalesced; "
                                 f"{len(self._slots)} slots, {self._free_count()} free)") from None
        except BaseException:
            if not m.sent:
                self._unqueue(m)
            raise

    def _key_of(self, p: Prepared) -> Key:
        """The coalescing key of a recall; one object per (namespace, flags, k) for unfiltered
        ones (cached: most recalls of a pool share a few), computed for filtered ones."""
        if p.blob:
            return coalesce_key(p.ns, p.flags, p.blob, p.k, self._layout.max_k)
        ck = (p.ns, p.flags, p.k)
        key = self._keys.get(ck)
        if key is None:
            key = coalesce_key(p.ns, p.flags, b"", p.k, self._layout.max_k)
            if len(self._keys) < 4096:
                self._keys[ck] = key
        return key

    def _free_count(self) -> int:
        return self._free.qsize() if self._free is not None else 0

    def _unqueue(self, m: _Member) -> None:
        """Take a caller that went away out of the queue; with no caller left, the queue leaves
        the line for a slot (so the free count is restored at once, as for a plain caller)."""
        try:
            self._queue.remove(m)
        except ValueError:
            pass
        w = self._slot_waiter
        if w is not None and not self._live_queue() and self._free is not None:
            self._slot_waiter = None
            self._free.remove_waiter(w)

    def _live_queue(self) -> int:
        return sum(1 for m in self._queue if not m.future.done())

    def _fail_queue(self, exc: BaseException) -> None:
        queue, self._queue = self._queue, []
        w, self._slot_waiter = self._slot_waiter, None
        if w is not None and self._free is not None:
            self._free.remove_waiter(w)
        for m in queue:
            if not m.future.done():
                m.future.set_exception(copy.copy(exc))

    def _schedule_dispatch(self) -> None:
        """Send the queue at the end of this event-loop turn (once, however many join it)."""
        if not self._dispatch_soon:
            self._dispatch_soon = True
            assert self._loop is not None
            self._loop.call_soon(self._dispatch_now)

    def _dispatch_now(self) -> None:
        self._dispatch_soon = False
        self._dispatch_guarded(None)

    def _on_slot(self, fut: asyncio.Future[ClientSlot]) -> None:
        """The queue's turn in line for a slot came (or the pool broke while it waited)."""
        if self._slot_waiter is not fut:
            return  # withdrawn (its slot, if it got one, was passed on then)
        self._slot_waiter = None
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._fail_queue(exc)
            return
        self._dispatch_guarded(fut.result())

    def _dispatch_guarded(self, slot: ClientSlot | None) -> None:
        try:
            self._dispatch(slot)
        except Exception as e:  # a bug: fail the callers rather than hang them (as the poller)
            self._break(BrokerUnavailable(f"pool dispatcher failed: {type(e).__name__}: {e}"))
            raise

    def _dispatch(self, slot: ClientSlot | None) -> None:
        """Send the queue, one group per slot, while there are slots (``slot``: one handed to the
        queue); then wait in line for the next one. Callers that went away are dropped first."""
        assert self._free is not None and self._loop is not None
        free = self._free
        while True:
            if self._queue and any(m.future.done() for m in self._queue):
                self._queue = [m for m in self._queue if not m.future.done()]
            if not self._queue:
                break
            if self._state not in ("open", "closing") or self._broken is not None:
                try:
                    self._check_usable()
                except KalosError as e:
                    self._fail_queue(e)
                break
            if slot is None:
                slot = free.get_nowait()
                if slot is None:
                    if self._slot_waiter is None:
                        w: asyncio.Future[ClientSlot] = self._loop.create_future()
                        w.add_done_callback(self._on_slot)
                        free.add_waiter(w)
                        self._slot_waiter = w
                    return
            if self._conn is None or slot not in self._current:
                slot = None  # a slot of an attachment that is gone (as in _acquire)
                continue
            self._send(slot, self._take_group())
            slot = None
        if slot is not None:
            free.put_nowait(slot)

    def _take_group(self) -> list[_Member]:
        """Remove and return the next group of the queue (``clients._coalesce.pick_group``)."""
        queue = self._queue
        if len(queue) == 1:
            self._queue = []
            return queue
        picked = pick_group(queue, self._layout.max_queries)
        if len(picked) == len(queue):
            self._queue = []
            return queue
        chosen = set(picked)
        self._queue = [m for i, m in enumerate(queue) if i not in chosen]
        return [queue[i] for i in picked]

    def _send(self, slot: ClientSlot, group: list[_Member]) -> None:
        """Write a group (one recall, or several sharing the slot) and post it."""
        conn = self._conn
        assert conn is not None and self._free is not None
        if conn.quiet():  # as in _execute_once: is the sidecar still there before we post?
            try:
                conn.check_alive()
            except BrokerUnavailable as e:
                self._free.put_nowait(slot)
                self._fail_members(group, e)  # reads: each caller sends again after the re-attach
                self._unavailable(e)
                return
        p = group[0].prep if len(group) == 1 else encode_recall_group([m.prep for m in group])
        try:
            blob_len = write_slot(slot.view, p)
            slot.post(p.op, p.ns, p.k, p.nq, p.flags, blob_len, group[-1].t0)
        except BaseException as e:
            slot.set_free()
            self._free.put_nowait(slot)
            self._fail_members(group, e)
            if not isinstance(e, Exception):
                raise
            return
        for m in group:
            m.sent = True
        if len(group) == 1:  # completes as a call of its own
            self._inflight[slot.index] = _Inflight(slot, p, group[0].future, group[0].t0)
        else:
            self._inflight[slot.index] = _Inflight(slot, p, group[0].future, group[-1].t0, group)
        self._posted += 1
        self._kick()

    @staticmethod
    def _fail_members(group: list[_Member], exc: BaseException) -> None:
        for m in group:
            if not m.future.done():
                m.future.set_exception(copy.copy(exc))

    def _complete_group(self, e: _Inflight) -> None:
        """A shared slot was answered: each caller still waiting gets its own share (or the
        error). Payloads that overflowed the blob area together are asked again one by one."""
        s = e.slot
        members = e.members
        assert members is not None and self._free is not None
        answers: list[Any] = []
        exc: KalosError | None = None
        try:
            hits = read_slot(s.view, s.outcome(), e.prep)
            answers = split(hits, [Share(m.prep.nq, m.prep.k, m.prep.single) for m in members])
        except KalosError as x:
            exc = x
        now = time.monotonic_ns()
        self._rt_ewma_ns += 0.2 * ((now - e.t0) - self._rt_ewma_ns)
        s.set_free()
        self._free.put_nowait(s)  # only now: the sidecar is done with the slot
        if isinstance(exc, PayloadTooLarge):
            # Together their payloads overflowed the slot; each alone may fit (as it would have
            # without coalescing): ask again for each caller still waiting, alone.
            again = [m for m in members if not m.future.done()]
            for m in again:
                m.key = None
                m.sent = False
                m.resent = True
            self._queue[:0] = again
            if again:
                self._schedule_dispatch()
            return
        for i, m in enumerate(members):
            fut = m.future
            latency = now - m.t0
            op = latency_op(m.prep.op, m.prep.single)
            if fut.done():  # this caller was cancelled or timed out: drop its share
                s.record(latency, ok=False, timed_out=True, op=op)
            else:
                s.record(latency, ok=exc is None, op=op)
                if exc is None:
                    fut.set_result(answers[i])
                else:
                    fut.set_exception(copy.copy(exc))
        self._requests += len(members)
        self._coalesced += len(members)
        if exc is not None:
            self._errors += len(members)

    def _kick(self) -> None:
        if self._poller is None or self._poller.done():
            assert self._loop is not None
            self._poller = self._loop.create_task(self._poll_loop())
        elif self._blocking:
            assert self._wake is not None
            self._wake.set()

    def spin_window_ns(self) -> int:
        """How long to poll after the last completion: ``spin_us``, or twice the typical round
        trip if longer, capped at ``max_spin_us``; ``spin_us=0`` turns polling off. Pure."""
        if not self._spin_ns:
            return 0
        return int(min(self._max_spin_ns, max(self._spin_ns, 2.0 * self._rt_ewma_ns)))

    def _reap(self) -> bool:
        """Complete every in-flight request whose answer is in. Returns True if any was."""
        progressed = False
        for idx, e in list(self._inflight.items()):
            s = e.slot
            if not s.is_done() or not s.try_consume():
                continue
            del self._inflight[idx]
            self._complete(e)
            progressed = True
        return progressed

    def _complete(self, e: _Inflight) -> None:
        if e.members is not None:
            self._complete_group(e)
            return
        s = e.slot
        fut = e.future
        result: Any = None
        exc: BaseException | None = None
        try:
            result = read_slot(s.view, s.outcome(), e.prep)
        except KalosError as x:
            exc = x
            if e.prep.call is not None:  # before the slot is handed to the call's next chunk
                e.prep.call.failed = True
        latency = time.monotonic_ns() - e.t0
        self._rt_ewma_ns += 0.2 * (latency - self._rt_ewma_ns)
        op = latency_op(e.prep.op, e.prep.single)
        if fut.done():  # the caller was cancelled or timed out: drop the answer
            s.record(latency, ok=False, timed_out=True, op=op)
        else:
            s.record(latency, ok=exc is None, op=op)
        s.set_free()
        assert self._free is not None
        self._free.put_nowait(s)  # only now: the sidecar is done with the slot
        self._requests += 1
        if exc is not None:
            self._errors += 1
        if not fut.done():
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)

    async def _poll_loop(self) -> None:
        """Resolve in-flight requests. Spins between loop turns while answers keep coming (and for
        ``spin_us`` after the last one, so back-to-back requests never pay a wake-up), then blocks
        (waiter thread) or, with nothing in flight, exits."""
        clock = time.monotonic_ns
        try:
            last = clock()
            while self._state != "closed" and self._conn is not None:
                spin = self.spin_window_ns()
                if self._inflight:
                    if self._reap():
                        last = clock()
                    elif clock() - last > spin:
                        await self._block()
                        last = clock()
                        continue
                    else:
                        # Nothing arrived: let another process on this core (the sidecar, other
                        # workers) run before the next look; a no-op when the core is ours.
                        os.sched_yield()
                elif clock() - last > spin:
                    return
                await asyncio.sleep(0)
        except BrokerUnavailable as e:
            self._unavailable(e)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug: fail the callers rather than hang them
            self._break(BrokerUnavailable(f"pool poller failed: {type(e).__name__}: {e}"))
            raise

    async def _block(self) -> None:
        assert self._wake is not None and self._waiter is not None and self._conn is not None
        oldest = next(iter(self._inflight.values())).slot
        self._wake.clear()
        self._blocking = True
        self._waiter.arm(oldest)
        try:
            if any(e.slot.is_done() for e in self._inflight.values()):
                # Answered while arming, or DONE with its response not posted yet (the sidecar
                # may have died in between): look again shortly, checking liveness on schedule.
                await asyncio.sleep(0.0002)
                now = time.monotonic_ns()
                if now - self._last_check_ns > LIVENESS_S * 1e9:
                    self._last_check_ns = now
                    self._conn.check_alive()
                return
            try:
                await asyncio.wait_for(self._wake.wait(), LIVENESS_S)
            except asyncio.TimeoutError:
                self._conn.check_alive()
        finally:
            self._blocking = False
            if self._waiter is not None:
                self._waiter.disarm()

    def _unavailable(self, exc: BrokerUnavailable) -> None:
        """The sidecar is dead or stopped (or its objects broke). Fail what was in flight, and
        re-attach in the background (or break for good without ``reconnect``)."""
        if self._state not in ("open", "closing") or self._conn is None:
            return
        if not self._reconnect:
            self._break(exc)
            return
        self._outages += 1
        self._down_since = time.monotonic_ns()
        # The dead sidecar's segment is gone with it; leases in it need no giving back, but the
        # locks are released by closing the attachment.
        self._detach(BrokerUnavailable(f"{exc} (the request was in flight; the pool re-attaches)"),
                     give_back=False)
        assert self._loop is not None
        self._reattacher = self._loop.create_task(self._reattach(exc))

    async def _reattach(self, cause: BrokerUnavailable) -> None:
        attempt = 0
        while self._state in ("open", "closing"):
            await asyncio.sleep(backoff_s(attempt, self._rng))
            attempt += 1
            try:
                conn, slots = await self._attach(None, True, "")
            except SlotsExhausted:
                continue  # others took the new sidecar's slots first: wait for some to free up
            except KalosError as e:  # UntrustedBroker, ProtocolError, ConfigError
                self._break(e)
                return
            new, old = conn.layout, self._layout
            if (new.dim, new.max_k, new.max_queries, new.blob_bytes) != (
                    old.dim, old.max_k, old.max_queries, old.blob_bytes):
                conn.give_back(slots, [])
                conn.close()
                self._break(ProtocolError(
                    f"broker {self.name!r} came back with another geometry (dim {new.dim}, max_k "
                    f"{new.max_k}, max_queries {new.max_queries}, blob {new.blob_bytes} bytes; was "
                    f"dim {old.dim}, max_k {old.max_k}, max_queries "
                    f"{old.max_queries}, blob {old.blob_bytes}): reopen the pool"))
                return
            if self._state not in ("open", "closing"):
                conn.give_back(slots, [])
                conn.close()
                return
            self._unavailable_ns += time.monotonic_ns() - self._down_since
            self._down_since = 0
            self._reattaches += 1
            self._install(conn, slots)
            return

    def _break(self, exc: KalosError) -> None:
        """No more service from this pool: fail every caller now; later calls raise ``exc``."""
        self._broken = exc
        self._detach(exc, give_back=True)
        if self._free is not None:
            self._free.wake_all(exc)
        self._fail_queue(exc)


def _connect(name: str, sidecar_uid: int | None) -> Connection:
    return Connection(name, sidecar_uid=sidecar_uid)


__all__ = ["RecallPool", "PoolStatistics"]
