"""Both slot paths against a real sidecar (real shared memory, real semaphores): the compiled one
(clients/_cslot.c: its own semaphores, rows written and answers decoded in C) and the pure-Python
one answer the same recalls exactly (numpy float64 reference), lone, many and coalesced, in a pool
and in a blocking client, and each says which path ran. Byte-level equivalence of the two is in
tests/unit/test_cslot.py."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest
from conftest import assert_topk, slots_free

from kalos.broker.errors import InvalidRequest
from kalos.broker.layout import Op
from kalos.broker.slotpath import PURE_ENV, REQUIRE_ENV, Choice, SlotPath
from kalos.clients import RecallClient, RecallPool
from kalos.clients._requests import Prepared
from kalos.clients._slots import CompiledSlot, NativeSemaphore, load_compiled
from kalos.clients._transport import Connection, Semaphore

pytestmark = pytest.mark.timeout(120)


def path_choice(path: str) -> Choice:
    if path == "python":
        return Choice(SlotPath.PYTHON, None, "test")
    try:
        return Choice(SlotPath.COMPILED, load_compiled(), "test")
    except ImportError as e:
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV}=1 and the compiled slot path does not load: {e}")
        pytest.skip(f"the compiled slot path is not built: {e}")


def connect_on(choice: Choice):
    def connect(name: str, uid: int | None) -> Connection:
        return Connection(name, sidecar_uid=uid, slot_path=choice)

    return connect


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["compiled", "python"])
async def test_a_pool_on_either_path_answers_exactly(sidecar, rng, path, caplog):
    choice = path_choice(path)
    caplog.set_level(logging.INFO, logger="kalos.clients.pool")
    for coalesce in (False, True):
        async with RecallPool(sidecar.name, size=4, coalesce=coalesce, connect=connect_on(choice)) as pool:
            assert pool.statistics().slot_path == path
            slots = pool._leases.slots
            assert all(isinstance(s, CompiledSlot) == (path == "compiled") for s in slots)
            sem_type = NativeSemaphore if path == "compiled" else Semaphore
            assert all(type(s.req) is sem_type and type(s.resp) is sem_type for s in slots)
            qs = rng.standard_normal((64, 32)).astype(np.float32)
            ks = rng.integers(1, 65, 64)
            lone = [await pool.recall(qs[i], int(ks[i]), timeout=30) for i in range(8)]
            together = await asyncio.gather(*(pool.recall(q, int(k), timeout=30) for q, k in zip(qs, ks)))
            many = await pool.recall_many(qs[:8], 7, timeout=30)
            for i, h in enumerate(lone):
                assert_topk(qs[i], sidecar.matrix, h.ids, h.scores, int(ks[i]))
            for q, k, h in zip(qs, ks, together):
                assert_topk(q, sidecar.matrix, h.ids, h.scores, int(k))
            for q, h in zip(qs[:8], many):
                assert_topk(q, sidecar.matrix, h.ids, h.scores, 7)
            # An error status through the path's decoding: a plain recall of a NaN row, prepared
            # by hand past the client's own check, answered NOT_FINITE by the sidecar.
            nan = Prepared(Op.RECALL, b"default", 3, 1, vectors=np.full((1, 32), np.nan, np.float32), single=True)
            with pytest.raises(InvalidRequest, match="NOT_FINITE"):
                await pool._execute(nan, 30, 0)
            # A namespace never written: an OK answer without hits through the same decoding.
            assert len(await pool.recall(qs[0], 3, namespace="nowhere", timeout=30)) == 0
            assert [len(h) for h in await pool.recall_many(qs[:2], 3, namespace="nowhere", timeout=30)] == [0, 0]
            if coalesce:
                assert pool.statistics().coalesced > 0
    assert [r.getMessage() for r in caplog.records].count(
        f"kalos pool {sidecar.name!r}: {path} slot path (test)"
    ) == 2  # once per pool, at open
    assert slots_free(sidecar.name)


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_blocking_client_on_either_path_answers_exactly(sidecar, rng, path):
    choice = path_choice(path)
    with RecallClient(sidecar.name, connect=connect_on(choice)) as c:
        assert c.slot_path == path
        for _ in range(20):
            q = rng.standard_normal(32).astype(np.float32)
            k = int(rng.integers(1, 65))
            h = c.recall(q, k, timeout=30)
            assert_topk(q, sidecar.matrix, h.ids, h.scores, k)
        qs = rng.standard_normal((8, 32)).astype(np.float32)
        for q, h in zip(qs, c.recall_many(qs, 5, timeout=30)):
            assert_topk(q, sidecar.matrix, h.ids, h.scores, 5)
        c.upsert([1], qs[:1], payloads=[{"a": 1}], namespace="p", timeout=30)
        [hit] = c.recall(qs[0], 1, namespace="p", with_payload=True, timeout=30)  # decoded in Python
        assert hit.id == 1 and hit.payload == {"a": 1}
    assert slots_free(sidecar.name)


@pytest.mark.asyncio
async def test_the_pool_runs_the_path_the_environment_names(sidecar):
    """``make test``: KALOS_REQUIRE_COMPILED=1 (where a compiler built the extension), then
    KALOS_PURE_PYTHON=1 over the unit and ipc layers; a pool must run what its run claims."""
    async with RecallPool(sidecar.name, size=1) as pool:
        path = pool.statistics().slot_path
    with RecallClient(sidecar.name) as c:
        assert c.slot_path == path
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        assert path == "compiled"
    elif os.environ.get(PURE_ENV, "") not in ("", "0"):
        assert path == "python"
