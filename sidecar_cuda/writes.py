"""A write as data (:class:`Write`, its kind :class:`WriteOp`) and how one is applied to the
in-memory store (:func:`apply_write`). The serving loop's general route, the durable stores and
the fleet follower all speak these, so a write decoded from a slot and a change read back from
PostgreSQL's change log are applied by the same code."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..broker.validation import WhereNode
from .store import MemoryStore


class WriteOp(enum.IntEnum):
    """What a write does. The values are stored in PostgreSQL's change log: never renumber."""

    UPSERT = 1
    DELETE = 2  # by ids
    DELETE_WHERE = 3  # by filter: resolved to ids (``Write.ids``) before it is made durable
    DROP = 4  # drop_namespace


@dataclass
class Write:
    op: WriteOp
    namespace: str
    ids: np.ndarray | None = None
    vectors: np.ndarray | None = None
    payloads: list[bytes | None] | None = None
    where: WhereNode | None = None  # DELETE_WHERE, until resolved

    def resolve(self, store: MemoryStore) -> None:
        """A delete by filter gets the ids its filter matches in ``store`` now (the caller makes
        sure ``store`` is the state the write applies to); other writes are left alone."""
        if self.op is WriteOp.DELETE_WHERE and self.ids is None:
            assert self.where is not None
            target = store.get(self.namespace)
            self.ids = np.empty(0, np.int64) if target is None else target.matching_ids(self.where)


def apply_write(store: MemoryStore, w: Write) -> int:
    """Apply a write (a resolved one, for a delete by filter) to ``store``; returns the rows it
    wrote or removed. Idempotent: applying the same write twice leaves the store as once (whole
    records are replaced; deleting what is gone removes nothing; dropping a dropped namespace
    drops nothing). Raises what the backend raises when it cannot grow."""
    if w.op is WriteOp.UPSERT:
        assert w.ids is not None and w.vectors is not None
        return store.get_or_create(w.namespace).upsert(w.ids, w.vectors, w.payloads)
    if w.op in (WriteOp.DELETE, WriteOp.DELETE_WHERE):
        assert w.ids is not None
        target = store.get(w.namespace)
        return 0 if target is None else target.delete(w.ids)
    n = store.drop(w.namespace)
    if w.namespace == "default":
        store.get_or_create("default")
    return n
