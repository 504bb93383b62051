"""Filters through a real sidecar against the reference of tests/filter_reference.py: ``$eq``
beside the other operators, and payloads of every JSON kind (a payload that is not an object has
no fields). ``KALOS_TEST_BACKEND=cuda`` runs it on the CUDA backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
from filter_reference import matches, random_filter, random_payload

from kalos.clients import RecallPool

pytestmark = pytest.mark.timeout(120)

DIM = 16


@pytest.mark.asyncio
async def test_random_filters_through_the_sidecar_match_the_reference(sidecar_factory, seed):
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    h = sidecar_factory(
        "rules", "--dim", str(DIM), "--slots", "4", "--max-k", "64", "--max-queries", "64", "--backend", "numpy"
    )
    n = 600
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    docs = [random_payload(r) for _ in range(n)]
    wheres = [{"a": {"$eq": "a"}}, {"a": {"$ne": 1}}, {"a": {"$exists": False}}, {"b": {"$nin": [1, None]}}] + [
        random_filter(r) for _ in range(40)
    ]
    async with RecallPool(h.name, size=2) as pool:
        await pool.upsert(ids, vecs, docs, namespace="r")
        for where in wheres:
            match = np.array([matches(d, where) for d in docs])
            m = int(match.sum())
            assert await pool.count("r", where) == m, where
            q = rng.standard_normal(DIM).astype(np.float32)
            hits = await pool.recall(q, 20, namespace="r", where=where, with_payload=True)
            assert len(hits) == min(20, m), where
            if not m:
                continue
            ref = vecs.astype(np.float64) @ q.astype(np.float64)
            pos = {int(i): j for j, i in enumerate(ids.tolist())}
            rows = np.array([pos[int(i)] for i in hits.ids])
            assert match[rows].all(), f"{where}: a hit outside the filter"
            kth = np.sort(ref[match])[::-1][min(20, m) - 1]
            tol = 1e-5 * (np.abs(ref).max() + 1)
            assert (ref[rows] >= kth - tol).all(), f"{where}: a hit outside the top 20 of the matches"
            np.testing.assert_allclose(hits.scores, ref[rows], atol=tol)
            assert hits.payloads == [docs[j] for j in rows.tolist()]
        # deleting by a filter that selects non-object payloads removes exactly the reference's rows
        gone = {"a": {"$exists": False}}
        match = np.array([matches(d, gone) for d in docs])
        assert await pool.delete(where=gone, namespace="r") == int(match.sum())
        assert await pool.count("r") == n - int(match.sum())
        assert await pool.count("r", {"a": {"$exists": True}}) == n - int(match.sum())
