"""Kalos ``where=`` filters as the integrations build them: one operator enum, one condition
builder, one way to combine conditions, one way to split long value lists.

Each store reads its framework's filter language (LangChain: the Mongo-style dict of
:func:`mongo_where`; LlamaIndex: ``MetadataFilters``; LangGraph: InMemoryStore's Python equality,
narrowed here and re-checked on the items), and builds the Kalos side only with these functions,
so how equality is spelled or how conditions are ANDed is decided once. The sidecar checks every
filter again (README, "Filters"); this module refuses early only what would otherwise mean
something else there (an equality whose value is an operator dict). Pure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

from kalos.broker.errors import InvalidRequest
from kalos.broker.validation import MAX_WHERE_VALUES, is_scalar

#: A Kalos filter: a dict ANDing conditions on top-level payload fields.
Where = dict[str, Any]


class FieldOp(str, Enum):
    """The operators of a Kalos condition on one field (Mongo's names)."""

    EQ = "$eq"
    NE = "$ne"
    IN = "$in"
    NIN = "$nin"
    GT = "$gt"
    GTE = "$gte"
    LT = "$lt"
    LTE = "$lte"
    EXISTS = "$exists"


RANGE_OPS = frozenset({FieldOp.GT, FieldOp.GTE, FieldOp.LT, FieldOp.LTE})


def condition(field: str, op: FieldOp, value: Any) -> Where:
    """One condition on one payload field. Equality takes a scalar (str, int, float, bool, None),
    else InvalidRequest: a dict there would be read as operators. ``$in``/``$nin`` take any
    iterable of values (sent as a list)."""
    if op is FieldOp.EQ:
        if not is_scalar(value):
            raise InvalidRequest(f"field {field!r}: equality takes a str, int, float, bool or None, got {value!r}")
        # The bare value: the sidecar's filter parser does not accept "$eq" yet.
        return {field: value}
    if op in (FieldOp.IN, FieldOp.NIN) and isinstance(value, (tuple, set, frozenset)):
        value = list(value)
    return {field: {op.value: value}}


def all_of(parts: Iterable[Where | None]) -> Where | None:
    """The conditions ANDed (None parts ignored; None when none is left): one dict while no
    field repeats (operators on one field merged), else ``{"$and": [...]}``."""
    present = [p for p in parts if p]
    if len(present) <= 1:
        return present[0] if present else None
    merged: Where = {}
    for part in present:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value
                continue
            old = merged[key]
            if key == "$and":
                merged[key] = [*old, *value]
            elif (
                not key.startswith("$")
                and isinstance(old, dict)
                and isinstance(value, dict)
                and not old.keys() & value.keys()
            ):
                merged[key] = {**old, **value}
            else:  # the same operator twice on a field, equality beside an operator, two $or
                return {"$and": present}
    return merged


def any_of(parts: Sequence[Where]) -> Where:
    """The conditions ORed (one alone is itself); InvalidRequest for none."""
    if not parts:
        raise InvalidRequest("an OR of no conditions")
    return parts[0] if len(parts) == 1 else {"$or": list(parts)}


def one_of(field: str, values: Sequence[Any]) -> Where:
    """``field`` is one of ``values``, in one filter: ``$in`` lists of at most the sidecar's
    bound, ORed when there are more."""
    chunks = [list(values[i : i + MAX_WHERE_VALUES]) for i in range(0, len(values), MAX_WHERE_VALUES)]
    return any_of([condition(field, FieldOp.IN, c) for c in chunks or [[]]])


def in_chunks(values: Iterable[str], blob_bytes: int) -> list[list[str]]:
    """``values`` (each once, in order) split for one ``$in`` per request: at most the sidecar's
    bound of values and half a slot's ``blob_bytes`` of JSON each (room for the rest of the
    filter)."""
    chunks: list[list[str]] = []
    size = 0
    for v in dict.fromkeys(values):
        n = len(json.dumps(v, ensure_ascii=False).encode()) + 1
        if not chunks or len(chunks[-1]) == MAX_WHERE_VALUES or size + n > blob_bytes // 2:
            chunks.append([])
            size = 0
        chunks[-1].append(v)
        size += n
    return chunks


def mongo_where(filter: Mapping[str, Any], field: Callable[[str], str] = str) -> Where:
    """A Mongo-style filter, as most vector stores take it, in Kalos semantics: ``{"f": v}``,
    ``{"f": {"$eq"|"$ne"|"$gt"|"$gte"|"$lt"|"$lte"|"$in"|"$nin"|"$exists": ...}}``,
    ``{"$and"|"$or": [filter, ...]}``; ``field`` renames each field (a prefix, say). Raises
    InvalidRequest for what Kalos cannot express (other operators, empty filters)."""
    if not isinstance(filter, Mapping) or not filter:
        raise InvalidRequest(f"a filter is a non-empty dict, got {filter!r}")
    parts: list[Where | None] = []
    for key, cond in filter.items():
        if key in ("$and", "$or"):
            if not isinstance(cond, (list, tuple)) or not cond:
                raise InvalidRequest(f"{key} takes a non-empty list of filters")
            subs = [mongo_where(c, field) for c in cond]
            parts.append(all_of(subs) if key == "$and" else any_of(subs))
        elif not isinstance(key, str) or not key or key.startswith("$"):
            raise InvalidRequest(f"unsupported filter operator {key!r} (at the top: $and, $or, or a field)")
        elif isinstance(cond, Mapping):
            if not cond:
                raise InvalidRequest(f"empty condition on {key!r}")
            parts += [condition(field(key), _field_op(key, op), arg) for op, arg in cond.items()]
        else:
            parts.append(condition(field(key), FieldOp.EQ, cond))
    where = all_of(parts)
    assert where is not None  # a non-empty filter gives at least one condition
    return where


def _field_op(key: str, op: Any) -> FieldOp:
    try:
        return FieldOp(op)
    except ValueError:
        raise InvalidRequest(
            f"field {key!r}: operator {op!r} is not supported by Kalos filters "
            f"(supported: {', '.join(o.value for o in FieldOp)})"
        ) from None
