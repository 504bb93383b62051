"""Sharded memory: placement arithmetic (pure), the merge, and a namespace over numpy shards
against the same namespace unsharded and a float64 reference, through random writes, deletes
(compaction moves across shards), growth, filtered searches and reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.broker.errors import ConfigError
from kalos.broker.layout import Metric
from kalos.broker.validation import parse_where
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
from kalos.sidecar_cuda.backends.select import choose_backend
from kalos.sidecar_cuda.backends.sharded import (
    BLOCK,
    ShardedBackend,
    global_rows,
    live_rows,
    local_capacity,
    merge_top,
    parse_devices,
    place,
)
from kalos.sidecar_cuda.storage.store import Namespace


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_placement_round_trips_and_stays_balanced(shards):
    rows = np.arange(0, 23 * BLOCK + 17, dtype=np.int64)
    shard, local = place(rows, shards)
    for s in range(shards):
        mine = rows[shard == s]
        assert (global_rows(local[shard == s], s, shards) == mine).all()
        assert (np.diff(local[shard == s]) == 1).all() and (len(mine) == 0 or local[shard == s][0] == 0)
    for n in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 7 * BLOCK + 3, len(rows)]:
        live = [live_rows(n, s, shards) for s in range(shards)]
        assert sum(live) == n
        assert max(live) - min(live) <= BLOCK
        for s in range(shards):  # the live rows of a shard are exactly its rows below n
            assert live[s] == int(((shard == s) & (rows < n)).sum())
    cap = local_capacity(10 * BLOCK + 1, shards)
    assert cap % BLOCK == 0 and cap * shards >= 10 * BLOCK + 1


def test_merge_top_is_the_top_of_the_union(rng):
    parts = []
    for _s in range(4):
        sc = -np.sort(-rng.standard_normal((5, 7)).astype(np.float32), axis=1)
        parts.append((rng.integers(0, 10**6, (5, 7)), sc))
    rows, scores = merge_top(parts, 10)
    allsc = np.concatenate([p[1] for p in parts], axis=1)
    assert rows.shape == (5, 10)
    np.testing.assert_array_equal(scores, -np.sort(-allsc, axis=1)[:, :10])
    one_rows, one_scores = merge_top(parts[:1], 3)
    assert one_rows.shape == (5, 3) and (one_scores == parts[0][1][:, :3]).all()


def test_parse_devices():
    assert parse_devices("all", 2) == [0, 1]
    assert parse_devices("1", 2) == [1]
    assert parse_devices(" 1,0 ", 2) == [1, 0]
    for bad, why in [("2", "no CUDA device 2"), ("0,0", "twice"), ("x", "comma list"), (",", "names no device")]:
        with pytest.raises(ConfigError, match=why):
            parse_devices(bad, 2)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        parse_devices("all", 0)


def test_choose_backend_shards_numpy():
    be = choose_backend("numpy", shards=3)
    try:
        assert isinstance(be, ShardedBackend) and be.placement == "cpu0,cpu1,cpu2"
        assert be.name == "numpy" and be.code == 1
    finally:
        be.close()
    assert isinstance(choose_backend("numpy", shards=1), NumpyBackend)
    with pytest.raises(ConfigError, match="shards"):
        choose_backend("numpy", shards=-1)


def _reference(ids_vecs: dict[int, np.ndarray], q: np.ndarray, k: int, allowed=None):
    ids = np.array(sorted(i for i in ids_vecs if allowed is None or i in allowed), np.int64)
    if not len(ids):
        return ids, np.empty((len(q), 0))
    x = np.stack([ids_vecs[i] for i in ids.tolist()]).astype(np.float64)
    s = q.astype(np.float64) @ x.T
    return ids, s


def _check(q, ids, scores, ref_ids, ref, k):
    kk = min(k, len(ref_ids))
    assert ids.shape == (len(q), kk)
    best = -np.sort(-ref, axis=1)[:, :kk]
    np.testing.assert_allclose(scores, best, rtol=1e-4, atol=1e-4)
    pos = {int(i): j for j, i in enumerate(ref_ids.tolist())}
    true = np.array([[ref[r, pos[int(i)]] for i in ids[r]] for r in range(len(q))])
    np.testing.assert_allclose(true, best, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shards,block", [(2, BLOCK), (3, 64), (4, 1)])
def test_sharded_namespace_matches_unsharded_and_float64(rng, shards, block):
    dim = 12
    be = ShardedBackend([NumpyBackend() for _ in range(shards)], [f"cpu{i}" for i in range(shards)], block)
    plain = NumpyBackend()
    try:
        sh = Namespace("s", be, dim, Metric.DOT, capacity=16)
        un = Namespace("u", plain, dim, Metric.DOT, capacity=16)
        live: dict[int, np.ndarray] = {}
        pls: dict[int, int] = {}
        for _step in range(12):
            new = rng.integers(0, 6000, rng.integers(200, 900)).astype(np.int64)
            vec = rng.standard_normal((len(new), dim)).astype(np.float32)
            col = rng.integers(0, 5, len(new))
            payloads = [json.dumps({"c": int(c)}).encode() for c in col]
            for ns in (sh, un):
                ns.upsert(new, vec, payloads)
            for i, v, c in zip(new.tolist(), vec, col.tolist()):  # the last of duplicates wins
                live[i], pls[i] = v, c
            gone = rng.choice(sorted(live), min(len(live) // 2, rng.integers(50, 700)), replace=False)
            for ns in (sh, un):
                ns.delete(gone.astype(np.int64))
            for i in gone.tolist():
                live.pop(i), pls.pop(i)
            assert sh.n == un.n == len(live)
            q = rng.standard_normal((3, dim)).astype(np.float32)
            k = int(rng.choice([1, 10, 64]))
            ids, scores = sh.search(q, k)
            ref_ids, ref = _reference(live, q, k)
            _check(q, ids, scores, ref_ids, ref, k)
            _u_ids, u_scores = un.search(q, k)
            np.testing.assert_allclose(scores, u_scores, rtol=1e-5, atol=1e-5)
            fut = sh.search_start(q, k)  # the pipeline's way: started on every shard, merged
            a_ids, a_scores = fut.result()
            assert (a_ids == ids).all() and (a_scores == scores).all()
            where = {"c": {"$in": [1, 3]}}
            node = parse_where(where)
            allowed = {i for i, c in pls.items() if c in (1, 3)}
            for blob in (b"k1", b"k1"):  # the second from the filter cache
                f_ids, f_scores = sh.search(q, k, match=sh.filtered(node, blob))
                r_ids, r = _reference(live, q, k, allowed)
                _check(q, f_ids, f_scores, r_ids, r, k)
            asked = np.array(rng.choice(sorted(live), 5).tolist() + [10**9], np.int64)
            g_ids, g_vecs, _ = sh.get(asked)
            assert g_ids.tolist() == asked[:5].tolist()
            np.testing.assert_array_equal(g_vecs, np.stack([live[i] for i in g_ids.tolist()]))
        assert sh.matrix.capacity >= sh.n
        counts = [live_rows(sh.n, s, shards, block) for s in range(shards)]
        assert max(counts) - min(counts) <= block  # balanced after all the deletes
    finally:
        be.close()
        plain.close()
