"""What a new user hits in the first hour (issue 22, the client items), on real sidecars: an
upsert refused for one payload writes nothing; a sidecar killed mid-upsert leaves exactly what
the PartialWrite error says; opening without a sidecar, with too large a pool, or with every
slot taken fails at once with the right error; a blocking client keeps its budget across
restarts."""

from __future__ import annotations

import asyncio
import shlex
import signal
import threading
import time

import numpy as np
import pytest
from conftest import run_py, slots_free, unique_name

from kalos import (
    BrokerUnavailable,
    ConfigError,
    KalosTimeout,
    PartialWrite,
    PayloadTooLarge,
    RecallClient,
    RecallPool,
    SlotsExhausted,
)
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing import start_sidecar_process

pytestmark = pytest.mark.timeout(240)

DIM = 16


def issue_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[object]]:
    """The issue's call: 100 rows, row 80 with a 20 KB payload (20008 bytes as JSON)."""
    ids = np.arange(100, dtype=np.int64) + 1000
    vecs = rng.standard_normal((100, DIM)).astype(np.float32)
    pls: list[object] = [{"row": i} for i in range(100)]
    pls[80] = {"t": "x" * 20000}
    return ids, vecs, pls


@pytest.mark.asyncio
async def test_an_upsert_with_one_payload_over_the_limit_writes_nothing(sidecar_factory, rng):
    """Issue 22 item 2, as reported: default --payload-limit (16384) and --max-queries (32), so
    the call is 4 chunks and the one holding row 80 used to be refused while the 68 rows of the
    others were written. Now: the error before anything is sent (the client reads the limit from
    the segment header), and 0 rows; the same through the blocking client; and a sidecar started
    with a larger --payload-limit takes the same call."""
    h = sidecar_factory("atomic", "--dim", str(DIM), "--backend", "numpy")
    ids, vecs, pls = issue_rows(rng)
    async with RecallPool(h.name, size=4) as pool:
        with pytest.raises(
            PayloadTooLarge, match="row 80 takes 20008 bytes, over the sidecar's --payload-limit of 16384"
        ) as e:
            await pool.upsert(ids, vecs, pls, namespace="n", timeout=10)
        assert not isinstance(e.value, PartialWrite)
        assert (await pool.namespaces()).get("n", 0) == 0
        with RecallClient(h.name, timeout=10) as c:
            with pytest.raises(PayloadTooLarge, match="20008 bytes"):
                c.upsert(ids, vecs, pls, namespace="n")
            assert c.namespaces().get("n", 0) == 0
        pls[80] = {"t": "x" * 200}
        assert await pool.upsert(ids, vecs, pls, namespace="n", timeout=10) == 100
        got = await pool.get(ids, namespace="n")
        assert got.ids.tolist() == ids.tolist() and got.payloads == pls
        np.testing.assert_array_equal(got.vectors, vecs)
    big = sidecar_factory("atomic-big", "--dim", str(DIM), "--backend", "numpy", "--payload-limit", "32768")
    pls[80] = {"t": "x" * 20000}
    async with RecallPool(big.name, size=4) as pool:
        assert await pool.upsert(ids, vecs, pls, namespace="n", timeout=10) == 100
        assert (await pool.get([1080], namespace="n")).payloads == [pls[80]]


@pytest.mark.asyncio
async def test_a_sidecar_killed_mid_upsert_leaves_what_the_error_says(sidecar_factory, rng, tmp_path):
    """kill -9 during a long upsert on a durable store, then a restart on the same data dir.

    The error's ids against what the new sidecar holds: every written id is there (it was
    acknowledged, so committed with synchronous=FULL before the answer); no unwritten id is
    (never posted, so the sidecar never saw it); the rest of what is there is in doubt (posted
    when the sidecar died: committed or not). In doubt are at most the pool's slots' chunks."""
    args = [
        "--dim",
        str(DIM),
        "--max-queries",
        "8",
        "--slots",
        "8",
        "--backend",
        "numpy",
        "--data-dir",
        str(tmp_path / "data"),
    ]
    h = sidecar_factory("midup", *args, ephemeral=False)
    n = 40_000
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    pls = [{"i": int(i)} for i in ids]
    async with RecallPool(h.name, size=4) as pool:
        task = asyncio.ensure_future(pool.upsert(ids, vecs, pls, namespace="bulk"))
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while pool.statistics().requests < 40:  # some chunks acknowledged
            assert loop.time() < end and not task.done(), "the upsert finished before the kill"
            await asyncio.sleep(0.002)
        h.kill9()
        with pytest.raises(BrokerUnavailable) as e:
            await asyncio.wait_for(task, 30)
        err = e.value
        assert isinstance(err, PartialWrite), err
        written, unwritten, doubt = set(err.written), set(err.unwritten), set(err.in_doubt)
        assert len(written) + len(unwritten) + len(doubt) == n
        assert written | unwritten | doubt == set(ids.tolist())
        sidecar_factory("midup", *args, name=h.name, ephemeral=False)  # same data dir
        got = await pool.get(ids, namespace="bulk", timeout=60)  # the pool re-attached
    present = set(got.ids.tolist())
    print(
        f"\n[mid-upsert kill] {n} rows: {len(written)} written, {len(doubt)} in doubt, "
        f"{len(unwritten)} not written; present after restart: {len(present)} "
        f"({len(present & doubt)} of the in-doubt ones)"
    )
    assert written <= present
    assert not present & unwritten
    assert present <= written | doubt
    assert len(doubt) <= 4 * 8  # the chunks in the pool's 4 slots at the kill
    assert len(written) >= 40 * 8 - len(doubt)
    pos = {int(i): j for j, i in enumerate(ids.tolist())}
    rows = [pos[i] for i in got.ids.tolist()]
    np.testing.assert_array_equal(got.vectors, vecs[rows])
    assert got.payloads == [pls[r] for r in rows]


@pytest.mark.asyncio
async def test_without_reconnect_no_sidecar_fails_at_once_and_the_hint_works(sidecar_factory):
    """Issue 22 item 8: reconnect=False with no sidecar waited the whole connect_timeout. Now it
    fails at once, and the command the message suggests starts a sidecar the pool then opens."""
    name = unique_name("nosuch")
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable) as e:
        await RecallPool(name, reconnect=False, connect_timeout=60).open()
    took = time.monotonic() - t0
    with pytest.raises(BrokerUnavailable):
        RecallClient(name, reconnect=False, connect_timeout=60)
    took_blocking = time.monotonic() - t0 - took
    print(
        f"\n[no sidecar] reconnect=False failed after {took * 1000:.1f} ms (pool), "
        f"{took_blocking * 1000:.1f} ms (blocking); connect_timeout was 60 s"
    )
    assert took < 20 and took_blocking < 20  # was 60 s each: it does not wait at all now
    msg = str(e.value)
    assert "reconnect=False" in msg
    hint = msg.split("`")[1]
    assert "--dim DIM --metric METRIC" in hint and "DIM the length of your vectors" in msg, msg
    words = shlex.split(hint.replace("DIM", str(DIM)).replace("METRIC", "dot"))  # the placeholders, filled
    assert words[:4] == ["kalos", "serve", "--name", name] and "--ephemeral" in words, hint
    proc = start_sidecar_process(words[2:] + ["--backend", "numpy"], name)
    try:
        async with RecallPool(name, reconnect=False, connect_timeout=10) as pool:
            assert pool.layout.dim == DIM
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        cleanup(name, force=True)
    with pytest.raises(BrokerUnavailable, match=r"no sidecar served it within 0.3 s"):
        await RecallPool(unique_name("nosuch"), connect_timeout=0.3).open()


@pytest.mark.asyncio
async def test_a_pool_larger_than_the_sidecar_is_a_config_error(sidecar_factory):
    h = sidecar_factory("big", "--dim", str(DIM), "--slots", "4", "--backend", "numpy")
    with pytest.raises(ConfigError, match=r"size=5 asks for more slots than broker .* has \(4\).*--slots"):
        await RecallPool(h.name, size=5).open()
    assert slots_free(h.name)  # nothing was taken
    async with RecallPool(h.name, size=4, min_size=4) as pool:
        assert pool.statistics().size == 4


HOLDER = """
import asyncio, sys
from kalos.clients import RecallPool
async def main():
    async with RecallPool(sys.argv[1], size=4, min_size=4) as pool:
        print("holding", pool.statistics().size, flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_slots_held_by_another_process_are_slots_exhausted_not_an_outage(sidecar_factory):
    """Issue 22 item 10: with every slot leased by another process, opening raised
    BrokerUnavailable after 10 s "waiting for a sidecar". Now SlotsExhausted at once, naming the
    counts; once that process is killed, opening waits for the sidecar to reclaim its slots."""
    h = sidecar_factory("full", "--dim", str(DIM), "--slots", "4", "--backend", "numpy")
    holder = run_py(HOLDER, h.name)
    try:
        assert holder.stdout.readline().decode().split() == ["holding", "4"]
        t0 = time.monotonic()
        with pytest.raises(SlotsExhausted) as e:
            await RecallPool(h.name, size=2, connect_timeout=1).open()
        took = time.monotonic() - t0
        print(f"\n[slots exhausted] raised after {took * 1000:.1f} ms (connect_timeout 60 s)")
        assert took < 20
        assert not isinstance(e.value, BrokerUnavailable)
        msg = str(e.value)
        assert "has 4 slots: 4 leased by other pools" in msg and "0 free" in msg
        assert "--slots" in msg and "waited within 1 s for other pools to give slots back" in msg
        holder.kill()
        holder.wait()
        t0 = time.monotonic()
        async with RecallPool(h.name, size=2, min_size=2, connect_timeout=30) as pool:  # reaped, then leased
            print(f"[slots exhausted] opened {(time.monotonic() - t0) * 1000:.0f} ms after the holder was killed")
            assert pool.statistics().size == 2
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_blocking_client_keeps_its_budget_across_restarts(seed, tmp_path):
    """Issue 22 item 17: calls that fail during an outage end at their deadline, not a backoff
    later. Outages here outlast the budget, so calls fail; each failure's overrun is recorded.
    The exact guarantee (no pause past the deadline) is tests/unit/test_client_rules.py's; on a
    loaded 2-vCPU machine this only bounds it loosely and prints what it measured."""
    name = unique_name("budget")
    args = [
        "--ephemeral",
        "--dim",
        str(DIM),
        "--random-rows",
        "500",
        "--seed",
        str(seed),
        "--slots",
        "8",
        "--backend",
        "numpy",
    ]
    budget = 0.25
    proc = start_sidecar_process(args, name)
    overruns: list[float] = []
    oks = [0]
    stop = threading.Event()
    errors: list[str] = []

    def caller() -> None:
        q = np.ones(DIM, np.float32)
        with RecallClient(name, timeout=budget) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    c.recall(q, k=3)
                    oks[0] += 1
                except (BrokerUnavailable, KalosTimeout):  # the budget ran out, sidecar or not
                    overruns.append(time.monotonic() - t0 - budget)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.01)

    t = threading.Thread(target=caller)
    try:
        t.start()
        for _ in range(5):
            time.sleep(0.3)
            proc.kill()
            proc.wait()
            time.sleep(0.8)  # several budgets without a sidecar
            proc = start_sidecar_process(args, name)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
        proc.terminate()
        proc.wait()
        cleanup(name, force=True)
    over = np.array(overruns)
    print(
        f"\n[blocking budget] {oks[0]} ok, {len(over)} failed (BrokerUnavailable or a timeout); overrun past the "
        f"{budget} s budget: p50 {np.median(over) * 1000:.1f} ms, max {over.max() * 1000:.1f} ms"
    )
    assert not errors, errors[:5]
    assert len(over) >= 5 and oks[0] > 0
    # Loose on purpose (a loaded 2-vCPU machine stalled one call 0.56 s past its deadline): the
    # failure this catches is a retry that waits out its backoff or the 10 s connect budget.
    assert over.max() < 2.0


@pytest.mark.asyncio
async def test_one_vector_rule_in_both_clients(sidecar, rng):
    """Issue 22 item 15: a float64 vector is converted (answers match the float64 reference of
    its float32 value); a (1, dim) array for recall, a (dim,) vector for recall_many or upsert,
    and a value beyond float32 are refused, by the pool and the blocking client alike."""
    from conftest import assert_topk

    from kalos import InvalidRequest

    q64 = rng.standard_normal(32)
    q32 = q64.astype(np.float32)
    refused = [
        ("recall", (np.ones((1, 32)),), r"got \(1, 32\): use recall_many for several queries, or vec\[0\]"),
        ("recall_many", (np.ones(32),), r"got \(32,\): use recall for one vector, or vec\[None\]"),
        ("upsert", ([1], np.ones(32)), r"got \(32,\): pass vec\[None\] for one record"),
        ("recall", (np.full(32, 1e39),), "does not fit in float32"),
        ("upsert", ([1, 2], np.ones((2, 31))), "dimension mismatch"),
    ]
    async with RecallPool(sidecar.name, size=2) as pool:
        h = await pool.recall(q64, k=5)
        assert_topk(q32, sidecar.matrix, h.ids, h.scores, 5)
        many = await pool.recall_many(np.stack([q64, q64]).astype(np.float16), k=5)
        assert_topk(q64.astype(np.float16).astype(np.float32), sidecar.matrix, many[0].ids, many[0].scores, 5)
        for method, args, msg in refused:
            with pytest.raises(InvalidRequest, match=msg):
                await getattr(pool, method)(*args)
        assert pool.statistics().posted == 2  # nothing refused reached a slot
        with RecallClient(sidecar.name, timeout=10) as c:
            h = c.recall(q64, k=5)
            assert_topk(q32, sidecar.matrix, h.ids, h.scores, 5)
            for method, args, msg in refused:
                with pytest.raises(InvalidRequest, match=msg):
                    getattr(c, method)(*args)
            assert c.upsert([7], np.arange(32, dtype=np.int64)[None], namespace="ints") == 1
            got = c.get([7], namespace="ints")
            assert got.vectors is not None and got.vectors.dtype == np.float32
            np.testing.assert_array_equal(got.vectors[0], np.arange(32, dtype=np.float32))
