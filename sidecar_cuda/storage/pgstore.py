"""PostgreSQL as a fleet's system of record: connections, the schema and its version, the SQL of
writes, the change log, snapshots and follower bookkeeping. The only module that imports psycopg;
every psycopg error becomes a Kalos error at one boundary (:func:`pg_errors`), with any password
removed from its text.

Schema ``kalos`` (created by the first sidecar, versioned by a row of ``kalos.meta``)::

    meta       (key, value)                  schema version, dim, metric, pruned_through
    records    (ns, id, vec, payload, created_at, updated_at, expires_at, ttl)
                                             the memories: vec float32 bytea, payload JSON bytea,
                                             timestamps and TTL as bigint ns (expires_at 0: never)
    namespaces (ns, default_ttl)             a namespace's default TTL (ns), where one was set
    changes    (xid, seq, op, ns, ids, vecs, payloads, at, stamps)
                                             the change log: one row per write of a batch; stamps:
                                             the resolved timestamps of its rows (module below)
    followers  (name, xid, seq, seen)        every live sidecar's applied position, heartbeat
    change_seq                               sequence of ``changes.seq``

Vectors are float32 ``bytea`` (the bytes a sidecar stores, no extension needed, any PostgreSQL
>= 13; pgvector would add a dependency and a float conversion per row for nothing: the store is
never searched, the GPU copy is). Payloads are the client's compact JSON bytes as ``bytea`` (jsonb
would reorder keys and renormalise numbers, so an export would not give back what was written).

Ordering (why the cursor cannot skip): every writing transaction first takes one advisory lock
(:data:`WRITE_LOCK`), then its transaction id (``pg_current_xact_id()``), then its ``seq`` numbers.
Writers are serialised by the lock, so the order of ``(xid, seq)`` is the commit order, and two
writes of the same record are applied by followers in the order PostgreSQL applied them.
Followers read ``(xid, seq) > cursor`` and only ``xid < pg_snapshot_xmin(pg_current_snapshot())``:
below that horizon no transaction is still running, so no change can commit behind the cursor.

Time (schema 2): every change carries absolute times (the writer's clock, resolved under the write
lock), so every replica applies the same record whatever its own clock: an UPSERT's ``stamps``
are four little-endian int64 arrays of its rows (created, updated, expires, ttl), a TOUCH's the
same (created and updated 0), a SET_TTL's one int64 (the default). Expiry deletes are logged as
DELETEs. A schema-1 store is migrated when a schema-2 sidecar first opens it (under the schema
lock, no row rewritten): records get the migration time as created/updated and no expiry; a
change without stamps (written by a schema-1 sidecar still running) is stamped with its commit
time. docs/deploy.md, "Several nodes", says what clock skew between nodes does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import conninfo as pg_conninfo

from ...broker.errors import ConfigError
from ...broker.positions import Position
from .store import Stamps, last_wins
from .writes import Write, WriteOp

log = logging.getLogger("kalos.sidecar")

SCHEMA_VERSION = 2
#: Advisory lock keys (64-bit; "kalos" in ASCII, then a role).
SCHEMA_LOCK = 0x6B616C6F7301
WRITE_LOCK = 0x6B616C6F7302
PRUNE_LOCK = 0x6B616C6F7303
CHANNEL = "kalos_changes"
_XMIN = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
_U63 = (1 << 63) - 1
Conn = psycopg.Connection[Any]


class StoreUnavailable(Exception):
    """PostgreSQL could not be reached or failed; the text never holds a password."""


# --------------------------------------------------------------------------- connection strings
@dataclass(frozen=True)
class Target:
    """A validated ``--store`` value. ``dsn`` holds what was given (maybe a password);
    ``shown`` is what logs and errors may print: no password, ever."""

    dsn: str
    shown: str
    password: str | None  # only to scrub it out of error texts

    def __repr__(self) -> str:  # (a dataclass repr would print the dsn)
        return f"Target({self.shown!r})"


def parse_target(value: str) -> Target:
    """Check a ``--store`` value: a ``postgresql://`` (or ``postgres://``) URI. Raises ConfigError
    whose text never includes the value's password (nor the value, when it cannot be parsed)."""
    if not value.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            "--store takes a postgresql:// URI (postgresql://USER@HOST:PORT/DB?"
            "sslmode=...; the password through PGPASSWORD or PGPASSFILE)"
        )
    try:
        parts = pg_conninfo.conninfo_to_dict(value)
    except psycopg.Error:
        raise ConfigError("--store is not a valid postgresql:// URI (not shown: it may hold a password)") from None
    password = parts.pop("password", None)
    host = str(parts.get("host") or os.environ.get("PGHOST") or "(local socket)")
    shown = "postgresql://{user}{at}{host}{port}/{db}".format(
        user=parts.get("user") or "",
        at="@" if parts.get("user") else "",
        host=host if "/" not in host else f"[{host}]",
        port=f":{parts['port']}" if parts.get("port") else "",
        db=parts.get("dbname") or "",
    )
    return Target(value, shown, None if password is None else str(password))


def scrub(text: str, target: Target) -> str:
    """``text`` without any password it may quote (ours, PGPASSWORD's, or a URI's)."""
    for secret in (target.password, os.environ.get("PGPASSWORD")):
        if secret:
            text = text.replace(secret, "***")
    return re.sub(r"(postgres(?:ql)?://[^:/@\s]*:)[^@\s]*@", r"\1***@", text)


@contextlib.contextmanager
def pg_errors(target: Target, what: str, *, config: bool = False) -> Iterator[None]:
    """Map psycopg errors to ours: ConfigError (``config``: at start, the operator's to fix) or
    StoreUnavailable, naming ``what`` failed and the store without its password."""
    try:
        yield
    except psycopg.Error as e:
        detail = scrub(str(e).strip() or type(e).__name__, target)
        msg = f"{what} ({target.shown}): {detail}"
        if config:
            raise ConfigError(msg) from None
        raise StoreUnavailable(msg) from None


def connect(target: Target, app: str, *, autocommit: bool, connect_timeout: float = 5.0) -> Conn:
    """A connection (libpq's usual means for the password: PGPASSWORD, PGPASSFILE, the URI).
    Raises psycopg.Error (callers map it)."""
    conn: Conn = psycopg.connect(
        target.dsn, autocommit=autocommit, application_name=app[:63], connect_timeout=max(1, int(connect_timeout))
    )
    # A stuck statement must not hold the serving thread (writes) or a follower forever.
    conn.execute("SET statement_timeout = '30s'")
    if not autocommit:
        conn.commit()
    return conn


# --------------------------------------------------------------------------- schema
_DDL = (
    "CREATE SCHEMA IF NOT EXISTS kalos",
    "CREATE TABLE IF NOT EXISTS kalos.meta (key text PRIMARY KEY, value text NOT NULL)",
    "CREATE TABLE IF NOT EXISTS kalos.records (ns text NOT NULL, id bigint NOT NULL, "
    "vec bytea NOT NULL, payload bytea, PRIMARY KEY (ns, id))",
    "CREATE TABLE IF NOT EXISTS kalos.changes (xid bigint NOT NULL, seq bigint NOT NULL, "
    "op smallint NOT NULL, ns text NOT NULL, ids bytea, vecs bytea, payloads bytea, "
    "at double precision NOT NULL, PRIMARY KEY (xid, seq))",
    # (schema 2's columns and table: _MIGRATE_1_2, run after these on a new store too)
    # Vectors stay in the row where they fit a page (out of line only as a last resort): a
    # snapshot then reads each row in one piece instead of one TOAST lookup per vector.
    "ALTER TABLE kalos.records ALTER COLUMN vec SET STORAGE MAIN",
    "ALTER TABLE kalos.changes ALTER COLUMN vecs SET STORAGE MAIN",
    "CREATE SEQUENCE IF NOT EXISTS kalos.change_seq",
    "CREATE TABLE IF NOT EXISTS kalos.followers (name text PRIMARY KEY, xid bigint NOT NULL, "
    "seq bigint NOT NULL, seen timestamptz NOT NULL)",
)


#: Schema 1 -> 2 (also the last steps of creating a store): the stamp columns with a constant
#: default (``{now}``: the migration's clock; PostgreSQL rewrites no row), whose default then
#: becomes the clock (a schema-1 sidecar still writing stamps its records with the time), the
#: namespaces table, the change log's stamps.
_MIGRATE_1_2 = (
    "ALTER TABLE kalos.records ADD COLUMN IF NOT EXISTS created_at bigint NOT NULL DEFAULT {now}",
    "ALTER TABLE kalos.records ADD COLUMN IF NOT EXISTS updated_at bigint NOT NULL DEFAULT {now}",
    "ALTER TABLE kalos.records ADD COLUMN IF NOT EXISTS expires_at bigint NOT NULL DEFAULT 0",
    "ALTER TABLE kalos.records ADD COLUMN IF NOT EXISTS ttl bigint NOT NULL DEFAULT 0",
    "ALTER TABLE kalos.records ALTER COLUMN created_at SET DEFAULT "
    "(extract(epoch from clock_timestamp()) * 1e9)::bigint",
    "ALTER TABLE kalos.records ALTER COLUMN updated_at SET DEFAULT "
    "(extract(epoch from clock_timestamp()) * 1e9)::bigint",
    "CREATE TABLE IF NOT EXISTS kalos.namespaces (ns text PRIMARY KEY, default_ttl bigint NOT NULL)",
    "ALTER TABLE kalos.changes ADD COLUMN IF NOT EXISTS stamps bytea",
)


def ensure_schema(conn: Conn, target: Target, dim: int, metric: str, now_ns: int | None = None) -> None:
    """Create the schema if there is none (under an advisory lock: sidecars may start together),
    else check its version, dim and metric, migrating a schema-1 store of the same dim and metric
    to schema 2 (module docstring; ``now_ns``: the migration's clock). Raises ConfigError on any
    other mismatch: a store is never rewritten by a sidecar that does not match it."""
    want = {"schema": str(SCHEMA_VERSION), "dim": str(dim), "metric": metric}
    with pg_errors(target, "cannot prepare the PostgreSQL store", config=True):
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            exists = conn.execute("SELECT to_regclass('kalos.meta') IS NOT NULL").fetchone()
            meta: dict[str, str] = {}
            if exists and exists[0]:
                meta = dict(conn.execute("SELECT key, value FROM kalos.meta").fetchall())
            now = time.time_ns() if now_ns is None else int(now_ns)
            if not meta:
                for stmt in _DDL:
                    conn.execute(stmt)
                for stmt in _MIGRATE_1_2:
                    conn.execute(stmt.format(now=now))
                for key, value in want.items():
                    conn.execute("INSERT INTO kalos.meta VALUES (%s, %s)", (key, value))
                conn.execute("INSERT INTO kalos.meta VALUES ('pruned_through', '0.0')")
                log.info("created the kalos schema (version %d) in %s", SCHEMA_VERSION, target.shown)
                return
            if meta.get("schema") == "1" and all(meta.get(k) == want[k] for k in ("dim", "metric")):
                for stmt in _MIGRATE_1_2:
                    conn.execute(stmt.format(now=now))
                conn.execute("UPDATE kalos.meta SET value = %s WHERE key = 'schema'", (want["schema"],))
                meta["schema"] = want["schema"]
                log.warning(
                    "migrated the kalos schema of %s from version 1 to %d: records kept, stamped "
                    "created/updated %d ns, no expiry",
                    target.shown,
                    SCHEMA_VERSION,
                    now,
                )
    if meta.get("schema") != want["schema"]:
        raise ConfigError(
            f"PostgreSQL store {target.shown} has kalos schema version {meta.get('schema')}, this "
            f"sidecar speaks version {SCHEMA_VERSION}; nothing was changed (a store is never "
            "migrated silently: only schema 1 is migrated, when opened; run the sidecar version that made it)"
        )
    for key in ("dim", "metric"):
        if meta.get(key) != want[key]:
            raise ConfigError(
                f"PostgreSQL store {target.shown} was made with {key}="
                f"{meta.get(key)}, this sidecar has {key}={want[key]}; nothing was changed"
            )


# --------------------------------------------------------------------------- changes
@dataclass(frozen=True, slots=True)
class Change:
    """One row of the change log, decoded: a write at a position, committed at ``at`` (epoch
    seconds, the database's clock)."""

    position: Position
    write: Write
    at: float


def _ids_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, "<i8").tobytes()


def _stamps_bytes(st: Stamps) -> bytes:
    return b"".join(np.ascontiguousarray(a, "<i8").tobytes() for a in (st.created, st.updated, st.expires, st.ttl))


def _stamps_of(raw: bytes | None, m: int, where: str) -> Stamps | None:
    if raw is None:
        return None
    a = np.frombuffer(raw, "<i8").astype(np.int64)
    if a.size != 4 * m:
        raise ValueError(f"{where}: {a.size} stamps for {m} rows")
    return Stamps(a[:m], a[m : 2 * m], a[2 * m : 3 * m], a[3 * m :])


def decode_change(
    row: tuple[int, int, int, str, bytes | None, bytes | None, bytes | None, float, bytes | None], dim: int
) -> Change:
    """A change-log row as a (resolved) Write. Raises ValueError for a row no sidecar could have
    written. A change without stamps (a schema-1 writer) is stamped with its commit time ``at``."""
    xid, seq, op, ns, ids_b, vecs_b, pls_b, at, stamps_b = row
    kind = WriteOp(op)
    where = f"change ({xid}, {seq})"
    ids = np.frombuffer(ids_b or b"", "<i8").astype(np.int64)
    w = Write(kind, ns, now_ns=int(at * 1e9))
    if kind is WriteOp.UPSERT:
        vecs = np.frombuffer(vecs_b or b"", "<f4").astype(np.float32)
        if vecs.size != len(ids) * dim:
            raise ValueError(f"{where}: {vecs.size} floats for {len(ids)} rows of dim {dim}")
        payloads: list[bytes | None] | None = None
        if pls_b is not None:
            lines = bytes(pls_b).split(b"\n")
            if len(lines) != len(ids):
                raise ValueError(f"{where}: {len(lines)} payloads for {len(ids)} rows")
            payloads = [None if line == b"null" else line for line in lines]
        w.ids, w.vectors, w.payloads = ids, vecs.reshape(len(ids), dim), payloads
        w.stamps = _stamps_of(stamps_b, len(ids), where) or Stamps.fresh(len(ids), w.now_ns)
    elif kind is WriteOp.TOUCH:
        w.ids, w.stamps = ids, _stamps_of(stamps_b, len(ids), where)
        if w.stamps is None:
            raise ValueError(f"{where}: a touch without stamps")
    elif kind is WriteOp.SET_TTL:
        t = np.frombuffer(stamps_b or b"", "<i8")
        if t.size != 1:
            raise ValueError(f"{where}: a default TTL of {t.size} values")
        w.ttl_ns = int(t[0])
    elif kind is not WriteOp.DROP:
        w.ids = ids
    return Change(Position(xid, seq), w, at)


_FETCH = (
    "SELECT xid, seq, op, ns, ids, vecs, payloads, at, stamps FROM kalos.changes "
    "WHERE (xid, seq) > (%s, %s) {horizon} ORDER BY xid, seq LIMIT %s"
)


def fetch_changes(conn: Conn, after: Position, limit: int, dim: int, *, below_horizon: bool = True) -> list[Change]:
    """Changes after ``after`` in log order, at most ``limit``. ``below_horizon``: only those of
    transactions older than every one still running (a follower's read); False only under
    :data:`WRITE_LOCK`, where no writer is running. Raises psycopg.Error."""
    sql = _FETCH.format(horizon=f"AND xid < {_XMIN}" if below_horizon else "")
    rows = conn.execute(sql, (after.xid, after.seq, limit)).fetchall()
    return [decode_change(r, dim) for r in rows]


def lock_for_write(conn: Conn) -> int:
    """In a transaction: take the fleet's write lock, then this transaction's id (in that order:
    the id is what orders the change log). Returns the xid."""
    row = conn.execute(
        "SELECT pg_current_xact_id()::text::bigint FROM (SELECT pg_advisory_xact_lock(%s)) AS l", (WRITE_LOCK,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def write_change(conn: Conn, xid: int, w: Write) -> int | None:
    """In a write transaction (under :func:`lock_for_write`): apply one resolved write to
    ``kalos.records`` (``kalos.namespaces``) and append it to the change log. Returns its seq
    (None: it changed nothing and nothing was logged). The write's arrays are left as the store
    will apply them. The write is resolved already (``durable.resolve_writes``)."""
    ns = w.namespace
    if w.op is WriteOp.UPSERT:
        assert w.ids is not None and w.vectors is not None and w.stamps is not None, "an upsert not resolved"
        keep = last_wins(w.ids)  # (one statement may not update a row twice)
        ids = w.ids[keep]
        vecs = np.ascontiguousarray(w.vectors[keep], "<f4")
        pls = None if w.payloads is None else [w.payloads[int(j)] for j in keep]
        st = w.stamps.take(keep)
        conn.execute(
            "INSERT INTO kalos.records (ns, id, vec, payload, created_at, updated_at, expires_at, ttl) "
            "SELECT %s, i, v, p, c, u, e, t FROM unnest(%s::bigint[], %s::bytea[], %s::bytea[], "
            "%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[]) AS x(i, v, p, c, u, e, t) "
            "ON CONFLICT (ns, id) DO UPDATE SET vec = EXCLUDED.vec, payload = EXCLUDED.payload, "
            "created_at = EXCLUDED.created_at, updated_at = EXCLUDED.updated_at, "
            "expires_at = EXCLUDED.expires_at, ttl = EXCLUDED.ttl",
            (
                ns,
                ids.tolist(),
                [r.tobytes() for r in vecs],
                pls or [None] * len(ids),
                st.created.tolist(),
                st.updated.tolist(),
                st.expires.tolist(),
                st.ttl.tolist(),
            ),
        )
        pls_b = None if pls is None else b"\n".join(b"null" if p is None else p for p in pls)
        return _log(conn, xid, w.op, ns, _ids_bytes(ids), vecs.tobytes(), pls_b, _stamps_bytes(st))
    if w.op is WriteOp.DROP:
        conn.execute("DELETE FROM kalos.records WHERE ns = %s", (ns,))
        conn.execute("DELETE FROM kalos.namespaces WHERE ns = %s", (ns,))
        return _log(conn, xid, w.op, ns, None, None, None)
    if w.op is WriteOp.SET_TTL:
        t = int(w.ttl_ns or 0)
        conn.execute(
            "INSERT INTO kalos.namespaces VALUES (%s, %s) ON CONFLICT (ns) DO UPDATE SET default_ttl = EXCLUDED.default_ttl",
            (ns, t),
        )
        return _log(conn, xid, w.op, ns, None, None, None, np.array([t], "<i8").tobytes())
    assert w.ids is not None
    if w.op is WriteOp.TOUCH:
        assert w.stamps is not None
        if not len(w.ids):
            return None
        conn.execute(
            "UPDATE kalos.records AS r SET expires_at = x.e, ttl = x.t FROM unnest(%s::bigint[], "
            "%s::bigint[], %s::bigint[]) AS x(i, e, t) WHERE r.ns = %s AND r.id = x.i",
            (w.ids.tolist(), w.stamps.expires.tolist(), w.stamps.ttl.tolist(), ns),
        )
        return _log(conn, xid, w.op, ns, _ids_bytes(w.ids), None, None, _stamps_bytes(w.stamps))
    gone = conn.execute(
        "DELETE FROM kalos.records WHERE ns = %s AND id = ANY(%s::bigint[]) RETURNING id", (ns, w.ids.tolist())
    ).fetchall()
    if not gone:
        return None
    # (an expiry is logged as the DELETE it is: followers delete what the writer deleted)
    op = WriteOp.DELETE if w.op is WriteOp.EXPIRE else w.op
    return _log(conn, xid, op, ns, _ids_bytes(np.array([g[0] for g in gone], np.int64)), None, None)


def _log(
    conn: Conn,
    xid: int,
    op: WriteOp,
    ns: str,
    ids: bytes | None,
    vecs: bytes | None,
    pls: bytes | None,
    stamps: bytes | None = None,
) -> int:
    row = conn.execute(
        "INSERT INTO kalos.changes (xid, seq, op, ns, ids, vecs, payloads, at, stamps) VALUES "
        "(%s, nextval('kalos.change_seq'), %s, %s, %s, %s, %s, "
        "extract(epoch from clock_timestamp()), %s) RETURNING seq",
        (xid, int(op), ns, ids, vecs, pls, stamps),
    ).fetchone()
    assert row is not None
    return int(row[0])


def notify(conn: Conn) -> None:
    """Wake every follower when this transaction commits (one notice per transaction)."""
    conn.execute(f"NOTIFY {CHANNEL}")


# --------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class Defaults:
    """The namespaces' default TTLs (ns) in a snapshot."""

    ttl: dict[str, int]


#: One chunk of a snapshot's records: (namespace, ids, vectors, payloads, stamps).
RecordChunk = tuple[str, np.ndarray, np.ndarray, list[bytes | None], Stamps]


def snapshot(conn: Conn, dim: int, chunk: int = 65536) -> Iterator[Position | dict[str, int] | Defaults | RecordChunk]:
    """Read every record in one consistent snapshot (REPEATABLE READ, binary COPY). Yields the
    cursor to follow from first (every change of a transaction at or after the snapshot's xmin
    may be missing from it; applying those again is idempotent), then the rows of each namespace,
    then the namespaces' default TTLs, then (namespace, ids, vectors, payloads, stamps) chunks.
    ``conn`` must be in autocommit mode. Raises psycopg.Error, ValueError."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute("SET LOCAL statement_timeout = 0")  # (a snapshot of many rows takes long)
        row = conn.execute(f"SELECT {_XMIN}").fetchone()  # the snapshot is taken here
        assert row is not None
        xmin = int(row[0])
        yield Position(max(0, xmin - 1), _U63)
        # Rows per namespace first (an index-only scan where the table is vacuumed): the store
        # then allocates each namespace once instead of doubling it (a copy each time) as it fills.
        yield dict(conn.execute("SELECT ns, count(*) FROM kalos.records GROUP BY ns").fetchall())
        yield Defaults(dict(conn.execute("SELECT ns, default_ttl FROM kalos.namespaces").fetchall()))
        buf: dict[str, _Chunk] = {}
        width = 4 * dim
        with conn.cursor().copy(
            "COPY (SELECT ns, id, vec, payload, created_at, updated_at, expires_at, ttl FROM kalos.records) "
            "TO STDOUT (FORMAT BINARY)"
        ) as cp:
            for ns, i, vec, payload, stamps in _copy_records(cp, width):
                b = buf.get(ns)
                if b is None:
                    b = buf[ns] = _Chunk(chunk, dim)
                if b.add(i, vec, payload, stamps):
                    yield b.take(ns)
        for ns, b in buf.items():
            if b.n:
                yield b.take(ns)


class _Chunk:
    """Records of one namespace being read: vectors copied straight into one array."""

    def __init__(self, size: int, dim: int) -> None:
        self.size, self.dim, self.width = size, dim, 4 * dim
        self._fresh()

    def _fresh(self) -> None:
        self.vecs = np.empty((self.size, self.dim), np.float32)
        self.raw = self.vecs.data.cast("B")
        self.ids = np.empty(self.size, np.int64)
        self.stamps = np.empty((self.size, 4), np.int64)
        self.payloads: list[bytes | None] = []
        self.n = 0

    def add(self, i: int, vec: Buffer, payload: bytes | None, stamps: tuple[int, int, int, int]) -> bool:
        """Append a record; True when the chunk is full."""
        n = self.n
        self.raw[n * self.width : (n + 1) * self.width] = vec
        self.ids[n] = i
        self.stamps[n] = stamps
        self.payloads.append(payload)
        self.n = n + 1
        return self.n == self.size

    def take(self, ns: str) -> RecordChunk:
        st = self.stamps[: self.n]
        out = (
            ns,
            self.ids[: self.n],
            self.vecs[: self.n],
            self.payloads,
            Stamps(st[:, 0].copy(), st[:, 1].copy(), st[:, 2].copy(), st[:, 3].copy()),
        )
        self._fresh()
        return out


_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")


Buffer = bytes | bytearray | memoryview


#: Fields of a snapshot's COPY row: ns, id, vec, payload, created_at, updated_at, expires_at, ttl.
_COPY_FIELDS = 8


def _copy_records(cp: Any, width: int) -> Iterator[tuple[str, int, Buffer, bytes | None, tuple[int, int, int, int]]]:
    """(ns, id, vector bytes, payload, (created, updated, expires, ttl)) of ``COPY (SELECT ns, id,
    vec, payload, created_at, updated_at, expires_at, ttl ...) TO STDOUT (FORMAT BINARY)``, parsed
    here from the raw stream: psycopg's row-by-row reading cost ~25 us a row (bootstrap time is
    this loop). Raises ValueError on a malformed stream or a vector that is not ``width`` bytes."""
    # One CopyData message per row, read straight from libpq: psycopg's Copy.read() costs
    # ~13 us of Python per message, more than parsing the row. The trailer is the last message:
    # psycopg's Copy then reads the end of the COPY and its result as usual.
    pgconn = cp.connection.pgconn
    data: Buffer = bytearray()
    pos = 0
    header = False
    while True:
        nbytes, block = pgconn.get_copy_data(0)
        if nbytes < 0:
            cp.read()  # the COPY's result: raises the server's error if it failed
            raise ValueError("COPY stream ended without its trailer")
        if pos >= len(data) and header:
            data, pos = block, 0  # (the usual case, a message of whole rows: parsed in place)
        else:
            data, pos = bytearray(data[pos:]) + block, 0
        if not header:
            if len(data) < 19:
                continue
            if bytes(data[:11]) != _COPY_SIGNATURE:
                raise ValueError("not a binary COPY stream")
            pos = 19 + _I32.unpack_from(data, 15)[0]
            header = True
        n = len(data)
        while True:
            if pos + 2 > n:
                break
            nf = _I16.unpack_from(data, pos)[0]
            if nf == -1:
                while cp.read():  # the end of the COPY and its result, through psycopg
                    pass
                return
            if nf != _COPY_FIELDS:
                raise ValueError(f"COPY row of {nf} fields, not {_COPY_FIELDS}")
            p = pos + 2
            fields: list[tuple[int, int]] = []
            for _f in range(_COPY_FIELDS):
                if p + 4 > n:
                    break
                ln = _I32.unpack_from(data, p)[0]
                p += 4
                if ln > 0 and p + ln > n:
                    break
                fields.append((p, ln))
                p += max(ln, 0)
            if len(fields) < _COPY_FIELDS:
                break  # the rest of this row is in the next block
            (a, la), (b, lb), (c, lc), (d, ld) = fields[:4]
            if lb != 8 or lc != width or la < 0:
                raise ValueError(f"record with a vector of {lc} bytes, not {width}")
            if any(ln != 8 for _o, ln in fields[4:]):
                raise ValueError("record with a timestamp that is not a bigint")
            # (the vector as a view of the message: copied once, when its chunk is joined)
            yield (
                bytes(data[a : a + la]).decode(),
                _I64.unpack_from(data, b)[0],
                data[c : c + lc],
                None if ld < 0 else bytes(data[d : d + ld]),
                (
                    _I64.unpack_from(data, fields[4][0])[0],
                    _I64.unpack_from(data, fields[5][0])[0],
                    _I64.unpack_from(data, fields[6][0])[0],
                    _I64.unpack_from(data, fields[7][0])[0],
                ),
            )
            pos = p


# --------------------------------------------------------------------------- followers
def heartbeat(conn: Conn, name: str, applied: Position) -> None:
    """Register or refresh a follower and its applied position (autocommit)."""
    conn.execute(
        "INSERT INTO kalos.followers VALUES (%s, %s, %s, now()) ON CONFLICT (name) "
        "DO UPDATE SET xid = EXCLUDED.xid, seq = EXCLUDED.seq, seen = now()",
        (name, applied.xid, applied.seq),
    )


def pruned_through(conn: Conn) -> Position:
    """The last change pruned from the log (a follower behind it must reload)."""
    row = conn.execute("SELECT value FROM kalos.meta WHERE key = 'pruned_through'").fetchone()
    xid, _, seq = (row[0] if row else "0.0").partition(".")
    return Position(int(xid), int(seq or 0))


def prune(conn: Conn, retention_s: float, batch: int = 10000) -> int:
    """Drop followers silent for longer than ``retention_s``, then the changes every live follower
    has applied, in batches (short transactions: a long one would hold back every follower's
    horizon). One sidecar prunes at a time. Returns the changes deleted (autocommit conn)."""
    deleted = 0
    while True:
        with conn.transaction():
            got = conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (PRUNE_LOCK,)).fetchone()
            if not got or not got[0]:
                return deleted
            conn.execute("DELETE FROM kalos.followers WHERE seen < now() - make_interval(secs => %s)", (retention_s,))
            low = conn.execute("SELECT xid, seq FROM kalos.followers ORDER BY xid, seq LIMIT 1").fetchone()
            if low is None:
                return deleted
            rows = conn.execute(
                "DELETE FROM kalos.changes WHERE (xid, seq) IN (SELECT xid, seq FROM kalos.changes "
                "WHERE (xid, seq) <= (%s, %s) ORDER BY xid, seq LIMIT %s) RETURNING xid, seq",
                (low[0], low[1], batch),
            ).fetchall()
            if not rows:
                return deleted
            last = max(Position(int(x), int(s)) for x, s in rows)
            conn.execute(
                "UPDATE kalos.meta SET value = %s WHERE key = 'pruned_through' AND "
                "string_to_array(value, '.')::bigint[] < ARRAY[%s, %s]::bigint[]",
                (f"{last.xid}.{last.seq}", last.xid, last.seq),
            )
            deleted += len(rows)
            if len(rows) < batch:
                return deleted
