"""A sharded sidecar (``--shards 3``; numpy shards here, CUDA shards with KALOS_TEST_BACKEND=cuda)
behind unchanged clients: concurrent writes, deletes and recalls against a float64 reference,
filtered recalls, and a restart from the durable store giving the same answers. What ran is
asserted: the /metrics identity names the three shards."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import numpy as np
import pytest

from kalos.clients.pool import RecallPool
from tests.conftest import TEST_BACKEND

DIM = 24


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _placement(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    line = next(ln for ln in body.splitlines() if ln.startswith("kalos_backend_info{"))
    return line.split('device="', 1)[1].split('"', 1)[0]


def _check(q, live: dict[int, np.ndarray], ids, scores, k, allowed=None):
    keys = np.array(sorted(i for i in live if allowed is None or i in allowed), np.int64)
    ref = q.astype(np.float64) @ np.stack([live[i] for i in keys.tolist()]).astype(np.float64).T
    kk = min(k, len(keys))
    best = -np.sort(-ref)[:kk]
    assert len(ids) == kk and len(set(ids.tolist())) == kk
    pos = {int(i): j for j, i in enumerate(keys.tolist())}
    np.testing.assert_allclose(ref[[pos[int(i)] for i in ids]], best, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(scores, best, rtol=1e-3, atol=1e-3)


@pytest.mark.asyncio
async def test_sharded_sidecar_concurrent_writes_filters_and_restart(sidecar_factory, rng, tmp_path):
    port = _port()
    args = (
        "--dim",
        str(DIM),
        "--backend",
        "numpy",
        "--shards",
        "3",
        "--max-k",
        "64",
        "--data-dir",
        str(tmp_path),
        "--metrics-port",
        str(port),
    )
    h = sidecar_factory("shd", *args, ephemeral=False)
    labels = "cpu0,cpu1,cpu2" if TEST_BACKEND == "numpy" else None
    got = _placement(port)
    assert got.count(",") == 2, got  # three shards ran
    if labels is not None:
        assert got == labels
    live: dict[int, np.ndarray] = {}
    color: dict[int, int] = {}
    async with RecallPool(h.name, size=8) as pool:
        first = rng.standard_normal((1, DIM)).astype(np.float32)
        await pool.upsert([10**6], first, [{"c": 2}], namespace="m")
        live[10**6], color[10**6] = first[0], 2
        for _round in range(4):
            new = rng.integers(0, 9000, 2500).astype(np.int64)
            vec = rng.standard_normal((len(new), DIM)).astype(np.float32)
            col = rng.integers(0, 4, len(new))
            pls = [{"c": int(c)} for c in col]
            gone = (
                np.array(rng.choice(sorted(live), len(live) // 3, replace=False), np.int64)
                if live
                else np.empty(0, np.int64)
            )
            # writes and recalls in flight together: each recall must see the rows of one moment,
            # so they are checked only against rows untouched by this round
            deleting = [pool.delete(gone, namespace="m")] if len(gone) else []
            await asyncio.gather(
                pool.upsert(new, vec, pls, namespace="m"),
                *deleting,
                *(pool.recall(rng.standard_normal(DIM).astype(np.float32), 10, namespace="m") for _ in range(16)),
            )
            order = {}  # upsert and delete ran concurrently: ask the sidecar which happened last
            for i in gone.tolist():
                live.pop(i, None)
                color.pop(i, None)
            for i, v, c in zip(new.tolist(), vec, col.tolist()):
                order[i] = (v, c)
            for i, (v, c) in order.items():
                live[i], color[i] = v, c
            both = np.array(sorted(set(gone.tolist()) & set(order)), np.int64)
            if len(both):
                for i in (await pool.get(both, namespace="m")).missing.tolist():
                    live.pop(int(i), None)  # the delete came after the upsert
                    color.pop(int(i), None)
            assert await pool.count("m") == len(live)
            qs = rng.standard_normal((5, DIM)).astype(np.float32)
            for q, hits in zip(qs, await asyncio.gather(*(pool.recall(q, 50, namespace="m") for q in qs))):
                _check(q, live, hits.ids, hits.scores, 50)
            allowed = {i for i, c in color.items() if c == 2}
            for q in qs[:2]:
                hits = await pool.recall(q, 20, namespace="m", where={"c": 2})
                _check(q, live, hits.ids, hits.scores, 20, allowed)
        q = rng.standard_normal(DIM).astype(np.float32)
        before = (await pool.recall(q, 30, namespace="m")).scores
    h.stop()
    h2 = sidecar_factory("shd", *args, name=h.name, ephemeral=False)
    async with RecallPool(h2.name, size=4) as pool:
        assert await pool.count("m") == len(live)
        hits = await pool.recall(q, 30, namespace="m")
        # The same answer by score (equal scores may come back in another order after a restart).
        np.testing.assert_allclose(hits.scores, before, rtol=1e-5, atol=1e-6)
        _check(q, live, hits.ids, hits.scores, 30)
