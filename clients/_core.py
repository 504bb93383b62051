"""The client core: a client's life, its requests in flight and its tallies, and what each event
does to them. No I/O: no event loop, no thread, no shared memory, no clock (times come in as
arguments, monotonic ns), so every transition is tested on its own (tests/unit/test_core.py).

The drivers feed it events and carry out the :class:`Step` it returns: ``RecallPool``
(``clients.pool``, asyncio) and ``RecallClient`` (``clients.blocking``) share :class:`Life`; the
pool also keeps its in-flight table and tallies here (:class:`ClientCore`).

    event             state before          state after    step for the driver
    open              NEW                   OPEN           (else ClosedError)
    close             NEW, CLOSED           CLOSED         NOTHING
                      FORKED                FORKED         NOTHING (the parent's slots)
                      BROKEN                CLOSED         TERMINATE
                      OPEN, CLOSING         CLOSING        WAIT (callers, then terminate)
    terminate         CLOSED, FORKED        CLOSED         NOTHING
                      any other             CLOSED         TERMINATE
    fork (child)      any                   FORKED         (forget, touch nothing)
    break(exc)        OPEN, CLOSING         BROKEN         (fail everything; calls raise exc)
    outage(exc)       not serving/detached  unchanged      NOTHING
                      serving, no reconnect BROKEN         BREAK
                      serving, reconnect    unchanged      REATTACH (an outage counted)
    reattached        serving               unchanged      INSTALL (a re-attach counted)
                      not serving           unchanged      END (the new attachment)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from ..broker.errors import ClosedError, KalosError
from ._exchange import Exchange
from ._life import Driver, PoolState, refusal

W = TypeVar("W")

#: Requests in flight and queued still go on (the poller, the dispatcher, the re-attacher run).
SERVING = frozenset({PoolState.OPEN, PoolState.CLOSING})


class Step(enum.Enum):
    """What a driver does after an event (the table in the module docstring)."""

    NOTHING = "nothing"
    WAIT = "wait"  # close: wait for the callers in flight or queued, then terminate
    TERMINATE = "terminate"  # stop the tasks, fail the callers, give the leases back
    BREAK = "break"  # fail every caller now and serve no more (the cause is Life.broken)
    REATTACH = "reattach"  # fail what was in flight, detach, re-attach in the background
    INSTALL = "install"  # make the new attachment current
    END = "end"  # end the new attachment: the client no longer serves


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool's state."""

    size: int  # slots leased now (between min_size and max_size)
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
    slot_path: str = "python"  # "compiled" (clients/_cslot.c) or "python": who does the byte work
    min_size: int = 1  # slots leased at open and always kept
    max_size: int = 1  # the pool's ``size``: the most slots it leases
    grown: int = 0  # slots leased after open, because callers waited for one
    returned: int = 0  # slots given back: idle, or ceded to a process waiting for its first
    refused: int = 0  # times callers waited and the broker had no slot to spare (they queued)


class SlotCounts(NamedTuple):
    """A pool's slots, for :meth:`ClientCore.statistics` (``_elastic.Leases.counts``)."""

    size: int  # leased now
    free: int
    min_size: int
    max_size: int
    grown: int
    returned: int
    refused: int


@dataclass
class Life:
    """A client's life phase (``_life.PoolState``) and the cause of a BROKEN one."""

    opened_in: int  # the pid of the process that made the client
    driver: Driver = Driver.POOL
    state: PoolState = PoolState.NEW
    broken: KalosError | None = None

    def refusal(self, pid: int) -> KalosError | None:
        """What a call raises now (None: it may go ahead)."""
        return refusal(self.state, self.broken, self.opened_in, pid, self.driver)

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def queue_refusal(self, pid: int) -> KalosError | None:
        """What queued calls get now: None while they may still be sent (OPEN or CLOSING)."""
        return None if self.state in SERVING else self.refusal(pid)

    def open(self) -> None:
        if self.state is not PoolState.NEW:
            raise ClosedError(f"{self.driver.value} is {self.state.value}: a {self.driver.value} is opened once")
        self.state = PoolState.OPEN

    def close(self) -> Step:
        state = self.state
        if state is PoolState.FORKED:
            return Step.NOTHING
        if state is PoolState.NEW or state is PoolState.CLOSED:
            self.state = PoolState.CLOSED
            return Step.NOTHING
        if state is PoolState.BROKEN:
            return Step.TERMINATE
        self.state = PoolState.CLOSING
        return Step.WAIT

    def terminate(self) -> Step:
        done = self.state is PoolState.CLOSED or self.state is PoolState.FORKED
        self.state = PoolState.CLOSED
        return Step.NOTHING if done else Step.TERMINATE

    def fork(self) -> None:
        self.state = PoolState.FORKED

    def break_(self, exc: KalosError) -> None:
        """Serve no more: later calls raise ``exc`` (until closed)."""
        self.broken = exc
        if self.state in SERVING:
            self.state = PoolState.BROKEN


@dataclass
class Tally:
    """A client's counts (``PoolStatistics``)."""

    requests: int = 0  # completed calls (a coalesced recall counts once)
    errors: int = 0
    posted: int = 0  # requests posted (round trips)
    coalesced: int = 0  # completed recalls that shared their slot
    outages: int = 0
    reattaches: int = 0
    unavailable_ns: int = 0  # outages over
    down_since: int = 0  # when the current outage began (0: none)

    def answered(self, callers: int, ok: bool, shared: bool) -> None:
        self.requests += callers
        if shared:
            self.coalesced += callers
        if not ok:
            self.errors += callers

    def unavailable_s(self, now_ns: int) -> float:
        return (self.unavailable_ns + (now_ns - self.down_since if self.down_since else 0)) / 1e9


@dataclass
class ClientCore(Generic[W]):
    """The pool's state apart from its I/O: its life, the exchanges posted and not answered yet
    (by slot index, oldest first: the waiter blocks on the oldest) and its tallies."""

    life: Life
    tally: Tally = field(default_factory=Tally)
    inflight: dict[int, Exchange[Any, W]] = field(default_factory=dict)

    def posted(self, ex: Exchange[Any, W]) -> None:
        self.inflight[ex.slot.index] = ex
        self.tally.posted += 1

    def oldest(self) -> Exchange[Any, W]:
        return next(iter(self.inflight.values()))

    def answered(self, index: int) -> Exchange[Any, W]:
        """The exchange in slot ``index`` is answered: out of the in-flight table."""
        return self.inflight.pop(index)

    def lost(self) -> list[Exchange[Any, W]]:
        """The attachment is gone: every exchange in flight is out of the table, its write call
        (if a chunk of one) marked failed so that no further chunk is posted; the driver fails
        its callers."""
        lost = list(self.inflight.values())
        self.inflight.clear()  # (in place: a driver may hold the table)
        for ex in lost:
            if ex.prep.call is not None:
                ex.prep.call.failed = True
        return lost

    def outage(self, attached: bool, reconnect: bool, now_ns: int) -> Step:
        """The sidecar was found dead or stopped (``exc`` in the driver's hands)."""
        if not self.life.serving or not attached:
            return Step.NOTHING
        if not reconnect:
            return Step.BREAK
        self.tally.outages += 1
        self.tally.down_since = now_ns
        return Step.REATTACH

    def reattached(self, now_ns: int) -> Step:
        if not self.life.serving:
            return Step.END
        t = self.tally
        t.unavailable_ns += now_ns - t.down_since
        t.down_since = 0
        t.reattaches += 1
        return Step.INSTALL

    def statistics(
        self, now_ns: int, slots: SlotCounts, *, orphaned: int, attached: bool, queued: int, slot_path: str
    ) -> PoolStatistics:
        """A snapshot: the driver's slots and what it alone knows (its orphans, whether it is
        attached, its queue, its slot path), with the core's table and tallies."""
        t = self.tally
        return PoolStatistics(
            size=slots.size,
            free=slots.free,
            in_flight=len(self.inflight),
            orphaned=orphaned,
            requests=t.requests,
            errors=t.errors,
            outages=t.outages,
            reattaches=t.reattaches,
            unavailable_s=t.unavailable_s(now_ns),
            attached=attached,
            queued=queued,
            posted=t.posted,
            coalesced=t.coalesced,
            slot_path=slot_path,
            min_size=slots.min_size,
            max_size=slots.max_size,
            grown=slots.grown,
            returned=slots.returned,
            refused=slots.refused,
        )

    def forget(self) -> None:
        """In a forked child: the parent's exchanges are not ours."""
        self.life.fork()
        self.inflight.clear()


__all__ = ["SERVING", "ClientCore", "Life", "PoolStatistics", "SlotCounts", "Step", "Tally"]
