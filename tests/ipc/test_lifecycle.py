"""Memory lifecycle: namespaces, ids, payloads, writes while serving, durability, crash recovery."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_topk, wait_until

from kalos.broker.errors import InvalidRequest, PayloadTooLarge
from kalos.clients import RecallClient, RecallPool

pytestmark = pytest.mark.timeout(240)


def dump(name: str, namespace: str) -> dict[int, tuple[np.ndarray, object]]:
    """Every record of a namespace, read back through the broker."""
    out: dict[int, tuple[np.ndarray, object]] = {}
    with RecallClient(name, timeout=10) as c:
        after = -1
        while True:
            # (a namespace nothing was ever acknowledged in, e.g. killed during a CUDA sidecar's
            # first, compiling write, exports as empty)
            ids, vecs, pls = c.export_page(namespace, after)
            if not len(ids):
                return out
            for i, v, p in zip(ids.tolist(), vecs, pls):
                assert i not in out
                out[i] = (v, p)
            after = int(ids[-1])


# --------------------------------------------------------------------------- API semantics


@pytest.mark.asyncio
async def test_upsert_recall_with_payload_delete_drop(sidecar_factory, rng):
    h = sidecar_factory(
        "api",
        "--dim",
        "8",
        "--backend",
        "numpy",
        "--max-queries",
        "4",
        "--blob-bytes",
        "4096",
        "--payload-limit",
        "512",
    )
    async with RecallPool(h.name, size=4) as pool:
        vecs = rng.standard_normal((10, 8)).astype(np.float32)
        ids = np.arange(100, 110)
        pls = [{"text": f"memory {i}", "source": "chat", "n": i} for i in range(10)]
        assert await pool.upsert(ids, vecs, payloads=pls, namespace="user-7") == 10
        assert await pool.namespaces() == {"user-7": 10}  # only what was written: no empty "default"
        hits = await pool.recall(vecs[3], k=4, namespace="user-7", with_payload=True)
        assert_topk(vecs[3], vecs, hits.ids - 100, hits.scores, 4)
        for hit in hits:
            assert hit.payload == pls[hit.id - 100]
        # Upsert replaces the record (vector and payload together); duplicates: the last wins.
        new = rng.standard_normal((3, 8)).astype(np.float32)
        await pool.upsert([105, 105, 106], new, payloads=[{"v": 1}, {"v": 2}, None], namespace="user-7")
        vecs[5], vecs[6] = new[1], new[2]
        got = dump(h.name, "user-7")
        np.testing.assert_array_equal(got[105][0], new[1])
        assert got[105][1] == {"v": 2} and got[106][1] is None
        # Delete: returns how many existed; deleted ids never come back.
        assert await pool.delete([100, 101, 999], namespace="user-7") == 2
        for q in vecs:
            hits = await pool.recall(q, k=10, namespace="user-7")
            assert not {100, 101} & set(hits.ids.tolist()) and len(hits) == 8
        assert await pool.delete([5], namespace="nobody") == 0
        assert len(await pool.recall(vecs[0], namespace="nobody")) == 0  # never written: no hits
        with pytest.raises(PayloadTooLarge):
            await pool.upsert([1], vecs[:1], payloads=[{"t": "x" * 600}], namespace="user-7")
        with pytest.raises(PayloadTooLarge):  # the whole request does not fit the slot
            await pool.upsert([1, 2, 3, 4], vecs[:4], payloads=[{"t": "x" * 1500}] * 4, namespace="user-7")
        with pytest.raises(InvalidRequest):
            await pool.upsert([1, 2], vecs[:3], namespace="user-7")
        with pytest.raises(InvalidRequest):
            await pool.upsert([-1], vecs[:1], namespace="user-7")
        with pytest.raises(InvalidRequest):
            await pool.upsert([1], np.full((1, 8), np.nan), namespace="user-7")
        with pytest.raises(InvalidRequest):
            await pool.upsert([1], vecs[:1], payloads=[{1, 2}], namespace="user-7")
        assert await pool.drop_namespace("user-7") == 8
        assert await pool.namespaces() == {}
        hits = await pool.recall(vecs[0], namespace="user-7", with_payload=True)  # dropped: as never written
        assert len(hits) == 0 and hits.payloads == []
        assert await pool.drop_namespace("user-7") == 0


@pytest.mark.asyncio
async def test_namespace_isolation_with_concurrent_writers(sidecar_factory, rng):
    h = sidecar_factory("iso", "--dim", "16", "--backend", "numpy", "--slots", "32")
    data = {ns: rng.standard_normal((300, 16)).astype(np.float32) for ns in ("a", "b", "c")}
    async with RecallPool(h.name, size=24) as pool:

        async def writer(ns: str) -> None:
            for lo in range(0, 300, 25):
                await pool.upsert(np.arange(lo, lo + 25), data[ns][lo : lo + 25], namespace=ns)

        async def reader(ns: str) -> None:
            for _ in range(40):
                q = rng.standard_normal(16).astype(np.float32)
                hits = await pool.recall(q, k=5, namespace=ns)  # (no hits before the first write)
                for i, s in zip(hits.ids.tolist(), hits.scores.tolist()):
                    assert abs(float(data[ns][i] @ q) - s) < 1e-3, "a hit from another namespace"

        await asyncio.gather(*(writer(ns) for ns in data), *(reader(ns) for ns in data for _ in range(3)))
        for ns, m in data.items():
            q = rng.standard_normal(16).astype(np.float32)
            hits = await pool.recall(q, k=10, namespace=ns)
            assert_topk(q, m, hits.ids, hits.scores, 10)


@pytest.mark.asyncio
@pytest.mark.parametrize("pipeline", ["auto", "on"])
async def test_read_your_writes_under_concurrency(sidecar_factory, rng, pipeline):
    h = sidecar_factory(
        "ryw",
        "--dim",
        "16",
        "--backend",
        "numpy",
        "--metric",
        "cosine",
        "--random-rows",
        "2000",
        "--slots",
        "32",
        "--pipeline",
        pipeline,
    )
    async with RecallPool(h.name, size=24) as pool:

        async def agent(j: int) -> None:
            for t in range(10):
                i = 10_000 + j * 100 + t
                v = rng.standard_normal(16).astype(np.float32)
                await pool.upsert([i], v[None])
                hits = await pool.recall(v, k=1)  # cosine: the vector itself is the best match
                assert hits.ids.tolist() == [i]
                assert await pool.delete([i]) == 1
                hits = await pool.recall(v, k=5)
                assert i not in hits.ids.tolist()

        await asyncio.gather(*(agent(j) for j in range(16)))


@pytest.mark.asyncio
@pytest.mark.parametrize("pipeline", ["auto", "on"])
async def test_compaction_under_load_never_loses_stable_rows(sidecar_factory, rng, pipeline):
    """Stable records are never touched; churn records (fixed vector per id) are inserted and
    deleted all the time, so rows move constantly. Every answer must contain every stable record
    that beats its k-th score, and every id must carry its own vector's score. With ``--pipeline
    on`` recall batches are left in flight and every write batch must finish them first."""
    h = sidecar_factory(
        "compact", "--dim", "12", "--backend", "numpy", "--slots", "32", "--max-queries", "32", "--pipeline", pipeline
    )
    stable = rng.standard_normal((500, 12)).astype(np.float32)
    churn = rng.standard_normal((500, 12)).astype(np.float32)  # id 1000 + j
    async with RecallPool(h.name, size=24) as pool:
        await pool.upsert(np.arange(500), stable)
        stop = asyncio.Event()
        checked = 0

        async def churner() -> None:
            live: set[int] = set()
            while not stop.is_set():
                ids = rng.choice(500, size=16, replace=False)
                await pool.upsert(1000 + ids, churn[ids])
                live |= set(ids.tolist())
                dead = rng.choice(sorted(live), size=min(len(live), 12), replace=False)
                await pool.delete(1000 + dead)
                live -= set(dead.tolist())

        async def reader() -> None:
            nonlocal checked
            for _ in range(60):
                q = rng.standard_normal(12).astype(np.float32)
                hits = await pool.recall(q, k=20)
                true = np.array([(stable[i] if i < 1000 else churn[i - 1000]) @ q for i in hits.ids])
                np.testing.assert_allclose(hits.scores, true, rtol=1e-4, atol=1e-4)
                kth = hits.scores[-1]
                must = set(np.flatnonzero(stable @ q > kth + 1e-4).tolist())
                assert must <= set(hits.ids.tolist()), "a stable row went missing during compaction"
                checked += 1

        writers = [asyncio.ensure_future(churner()) for _ in range(2)]
        await asyncio.gather(*(reader() for _ in range(6)))
        stop.set()
        await asyncio.gather(*writers)
        assert checked == 360


# --------------------------------------------------------------------------- durability


def test_restart_keeps_exactly_the_acknowledged_memories(sidecar_factory, tmp_path, rng):
    d = str(tmp_path / "data")
    h = sidecar_factory("dur", "--dim", "8", "--backend", "numpy", "--data-dir", d, ephemeral=False)
    vecs = rng.standard_normal((50, 8)).astype(np.float32)
    with RecallClient(h.name) as c:
        c.upsert(np.arange(50), vecs, payloads=[{"i": i} for i in range(50)], namespace="n1")
        c.upsert([7], vecs[:1] * 2, payloads=[{"i": "seven"}], namespace="n2")
        c.delete(np.arange(10, 20), namespace="n1")
        c.upsert([3], vecs[4:5], payloads=None, namespace="n1")
        c.upsert([1], vecs[:1], namespace="gone")
        c.drop_namespace("gone")
        before = {ns: dump(h.name, ns) for ns in ("n1", "n2")}
    assert h.stop() == 0
    h2 = sidecar_factory("dur2", "--dim", "8", "--backend", "numpy", "--data-dir", d, name=h.name, ephemeral=False)
    with RecallClient(h2.name) as c:
        assert c.namespaces() == {"n1": 40, "n2": 1}
    for ns in ("n1", "n2"):
        after = dump(h2.name, ns)
        assert after.keys() == before[ns].keys()
        for i in after:
            np.testing.assert_array_equal(after[i][0], before[ns][i][0])
            assert after[i][1] == before[ns][i][1]
    assert dump(h2.name, "n1")[3][1] is None


WRITER = r"""
import os, sys, numpy as np
from kalos.clients import RecallClient
from kalos.broker.errors import BrokerUnavailable, KalosError
name, lo, hi, seed, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
def say(line): os.write(fd, (line + "\n").encode())
def vec(i, ver): return np.random.default_rng((i, ver)).standard_normal(8).astype(np.float32)
rng = np.random.default_rng(seed)
try:
    c = RecallClient(name, timeout=5)
except KalosError:
    sys.exit(0)
ver = int(seed) * 1000
while True:
    ver += 1
    ids = sorted(set(rng.integers(lo, hi, size=int(rng.integers(1, 6))).tolist()))
    op = "U" if rng.random() < 0.65 else "D"
    say(f"P {op} {ver} " + " ".join(map(str, ids)))
    try:
        if op == "U":
            c.upsert(ids, np.stack([vec(i, ver) for i in ids]), payloads=[{"id": i, "ver": ver} for i in ids],
                     namespace="crash")
        else:
            c.delete(ids, namespace="crash")
    except KalosError:
        sys.exit(0)
    say(f"A {op} {ver} " + " ".join(map(str, ids)))
"""


def _vec(i: int, ver: int) -> np.ndarray:
    return np.random.default_rng((i, ver)).standard_normal(8).astype(np.float32)


def _acked(logs: list[str]) -> int:
    """Writes the writers have logged as acknowledged so far (complete lines only)."""
    n = 0
    for log in logs:
        try:
            with open(log, "rb") as f:
                lines = f.read().split(b"\n")[:-1]
        except FileNotFoundError:
            continue
        n += sum(1 for line in lines if line.startswith(b"A "))
    return n


@pytest.mark.slow
def test_kill9_during_writes_loses_nothing_acknowledged(sidecar_factory, tmp_path, seed):
    """Several writer processes stream upserts and deletes; the sidecar is killed at random moments
    (after a random number of acknowledged writes, so that a slow machine does not shrink the
    test) and restarted. Every acknowledged write must be there, every acknowledged delete
    absent, and nothing half-written (a record's vector and payload always belong to the same
    write)."""
    d = str(tmp_path / "data")
    r = random.Random(seed)
    model: dict[int, int] = {}  # id -> version present (absent ids are not in the dict)
    acked = in_flight_at_crash = 0
    name = None
    writers_n = 3
    for rnd in range(5):
        h = sidecar_factory(
            f"crash{rnd}",
            "--dim",
            "8",
            "--backend",
            "numpy",
            "--data-dir",
            d,
            "--slots",
            "8",
            "--max-queries",
            "8",
            name=name,
            ephemeral=False,
        )
        name = h.name
        logs = [str(tmp_path / f"w{rnd}-{j}.log") for j in range(writers_n)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WRITER,
                    name,
                    str(j * 100),
                    str(j * 100 + 40),
                    str(rnd * 10 + j + 1 + seed % 1000),
                    logs[j],
                ]
            )
            for j in range(writers_n)
        ]
        target = r.randint(12, 60)
        assert wait_until(lambda: _acked(logs) >= target or all(p.poll() is not None for p in procs), 120), (
            f"round {rnd}: {_acked(logs)} of {target} writes acknowledged"
        )
        time.sleep(r.random() * 0.02)  # somewhere inside the next writes
        h.kill9()
        for p in procs:
            p.wait(timeout=60)
        # Allowed states per id: the last acknowledged one, or the one in flight at the crash.
        allowed: dict[int, set[int | None]] = {}
        for log in logs:
            lines = open(log).read().splitlines() if os.path.exists(log) else []
            pending = None
            for line in lines:
                kind, op, ver, *ids = line.split()
                ver_i = int(ver)
                if kind == "P":
                    pending = (op, ver_i, [int(x) for x in ids])
                    continue
                acked += 1
                for i in map(int, ids):
                    if op == "U":
                        model[i] = ver_i
                    else:
                        model.pop(i, None)
                pending = None
            if pending is not None:
                in_flight_at_crash += 1
                op, ver_i, ids = pending
                for i in ids:
                    allowed.setdefault(i, set()).add(ver_i if op == "U" else None)
        h2 = sidecar_factory(
            f"check{rnd}",
            "--dim",
            "8",
            "--backend",
            "numpy",
            "--data-dir",
            d,
            "--slots",
            "8",
            "--max-queries",
            "8",
            name=name,
            ephemeral=False,
        )
        got = dump(name, "crash") if os.path.exists(d) else {}
        ids_all = set(model) | set(allowed) | set(got)
        for i in ids_all:
            ok = {model.get(i)} | allowed.get(i, set())
            if i in got:
                v, p = got[i]
                assert p["id"] == i, "payload of another record"
                np.testing.assert_array_equal(v, _vec(i, p["ver"]), err_msg="vector and payload disagree")
                assert p["ver"] in ok, f"id {i}: version {p['ver']} not allowed {ok}"
                model[i] = p["ver"]
            else:
                assert None in ok, f"id {i}: acknowledged write lost (expected version {model.get(i)})"
                model.pop(i, None)
        h2.stop()
    print(f"{acked} writes acknowledged, {in_flight_at_crash} in flight at a crash, {len(model)} ids live")
    assert acked >= 5 * 12 and model, "the writers stopped before the sidecar was killed"


def test_corrupt_or_mismatched_store_is_refused_and_left_untouched(tmp_path, sidecar_factory):
    from kalos.sidecar_cuda.storage.sqlite import DB_FILE

    d = tmp_path / "data"
    h = sidecar_factory("st", "--dim", "8", "--backend", "numpy", "--data-dir", str(d), ephemeral=False)
    with RecallClient(h.name) as c:
        c.upsert([1, 2], np.ones((2, 8), np.float32), namespace="x")
    h.stop()
    db = d / DB_FILE
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    from kalos.cli import main as kalos

    env_name = f"st-{os.getpid()}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kalos.sidecar_cuda",
            "--name",
            env_name,
            "--dim",
            "16",
            "--data-dir",
            str(d),
            "--backend",
            "numpy",
        ],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode != 0 and b"dim=8" in r.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    raw = bytearray(db.read_bytes())
    raw[100:4096] = os.urandom(4096 - 100)
    db.write_bytes(bytes(raw))
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kalos.sidecar_cuda",
            "--name",
            env_name,
            "--dim",
            "8",
            "--data-dir",
            str(d),
            "--backend",
            "numpy",
        ],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode != 0 and b"nothing was changed" in r.stderr, r.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    del kalos


def test_export_import_round_trip(sidecar_factory, tmp_path, rng):
    from kalos.cli import main as kalos

    h = sidecar_factory("xfer", "--dim", "8", "--backend", "numpy", "--slots", "20", "--max-queries", "16")
    n = 3000
    vecs = rng.standard_normal((n, 8)).astype(np.float32)
    ids = rng.choice(10**9, size=n, replace=False).astype(np.int64)
    pls = [{"k": int(i)} if i % 3 else None for i in ids]
    with RecallClient(h.name) as c:
        c.upsert(ids, vecs, payloads=pls, namespace="src")
    out = str(tmp_path / "exp")
    assert kalos(["export", "src", out, "--name", h.name]) == 0
    assert kalos(["import", "dst", out, "--name", h.name]) == 0
    a, b = dump(h.name, "src"), dump(h.name, "dst")
    assert a.keys() == b.keys() == set(ids.tolist())
    by_id = dict(zip(ids.tolist(), zip(vecs, pls)))
    for i in a:
        np.testing.assert_array_equal(b[i][0], by_id[i][0])
        assert b[i][1] == by_id[i][1] == a[i][1]


def test_cli_lists_namespaces(sidecar_factory, capsys):
    from kalos.cli import main as kalos

    h = sidecar_factory("cli", "--dim", "4", "--backend", "numpy")
    with RecallClient(h.name) as c:
        c.upsert([1, 2, 3], np.eye(3, 4, dtype=np.float32), namespace="agent-42")
    assert kalos(["namespaces", "--name", h.name]) == 0
    out = capsys.readouterr().out.split("\n")
    assert [line for line in out if line] == ["agent-42\t3"]  # (no empty "default" nobody wrote)
