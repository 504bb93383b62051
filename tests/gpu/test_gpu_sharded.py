"""Sharded memory on CUDA: several shards on one GPU (each its own backend, stream and buffers),
and one shard per GPU where two or more are visible. Against the unsharded CUDA namespace and a
float64 reference, through writes, deletes (moves across shards), filtered searches, the
pipeline's started searches and reads. Skipped where CuPy or a CUDA device is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.broker.layout import Metric
from kalos.broker.validation import parse_where
from kalos.sidecar_cuda.backends.cuda import cuda_available, device_count
from kalos.sidecar_cuda.backends.sharded import ShardedBackend
from kalos.sidecar_cuda.storage.store import Namespace

_WHY = cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_WHY is not None, reason=f"CUDA backend unavailable: {_WHY}"),
]
TOL = {"float32": 1e-4, "float16": 4e-3}


def _check(q, live, ids, scores, k, rtol, allowed=None):
    keys = np.array(sorted(i for i in live if allowed is None or i in allowed), np.int64)
    x = np.stack([live[i] for i in keys.tolist()]).astype(np.float64)
    ref = q.astype(np.float64) @ x.T
    kk = min(k, len(keys))
    assert ids.shape == (len(q), kk)
    pos = {int(i): j for j, i in enumerate(keys.tolist())}
    tol = rtol * (np.abs(ref).max() + 1)
    for r in range(len(q)):
        best = -np.sort(-ref[r])[:kk]
        assert len(set(ids[r].tolist())) == kk
        np.testing.assert_allclose(ref[r, [pos[int(i)] for i in ids[r]]], best, atol=tol)
        np.testing.assert_allclose(scores[r], best, atol=tol)


def _exercise(be, rng, dtype, block_rows=3000, steps=5, dim=48):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    plain = CupyBackend(storage_dtype=dtype, host_work=0)
    try:
        sh = Namespace("s", be, dim, Metric.DOT, capacity=64)
        un = Namespace("u", plain, dim, Metric.DOT, capacity=64)
        live: dict[int, np.ndarray] = {}
        col: dict[int, int] = {}
        for _ in range(steps):
            new = rng.integers(0, 4 * block_rows, block_rows).astype(np.int64)
            vec = rng.standard_normal((len(new), dim)).astype(np.float32)
            c = rng.integers(0, 4, len(new))
            pls = [json.dumps({"c": int(v)}).encode() for v in c]
            for ns in (sh, un):
                ns.upsert(new, vec, pls)
            for i, v, cc in zip(new.tolist(), vec, c.tolist()):
                live[i], col[i] = v, cc
            gone = rng.choice(sorted(live), len(live) // 4, replace=False).astype(np.int64)
            for ns in (sh, un):
                ns.delete(gone)
            for i in gone.tolist():
                live.pop(i), col.pop(i)
            for b, k in ((1, 10), (5, 64), (40, 10)):  # fused and GEMM paths
                q = rng.standard_normal((b, dim)).astype(np.float32)
                ids, scores = sh.search(q, k)
                _check(q, live, ids, scores, k, TOL[dtype])
                a_ids, _a_scores = sh.search_start(q, k).result()
                assert (a_ids == ids).all()
                _u_ids, u_scores = un.search(q, k)
                np.testing.assert_allclose(scores, u_scores, atol=TOL[dtype] * (np.abs(u_scores).max() + 1))
                for where, want in (({"c": 1}, {1}), ({"c": {"$ne": 3}}, {0, 1, 2})):
                    allowed = {i for i, cc in col.items() if cc in want}
                    f = sh.filtered(parse_where(where), json.dumps(where).encode())
                    f_ids, f_scores = sh.search(q, k, match=f)
                    _check(q, live, f_ids, f_scores, k, TOL[dtype], allowed)
            asked = np.array(rng.choice(sorted(live), 7).tolist(), np.int64)
            g_ids, g_vecs, _ = sh.get(asked)
            assert g_ids.tolist() == asked.tolist()
            np.testing.assert_allclose(
                g_vecs, np.stack([live[i] for i in asked.tolist()]), rtol=TOL[dtype], atol=TOL[dtype]
            )
    finally:
        plain.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_several_shards_on_one_gpu(rng, dtype):
    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    be = ShardedBackend(
        [CupyBackend(storage_dtype=dtype, device=0, host_work=0) for _ in range(3)], ["cuda:0"] * 3, block=256
    )
    try:
        assert len({id(b.stream) for b in be.backends}) == 3  # three streams, three buffer sets
        _exercise(be, rng, dtype)
    finally:
        be.close()


@pytest.mark.skipif(device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")
def test_one_shard_per_gpu(rng):
    from kalos.sidecar_cuda.backends.select import choose_backend

    be = choose_backend("cuda", storage_dtype="float16", devices="all")
    try:
        assert isinstance(be, ShardedBackend)
        assert be.placement == ",".join(f"cuda:{d}" for d in range(device_count()))
        _exercise(be, rng, "float16")
        m = be.new_matrix(8, 4096, Metric.DOT)
        for part, dev in zip(m.parts, range(device_count())):
            assert part.data.device.id == dev  # each shard's rows live on its own GPU
    finally:
        be.close()
