"""Positions in a fleet's change log: what a write returns and what ``after=`` waits for.

A fleet (sidecars following one PostgreSQL store, ``kalos serve --store postgresql://...``) orders
every change by ``(xid, seq)``: the writing transaction's 64-bit id, then the change's number in
the log. A write's answer carries the position of its last change; a read given ``after=`` that
position is served once the local sidecar has applied the log up to it. Positions compare as
tuples; they are plain data, safe to send to another process or host (``str`` / :meth:`parse`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequest

_PREFIX = "kpos:"
_U63 = (1 << 63) - 1


@dataclass(frozen=True, order=True, slots=True)
class Position:
    """A place in a fleet's change log (``xid``, then ``seq``); both in ``1..2**63-1``."""

    xid: int
    seq: int

    def __post_init__(self) -> None:
        for name in ("xid", "seq"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v <= _U63:
                raise InvalidRequest(f"position {name} must be an int in 0..2**63-1, got {v!r}")

    def __str__(self) -> str:
        return f"{_PREFIX}{self.xid}.{self.seq}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """The position ``str(position)`` spelt. Raises InvalidRequest."""
        if not isinstance(text, str) or not text.startswith(_PREFIX):
            raise InvalidRequest(f"not a position token: {text!r}")
        xid, dot, seq = text[len(_PREFIX) :].partition(".")
        if not dot or not xid.isdigit() or not seq.isdigit():
            raise InvalidRequest(f"not a position token: {text!r}")
        return cls(int(xid), int(seq))


#: Before every change (a follower that has applied nothing yet).
ORIGIN = Position(0, 0)
#: After every change: what a sidecar without a change log has "applied" (nothing waits there).
BEYOND = Position(_U63, _U63)


def as_position(after: Position | str | None) -> Position | None:
    """``after=`` as a caller may give it: a Position, its string, or None. Raises InvalidRequest."""
    if after is None or isinstance(after, Position):
        return after
    if isinstance(after, str):
        return Position.parse(after)
    raise InvalidRequest(f"after= takes a Position (a write's .position) or its string, got {type(after).__name__}")
