"""The PostgreSQL store of a fleet, with a real server: clear errors (and no password in them),
the schema version, positions across nodes, the store going away, a follower past the log's
retention."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import numpy as np
import pytest
from conftest import free_port, run_py, slots_free
from fleetkit import PgServer, fleet, fleet_dsn, pg, pg_server, run_serve, wait_for  # noqa: F401 (fixtures)

from kalos import Position, PositionTimeout, RecallClient, ServerError
from kalos.testing.postgres import PASSWORD

pytestmark = pytest.mark.timeout(180)


def _http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _serve_args(*extra: str) -> list[str]:
    return ["--name", f"t{os.getpid()}-refused", "--dim", "16", "--backend", "numpy", *extra]


# --------------------------------------------------------------------------- refusals
def test_bad_store_values_are_refused_without_echoing_them():
    secret = "s3cr3t-in-uri"
    for value, expect in [
        (f"mysql://u:{secret}@h/db", "takes a postgresql:// URI"),
        (f"postgresql://u:{secret}@h:notaport/db", ""),
    ]:
        out = run_serve(_serve_args(), {"KALOS_STORE": value})
        text = out.stdout + out.stderr
        print(text[-600:])
        assert out.returncode == 2, text
        assert secret not in text
        assert expect in text
    out = run_serve(_serve_args("--store", "postgresql://x@/db", "--ephemeral"), {})
    assert out.returncode == 2 and "--ephemeral (from the command line) conflicts with --store" in out.stderr


def test_wrong_password_missing_database_other_schema_are_clear(pg: PgServer, fleet_dsn: str, fleet):
    db = fleet_dsn.split("@/")[1].split("?")[0]
    wrong = "wrong-pw-4711"
    out = run_serve(_serve_args(), {"KALOS_STORE": pg.tcp_dsn(db, wrong)})
    print(out.stderr[-800:])
    assert out.returncode == 2
    assert "password authentication failed" in out.stderr and wrong not in out.stderr
    out = run_serve(_serve_args(), {"KALOS_STORE": pg.tcp_dsn(db), "PGPASSWORD": wrong})
    assert out.returncode == 2 and wrong not in out.stderr
    assert "password authentication failed" in out.stderr

    out = run_serve(_serve_args(), {"KALOS_STORE": pg.dsn("no_such_db")})
    print(out.stderr[-500:])
    assert out.returncode == 2 and 'database "no_such_db" does not exist' in out.stderr

    node = fleet("first")  # creates the schema (version 2, dim 16, dot)
    node.stop()
    out = run_serve(_serve_args("--dim", "32"), {"KALOS_STORE": fleet_dsn})
    assert out.returncode == 2 and "was made with dim=16, this sidecar has dim=32" in out.stderr
    pg.psql("UPDATE kalos.meta SET value = '99' WHERE key = 'schema'", db)
    out = run_serve(_serve_args(), {"KALOS_STORE": fleet_dsn})
    print(out.stderr[-500:])
    assert out.returncode == 2
    assert "has kalos schema version 99, this sidecar speaks version 2" in out.stderr
    assert "nothing was changed" in out.stderr
    assert pg.psql("SELECT value FROM kalos.meta WHERE key = 'schema'", db) == "99"  # untouched


def test_password_not_in_ps_logs_or_metrics(pg: PgServer, fleet_dsn: str, fleet):
    db = fleet_dsn.split("@/")[1].split("?")[0]
    port = free_port()
    node = fleet("pw", "--metrics-port", str(port), store=pg.tcp_dsn(db, PASSWORD))
    with RecallClient(node.name, timeout=10) as c:
        c.upsert([1], np.ones((1, 16), np.float32))
    with open(f"/proc/{node.proc.pid}/cmdline", "rb") as f:
        assert PASSWORD.encode() not in f.read()
    status, metrics = _http(port, "/metrics")
    assert status == 200 and "kalos_replication_lag_seconds_bucket" in metrics
    assert PASSWORD not in metrics
    _, ready = _http(port, "/readyz")
    assert PASSWORD not in ready
    node.stop()
    assert PASSWORD not in node.log() and "kalos@127.0.0.1" in node.log()


# --------------------------------------------------------------------------- positions
def test_position_token_read_your_writes_across_nodes(fleet, rng):
    a, b = fleet("a"), fleet("b")
    with RecallClient(a.name, timeout=10) as ca, RecallClient(b.name, timeout=10) as cb:
        for i in range(40):
            vec = rng.standard_normal((1, 16)).astype(np.float32)
            w = ca.upsert([i], vec, payloads=[{"n": i}], namespace="tok")
            assert w == 1 and isinstance(w.position, Position)
            got = cb.get([i], namespace="tok", after=w.position)  # at once, every time
            assert got.ids.tolist() == [i] and got.payloads == [{"n": i}]
            np.testing.assert_array_equal(got.vectors, vec)
            hits = cb.recall(vec[0], k=1, namespace="tok", where={"n": i}, after=str(w.position))
            assert hits.ids.tolist() == [i]
        d = cb.delete(where={"n": {"$lt": 20}}, namespace="tok")
        assert d == 20 and d.position > w.position
        assert ca.count("tok", after=d.position) == 20
        # A position this node will not reach in time: a clear timeout, within the budget.
        ahead = Position(d.position.xid + 10**9, 1)
        t0 = time.monotonic()
        with pytest.raises(PositionTimeout, match="not applied within the time budget"):
            ca.count("tok", after=ahead, timeout=1.0)
        took = time.monotonic() - t0
        print(f"PositionTimeout after {took:.3f} s (budget 1.0 s)")
        assert took < 5.0
        assert ca.count("tok") == 20  # the client goes on


# --------------------------------------------------------------------------- faults
def test_store_down_recalls_served_writes_fail_then_catch_up(pg: PgServer, fleet, rng):
    port = free_port()
    a = fleet("a", "--metrics-port", str(port))
    b = fleet("b")
    vecs = rng.standard_normal((50, 16)).astype(np.float32)
    with RecallClient(a.name, timeout=10) as ca, RecallClient(b.name, timeout=10) as cb:
        w = ca.upsert(np.arange(50), vecs)
        assert cb.count(after=w.position) == 50
        pg.stop("immediate")
        try:
            q = vecs[7]
            assert ca.recall(q, k=5).ids.tolist() == np.argsort(-(vecs.astype(np.float64) @ q))[:5].tolist()
            t0 = time.monotonic()
            with pytest.raises(ServerError, match="STORE_ERROR"):
                ca.upsert([100], vecs[:1], timeout=5)
            print(f"write failed after {time.monotonic() - t0:.3f} s")
            assert ca.get([100]).missing.tolist() == [100]  # nothing applied locally
            assert ca.count() == 50 and cb.count() == 50
            assert wait_for(lambda: _http(port, "/readyz")[1].startswith("degraded:"), 10)
            status, why = _http(port, "/readyz")
            print(status, why)
            assert status == 200 and "unreachable" in why
            assert "kalos_replication_connected 0.0" in _http(port, "/metrics")[1]
        finally:
            pg.start()
        deadline = time.monotonic() + 30
        while True:  # the writer reconnects with backoff: the first writes may still fail
            try:
                w = ca.upsert([100], vecs[:1], timeout=5)
                break
            except ServerError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert cb.count(after=w.position, timeout=20) == 51
        assert wait_for(lambda: _http(port, "/readyz")[1].strip() == "ready", 15)


def pruned_through(pg: PgServer, db: str) -> tuple[int, int]:
    """The store's pruned_through position as numbers (as strings "1000.1" sorts before "999.5")."""
    xid, _, seq = pg.psql("SELECT value FROM kalos.meta WHERE key = 'pruned_through'", db).partition(".")
    return int(xid or -1), int(seq or 0)


def test_follower_past_retention_reloads_and_converges(pg: PgServer, fleet_dsn: str, fleet, rng):
    db = fleet_dsn.split("@/")[1].split("?")[0]
    a = fleet("a", "--store-retention", "1.5")
    b = fleet("b", "--store-retention", "1.5")
    vecs = rng.standard_normal((200, 16)).astype(np.float32)
    with RecallClient(a.name, timeout=10) as ca:
        w = ca.upsert(np.arange(20), vecs[:20])
        with RecallClient(b.name, timeout=10) as cb:
            assert cb.count(after=w.position) == 20
        b.pause()  # gone silent: after the retention it is dropped and the log pruned past it
        try:
            i = 20
            seen = (w.position.xid, w.position.seq)  # the last write b applied
            assert wait_for(lambda: pg.psql("SELECT count(*) FROM kalos.followers", db) == "1", 20)
            while pruned_through(pg, db) <= seen:  # (not the newest write: pruning trails it)
                w = ca.upsert([i], vecs[i : i + 1], payloads=[{"i": i}])
                ca.delete([i - 10])
                i += 1
                assert i < 200, f"the log was never pruned past {seen}: {pruned_through(pg, db)}"
                time.sleep(0.05)
            w = ca.upsert([i], vecs[i : i + 1])
        finally:
            b.resume()
        want = ca.count()
        with RecallClient(b.name, timeout=30, connect_timeout=30) as cb:
            assert cb.count(after=w.position, timeout=30) == want
            ea, eb = ca.export_page("default", -1), cb.export_page("default", -1)
            assert ea[0].tolist() == eb[0].tolist()
            np.testing.assert_array_equal(ea[1], eb[1])
            assert ea[2] == eb[2]
    assert "reloading in the background" in b.log()
    assert "replica reloaded" in b.log()
    print(json.dumps({"writes": i, "rows": want}))


def test_without_a_fleet_store_writes_have_no_position_and_after_does_not_wait(sidecar):
    with RecallClient(sidecar.name, timeout=5) as c:
        w = c.upsert([5000], np.ones((1, 32), np.float32))
        assert w == 1 and w.position is None
        t0 = time.monotonic()
        hits = c.recall(np.ones(32, np.float32), k=1, after=Position(10**12, 1), timeout=5)
        assert c.count(after="kpos:99.1") == 2001
        assert hits.ids.tolist() == [5000] and time.monotonic() - t0 < 4
        with pytest.raises(Exception, match="not a position token"):
            c.count(after="nonsense")


def test_a_held_read_of_a_client_that_dies_frees_its_slot(fleet):
    """A read waiting for a position that never comes, with no time limit: its client is killed;
    the sidecar answers the held read and the reaper frees the slot, as for any dead client."""
    a = fleet("a")
    code = (
        "import sys; from kalos import RecallClient, Position\n"
        "c = RecallClient(sys.argv[1], timeout=None)\n"
        "print('posting', flush=True)\n"
        "c.count(after=Position(10**15, 1))\n"
    )
    p = run_py(code, a.name)
    try:
        assert p.stdout.readline().strip() == b"posting"
        assert wait_for(lambda: not slots_free(a.name), 10)
        time.sleep(0.3)  # the read is held (BUSY) by now
        assert not slots_free(a.name)
        p.kill()
        p.wait()
        assert wait_for(lambda: slots_free(a.name), 10), "the held read's slot was never freed"
        with RecallClient(a.name, timeout=5) as c:  # and the sidecar serves on
            assert c.count() == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_the_follower_cursor_never_skips_a_late_committing_transaction(fleet_dsn: str, fleet):
    """Two writers without the fleet's lock (as any transaction could interleave): T1 takes its
    xid and seq first but commits last. A cursor over plain seq would read T2's change, move past
    it and never see T1's; reading in (xid, seq) order below the snapshot's xmin holds T2 back
    until T1 has committed, then gives both, in order."""
    import psycopg

    from kalos.broker.positions import ORIGIN
    from kalos.sidecar_cuda.storage.durable import resolve_writes
    from kalos.sidecar_cuda.storage.pgstore import fetch_changes, write_change
    from kalos.sidecar_cuda.storage.writes import Write, WriteOp

    fleet("schema").stop()  # creates the schema
    vec = np.ones((1, 16), np.float32)

    def xid(conn) -> int:
        return int(conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0])

    with (
        psycopg.connect(fleet_dsn) as t1,
        psycopg.connect(fleet_dsn) as t2,
        psycopg.connect(fleet_dsn, autocommit=True) as reader,
    ):
        w1, w2 = (
            Write(WriteOp.UPSERT, "late", np.array([1]), vec, None),
            Write(WriteOp.UPSERT, "late", np.array([2]), vec, None),
        )
        resolve_writes([w1, w2], None)
        x1 = xid(t1)
        s1 = write_change(t1, x1, w1)
        x2 = xid(t2)
        s2 = write_change(t2, x2, w2)
        assert x1 < x2 and s1 < s2
        t2.commit()
        seen = reader.execute("SELECT seq FROM kalos.changes WHERE ns = 'late'").fetchall()
        assert seen == [(s2,)]  # what a plain `seq > cursor` follower would take, and move past
        assert fetch_changes(reader, ORIGIN, 100, 16) == []  # held back: T1 still runs
        t1.commit()
        got = fetch_changes(reader, ORIGIN, 100, 16)
        assert [(c.position.xid, c.position.seq) for c in got] == [(x1, s1), (x2, s2)]


@pytest.mark.asyncio
async def test_pool_writes_return_positions_that_reads_on_another_node_wait_for(fleet, rng):
    from kalos import RecallPool

    a, b = fleet("a"), fleet("b")
    vecs = rng.standard_normal((40, 16)).astype(np.float32)
    async with RecallPool(a.name, size=4, timeout=10) as pa, RecallPool(b.name, size=4, timeout=10) as pb:
        w = await pa.upsert(np.arange(40), vecs, payloads=[{"i": i} for i in range(40)], namespace="p")
        assert w == 40 and w.position is not None  # (two chunks of max_queries: the later position)
        many = await pb.recall_many(vecs[:3], k=1, namespace="p", after=w.position)
        best = np.argmax(vecs[:3].astype(np.float64) @ vecs.astype(np.float64).T, axis=1)
        assert [h.ids.tolist() for h in many] == [[int(i)] for i in best]
        assert (await pb.get([39], namespace="p", after=w.position)).ids.tolist() == [39]
        d = await pb.drop_namespace("p")
        assert d == 40 and d.position > w.position
        # Once the drop is applied on a, "p" holds nothing there: count 0, no hits (no error).
        assert await pa.count("p", after=d.position) == 0
        assert len(await pa.recall(vecs[0], k=3, namespace="p", after=d.position)) == 0
        assert "p" not in await pa.namespaces()
