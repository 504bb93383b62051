"""A filtered search on the CUDA backend: the exact top-k over candidate rows only
(``Matrix.search(within=)``), by over-fetching with a proof or by searching the gathered rows (the
rounds are ``planner.filtered_plan``'s, pure).

When many rows match, the top-k' of every row (k' > k) is searched and the candidates' first k
among them are the answer, proven when at least min(k, candidates) of the k' are candidates (any
candidate outside them scores no better than all k'); a query without that proof goes on to the
next round, then to the gathered search. Otherwise the candidates' rows are gathered into rows of
their own (kept under the caller's key until the next write, within a byte budget) and searched
by the same exact paths.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..base import Decay, SearchResult, Subset
from .device import Device
from .kernels import MAX_K
from .planner import GATHER_CACHE_FRACTION, GATHER_CACHE_MIN_BYTES, HALF_K, SearchPath, cheap_k, filtered_plan
from .rows import DeviceRows, gather
from .search import plan_for, run


def search_within(
    dev: Device, m: DeviceRows, queries: np.ndarray, n: int, k: int, within: Subset, decay: Decay | None = None
) -> SearchResult:
    """Exact top-k of ``queries`` over the candidate rows ``within`` (distinct, ascending, each < n;
    at least one) of rows [0, n) of ``m``; see the module docstring and ``Matrix.search``.
    ``decay``: recency-weighted (the proof of an over-fetch holds for any per-row score)."""
    candidates = within.rows
    c = len(candidates)
    if c == n:  # (candidates are sorted and unique: every row matches)
        m.filter_stats["all_rows"] = m.filter_stats.get("all_rows", 0) + len(queries)
        return run(dev, m, queries, n, k, decay=decay)
    b = len(queries)
    kk = min(k, c)
    out_r = np.empty((b, kk), np.int64)
    out_s = np.empty((b, kk), np.float32)
    todo = np.arange(b)
    cheap = cheap_k(SearchPath.GEMM if decay is not None else plan_for(dev, m, b, n, HALF_K).path)
    for kp in filtered_plan(k, c, n, MAX_K, cheap_k=cheap, gather_kept=_gather_kept(dev, m, within.key, c)):
        rows, scores = run(dev, m, np.ascontiguousarray(queries[todo]), n, kp, decay=decay)
        pos = np.minimum(np.searchsorted(candidates, rows), c - 1)
        hit = candidates[pos] == rows
        proven = hit.sum(axis=1) >= kk
        for i in np.flatnonzero(proven).tolist():
            cols = np.flatnonzero(hit[i])[:kk]
            out_r[todo[i]], out_s[todo[i]] = rows[i, cols], scores[i, cols]
        m.filter_stats[f"overfetch_{kp}"] = m.filter_stats.get(f"overfetch_{kp}", 0) + int(proven.sum())
        todo = todo[~proven]
        if len(todo) == 0:
            return out_r, out_s
    if len(todo) == b:
        return _search_gathered(dev, m, queries, k, within, decay)
    out_r[todo], out_s[todo] = _search_gathered(dev, m, np.ascontiguousarray(queries[todo]), k, within, decay)
    return out_r, out_s


def _search_gathered(
    dev: Device, m: DeviceRows, queries: np.ndarray, k: int, within: Subset, decay: Decay | None
) -> SearchResult:
    candidates, key = within.rows, within.key
    m.filter_stats["gathered"] += len(queries)
    sub = m.gathered.get(key) if key is not None else None
    if sub is None:
        sub = gather(dev, m, candidates)
        if key is not None and sub.data.nbytes <= _gather_budget(dev, m):
            # (the budget is asked again after each eviction: freed rows raise the free memory)
            while m.gathered and (
                sum(g.data.nbytes for g in m.gathered.values()) + sub.data.nbytes > _gather_budget(dev, m)
            ):
                m.gathered.popitem(last=False)
            m.gathered[key] = sub
    else:
        m.gathered.move_to_end(key)
        m.filter_stats["gather_reused"] += len(queries)
    rows, scores = run(dev, sub, queries, len(candidates), k, decay=decay)
    return np.asarray(candidates, np.int64)[rows], scores


def _gather_kept(dev: Device, m: DeviceRows, key: Hashable, matches: int) -> bool:
    """Are the gathered rows of ``key`` cached, or would they be?"""
    if key is None:
        return False
    return key in m.gathered or matches * m.data.shape[1] * m.data.itemsize <= _gather_budget(dev, m)


def _gather_budget(dev: Device, m: DeviceRows) -> int:
    """Device bytes the gathered rows of ``m`` may hold: GATHER_CACHE_FRACTION of its rows, at
    least 64 MiB, and never more than a quarter of the free device memory."""
    quarter = dev.free_bytes() // 4
    return max(min(GATHER_CACHE_MIN_BYTES, quarter), min(int(m.data.nbytes * GATHER_CACHE_FRACTION), quarter))


__all__ = ["search_within"]
