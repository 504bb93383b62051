"""Reads that wait for a fleet position (``after=``, Flag.AFTER): held aside, BUSY, until the
sidecar has applied its change log up to the position the client asked for, then served by the
usual routes; answered NOT_APPLIED at the client's ``after_until_ns``.

The decision is :func:`sort_held` (pure); :class:`HeldReads` reads the slots and answers. A held
slot counts as in flight for the reaper; one whose client died is answered at the next reap (so
the reaper can free it), never served into a slot another client may lease next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...broker.layout import S_BUSY, Flag, SlotWords, Status
from ...broker.positions import Position
from .answers import AnswerWriter

_AFTER = int(Flag.AFTER)


@dataclass(frozen=True, slots=True)
class Held:
    slot: int
    generation: int
    position: Position
    until_ns: int  # CLOCK_MONOTONIC; 0: no limit


def sort_held(held: list[Held], applied: Position, now_ns: int) -> tuple[list[Held], list[Held], list[Held]]:
    """(ready: position applied, expired: past their limit, waiting). Pure."""
    ready, expired, waiting = [], [], []
    for h in held:
        if h.position <= applied:
            ready.append(h)
        elif h.until_ns and now_ns >= h.until_ns:
            expired.append(h)
        else:
            waiting.append(h)
    return ready, expired, waiting


class HeldReads:
    """The reads of one segment waiting for a position (see the module docstring).

    ``applied()``: the position this sidecar has applied (a sidecar without a change log returns
    one past every position, so nothing waits)."""

    def __init__(self, words: SlotWords, writer: AnswerWriter, applied: Callable[[], Position]) -> None:
        self._w = words
        self._writer = writer
        self._applied = applied
        self.held: list[Held] = []

    def admit(self, taken: list[int], t_pick: int) -> list[int]:
        """Of the slots just taken, those to serve now: a read whose position is not applied yet
        is held (BUSY). Every taken slot's AFTER bit is cleared, so no route sees it."""
        u32, flags = self._w.u32, self._w.flags
        for i in taken:  # (the serving loop's hot path: a plain loop, no generator)
            if u32[flags[i]] & _AFTER:
                return self._admit(taken, t_pick)
        return taken

    def _admit(self, taken: list[int], t_pick: int) -> list[int]:
        W = self._w
        u32, u64 = W.u32, W.u64
        applied = self._applied()
        now: list[int] = []
        for i in taken:
            flags = u32[W.flags[i]]
            if not flags & _AFTER:
                now.append(i)
                continue
            u32[W.flags[i]] = flags & ~_AFTER
            xid, seq = u64[W.after_xid[i]], u64[W.after_seq[i]]
            pos = Position(min(xid, (1 << 63) - 1), min(seq, (1 << 63) - 1))  # (untrusted)
            if pos <= applied:
                now.append(i)
                continue
            u32[W.state[i]] = S_BUSY
            u64[W.t_pick_ns[i]] = t_pick
            self.held.append(Held(i, u64[W.generation[i]], pos, u64[W.after_until_ns[i]]))
        return now

    def release(self) -> tuple[list[int], int]:
        """(slots whose position is now applied: to serve, number answered NOT_APPLIED now)."""
        ready, expired, self.held = sort_held(self.held, self._applied(), time.monotonic_ns())
        if expired:
            self._not_applied(expired, "not applied within the time budget")
        return [h.slot for h in ready], len(expired)

    def drop(self, alive: Callable[[int], bool]) -> int:
        """Answer the held reads of clients that are gone (``alive(slot)`` False), so the reaper
        can free their slots; returns how many."""
        gone = [h for h in self.held if not alive(h.slot)]
        if gone:
            self.held = [h for h in self.held if alive(h.slot)]
            self._not_applied(gone, "the client is gone")
        return len(gone)

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest limit of a held read (None: none has one)."""
        limits = [h.until_ns for h in self.held if h.until_ns]
        if not limits:
            return None
        return max(0.0, (min(limits) - time.monotonic_ns()) / 1e9)

    def slots(self) -> set[int]:
        return {h.slot for h in self.held}

    def _not_applied(self, held: list[Held], why: str) -> None:
        applied = self._applied()
        for h in held:
            self._writer.answer(
                h.slot,
                h.generation,
                Status.NOT_APPLIED,
                f"position {h.position} {why}: this sidecar has applied its fleet's change log up to {applied}",
            )
        self._writer.deliver(np.asarray([h.slot for h in held], np.intp))
