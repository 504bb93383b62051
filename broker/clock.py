"""Memory over time, the parts clients and the sidecar share: how a TTL is given and encoded,
what a recency weighting is (:class:`Recency`) and the one formula of its decay. Pure.

One clock decides: the sidecar's ``CLOCK_REALTIME``, in integer nanoseconds. It stamps every
record it writes (``created_at``: the first write of the id, ``updated_at``: the last), sets
``expires_at = updated_at + ttl`` (0: never), and computes every age at serving time; a client
never sends a time, only durations (a TTL, a half-life). The Python API speaks seconds (floats,
like :func:`time.time`); the protocol speaks nanoseconds (docs/protocol.md, "Memory over time").

**Decay.** A recency-weighted recall ranks every matching row by::

    score = similarity + weight * 0.5 ** (age / half_life)      age = max(0, now - updated_at)

so a record's recency part is ``weight`` when just written, half of it one half-life later, and
tends to 0. LangChain's ``TimeWeightedVectorStoreRetriever`` adds ``(1 - decay_rate) ** hours``
(hours since last access, weight 1): the same curve with ``half_life = 3600 * ln(0.5) /
ln(1 - decay_rate)`` seconds (:meth:`Recency.from_decay_rate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidRequest

NS = 1_000_000_000
#: ``expires_at`` of a record that never expires, and the ``ttl_ns`` that says "never".
NEVER = 0
#: The longest TTL: a century (beyond it, ``now + ttl`` would approach int64's end).
MAX_TTL_S = 100 * 365.25 * 86400.0
MAX_TTL_NS = int(MAX_TTL_S * NS)


def ttl_ns(ttl: Any) -> int:
    """A TTL given in seconds as the protocol's ``ttl_ns``: ``math.inf`` means never expire (0).
    Raises InvalidRequest for anything but a positive number of seconds up to a century or inf
    (a bool, NaN, 0 or less, a string ...). ``None`` is the caller's to handle (the default)."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float, np.integer, np.floating)):
        raise InvalidRequest(f"ttl takes seconds (a number > 0, or math.inf for never), got {ttl!r}")
    t = float(ttl)
    if t == math.inf:
        return NEVER
    if not math.isfinite(t) or t <= 0.0:
        raise InvalidRequest(f"ttl must be > 0 seconds (math.inf: never expire), got {ttl!r}")
    if t > MAX_TTL_S:
        raise InvalidRequest(f"ttl of {t:.4g} s is beyond a century; use math.inf for never")
    return max(1, round(t * NS))


def ttl_groups(ttl: Any, n: int) -> list[tuple[int | None, np.ndarray]]:
    """An upsert's ``ttl`` for its ``n`` rows as groups of rows sharing one ``ttl_ns`` (None: the
    namespace's default), in order of first appearance. ``ttl``: None, seconds, math.inf, or a
    sequence of those, one per row. Raises InvalidRequest. Pure."""
    if ttl is None or not isinstance(ttl, (Sequence, np.ndarray)) or isinstance(ttl, (str, bytes)):
        return [(None if ttl is None else ttl_ns(ttl), np.arange(n))]
    values = list(ttl)
    if len(values) != n:
        raise InvalidRequest(f"{len(values)} ttls for {n} rows")
    codes = [None if v is None else ttl_ns(v) for v in values]
    groups: dict[int | None, list[int]] = {}
    for i, c in enumerate(codes):
        groups.setdefault(c, []).append(i)
    return [(c, np.asarray(rows, np.intp)) for c, rows in groups.items()]


@dataclass(frozen=True, slots=True)
class Recency:
    """Rank a recall by ``similarity + weight * 0.5 ** (age / half_life)`` (module docstring):
    ``half_life`` in seconds (finite, > 0), ``weight`` any finite number (the score units of the
    sidecar's metric: 0.1 under cosine lets a fresh record beat an older one up to 0.1 more
    similar). Checked when made: InvalidRequest."""

    half_life: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        h, w = self.half_life, self.weight
        for name, v in (("half_life", h), ("weight", w)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise InvalidRequest(f"Recency {name} must be a number, got {v!r}")
        if not (math.isfinite(float(h)) and float(h) > 0.0):
            raise InvalidRequest(f"Recency half_life must be finite seconds > 0, got {h!r}")
        if not math.isfinite(float(w)):
            raise InvalidRequest(f"Recency weight must be finite, got {w!r}")
        object.__setattr__(self, "half_life", float(h))
        object.__setattr__(self, "weight", float(w))

    @classmethod
    def from_decay_rate(cls, decay_rate: float, weight: float = 1.0) -> Recency:
        """LangChain's form, ``(1 - decay_rate) ** hours_passed``: the same decay as a half-life
        (0 < decay_rate < 1)."""
        if not 0.0 < decay_rate < 1.0:
            raise InvalidRequest(f"decay_rate must be in (0, 1), got {decay_rate!r}")
        return cls(3600.0 * math.log(0.5) / math.log1p(-decay_rate), weight)

    def part(self, updated_at_ns: np.ndarray, now_ns: int) -> np.ndarray:
        """The recency part (float64) of records last written at ``updated_at_ns``, at ``now_ns``."""
        return decay_part(updated_at_ns, now_ns, self.half_life, self.weight)


def decay_part(updated_at_ns: np.ndarray, now_ns: int, half_life_s: float, weight: float) -> np.ndarray:
    """``weight * 0.5 ** (max(0, now - updated_at) / half_life)`` per record, float64. The one
    formula (the backends' kernels compute the same in their own precision). Pure."""
    age_s = np.maximum(now_ns - np.asarray(updated_at_ns, np.int64), 0).astype(np.float64) / NS
    out: np.ndarray = weight * np.exp2(-age_s / half_life_s)
    return out


def check_recency(half_life_s: float, weight: float) -> str | None:
    """Why a recency a client wrote (any float64s) is refused, or None. Never raises. Pure."""
    if not (math.isfinite(half_life_s) and half_life_s > 0.0):
        return f"half_life_s must be finite and > 0, got {half_life_s!r}"
    if not math.isfinite(weight):
        return f"recency_weight must be finite, got {weight!r}"
    return None


def seconds(ns: np.ndarray) -> np.ndarray:
    """Nanosecond timestamps as float64 seconds since the epoch (``time.time()``'s unit)."""
    out: np.ndarray = np.asarray(ns, np.int64).astype(np.float64) / NS
    return out


def expiry_seconds(ns: np.ndarray) -> np.ndarray:
    """``expires_at`` in seconds, ``inf`` for a record that never expires (``NEVER``)."""
    s = seconds(ns)
    s[np.asarray(ns) == NEVER] = np.inf
    return s


__all__ = [
    "MAX_TTL_NS",
    "NEVER",
    "NS",
    "Recency",
    "check_recency",
    "decay_part",
    "expiry_seconds",
    "seconds",
    "ttl_groups",
    "ttl_ns",
]
