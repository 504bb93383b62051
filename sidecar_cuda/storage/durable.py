"""The seam every durable store implements (:class:`Durable`: SQLite in :mod:`.sqlite`, PostgreSQL
in :mod:`.fleet`), the choice of store from the config (:func:`store_kind`, the one place it is
made), and the serving thread's one way to write (:func:`commit_and_apply`): durable first, then
applied in memory, then acknowledged."""

from __future__ import annotations

import enum
from typing import Protocol

from ...broker.positions import Position
from .store import MemoryStore
from .writes import Write, apply_write


class StoreError(Exception):
    """The durable store failed; the batch's writes were not acknowledged."""


class StoreKind(enum.Enum):
    EPHEMERAL = "ephemeral"  # memory only
    SQLITE = "sqlite"  # --data-dir: one host
    POSTGRES = "postgres"  # --store postgresql://...: a fleet of sidecars following one database


def store_kind(data_dir: str | None, store: str | None) -> StoreKind:
    """Where a sidecar's memories live, from its (validated) config: the one place it is chosen."""
    if store is not None:
        return StoreKind.POSTGRES
    return StoreKind.EPHEMERAL if data_dir is None else StoreKind.SQLITE


class Durable(Protocol):
    """What the serving loop asks of a durable store (SQLite in ``sqlite``, PostgreSQL in
    ``fleet``).

    The serving thread is the only caller, through :func:`commit_and_apply`: ``begin`` (brought
    up to date, the store's write lock held), the writes resolved against the memory (here, the
    one place), ``commit`` (or ``abort``), then the writes applied in memory, then
    ``applied_through``."""

    def load_into(self, store: MemoryStore) -> tuple[int, float]:
        """Load every namespace into ``store``; returns (rows, seconds). Raises ConfigError."""
        ...

    def begin(self, store: MemoryStore) -> None:
        """Before a batch's writes are resolved: bring ``store`` up to what other writers
        committed (where there are any) and hold the store's write lock until :meth:`commit` or
        :meth:`abort`, so deletes by filter match what every writer committed before them.
        Raises StoreError (nothing begun)."""
        ...

    def commit(self, writes: list[Write]) -> list[Position] | None:
        """Make the resolved ``writes`` durable, all or nothing, and end what :meth:`begin` began.
        Returns each write's position in the change log (None where the store has none).
        Raises StoreError."""
        ...

    def abort(self) -> None:
        """End what :meth:`begin` began without writing anything."""
        ...

    def applied_through(self, position: Position | None) -> None:
        """The writes of the last commit are applied in memory up to ``position`` (the last of
        what ``commit`` returned; None: not all of them, so the change log brings them again)."""
        ...

    def close(self) -> None: ...


def resolve_writes(writes: list[Write], store: MemoryStore | None) -> None:
    """Resolve ``writes`` against ``store`` (None: an empty one, for tools without a memory):
    stamps, the ids a delete by filter or an expiry names. The one place writes are resolved:
    :func:`commit_and_apply` on the serving thread, and the offline tools before they commit."""
    for w in writes:
        w.resolve(store)


def commit_and_apply(
    persist: Durable | None, store: MemoryStore, writes: list[Write]
) -> tuple[list[Position] | None, list[int | Exception]]:
    """Make ``writes`` durable (``begin``, resolved against ``store``, ``commit``; resolved only,
    without a durable store), then apply them to ``store`` in order. Returns the positions
    ``commit`` gave (None: no change log) and each write's count, or the exception applying it
    raised (then durable but not applied here: the change log brings it again where there is
    one). Raises StoreError when the commit fails (nothing applied). The serving thread's one way
    to write: the general route, refreshes on read and the sweeper."""
    positions = None
    if persist is None:
        resolve_writes(writes, store)
    else:
        persist.begin(store)
        try:
            resolve_writes(writes, store)
        except BaseException:
            persist.abort()
            raise
        positions = persist.commit(writes)
    out: list[int | Exception] = []
    for w in writes:
        try:
            out.append(apply_write(store, w))
        except Exception as e:
            out.append(e)
    if persist is not None:
        # A write that failed to apply here is applied again from the change log (where there is
        # one): the store's cursor then stays before this batch.
        failed = any(isinstance(x, Exception) for x in out)
        persist.applied_through(None if failed or not positions else positions[-1])
    return positions, out
