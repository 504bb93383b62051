"""Adapters that let other frameworks keep their vectors in a Kalos sidecar.

``langchain``, ``langgraph`` and ``llamaindex`` hold one store each; what they share is written
once beside them: ``_ids`` (string keys as Kalos ids, the one collision error), ``_filters``
(building Kalos ``where=`` filters), ``_plans`` (each operation as a plan that sync and async
methods both run), ``_loops`` (one pool per event loop) and ``_core`` (a store's client, pools and
the two drivers). docs/architecture.md, "Integrations", draws how they fit.
"""

from __future__ import annotations

from ._core import require_similarity
from ._ids import IdCollision

__all__ = ["IdCollision", "require_similarity"]
