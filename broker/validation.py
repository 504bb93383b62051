"""Validation of caller input, before anything touches shared memory. Pure functions."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from broker.errors import InvalidRequest, PayloadTooLarge

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


def as_queries(x: Any, dim: int, max_queries: int, *, single: bool) -> np.ndarray:
    """Return a C-contiguous float32 (n, dim) copy-free view where possible.

    ``single``: x must be one vector of shape (dim,) (or (1, dim)); otherwise a (n, dim) matrix.
    Raises InvalidRequest on wrong dtype/shape/dim, non-finite values, or n outside 1..max_queries.
    """
    if (single and type(x) is np.ndarray and x.dtype == np.float32 and x.shape == (dim,)
            and x.flags.c_contiguous):
        # Fast path for the common call: one float32 vector. The sum is finite iff every element
        # is, unless it overflows (values near 1e38); only then is the element-wise check needed.
        if math.isfinite(float(x.sum())) or np.isfinite(x).all():
            return x[None, :]
        raise InvalidRequest("vectors contain NaN or infinity")
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" or a.dtype.kind == "b":
        raise InvalidRequest(f"vectors must be a real numeric array, got dtype {a.dtype}")
    if single:
        if a.ndim == 2 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 1:
            raise InvalidRequest(f"recall() takes one vector of shape ({dim},), got shape {a.shape}; "
                                 "use recall_many() for several")
        a = a[None, :]
    elif a.ndim != 2:
        raise InvalidRequest(f"expected a 2-d array (n, {dim}), got shape {a.shape}")
    n, d = a.shape
    if d != dim:
        raise InvalidRequest(f"dimension mismatch: broker serves dim={dim}, got {d}")
    if not 1 <= n <= max_queries:
        raise InvalidRequest(f"{n} rows in one request; this broker allows 1..{max_queries} per slot")
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise InvalidRequest("vectors contain NaN or infinity (after conversion to float32)")
    return a


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


def encode_payloads(payloads: Sequence[Any] | None, n: int, limit: int) -> bytes:
    """JSON-lines encoding of one payload per row (``null`` for none); refuses more than ``limit`` bytes."""
    if payloads is None:
        return b""
    if len(payloads) != n:
        raise InvalidRequest(f"{len(payloads)} payloads for {n} vectors")
    try:
        lines = [json.dumps(p, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
                 for p in payloads]
    except RecursionError:
        raise InvalidRequest(f"a payload nests deeper than {MAX_PAYLOAD_DEPTH} levels") from None
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"payloads must be JSON-serialisable: {e}") from None
    for line in lines:
        if line.count("[") + line.count("{") > MAX_PAYLOAD_DEPTH and \
                json_depth(json.loads(line)) > MAX_PAYLOAD_DEPTH:
            raise InvalidRequest(f"a payload nests deeper than {MAX_PAYLOAD_DEPTH} levels")
    blob = "\n".join(lines).encode()
    if len(blob) > limit:
        raise PayloadTooLarge(f"payloads take {len(blob)} bytes; one request carries at most {limit} "
                              "(split the upsert or raise the sidecar's --blob-bytes)")
    return blob
