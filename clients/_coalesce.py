"""Client-side coalescing: the pure decisions behind packing several recalls of one pool into one
multi-query slot, and splitting its answer. No slots, no event loop, no clock: the pool
(``clients/pool.py``) asks these functions and does the I/O around them.

Which path a recall takes (:func:`route`):

=========  =======================================================================================
DIRECT     coalescing off, or a lone caller: a free slot, nothing queued, nothing of this pool in
           flight. Today's path: claim a slot, write, post, at once (no timer, no extra turn).
QUEUE      the recall would wait anyway: no free slot, other recalls already queued, or this pool
           already has requests in flight (the sidecar is busy with them, or takes them with the
           next pass). It joins the pool's queue; the queue is sent at the end of the current
           event-loop turn, or when a slot frees up.
=========  =======================================================================================

What may share a slot (:func:`coalesce_key`): the recalls of one namespace, with the same flags
(with/without payloads, filtered or not), the same filter bytes, and the same **k class**:

* without payloads, k rounded up to a power of two (capped at the broker's max_k). The slot asks
  for the largest k of its members and each member gets its own first k hits: exactly what the
  sidecar already does for recalls of different k that share one of its batches (it searches once
  with the largest k and cuts each answer to its own). The class bounds the extra work to less than
  twice the hits a member asked for.
* with payloads, the same k only: every hit's payload travels in the slot's blob area, so a
  rounded-up k would ship and decode payloads nobody asked for, and fill the blob area sooner.

A group is the oldest queued recall and every later one of its key, in arrival order, as long as
their rows fit in one slot (:func:`pick_group`). A recall marked ``alone`` (a shared answer
overflowed the blob area, see the pool) never shares a slot again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol, Union

from ..broker.layout import Flag
from .results import Hits


class Path(enum.Enum):
    DIRECT = "direct"
    QUEUE = "queue"


def route(coalesce: bool, queued: int, free: int, in_flight: int) -> Path:
    """The path of a new recall: ``queued`` recalls already waiting to be coalesced, ``free``
    slots on the free stack, ``in_flight`` requests of this pool posted and not yet answered."""
    if not coalesce:
        return Path.DIRECT
    if queued or not free or in_flight:
        return Path.QUEUE
    return Path.DIRECT


class Key(NamedTuple):
    """What recalls sharing a slot have in common."""

    namespace: bytes
    flags: int  # Flag.WITH_PAYLOAD | Flag.WHERE
    where: bytes  # the encoded filter (b"" without one)
    k_class: int


def k_class(k: int, with_payload: bool, max_k: int) -> int:
    """k rounded up to a power of two, at most ``max_k``; k itself with payloads (module docstring)."""
    if with_payload or k >= max_k:
        return k
    return min(max_k, 1 << (k - 1).bit_length())


def coalesce_key(namespace: bytes, flags: int, where: bytes, k: int, max_k: int) -> Key:
    return Key(namespace, flags, where, k_class(k, bool(flags & Flag.WITH_PAYLOAD), max_k))


class Queued(Protocol):
    """What :func:`pick_group` needs of one queued recall (the pool's own queue entries have it)."""

    @property
    def key(self) -> Key | None: ...  # None: send alone

    @property
    def rows(self) -> int: ...


class Waiting(NamedTuple):
    """A :class:`Queued` recall as a plain value."""

    key: Key | None  # None: send alone
    rows: int


def pick_group(queue: Sequence[Queued], max_rows: int) -> list[int]:
    """Positions in ``queue`` (oldest first) of the recalls to send in the next slot: the oldest
    one, then every later one with its key whose rows still fit in ``max_rows``, in order (one that
    does not fit is skipped, not a stop: a smaller one behind it may fit). Empty for an empty
    queue. A recall whose key is None goes alone."""
    if not queue:
        return []
    first = queue[0]
    picked = [0]
    key = first.key
    if key is None:
        return picked
    rows = first.rows
    for i in range(1, len(queue)):
        w = queue[i]
        k = w.key
        if (k is key or k == key) and rows + w.rows <= max_rows:  # (keys are often one object)
            picked.append(i)
            rows += w.rows
            if rows == max_rows:
                break
    return picked


class Share(NamedTuple):
    """One member's part of a shared slot: its rows, its own k, whether it was ``recall`` (one
    Hits) or ``recall_many`` (a list), and when its call began (monotonic ns: the latency the
    pool records for it is its own; :func:`split` does not read it)."""

    rows: int
    k: int
    single: bool
    t0: int = 0


Answer = Union[Hits, "list[Hits]"]


def split(hits: Sequence[Hits], shares: Sequence[Share]) -> list[Answer]:
    """Scatter a shared slot's answer (one Hits per row, in the members' order) to its members,
    each cut to its own k (the slot asked for the largest)."""
    out: list[Answer] = []
    row = 0
    for s in shares:
        mine = [h.head(s.k) for h in hits[row : row + s.rows]]
        row += s.rows
        out.append(mine[0] if s.single else mine)
    if row != len(hits):
        raise ValueError(f"{len(hits)} rows of hits for {row} rows asked")
    return out


__all__ = [
    "Answer",
    "Key",
    "Path",
    "Queued",
    "Share",
    "Waiting",
    "coalesce_key",
    "k_class",
    "pick_group",
    "route",
    "split",
]
