"""Pools opened before a fork belong to the parent: the child's copies must never touch the
parent's slots. One hook, registered once, tells every pool still open in the child
(:func:`track`) that it is a forked copy (every use then raises ForkedPoolError at once)."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Forkable(Protocol):
    def _forked(self) -> None:
        """Forget the parent's slots, threads and loop without touching any of them."""


_OPEN: weakref.WeakSet[Forkable] = weakref.WeakSet()


def track(client: Forkable) -> None:
    """``client`` is open in this process: a fork tells its child's copy."""
    _OPEN.add(client)


def untrack(client: Forkable) -> None:
    _OPEN.discard(client)


def _after_fork_in_child() -> None:
    for client in list(_OPEN):
        client._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["Forkable", "track", "untrack"]
