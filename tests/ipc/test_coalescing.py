"""Client-side coalescing against a real sidecar: concurrent recalls of one pool share multi-query
slots, and each caller still gets exactly its own answer (checked against numpy float64), its own
timeout or cancellation, and its own payloads. The pure decisions are in
tests/unit/test_coalesce.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import assert_topk, slots_free

from kalos.broker.errors import KalosTimeout
from kalos.clients import RecallPool
from kalos.clients.results import Hits

pytestmark = pytest.mark.timeout(120)

NS_ROWS = 300  # rows of namespace "a": ids 0..299, payload {"g": id % 3, "id": id}


def check_filtered(q: np.ndarray, matrix: np.ndarray, allowed: np.ndarray, h: Hits, k: int) -> None:
    """``h`` is the exact top-k of ``q`` over the allowed rows of ``matrix`` (ids = row numbers)."""
    ref = matrix.astype(np.float64) @ q.astype(np.float64)
    ref[~allowed] = -np.inf
    kk = min(k, int(allowed.sum()))
    ids = h.ids
    assert len(ids) == kk and len(set(ids.tolist())) == kk
    assert allowed[ids].all(), "a hit outside the filter"
    tol = 1e-5 * (np.abs(ref[allowed]).max() + 1.0)
    kth = np.sort(ref)[::-1][kk - 1]
    assert (ref[ids] >= kth - tol).all(), "an id outside the true top-k"
    np.testing.assert_allclose(h.scores, ref[ids], rtol=1e-4, atol=tol)


async def fill_a(pool: RecallPool, rng: np.random.Generator) -> np.ndarray:
    vecs = rng.standard_normal((NS_ROWS, 32)).astype(np.float32)
    ids = np.arange(NS_ROWS)
    await pool.upsert(ids, vecs, payloads=[{"g": int(i % 3), "id": int(i)} for i in ids], namespace="a")
    return vecs


@pytest.mark.asyncio
async def test_concurrent_mixed_recalls_each_get_exactly_their_own_answer(sidecar, rng):
    async with RecallPool(sidecar.name, size=4, coalesce=True) as pool:
        a = await fill_a(pool, rng)
        g = np.arange(NS_ROWS) % 3
        everything = np.ones(NS_ROWS, bool)
        calls, checks = [], []
        for i in range(240):
            q = rng.standard_normal(32).astype(np.float32)
            k = int(rng.integers(1, 65))
            kind = i % 6
            if kind == 0:
                calls.append(pool.recall(q, k, timeout=30))
                checks.append(lambda h, q=q, k=k: assert_topk(q, sidecar.matrix, h.ids, h.scores, k))
            elif kind == 1:
                calls.append(pool.recall(q, k, namespace="a", timeout=30))
                checks.append(lambda h, q=q, k=k: check_filtered(q, a, everything, h, k))
            elif kind == 2:
                r = int(rng.integers(0, 3))
                calls.append(pool.recall(q, k, namespace="a", where={"g": r}, timeout=30))
                checks.append(lambda h, q=q, k=k, r=r: check_filtered(q, a, g == r, h, k))
            elif kind == 3:
                kp = int(rng.integers(1, 9))

                def check_payloads(h, q=q, kp=kp):
                    check_filtered(q, a, everything, h, kp)
                    assert h.payloads == [{"g": int(j % 3), "id": int(j)} for j in h.ids]

                calls.append(pool.recall(q, kp, namespace="a", with_payload=True, timeout=30))
                checks.append(check_payloads)
            elif kind == 4:
                qs = rng.standard_normal((3, 32)).astype(np.float32)

                def check_many(hs, qs=qs, k=k):
                    assert len(hs) == 3
                    for qq, h in zip(qs, hs):
                        assert_topk(qq, sidecar.matrix, h.ids, h.scores, k)

                calls.append(pool.recall_many(qs, k, timeout=30))
                checks.append(check_many)
            else:
                calls.append(pool.recall(q, k, namespace="a", where={"g": {"$ne": 0}}, timeout=30))
                checks.append(lambda h, q=q, k=k: check_filtered(q, a, g != 0, h, k))
        out = await asyncio.gather(*calls)
        for check, h in zip(checks, out):
            check(h)
        st = pool.statistics()
        recalls = st.requests - 38  # the upsert took 300 / 8 rows per slot = 38 requests
        assert recalls == 240 and st.errors == 0
        assert st.coalesced > 100, st  # most of them shared a slot ...
        assert st.posted < st.requests - 100, st  # ... so far fewer round trips than calls
        assert (st.free, st.in_flight, st.queued) == (4, 0, 0)
    assert slots_free(sidecar.name)


@pytest.mark.asyncio
async def test_a_lone_caller_is_not_coalesced(sidecar, rng):
    async with RecallPool(sidecar.name, size=4, coalesce=True) as pool:
        for _ in range(50):
            q = rng.standard_normal(32).astype(np.float32)
            h = await pool.recall(q, 10, timeout=10)
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 10)
        st = pool.statistics()
        assert (st.requests, st.posted, st.coalesced) == (50, 50, 0)


@pytest.mark.asyncio
async def test_by_default_each_recall_goes_in_its_own_slot(sidecar, rng):
    """Coalescing is opt-in (coalesce=True): the default pool sends every recall alone."""
    async with RecallPool(sidecar.name, size=4) as pool:
        qs = rng.standard_normal((60, 32)).astype(np.float32)
        out = await asyncio.gather(*(pool.recall(q, 7, timeout=30) for q in qs))
        for q, h in zip(qs, out):
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 7)
        st = pool.statistics()
        assert (st.requests, st.posted, st.coalesced) == (60, 60, 0)


@pytest.mark.asyncio
async def test_cancelled_and_timed_out_callers_do_not_affect_the_others(sidecar, rng):
    async with RecallPool(sidecar.name, size=2, coalesce=True) as pool:
        qs = rng.standard_normal((150, 32)).astype(np.float32)
        ks = [int(k) for k in rng.integers(1, 65, size=150)]
        tasks = [
            asyncio.ensure_future(pool.recall(q, k, timeout=1e-4 if i % 7 == 3 else 30))
            for i, (q, k) in enumerate(zip(qs, ks))
        ]
        await asyncio.sleep(0)  # every call is validated and queued (or sent)
        await asyncio.sleep(0)
        # (a caller answered before its cancel, on a slow machine, is not cancelled: cancel()
        # says which were)
        cancelled = {i for i, t in enumerate(tasks) if i % 5 == 1 and t.cancel()}
        assert len(cancelled) >= 20, cancelled  # of 30: at most the first slots are answered yet
        out = await asyncio.gather(*tasks, return_exceptions=True)
        served = 0
        for i, (q, k, h) in enumerate(zip(qs, ks, out)):
            if i in cancelled:
                # CancelledError, or the caller's own answer when it arrived just as the caller
                # was cancelled (Python 3.11's wait_for then returns it): never another's
                if not isinstance(h, asyncio.CancelledError):
                    assert isinstance(h, Hits), h
                    assert_topk(q, sidecar.matrix, h.ids, h.scores, k)
            elif i % 7 == 3:
                assert isinstance(h, KalosTimeout) or isinstance(h, Hits), h  # its own budget
                if isinstance(h, Hits):
                    assert_topk(q, sidecar.matrix, h.ids, h.scores, k)
            else:
                assert isinstance(h, Hits), h
                assert_topk(q, sidecar.matrix, h.ids, h.scores, k)
                served += 1
        assert served == sum(1 for i in range(150) if i not in cancelled and i % 7 != 3)
        assert sum(isinstance(out[i], asyncio.CancelledError) for i in cancelled) >= len(cancelled) // 2
        t0 = time.monotonic()
        while pool.statistics().in_flight and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.01)  # orphans drain as the sidecar answers them
        st = pool.statistics()
        print(
            f"\n[coalescing] {len(cancelled)} cancelled "
            f"({sum(isinstance(out[i], Hits) for i in cancelled)} answered as they were); orphans drained "
            f"{(time.monotonic() - t0) * 1000:.0f} ms after the last answer"
        )
        assert (st.free, st.in_flight, st.queued) == (2, 0, 0), st
        assert st.coalesced > 0
        # and the pool serves on, correctly
        q = rng.standard_normal(32).astype(np.float32)
        h = await pool.recall(q, 5, timeout=10)
        assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
    assert slots_free(sidecar.name)


@pytest.mark.asyncio
async def test_one_callers_timeout_while_queued_is_its_own(sidecar, rng):
    """A caller whose budget runs out while it waits in the queue gets its own timeout; the
    callers queued with it are answered."""
    async with RecallPool(sidecar.name, size=1, coalesce=True) as pool:
        qs = rng.standard_normal((12, 32)).astype(np.float32)
        tasks = [asyncio.ensure_future(pool.recall(q, 9, timeout=0.0 if i == 5 else 30)) for i, q in enumerate(qs)]
        out = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(out[5], KalosTimeout)
        for i, (q, h) in enumerate(zip(qs, out)):
            if i != 5:
                assert isinstance(h, Hits), h
                assert_topk(q, sidecar.matrix, h.ids, h.scores, 9)


@pytest.mark.asyncio
async def test_payloads_that_overflow_a_shared_slot_are_asked_again_alone(sidecar_factory, seed):
    h = sidecar_factory(
        "blob", "--dim", "32", "--blob-bytes", "2048", "--slots", "8", "--max-queries", "8", "--backend", "numpy"
    )
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((40, 32)).astype(np.float32)
    text = "x" * 120
    async with RecallPool(h.name, size=1, coalesce=True) as pool:
        for lo in range(0, 40, 8):
            await pool.upsert(
                np.arange(lo, lo + 8), vecs[lo : lo + 8], payloads=[{"id": i, "t": text} for i in range(lo, lo + 8)]
            )
        qs = rng.standard_normal((8, 32)).astype(np.float32)
        # one caller's 8 payloads (~1.1 KiB) fit the 2 KiB blob area; seven callers' do not
        out = await asyncio.gather(*(pool.recall(q, 8, with_payload=True, timeout=30) for q in qs))
        for q, hits in zip(qs, out):
            check_filtered(q, vecs, np.ones(40, bool), hits, 8)
            assert hits.payloads == [{"id": int(i), "t": text} for i in hits.ids]
        st = pool.statistics()
        assert st.errors == 0
        assert st.posted > st.requests  # the shared slot failed, each caller was asked alone
