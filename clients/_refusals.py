"""What a caller of the asyncio pool gets when its budget runs out, in words: which error, and
what it says about the pool's state. Pure: the numbers come in as arguments."""

from __future__ import annotations

from ..broker.errors import AcquireTimeout, BrokerUnavailable, ResponseTimeout


def down(name: str, down_ns: int) -> BrokerUnavailable:
    """The budget ran out during an outage of ``down_ns`` so far."""
    return BrokerUnavailable(
        f"broker {name!r}: no sidecar within the time budget (down for {down_ns / 1e9:.2f} s; the pool "
        "re-attaches as soon as one serves the name)"
    )


def no_slot(leased: int, size: int) -> AcquireTimeout:
    """No slot came free within the budget."""
    return AcquireTimeout(
        f"no free slot within the time budget ({leased} slots leased, all in "
        f"flight; the pool grows to size={size} while the broker has slots free)"
    )


def not_sent(resent: bool, timeout: float | None, leased: int, free: int) -> AcquireTimeout | ResponseTimeout:
    """A recall still in the coalescing queue when its budget ran out (``resent``: it had gone
    once in a shared slot that overflowed)."""
    if resent:
        return ResponseTimeout(
            f"no answer within {timeout} s (sent in a shared slot whose payloads overflowed it, then queued again alone)"
        )
    return AcquireTimeout(f"not sent within the time budget (queued to be coalesced; {leased} slots, {free} free)")


def unanswered(timeout: float | None) -> ResponseTimeout:
    """Sent, and not answered within the budget (the request stays in flight)."""
    return ResponseTimeout(
        f"no answer within {timeout} s (request stays in flight until the sidecar finishes it; the slot is then reused)"
    )


__all__ = ["down", "no_slot", "not_sent", "unanswered"]
