"""What recalls return."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from ..broker.positions import Position


class Hit(tuple[int, float, Any]):
    """One hit: the tuple ``(id, score, payload)`` (so ``id, score, payload = hit`` works as it
    always did), with names, and what a recall carried beside them (None where it did not):

    * ``similarity`` and ``recency``: the two parts of a recency-weighted score
      (``score = similarity + recency``; :class:`~kalos.broker.clock.Recency`);
    * ``created_at``, ``updated_at``, ``expires_at``: the record's timestamps in seconds since the
      epoch (the sidecar's clock; ``expires_at`` is ``math.inf`` for a record that never expires),
      carried by recalls ``with_payload=True`` or ``with_times=True`` and by recency recalls."""

    similarity: float | None
    recency: float | None
    created_at: float | None
    updated_at: float | None
    expires_at: float | None

    def __new__(
        cls,
        id: int,
        score: float,
        payload: Any = None,
        *,
        similarity: float | None = None,
        recency: float | None = None,
        created_at: float | None = None,
        updated_at: float | None = None,
        expires_at: float | None = None,
    ) -> Hit:
        self = super().__new__(cls, (id, score, payload))
        self.similarity, self.recency = similarity, recency
        self.created_at, self.updated_at, self.expires_at = created_at, updated_at, expires_at
        return self

    @property
    def id(self) -> int:
        return self[0]

    @property
    def score(self) -> float:
        return self[1]

    @property
    def payload(self) -> Any:
        return self[2]

    @property
    def text(self) -> str | None:
        """The record's text (``upsert_text`` keeps it in the payload's ``"text"`` field): None
        when the recall carried no payload or the payload has no text."""
        p = self[2]
        t = p.get("text") if isinstance(p, dict) else None
        return t if isinstance(t, str) else None

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={v!r}"
            for name in ("similarity", "recency", "created_at", "updated_at", "expires_at")
            if (v := getattr(self, name)) is not None
        )
        return f"Hit(id={self[0]!r}, score={self[1]!r}, payload={self[2]!r}{extra})"


class Hits(Sequence[Hit]):
    """Top-k of one query, best first: ``ids`` (int64) and ``scores`` (float32) arrays, and
    ``payloads`` when recalled ``with_payload=True``. Iterating yields :class:`Hit` tuples.

    Scores: the dot product (dot), cosine similarity (cosine), or minus the squared Euclidean
    distance (l2); higher is always better. A recency-weighted recall (``recency=``) adds each
    record's recency part: ``scores = similarity + recency`` (float32 and float64 arrays).

    Timestamps (float64 seconds since the epoch, the sidecar's clock; None when the recall did not
    carry them: ``with_payload=True``, ``with_times=True`` and ``recency=`` recalls do):
    ``created_at`` (first write of the id), ``updated_at`` (last write), ``expires_at`` (``inf``:
    never); ``served_at_ns``: the sidecar's clock (int ns) the recall was served at.
    """

    __slots__ = (
        "ids",
        "scores",
        "payloads",
        "similarity",
        "recency",
        "created_at",
        "updated_at",
        "expires_at",
        "served_at_ns",
    )

    def __init__(
        self,
        ids: np.ndarray,
        scores: np.ndarray,
        payloads: list[Any] | None = None,
        *,
        recency: np.ndarray | None = None,
        created_at: np.ndarray | None = None,
        updated_at: np.ndarray | None = None,
        expires_at: np.ndarray | None = None,
        served_at_ns: int | None = None,
    ) -> None:
        self.ids = ids
        self.scores = scores
        self.payloads = payloads
        self.recency = recency
        self.similarity = None if recency is None else (scores.astype(np.float64) - recency).astype(np.float32)
        self.created_at = created_at
        self.updated_at = updated_at
        self.expires_at = expires_at
        #: The sidecar's clock (CLOCK_REALTIME ns) the recall was served at: what expiry and ages
        #: were decided at (None where the recall carried no timestamps).
        self.served_at_ns = served_at_ns

    def head(self, k: int) -> Hits:
        """The first ``k`` hits, with everything they carry (a shared slot's answer cut to one
        caller's k)."""
        if len(self.ids) <= k:
            return self

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:k]

        return Hits(
            self.ids[:k],
            self.scores[:k],
            None if self.payloads is None else self.payloads[:k],
            recency=cut(self.recency),
            created_at=cut(self.created_at),
            updated_at=cut(self.updated_at),
            expires_at=cut(self.expires_at),
            served_at_ns=self.served_at_ns,
        )

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> Hit: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Hit]: ...
    def __getitem__(self, i: int | slice) -> Hit | Sequence[Hit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        payload = None if self.payloads is None else self.payloads[i]
        if self.created_at is None and self.recency is None:
            return Hit(int(self.ids[i]), float(self.scores[i]), payload)
        return Hit(
            int(self.ids[i]),
            float(self.scores[i]),
            payload,
            similarity=None if self.similarity is None else float(self.similarity[i]),
            recency=None if self.recency is None else float(self.recency[i]),
            created_at=None if self.created_at is None else float(self.created_at[i]),
            updated_at=None if self.updated_at is None else float(self.updated_at[i]),
            expires_at=None if self.expires_at is None else float(self.expires_at[i]),
        )

    def __iter__(self) -> Iterator[Hit]:
        for j in range(len(self.ids)):
            yield self[j]

    def __repr__(self) -> str:
        return f"Hits(ids={self.ids.tolist()}, scores={np.round(self.scores, 4).tolist()})"


@dataclass(frozen=True)
class Records:
    """Records fetched by id (``get``): those that exist, in the order asked (an id asked twice
    comes twice), and the ids that do not exist (``missing``, in the order asked; not an error:
    an expired record does not exist).

    ``ids`` int64 (m,); ``vectors`` float32 (m, dim) as stored (unit rows under cosine), or None
    when fetched ``with_vectors=False``; ``payloads``: m decoded payloads (None for none);
    ``created_at``, ``updated_at``, ``expires_at``: float64 (m,) seconds since the epoch (the
    sidecar's clock; ``expires_at`` ``inf``: never), None only where a caller built the value
    without them."""

    ids: np.ndarray
    vectors: np.ndarray | None
    payloads: list[Any]
    missing: np.ndarray
    created_at: np.ndarray | None = None
    updated_at: np.ndarray | None = None
    expires_at: np.ndarray | None = None
    served_at_ns: int | None = None  # the sidecar's clock (CLOCK_REALTIME ns) it was served at

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
