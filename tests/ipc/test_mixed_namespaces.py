"""A namespace per user, as agents run it (issue 34): concurrent recalls to many namespaces are
served on the sidecar's MIXED route (one gathered search, each query over its own namespace),
with writes, deletes and drops of some namespaces between the waves of recalls; answers checked
against float64 on a real sidecar, the route read back from the sidecar's per-route counter."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import free_port
from test_multi_query_batches import routes

from kalos.clients import RecallPool

DIM = 24


def check(model: dict[int, np.ndarray], q: np.ndarray, ids: np.ndarray, scores: np.ndarray, k: int) -> None:
    kk = min(k, len(model))
    assert len(ids) == kk, (len(ids), kk)
    if not kk:
        return
    keys = np.fromiter(model, np.int64, len(model))
    ref = np.stack([model[i] for i in keys.tolist()]).astype(np.float64) @ q.astype(np.float64)
    by_id = dict(zip(keys.tolist(), ref.tolist()))
    assert len(set(ids.tolist())) == kk and set(ids.tolist()) <= set(by_id)
    tol = 1e-5 * (np.abs(ref).max() + 1.0)
    kth = np.sort(ref)[::-1][kk - 1]
    got = np.asarray([by_id[i] for i in ids.tolist()])
    assert (got >= kth - tol).all(), "an id outside the true top-k"
    np.testing.assert_allclose(scores, got, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("pipeline", ["off", "on"])
@pytest.mark.asyncio
async def test_recalls_to_many_namespaces_take_the_mixed_route(sidecar_factory, seed, pipeline):
    port = free_port()
    h = sidecar_factory(
        "mixed", "--dim", str(DIM), "--slots", "32", "--max-queries", "4", "--pipeline", pipeline,
        "--metrics-port", str(port),
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    models: dict[str, dict[int, np.ndarray]] = {}
    writes = 0
    absent = 0  # recalls of a namespace that does not exist: alone in a batch, the general route
    async with RecallPool(h.name, size=16) as pool:
        for j in range(40):
            n = int(rng.choice([1, 4, 30, 200]))
            ids = rng.choice(1 << 40, n, replace=False).astype(np.int64)
            vecs = rng.standard_normal((n, DIM)).astype(np.float32)
            await pool.upsert(ids, vecs, namespace=f"user-{j}")
            writes += -(-n // 4)  # (a slot holds 4 rows: --max-queries)
            models[f"user-{j}"] = dict(zip(ids.tolist(), vecs))
        names = [*models, "new-user-a", "new-user-b"]  # never written: no memories yet
        for wave in range(4):
            jobs = []
            for _ in range(160):
                name = names[int(rng.integers(len(names)))]
                nq = int(rng.choice([1, 1, 1, 3]))
                jobs.append((name, rng.standard_normal((nq, DIM)).astype(np.float32), int(rng.integers(1, 25))))

            async def one(name: str, q: np.ndarray, k: int) -> list:
                if len(q) == 1:
                    return [await pool.recall(q[0], k, namespace=name, timeout=30)]
                return list(await pool.recall_many(q, k, namespace=name, timeout=30))

            absent += sum(1 for name, _q, _k in jobs if not models.get(name))
            outs = await asyncio.gather(*(one(*job) for job in jobs))
            for (name, q, k), hits in zip(jobs, outs):
                for row, hit in zip(q, hits):
                    check(models.get(name, {}), row, hit.ids, hit.scores, k)
            # Writes between the waves: new rows, replaced rows, deletes, a drop.
            for _ in range(5):
                name = names[int(rng.integers(40))]
                m = models.setdefault(name, {})
                old = list(m)
                new = rng.choice(1 << 40, 3).astype(np.int64).tolist() + old[:2]
                vecs = rng.standard_normal((len(new), DIM)).astype(np.float32)
                await pool.upsert(new, vecs, namespace=name)
                m.update(zip(new, vecs))
                gone = list(m)[-2:]
                await pool.delete(gone, namespace=name)
                for i in gone:
                    del m[i]
                writes += -(-len(new) // 4) + 1
            dropped = names[wave]
            await pool.drop_namespace(dropped)
            writes += 1
            models[dropped] = {}
    r = routes(port)
    assert r["mixed"] >= 4, r  # every wave's batches spanned namespaces
    # Only the writes, and recalls of a namespace that does not exist (alone, or several of the same
    # one, in a batch), took the general route; the batches of recalls took the mixed one.
    assert r["general"] <= writes + absent, r
