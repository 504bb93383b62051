"""The fleet's pure parts: positions and tokens, held reads, backoff, lag buckets, the store choice,
--store options, connection strings without their password, change-log rows, psycopg errors
mapped to ours, idempotent apply."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from kalos import Position, PositionTimeout, ResponseTimeout, Written
from kalos.broker.errors import ConfigError, InvalidRequest
from kalos.broker.layout import Metric, Status, error_for_status
from kalos.broker.positions import BEYOND, ORIGIN, as_position
from kalos.broker.validation import decode_where
from kalos.clients.results import written
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
from kalos.sidecar_cuda.config import add_serve_arguments, config_from_args
from kalos.sidecar_cuda.serving.waits import Held, sort_held
from kalos.sidecar_cuda.storage.durable import StoreKind, store_kind
from kalos.sidecar_cuda.storage.store import MemoryStore
from kalos.sidecar_cuda.storage.writes import Write, WriteOp, apply_write

pytestmark = pytest.mark.timeout(20)


def test_positions_order_print_and_parse() -> None:
    a, b = Position(10, 5), Position(11, 1)
    assert ORIGIN < a < b < BEYOND
    assert Position.parse(str(b)) == b and str(b) == "kpos:11.1"
    assert as_position(None) is None and as_position(str(a)) == a and as_position(a) is a
    for bad in ("", "kpos:", "kpos:1", "kpos:1.x", "pos:1.2", "kpos:-1.2"):
        with pytest.raises(InvalidRequest):
            Position.parse(bad)
    with pytest.raises(InvalidRequest):
        as_position(12)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        Position(1 << 63, 0)


def test_written_is_an_int_with_the_last_position() -> None:
    w = written([Written(3, Position(5, 9)), Written(2, Position(5, 7)), Written(0, None)])
    assert w == 5 and isinstance(w, int) and w.position == Position(5, 9)
    assert written([Written(1), 2]).position is None


def test_not_applied_is_a_position_timeout() -> None:
    e = error_for_status(Status.NOT_APPLIED, "position kpos:9.9 not applied")
    assert isinstance(e, PositionTimeout) and isinstance(e, ResponseTimeout)
    assert isinstance(e, TimeoutError) and "kpos:9.9" in str(e)


def test_sort_held_ready_expired_waiting() -> None:
    h = [
        Held(0, 1, Position(5, 1), 0),
        Held(1, 1, Position(9, 1), 100),
        Held(2, 1, Position(9, 1), 0),
        Held(3, 1, Position(4, 9), 50),
    ]
    ready, expired, waiting = sort_held(h, Position(5, 1), now_ns=100)
    assert [x.slot for x in ready] == [0, 3]
    assert [x.slot for x in expired] == [1]
    assert [x.slot for x in waiting] == [2]  # no limit: waits on
    assert sort_held(h, BEYOND, 0)[0] == h


def test_backoff_doubles_to_the_cap_with_jitter() -> None:
    pytest.importorskip("psycopg")
    from kalos.sidecar_cuda.storage.fleet import LAG_BOUNDS_S, backoff_s, lag_bucket

    assert [backoff_s(n, 5.0, rand=lambda: 1.0) for n in (1, 2, 3, 8, 30)] == [0.1, 0.2, 0.4, 5.0, 5.0]
    assert backoff_s(1, 5.0, rand=lambda: 0.0) == 0.05
    assert lag_bucket(0.0) == 0 and lag_bucket(0.1) == LAG_BOUNDS_S.index(0.1)
    assert lag_bucket(1e9) == len(LAG_BOUNDS_S)


def test_store_kind_is_chosen_in_one_place() -> None:
    assert store_kind(None, None) is StoreKind.EPHEMERAL
    assert store_kind("/d", None) is StoreKind.SQLITE
    assert store_kind(None, "postgresql://x@/db") is StoreKind.POSTGRES


def _cfg(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_serve_arguments(p, environ=env or {})
    return config_from_args(p.parse_args(argv))


def test_store_option_rules_and_no_password_in_the_config_repr() -> None:
    secret = "pw-in-the-uri"
    cfg = _cfg([], {"KALOS_STORE": f"postgresql://u:{secret}@db.example/kalos"})
    assert cfg.store is not None and cfg.data_dir is None
    assert secret not in repr(cfg)
    assert _cfg(["--store", "postgresql://u@h/db", "--store-retention", "30"]).store_retention_s == 30
    for argv in (
        ["--store", "postgresql://u@h/db", "--data-dir", "/d"],
        ["--store", "postgresql://u@h/db", "--ephemeral"],
    ):
        with pytest.raises(ConfigError, match="conflicts with"):
            _cfg(argv)
    with pytest.raises(ConfigError) as e:
        _cfg(["--store", f"mysql://u:{secret}@h/db"])
    assert secret not in str(e.value)
    with pytest.raises(ConfigError, match="--store postgresql://"):
        _cfg([])


def test_targets_are_shown_without_password_and_errors_scrubbed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pg = pytest.importorskip("kalos.sidecar_cuda.storage.pgstore")
    t = pg.parse_target("postgresql://alice:hunter2@db.example:5433/mem?sslmode=require")
    assert t.shown == "postgresql://alice@db.example:5433/mem"
    assert "hunter2" not in repr(t) and "hunter2" not in t.shown
    assert (
        pg.scrub("auth failed for hunter2 in postgresql://alice:hunter2@db/x", t)
        == "auth failed for *** in postgresql://alice:***@db/x"
    )
    monkeypatch.setenv("PGPASSWORD", "envsecret")
    assert "envsecret" not in pg.scrub("bad envsecret", t)
    for bad in ("mysql://a:b@h/d", "host=a password=junk junk"):
        with pytest.raises(ConfigError) as e:
            pg.parse_target(bad)
        assert "junk" not in str(e.value) and ":b@" not in str(e.value)


def test_every_psycopg_error_maps_to_ours_without_the_password() -> None:
    pg = pytest.importorskip("kalos.sidecar_cuda.storage.pgstore")
    import psycopg

    t = pg.parse_target("postgresql://alice:hunter2@db/mem")
    classes = [
        psycopg.Error,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        psycopg.DatabaseError,
        psycopg.ProgrammingError,
        psycopg.errors.QueryCanceled,
        psycopg.errors.UndefinedTable,
        psycopg.errors.InvalidPassword,
    ]
    for cls in classes:
        with pytest.raises(pg.StoreUnavailable) as e:
            with pg.pg_errors(t, "doing X"):
                raise cls("failed with hunter2")
        assert "doing X" in str(e.value) and "hunter2" not in str(e.value)
        with pytest.raises(ConfigError):
            with pg.pg_errors(t, "starting", config=True):
                raise cls("x")


def test_change_rows_decode_and_bad_rows_are_refused() -> None:
    pg = pytest.importorskip("kalos.sidecar_cuda.storage.pgstore")
    ids = np.array([3, 1], np.int64)
    vecs = np.arange(8, dtype=np.float32).reshape(2, 4)
    c = pg.decode_change(
        (7, 2, int(WriteOp.UPSERT), "ns", ids.tobytes(), vecs.tobytes(), b'{"a":1}\nnull', 12.5, None), 4
    )
    assert c.position == Position(7, 2) and c.at == 12.5 and c.write.op is WriteOp.UPSERT
    assert c.write.ids.tolist() == [3, 1] and c.write.payloads == [b'{"a":1}', None]
    np.testing.assert_array_equal(c.write.vectors, vecs)
    # (no stamps: a schema-1 writer's change, stamped with its commit time, never expiring)
    assert c.write.stamps.updated.tolist() == [12_500_000_000] * 2 and c.write.stamps.expires.tolist() == [0, 0]
    d = pg.decode_change((7, 3, int(WriteOp.DROP), "ns", None, None, None, 0.0, None), 4)
    assert d.write.op is WriteOp.DROP and d.write.ids is None
    with pytest.raises(ValueError):
        pg.decode_change((7, 4, int(WriteOp.UPSERT), "ns", ids.tobytes(), vecs.tobytes()[:-4], None, 0.0, None), 4)
    with pytest.raises(ValueError):
        pg.decode_change((7, 5, 99, "ns", None, None, None, 0.0, None), 4)


def test_apply_is_idempotent_and_deletes_by_filter_resolve_against_the_store(rng) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStore(NumpyBackend(), 4, Metric.DOT)
    vecs = rng.standard_normal((3, 4)).astype(np.float32)
    changes = [
        Write(WriteOp.UPSERT, "a", np.array([1, 2, 3]), vecs, [b'{"t":1}', b'{"t":2}', None]),
        Write(WriteOp.DELETE, "a", np.array([2, 9])),
        Write(WriteOp.UPSERT, "b", np.array([5]), vecs[:1], None),
        Write(WriteOp.DROP, "b"),
    ]
    for w in changes:
        apply_write(store, w)
    once = {n: sorted(ns.id_row) for n, ns in store.namespaces.items()}
    for w in changes[1:] + changes:  # seen again, in part and in full, in order
        apply_write(store, w)
    assert {n: sorted(ns.id_row) for n, ns in store.namespaces.items()} == once == {"a": [1, 3]}
    dw = Write(WriteOp.DELETE_WHERE, "a", where=decode_where(b'{"t":1}'))
    dw.resolve(store)
    assert dw.ids is not None and dw.ids.tolist() == [1]
    assert apply_write(store, dw) == 1 and apply_write(store, dw) == 0


def test_the_follower_hands_changes_to_the_serving_thread_in_order_bounded_and_a_reload_once() -> None:
    """``Handoff``: the follower puts batches (full at its limit: it then waits), the serving thread
    takes at most N changes a pass in log order, batches split across passes; a finished reload is
    taken once. Two threads at once lose nothing and reorder nothing."""
    import threading

    pytest.importorskip("psycopg")
    from kalos.sidecar_cuda.storage.fleet import Handoff
    from kalos.sidecar_cuda.storage.pgstore import Change

    def change(i: int) -> Change:
        return Change(Position(1, i), Write(WriteOp.DELETE, "ns", ids=np.array([i], np.int64)), 0.0)

    h = Handoff(limit=2)
    assert not h.pending() and not h.full() and h.take_changes(5) == [] and h.take_reload() is None
    h.put_changes([change(1), change(2), change(3)])
    h.put_changes([change(4)])
    assert h.full() and h.pending()
    assert [c.position.seq for c in h.take_changes(2)] == [1, 2]  # a batch split across passes
    assert h.full()  # (what is left of it still counts as a batch waiting)
    assert [c.position.seq for c in h.take_changes(5)] == [3, 4]
    assert not h.pending()
    h.put_reload({}, Position(9, 9))
    assert h.pending() and h.take_reload() == ({}, Position(9, 9)) and h.take_reload() is None

    h = Handoff(limit=4)
    n = 2000
    seen: list[int] = []

    def follower() -> None:
        i = 0
        while i < n:
            if h.full():
                continue
            batch = [change(j) for j in range(i, min(n, i + 7))]
            h.put_changes(batch)
            i += len(batch)

    t = threading.Thread(target=follower)
    t.start()
    while len(seen) < n:
        seen += [c.position.seq for c in h.take_changes(16)]
    t.join()
    assert seen == list(range(n))
