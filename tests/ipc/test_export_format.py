"""``kalos export`` / ``kalos import``, format 2: timestamps and TTLs round-trip, files are 0600,
``--all`` takes every namespace, exports of the first format still import, and the data-dir
path (the sidecar stopped) keeps every timestamp exactly (kalos.transfer)."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import unique_name

from kalos.clients import RecallClient
from kalos.testing.sidecar import running_sidecar
from kalos.transfer import FORMAT_VERSION, STAMPS_DTYPE, TTL_UNKNOWN

pytestmark = pytest.mark.timeout(180)
KALOS = [sys.executable, "-m", "kalos.cli"]
DIM = 8
HOUR = 3600.0


def kalos(*args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALOS_") or k == "KALOS_REQUIRE_COMPILED"}

    def pre() -> None:
        if umask is not None:
            os.umask(umask)

    return subprocess.run([*KALOS, *args], capture_output=True, text=True, timeout=120, env=env, preexec_fn=pre)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    return r.stdout


def fill(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Namespaces with records that expire, that never do, of a default TTL, and payloads."""
    vecs = {ns: rng.standard_normal((40, DIM), dtype=np.float32) for ns in ("a", "b", "c:d@e")}
    with RecallClient(name, timeout=30) as c:
        c.set_default_ttl("b", 2 * HOUR)
        for ns, v in vecs.items():
            ids = np.arange(100, 140)
            ttls = [None if i % 3 == 0 else HOUR * (1 + i % 5) if i % 3 == 1 else math.inf for i in range(40)]
            c.upsert(ids[:20], v[:20], [{"i": int(i)} for i in ids[:20]], namespace=ns, ttl=ttls[:20])
            time.sleep(0.01)  # two writes, two stamps
            c.upsert(ids[20:], v[20:], None, namespace=ns, ttl=ttls[20:])
            c.touch(ids[:5], namespace=ns)  # expires_at moves, updated_at does not
    return vecs


def records(name: str, ns: str) -> dict[int, tuple[list[float], object, float, float, float]]:
    with RecallClient(name, timeout=30) as c:
        r = c.get(np.arange(100, 140), namespace=ns)
    assert r.created_at is not None and r.updated_at is not None and r.expires_at is not None
    return {
        int(i): (r.vectors[k].tolist(), r.payloads[k], r.created_at[k], r.updated_at[k], r.expires_at[k])
        for k, i in enumerate(r.ids.tolist())
    }


def store_rows(data_dir: Path) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    db = sqlite3.connect(data_dir / "kalos.sqlite3")
    try:
        rows = db.execute(
            "SELECT ns, id, vec, payload, created_at, updated_at, expires_at, ttl FROM records ORDER BY ns, id"
        ).fetchall()
        defaults = db.execute("SELECT ns, default_ttl FROM namespaces WHERE default_ttl != 0 ORDER BY ns").fetchall()
    finally:
        db.close()
    return rows, defaults


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


def test_an_export_through_the_sidecar_keeps_timestamps_and_ttls_and_is_private(
    sidecar_factory, tmp_path: Path, rng: np.random.Generator
) -> None:
    h = sidecar_factory("fmt", "--dim", str(DIM), "--metric", "cosine", "--backend", "numpy")
    fill(h.name, rng)
    before = records(h.name, "a")
    out = tmp_path / "exp"
    ok(kalos("export", "a", str(out), "--name", h.name, umask=0))  # a umask of 0 changes nothing
    assert modes(out) == {
        ".": 0o700,
        "manifest.json": 0o600,
        "ids.npy": 0o600,
        "vectors.npy": 0o600,
        "payloads.jsonl": 0o600,
        "stamps.npy": 0o600,
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "kalos-export" and manifest["version"] == FORMAT_VERSION == 2
    assert manifest["dim"] == DIM and manifest["metric"] == "cosine"
    assert manifest["namespaces"] == [{"name": "a", "dir": ".", "records": 40, "default_ttl_ns": None}]
    stamps = np.load(out / "stamps.npy")
    ids = np.load(out / "ids.npy")
    assert stamps.dtype == STAMPS_DTYPE and len(stamps) == 40
    precision = manifest["stamps_precision_ns"] / 1e9
    for k, i in enumerate(ids.tolist()):
        _v, _p, created, updated, expires = before[i]
        assert abs(stamps["created_at_ns"][k] / 1e9 - created) <= precision
        assert abs(stamps["updated_at_ns"][k] / 1e9 - updated) <= precision
        if math.isinf(expires):
            assert stamps["expires_at_ns"][k] == 0
        else:
            assert abs(stamps["expires_at_ns"][k] / 1e9 - expires) <= precision
    assert (stamps["ttl_ns"] == TTL_UNKNOWN).all()  # not readable through the protocol

    # Imported through the sidecar: the same expiry; the sidecar stamps the writes itself.
    t0 = time.time()
    text = ok(kalos("import", "copy", str(out), "--name", h.name))
    t1 = time.time()
    assert "imported 40 records into 'copy'" in text and "keeps its expires_at" in text, text
    after = records(h.name, "copy")
    assert after.keys() == before.keys()
    for i, (vec, payload, created, updated, expires) in after.items():
        np.testing.assert_allclose(vec, before[i][0], rtol=1e-6)  # (cosine normalizes again)
        assert payload == before[i][1]
        assert t0 <= created == updated <= t1
        if math.isinf(before[i][4]):
            assert math.isinf(expires)
        else:  # what was left, rounded up to the millisecond, from the moment of the import
            assert before[i][4] - 0.001 <= expires <= before[i][4] + (t1 - t0) + 0.002, (i, expires, before[i][4])


def test_all_namespaces_round_trip_through_the_data_dir_exactly(tmp_path: Path, rng: np.random.Generator) -> None:
    name = unique_name("fmtdir")
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "all"
    args = ["--dim", str(DIM), "--metric", "l2", "--backend", "numpy"]
    with running_sidecar(["--data-dir", str(src), *args], name):
        fill(name, rng)
        # The sidecar holds the data dir: the direct path is refused, naming it.
        r = kalos("export", "--all", str(out), "--data-dir", str(src))
        assert r.returncode == 2 and f"data dir {src} is in use by the sidecar of broker {name!r}" in r.stderr
        assert "leave out --data-dir to go through the running sidecar" in r.stderr, r.stderr
        assert not out.exists()

    text = ok(kalos("export", "--all", str(out), "--data-dir", str(src)))
    assert "exported 3 namespaces, 120 records" in text, text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stamps_precision_ns"] == 1 and manifest["metric"] == "l2"
    assert [(e["name"], e["dir"], e["records"]) for e in manifest["namespaces"]] == [
        ("a", "0000-a", 40),
        ("b", "0001-b", 40),
        ("c:d@e", "0002-c:d@e", 40),
    ]
    assert [e["default_ttl_ns"] for e in manifest["namespaces"]] == [0, int(2 * HOUR * 1e9), 0]
    assert set(modes(out).values()) <= {0o600, 0o700}

    # Into a new data dir (made with the export's dim and metric): the store rows are the same rows.
    text = ok(kalos("import", str(out), "--data-dir", str(dst)))
    assert "imported 40 records into 'c:d@e' of data dir" in text and "keeps its expires_at" not in text, text
    assert store_rows(dst) == store_rows(src)
    assert modes(dst)["kalos.sqlite3"] == 0o600

    # ... and a sidecar on it serves them with those timestamps.
    with running_sidecar(["--data-dir", str(dst), *args], name):
        with RecallClient(name, timeout=30) as c:
            assert c.metric == "l2" and c.count("b") == 40

    # Through a sidecar, --all imports each namespace into its own name, default TTLs too.
    with running_sidecar(["--ephemeral", *args], name):
        text = ok(kalos("import", str(out), "--name", name))
        with RecallClient(name, timeout=30) as c:
            assert {ns: c.count(ns) for ns in ("a", "b", "c:d@e")} == {"a": 40, "b": 40, "c:d@e": 40}
            c.upsert([1], np.ones((1, DIM), np.float32), namespace="b")  # no ttl=: b's default
            (exp,) = c.get([1], namespace="b").expires_at  # type: ignore[misc]
            assert abs(exp - time.time() - 2 * HOUR) < 60
        r = kalos("import", "one", str(out), "--name", name)
        assert r.returncode == 2 and "holds 3 namespaces" in r.stderr, r.stderr


def test_records_expired_since_the_export_are_left_out(tmp_path: Path) -> None:
    name = unique_name("fmtexp")
    data = tmp_path / "d"
    with running_sidecar(["--data-dir", str(data), "--dim", str(DIM), "--backend", "numpy"], name):
        with RecallClient(name, timeout=30) as c:
            c.upsert([1, 2], np.ones((2, DIM), np.float32), namespace="n", ttl=[1.0, math.inf])
        ok(kalos("export", "n", str(tmp_path / "e"), "--name", name))
        time.sleep(1.2)
        text = ok(kalos("import", "m", str(tmp_path / "e"), "--name", name))
        assert "imported 1 records into 'm'" in text and "left out 1 records that have expired" in text, text
    text = ok(kalos("import", "k", str(tmp_path / "e"), "--data-dir", str(data)))
    assert "imported 1 records into 'k'" in text and "left out 1 records" in text, text


def test_exports_of_the_first_format_still_import(sidecar_factory, tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.mkdir()
    np.save(v1 / "vectors.npy", np.eye(3, DIM, dtype=np.float32))
    np.save(v1 / "ids.npy", np.array([7, 8, 9], np.int64))
    (v1 / "payloads.jsonl").write_text('{"x": 1}\nnull\n[2]\n')
    h = sidecar_factory("fmtv1", "--dim", str(DIM), "--backend", "numpy")
    r = kalos("import", str(v1), "--name", h.name)
    assert r.returncode == 2 and "format 1, which names no namespace" in r.stderr, r.stderr
    text = ok(kalos("import", "old", str(v1), "--name", h.name))
    assert "imported 3 records into 'old'" in text and "timestamps" not in text, text
    with RecallClient(h.name, timeout=30) as c:
        got = c.get([7, 8, 9], namespace="old")
        assert got.payloads == [{"x": 1}, None, [2]] and np.isinf(got.expires_at).all()  # type: ignore[union-attr]
    # Into a data dir: a new store needs the metric the first format does not record.
    r = kalos("import", "old", str(v1), "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "give --metric" in r.stderr, r.stderr
    ok(kalos("import", "old", str(v1), "--data-dir", str(tmp_path / "d"), "--metric", "dot"))
    # A newer format is refused in words.
    new = tmp_path / "v3"
    new.mkdir()
    (new / "manifest.json").write_text(json.dumps({"format": "kalos-export", "version": 3}))
    r = kalos("import", str(new), "--name", h.name)
    assert r.returncode == 2 and "format 3, written by a newer kalos" in r.stderr, r.stderr


def test_export_needs_a_namespace_or_all(tmp_path: Path) -> None:
    r = kalos("export", str(tmp_path / "x"))
    assert r.returncode == 2 and "takes NAMESPACE DIR, or --all DIR" in r.stderr, r.stderr
    r = kalos("export", "ns", str(tmp_path / "x"), "--all")
    assert r.returncode == 2 and "takes NAMESPACE DIR, or --all DIR" in r.stderr, r.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine").write_text("x")
    r = kalos("export", "--all", str(tmp_path / "busy"), "--name", unique_name("none"))
    assert r.returncode == 2 and "is not empty" in r.stderr, r.stderr
