"""Writes of more rows than one slot carries, as pure decisions: how an upsert's rows are packed
into chunks and what a failed call means for each chunk's ids.

An upsert or delete is validated whole before its first chunk is sent (clients._requests), each
payload against the sidecar's ``--payload-limit`` too (the segment header carries it), so the only
failures left part way are outages and store failures between chunks. For those, :func:`failure`
says which ids were written, which were not, and which are in doubt (:class:`kalos.broker.errors.PartialWrite`). The pool and the blocking client do the I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..broker.errors import AcquireTimeout, KalosError, PayloadTooLarge, partial_write
from ..broker.layout import Op, Status
from .results import Written, written


def last_wins(ids: np.ndarray) -> np.ndarray | None:
    """Positions in ``ids`` keeping the last occurrence of each id, in call order, or None if
    every id occurs once. Chunks of one call are served in any order, so "the last wins" across
    chunks holds only if the client drops the earlier duplicates."""
    if len(ids) < 2:
        return None
    rev = ids[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    if len(first_in_rev) == len(ids):
        return None
    return np.sort(len(ids) - 1 - first_in_rev)


def pack(
    lines: Sequence[bytes] | None, n: int, max_rows: int, blob_bytes: int, payload_limit: int
) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` of consecutive chunks: at most ``max_rows`` rows each and, with
    payloads, at most ``blob_bytes`` bytes of payload lines (joined by newlines: the slot's blob
    area). Raises PayloadTooLarge naming the first row whose payload exceeds the sidecar's
    ``payload_limit`` (its ``--payload-limit``, read from the segment header) or, alone, the blob
    area: the whole call is refused before any part of it is sent."""
    if lines is None:
        return [(lo, min(n, lo + max_rows)) for lo in range(0, n, max_rows)]
    out: list[tuple[int, int]] = []
    lo, used = 0, -1  # -1: the first line of a chunk has no newline before it
    for row, line in enumerate(lines):
        size = len(line)
        if size > payload_limit:
            raise PayloadTooLarge(
                f"the payload of row {row} takes {size} bytes, over the sidecar's --payload-limit "
                f"of {payload_limit}: nothing of this call was sent"
            )
        if size > blob_bytes:
            raise PayloadTooLarge(
                f"the payload of row {row} takes {size} bytes; a request carries at most "
                f"{blob_bytes} (the slot's blob area, the sidecar's --blob-bytes): nothing of this "
                "call was sent"
            )
        if row > lo and (row - lo == max_rows or used + 1 + size > blob_bytes):
            out.append((lo, row))
            lo, used = row, -1
        used += 1 + size
    if n > lo:
        out.append((lo, n))
    return out


class WriteCall:
    """Shared by the chunks of one call that are sent at once: set ``failed`` as soon as one
    fails (the pool sets it where the failure is first seen: the answer read, the outage found),
    and no further chunk of the call is posted."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


class Fate(enum.Enum):
    """What became of one chunk of a call."""

    APPLIED = "written"  # answered OK
    NOT_APPLIED = "not written"  # never sent, or refused before the sidecar wrote anything
    IN_DOUBT = "in doubt"  # sent and never answered, or failed after the sidecar's store took it


#: Statuses a sidecar answers before it stores or applies anything of the request (the write
#: path checks the slot, then capacity, then commits; a failed commit is rolled back).
_REFUSED = frozenset(
    {
        Status.BAD_REQUEST,
        Status.DIM_MISMATCH,
        Status.K_OUT_OF_RANGE,
        Status.TOO_MANY_QUERIES,
        Status.NOT_FINITE,
        Status.UNKNOWN_NAMESPACE,
        Status.PAYLOAD_TOO_LARGE,
        Status.UNKNOWN_OP,
        Status.STORE_ERROR,
        Status.CAPACITY,
        Status.BAD_ID,
    }
)


def fate(ok: bool, posted: bool, status: int | None) -> Fate:
    """One chunk's fate: ``ok`` (answered OK), ``posted`` (it reached a slot and was posted),
    ``status`` (the error status the sidecar answered, None if it never answered)."""
    if ok:
        return Fate.APPLIED
    if not posted:
        return Fate.NOT_APPLIED
    if status is not None and status in _REFUSED:
        return Fate.NOT_APPLIED
    return Fate.IN_DOUBT  # lost in flight, or BACKEND_ERROR / SERVER_ERROR after the commit


class Chunk(Protocol):
    """What :func:`settle` reads of one chunk (``clients._requests.Prepared`` has it)."""

    @property
    def ids(self) -> np.ndarray | None: ...  # None: a delete by filter

    @property
    def posted(self) -> bool: ...

    @property
    def status(self) -> int | None: ...


_NO_IDS = np.empty(0, np.int64)


def out_of_budget(deadline: float | None, now: float) -> AcquireTimeout | None:
    """The error of a chunk whose call has no budget left before the chunk is sent (seconds on
    one monotonic clock; None: no limit): it is not posted, since nobody would wait for it."""
    if deadline is not None and now >= deadline:
        return AcquireTimeout("the call's time budget ran out before this part was sent")
    return None


def settle(op: Op, chunks: Sequence[Chunk], results: Sequence[object]) -> Written:
    """The rows a call wrote when every chunk was answered (``results`` all ints, each a Written
    with the fleet position of its chunk: the call's is the last); else raise the
    call's error (:func:`failure`): ``results`` holds each chunk's count, the KalosError it
    failed with, or None (not sent); the first error is the cause."""
    counts = [r for r in results if isinstance(r, int)]
    if len(counts) == len(results):
        return written(counts)
    cause = next(r for r in results if isinstance(r, KalosError))
    fates = [fate(isinstance(r, int), c.posted, c.status) for c, r in zip(chunks, results)]
    err = failure(op, cause, [_NO_IDS if c.ids is None else c.ids for c in chunks], fates)
    if err is cause:
        raise cause
    raise err from cause


def failure(op: Op, cause: KalosError, chunk_ids: Sequence[np.ndarray], fates: Sequence[Fate]) -> KalosError:
    """The error a failed call raises: ``cause`` itself if the call was one request (the
    sidecar applies a request whole or not at all) or no chunk was applied or is in doubt
    (nothing happened: the call can be fixed or sent again as it is); else a PartialWrite that
    is also a ``type(cause)``, listing the ids by fate. ``op``: UPSERT or DELETE."""
    if len(fates) < 2 or all(f is Fate.NOT_APPLIED for f in fates):
        return cause
    by: dict[Fate, list[int]] = {f: [] for f in Fate}
    for ids, f in zip(chunk_ids, fates):
        by[f].extend(ids.tolist())
    written, unwritten, doubt = (tuple(by[f]) for f in (Fate.APPLIED, Fate.NOT_APPLIED, Fate.IN_DOUBT))
    total = len(written) + len(unwritten) + len(doubt)
    what = op.name.lower()
    verb = {Op.UPSERT: "written", Op.TOUCH: "touched"}.get(op, "deleted")
    return partial_write(
        cause,
        f"{what} of {total} ids in {len(fates)} requests stopped part way: {len(written)} "
        f"{verb}, {len(unwritten)} not, {len(doubt)} in doubt (sent, no answer; {what} is "
        f"idempotent: sending them again is safe); .written, .unwritten and .in_doubt list them. "
        f"Stopped by {type(cause).__name__}: {cause}",
        written=written,
        unwritten=unwritten,
        in_doubt=doubt,
    )


__all__ = ["Chunk", "Fate", "WriteCall", "failure", "fate", "last_wins", "out_of_budget", "pack", "settle"]
