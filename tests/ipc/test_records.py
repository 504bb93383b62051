"""Records by id (GET) and filtered operations against a real sidecar, checked against what was
upserted (and a numpy float64 reference for recalls)."""

from __future__ import annotations

import numpy as np
import pytest

import clients._requests as _requests
from broker.errors import InvalidRequest, PayloadTooLarge, ProtocolError, UnknownNamespace
from broker.layout import Layout, Op, SegmentView, Status
from clients import RecallClient, RecallPool, Records
from clients._transport import ClientSlot, Connection
from conftest import wait_until

pytestmark = pytest.mark.timeout(120)

DIM = 16


@pytest.fixture
def small(sidecar_factory):
    """An empty numpy sidecar: dim 16, max_queries 8 (so gets of more ids are chunked)."""
    return sidecar_factory("rec", "--dim", str(DIM), "--slots", "8", "--max-k", "64",
                           "--max-queries", "8", "--backend", "numpy")


def records(rng: np.random.Generator, n: int, start: int = 0
            ) -> tuple[np.ndarray, np.ndarray, list[object]]:
    ids = np.arange(start, start + n, dtype=np.int64) * 3 + 1
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    pls: list[object] = [None if j % 5 == 0 else {"j": int(j), "tag": f"t{j % 7}", "x": [j, "y"]}
                         for j in range(n)]
    return ids, vecs, pls


@pytest.mark.asyncio
async def test_get_returns_records_in_the_order_asked_and_the_missing(small, rng):
    ids, vecs, pls = records(rng, 50)
    async with RecallPool(small.name, size=4) as pool:
        await pool.upsert(ids, vecs, pls, namespace="n")
        order = rng.permutation(len(ids))
        asked = np.concatenate([ids[order[:20]], [2, 5, 10**12], ids[order[20:23]], ids[order[:1]]])
        got = await pool.get(asked, namespace="n")
        assert isinstance(got, Records)
        want = [i for i in asked.tolist() if i in set(ids.tolist())]
        assert got.ids.tolist() == want  # order asked, 25 ids over 4 chunks of 8
        assert got.missing.tolist() == [2, 5, 10**12]
        pos = {int(i): j for j, i in enumerate(ids.tolist())}
        assert got.vectors is not None and got.vectors.dtype == np.float32
        np.testing.assert_allclose(got.vectors, vecs[[pos[i] for i in want]], rtol=1e-6, atol=0)
        assert got.payloads == [pls[pos[i]] for i in want]
        none = await pool.get([3, 8], namespace="n", with_vectors=False)
        assert len(none) == 0 and none.vectors is None and none.missing.tolist() == [3, 8]
        lean = await pool.get(ids[:3], namespace="n", with_vectors=False)
        assert lean.vectors is None and lean.ids.tolist() == ids[:3].tolist()
        # a delete and a replacement are seen by the next get
        await pool.delete(ids[:1], namespace="n")
        await pool.upsert(ids[1:2], vecs[2:3], [{"new": True}], namespace="n")
        after = await pool.get(ids[:2], namespace="n")
        assert after.ids.tolist() == [int(ids[1])] and after.missing.tolist() == [int(ids[0])]
        assert after.payloads == [{"new": True}]
        np.testing.assert_allclose(after.vectors, vecs[2:3], rtol=1e-6)


def test_get_blocking_client_and_cosine_rows_as_stored(sidecar_factory, rng):
    h = sidecar_factory("cos", "--dim", str(DIM), "--metric", "cosine", "--max-queries", "4",
                        "--backend", "numpy")
    ids, vecs, pls = records(rng, 10)
    with RecallClient(h.name, timeout=10) as c:
        c.upsert(ids, vecs, pls)
        got = c.get(ids[::-1])
        unit = vecs / np.linalg.norm(vecs.astype(np.float64), axis=1, keepdims=True)
        assert got.ids.tolist() == ids[::-1].tolist() and got.missing.size == 0
        np.testing.assert_allclose(got.vectors, unit[::-1], rtol=1e-5, atol=1e-6)
        assert got.payloads == pls[::-1]
        with pytest.raises(UnknownNamespace):
            c.get([1], namespace="nope")


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [[], [-1], [1.5], [[1, 2]], ["a"], np.array([2**64 - 1], np.uint64)])
async def test_get_bad_ids_fail_before_shared_memory(small, bad):
    async with RecallPool(small.name, size=1) as pool:
        with pytest.raises(InvalidRequest):
            await pool.get(bad)
        with pytest.raises(InvalidRequest):
            await pool.get([1], namespace="no spaces")
        assert pool.statistics().requests == 0  # nothing was sent


@pytest.mark.asyncio
async def test_get_unknown_namespace_and_payloads_too_large(sidecar_factory, rng):
    h = sidecar_factory("big", "--dim", str(DIM), "--blob-bytes", "4096", "--max-queries", "8",
                        "--backend", "numpy")
    async with RecallPool(h.name, size=2) as pool:
        with pytest.raises(UnknownNamespace):
            await pool.get([1], namespace="nope")
        ids = np.arange(8)
        for lo in (0, 4):  # 4 payloads fit a request, 8 do not
            await pool.upsert(ids[lo:lo + 4], rng.standard_normal((4, DIM)), [{"s": "x" * 900}] * 4)
        with pytest.raises(PayloadTooLarge):
            await pool.get(ids)
        got = await pool.get(ids[:2])
        assert got.payloads == [{"s": "x" * 900}] * 2


def raw_get(c: Connection, slot: ClientSlot, ids: list[int], ns: bytes, flags: int = 0,
            blob: bytes = b"", op: int = int(Op.GET)) -> tuple[int, int, str]:
    """A request written by hand (no client-side checks): (status, n_results, detail)."""
    slot.view.ids[: len(ids)] = ids
    slot.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    slot.post(op, ns, 0, len(ids), flags, len(blob), 0)
    assert wait_until(lambda: slot.is_done() and slot.try_consume(), 10)
    status, n, blen = slot.outcome()
    detail = slot.blob_text(blen).decode(errors="replace")
    slot.set_free()
    return status, n, detail


def test_get_written_by_hand_negative_ids_and_nq_out_of_range(small, rng):
    with RecallClient(small.name) as client:
        client.upsert([1, 2], rng.standard_normal((2, DIM)))
        c = Connection(small.name)
        slot = c.lease(1)[0]
        try:
            assert raw_get(c, slot, [1, -5], b"default")[0] == Status.BAD_ID
            assert raw_get(c, slot, [], b"default")[0] == Status.TOO_MANY_QUERIES
            assert raw_get(c, slot, [2, 3, 1], b"default")[:2] == (Status.OK, 2)
        finally:
            c.give_back([slot], [])
            c.close()
        assert small.proc.poll() is None


def _answer(ids_out: list[int], blob: bytes, asked: list[int]) -> object:
    L = Layout(n_slots=1, dim=2, max_k=2, max_queries=4, blob_bytes=1024)
    seg = SegmentView(memoryview(bytearray(L.total_bytes)), L)
    v = seg.slot[0]
    v.ids[: len(ids_out)] = ids_out
    v.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
    p = _requests.get(L, asked, "default", True)[0]
    return _requests.read(v, (int(Status.OK), len(ids_out), len(blob)), p)


@pytest.mark.parametrize("ids_out, blob, asked", [
    ([1, 2, 3], b"null\nnull\nnull", [1, 2]),  # more records than ids asked
    ([1, 2], b"null", [1, 2]),  # payload lines do not match
    ([1, 9], b"null\nnull", [1, 2]),  # an id that was not asked for
])
def test_get_answer_that_breaks_the_protocol(ids_out, blob, asked):
    with pytest.raises(ProtocolError):
        _answer(ids_out, blob, asked)
    ok = _answer([2], b'{"a":1}', [1, 2])
    assert isinstance(ok, Records) and ok.ids.tolist() == [2] and ok.missing.tolist() == [1]
