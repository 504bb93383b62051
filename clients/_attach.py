"""Attachment, written once for both clients: open the broker's objects, wait for a loading
sidecar to be READY, lease slots, retry with jittered backoff while no sidecar serves the name;
after an outage, re-attach and refuse a sidecar of another geometry; detach (leases given back,
or left to the reaper).

:func:`attach` (and :class:`Attacher`, which holds one client's fixed arguments) are generators
that yield the seconds to pause and return the :class:`Attachment`; the blocking client drives
them with :func:`drive` (``time.sleep``), the pool with :func:`drive_async` (``asyncio.sleep``).
Every pause is clipped to what is left of the deadline (:func:`pause_within`), so a caller's
budget is never overrun by a backoff; a test drives them with a fake clock. Closing a generator
while it pauses (a cancelled ``open()``) closes the half-made attachment.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Collection, Generator
from typing import NamedTuple, TypeVar

from ..broker.errors import BrokerUnavailable, ConfigError, ProtocolError, SlotsExhausted
from ..broker.layout import Layout
from ._slots import ClientSlot
from ._transport import Connection, LockBusy, SlotCensus, SlotWant

#: Re-attach attempts after an outage: jittered exponential backoff between these (seconds).
BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 0.2
#: How often a sidecar that is loading is looked at until it is READY (seconds).
READY_POLL_S = 0.005

Connect = Callable[[str, "int | None"], Connection]
T = TypeVar("T")


class Attachment(NamedTuple):
    """A connection to a serving sidecar and the slots leased through it."""

    conn: Connection
    slots: list[ClientSlot]

    def end(self, busy: Collection[ClientSlot] = (), *, give_back: bool = True) -> None:
        """Detach. ``give_back``: idle slots are free for others at once, ``busy`` ones (a
        request in flight) are marked abandoned for the sidecar's reaper, which frees them once
        answered; without it (the sidecar is gone) the leases end with the connection. A sidecar
        that went away meanwhile took the leases with it: not an error."""
        try:
            if give_back:
                taken = {s.index for s in busy}
                self.conn.give_back([s for s in self.slots if s.index not in taken], list(busy))
        except BrokerUnavailable:
            pass
        finally:
            self.conn.close()


def geometry_error(name: str, old: Layout, new: Layout, reopen: str) -> ProtocolError | None:
    """The error for a sidecar that came back with another geometry (what every request is
    encoded against: dim, max_k, max_queries, blob size), None for the same one. ``reopen``:
    what the caller must reopen ("the pool", "the client"). Pure."""
    if (new.dim, new.max_k, new.max_queries, new.blob_bytes) == (old.dim, old.max_k, old.max_queries, old.blob_bytes):
        return None
    return ProtocolError(
        f"broker {name!r} came back with another geometry (dim {new.dim}, max_k {new.max_k}, "
        f"max_queries {new.max_queries}, blob {new.blob_bytes} bytes; was dim {old.dim}, max_k "
        f"{old.max_k}, max_queries {old.max_queries}, blob {old.blob_bytes}): reopen {reopen}"
    )


def backoff_s(attempt: int, rng: random.Random) -> float:
    """Delay before re-attach attempt ``attempt`` (0-based): full jitter over an exponential
    ceiling, so N workers of one host do not stampede a starting sidecar. Pure but for ``rng``."""
    ceiling = min(BACKOFF_MAX_S, BACKOFF_MIN_S * (2 ** min(attempt, 16)))
    return rng.uniform(BACKOFF_MIN_S / 2, ceiling)


def pause_within(want: float, deadline: float | None, now: float) -> float | None:
    """``want`` seconds, clipped to what is left before ``deadline`` (monotonic seconds; None: no
    limit); None when nothing is left: give up now rather than pause past the budget. Pure."""
    if deadline is None:
        return want
    left = deadline - now
    if left <= 0:
        return None
    return min(want, left)


class _Retry(Exception):
    """One attempt failed in a way worth trying again (within the deadline). ``waiting_for``:
    what a SlotsExhausted waits for; ``want``: the announcement that this process waits for its
    first slot (taken once, held until the attach ends)."""

    def __init__(
        self,
        error: BrokerUnavailable | SlotsExhausted,
        waiting_for: str = "them to be reclaimed",
        want: SlotWant | None = None,
    ) -> None:
        self.error = error
        self.waiting_for = waiting_for
        self.want = want


def attach(
    connect: Connect,
    name: str,
    sidecar_uid: int | None,
    *,
    size: int,
    min_size: int,
    deadline: float | None,
    wait_for_sidecar: bool,
    within: str,
    clock: Callable[[], float],
    rng: random.Random,
    for_pool: bool = False,
    initial: int | None = None,
    wait_for_slots: bool = False,
) -> Generator[float, None, Attachment]:
    """Attach and lease between ``min_size`` and ``initial`` slots (default ``size``); yields
    pauses (seconds).

    ``deadline``: monotonic seconds (by ``clock``), None for no limit. ``wait_for_sidecar``:
    while no live sidecar serves the name (no objects, a dead or stopping one), retry until the
    deadline; False: raise BrokerUnavailable at once. A live sidecar that is still loading is
    waited for (within the deadline) either way, and so are slots that the sidecar is reclaiming
    from processes that exited. ``within``: how the budget is named in messages.
    ``for_pool``: a pool's attachment (a RecallClient's otherwise): a ``size`` above the
    sidecar's slot count is a ConfigError, and messages speak of the pool's size.
    ``wait_for_slots``: slots that live processes hold are waited for too, within the deadline
    (elastic pools give back what they hold beyond their ``min_size`` when idle, and at once
    while a process waits for its first slot: this one announces its wait,
    ``Connection.want_slots``, until the attach ends); False: SlotsExhausted at once.

    Raises BrokerUnavailable (naming ``within``), SlotsExhausted (other processes hold the
    slots), ConfigError, UntrustedBroker, ProtocolError.
    """
    attempt = 0
    want: SlotWant | None = None
    try:
        while True:
            try:
                return (
                    yield from _attempt(
                        connect,
                        name,
                        sidecar_uid,
                        size=size,
                        min_size=min_size,
                        initial=size if initial is None else initial,
                        deadline=deadline,
                        within=within,
                        clock=clock,
                        wait_for_sidecar=wait_for_sidecar,
                        wait_for_slots=wait_for_slots,
                        announced=want is not None,
                        for_pool=for_pool,
                    )
                )
            except _Retry as r:
                want = want or r.want
                pause = pause_within(backoff_s(attempt, rng), deadline, clock())
                if pause is None:
                    e = r.error
                    if isinstance(e, SlotsExhausted):
                        raise SlotsExhausted(f"{e} (waited {within} for {r.waiting_for})") from None
                    if isinstance(e, LockBusy):
                        raise LockBusy(f"{e} (tried {within})") from None
                    raise BrokerUnavailable(f"{e} (no sidecar served it {within})") from None
            yield pause
            attempt += 1
    finally:
        if want is not None:
            want.release()


def _attempt(
    connect: Connect,
    name: str,
    sidecar_uid: int | None,
    *,
    size: int,
    min_size: int,
    initial: int,
    deadline: float | None,
    within: str,
    clock: Callable[[], float],
    wait_for_sidecar: bool,
    wait_for_slots: bool,
    announced: bool,
    for_pool: bool,
) -> Generator[float, None, Attachment]:
    try:
        conn = connect(name, sidecar_uid)
    except BrokerUnavailable as e:
        raise _absent(e, wait_for_sidecar) from None
    try:
        while True:
            try:
                ready = conn.is_ready()
                conn.check_alive()  # a dead or stopping one is being replaced
            except BrokerUnavailable as e:
                raise _absent(e, wait_for_sidecar) from None
            if ready:
                break
            # A live sidecar that is loading will serve soon: worth waiting for, reconnect or not.
            pause = pause_within(READY_POLL_S, deadline, clock())
            if pause is None:
                raise BrokerUnavailable(f"broker {name!r}: the sidecar is still starting (loading), not ready {within}")
            yield pause
        n_slots = conn.layout.n_slots
        if for_pool and size > n_slots:
            raise ConfigError(
                f"a pool of size={size} asks for more slots than broker {name!r} has ({n_slots}): "
                f"lower size (at most {n_slots}, less if other processes use this broker too) or "
                "start the sidecar with more --slots"
            )
        try:
            slots = conn.lease(initial)
            if len(slots) < min_size:
                conn.give_back(slots, [])
                census = conn.census()
        except LockBusy as e:  # a live sidecar; another process holds the claim lock: try again
            raise _Retry(e) from None
        except BrokerUnavailable as e:  # its objects went away under us
            raise _absent(e, wait_for_sidecar) from None
        if len(slots) < min_size:
            error = SlotsExhausted(_exhausted(name, census, size, min_size, for_pool))
            if census.free + census.reclaimable >= min_size:
                raise _Retry(error)  # the sidecar's reaper frees them within a fraction of a second
            if wait_for_slots:  # elastic pools give back what they hold beyond their min_size
                raise _Retry(
                    error, "other pools to give slots back", None if announced else conn.want_slots(first=True)
                )
            raise error
    except BaseException:
        conn.close()
        raise
    return Attachment(conn, slots)


def _absent(e: BrokerUnavailable, wait: bool) -> Exception:
    """What to raise when no live sidecar serves the name: _Retry (wait for one), or the error
    for the caller. UntrustedBroker (a squatted name) is never waited on."""
    if type(e) is not BrokerUnavailable:
        return e
    if wait:
        return _Retry(e)
    return BrokerUnavailable(f"{e} (reconnect=False: not waiting for one)")


def _exhausted(name: str, c: SlotCensus, size: int, min_size: int, for_pool: bool) -> str:
    gone = f", {c.reclaimable} being reclaimed from processes that exited" if c.reclaimable else ""
    held = (
        f"broker {name!r} has {c.n_slots} slots: {c.leased} leased by other pools (of this "
        f"or other processes){gone}, {c.free} free; "
    )
    if not for_pool:
        return held + (
            "a RecallClient needs one. Close pools that are not needed or start the sidecar with more --slots"
        )
    return held + (
        f"this pool needs at least {min_size} (min_size; it grows to size={size} on demand). "
        "Close pools and clients that are not needed, lower min_size, or start the sidecar "
        "with more --slots"
    )


class Attacher:
    """One client's attachment arguments, fixed when it is made: the broker, the sidecar's user,
    how many slots (``initial``, default ``size``, at least ``min_size``; ``wait_for_slots``:
    :func:`attach`), whose (``for_pool``: a pool's, else a RecallClient's), and the backoff's
    random source. ``reopen`` names what a caller reopens when the geometry changed."""

    def __init__(
        self,
        connect: Connect,
        name: str,
        sidecar_uid: int | None,
        *,
        size: int,
        min_size: int,
        for_pool: bool,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        initial: int | None = None,
        wait_for_slots: bool = False,
    ) -> None:
        self.name = name
        self._initial = initial
        self._wait_for_slots = wait_for_slots
        self._connect = connect
        self._uid = sidecar_uid
        self._size = size
        self._min_size = min_size
        self._for_pool = for_pool
        self._rng = rng
        self._clock = clock
        self.reopen = "the pool" if for_pool else "the client"

    def attach(self, deadline: float | None, wait_for_sidecar: bool, within: str) -> Generator[float, None, Attachment]:
        """:func:`attach` with this client's arguments."""
        return attach(
            self._connect,
            self.name,
            self._uid,
            size=self._size,
            min_size=self._min_size,
            deadline=deadline,
            wait_for_sidecar=wait_for_sidecar,
            within=within,
            clock=self._clock,
            rng=self._rng,
            for_pool=self._for_pool,
            initial=self._initial,
            wait_for_slots=self._wait_for_slots,
        )

    def reattach(self, old: Layout) -> Generator[float, None, Attachment]:
        """A pool's re-attach after an outage, in the background and without a deadline: a
        jittered backoff before every attempt (the workers of a host do not stampede a starting
        sidecar), slots held by others (SlotsExhausted) waited for, and the new sidecar's
        geometry checked against ``old`` (:meth:`check_geometry`). Raises UntrustedBroker,
        ProtocolError, ConfigError."""
        attempt = 0
        while True:
            yield backoff_s(attempt, self._rng)
            attempt += 1
            try:
                att = yield from self.attach(None, True, "")
            except SlotsExhausted:
                continue
            return self.check_geometry(att, old)

    def check_geometry(self, att: Attachment, old: Layout) -> Attachment:
        """``att``, if its sidecar has the geometry of ``old`` (what the caller's requests are
        encoded against); else ``att`` is ended (its leases given back) and ProtocolError
        raised."""
        err = geometry_error(self.name, old, att.conn.layout, self.reopen)
        if err is not None:
            att.end()
            raise err
        return att


def drive(steps: Generator[float, None, T]) -> T:
    """Run an attach generator in this thread, sleeping its pauses."""
    try:
        while True:
            time.sleep(next(steps))
    except StopIteration as done:
        value: T = done.value
        return value
    finally:
        steps.close()


async def drive_async(steps: Generator[float, None, T]) -> T:
    """Run an attach generator on the running loop, its pauses awaited (cancellable: a half-made
    attachment is closed)."""
    try:
        while True:  # noqa: ASYNC110 (the attach plan's own pauses, computed per step)
            await asyncio.sleep(next(steps))
    except StopIteration as done:
        value: T = done.value
        return value
    finally:
        steps.close()


__all__ = [
    "Attacher",
    "Attachment",
    "Connect",
    "attach",
    "backoff_s",
    "drive",
    "drive_async",
    "geometry_error",
    "pause_within",
]
