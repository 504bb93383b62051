"""String keys as Kalos ids, for every store: one probing scheme, one placement, one error.

A framework names its records with strings (a document id, a node id, a namespace and key); Kalos
ids are int64 >= 0. A key hashes (BLAKE2b) to a short *probe sequence* of ids and its record sits
at one of them; the record's payload names its key, so a store can tell its own record from
another key's (a hash collision) or from a record it did not write::

    key --IdScheme.ids--> [p0, p1, ... p(n-1)]        probe ids, the same in every process
    read what next_reads asks, until it asks nothing   held: id -> the key its payload names
    claim(probes, held)                                each key: the probe holding its own
                                                       record, else the first one free
                                                       (IdCollision when none is)

:func:`claim` is the one placement rule: as if every probe of every key had been read. What must
be read for it to answer exactly that is decided by :func:`next_reads`, in rounds (pure; the
plan around it, ``_plans.read_probes``, does the reading):

1. every key's first probe (every probe at once when they all fit one request);
2. a key whose first probe holds its own record is settled there. One whose first probe holds
   nothing is *located*: the records naming it are looked up by key, wherever they are (one
   filtered request for many keys), when the store can; else, and for a key whose first probe
   holds something else (a collision, rare), its other probes are read;
3. the claim is walked: a key that would take an id nobody has read yet (another key of the
   write took its first probe) has its other probes read, and the walk runs again.

So a record is found wherever it went (deleting an earlier probe's record needs no tombstone, a
key is never written twice), while a write of new keys reads one id per key. :func:`claim` never
hands out an id that holds a record of another key or that another key of the same write took,
so one writer never overwrites anything it does not own. The read and the write are two requests,
not one transaction (docs/integrations.md, "Limits and trade-offs").

The stores differ only in their :class:`IdScheme` constants, which are pinned: the ids of records
already stored are found by them. LangChain probes once (its ids are documented as one hash any
client can compute); LlamaIndex re-hashes up to 8 times; LangGraph probes a window of 8
consecutive ids below 2**48, because each item's vectors are numbered ``item id << 14 | j``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from kalos.broker.errors import KalosError

K = TypeVar("K", bound=Hashable)


class IdCollision(KalosError, ValueError, RuntimeError):
    """Every id a key may take holds another key's record, or a record that is not the store's
    (or another key of the same write took it). Raised before anything of the write is sent.

    Also a ValueError and a RuntimeError, as LangChain's ``IdCollisionError`` and LangGraph's
    ``KeyCollision`` were (both names are aliases of this class), so ``except`` clauses written
    against either still catch it."""


class Probing(Enum):
    """How a key's later probe ids follow from its first."""

    #: Probe ``a`` hashes ``f"{a}\\0{key}"`` (probe 0 the key alone): spread over ``bits`` bits.
    REHASH = "rehash"
    #: One hash, then the ids right after it; the ids stay below ``2**bits``.
    WINDOW = "window"


@dataclass(frozen=True)
class IdScheme:
    """Where a key's record may be: ``probes`` ids derived from BLAKE2b-64 of the key's UTF-8
    bytes (``person``: BLAKE2b's personalisation, so two schemes never share ids by design)."""

    probing: Probing
    probes: int = 1
    person: bytes = b""
    bits: int = 63

    def probe(self, key: str, attempt: int = 0) -> int:
        """The ``attempt``-th probe id of ``key`` (0 <= id < 2**bits)."""
        if not 0 <= attempt < self.probes:
            raise ValueError(f"attempt {attempt} outside 0..{self.probes - 1}")
        if self.probing is Probing.WINDOW:
            # little-endian and a modulus: the layout LangGraph items were first stored with
            base = int.from_bytes(_digest(key.encode(), self.person), "little")
            return base % ((1 << self.bits) - self.probes) + attempt
        data = key.encode() if attempt == 0 else f"{attempt}\x00{key}".encode()
        return int.from_bytes(_digest(data, self.person), "big") & ((1 << self.bits) - 1)

    def ids(self, key: str) -> list[int]:
        """Every probe id of ``key``, in probing order."""
        return [self.probe(key, a) for a in range(self.probes)]


def _digest(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8, person=person).digest()


def find(probes: Mapping[K, Sequence[int]], held: Mapping[int, K | None]) -> dict[K, int]:
    """The id holding each key's own record (keys without one are left out). ``held``: the
    records read at the probe ids, id -> the key its payload names (None: not one of ours)."""
    found: dict[K, int] = {}
    for key, ids in probes.items():
        mine = next((i for i in ids if i in held and held[i] == key), None)
        if mine is not None:
            found[key] = mine
    return found


def claim(probes: Mapping[K, Sequence[int]], held: Mapping[int, K | None]) -> dict[K, int]:
    """Where each key's record goes: the probe already holding its own record; else its first
    probe that holds no record and that no key before it (in ``probes`` order) took. Pure.
    Raises IdCollision naming the keys that found no id and what holds their probes."""
    placed = find(probes, held)
    taken: dict[int, K | None] = {**held, **{i: k for k, i in placed.items()}}
    failed: list[str] = []
    for key, ids in probes.items():
        if key in placed:
            continue
        free = next((i for i in ids if i not in taken), None)
        if free is None:
            holders = ", ".join(f"{i} holds {_holder(taken[i], i in held)}" for i in ids)
            failed.append(f"{key!r} ({holders})")
            continue
        placed[key] = free
        taken[free] = key
    if failed:
        raise IdCollision(
            f"no free Kalos id for {'; '.join(failed[:5])}"
            f"{f' and {len(failed) - 5} more' if len(failed) > 5 else ''}; "
            "nothing of this write was sent"
        )
    return placed


def _holder(key: object, stored: bool) -> str:
    if key is None:
        return "a record that is not this store's"
    return f"{key!r}" + ("" if stored else ", another key of this write")


@dataclass
class Reading(Generic[K]):
    """What a placement has read so far (filled in by the plan that reads, ``_plans``)."""

    #: The records read: id -> the key its payload names (None: a record that is not the store's).
    held: dict[int, K | None] = field(default_factory=dict)
    #: Ids whose content is known: read by id (with or without a record), or found by key.
    read: set[int] = field(default_factory=set)
    #: Keys looked up by key: every record naming them is in ``held``.
    located: set[K] = field(default_factory=set)

    def learn(self, asked: Iterable[int], records: Mapping[int, K | None], located: Iterable[K] = ()) -> None:
        """Ids ``asked`` were read (``records``: those of them holding a record, and the records
        the look-up of keys ``located`` found, wherever they are)."""
        self.read.update(asked)
        self.read.update(records)
        self.held.update(records)
        self.located.update(located)


@dataclass(frozen=True)
class Reads(Generic[K]):
    """What to read next: ``ids`` by id, and the records of keys ``locate`` by key."""

    ids: list[int]
    locate: list[K]

    def __bool__(self) -> bool:
        return bool(self.ids or self.locate)


def next_reads(
    probes: Mapping[K, Sequence[int]],
    seen: Reading[K],
    *,
    place: Collection[K] | None = None,
    can_locate: bool = False,
    per_request: int = 0,
) -> Reads[K]:
    """What to read next so that ``find(probes, seen.held)`` and ``claim`` over the keys
    ``place`` (all with None) answer as they would with every probe read; nothing (a false
    :class:`Reads`) once they do. ``can_locate``: the store can look keys up by key;
    ``per_request``: ids one request reads (all the probes are read at once when they fit). Pure.
    """
    first = _unique(ids[0] for ids in probes.values() if ids[0] not in seen.read)
    if first:
        every = _unique(i for ids in probes.values() for i in ids if i not in seen.read)
        return Reads(every if len(every) <= per_request else first, [])
    # Where is each key's own record? Settled at its first probe, by a look-up, or by reading all.
    ids: list[int] = []
    locate: list[K] = []
    for key, probe in probes.items():
        if _holds(seen.held, probe[0], key) or key in seen.located or seen.read.issuperset(probe):
            continue
        if can_locate and probe[0] not in seen.held:
            locate.append(key)
        else:
            ids += [i for i in probe if i not in seen.read]
    if ids or locate:
        return Reads(_unique(ids), locate)
    # Every own record is known: walk the claim; an id it would take unread gets read first.
    placing = probes if place is None else {k: v for k, v in probes.items() if k in place}
    placed = find(placing, seen.held)
    taken = set(seen.held) | set(placed.values())
    for key, probe in placing.items():
        if key in placed:
            continue
        free = next((i for i in probe if i not in taken), None)
        if free is None:
            continue  # claim raises IdCollision for it: every id it has is known to be taken
        if free not in seen.read:
            ids += [i for i in probe if i not in seen.read]
        taken.add(free)
    return Reads(_unique(ids), [])


def _holds(held: Mapping[int, K | None], i: int, key: K) -> bool:
    return i in held and held[i] == key


def _unique(ids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(ids))
