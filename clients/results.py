"""What recalls return."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import numpy as np

from ..broker.positions import Position


class Hit(NamedTuple):
    id: int
    score: float
    payload: Any = None


class Hits(Sequence[Hit]):
    """Top-k of one query, best first: ``ids`` (int64) and ``scores`` (float32) arrays, and
    ``payloads`` when recalled ``with_payload=True``. Iterating yields :class:`Hit` tuples.

    Scores: the dot product (dot), cosine similarity (cosine), or minus the squared Euclidean
    distance (l2); higher is always better.
    """

    __slots__ = ("ids", "scores", "payloads")

    def __init__(self, ids: np.ndarray, scores: np.ndarray, payloads: list[Any] | None = None) -> None:
        self.ids = ids
        self.scores = scores
        self.payloads = payloads

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> Hit: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Hit]: ...
    def __getitem__(self, i: int | slice) -> Hit | Sequence[Hit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Hit(int(self.ids[i]), float(self.scores[i]), None if self.payloads is None else self.payloads[i])

    def __iter__(self) -> Iterator[Hit]:
        for j in range(len(self.ids)):
            yield self[j]

    def __repr__(self) -> str:
        return f"Hits(ids={self.ids.tolist()}, scores={np.round(self.scores, 4).tolist()})"


@dataclass(frozen=True)
class Records:
    """Records fetched by id (``get``): those that exist, in the order asked (an id asked twice
    comes twice), and the ids that do not exist (``missing``, in the order asked; not an error).

    ``ids`` int64 (m,); ``vectors`` float32 (m, dim) as stored (unit rows under cosine), or None
    when fetched ``with_vectors=False``; ``payloads``: m decoded payloads (None for none)."""

    ids: np.ndarray
    vectors: np.ndarray | None
    payloads: list[Any]
    missing: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


class Written(int):
    """What a write returns: the rows written or removed (an ``int``, as before fleets) and
    ``position``, the place of the write's last change in its fleet's change log (a
    :class:`~kalos.broker.positions.Position`; None where the sidecar has no change log, i.e.
    SQLite or ephemeral). Pass ``position`` as ``after=`` to a read on any node of the fleet to
    read this write there."""

    position: Position | None

    def __new__(cls, rows: int, position: Position | None = None) -> Written:
        self = super().__new__(cls, rows)
        self.position = position
        return self

    def __repr__(self) -> str:
        return f"Written({int(self)}, position={self.position})"


def written(parts: Sequence[int]) -> Written:
    """One :class:`Written` for a write sent in chunks: the rows summed, the last position."""
    positions = [p.position for p in parts if isinstance(p, Written) and p.position is not None]
    return Written(sum(int(p) for p in parts), max(positions) if positions else None)
