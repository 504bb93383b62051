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
    """What the serving loop asks of a durable store (SQLite here, PostgreSQL in ``fleet``).

    The serving thread is the only caller; ``commit`` runs before anything of the batch is applied
    in memory, ``applied`` after."""

    def load_into(self, store: MemoryStore) -> tuple[int, float]:
        """Load every namespace into ``store``; returns (rows, seconds). Raises ConfigError."""
        ...

    def commit(self, writes: list[Write], store: MemoryStore) -> list[Position] | None:
        """Resolve the deletes by filter against ``store`` (brought up to date first where other
        writers exist) and make ``writes`` durable, all or nothing. Returns each write's position
        in the change log (None where the store has none). Raises StoreError."""
        ...

    def applied_through(self, position: Position | None) -> None:
        """The writes of the last commit are applied in memory up to ``position`` (the last of
        what ``commit`` returned; None: not all of them, so the change log brings them again)."""
        ...

    def close(self) -> None: ...


def commit_and_apply(
    persist: Durable | None, store: MemoryStore, writes: list[Write]
) -> tuple[list[Position] | None, list[int | Exception]]:
    """Make ``writes`` durable (resolved against ``store`` by the store's ``commit``; resolved
    here without one), then apply them to ``store`` in order. Returns the positions ``commit``
    gave (None: no change log) and each write's count, or the exception applying it raised (then
    durable but not applied here: the change log brings it again where there is one). Raises
    StoreError when the commit fails (nothing applied). The serving thread's one way to write:
    the general route, refreshes on read and the sweeper."""
    positions = None
    if persist is not None:
        positions = persist.commit(writes, store)
    else:
        for w in writes:
            w.resolve(store)
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
