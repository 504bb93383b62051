"""docs/backup.md, "PostgreSQL": the documented pg_dump while a node writes, and the documented
restore into a new database, run as written (issue 33, item 12). A node started on the restored
database serves every record with its vector, payload, timestamps and TTL, the namespaces' default
TTLs, and takes new writes.

The one change: every ``postgresql://USER@db.internal:5432/DB`` names the test's server (its
superuser, over its socket) and the databases get the test's names; the server's own ``pg_dump``,
``pg_restore`` and ``psql`` come first on ``PATH``."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from fleetkit import PgServer, fleet, fleet_dsn, pg, pg_server  # noqa: F401 (fixtures)

from kalos import RecallClient

pytestmark = pytest.mark.timeout(180)
DOC = Path(__file__).resolve().parents[2] / "docs" / "backup.md"


def _blocks() -> list[str]:
    section = DOC.read_text(encoding="utf-8").split("## PostgreSQL", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_pg_dump_and_restore_as_documented(pg: PgServer, fleet_dsn: str, fleet, tmp_path: Path) -> None:
    source_db = fleet_dsn.split("@/")[1].split("?")[0]
    restored_db = f"{source_db}_restored"

    def uri(m: re.Match[str]) -> str:
        db = {"kalos": source_db, "kalos_restored": restored_db}.get(m.group(2), m.group(2))
        return pg.dsn(db)

    def fix(script: str) -> str:
        script = re.sub(r"postgresql://(\w+)@db\.internal:5432/(\w+)", uri, script)
        return script.replace("DATABASE kalos_restored OWNER kalos", f'DATABASE "{restored_db}" OWNER kalos')

    env = {**os.environ, "PATH": f"{pg.bindir}:{os.environ['PATH']}"}
    dump, restore = _blocks()

    node = fleet("src")
    rng = np.random.default_rng(7)
    vecs = rng.standard_normal((300, 16), dtype=np.float32)
    with RecallClient(node.name) as c:
        c.set_default_ttl("notes", 3600)
        c.upsert(np.arange(200), vecs[:200], [{"i": i} for i in range(200)], namespace="notes")
        c.upsert(np.arange(200, 300), vecs[200:], [None] * 100, namespace="facts", ttl=[None, 900.0] * 50)
        before = c.get(np.arange(200), namespace="notes"), c.get(np.arange(200, 300), namespace="facts")

        stop = threading.Event()

        def write_on() -> None:  # the fleet keeps writing while pg_dump runs
            i = 0
            while not stop.is_set():
                c.upsert([10_000 + i % 50], vecs[:1], namespace="busy")
                i += 1

        writer = threading.Thread(target=write_on)
        writer.start()
        try:
            out = subprocess.run(["bash", "-e", "-c", fix(dump)], cwd=tmp_path, env=env, capture_output=True, text=True)
        finally:
            stop.set()
            writer.join()
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "kalos.dump").stat().st_mode & 0o777 == 0o600  # umask 077

    out = subprocess.run(["bash", "-e", "-c", fix(restore)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert pg.psql("SELECT count(*) FROM kalos.changes", restored_db) == "0"
    assert pg.psql("SELECT count(*) FROM kalos.followers", restored_db) == "0"
    assert pg.psql("SELECT value FROM kalos.meta WHERE key = 'pruned_through'", restored_db) == "0.0"

    restored = fleet("restored", store=pg.dsn(restored_db))
    with RecallClient(restored.name) as c:
        after = c.get(np.arange(200), namespace="notes"), c.get(np.arange(200, 300), namespace="facts")
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.vectors, b.vectors)
            assert a.payloads == b.payloads
            for field in ("created_at", "updated_at", "expires_at"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert np.isinf(after[1].expires_at[::2]).all() and np.isfinite(after[1].expires_at[1::2]).all()
        assert 1 <= c.count("busy") <= 50
        # The namespace's default TTL came back with it; the restored store takes writes.
        c.upsert([999], vecs[:1], namespace="notes")
        assert np.isfinite(c.get([999], namespace="notes").expires_at).all()
        assert c.count("notes") == 201
