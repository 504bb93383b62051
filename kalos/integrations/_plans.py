"""Store logic written once for sync and async: plans that yield typed steps, and the plans the
stores share.

A *plan* is a generator: it yields a list of :class:`Step` values (requests that may run
concurrently), is sent their results in the same order, and returns the operation's answer. It
does no I/O itself. Two drivers run plans (``_core.Connections``): the blocking one on a
``RecallClient``, a step after another; the async one on the running loop's ``RecallPool``, the
steps of one list at once. A store method and its ``a``-twin are then the same plan::

    def add(self, ...):         return self._conns.run(self._add(...))
    async def aadd(self, ...):  return await self._conns.arun(self._add(...))

A step names its call as a pair of typed callables (:class:`Call`: ``RecallClient.get`` and
``RecallPool.get``, arguments checked by mypy against both), never by a method name. Errors listed
in ``Step.catching`` come back as the step's result (a plan tests ``isinstance``); any other error
ends the plan and reaches the caller.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Generator, Mapping, MutableSet, Sequence
from dataclasses import dataclass, replace
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import numpy as np

from kalos.broker.errors import PayloadTooLarge
from kalos.broker.layout import Layout
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool
from kalos.clients.results import Records

from ._filters import Where
from ._ids import K, Reading, next_reads

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


@dataclass(frozen=True)
class Step(Generic[T]):
    """One request of a plan: how it runs on a blocking client and how on a pool."""

    run: Callable[[RecallClient], T]
    arun: Callable[[RecallPool], Awaitable[T]]
    catch: tuple[type[Exception], ...] = ()

    def catching(self, *errors: type[Exception]) -> Step[T]:
        """This step with ``errors`` handed back as its result instead of ending the plan."""
        return replace(self, catch=self.catch + errors)


#: Yields the steps to run (together), is sent their results, returns the answer.
Plan = Generator[Sequence[Step[Any]], list[Any], R]


class Call(Generic[P, T]):
    """A Kalos operation both clients have under one signature: ``Call(RecallClient.get,
    RecallPool.get)(ids, namespace=...)`` is the step of one ``get``."""

    def __init__(
        self,
        blocking: Callable[Concatenate[RecallClient, P], T],
        pooled: Callable[Concatenate[RecallPool, P], Awaitable[T]],
    ) -> None:
        self._blocking = blocking
        self._pooled = pooled

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Step[T]:
        return Step(lambda c: self._blocking(c, *args, **kwargs), lambda p: self._pooled(p, *args, **kwargs))


RECALL = Call(RecallClient.recall, RecallPool.recall)
GET = Call(RecallClient.get, RecallPool.get)
UPSERT = Call(RecallClient.upsert, RecallPool.upsert)
DELETE = Call(RecallClient.delete, RecallPool.delete)
TOUCH = Call(RecallClient.touch, RecallPool.touch)
DROP_NAMESPACE = Call(RecallClient.drop_namespace, RecallPool.drop_namespace)
EXPORT_PAGE = Call(RecallClient.export_page, RecallPool.export_page)
COUNT = Call(RecallClient.count, RecallPool.count)


async def _pool_layout(pool: RecallPool) -> Layout:
    return pool.layout


#: The connection's geometry (no request: read from the sidecar's header).
LAYOUT: Step[Layout] = Step(lambda c: c.layout, _pool_layout)


def layout() -> Plan[Layout]:
    """The sidecar's geometry (dim, max_k, max_queries, blob_bytes)."""
    results = yield [LAYOUT]
    lay: Layout = results[0]
    return lay


def together(plans: Sequence[Plan[Any]]) -> Plan[list[Any]]:
    """Several plans side by side: each round, the steps of every unfinished plan go out in one
    list (concurrently on a pool). Returns their answers in order."""
    answers: list[Any] = [None] * len(plans)
    pending: list[tuple[int, Sequence[Step[Any]]]] = []
    for i, plan in enumerate(plans):
        try:
            pending.append((i, next(plan)))
        except StopIteration as done:
            answers[i] = done.value
    while pending:
        results = yield [s for _, steps in pending for s in steps]
        at = 0
        waiting, pending = pending, []
        for i, steps in waiting:
            part, at = results[at : at + len(steps)], at + len(steps)
            try:
                pending.append((i, plans[i].send(part)))
            except StopIteration as done:
                answers[i] = done.value
    return answers


def fetch_payloads(namespace: str, ids: Sequence[int]) -> Plan[dict[int, Any]]:
    """The payloads of the records of ``ids`` that exist (id -> payload), read a slot-full of ids
    per request (:func:`fetch_records`). A namespace that does not exist holds nothing."""
    found = yield from fetch_records(namespace, ids)
    return {i: r.payload for i, r in found.items()}


#: The metadata keys under which the stores hand out a record's timestamps (seconds since the
#: epoch, float, the sidecar's clock): first write and last write. Prefixed, so that they never
#: hide a metadata key of a document's or node's own.
CREATED_AT_KEY = "kalos_created_at"
UPDATED_AT_KEY = "kalos_updated_at"
TIME_KEYS = (CREATED_AT_KEY, UPDATED_AT_KEY)


@dataclass(frozen=True)
class Stamped:
    """A record's payload and its timestamps: seconds since the epoch on the sidecar's clock
    (``created_at``: first write of the id, ``updated_at``: last write, ``expires_at``: ``inf``
    for a record that never expires)."""

    payload: Any
    created_at: float
    updated_at: float
    expires_at: float


def fetch_records(namespace: str, ids: Sequence[int]) -> Plan[dict[int, Stamped]]:
    """The records of ``ids`` that exist and have not expired (id -> :class:`Stamped`); none in a
    namespace that does not exist (the sidecar answers it as empty). A slot-full of ids per
    request, the requests together. A request whose payloads overflow the slot is halved
    (PayloadTooLarge only for one record alone)."""
    lay = yield from layout()
    out: dict[int, Stamped] = {}
    unique = list(dict.fromkeys(ids))
    chunks = [unique[i : i + lay.max_queries] for i in range(0, len(unique), lay.max_queries)]
    while chunks:
        answers = yield [GET(c, namespace=namespace, with_vectors=False).catching(PayloadTooLarge) for c in chunks]
        retry: list[list[int]] = []
        for chunk, got in zip(chunks, answers):
            if isinstance(got, PayloadTooLarge):
                if len(chunk) == 1:
                    raise got
                retry += [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
                continue
            out.update(_stamped(got))
        chunks = retry
    return out


def _stamped(records: Records) -> dict[int, Stamped]:
    """id -> :class:`Stamped` of a ``get`` answer (which always carries the timestamps)."""
    assert records.created_at is not None and records.updated_at is not None and records.expires_at is not None
    return {
        i: Stamped(p, c, u, e)
        for i, p, c, u, e in zip(
            records.ids.tolist(),
            records.payloads,
            records.created_at.tolist(),
            records.updated_at.tolist(),
            records.expires_at.tolist(),
        )
    }


@dataclass(frozen=True)
class ByKey(Generic[K]):
    """How a store knows its keys' records: ``key_of`` names the key a payload holds (None: a
    record that is not the store's); ``wheres``, if the store has it, gives filters (one per
    request) that together select every record naming one of ``keys``, wherever it is, for a
    slot of ``blob_bytes`` (then a key whose first probe is free is looked up, not probed)."""

    key_of: Callable[[Any], K | None]
    wheres: Callable[[Sequence[K], int], list[Where]] | None = None


@dataclass(frozen=True)
class Probed(Generic[K]):
    """What a placement read: the records (id -> the key its payload names) and their
    payloads. ``find`` and ``claim`` over ``held`` answer as if every probe had been read."""

    held: dict[int, K | None]
    payloads: dict[int, Any]


def read_probes(
    namespace: str,
    probes: Mapping[K, Sequence[int]],
    by: ByKey[K],
    place: Collection[K] | None = None,
    *,
    filled: MutableSet[str] | None = None,
) -> Plan[Probed[K]]:
    """Read what ``_ids.next_reads`` asks (round after round: first probes, look-ups by key and
    collided keys' other probes together, rarely a last round) until ``find(probes, held)`` and
    ``claim`` over ``place`` (every key with None) are exact.

    A namespace that holds no record (a new user's, never written, or dropped) holds nothing
    to read: unless ``filled`` (the namespaces the store has seen holding records, a hint; None:
    none) names it, its records are counted first, and none means only that count is sent. A
    count above 0 adds the namespace to ``filled``."""
    lay = yield from layout()
    if filled is None or namespace not in filled:
        [held] = yield [COUNT(namespace)]
        if held == 0:
            return Probed({}, {})
        if filled is not None:
            filled.add(namespace)
    seen: Reading[K] = Reading()
    payloads: dict[int, Any] = {}
    while reads := next_reads(probes, seen, place=place, can_locate=by.wheres is not None, per_request=lay.max_queries):
        wheres = by.wheres(reads.locate, lay.blob_bytes) if by.wheres and reads.locate else []
        found, *looked = yield from together(
            [fetch_payloads(namespace, reads.ids), *(scan(namespace, w) for w in wheres)]
        )
        for sc in looked:
            found.update(zip(sc.ids, sc.payloads))
        payloads.update(found)
        seen.learn(reads.ids, {i: by.key_of(p) for i, p in found.items()}, reads.locate)
    return Probed(seen.held, payloads)


@dataclass(frozen=True)
class Scan:
    """Records read in id order: ids, their vectors (float32, as stored) and payloads."""

    ids: list[int]
    vectors: np.ndarray
    payloads: list[Any]


def scan(namespace: str, where: Where | None) -> Plan[Scan]:
    """Every record matching ``where`` (all with None), paged by id; none if the namespace does
    not exist (the sidecar answers it as empty)."""
    dim = (yield from layout()).dim
    ids: list[int] = []
    pages: list[np.ndarray] = [np.empty((0, dim), np.float32)]
    payloads: list[Any] = []
    after = -1
    while True:
        [page] = yield [EXPORT_PAGE(namespace, after, where=where)]
        if len(page[0]) == 0:
            return Scan(ids, np.concatenate(pages), payloads)
        pids, vectors, ppay = page
        ids += pids.tolist()
        pages.append(np.asarray(vectors, np.float32).reshape(len(pids), dim))
        payloads += ppay
        after = ids[-1]


def upsert_rows(
    namespace: str,
    ids: Sequence[int],
    vectors: np.ndarray,
    payloads: Sequence[Any],
    ttl: float | Sequence[float] | None = None,
    *,
    filled: MutableSet[str] | None = None,
) -> Plan[None]:
    """Write records (one id twice: the last row wins, at the first one's place), packed into
    requests that fit a slot (rows and payload bytes), sent together. ``ttl``: as
    ``RecallPool.upsert``'s (seconds, ``math.inf`` for never, None for the namespace's default),
    one for every row or one per row. Once written, the namespace joins ``filled`` (as
    :func:`read_probes` takes it)."""
    last = {int(i): j for j, i in enumerate(ids)}
    rows = list(last.values())
    ids_, vecs, pays = list(last), vectors[rows], [payloads[j] for j in rows]
    ttls: list[float] | None = None
    if ttl is not None and not isinstance(ttl, (int, float)):
        ttls = [ttl[j] for j in rows]
    lay = yield from layout()
    yield [
        UPSERT(
            ids_[lo:hi],
            vecs[lo:hi],
            pays[lo:hi],
            namespace=namespace,
            ttl=ttl if ttls is None else ttls[lo:hi],
        )
        for lo, hi in pack([line_bytes(p) for p in pays], lay.max_queries, lay.blob_bytes)
    ]
    if filled is not None and ids_:
        filled.add(namespace)
    return None


def pack(sizes: Sequence[int], max_rows: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split rows into [lo, hi) runs of at most ``max_rows`` rows whose JSON lines (``sizes``
    bytes each, newline-joined) fit ``max_bytes``; a row too big on its own gets a run alone (the
    sidecar then refuses it with PayloadTooLarge). Pure."""
    runs: list[tuple[int, int]] = []
    lo, used = 0, -1
    for i, size in enumerate(sizes):
        if i > lo and (i - lo >= max_rows or used + 1 + size > max_bytes):
            runs.append((lo, i))
            lo, used = i, -1
        used += 1 + size
    if lo < len(sizes):
        runs.append((lo, len(sizes)))
    return runs


def line_bytes(payload: Any) -> int:
    """Bytes of a payload's JSON line as the client encodes it (0 for one it will refuse)."""
    try:
        return len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError):
        return 0  # the client's own check raises InvalidRequest with the reason


def unit_rows(rows: Any) -> np.ndarray:
    """float32 rows scaled to unit length in float64 (a zero row stays zero), so an inner
    product is a cosine similarity."""
    m = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(m, axis=-1, keepdims=True)
    return (m / np.where(norms == 0, 1.0, norms)).astype(np.float32)
