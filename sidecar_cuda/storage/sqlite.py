"""The embedded durable store: SQLite in WAL mode with synchronous=FULL under ``--data-dir``, an
implementation of :class:`~kalos.sidecar_cuda.storage.durable.Durable` (the fleet store,
PostgreSQL, is the other: :mod:`kalos.sidecar_cuda.storage.fleet`).

A batch's writes are committed in one transaction (group commit) *before* they are applied in memory
and acknowledged, so every acknowledged write survives kill -9 and power loss (as far as fsync does).
On start every namespace is loaded back to the backend. The store is never overwritten or
"repaired": a store that cannot be opened, is corrupt, or was made for another dim/metric stops the
sidecar with a clear message.

Schema 2 (protocol 6) keeps each record's timestamps and TTL beside it and each namespace's default
TTL in a table of its own. A schema-1 store (written before) is migrated when opened, in one
transaction, without rewriting a row: its records get ``created_at = updated_at =`` the time of
the migration and no expiry (docs/operations.md, "Upgrading to protocol 6").
"""

from __future__ import annotations

import itertools
import logging
import os
import pwd
import sqlite3
import time
from collections.abc import Callable, Iterator

import numpy as np

from ...broker.errors import ConfigError
from ...broker.positions import Position
from .durable import StoreError
from .store import MemoryStore, Stamps
from .writes import Write, WriteOp

log = logging.getLogger("kalos.sidecar")
DB_FILE = "kalos.sqlite3"
SCHEMA_VERSION = 2
#: The columns schema 2 added to ``records`` (a schema-1 store gets them when it is opened).
_STAMP_COLUMNS = ("created_at", "updated_at", "expires_at", "ttl")
#: Seconds between the start-up load's progress lines.
LOAD_REPORT_S = 5.0


#: Files SQLite keeps beside the database (it creates them with the database file's mode).
_SIDE_FILES = ("", "-wal", "-shm", "-journal")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def prepare_data_dir(data_dir: str) -> None:
    """Make sure ``data_dir`` is a directory this process's user owns, creating it (0700) if
    missing. Raises ConfigError saying what is wrong in words: a file in its place, another
    owner (a store in a directory someone else controls can be swapped under the sidecar, so
    root is refused one too), or the OS error of creating it."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ConfigError(
            f"data dir {data_dir} exists and is not a directory; give --data-dir a directory (it is created if missing)"
        )
    try:
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        owner = os.stat(data_dir).st_uid
    except OSError as e:
        raise ConfigError(
            f"cannot create data dir {data_dir}: {e.strerror}"
            f"{'' if e.filename in (None, data_dir) else f' ({e.filename})'}"
        ) from None
    me = os.geteuid()
    if owner != me:
        raise ConfigError(
            f"data dir {data_dir} is owned by uid {owner} ({_user(owner)}) but the "
            f"sidecar runs as uid {me} ({_user(me)}); chown it or pick another dir"
        )


def make_private(data_dir: str, db_path: str) -> None:
    """The data directory 0700 and the store's files 0600, whatever the umask: every vector and
    payload is in them. A looser directory or file left by an earlier version or by hand is
    tightened, with a log line. Raises ConfigError (:func:`prepare_data_dir`) or OSError."""
    prepare_data_dir(data_dir)
    mode = os.stat(data_dir).st_mode & 0o777
    if mode & 0o077:
        os.chmod(data_dir, 0o700)
        log.warning("data dir %s had mode %04o: tightened to 0700 (it holds every memory)", data_dir, mode)
    # Created here, not by SQLite, so the mode does not depend on the umask; SQLite gives its WAL
    # and shared-memory files the database file's mode.
    os.close(os.open(db_path, os.O_RDWR | os.O_CREAT, 0o600))
    for suffix in _SIDE_FILES:
        path = db_path + suffix
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            continue
        if mode & 0o077:
            os.chmod(path, 0o600)
            log.warning("store file %s had mode %04o: tightened to 0600", path, mode)


class Persistence:
    def __init__(self, data_dir: str, dim: int, metric: str) -> None:
        self.path = os.path.join(data_dir, DB_FILE)
        try:
            make_private(data_dir, self.path)
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA busy_timeout=5000")
            ok = self.db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise ConfigError(
                    f"store {self.path} is corrupt ({ok}); nothing was changed. "
                    "Restore it from a backup or start with another --data-dir"
                )
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS records (ns TEXT NOT NULL, id INTEGER NOT NULL, "
                "vec BLOB NOT NULL, payload BLOB, created_at INTEGER NOT NULL DEFAULT 0, "
                "updated_at INTEGER NOT NULL DEFAULT 0, expires_at INTEGER NOT NULL DEFAULT 0, "
                "ttl INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (ns, id)) WITHOUT ROWID"
            )
            self.db.execute("CREATE TABLE IF NOT EXISTS namespaces (ns TEXT PRIMARY KEY, default_ttl INTEGER NOT NULL)")
            self._check_meta(dim, metric)
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"cannot open store {self.path}: {e}; nothing was changed") from None
        except OSError as e:
            raise ConfigError(f"cannot prepare data dir {data_dir}: {e}") from None

    def _check_meta(self, dim: int, metric: str) -> None:
        meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        want = {"schema": str(SCHEMA_VERSION), "dim": str(dim), "metric": metric}
        if not meta:
            with self._tx():
                self.db.executemany("INSERT INTO meta VALUES (?, ?)", list(want.items()))
            return
        if meta.get("schema") == "1" and meta.get("dim") == want["dim"] and meta.get("metric") == metric:
            self._migrate_from_1()
            meta["schema"] = str(SCHEMA_VERSION)
        for key, value in want.items():
            if meta.get(key) != value:
                raise ConfigError(
                    f"store {self.path} was made with {key}={meta.get(key)}, "
                    f"this sidecar has {key}={value}; nothing was changed"
                )

    def _migrate_from_1(self, now_ns: int | None = None) -> None:
        """Schema 1 -> 2 in one transaction: the stamp columns (constant defaults: SQLite rewrites
        no row), the namespaces table, the version. Every record keeps its vector and payload and
        gets ``created_at = updated_at = now_ns`` (the migration's clock) and no expiry."""
        now = time.time_ns() if now_ns is None else now_ns
        have = {row[1] for row in self.db.execute("PRAGMA table_info(records)").fetchall()}
        with self._tx():
            for col in _STAMP_COLUMNS:
                if col not in have:
                    default = now if col in ("created_at", "updated_at") else 0
                    self.db.execute(f"ALTER TABLE records ADD COLUMN {col} INTEGER NOT NULL DEFAULT {int(default)}")
            self.db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),))
        rows = self.db.execute("SELECT count(*) FROM records").fetchone()[0]
        log.warning(
            "store %s migrated from schema 1 to %d: %d records kept, stamped created/updated now (%d ns), no expiry",
            self.path,
            SCHEMA_VERSION,
            rows,
            now,
        )

    def _tx(self) -> _Tx:
        return _Tx(self.db)

    def begin(self, store: MemoryStore) -> None:
        """Nothing to do: this sidecar is the store's only writer (``storage.datadir`` locks the
        directory), so its memory is the store's state; :meth:`commit` is one transaction."""

    def abort(self) -> None:
        """Nothing begun (see :meth:`begin`)."""

    def commit(self, writes: list[Write]) -> list[Position] | None:
        """Make the resolved ``writes`` durable, all or nothing (``durable.resolve_writes``
        first). Raises StoreError."""
        if not writes:
            return None
        try:
            with self._tx():
                for w in writes:
                    if w.op is WriteOp.UPSERT:
                        assert w.ids is not None and w.vectors is not None and w.stamps is not None
                        pls = w.payloads or [None] * len(w.ids)
                        st = w.stamps
                        self.db.executemany(
                            "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            [
                                (w.namespace, int(i), v.tobytes(), p, c, u, e, t)
                                for i, v, p, c, u, e, t in zip(
                                    w.ids.tolist(),
                                    w.vectors,
                                    pls,
                                    st.created.tolist(),
                                    st.updated.tolist(),
                                    st.expires.tolist(),
                                    st.ttl.tolist(),
                                )
                            ],
                        )
                    elif w.op in (WriteOp.DELETE, WriteOp.DELETE_WHERE, WriteOp.EXPIRE):
                        assert w.ids is not None
                        self.db.executemany(
                            "DELETE FROM records WHERE ns = ? AND id = ?",
                            [(w.namespace, int(i)) for i in w.ids.tolist()],
                        )
                    elif w.op is WriteOp.TOUCH:
                        assert w.ids is not None and w.stamps is not None
                        self.db.executemany(
                            "UPDATE records SET expires_at = ?, ttl = ? WHERE ns = ? AND id = ?",
                            [
                                (e, t, w.namespace, i)
                                for i, e, t in zip(w.ids.tolist(), w.stamps.expires.tolist(), w.stamps.ttl.tolist())
                            ],
                        )
                    elif w.op is WriteOp.SET_TTL:
                        self.db.execute(
                            "INSERT OR REPLACE INTO namespaces VALUES (?, ?)", (w.namespace, int(w.ttl_ns or 0))
                        )
                    elif w.op is WriteOp.DROP:
                        self.db.execute("DELETE FROM records WHERE ns = ?", (w.namespace,))
                        self.db.execute("DELETE FROM namespaces WHERE ns = ?", (w.namespace,))
        except sqlite3.Error as e:
            raise StoreError(str(e)) from None
        return None

    def applied_through(self, position: Position | None) -> None:
        """Nothing to do: one host, no change log."""

    def namespaces(self) -> list[tuple[str, int]]:
        """(namespace, records) of every namespace that holds records or a default TTL."""
        counts = dict(self.db.execute("SELECT ns, count(*) FROM records GROUP BY ns").fetchall())
        for (name,) in self.db.execute("SELECT ns FROM namespaces").fetchall():
            counts.setdefault(name, 0)
        return sorted(counts.items())

    def default_ttls(self) -> dict[str, int]:
        """The namespaces' default TTLs (ns) that were set."""
        return dict(self.db.execute("SELECT ns, default_ttl FROM namespaces").fetchall())

    def scan(
        self, namespace: str, dim: int, chunk: int = 65536
    ) -> Iterator[tuple[np.ndarray, np.ndarray, list[bytes | None], Stamps]]:
        """Yield (ids, vectors, payloads, stamps) chunks of one namespace."""
        cur = self.db.execute(
            "SELECT id, vec, payload, created_at, updated_at, expires_at, ttl FROM records WHERE ns = ? ORDER BY id",
            (namespace,),
        )
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                return
            m = len(rows)
            ids = np.fromiter((r[0] for r in rows), np.int64, m)
            raw = b"".join(r[1] for r in rows)
            if len(raw) != 4 * dim * m:
                raise ConfigError(f"store {self.path}: vector of wrong length in namespace {namespace!r}")
            vecs = np.frombuffer(raw, np.float32).reshape(m, dim)
            stamps = Stamps(*(np.fromiter((r[c] for r in rows), np.int64, m) for c in range(3, 7)))
            yield ids, vecs, [r[2] for r in rows], stamps

    def scan_all(
        self, dim: int, chunk: int = 65536
    ) -> Iterator[tuple[str, np.ndarray, np.ndarray, list[bytes | None], Stamps]]:
        """Yield (namespace, ids, vectors, payloads, stamps) of every record, namespace after
        namespace, in one pass over the table (its key order): a store of 100k namespaces loads
        without a query per namespace."""
        cur = self.db.execute(
            "SELECT ns, id, vec, payload, created_at, updated_at, expires_at, ttl FROM records ORDER BY ns, id"
        )
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                return
            for name, group in itertools.groupby(rows, key=lambda r: r[0]):
                part = list(group)
                m = len(part)
                raw = b"".join(r[2] for r in part)
                if len(raw) != 4 * dim * m:
                    raise ConfigError(f"store {self.path}: vector of wrong length in namespace {name!r}")
                ids = np.fromiter((r[1] for r in part), np.int64, m)
                vecs = np.frombuffer(raw, np.float32).reshape(m, dim)
                stamps = Stamps(*(np.fromiter((r[c] for r in part), np.int64, m) for c in range(4, 8)))
                yield name, ids, vecs, [r[3] for r in part], stamps

    def load_into(
        self,
        store: MemoryStore,
        *,
        every_s: float = LOAD_REPORT_S,
        chunk: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> tuple[int, float]:
        """Load every namespace into ``store`` (a MemoryStore); returns (rows, seconds). Logs the
        rows to load first, then how far it got every ``every_s`` seconds (a large store takes
        minutes and the sidecar is not ready until it is done)."""
        t0 = time.perf_counter()
        total = 0
        try:
            counts = self.namespaces()
            want = sum(n for _ns, n in counts)
            log.info("loading %s rows in %d namespaces from %s", f"{want:,}", len(counts), self.path)
            last = clock()
            defaults = self.default_ttls()
            for ns_name, count in counts:  # (those with a default TTL and no rows too)
                store.get_or_create(ns_name, capacity=count).default_ttl = int(defaults.get(ns_name, 0))
            for ns_name, ids, vecs, pls, stamps in self.scan_all(store.dim, chunk):
                store.get_or_create(ns_name).upsert(ids, vecs, pls, stamps)
                total += len(ids)
                now = clock()
                if now - last >= every_s:
                    last = now
                    log.info(
                        "loading: %s of %s rows (%.0f%%), namespace %r",
                        f"{total:,}",
                        f"{want:,}",
                        100.0 * total / max(want, 1),
                        ns_name,
                    )
        except (sqlite3.DatabaseError, ValueError) as e:
            raise ConfigError(f"store {self.path} cannot be read ({e}); nothing was changed") from None
        return total, time.perf_counter() - t0

    def close(self) -> None:
        self.db.close()


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, et, ev, tb) -> None:  # type: ignore[no-untyped-def]
        self.db.execute("COMMIT" if et is None else "ROLLBACK")
