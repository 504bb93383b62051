"""The coalescing queue as data (:class:`Backlog`): the recalls waiting to share slots, oldest
first, and the decisions about them: a recall's coalescing key, the next group to send, who goes
again alone, when the queue may leave the line for a slot. Pure: no event loop, no slot; an entry
is anything with the fields of :class:`Entry` and a ``gone()`` (the asyncio queue's members,
``clients._queue``, whose caller's future is done). What may share a slot is
``clients._coalesce``'s.

    event            backlog                                   the driver (clients._queue)
    join(e)          ``e`` at the back                         schedules a dispatch
    pending()        entries whose caller went away dropped;   sends while True and a slot comes
                     True while any is left
    next_group()     the group out (``_coalesce.pick_group``)  posts it in one slot
    again(es)        those still waiting to the front, alone   schedules a dispatch if True
    leave(e)         ``e`` out; True when no caller is left    leaves the line for a slot if True
    clear()          every entry out                           fails them
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from ..broker.layout import Op
from ._coalesce import Key, coalesce_key, pick_group
from ._requests import Prepared

_KEY_CACHE = 4096  # unfiltered coalescing keys kept (one per namespace, flags and k seen)


class Entry(Protocol):
    """A queued recall as the backlog sees it."""

    key: Key | None  # None: it goes alone
    rows: int
    sent: bool
    resent: bool  # sent once in a shared slot that overflowed; queued again alone

    def gone(self) -> bool: ...  # its caller went away (cancelled, timed out) or was answered


E = TypeVar("E", bound=Entry)


def coalescible(p: Prepared[Any]) -> bool:
    """A recall the queue may pack with others: every parameter of it is part of a slot's key
    (none waits for a fleet position, asks for recency or mixes in a lexical part)."""
    return p.op is Op.RECALL and p.after is None and p.recency is None and p.hybrid is None


class Backlog(Generic[E]):
    """Recalls waiting to share slots of ``max_rows`` rows (the broker's max_queries), k up to
    ``max_k``; the module docstring has the table of events."""

    def __init__(self, max_rows: int, max_k: int) -> None:
        self.max_rows = max_rows
        self.max_k = max_k
        self.entries: list[E] = []
        self._keys: dict[tuple[bytes, int, int], Key] = {}

    def __len__(self) -> int:
        """Entries, those of callers that went away included (what ``_coalesce.route`` reads)."""
        return len(self.entries)

    def live(self) -> list[E]:
        """The entries whose callers still wait."""
        return [e for e in self.entries if not e.gone()]

    def key_of(self, p: Prepared[Any]) -> Key | None:
        """The coalescing key of a recall; one object per (namespace, flags, k) for unfiltered
        ones (cached: most recalls of a pool share a few), computed for filtered ones. A recall
        that waits for a fleet position (``after=``) goes alone: a shared slot has one position."""
        if p.after is not None:
            return None
        if p.blob:
            return coalesce_key(p.ns, p.flags, p.blob, p.k, self.max_k)
        ck = (p.ns, p.flags, p.k)
        key = self._keys.get(ck)
        if key is None:
            key = coalesce_key(p.ns, p.flags, b"", p.k, self.max_k)
            if len(self._keys) < _KEY_CACHE:
                self._keys[ck] = key
        return key

    def join(self, e: E) -> None:
        self.entries.append(e)

    def leave(self, e: E) -> bool:
        """Take ``e`` (its caller went away) out; True when no caller is left waiting (then the
        queue need not wait for a slot)."""
        try:
            self.entries.remove(e)
        except ValueError:
            pass
        return not any(not x.gone() for x in self.entries)

    def again(self, entries: Sequence[E]) -> bool:
        """A shared slot overflowed: its callers still waiting go to the front, each to be sent
        alone (their key dropped). True if any did."""
        back = [e for e in entries if not e.gone()]
        for e in back:
            e.key = None
            e.sent = False
            e.resent = True
        self.entries[:0] = back
        return bool(back)

    def pending(self) -> bool:
        """Drop the entries whose callers went away; True while any is left to send."""
        entries = self.entries
        if entries and any(e.gone() for e in entries):
            entries = self.entries = [e for e in entries if not e.gone()]
        return bool(entries)

    def next_group(self) -> list[E]:
        """Remove and return the next group to share a slot (``_coalesce.pick_group``)."""
        entries = self.entries
        if len(entries) == 1:
            self.entries = []
            return entries
        picked = pick_group(entries, self.max_rows)
        if len(picked) == len(entries):
            self.entries = []
            return entries
        chosen = set(picked)
        self.entries = [e for i, e in enumerate(entries) if i not in chosen]
        return [entries[i] for i in picked]

    def clear(self) -> list[E]:
        """Every entry out (to be failed, or forgotten in a forked child)."""
        entries, self.entries = self.entries, []
        return entries


__all__ = ["Backlog", "Entry", "coalescible"]
