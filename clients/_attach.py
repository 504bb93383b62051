"""Attaching to a broker, written once for both clients: open the objects, wait for a loading
sidecar to be READY, lease slots; retry with jittered backoff while no sidecar serves the name.

:func:`attach` is a generator that yields the seconds to pause and returns the attachment; the
blocking client drives it with ``time.sleep``, the pool with ``asyncio.sleep``. Every pause is
clipped to what is left of the deadline (:func:`pause_within`), so a caller's budget is never
overrun by a backoff; a test drives it with a fake clock. Closing the generator while it pauses
(a cancelled ``open()``) closes the half-made attachment.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator

from ..broker.errors import BrokerUnavailable, ConfigError, SlotsExhausted
from ._transport import ClientSlot, Connection, LockBusy, SlotCensus

#: Re-attach attempts after an outage: jittered exponential backoff between these (seconds).
BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 0.2
#: How often a sidecar that is loading is looked at until it is READY (seconds).
READY_POLL_S = 0.005

Connect = Callable[[str, "int | None"], Connection]
Attachment = tuple[Connection, list[ClientSlot]]


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
    """One attempt failed in a way worth trying again (within the deadline)."""

    def __init__(self, error: BrokerUnavailable | SlotsExhausted) -> None:
        self.error = error


def attach(connect: Connect, name: str, sidecar_uid: int | None, *, size: int, min_size: int,
           deadline: float | None, wait_for_sidecar: bool, within: str,
           clock: Callable[[], float], rng: random.Random,
           for_pool: bool = False) -> Generator[float, None, Attachment]:
    """Attach and lease between ``min_size`` and ``size`` slots; yields pauses (seconds).

    ``deadline``: monotonic seconds (by ``clock``), None for no limit. ``wait_for_sidecar``:
    while no live sidecar serves the name (no objects, a dead or stopping one), retry until the
    deadline; False: raise BrokerUnavailable at once. A live sidecar that is still loading is
    waited for (within the deadline) either way, and so are slots that the sidecar is reclaiming
    from processes that exited. ``within``: how the budget is named in messages.
    ``for_pool``: a pool's attachment (a RecallClient's otherwise): a ``size`` above the
    sidecar's slot count is a ConfigError, and messages speak of the pool's size.

    Raises BrokerUnavailable (naming ``within``), SlotsExhausted (other processes hold the
    slots), ConfigError, UntrustedBroker, ProtocolError.
    """
    attempt = 0
    while True:
        try:
            return (yield from _attempt(connect, name, sidecar_uid, size=size, min_size=min_size,
                                        deadline=deadline, within=within, clock=clock,
                                        wait_for_sidecar=wait_for_sidecar,
                                        for_pool=for_pool))
        except _Retry as r:
            pause = pause_within(backoff_s(attempt, rng), deadline, clock())
            if pause is None:
                e = r.error
                if isinstance(e, SlotsExhausted):
                    raise SlotsExhausted(f"{e} (waited {within} for them to be reclaimed)") from None
                if isinstance(e, LockBusy):
                    raise LockBusy(f"{e} (tried {within})") from None
                raise BrokerUnavailable(f"{e} (no sidecar served it {within})") from None
        yield pause
        attempt += 1


def _attempt(connect: Connect, name: str, sidecar_uid: int | None, *, size: int, min_size: int,
             deadline: float | None, within: str, clock: Callable[[], float],
             wait_for_sidecar: bool, for_pool: bool) -> Generator[float, None, Attachment]:
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
                raise BrokerUnavailable(f"broker {name!r}: the sidecar is still starting "
                                        f"(loading), not ready {within}")
            yield pause
        n_slots = conn.layout.n_slots
        if for_pool and size > n_slots:
            raise ConfigError(
                f"a pool of size={size} asks for more slots than broker {name!r} has ({n_slots}): "
                f"lower size (at most {n_slots}, less if other processes use this broker too) or "
                "start the sidecar with more --slots")
        try:
            slots = conn.lease(size)
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
            raise error
    except BaseException:
        conn.close()
        raise
    return conn, slots


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
    held = (f"broker {name!r} has {c.n_slots} slots: {c.leased} leased by other pools (of this "
            f"or other processes){gone}, {c.free} free; ")
    if not for_pool:
        return held + ("a RecallClient needs one. Close pools that are not needed or start the "
                       "sidecar with more --slots")
    return held + (f"this pool needs at least {min_size} (min_size; it asks for {size}). Close "
                   "pools that are not needed, lower size and min_size, or start the sidecar with "
                   "more --slots")


__all__ = ["Attachment", "Connect", "attach", "backoff_s", "pause_within"]
