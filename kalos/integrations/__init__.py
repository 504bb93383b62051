"""Adapters that let other frameworks keep their vectors in a Kalos sidecar."""

from __future__ import annotations

from kalos.broker.errors import UsageError


def require_similarity(metric: str, what: str) -> None:
    """Stores that promise cosine similarities need a sidecar that scores by inner product:
    raise UsageError (naming the sidecar's metric) for one started with ``--metric l2``."""
    if metric not in ("cosine", "dot"):
        raise UsageError(f"{what} needs a sidecar started with --metric cosine or dot (its scores "
                         f"are then cosine similarities); this one scores with {metric!r}")
