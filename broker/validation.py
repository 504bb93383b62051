"""Validation of caller input, before anything touches shared memory. Pure functions."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidRequest

#: Ids are int64; -1 marks "no result" in result arrays, so negative ids are refused.
MAX_ID = 2**63 - 1
#: Deepest nesting of arrays/objects a payload may have. Decoders recurse per level (CPython's
#: json stops near 1,000 levels with RecursionError), and every reader of a payload (sidecar,
#: clients, framework adapters) must be able to decode what was stored.
MAX_PAYLOAD_DEPTH = 64


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value: 0 for a scalar, 1 for ``[]`` or ``{}``. Iterative,
    so any depth is measured without recursion."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        depth = max(depth, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return depth


def payload_problem(line: bytes) -> str | None:
    """Why one encoded payload (a JSON text, as stored) is refused, or None. Never raises: a
    client may have written any bytes."""
    if line.count(b"[") + line.count(b"{") <= MAX_PAYLOAD_DEPTH:
        try:  # too few brackets to nest deeper than the limit: only validity to check
            json.loads(line)
        except (ValueError, RecursionError):
            return "payload is not valid JSON"
        return None
    try:
        value = json.loads(line)
    except RecursionError:
        return f"payload nests deeper than {MAX_PAYLOAD_DEPTH} levels"
    except ValueError:
        return "payload is not valid JSON"
    if json_depth(value) > MAX_PAYLOAD_DEPTH:
        return f"payload nests deeper than {MAX_PAYLOAD_DEPTH} levels"
    return None


class VectorsFor(enum.Enum):
    """The call vectors are given to, which fixes the one shape it takes: ``recall`` exactly
    ``(dim,)``; ``recall_many`` and ``upsert`` exactly ``(n, dim)``."""

    RECALL = "recall"
    RECALL_MANY = "recall_many"
    UPSERT = "upsert"


#: Largest float32 magnitude: a value beyond it becomes infinity when converted.
_F32_MAX = float(np.finfo(np.float32).max)


def as_vectors(x: Any, dim: int, use: VectorsFor, max_rows: int | None = None) -> np.ndarray:
    """The one rule for vectors given to any call: a C-contiguous float32 ``(n, dim)`` array
    (a view of ``x`` where possible).

    Any real float or integer dtype is converted to float32; a value beyond float32's range
    (about 3.4e38), NaN or infinity is refused. :attr:`VectorsFor.RECALL` takes exactly one vector
    of shape ``(dim,)`` (returned as ``(1, dim)``), the others exactly ``(n, dim)`` with ``n`` in
    ``1..max_rows`` (no bound if None). Anything else raises InvalidRequest naming the shape it
    got and the one expected.
    """
    if (
        use is VectorsFor.RECALL
        and type(x) is np.ndarray
        and x.dtype == np.float32
        and x.shape == (dim,)
        and x.flags.c_contiguous
    ):
        # Fast path for the common call: one float32 vector. Its dot product with itself is
        # finite iff every element is, unless it overflows (elements beyond ~1.8e19); only then
        # is the element-wise check needed. (A third of the cost of x.sum() here: no wrapper.)
        if math.isfinite(x.dot(x)) or np.isfinite(x).all():
            return x[None, :]
        raise InvalidRequest("vectors contain NaN or infinity")
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged lists, arrays of another device (cupy) ...
        raise InvalidRequest(f"{use.value}: vectors must be a numeric array, got {type(x).__name__} ({e})") from None
    if a.dtype.kind not in "fiu":
        raise InvalidRequest(
            f"{use.value}: vectors must be real numbers (a float or integer "
            f"dtype, converted to float32), got dtype {a.dtype}"
        )
    problem = _shape_problem(a.shape, dim, use, max_rows)
    if problem is not None:
        raise InvalidRequest(problem)
    if use is VectorsFor.RECALL:
        a = a[None, :]
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(out).all():
        if a.dtype.kind == "f" and a.dtype.itemsize > 4 and np.isfinite(a).all():
            raise InvalidRequest(
                f"{use.value}: a value does not fit in float32 (its magnitude "
                f"exceeds {_F32_MAX:.4g}); vectors are stored as float32"
            )
        raise InvalidRequest("vectors contain NaN or infinity")
    return out


def _shape_problem(shape: tuple[int, ...], dim: int, use: VectorsFor, max_rows: int | None) -> str | None:
    """Why ``shape`` is not what ``use`` takes (the message for the caller), or None. Pure."""
    if use is VectorsFor.RECALL:
        if shape == (dim,):
            return None
        want = f"recall takes one vector of shape ({dim},); got {shape}"
        if len(shape) == 2 and shape[1] == dim:
            hint = ": use recall_many for several queries" + (", or vec[0]" if shape[0] == 1 else "")
            return want + hint
        if len(shape) == 1:
            return f"{want}: dimension mismatch, the broker serves dim={dim}"
        return want
    what = (
        "recall_many takes a matrix of shape (n, {d})"
        if use is VectorsFor.RECALL_MANY
        else "upsert takes a matrix of shape (n, {d}), one row per id"
    )
    want = what.format(d=dim) + f"; got {shape}"
    if len(shape) == 1 and shape[0] == dim:
        return want + (
            ": use recall for one vector, or vec[None]"
            if use is VectorsFor.RECALL_MANY
            else ": pass vec[None] for one record"
        )
    if len(shape) != 2:
        return want
    n, d = shape
    if d != dim:
        return f"{want}: dimension mismatch, the broker serves dim={dim}"
    if n < 1:
        return f"{want}: no rows"
    if max_rows is not None and n > max_rows:
        return f"{want}: {n} rows in one request; this broker allows 1..{max_rows} (its --max-queries)"
    return None


def check_k(k: Any, max_k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InvalidRequest(f"k must be an integer, got {k!r}")
    if not 1 <= int(k) <= max_k:
        raise InvalidRequest(f"k={k} is outside 1..{max_k} (the broker's max_k)")
    return int(k)


def as_ids(ids: Any, n: int | None = None, *, max_n: int | None = None) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim == 0:
        a = a[None]
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidRequest(f"ids must be a 1-d array of integers, got dtype {a.dtype} shape {a.shape}")
    if n is not None and a.size != n:
        raise InvalidRequest(f"{a.size} ids for {n} vectors")
    if a.size == 0:
        raise InvalidRequest("empty ids")
    if max_n is not None and a.size > max_n:
        raise InvalidRequest(f"{a.size} ids in one request; at most {max_n}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > MAX_ID:
        raise InvalidRequest("ids must fit in int64")
    a = a.astype(np.int64, copy=False)
    if a.size and int(a.min()) < 0:
        raise InvalidRequest("ids must be >= 0")
    return np.ascontiguousarray(a)


def payload_lines(payloads: Sequence[Any], n: int) -> list[bytes]:
    """One JSON text per row (``null`` for none), as the sidecar stores it; every payload is
    checked (JSON-serialisable, finite numbers, nesting) before any is sent. Raises
    InvalidRequest naming the first row refused."""
    if len(payloads) != n:
        raise InvalidRequest(f"{len(payloads)} payloads for {n} vectors")
    out = []
    for row, p in enumerate(payloads):
        try:
            line = json.dumps(p, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except RecursionError:
            raise InvalidRequest(f"the payload of row {row} nests deeper than {MAX_PAYLOAD_DEPTH} levels") from None
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"payloads must be JSON-serialisable (row {row}): {e}") from None
        if line.count("[") + line.count("{") > MAX_PAYLOAD_DEPTH and json_depth(json.loads(line)) > MAX_PAYLOAD_DEPTH:
            raise InvalidRequest(f"the payload of row {row} nests deeper than {MAX_PAYLOAD_DEPTH} levels")
        out.append(line.encode())
    return out


# --------------------------------------------------------------------------- filters (where=)

#: A parsed filter: ("and"|"or", (node, ...)), ("eq"|"ne", field, scalar), ("in"|"nin", field,
#: (scalar, ...)), ("gt"|"gte"|"lt"|"lte", field, number), ("exists", field, bool). ``{"f": v}``
#: and ``{"f": {"$eq": v}}`` parse to the same node.
WhereNode = tuple[Any, ...]
#: Bounds of one filter: ``$or``/``$and`` nesting, conditions in all, values of one ``$in``.
MAX_WHERE_DEPTH = 8
MAX_WHERE_TERMS = 256
MAX_WHERE_VALUES = 1024
_RANGE_OPS = {"$gt": "gt", "$gte": "gte", "$lt": "lt", "$lte": "lte"}
#: A record's timestamps, as filter fields (range operators only, seconds since the epoch; a
#: record that never expires has ``$expires_at`` +inf). Their names start with ``$``, so no
#: payload field can shadow them.
TIME_FIELDS = frozenset({"$created_at", "$updated_at", "$expires_at"})
_FIELD_OPS = frozenset({"$eq", "$in", "$nin", "$ne", "$exists", *_RANGE_OPS})


def is_scalar(v: Any) -> bool:
    """A value equality filters may name: str, int, float (finite), bool or None."""
    if isinstance(v, float):
        return math.isfinite(v)
    return v is None or isinstance(v, (str, int, bool))


def parse_where(where: Any) -> WhereNode:
    """Check a filter (a dict ANDing conditions on top-level payload fields) and return its parsed
    form. Pure; raises InvalidRequest naming the first problem. Used by clients before anything is
    sent and by the sidecar on the bytes a client wrote (untrusted)."""
    terms = [0]
    return _parse_where(where, 0, terms)


def _parse_where(where: Any, depth: int, terms: list[int]) -> WhereNode:
    if not isinstance(where, dict):
        raise InvalidRequest(f"a filter is a dict of conditions, got {type(where).__name__}")
    if depth > MAX_WHERE_DEPTH:
        raise InvalidRequest(f"filters nest $or/$and at most {MAX_WHERE_DEPTH} deep")
    out: list[WhereNode] = []
    for key, cond in where.items():
        if not isinstance(key, str) or not key:
            raise InvalidRequest(f"filter fields are non-empty strings, got {key!r}")
        if key in ("$or", "$and"):
            if not isinstance(cond, list) or not cond:
                raise InvalidRequest(f"{key} takes a non-empty list of filters")
            out.append((key[1:], tuple(_parse_where(c, depth + 1, terms) for c in cond)))
            continue
        if key in TIME_FIELDS:
            conds = _time_conditions(key, cond)
            out.extend(conds)
            terms[0] += len(conds)
            if terms[0] > MAX_WHERE_TERMS:
                raise InvalidRequest(f"a filter has at most {MAX_WHERE_TERMS} conditions")
            continue
        if key.startswith("$"):
            raise InvalidRequest(
                f"unknown filter operator {key!r} (at the top: $or, $and, or a time field: "
                f"{', '.join(sorted(TIME_FIELDS))})"
            )
        if isinstance(cond, dict):
            if not cond:
                raise InvalidRequest(f"empty condition on {key!r}")
            for op, arg in cond.items():
                out.append(_field_condition(key, op, arg))
                terms[0] += 1
        elif is_scalar(cond):
            out.append(("eq", key, cond))
            terms[0] += 1
        else:
            raise InvalidRequest(
                f"field {key!r}: equality takes a str, int, float, bool or None "
                f"(or an operator dict), got {type(cond).__name__}"
            )
        if terms[0] > MAX_WHERE_TERMS:
            raise InvalidRequest(f"a filter has at most {MAX_WHERE_TERMS} conditions")
    return ("and", tuple(out))


def _time_conditions(field: str, cond: Any) -> list[WhereNode]:
    """The conditions on a record timestamp (``{"$updated_at": {"$gte": t, ...}}``): range
    operators with a finite number of seconds since the epoch."""
    if not isinstance(cond, dict) or not cond:
        raise InvalidRequest(
            f"{field} takes range operators on seconds since the epoch, e.g. {{{field!r}: {{'$gte': 1.7e9}}}}"
        )
    out: list[WhereNode] = []
    for op, arg in cond.items():
        if op not in _RANGE_OPS:
            raise InvalidRequest(f"{field}: only {', '.join(sorted(_RANGE_OPS))} (seconds since the epoch), got {op!r}")
        if isinstance(arg, bool) or not isinstance(arg, (int, float)) or not math.isfinite(arg):
            raise InvalidRequest(f"{field}: {op} takes a finite number of seconds since the epoch")
        out.append((_RANGE_OPS[op], field, float(arg)))
    return out


def _field_condition(field: str, op: Any, arg: Any) -> WhereNode:
    if op not in _FIELD_OPS:
        raise InvalidRequest(f"field {field!r}: unknown operator {op!r} (known: {', '.join(sorted(_FIELD_OPS))})")
    if op in ("$in", "$nin"):
        if not isinstance(arg, list) or len(arg) > MAX_WHERE_VALUES or not all(map(is_scalar, arg)):
            raise InvalidRequest(
                f"field {field!r}: {op} takes a list of at most {MAX_WHERE_VALUES} "
                "scalars (str, int, float, bool, None)"
            )
        return (op[1:], field, tuple(arg))
    if op in ("$eq", "$ne"):
        if not is_scalar(arg):
            raise InvalidRequest(f"field {field!r}: {op} takes a scalar (str, int, float, bool, None)")
        return (op[1:], field, arg)
    if op == "$exists":
        if not isinstance(arg, bool):
            raise InvalidRequest(f"field {field!r}: $exists takes true or false")
        return ("exists", field, arg)
    if isinstance(arg, bool) or not isinstance(arg, (int, float)) or not math.isfinite(arg):
        raise InvalidRequest(f"field {field!r}: {op} takes a finite number")
    return (_RANGE_OPS[op], field, float(arg))


def encode_where(where: Any, limit: int) -> bytes:
    """The canonical encoding of a valid filter (compact JSON, keys sorted) for a slot's blob;
    raises InvalidRequest (invalid, or longer than ``limit`` bytes)."""
    parse_where(where)
    try:
        blob = json.dumps(where, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"filter is not JSON-serialisable: {e}") from None
    if len(blob) > limit:
        raise InvalidRequest(f"filter takes {len(blob)} bytes; a request carries at most {limit}")
    return blob


def decode_where(blob: bytes) -> WhereNode:
    """A filter as a client wrote it (any bytes): parsed, or InvalidRequest. Never anything else."""
    try:
        where = json.loads(blob)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise InvalidRequest("filter is not valid JSON") from None
    return parse_where(where)
