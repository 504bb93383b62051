"""An independent reference of the documented filter semantics (docs/protocol.md, "Filters"),
evaluated on decoded payloads one record at a time, and random payloads and filters to hold the
sidecar's column evaluation against it. Shared by tests/unit/test_filters.py and
tests/ipc/test_filter_rules.py."""

from __future__ import annotations

import operator
import random
from typing import Any

_ABSENT = object()
_RANGE = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}

#: Field names the random payloads and filters draw from ("zz" is never written).
FIELDS = ("a", "b", "c", "zz")
#: Scalars that payloads hold and filters name: equal pairs across types (1 and 1.0), pairs that
#: must not be equal (True and 1, "1" and 1, None and 0), and values no payload holds.
SCALARS: tuple[Any, ...] = (0, 1, 1.0, 2, 2.5, -3, True, False, None, "1", "a", "b", "", "zzz")


def scalar_equal(a: Any, b: Any) -> bool:
    """Equality of a payload value and a filter scalar: by type and value, bools are not numbers,
    a list or an object equals nothing."""
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return bool(a == b)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def matches(payload: Any, where: dict[str, Any]) -> bool:
    """Whether a record with this decoded payload (None: no payload) matches ``where``.

    The rule for payloads that are not objects: they have no fields, so every field is missing
    (``$ne``, ``$nin`` and ``$exists: false`` match them; nothing else does)."""
    fields: dict[str, Any] = payload if isinstance(payload, dict) else {}
    for key, cond in where.items():
        if key == "$or":
            if not any(matches(payload, c) for c in cond):
                return False
            continue
        if key == "$and":
            if not all(matches(payload, c) for c in cond):
                return False
            continue
        v = fields.get(key, _ABSENT)
        present = v is not _ABSENT
        for op, arg in cond.items() if isinstance(cond, dict) else [("$eq", cond)]:
            if op == "$eq":
                ok = present and scalar_equal(v, arg)
            elif op == "$ne":
                ok = not (present and scalar_equal(v, arg))
            elif op == "$in":
                ok = present and any(scalar_equal(v, a) for a in arg)
            elif op == "$nin":
                ok = not (present and any(scalar_equal(v, a) for a in arg))
            elif op == "$exists":
                ok = present == arg
            else:  # a range operator: numbers only
                ok = present and _number(v) and _RANGE[op](v, arg)
            if not ok:
                return False
    return True


def random_payload(r: random.Random) -> Any:
    """A payload of any JSON kind: none, null, a list, a string, a number, a bool, or an object
    of scalars, lists and objects."""
    x = r.random()
    if x < 0.05:
        return None
    if x < 0.10:
        return r.choice([[], [1, "a"], [{"a": 1}]])
    if x < 0.15:
        return r.choice(["a", "", '{"a": 1}'])
    if x < 0.20:
        return r.choice([0, 1, 2.5, -3])
    if x < 0.22:
        return r.choice([True, False])
    doc: dict[str, Any] = {}
    for f in FIELDS[:-1]:
        y = r.random()
        if y < 0.25:
            continue  # missing
        doc[f] = r.choice(SCALARS) if y < 0.9 else r.choice([[1], {"a": 1}, []])
    return doc


def random_condition(r: random.Random) -> Any:
    op = r.choice(["bare", "$eq", "$ne", "$in", "$nin", "$exists", "$gt", "$gte", "$lt", "$lte"])
    if op == "bare":
        return r.choice(SCALARS)
    if op in ("$eq", "$ne"):
        return {op: r.choice(SCALARS)}
    if op in ("$in", "$nin"):
        return {op: r.sample(SCALARS, r.randint(0, 4))}
    if op == "$exists":
        return {op: r.random() < 0.5}
    return {op: r.choice([-3, 0, 1, 1.5, 2.5])}


def random_filter(r: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random valid filter: conditions on fields (several operators on one field sometimes),
    ``$or``/``$and`` nested up to two deep."""
    out: dict[str, Any] = {}
    for _ in range(r.randint(0 if depth else 1, 2)):
        f = r.choice(FIELDS)
        cond = random_condition(r)
        if isinstance(cond, dict) and r.random() < 0.2:
            extra = random_condition(r)
            if isinstance(extra, dict):
                cond = {**cond, **extra}
        out[f] = cond
    if depth < 2 and r.random() < 0.3:
        out[r.choice(["$or", "$and"])] = [random_filter(r, depth + 1) for _ in range(r.randint(1, 3))]
    return out
