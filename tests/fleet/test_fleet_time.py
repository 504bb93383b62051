"""Memory over time in a fleet (issue 26), with a real PostgreSQL server: timestamps, TTLs, touches
and default TTLs travel with the change log (absolute times: every node agrees), a node whose
store is away still never answers an expired record, the sweep reaches the store and every node,
and a store written by schema 1 is migrated without loss."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from fleetkit import PgServer, fleet, fleet_dsn, pg, pg_server, wait_for  # noqa: F401 (fixtures)

from kalos import RecallClient

pytestmark = pytest.mark.timeout(180)


def _db(fleet_dsn: str) -> str:
    return fleet_dsn.split("@/")[1].split("?")[0]


def test_timestamps_ttls_and_defaults_travel_and_expiry_holds_while_the_store_is_away(
    pg: PgServer, fleet_dsn: str, fleet, rng
):
    a, b = fleet("a"), fleet("b")
    db = _db(fleet_dsn)
    vecs = rng.standard_normal((10, 16)).astype(np.float32)
    with RecallClient(a.name, timeout=10) as ca, RecallClient(b.name, timeout=10) as cb:
        ca.set_default_ttl("t", 60)
        ca.upsert(np.arange(6), vecs[:6], namespace="t")  # the default: 60 s
        ca.upsert([6, 7], vecs[6:8], namespace="t", ttl=1.0)
        w = ca.touch([5], namespace="t", ttl=math.inf)
        on_a = ca.get(np.arange(8), namespace="t", with_vectors=False)
        on_b = cb.get(np.arange(8), namespace="t", with_vectors=False, after=w.position)
        for f in ("created_at", "updated_at", "expires_at"):  # the writer's stamps, everywhere
            np.testing.assert_array_equal(getattr(on_a, f), getattr(on_b, f))
        assert on_b.expires_at[5] == math.inf and on_b.expires_at[6] - on_b.updated_at[6] == pytest.approx(1.0)
        assert on_b.expires_at[0] - on_b.updated_at[0] == pytest.approx(60.0)
        # b learned the default through the log: its own writes take it.
        wb = cb.upsert([8], vecs[8:9], namespace="t")
        got = ca.get([8], namespace="t", after=wb.position)
        assert got.expires_at[0] - got.updated_at[0] == pytest.approx(60.0)
        # The store goes away before 6 and 7 expire: no node can sweep them, none answers them.
        pg.stop("immediate")
        try:
            time.sleep(max(0.0, on_a.expires_at[6] - time.time()) + 0.1)
            for c in (ca, cb):
                hits = c.recall(vecs[6], 10, namespace="t", with_times=True)
                assert not {6, 7} & set(hits.ids.tolist()) and hits.served_at_ns / 1e9 > on_a.expires_at[6]
                assert c.get([6, 7], namespace="t").missing.tolist() == [6, 7]
                assert c.count("t") == 7 and c.namespaces()["t"] == 7
        finally:
            pg.start()
        # Back: a sweep commits the DELETEs; the store and every node lose them for good.
        assert wait_for(lambda: pg.psql("SELECT count(*) FROM kalos.records WHERE ns = 't'", db) == "7", 30)
        assert pg.psql("SELECT count(*) FROM kalos.changes WHERE op = 2 AND ns = 't'", db) != "0"
        assert pg.psql("SELECT default_ttl FROM kalos.namespaces WHERE ns = 't'", db) == str(60 * 10**9)
        assert ca.count("t") == cb.count("t") == 7
    # A node started now bootstraps the same timestamps from the snapshot.
    c = fleet("c")
    with RecallClient(c.name, timeout=10) as cc:
        snap = cc.get(np.arange(6), namespace="t", with_vectors=False)
        for f in ("created_at", "updated_at", "expires_at"):
            np.testing.assert_array_equal(getattr(snap, f), getattr(on_a, f)[:6])
        assert cc.upsert([9], vecs[9:10], namespace="t") == 1
        assert cc.get([9], namespace="t").expires_at[0] < math.inf  # the default came with the snapshot


def test_a_schema_1_store_is_migrated_without_loss(pg: PgServer, fleet_dsn: str, fleet, rng):
    """A store a protocol-5 fleet wrote: the schema-1 tables with records and a change log."""
    db = _db(fleet_dsn)
    vecs = rng.standard_normal((3, 16)).astype(np.float32)
    for stmt in (
        "CREATE SCHEMA kalos",
        "CREATE TABLE kalos.meta (key text PRIMARY KEY, value text NOT NULL)",
        "CREATE TABLE kalos.records (ns text NOT NULL, id bigint NOT NULL, vec bytea NOT NULL, "
        "payload bytea, PRIMARY KEY (ns, id))",
        "CREATE TABLE kalos.changes (xid bigint NOT NULL, seq bigint NOT NULL, op smallint NOT NULL, "
        "ns text NOT NULL, ids bytea, vecs bytea, payloads bytea, at double precision NOT NULL, "
        "PRIMARY KEY (xid, seq))",
        "CREATE SEQUENCE kalos.change_seq",
        "CREATE TABLE kalos.followers (name text PRIMARY KEY, xid bigint NOT NULL, seq bigint NOT NULL, "
        "seen timestamptz NOT NULL)",
        "INSERT INTO kalos.meta VALUES ('schema', '1'), ('dim', '16'), ('metric', 'dot'), ('pruned_through', '0.0')",
    ):
        pg.psql(stmt, db)
    for i in range(3):
        hexvec = vecs[i].tobytes().hex()
        pg.psql(f"INSERT INTO kalos.records VALUES ('old', {i}, '\\x{hexvec}'::bytea, '{{\"i\":{i}}}'::bytea)", db)
    t0 = time.time()
    a = fleet("a")
    t1 = time.time()
    assert pg.psql("SELECT value FROM kalos.meta WHERE key = 'schema'", db) == "2"
    with RecallClient(a.name, timeout=10) as ca:
        got = ca.get([0, 1, 2], namespace="old")
        np.testing.assert_array_equal(got.vectors, vecs)
        assert got.payloads == [{"i": 0}, {"i": 1}, {"i": 2}]
        assert (got.created_at == got.updated_at).all() and t0 - 1 <= got.created_at[0] <= t1 + 1
        assert (got.expires_at == math.inf).all()
        w = ca.upsert([3], vecs[:1], namespace="old", ttl=30)
    b = fleet("b")
    with RecallClient(b.name, timeout=10) as cb:
        assert cb.count("old", after=w.position) == 4
        assert cb.get([3], namespace="old").expires_at[0] < math.inf
