"""A write as data (:class:`Write`, its kind :class:`WriteOp`) and how one is applied to the
in-memory store (:func:`apply_write`). The serving loop's general route, the sweeper, the durable
stores and the fleet follower all speak these, so a write decoded from a slot and a change read
back from PostgreSQL's change log are applied by the same code.

A write is **resolved** against the memory it applies to before it is made durable
(:meth:`Write.resolve`): a delete by filter gets its ids, an upsert its timestamps (``created``
kept from a live record of the id), a touch the ids it touches and their new expiry, the sweeper's
expiry the ids expired at its ``now``. What is stored and logged is the resolved write, with
absolute times, so every replica applies the same thing whatever its clock.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np

from ...broker.validation import WhereNode
from .store import MemoryStore, Stamps


class WriteOp(enum.IntEnum):
    """What a write does. The values are stored in PostgreSQL's change log: never renumber."""

    UPSERT = 1
    DELETE = 2  # by ids
    DELETE_WHERE = 3  # by filter: resolved to ids (``Write.ids``) before it is made durable
    DROP = 4  # drop_namespace
    TOUCH = 5  # restart the expiry of ids: resolved to the live ids and their new expiry
    SET_TTL = 6  # the namespace's default TTL (``Write.ttl_ns``)
    EXPIRE = 7  # the sweeper: resolved to the ids expired at ``now_ns`` (logged as a DELETE)


#: Writes whose ids depend on the memory they apply to: a batch is cut before each
#: (``batching.write_segments``), so they see every write posted before them.
RESOLVED_FROM_MEMORY = frozenset({WriteOp.DELETE_WHERE, WriteOp.TOUCH})


@dataclass
class Write:
    op: WriteOp
    namespace: str
    ids: np.ndarray | None = None
    vectors: np.ndarray | None = None
    payloads: list[bytes | None] | None = None
    where: WhereNode | None = None  # DELETE_WHERE, until resolved
    now_ns: int = 0  # the sidecar's clock (CLOCK_REALTIME ns) when it took the write
    # UPSERT, TOUCH: the TTL asked for (ns; 0: never; None: the namespace default / each row's own);
    # SET_TTL: the namespace's default (0: none).
    ttl_ns: int | None = None
    stamps: Stamps | None = None  # UPSERT, TOUCH: resolved, one per id
    limit: int = 0  # EXPIRE: at most this many ids

    def resolve(self, store: MemoryStore | None) -> None:
        """Resolve the write against ``store`` (the caller makes sure ``store`` is the state the
        write applies to; module docstring; None: an empty one). A write made without a clock
        (``now_ns`` 0: tools, tests) takes the wall clock now. Resolving twice changes nothing."""
        target = None if store is None else store.get(self.namespace)
        if not self.now_ns:
            self.now_ns = time.time_ns()
        now = self.now_ns
        if self.op is WriteOp.DELETE_WHERE and self.ids is None:
            assert self.where is not None
            self.ids = np.empty(0, np.int64) if target is None else target.matching_ids(self.where)
        elif self.op is WriteOp.UPSERT and self.stamps is None:
            assert self.ids is not None
            if target is None:  # (a new namespace: no default TTL)
                self.stamps = Stamps.written(len(self.ids), now, self.ttl_ns or 0)
            else:
                self.stamps = target.stamps_for(self.ids, now, self.ttl_ns)
        elif self.op is WriteOp.TOUCH and self.stamps is None:
            assert self.ids is not None
            if target is None:
                ids, exp, ttl = np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
            else:
                ids, exp, ttl = target.touch_plan(self.ids, now, self.ttl_ns)
            zero = np.zeros(len(ids), np.int64)
            self.ids, self.stamps = ids, Stamps(zero, zero.copy(), exp, ttl)
        elif self.op is WriteOp.EXPIRE and self.ids is None:
            self.ids = np.empty(0, np.int64) if target is None else target.expired_ids(now, self.limit)


def apply_write(store: MemoryStore, w: Write) -> int:
    """Apply a resolved write to ``store``; returns the rows it wrote, touched or removed (of the
    removed, those that had not expired at its ``now_ns``: what a caller saw as existing; the
    sweeper counts its ids itself). Idempotent: applying the same write twice leaves the store as
    once (whole records are replaced; deleting what is gone removes nothing; a touch sets the
    same expiry; dropping a dropped namespace drops nothing). Raises what the backend raises
    when it cannot grow."""
    if w.op is WriteOp.UPSERT:
        assert w.ids is not None and w.vectors is not None
        return store.get_or_create(w.namespace).upsert(w.ids, w.vectors, w.payloads, w.stamps)
    if w.op in (WriteOp.DELETE, WriteOp.DELETE_WHERE, WriteOp.EXPIRE):
        assert w.ids is not None
        target = store.get(w.namespace)
        return 0 if target is None else target.delete(w.ids, w.now_ns or None)
    if w.op is WriteOp.TOUCH:
        assert w.ids is not None and w.stamps is not None
        target = store.get(w.namespace)
        return 0 if target is None else target.touch(w.ids, w.stamps.expires, w.stamps.ttl)
    if w.op is WriteOp.SET_TTL:
        store.get_or_create(w.namespace).default_ttl = w.ttl_ns or 0
        return 0
    # (a dropped namespace is gone, "default" too: reads of it answer empty, as of one never written)
    return store.drop(w.namespace, w.now_ns or None)
