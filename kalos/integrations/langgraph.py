"""LangGraph long-term memory on Kalos: :class:`KalosStore`, a ``langgraph.store.base.BaseStore``.

Requires ``langgraph`` (``pip install 'kalos-recall[langgraph]'``). Semantics follow LangGraph's
``InMemoryStore`` (``put/get/search/delete/list_namespaces``, their ``a*`` forms, ``batch/abatch``,
tuple namespaces, prefix search, ``index={"embed", "dims", "fields"}``, filters, ``limit/offset``);
the differences are listed under *Differences* below.

Mapping onto Kalos
------------------
One store uses two Kalos namespaces (``namespace`` and ``namespace + ".vec"``), so any number of
LangGraph namespaces share one Kalos namespace and a prefix search is one filtered request::

    NAMESPACE (items)             id = item id                        vector = zeros (never recalled)
      payload: ns [labels], depth, "ns.0".."ns.<depth-1>" (one field per label), key, value,
               created_at, updated_at, seq, ns_seq, nvec, "f.<field>" (filterable copies)
    NAMESPACE.vec (vectors)       id = item id << 14 | j              vector = j-th embedding, unit
      payload: "ns.0".., "f.<field>"                                  norm (cosine = inner product)

* **Ids.** The item id is a 48-bit BLAKE2b hash of ``(namespace tuple, key)``; a put probes the
  window ``h .. h+7`` and takes the record whose stored ``(ns, key)`` is its own, or else the
  first free id (the integrations' one id scheme, ``kalos.integrations._ids``). A record of
  another item is never overwritten by one writer (all eight taken: :class:`KeyCollision`, an
  alias of ``IdCollision``). Lookups read every item's ``h`` (whole windows when they fit one
  ``get``), then the rest of the window of each item not stored at ``h``, so an item is found
  anywhere in its window and deletes need no tombstones. The check and the write are two
  requests, not a transaction: two processes putting *different* keys whose windows overlap (a
  48-bit hash within 8 of each other) in the same round trip could both take the same free id;
  that needs a near-collision and the race. Vector ids carry their item id, so a recall needs no
  payloads to find its items.
* **Prefix search** is equality on the per-label fields ``ns.0 .. ns.<n-1>`` (Kalos filters have
  no string-prefix operator, and labels cannot contain ``.`` anyway).
* **Filters.** The part of a LangGraph filter that Kalos can evaluate is sent as ``where=`` on
  the ``f.<field>`` copies of top-level scalars (strings up to 256 characters); the whole filter is
  then applied to the returned items with LangGraph's semantics, so the server side only narrows.
* **Scores.** Embeddings are normalised to unit length before they are stored and queries before
  they are sent, so the sidecar's inner product (``--metric dot`` or ``cosine``) is the cosine
  similarity InMemoryStore computes (float32 instead of float64: equal within ~1e-6). Each
  indexed text is its own vector; an item's score is the best of its vectors (max pooling).
* **Order.** A search without a query lists namespaces in the order they got their first item
  and items in the order they were created (``ns_seq``, ``seq``), as InMemoryStore does.
* **TTL** (``supports_ttl = True``; ``ttl=`` takes LangGraph's ``TTLConfig``). ``put(...,
  ttl=minutes)`` (``None``: never; not given: the config's ``default_ttl``) becomes the Kalos TTL
  of the item's record and, ``VECTOR_TTL_SLACK_S`` (5 s) longer, of its vectors; the minutes are
  kept in the payload (``ttl``). The sidecar stamps and expires records on its own clock and never
  answers an expired one (exactly, whether its sweeper deleted it yet or not), so an item is
  absent from ``get``, ``search`` and ``list_namespaces`` from the instant it expires:
  ``omit_expired`` is always in force and ``sweep_interval_minutes`` has nothing to schedule. A
  read with ``refresh_ttl`` (``None``: the config's ``refresh_on_read``, default True) restarts
  the TTL of the items it returns that have one, and of their vectors (one touch of each, at
  once), so the vectors of an item never expire before it and a search by query finds every
  live item. Vectors an expired item leaves behind (for their slack, or a TTL when it expired
  between a read and its refresh) are skipped: a search uses an item's vector ``j`` only while
  the item exists and ``j`` is below its ``nvec``.

Differences from InMemoryStore (deliberate)
-------------------------------------------
* A put replaces the item's vectors; InMemoryStore keeps the vectors of texts the previous value
  had and the new one lacks (also after ``index=False``), so the old text stays searchable.
* ``list_namespaces`` lists namespaces that hold items (as PostgresStore); InMemoryStore also
  lists namespaces whose items were all deleted and namespaces that were only read by ``get``.
* ``created_at`` survives updates (as PostgresStore); InMemoryStore resets it on every put.
* Range operators (``$gt`` ...) match numbers only and never raise; InMemoryStore applies
  ``float()`` to the stored value (``True`` counts as 1, ``"5"`` as 5, a missing field raises).
* Scores are float32 cosines; a zero query vector scores 0 here and NaN in InMemoryStore.
* InMemoryStore has no TTL; against PostgresStore: TTLs may be fractions of a minute (its
  ``ttl_minutes`` column is an INT), an expired item is gone at once for every read (as its
  ``omit_expired=True``), and an item put after its predecessor expired is a new item (a new
  ``created_at``).
* ``list_namespaces`` and searches without a query scan the items under the prefix (paged
  ``export_page``); a search with a query recalls the top vectors (growing ``k`` up to the
  sidecar's ``max_k``, then an exact scan when post-filtering left too few items).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kalos.broker.clock import ttl_ns
from kalos.broker.layout import NAMESPACE_BYTES, Layout
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool

from ._core import ConnectedStore, Connections
from ._filters import RANGE_OPS, FieldOp, Where, all_of, any_of, condition
from ._ids import IdCollision, IdScheme, Probing, claim, find
from ._plans import (
    DELETE,
    RECALL,
    TOUCH,
    ByKey,
    Plan,
    Step,
    fetch_payloads,
    layout,
    read_probes,
    scan,
    unit_rows,
    upsert_rows,
)
from .embeddings import EMBED_NAME, KalosEmbeddings

try:
    from langchain_core.embeddings import Embeddings
    from langgraph.store.base import (
        BaseStore,
        GetOp,
        IndexConfig,
        Item,
        ListNamespacesOp,
        MatchCondition,
        Op,
        PutOp,
        Result,
        SearchItem,
        SearchOp,
        TTLConfig,
        ensure_embeddings,
        get_text_at_path,
        tokenize_path,
    )
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError("kalos.integrations.langgraph needs langgraph: pip install 'kalos-recall[langgraph]'") from e
try:
    from langgraph.store.base import validate_op_namespace
except ImportError:  # pragma: no cover - older releases: BaseStore.put/get/search still check labels

    def validate_op_namespace(op: Op) -> None:
        return None


__all__ = ["KalosStore", "KeyCollision", "item_id_window", "vector_id", "ttl_seconds", "check_ttl_config"]

ITEM_ID_BITS = 48
VECTOR_INDEX_BITS = 14
#: Most vectors one item can have (indexed texts, one per path match).
MAX_VECTORS_PER_ITEM = 1 << VECTOR_INDEX_BITS
_VECTOR_INDEX_MASK = MAX_VECTORS_PER_ITEM - 1
PROBE_WINDOW = 8
#: Pinned: items already stored are found by these ids.
IDS = IdScheme(Probing.WINDOW, probes=PROBE_WINDOW, bits=ITEM_ID_BITS)
#: Seconds an item's vectors outlive the item (their TTL is the item's plus this): a put writes
#: the vectors one round trip before the item (and touches them again when the two writes were
#: more than half of this apart), a refresh touches both at once; vectors left by an expired item
#: are skipped by searches until they expire too.
VECTOR_TTL_SLACK_S = 5.0
#: Top-level string values longer than this are not copied for server-side filtering.
MAX_COPIED_STR = 256
_EXACT_INT = 1 << 53
_RANGE_OPS: dict[str, Callable[[float, float], bool]] = {
    "$gt": lambda a, b: a > b,
    "$gte": lambda a, b: a >= b,
    "$lt": lambda a, b: a < b,
    "$lte": lambda a, b: a <= b,
}
_OPERATORS = frozenset({"$eq", "$ne", *_RANGE_OPS})

#: The name this store's collision error had; the one error of the integrations.
KeyCollision = IdCollision
ItemKey = tuple[tuple[str, ...], str]


# ----------------------------------------------------------------------------- ids (pure)
def item_id_window(namespace: tuple[str, ...], key: str) -> list[int]:
    """The ids an item may take, in probing order: a 48-bit hash of ``(namespace, key)`` and the
    next ``PROBE_WINDOW - 1`` ids."""
    return IDS.ids(json.dumps([list(namespace), key], ensure_ascii=False, separators=(",", ":")))


def vector_id(item_id: int, j: int) -> int:
    """The id of the ``j``-th vector of item ``item_id`` (the item id is ``id >> 14``)."""
    return (item_id << VECTOR_INDEX_BITS) | j


def _item_key(payload: Any) -> ItemKey | None:
    """The ``(namespace, key)`` a record of the items namespace holds (None: not an item)."""
    if isinstance(payload, dict) and isinstance(payload.get("ns"), list) and isinstance(payload.get("key"), str):
        return tuple(payload["ns"]), payload["key"]
    return None


#: Items are found by their windows, not looked up by key: an item is named by its namespace's
#: labels and its key, so a look-up filter would need conditions per namespace, and the rest of
#: a window is one request for four items anyway.
_ITEMS = ByKey(_item_key)


# ----------------------------------------------------------------------------- TTL (pure)
_TTL_CONFIG_KEYS = frozenset({"default_ttl", "refresh_on_read", "sweep_interval_minutes", "omit_expired"})


def ttl_seconds(minutes: Any) -> float:
    """LangGraph's TTL (minutes; None: never expires) as Kalos's (seconds; ``math.inf``: never).
    ValueError for anything but a number of minutes > 0 within Kalos's bound (a century)."""
    if minutes is None:
        return math.inf
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
        raise ValueError(f"ttl is a number of minutes > 0 (None: never expires), got {minutes!r}")
    seconds = float(minutes) * 60.0
    if not (math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(f"ttl is a number of minutes > 0 (None: never expires), got {minutes!r}")
    ttl_ns(seconds + VECTOR_TTL_SLACK_S)  # Kalos's own bound: InvalidRequest, a ValueError
    return seconds


def check_ttl_config(config: Mapping[str, Any] | None) -> TTLConfig | None:
    """A copy of a ``TTLConfig`` whose values this store can honour; ValueError (before anything
    is sent) for an unknown key, a ``default_ttl`` that :func:`ttl_seconds` refuses, a
    ``refresh_on_read`` / ``omit_expired`` that is not a bool, or a ``sweep_interval_minutes``
    that is not a positive int (accepted for compatibility: the sidecar sweeps by itself)."""
    if config is None:
        return None
    unknown = set(config) - _TTL_CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown TTLConfig keys {sorted(unknown)}; known: {sorted(_TTL_CONFIG_KEYS)}")
    ttl_seconds(config.get("default_ttl"))
    for key in ("refresh_on_read", "omit_expired"):
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"TTLConfig {key} is a bool, got {config[key]!r}")
    sweep = config.get("sweep_interval_minutes")
    if sweep is not None and (isinstance(sweep, bool) or not isinstance(sweep, int) or sweep <= 0):
        raise ValueError(f"TTLConfig sweep_interval_minutes is a positive int or None, got {sweep!r}")
    out: TTLConfig = {**config}  # type: ignore[typeddict-item]
    return out


# ----------------------------------------------------------------------------- filters (pure)
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _apply_operator(value: Any, op: str, operand: Any) -> bool:
    if op == "$eq":
        return bool(value == operand)
    if op == "$ne":
        return bool(value != operand)
    if op in _RANGE_OPS:
        # Numbers only, never an exception (InMemoryStore calls float() on the stored value).
        return _is_number(value) and _RANGE_OPS[op](float(value), float(operand))
    raise ValueError(f"Unsupported operator: {op}")


def value_matches(item_value: Any, filter_value: Any) -> bool:
    """LangGraph's filter semantics for one field (InMemoryStore's ``_compare_values``)."""
    if isinstance(filter_value, dict):
        if any(str(k).startswith("$") for k in filter_value):
            return all(_apply_operator(item_value, k, v) for k, v in filter_value.items())
        if not isinstance(item_value, dict):
            return False
        return all(value_matches(item_value.get(k), v) for k, v in filter_value.items())
    if isinstance(filter_value, (list, tuple)):
        return (
            isinstance(item_value, (list, tuple))
            and len(item_value) == len(filter_value)
            and all(value_matches(a, b) for a, b in zip(item_value, filter_value))
        )
    return bool(item_value == filter_value)


def item_matches(value: dict[str, Any], filt: dict[str, Any] | None) -> bool:
    return not filt or all(value_matches(value.get(k), v) for k, v in filt.items())


def check_filter(filt: dict[str, Any] | None) -> None:
    """ValueError for an unknown operator or a range operand that is not a number, before any
    request is sent."""
    for fv in (filt or {}).values():
        if isinstance(fv, dict) and any(str(k).startswith("$") for k in fv):
            for op, operand in fv.items():
                if op not in _OPERATORS:
                    raise ValueError(f"Unsupported operator: {op}")
                if op in _RANGE_OPS:
                    float(operand)


def _copied(v: Any) -> tuple[bool, Any]:
    """Whether a top-level value is copied to its ``f.<field>`` column, and as what."""
    if v is None or isinstance(v, bool):
        return True, v
    if isinstance(v, str):
        return len(v) <= MAX_COPIED_STR, v
    if isinstance(v, int):
        if abs(v) <= _EXACT_INT:
            return True, v
        try:
            return True, float(v)  # Kalos compares numbers as float64 anyway
        except OverflowError:
            return False, None
    if isinstance(v, float):
        return math.isfinite(v), v
    return False, None


def filter_columns(value: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in value.items():
        ok, c = _copied(v)
        if ok:
            out["f." + k] = c
    return out


def _equal_values(v: Any) -> list[Any] | None:
    """Kalos values equal to every stored value that equals ``v`` in Python, when all such values
    are copied; None when that cannot be said."""
    if isinstance(v, str):
        return [v] if len(v) <= MAX_COPIED_STR else None
    if isinstance(v, bool):
        return [v, int(v)]  # True == 1 == 1.0 in Python; Kalos: 1 == 1.0, true != 1
    if _is_number(v) and math.isfinite(v) and abs(v) <= _EXACT_INT:
        return [v, bool(v)] if v in (0, 1) else [v]
    return None


def translate_filter(filt: dict[str, Any] | None) -> tuple[list[Where], bool]:
    """Kalos ``where`` conditions (to AND) that every item matching ``filt`` satisfies, and whether
    they match exactly those items (else the caller keeps post-filtering and fetches more)."""
    conds: list[Where] = []
    exact = True
    for fld, fv in (filt or {}).items():
        col = "f." + fld
        if isinstance(fv, dict) and any(str(k).startswith("$") for k in fv):
            ops = list(fv.items())
        elif isinstance(fv, (dict, list, tuple)):
            exact = False
            continue
        else:
            ops = [("$eq", fv)]
        for op, operand in ops:
            if FieldOp(op) in RANGE_OPS:
                x = float(operand)
                if math.isfinite(x):
                    conds.append(condition(col, FieldOp(op), x))
                else:
                    exact = False
                continue
            if operand is None:  # missing fields equal None; non-copied values are missing too
                exact = False
                conds.append(
                    any_of([condition(col, FieldOp.EQ, None), condition(col, FieldOp.EXISTS, False)])
                    if op == "$eq"
                    else condition(col, FieldOp.NE, None)
                )
                continue
            vals = _equal_values(operand)
            if vals is None:
                exact = False
                continue
            conds.append(condition(col, FieldOp.IN if op == "$eq" else FieldOp.NIN, vals))
    return conds, exact


def prefix_conditions(prefix: Sequence[str]) -> list[Where]:
    return [condition(f"ns.{i}", FieldOp.EQ, label) for i, label in enumerate(prefix) if label != "*"]


def namespace_matches(cond: MatchCondition, ns: tuple[str, ...]) -> bool:
    path = cond.path
    if len(ns) < len(path):
        return False
    if cond.match_type == "prefix":
        pairs = zip(ns, path)
    elif cond.match_type == "suffix":
        pairs = zip(reversed(ns), reversed(path))
    else:
        raise ValueError(f"Unsupported match type: {cond.match_type}")
    return all(p == "*" or a == p for a, p in pairs)


# ----------------------------------------------------------------------------- records
@dataclass
class _Stored:
    """An item as read back from its record."""

    id: int
    payload: dict[str, Any]

    @property
    def namespace(self) -> tuple[str, ...]:
        return tuple(self.payload["ns"])

    @property
    def nvec(self) -> int:
        return int(self.payload.get("nvec", 0))

    @property
    def has_ttl(self) -> bool:
        """Whether the item was put with a TTL (a refresh on read then restarts it)."""
        return self.payload.get("ttl") is not None

    def item(self) -> Item:
        p = self.payload
        return Item(
            value=p["value"],
            key=p["key"],
            namespace=tuple(p["ns"]),
            created_at=datetime.fromisoformat(p["created_at"]),
            updated_at=datetime.fromisoformat(p["updated_at"]),
        )

    def search_item(self, score: float | None) -> SearchItem:
        p = self.payload
        return SearchItem(
            tuple(p["ns"]),
            p["key"],
            p["value"],
            datetime.fromisoformat(p["created_at"]),
            datetime.fromisoformat(p["updated_at"]),
            score,
        )


def _listing_order(items: list[_Stored]) -> list[_Stored]:
    """InMemoryStore's order: namespaces by when they got their first item, then items by
    creation. ``ns_seq`` is the same for all items of a namespace put by one writer; the minimum
    keeps each namespace together if concurrent writers disagreed."""
    first: dict[tuple[str, ...], int] = {}
    for s in items:
        ns = s.namespace
        first[ns] = min(first.get(ns, s.payload["ns_seq"]), s.payload["ns_seq"])
    return sorted(items, key=lambda s: (first[s.namespace], s.namespace, s.payload["seq"]))


def _page(
    ranked: list[tuple[float, _Stored]], scoreless: list[_Stored], offset: int, limit: int
) -> list[tuple[float | None, _Stored]]:
    """InMemoryStore's paging of a query search: ranked items ``[offset, offset+limit)``, then
    items without vectors fill up to ``limit`` (from the first one: InMemoryStore ignores the
    offset there)."""
    kept: list[tuple[float | None, _Stored]] = []
    for ix, (score, s) in enumerate(ranked):
        if ix >= offset + limit:
            break
        if ix >= offset:
            kept.append((score, s))
    if scoreless and len(kept) < limit:
        kept.extend((None, s) for s in scoreless[: limit - len(kept)])
    return kept


def _vector_hits(ids: Sequence[int], scores: Sequence[float]) -> list[tuple[int, int, float]]:
    """Recalled vectors as (item id, vector index, score), in the order given."""
    return [(int(v) >> VECTOR_INDEX_BITS, int(v) & _VECTOR_INDEX_MASK, float(sc)) for v, sc in zip(ids, scores)]


def _unit_rows(vectors: Sequence[Sequence[float]], dim: int) -> np.ndarray:
    m = np.asarray(vectors, dtype=np.float64).reshape(len(vectors), -1)
    if m.shape[1] != dim:
        raise ValueError(f"the embedding function returned {m.shape[1]} dimensions; the sidecar serves {dim}")
    return unit_rows(m)


# ----------------------------------------------------------------------------- the store
class KalosStore(ConnectedStore, BaseStore):
    """LangGraph's ``BaseStore`` on a Kalos sidecar (long-term memory shared by processes).

    ``name``: the broker. ``namespace``: the Kalos namespace of the items (the vectors go to
    ``namespace + ".vec"``); stores with different ``namespace`` are independent. ``index``: as
    for ``InMemoryStore`` (``dims`` must be the sidecar's ``--dim``; without ``index`` nothing is
    embedded and ``query=`` is ignored). ``ttl``: LangGraph's ``TTLConfig`` (``default_ttl`` in
    minutes, ``refresh_on_read``; module docstring, "TTL"; ValueError for values it cannot
    honour). ``timeout``: seconds per Kalos request (None: no limit). A batch is one plan: :meth:`batch` runs it on a :class:`~kalos.clients.blocking.RecallClient`,
    :meth:`abatch` on a :class:`~kalos.clients.pool.RecallPool` (``pool_size`` slots) of the
    running event loop (one per loop); both are opened on first use, or pass ``client=`` /
    ``pool=`` (not closed by the store then).
    Kalos errors (``BrokerUnavailable``, ``KalosTimeout``, ``PayloadTooLarge``...) propagate.
    Close with :meth:`close` / :meth:`aclose` or use the store as a (async) context manager.
    """

    supports_ttl = True

    def __init__(
        self,
        name: str = "default",
        *,
        namespace: str = "langgraph",
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
        timeout: float | None = 30.0,
        pool_size: int = 4,
        client: RecallClient | None = None,
        pool: RecallPool | None = None,
    ) -> None:
        if len(namespace) + 4 > NAMESPACE_BYTES:
            raise ValueError(f"namespace {namespace!r} too long: at most {NAMESPACE_BYTES - 4} chars")
        self.ttl_config = check_ttl_config(ttl)
        self.name = name
        self.items_namespace = namespace
        self.vectors_namespace = namespace + ".vec"
        self._conns = Connections(
            name, timeout=timeout, pool_size=pool_size, client=client, pool=pool, similarity_for="KalosStore"
        )
        self._last_seq = 0
        self.index_config: IndexConfig | None = None
        self.embeddings: Embeddings | None = None
        self._fields: list[tuple[str, str | list[str]]] = []
        if index:
            self.index_config = index.copy()
            embed = index.get("embed")
            # "kalos": the sidecar's own model (--embed), over the store's connections.
            self.embeddings = (
                KalosEmbeddings(name, connections=self._conns) if embed == EMBED_NAME else ensure_embeddings(embed)
            )
            self._fields = [(p, p if p == "$" else tokenize_path(p)) for p in (index.get("fields") or ["$"])]

    # ------------------------------------------------------------------ drivers
    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops``; reads see the state before the batch's writes (as InMemoryStore)."""
        return self._conns.run(self._batch_plan(list(ops)))

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` on the running loop's pool; independent requests go concurrently."""
        return await self._conns.arun(self._batch_plan(list(ops)))

    def _embed(self, texts: list[str], *, query: bool = False) -> Step[list[list[float]]]:
        emb = self.embeddings
        assert emb is not None

        async def aembed_queries(_: RecallPool) -> list[list[float]]:
            return list(await asyncio.gather(*(emb.aembed_query(t) for t in texts)))

        if query:
            return Step(lambda _: [emb.embed_query(t) for t in texts], aembed_queries)
        return Step(lambda _: emb.embed_documents(texts), lambda _: emb.aembed_documents(texts))

    # ------------------------------------------------------------------ plans
    def _batch_plan(self, ops: list[Op]) -> Plan[list[Result]]:
        results: list[Result] = [None] * len(ops)
        gets: list[tuple[int, GetOp]] = []
        puts: dict[ItemKey, PutOp] = {}
        for op in ops:
            validate_op_namespace(op)
            if isinstance(op, SearchOp):
                check_filter(op.filter)
            elif isinstance(op, PutOp):
                ttl_seconds(op.ttl)
            elif not isinstance(op, (GetOp, ListNamespacesOp)):
                raise ValueError(f"Unknown operation type: {type(op)}")
        for i, op in enumerate(ops):
            if isinstance(op, GetOp):
                gets.append((i, op))
            elif isinstance(op, PutOp):
                puts[(op.namespace, op.key)] = op  # the last wins, at the first one's place
        geo = yield from layout()
        read: list[_Stored] = []  # items read by an op that refreshes their TTL
        if gets:
            found, _ = yield from self._lookup([(op.namespace, op.key) for _, op in gets])
            for i, op in gets:
                s = found.get((op.namespace, op.key))
                results[i] = None if s is None else s.item()
                if s is not None and op.refresh_ttl:
                    read.append(s)
        for i, op in enumerate(ops):
            if isinstance(op, SearchOp):
                page = yield from self._search(op, geo)
                results[i] = [s.search_item(score) for score, s in page]
                if op.refresh_ttl:
                    read += [s for _, s in page]
            elif isinstance(op, ListNamespacesOp):
                results[i] = yield from self._list_namespaces(op)
        yield from self._refresh(read)
        if puts:
            yield from self._write(list(puts.values()), geo)
        return results

    def _refresh(self, items: Iterable[_Stored]) -> Plan[None]:
        """LangGraph's refresh on read: the items read that have a TTL expire that TTL after
        now, and their vectors their slack later (both touched at once: each restarts its own
        TTL). An item that expired since it was read is not touched; its vectors may be, and
        then outlive it as any expired item's do (searches skip them)."""
        timed = {s.id: s for s in items if s.has_ttl}
        if not timed:
            return None
        vec_ids = [vector_id(iid, j) for iid, s in timed.items() for j in range(s.nvec)]
        steps = [TOUCH(list(timed), namespace=self.items_namespace)]
        if vec_ids:
            steps.append(TOUCH(vec_ids, namespace=self.vectors_namespace))
        yield steps
        return None

    def _fetch(self, namespace: str, ids: list[int]) -> Plan[dict[int, _Stored]]:
        """The records of ``ids`` that exist (those with a payload to read)."""
        payloads = yield from fetch_payloads(namespace, ids)
        return {i: _Stored(i, p) for i, p in payloads.items() if isinstance(p, dict)}

    def _lookup(
        self, keys: list[ItemKey], place: Collection[ItemKey] = ()
    ) -> Plan[tuple[dict[ItemKey, _Stored], dict[int, ItemKey | None]]]:
        """The stored items of ``keys`` (absent ones left out), and who holds the ids read, enough
        for ``claim`` to place the keys ``place`` (``_plans.read_probes``: first ids, then the
        rest of a window only where the first holds another record; whole windows when they
        fit one request)."""
        probes = {k: item_id_window(*k) for k in dict.fromkeys(keys)}
        seen = yield from read_probes(self.items_namespace, probes, _ITEMS, place, filled=self._conns.filled)
        found = find(probes, seen.held)
        return {k: _Stored(i, seen.payloads[i]) for k, i in found.items()}, seen.held

    def _list_items(self, where: Where | None, filt: dict[str, Any] | None) -> Plan[list[_Stored]]:
        """Every item under ``where`` that matches ``filt``, in InMemoryStore's order."""
        found = yield from scan(self.items_namespace, where)
        items = [
            _Stored(i, p)
            for i, p in zip(found.ids, found.payloads)
            if isinstance(p, dict) and item_matches(p["value"], filt)
        ]
        return _listing_order(items)

    def _search(self, op: SearchOp, geo: Layout) -> Plan[list[tuple[float | None, _Stored]]]:
        """The page of items ``op`` asks for, each with its score (None without a query)."""
        conds, exact = translate_filter(op.filter)
        conds = prefix_conditions(op.namespace_prefix) + conds
        if not (op.query and self.embeddings is not None):
            items = yield from self._list_items(all_of(conds), op.filter)
            return [(None, s) for s in items[op.offset : op.offset + op.limit]]
        [[qv]] = yield [self._embed([op.query], query=True)]
        q = _unit_rows([qv], geo.dim)[0]
        ranked = yield from self._ranked(q, all_of(conds), exact, op.filter, op.offset + op.limit, geo)
        scoreless: list[_Stored] = []
        if len(ranked) < op.offset + op.limit:  # some fill may be needed
            scoreless = yield from self._list_items(all_of(conds + [condition("nvec", FieldOp.EQ, 0)]), op.filter)
        return _page(ranked, scoreless, op.offset, op.limit)

    def _ranked(
        self, q: np.ndarray, where: Where | None, exact: bool, filt: dict[str, Any] | None, need: int, geo: Layout
    ) -> Plan[list[tuple[float, _Stored]]]:
        """The best ``need`` items matching ``filt`` by their best vector, best first."""
        if need <= 0:
            return []
        k = min(geo.max_k, max(16, 2 * need))
        while True:
            [hits] = yield [RECALL(q, k, namespace=self.vectors_namespace, where=where)]
            scored = _vector_hits(hits.ids.tolist(), hits.scores.tolist())  # best first
            exhausted = len(hits) < k
            items = list(dict.fromkeys(iid for iid, _, _ in scored))
            if exact and not exhausted:
                items = items[: need + 4]  # a few spare for items replaced meanwhile
            kept, stale = yield from self._rank_items(scored, items, filt)
            if stale and len(items) < len(dict.fromkeys(iid for iid, _, _ in scored)):
                # An item ranked by a vector its value no longer has: its true score is lower,
                # so items cut off above may outrank it. Rank every item recalled.
                kept, _ = yield from self._rank_items(scored, list(dict.fromkeys(i for i, _, _ in scored)), filt)
            if len(kept) >= need or exhausted:
                return kept[:need]
            if k >= geo.max_k:
                break
            k = min(geo.max_k, k * 4)
        # Post-filtering left too few of max_k vectors: score every candidate vector here.
        found = yield from scan(self.vectors_namespace, where)
        if not found.ids:
            return []
        scores = found.vectors.astype(np.float64) @ q.astype(np.float64)
        order = np.argsort(-scores, kind="stable").tolist()
        scored = _vector_hits([found.ids[j] for j in order], [float(scores[j]) for j in order])
        everyone = list(dict.fromkeys(iid for iid, _, _ in scored))
        kept = []
        any_stale = False
        step = max(need, geo.max_queries)
        for lo in range(0, len(everyone), step):
            part, stale = yield from self._rank_items(scored, everyone[lo : lo + step], filt)
            kept += part
            any_stale = any_stale or stale
            if len(kept) >= need and not any_stale:  # (items come best first unless one was stale)
                break
        kept.sort(key=lambda t: -t[0])
        return kept[:need]

    def _rank_items(
        self, scored: list[tuple[int, int, float]], items: list[int], filt: dict[str, Any] | None
    ) -> Plan[tuple[list[tuple[float, _Stored]], bool]]:
        """The ``items`` (ids) that exist and match ``filt``, each scored by its best vector
        among ``scored`` (item id, vector index, score; best first) that its value still has
        (index < its ``nvec``), best first; and whether a vector it no longer has was skipped
        (left by an earlier value whose item expired, or by a put that failed half-way)."""
        records = yield from self._fetch(self.items_namespace, items)
        wanted = set(items)
        out: list[tuple[float, _Stored]] = []
        taken: set[int] = set()
        stale = False
        for iid, j, score in scored:
            s = records.get(iid)
            if iid in taken or iid not in wanted or s is None:
                continue
            if j >= s.nvec:
                stale = True
                continue
            taken.add(iid)
            if item_matches(s.payload["value"], filt):
                out.append((score, s))
        return out, stale

    def _list_namespaces(self, op: ListNamespacesOp) -> Plan[list[tuple[str, ...]]]:
        conds: list[Where] = []
        for c in op.match_conditions or ():
            conds.append(condition("depth", FieldOp.GTE, len(c.path)))
            if c.match_type == "prefix":
                conds += prefix_conditions(c.path)
        found = yield from scan(self.items_namespace, all_of(conds))
        namespaces = {tuple(p["ns"]) for p in found.payloads if isinstance(p, dict)}
        if op.match_conditions:
            namespaces = {ns for ns in namespaces if all(namespace_matches(c, ns) for c in op.match_conditions)}
        if op.max_depth is not None:
            namespaces = {ns[: op.max_depth] for ns in namespaces}
        return sorted(namespaces)[op.offset : op.offset + op.limit]

    # ------------------------------------------------------------------ writes
    def _texts(self, op: PutOp) -> list[str]:
        """The texts InMemoryStore would embed for ``op``, in its order."""
        if op.value is None or op.index is False or self.embeddings is None:
            return []
        paths = self._fields if op.index is None else [(p, tokenize_path(p)) for p in op.index]
        texts: list[str] = []
        for _, tokens in paths:
            texts += get_text_at_path(op.value, tokens)
        return texts

    def _next_seq(self) -> int:
        self._last_seq = max(time.time_ns(), self._last_seq + 1)
        return self._last_seq

    def _write(self, puts: list[PutOp], geo: Layout) -> Plan[None]:
        placing = [(op.namespace, op.key) for op in puts if op.value is not None]
        existing, held = yield from self._lookup([(op.namespace, op.key) for op in puts], placing)
        # An existing item keeps its id; a new one takes the first free id of its window, never
        # one holding another item: that is how a hash collision is survived.
        ids = claim({k: item_id_window(*k) for k in placing}, held)
        # Namespace order of new items: that of the namespace's items, if it has any.
        ns_seq: dict[tuple[str, ...], int] = {}
        for s in existing.values():
            ns_seq.setdefault(s.namespace, s.payload["ns_seq"])
        unknown = list(
            dict.fromkeys(op.namespace for op in puts if op.value is not None and op.namespace not in ns_seq)
        )
        if unknown:
            zero = np.zeros(geo.dim, np.float32)
            answers = yield [
                RECALL(
                    zero,
                    1,
                    namespace=self.items_namespace,
                    with_payload=True,
                    where=all_of([condition("depth", FieldOp.EQ, len(ns)), *prefix_conditions(ns)]),
                )
                for ns in unknown
            ]
            for ns, hits in zip(unknown, answers):
                if len(hits) and hits.payloads:
                    ns_seq[ns] = hits.payloads[0]["ns_seq"]
        texts = [self._texts(op) for op in puts]
        flat = list(dict.fromkeys(t for ts in texts for t in ts))
        embedded: dict[str, np.ndarray] = {}
        if flat:
            [vectors] = yield [self._embed(flat)]
            embedded = dict(zip(flat, _unit_rows(vectors, geo.dim)))
        now = datetime.now(timezone.utc).isoformat()
        item_rows: list[tuple[int, dict[str, Any], float]] = []
        vec_rows: list[tuple[int, np.ndarray, dict[str, Any], float]] = []
        stale_vecs: list[int] = []
        gone_items: list[int] = []
        for op, op_texts in zip(puts, texts):
            k = (op.namespace, op.key)
            old = existing.get(k)
            old_nvec = 0 if old is None else int(old.payload.get("nvec", 0))
            if op.value is None:
                if old is not None:
                    gone_items.append(old.id)
                    stale_vecs += [vector_id(old.id, j) for j in range(old_nvec)]
                continue
            if len(op_texts) > MAX_VECTORS_PER_ITEM:
                raise ValueError(f"{k!r}: {len(op_texts)} texts to index, at most {MAX_VECTORS_PER_ITEM}")
            iid = ids[k]
            value = dict(op.value)
            labels = {f"ns.{i}": label for i, label in enumerate(op.namespace)}
            columns = filter_columns(value)
            seq = self._next_seq() if old is None else old.payload["seq"]
            nss = ns_seq.setdefault(op.namespace, seq)
            ttl = ttl_seconds(op.ttl)
            item_rows.append(
                (
                    iid,
                    {
                        "ns": list(op.namespace),
                        "depth": len(op.namespace),
                        **labels,
                        "key": op.key,
                        "value": value,
                        "created_at": now if old is None else old.payload["created_at"],
                        "updated_at": now,
                        "seq": seq,
                        "ns_seq": nss,
                        "nvec": len(op_texts),
                        "ttl": op.ttl,
                        **columns,
                    },
                    ttl,
                )
            )
            vec_ttl = ttl + VECTOR_TTL_SLACK_S
            vec_rows += [
                (vector_id(iid, j), embedded[t], {**labels, **columns}, vec_ttl) for j, t in enumerate(op_texts)
            ]
            stale_vecs += [vector_id(iid, j) for j in range(len(op_texts), old_nvec)]
        # Vectors before their item, stale vectors after it: a search meanwhile finds either
        # version of an item, never a vector without an item it can read. Every row gets its TTL
        # (math.inf: never, whatever default the Kalos namespace may have been given).
        started = time.monotonic()
        if vec_rows:
            yield from upsert_rows(
                self.vectors_namespace,
                [r[0] for r in vec_rows],
                np.stack([r[1] for r in vec_rows]),
                [r[2] for r in vec_rows],
                [r[3] for r in vec_rows],
                filled=self._conns.filled,
            )
        if item_rows:
            yield from upsert_rows(
                self.items_namespace,
                [i for i, _, _ in item_rows],
                np.zeros((len(item_rows), geo.dim), np.float32),
                [p for _, p, _ in item_rows],
                [t for _, _, t in item_rows],
                filled=self._conns.filled,
            )
        timed_vecs = [r[0] for r in vec_rows if r[3] != math.inf]
        if timed_vecs and time.monotonic() - started > VECTOR_TTL_SLACK_S / 2:
            # The items were stamped so long after their vectors that the vectors' slack may not
            # cover it: restart the vectors' TTLs, now that the items have theirs.
            yield [TOUCH(timed_vecs, namespace=self.vectors_namespace)]
        if gone_items:
            yield [DELETE(gone_items, namespace=self.items_namespace)]
        if stale_vecs:
            yield [DELETE(stale_vecs, namespace=self.vectors_namespace)]
        return None
