"""Memory over time with real sidecars and clients (issue 26): TTLs of a few hundred ms checked
against a model at every answer's time, restarts that keep timestamps and TTLs, recency-weighted
recall exact against float64, refresh on read, and bad time fields written into a slot by hand.

The model's clock tolerance: a write is stamped by the sidecar at some instant between the
client's ``time.time_ns()`` before and after the call (one host, one CLOCK_REALTIME), so a record
written with TTL t expires in [before + t, after + t]; a read says when it was served
(``served_at_ns``, the sidecar's clock). A record is *surely expired* at a read if even the latest
bound has passed, *surely alive* if not even the earliest has; only those are checked, and the
uncertain window is the call's own duration."""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import time
import urllib.request

import numpy as np
import pytest
from conftest import free_port, wait_until

from kalos import Recency
from kalos.broker.layout import Flag, Op, Status
from kalos.clients import RecallClient, RecallPool
from kalos.clients._transport import Connection

pytestmark = pytest.mark.timeout(120)
DIM = 8
NS = 1_000_000_000
IDS = 1000  # ids the TTL model writes (a recall of k = 1024 returns every live one)


def start(sidecar_factory, tag: str, *args: str, **kw):
    return sidecar_factory(
        tag,
        "--dim",
        str(DIM),
        "--backend",
        "numpy",
        "--slots",
        "8",
        "--max-k",
        "1024",  # (the CUDA backend's largest k: KALOS_TEST_BACKEND=cuda runs this suite too)
        "--max-queries",
        "64",
        "--blob-bytes",
        str(1 << 18),
        *args,
        **kw,
    )


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name}")


class Model:
    """What the client knows of each id: the bounds of its expiry (ns; None: never), or gone."""

    def __init__(self) -> None:
        self.exp: dict[int, tuple[int, int] | None] = {}  # id -> (earliest, latest) expiry, None: never
        self.uncertain: set[int] = set()  # a touch raced its expiry: not checked until rewritten
        self.checked_alive = 0
        self.checked_expired = 0

    def written(self, ids: list[int], t0: int, t1: int, ttl_s: float | None) -> None:
        for i in ids:
            self.uncertain.discard(i)
            self.exp[i] = None if ttl_s is None else (t0 + round(ttl_s * NS), t1 + round(ttl_s * NS))

    def touched(self, ids: list[int], t0: int, t1: int, ttl_s: float) -> None:
        for i in ids:
            b = self.exp.get(i, "gone")
            if b == "gone" or i in self.uncertain:
                continue
            if b is None or b[0] > t1:  # surely alive when touched: restarted
                self.exp[i] = (t0 + round(ttl_s * NS), t1 + round(ttl_s * NS))
            elif b[1] > t0:  # it may have expired before the touch: unknown from now on
                self.uncertain.add(i)

    def surely_expired(self, i: int, at: int) -> bool:
        b = self.exp.get(i, "gone")
        return b == "gone" or (b is not None and b[1] <= at and i not in self.uncertain)

    def surely_alive(self, i: int, at: int) -> bool:
        b = self.exp.get(i, "gone")
        return b != "gone" and i not in self.uncertain and (b is None or b[0] > at)

    def check_read(self, ids: list[int], at: int, complete: bool, asked: list[int] | None = None) -> None:
        """An answer served at ``at`` returned ``ids``: none surely expired; with ``complete``
        (every record, or every asked id that exists) none surely alive missing."""
        got = set(ids)
        for i in got:
            assert not self.surely_expired(i, at), (
                f"id {i} returned {(at - self.exp[i][1]) / 1e6:.3f} ms after it expired"
            )  # type: ignore[index]
            self.checked_alive += 1
        if complete:
            for i in self.exp if asked is None else asked:
                if self.surely_alive(i, at):
                    assert i in got, f"id {i} lost while alive"
                elif self.surely_expired(i, at):
                    self.checked_expired += 1


@pytest.mark.asyncio
async def test_no_expired_record_is_ever_returned_and_nothing_alive_is_lost(sidecar_factory, rng):
    """Thousands of random records with random TTLs (100-600 ms, or none) and touches, against a
    real sidecar whose sweeper deletes behind them: every recall, get and count is checked."""
    port = free_port()
    h = start(sidecar_factory, "ttlmodel", "--metrics-port", str(port))
    model = Model()
    vecs = rng.standard_normal((IDS, DIM)).astype(np.float32)
    # At least 4 s, and on until the floors checked below are met (a loaded machine serves fewer
    # calls a second; the floors keep the test's reach), within a guard against a hang.
    end = time.monotonic() + 4.0
    writes = reads = 0

    def more() -> bool:
        now = time.monotonic()
        short = writes <= 2000 or reads <= 200 or model.checked_expired <= 500
        return now < end or (short and now < end + 60.0)

    async with RecallPool(h.name, size=4) as pool:
        t0 = time.time_ns()
        await pool.upsert([0], vecs[:1], namespace="m", ttl=math.inf)  # (the namespace exists)
        model.written([0], t0, time.time_ns(), None)
        while more():
            op = rng.random()
            if op < 0.35:  # upsert a batch, with a TTL or none
                ids = rng.choice(IDS, int(rng.integers(1, 64)), replace=False).tolist()
                ttl = None if rng.random() < 0.2 else float(rng.uniform(0.1, 0.6))
                t0 = time.time_ns()
                await pool.upsert(ids, vecs[ids], namespace="m", ttl=math.inf if ttl is None else ttl)
                model.written(ids, t0, time.time_ns(), ttl)
                writes += len(ids)
            elif op < 0.5:  # touch some, with a new TTL
                ids = rng.choice(IDS, int(rng.integers(1, 32)), replace=False).tolist()
                ttl = float(rng.uniform(0.1, 0.6))
                t0 = time.time_ns()
                await pool.touch(ids, namespace="m", ttl=ttl)
                model.touched(ids, t0, time.time_ns(), ttl)
            elif op < 0.75:  # everything, through a recall of k above the records
                hits = await pool.recall(vecs[int(rng.integers(IDS))], 1024, namespace="m", with_times=True)
                assert hits.served_at_ns is not None
                model.check_read(hits.ids.tolist(), hits.served_at_ns, complete=True)
                for i, e in zip(hits.ids.tolist(), hits.expires_at.tolist()):  # the sidecar's own stamps
                    b = model.exp[i]
                    if i not in model.uncertain:
                        assert (e == math.inf) if b is None else (b[0] - 2000 <= e * 1e9 <= b[1] + 2000)
                reads += 1
            elif op < 0.9:
                asked = rng.choice(IDS, 64, replace=False).tolist()
                rec = await pool.get(asked, namespace="m", with_vectors=False)
                assert rec.served_at_ns is not None
                model.check_read(rec.ids.tolist(), rec.served_at_ns, complete=True, asked=asked)
                reads += 1
            else:  # count and namespaces() agree with what a recall can return
                t0 = time.time_ns()
                n = await pool.count("m")
                listed = (await pool.namespaces()).get("m", 0)
                t1 = time.time_ns()
                lo = sum(1 for i in model.exp if model.surely_alive(i, t1))
                hi = sum(1 for i in model.exp if not model.surely_expired(i, t0))
                assert lo <= n <= hi and lo <= listed <= hi, (lo, n, listed, hi)
            await asyncio.sleep(0)
        print(
            f"{writes} rows written, {reads} reads, {model.checked_alive} hits checked, "
            f"{model.checked_expired} surely expired records checked absent"
        )
        assert writes > 2000 and reads > 200 and model.checked_expired > 500
        # After the last TTL: only the records without one are left, and the sweeper deleted the
        # rest (its counter), rather than every read hiding them.
        await asyncio.sleep(0.9)
        forever = {i for i, b in model.exp.items() if b is None and i not in model.uncertain}
        maybe = forever | model.uncertain
        exported: set[int] = set()
        after = -1
        while True:  # (a page holds max_queries records)
            ids, _v, _p = await pool.export_page("m", after)
            if not len(ids):
                break
            exported |= set(ids.tolist())
            after = int(ids[-1])
        assert forever <= exported <= maybe
        assert len(forever) <= await pool.count("m") <= len(maybe)
        expired = metric(port, "kalos_records_expired_total")
        print(f"the sweeper deleted {expired:.0f} records")
        assert expired > 500


@pytest.mark.asyncio
async def test_restarts_keep_timestamps_ttls_and_default_ttls(sidecar_factory, tmp_path, rng):
    d = str(tmp_path / "data")
    h = start(sidecar_factory, "ttlrestart", "--data-dir", d, ephemeral=False)
    v = rng.standard_normal((6, DIM)).astype(np.float32)
    async with RecallPool(h.name, size=2) as pool:
        await pool.upsert([0, 1, 2], v[:3], namespace="r", ttl=60)
        await pool.upsert([3], v[3:4], namespace="r", ttl=1.0)
        await pool.upsert([4], v[4:5], namespace="r")  # never
        await pool.set_default_ttl("r", 120)
        await pool.upsert([0], v[:1], namespace="r")  # rewritten: created kept, default TTL
        assert await pool.touch([1], namespace="r", ttl=90) == 1
        before = await pool.get([0, 1, 2, 3, 4], namespace="r", with_vectors=False)
    assert before.missing.tolist() == []
    assert before.expires_at[4] == math.inf and before.created_at[0] < before.updated_at[0]
    np.testing.assert_allclose(before.expires_at[[0, 1]] - before.served_at_ns / NS, [120, 90], atol=2.0)
    h.stop()
    await asyncio.sleep(1.1)  # record 3 expires while the sidecar is down
    h2 = start(sidecar_factory, "ttlrestart", "--data-dir", d, name=h.name, ephemeral=False)
    async with RecallPool(h2.name, size=2) as pool:
        after = await pool.get([0, 1, 2, 3, 4], namespace="r", with_vectors=False)
        assert after.ids.tolist() == [0, 1, 2, 4] and after.missing.tolist() == [3]
        for f in ("created_at", "updated_at", "expires_at"):
            np.testing.assert_array_equal(getattr(after, f), getattr(before, f)[[0, 1, 2, 4]])
        assert await pool.count("r") == 4 and (await pool.namespaces())["r"] == 4
        await pool.upsert([5], v[5:6], namespace="r")  # the default TTL came back too
        got = await pool.get([5], namespace="r")
        assert got.expires_at[0] - got.updated_at[0] == pytest.approx(120, abs=1e-3)
        await asyncio.sleep(0.5)  # (a sweep or two)
    h2.stop()
    # The sweeper deleted record 3 durably: it is gone from the store itself.
    db = sqlite3.connect(os.path.join(d, "kalos.sqlite3"))
    try:
        assert sorted(i for (i,) in db.execute("SELECT id FROM records WHERE ns = 'r'")) == [0, 1, 2, 4, 5]
    finally:
        db.close()


def _reference_scores(vecs: np.ndarray, upd_s: np.ndarray, q: np.ndarray, now_ns: int, rec: Recency) -> np.ndarray:
    age = np.maximum(now_ns / NS - upd_s, 0.0)
    return vecs.astype(np.float64) @ q.astype(np.float64) + rec.weight * 0.5 ** (age / rec.half_life)


@pytest.mark.asyncio
async def test_recency_weighted_recall_is_exact_against_float64(sidecar_factory, rng):
    h = start(sidecar_factory, "recency")
    n = 1200
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    colour = rng.integers(0, 3, n)
    async with RecallPool(h.name, size=4) as pool:
        for lo in range(0, n, 200):  # written in waves: ages differ by tens of ms
            await pool.upsert(
                np.arange(lo, lo + 200),
                vecs[lo : lo + 200],
                [{"c": int(c)} for c in colour[lo : lo + 200]],
                namespace="w",
                ttl=[None if i % 7 else 0.05 for i in range(lo, lo + 200)],  # some expire soon
            )
            await asyncio.sleep(0.03)
        await asyncio.sleep(0.06)  # the 0.05 s ones have expired (swept or not)
        rec_all = await pool.get(np.arange(n), namespace="w", with_vectors=False)
        alive = rec_all.ids
        upd = np.full(n, np.nan)
        upd[alive] = rec_all.updated_at
        for recency in (Recency(0.05, 2.0), Recency(1.0, 0.3), Recency(10.0, -1.0)):
            qs = rng.standard_normal((5, DIM)).astype(np.float32)
            for where in (None, {"c": {"$in": [0, 2]}}):
                allowed = alive if where is None else alive[np.isin(colour[alive], [0, 2])]
                many = await pool.recall_many(qs, 25, namespace="w", recency=recency, where=where)
                one = await pool.recall(qs[0], 7, namespace="w", recency=recency, where=where, with_payload=True)
                for q, hits in [*zip(qs, many), (qs[0], one)]:
                    ref = _reference_scores(vecs, upd, q, hits.served_at_ns, recency)
                    r = ref[allowed]
                    kk = min(len(hits.ids), len(allowed))
                    assert kk == len(hits.ids) and set(hits.ids.tolist()) <= set(allowed.tolist())
                    tol = 1e-5 * (np.abs(r).max() + 1.0)
                    kth = np.sort(r)[::-1][kk - 1]
                    assert (ref[hits.ids] >= kth - tol).all(), "a record outside the true top-k"
                    np.testing.assert_allclose(hits.scores, ref[hits.ids], rtol=1e-4, atol=tol)
                    # the two parts: similarity = q.x, recency = the decayed weight
                    np.testing.assert_allclose(hits.similarity, vecs[hits.ids] @ q, rtol=1e-4, atol=tol)
                    np.testing.assert_allclose(
                        hits.recency, ref[hits.ids] - vecs[hits.ids].astype(np.float64) @ q, atol=tol
                    )
                assert one.payloads == [{"c": int(colour[i])} for i in one.ids]
        # A plain recall of the same namespace ranks by similarity alone.
        plain = await pool.recall(qs[0], 10, namespace="w")
        sims = vecs[alive] @ qs[0]
        assert plain.ids[0] == alive[np.argmax(sims)]


@pytest.mark.asyncio
async def test_refresh_on_read_restarts_the_expiry_durably(sidecar_factory, tmp_path, rng):
    h = start(sidecar_factory, "refresh", "--data-dir", str(tmp_path / "d"), ephemeral=False)
    v = rng.standard_normal((4, DIM))
    v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)  # unit rows: v[0] is its own best
    async with RecallPool(h.name, size=2) as pool:
        # Seconds, not tenths: every step below must land inside its window on a loaded machine.
        await pool.upsert([0, 1, 2, 3], v, namespace="f", ttl=3.0)
        first = await pool.get([0, 1, 2, 3], namespace="f")
        await asyncio.sleep(1.0)
        hits = await pool.recall(v[0], 1, namespace="f", refresh_ttl=True, with_times=True)
        assert hits.ids.tolist() == [0]
        got = await pool.get([1], namespace="f", refresh_ttl=True)
        assert got.ids.tolist() == [1]
        again = await pool.get([0, 1, 2, 3], namespace="f")
        assert (again.expires_at[:2] - first.expires_at[:2] > 0.9).all()  # restarted >= 1 s later
        assert (again.expires_at[2:] == first.expires_at[2:]).all()
        assert (again.updated_at == first.updated_at).all()  # a touch is no write of the record
        # 2 and 3 expired; 0 and 1 not for another second (the sidecar's clock is this host's)
        await asyncio.sleep(max(0.0, float(first.expires_at[2:].max()) + 0.2 - time.time()))
        assert (await pool.get([0, 1, 2, 3], namespace="f")).ids.tolist() == [0, 1]
        assert await pool.count("f") == 2


def _raw(c: Connection, slot, op: int, ns: bytes, *, nq: int = 1, k: int = 1, flags: int = 0, **ctl) -> tuple[int, str]:
    """A request written by hand (no client-side checks): (status, detail)."""
    slot.view.ids[:nq] = np.arange(nq)
    slot.view.queries[:nq] = 1.0
    for name, value in ctl.items():
        slot.view.ctl[name] = value
    slot.post(op, ns, k, nq, flags, 0, 0)
    assert wait_until(lambda: slot.is_done() and slot.try_consume(), 10)
    status, _n, blen = slot.outcome()
    detail = slot.blob_text(blen).decode(errors="replace")
    slot.set_free()
    return status, detail


def test_time_fields_written_by_hand_get_a_status_and_the_sidecar_serves_on(sidecar_factory, rng):
    h = start(sidecar_factory, "rawtime")
    with RecallClient(h.name) as client:
        client.upsert([0, 1], rng.standard_normal((2, DIM)), namespace="x")
        c = Connection(h.name)
        slot = c.lease(1)[0]
        try:
            for op, flags, ctl, want in (
                (Op.UPSERT, Flag.TTL, dict(ttl_ns=-1), "ttl_ns=-1"),
                (Op.TOUCH, Flag.TTL, dict(ttl_ns=-(2**62)), "ttl_ns="),
                (Op.SET_TTL, 0, dict(ttl_ns=-3), "ttl_ns=-3"),
                (Op.RECALL, Flag.RECENCY, dict(half_life_s=math.nan, recency_weight=1.0), "half_life_s"),
                (
                    Op.RECALL,
                    Flag.RECENCY | Flag.WITH_PAYLOAD,
                    dict(half_life_s=1.0, recency_weight=-math.inf),
                    "recency_weight",
                ),
            ):
                status, detail = _raw(c, slot, int(op), b"x", flags=int(flags), **ctl)
                assert status == Status.BAD_REQUEST and want in detail, (op, detail)
            # A well-formed one by hand: a recency recall answers its timestamps in the blob.
            status, _d = _raw(
                c, slot, int(Op.RECALL), b"x", k=2, flags=int(Flag.RECENCY), half_life_s=5.0, recency_weight=1.0
            )
            assert status == Status.OK and int(slot.view.ctl["n_results"]) == 2
            assert int(slot.view.ctl["blob_len"]) == 64 and int(slot.view.ctl["now_ns"]) > 0
        finally:
            c.give_back([slot], [])
            c.close()
        assert h.proc.poll() is None
        assert client.count("x") == 2


def test_the_integrations_doc_snippet_runs_as_written(sidecar_factory):
    """docs/integrations.md, "Memory over time": its Python block against a real sidecar started
    as the doc's `kalos serve` line says (dim 8, cosine); only the broker's name changes."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    section = doc.split("## Memory over time", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    assert code.count('RecallClient("docs-check")') == 1
    h = sidecar_factory("docsnip", "--dim", "8", "--metric", "cosine", "--backend", "numpy")
    run = code.replace('RecallClient("docs-check")', f'RecallClient("{h.name}")')
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    first = lines[0].split(" ", 4)  # id, score, similarity, recency, text: the query's own note first
    assert first[0] == "1" and float(first[1]) == pytest.approx(float(first[2]) + float(first[3]), abs=2e-3)
    assert 0.19 < float(first[3]) <= 0.2 and first[4] == "asked about tea"
