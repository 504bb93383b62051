"""A sidecar of a fleet: PostgreSQL is the system of record (:mod:`kalos.sidecar_cuda.storage.pgstore`),
this sidecar's memory a replica that follows it.

Threads and who touches what:

* the **serving thread** is the only one that changes the memory store. It commits its own
  batches (:meth:`FleetStore.commit`: take the fleet's write lock, apply the changes other nodes
  committed since its cursor, resolve deletes by filter, write, commit) and applies followed
  changes between batches (:meth:`FleetStore.apply_pending`, with nothing in flight on the
  backend). One thread, one order: the store never needs a lock, and a sidecar's own write is
  applied after everything committed before it, so its next read sees it and nothing older.
* the **follower thread** (:class:`Follower`) holds its own connection: LISTEN for commits (and
  poll as a fallback), read the log below the horizon, queue decoded changes for the serving
  thread and post the doorbell; heartbeat its position, prune the log, reload in the background
  when its cursor was pruned. It never touches the store.

Applying is idempotent (whole records replaced, deletes of what is gone remove nothing): a change
seen twice, or this sidecar's own write seen again, changes nothing. See docs/deploy.md, "Several
nodes", for the guarantees.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import psycopg
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ...broker.errors import ConfigError
from ...broker.layout import Metric as MetricKind
from ...broker.positions import ORIGIN, Position
from ..backends.base import Backend
from .durable import StoreError
from .pgstore import (
    CHANNEL,
    Change,
    Conn,
    Defaults,
    StoreUnavailable,
    Target,
    connect,
    ensure_schema,
    fetch_changes,
    heartbeat,
    lock_for_write,
    notify,
    pg_errors,
    prune,
    pruned_through,
    scrub,
    snapshot,
    write_change,
)
from .store import MemoryStore, Namespace
from .writes import Write, apply_write

log = logging.getLogger("kalos.sidecar")

#: Upper bounds of the replication lag histogram (seconds, commit -> applied here).
LAG_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Changes applied per pass of the serving loop at most (recalls wait behind one pass).
APPLY_PER_PASS = 256
#: Fetched batches waiting for the serving thread at most (the follower pauses beyond).
_QUEUED_MAX = 16


@dataclass(frozen=True)
class FleetOptions:
    """Tunables of a follower (defaults fit a fleet on one network)."""

    poll_s: float = 0.2  # re-read the log this often when no notice comes
    heartbeat_s: float = 1.0
    prune_s: float = 10.0
    retention_s: float = 600.0  # a follower silent this long is dropped; the log kept for it goes
    fetch_rows: int = 1000
    backoff_max_s: float = 5.0


def backoff_s(failures: int, cap: float, rand: Callable[[], float] = random.random) -> float:
    """Seconds before reconnect attempt ``failures`` (1, 2, ...): doubling from 0.1 s, at most
    ``cap``, with jitter so a fleet does not reconnect in step. Pure."""
    base = min(cap, 0.1 * 2.0 ** min(failures - 1, 16))
    return float(base * (0.5 + 0.5 * rand()))


def lag_bucket(lag_s: float) -> int:
    """Index of the histogram bucket of a lag (the last is +Inf). Pure."""
    for i, b in enumerate(LAG_BOUNDS_S):
        if lag_s <= b:
            return i
    return len(LAG_BOUNDS_S)


class ReplicationStats:
    """Counters the serving and follower threads write and the collector reads (plain ints and
    floats: a scrape sees each value whole)."""

    def __init__(self) -> None:
        self.lag_buckets = np.zeros(len(LAG_BOUNDS_S) + 1, np.int64)
        self.lag_sum = 0.0
        self.applied = 0  # changes applied from the log (not this sidecar's own)
        self.reloads = 0
        self.connected = False
        self.reason = "starting"  # why not connected
        self.caught_up_at = time.time()  # last time the follower found nothing newer to read
        self.down_since: float | None = None

    def observe_lag(self, lag_s: float) -> None:
        self.lag_buckets[lag_bucket(max(0.0, lag_s))] += 1
        self.lag_sum += max(0.0, lag_s)


class _NotStarted(Exception):
    """A write transaction failed before it took the write lock."""


class Handoff:
    """The follower-to-serving hand-off, declared: the follower thread (and its reload thread) only
    put, the serving thread only takes, under one lock. What is handed over: batches of decoded
    changes in log order, at most :data:`_QUEUED_MAX` batches waiting (the follower waits while the
    serving thread is behind: no unbounded memory), and a finished reload (a new store's namespaces
    and the log position they hold)."""

    def __init__(self, limit: int = _QUEUED_MAX) -> None:
        self._lock = threading.Lock()
        self._changes: deque[list[Change]] = deque()
        self._reload: tuple[dict[str, Namespace], Position] | None = None
        self._limit = limit

    # -- the follower's side
    def full(self) -> bool:
        with self._lock:
            return len(self._changes) >= self._limit

    def put_changes(self, changes: list[Change]) -> None:
        with self._lock:
            self._changes.append(changes)

    def put_reload(self, namespaces: dict[str, Namespace], cursor: Position) -> None:
        with self._lock:
            self._reload = (namespaces, cursor)

    # -- the serving thread's side
    def pending(self) -> bool:
        """Anything to take (checked every pass: one lock, no copy)."""
        with self._lock:
            return bool(self._changes) or self._reload is not None

    def take_reload(self) -> tuple[dict[str, Namespace], Position] | None:
        with self._lock:
            out, self._reload = self._reload, None
            return out

    def take_changes(self, at_most: int) -> list[Change]:
        """Up to ``at_most`` changes, in log order (a batch split across calls if need be)."""
        out: list[Change] = []
        with self._lock:
            while self._changes and len(out) < at_most:
                batch = self._changes[0]
                room = at_most - len(out)
                out += batch[:room]
                if len(batch) > room:
                    self._changes[0] = batch[room:]
                else:
                    self._changes.popleft()
        return out


class FleetStore:
    """The :class:`~kalos.sidecar_cuda.storage.durable.Durable` of a fleet sidecar, and its replica state:
    ``applied`` is the position up to which this sidecar's memory holds the log."""

    def __init__(
        self,
        target: Target,
        *,
        name: str,
        dim: int,
        metric: MetricKind,
        backend: Backend,
        options: FleetOptions | None = None,
    ) -> None:
        self.target = target
        self.backend = backend  # a background reload builds its store on it
        self.dim = dim
        self.metric = metric
        self.options = options or FleetOptions()
        self.member = f"{socket.gethostname()}/{name}"  # this follower's row in kalos.followers
        self._app = f"kalos {name}"
        self.applied: Position = ORIGIN
        self.stats = ReplicationStats()
        self.handoff = Handoff()  # follower -> serving thread
        self._writer: Conn | None = None
        self._xid = 0  # the write transaction begin() took the lock in
        self._writer_failures = 0
        self._writer_retry_at = 0.0
        self.follower: Follower | None = None
        with pg_errors(target, "cannot connect to the PostgreSQL store", config=True):
            conn = connect(target, self._app, autocommit=False)
        try:
            ensure_schema(conn, target, dim, metric.name.lower())
        finally:
            conn.close()

    # ------------------------------------------------------------------ start
    def load_into(self, store: MemoryStore) -> tuple[int, float]:
        """Bootstrap: register (so the log is kept for us), read one snapshot into ``store``,
        then follow from its cursor. Raises ConfigError (the sidecar does not start)."""
        t0 = time.perf_counter()
        with pg_errors(self.target, "cannot load from the PostgreSQL store", config=True):
            conn = connect(self.target, self._app, autocommit=True)
            try:
                rows, cursor = bootstrap(conn, self.member, store, self.dim)
            except ValueError as e:
                raise ConfigError(
                    f"PostgreSQL store {self.target.shown} holds a record no sidecar wrote: {e}; nothing was changed"
                ) from None
            finally:
                conn.close()
        self.applied = cursor
        self.stats.connected, self.stats.reason = True, ""
        return rows, time.perf_counter() - t0

    def start_following(self, wake: Callable[[], None]) -> None:
        """Start the follower thread (``wake``: posts the serving loop's doorbell)."""
        self.follower = Follower(self, wake)
        self.follower.start()

    # ------------------------------------------------------------------ the serving thread
    def begin(self, store: MemoryStore) -> None:
        """See :class:`~kalos.sidecar_cuda.storage.durable.Durable`. Takes the fleet's write lock
        (a transaction on the serving thread's connection) and brings the memory up to the log's
        end under it, so deletes by filter match what every node committed before them, and this
        batch's changes follow them in every replica. Raises StoreError (nothing begun)."""
        try:
            try:
                self._begin_once(self._writer_conn(), store)
            except _NotStarted:
                # A connection broken while idle (the database restarted since the last write)
                # fails at the first statement, before anything was written: connect once more.
                self._drop_writer()
                self._begin_once(self._writer_conn(), store)
        except (psycopg.Error, _NotStarted) as e:
            raise self._failed(e) from None
        except ValueError as e:  # a change no sidecar wrote: apply nothing more from it
            raise StoreError(f"PostgreSQL store {self.target.shown}: {e}") from None

    def _begin_once(self, conn: Conn, store: MemoryStore) -> None:
        """One attempt of :meth:`begin`. Raises _NotStarted if the connection failed before the
        transaction took the write lock (nothing was sent that could have been committed)."""
        try:  # (the connection is not in autocommit mode: this statement begins the transaction)
            self._xid = lock_for_write(conn)
        except psycopg.OperationalError as e:
            raise _NotStarted() from e
        try:
            while True:  # catch up: no writer runs now, so every change is readable
                changes = fetch_changes(conn, self.applied, 4096, self.dim, below_horizon=False)
                self._apply(changes, store, observe=False)
                if len(changes) < 4096:
                    break
        except BaseException:
            self._rollback(conn)
            raise

    def commit(self, writes: list[Write]) -> list[Position]:
        """See :class:`~kalos.sidecar_cuda.storage.durable.Durable`: the resolved writes and their
        change-log rows, then COMMIT, ending what :meth:`begin` began. Returns each write's
        position (a write that changed nothing: the position before it). Raises StoreError
        (nothing of the batch is then applied here; it may have been committed if the
        connection broke during COMMIT, as with any database)."""
        conn, xid = self._writer, self._xid
        assert conn is not None, "commit() without begin()"
        try:
            try:
                positions = []
                last = self.applied
                for w in writes:
                    seq = write_change(conn, xid, w)
                    if seq is not None:
                        last = Position(xid, seq)
                    positions.append(last)
                notify(conn)
                conn.commit()
            except BaseException:
                self._rollback(conn)
                raise
        except psycopg.Error as e:
            raise self._failed(e) from None
        except ValueError as e:  # a write the change log cannot hold
            raise StoreError(f"PostgreSQL store {self.target.shown}: {e}") from None
        self._writer_failures = 0
        return positions

    def abort(self) -> None:
        if self._writer is not None:
            self._rollback(self._writer)

    @staticmethod
    def _rollback(conn: Conn) -> None:
        try:
            conn.rollback()
        except psycopg.Error:
            pass  # (a broken connection: the server rolls back on its own)

    def _failed(self, e: BaseException) -> StoreError:
        """The writer's connection failed (``e``): back off, and the error a caller gets."""
        self._writer_broken()
        cause = e.__cause__ if isinstance(e, _NotStarted) else e
        return StoreError(scrub(f"PostgreSQL store {self.target.shown}: {str(cause).strip()}", self.target))

    def applied_through(self, position: Position | None) -> None:
        if position is not None and position > self.applied:
            self.applied = position

    def _writer_conn(self) -> Conn:
        """The serving thread's connection, (re)made on demand. While the store is unreachable a
        write fails at once until the next attempt is due (backoff), so a dead store costs the
        serving loop one failed connect per backoff period, not one per write."""
        if self._writer is not None and not self._writer.closed:
            return self._writer
        now = time.monotonic()
        if now < self._writer_retry_at:
            raise StoreError(
                f"PostgreSQL store {self.target.shown} unreachable "
                f"({self.stats.reason}); next attempt in {self._writer_retry_at - now:.1f} s"
            )
        try:
            with pg_errors(self.target, "cannot connect to the PostgreSQL store"):
                self._writer = connect(self.target, self._app, autocommit=False, connect_timeout=2)
        except StoreUnavailable as e:
            self._writer_broken()
            raise StoreError(str(e)) from None
        return self._writer

    def _drop_writer(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except psycopg.Error:
                pass
            self._writer = None

    def _writer_broken(self) -> None:
        self._drop_writer()
        self._writer_failures += 1
        self._writer_retry_at = time.monotonic() + backoff_s(self._writer_failures, self.options.backoff_max_s)

    def has_work(self) -> bool:
        """Followed changes or a reload wait to be applied (checked every pass: cheap)."""
        return self.handoff.pending()

    def apply_pending(self, store: MemoryStore) -> int:
        """Apply what the follower queued (at most :data:`APPLY_PER_PASS` changes; the rest next
        pass), or swap in a finished reload. Serving thread, nothing in flight. Returns the
        changes applied."""
        reload = self.handoff.take_reload()
        if reload is not None:
            namespaces, cursor = reload
            store.namespaces = namespaces
            self.applied = cursor
            # (what is queued stays: older changes are at or before the snapshot's cursor and
            # are skipped, newer ones were fetched after it and are needed)
            log.info("replica reloaded from %s; following from %s", self.target.shown, cursor)
            return 0
        changes = self.handoff.take_changes(APPLY_PER_PASS)
        return self._apply(changes, store, observe=True) if changes else 0

    def _apply(self, changes: list[Change], store: MemoryStore, *, observe: bool) -> int:
        """Apply changes after ``applied``, in order (those at or before it are skipped)."""
        n = 0
        now = time.time()
        for c in changes:
            if c.position <= self.applied:
                continue
            apply_write(store, c.write)
            self.applied = c.position
            n += 1
            if observe:
                self.stats.observe_lag(now - c.at)
        self.stats.applied += n
        return n

    # ------------------------------------------------------------------ health
    def degraded(self) -> str | None:
        """Why this replica may be stale (None: following)."""
        s = self.stats
        if s.connected:
            return None
        since = "" if s.down_since is None else f" for {time.time() - s.down_since:.1f} s"
        return (
            f"degraded: PostgreSQL store {self.target.shown} unreachable{since} ({s.reason}); "
            f"serving recalls from the local copy, applied up to {self.applied}"
        )

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self._drop_writer()


def bootstrap(conn: Conn, member: str, store: MemoryStore, dim: int) -> tuple[int, Position]:
    """Register ``member`` at the log's current start (so nothing it needs is pruned meanwhile),
    load one snapshot into ``store``, and return (rows, the cursor to follow from). Retries if
    the log was pruned past the snapshot's cursor before it registered. Raises psycopg.Error,
    ValueError."""
    while True:
        start = pruned_through(conn)
        heartbeat(conn, member, start)
        rows = 0
        cursor = ORIGIN
        for item in snapshot(conn, dim):
            if isinstance(item, Position):
                cursor = item
                continue
            if isinstance(item, dict):
                for ns_name, count in item.items():
                    store.get_or_create(ns_name, capacity=count)
                continue
            if isinstance(item, Defaults):
                for ns_name, ttl in item.ttl.items():
                    store.get_or_create(ns_name).default_ttl = int(ttl)
                continue
            ns_name, ids, vecs, pls, stamps = item
            store.get_or_create(ns_name).upsert(ids, vecs, pls, stamps)
            rows += len(ids)
        if pruned_through(conn) <= cursor:
            heartbeat(conn, member, cursor)
            return rows, cursor
        store.namespaces.clear()


class Follower(threading.Thread):
    """Reads the change log into ``fleet.handoff`` (see the module docstring)."""

    def __init__(self, fleet: FleetStore, wake: Callable[[], None]) -> None:
        super().__init__(name="kalos-follower", daemon=True)
        self.fleet = fleet
        self._wake = wake
        self._halt = threading.Event()
        self.fetched: Position = fleet.applied
        self._reloading: threading.Thread | None = None

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        f = self.fleet
        failures = 0
        while not self._halt.is_set():
            try:
                with pg_errors(f.target, "following the PostgreSQL store"):
                    conn = connect(f.target, f._app + " follower", autocommit=True)
                    try:
                        conn.execute(f"LISTEN {CHANNEL}")
                        if f.stats.down_since is not None:
                            log.info(
                                "PostgreSQL store %s reachable again: catching up from %s", f.target.shown, f.applied
                            )
                        f.stats.connected, f.stats.down_since = True, None
                        failures = 0
                        self._follow(conn)
                    finally:
                        conn.close()
            except StoreUnavailable as e:
                s = f.stats
                if s.connected or s.down_since is None:
                    log.warning("%s; recalls go on from the local copy, reconnecting", e)
                    s.down_since = time.time()
                s.connected, s.reason = False, str(e)
                failures += 1
                self._halt.wait(backoff_s(failures, f.options.backoff_max_s))
            except Exception as e:  # never let the thread die silently: log and retry
                log.exception("follower failed")
                f.stats.connected, f.stats.reason = False, f"follower failed: {type(e).__name__}: {e}"
                failures += 1
                self._halt.wait(backoff_s(failures, f.options.backoff_max_s))

    def _follow(self, conn: Conn) -> None:
        f, opt = self.fleet, self.fleet.options
        next_beat = next_prune = 0.0
        quick = 0  # re-reads soon after a notice found nothing yet (a writer below the horizon)
        while not self._halt.is_set():
            now = time.monotonic()
            if now >= next_beat:
                heartbeat(conn, f.member, f.applied)
                next_beat = now + opt.heartbeat_s
                cursor = max(self.fetched, f.applied)
                if self._reloading is None and pruned_through(conn) > cursor:
                    self._start_reload(cursor)
            if now >= next_prune:
                n = prune(conn, opt.retention_s)
                if n:
                    log.debug("pruned %d changes from the log", n)
                next_prune = now + opt.prune_s
            if self._reloading is not None or f.handoff.full():
                self._halt.wait(0.01)  # (a reload, or the serving thread is behind: no more memory)
                continue
            cursor = max(self.fetched, f.applied)
            try:
                changes = fetch_changes(conn, cursor, opt.fetch_rows, f.dim)
            except ValueError as e:
                f.stats.reason = f"unreadable change: {e}"
                log.error("the change log holds a change no sidecar wrote (%s): following stopped", e)
                self._halt.wait(opt.poll_s)
                continue
            if changes:
                self.fetched = changes[-1].position
                f.handoff.put_changes(changes)
                self._wake()
                quick = 0
                if len(changes) == opt.fetch_rows:
                    continue
            else:
                f.stats.caught_up_at = time.time()
            wait = 0.002 if quick else opt.poll_s
            got = False
            for _n in conn.notifies(timeout=wait, stop_after=1):
                got = True
            if got:
                quick = 10
            elif quick:
                quick -= 1

    def _start_reload(self, cursor: Position) -> None:
        """The log no longer holds what comes after ``cursor``: load a fresh snapshot into a new
        store in the background; the serving thread swaps it in at once when it is complete."""
        f = self.fleet
        log.warning(
            "the change log was pruned past this replica's position %s (it was away "
            "longer than the retention): reloading in the background",
            cursor,
        )

        def reload() -> None:
            try:
                fresh = MemoryStore(f.backend, f.dim, f.metric)
                with pg_errors(f.target, "reloading from the PostgreSQL store"):
                    conn = connect(f.target, f._app + " reload", autocommit=True)
                    try:
                        _rows, new_cursor = bootstrap(conn, f.member, fresh, f.dim)
                    finally:
                        conn.close()
                f.handoff.put_reload(dict(fresh.namespaces), new_cursor)
                self.fetched = new_cursor
                f.stats.reloads += 1
                self._wake()
            except Exception as e:
                log.error("reload failed (%s): retrying", e)
            finally:
                self._reloading = None

        self._reloading = threading.Thread(target=reload, name="kalos-reload", daemon=True)
        self._reloading.start()


class FleetCollector(Collector):
    """The replication metrics of a fleet sidecar (read at scrape time)."""

    def __init__(self, fleet: FleetStore) -> None:
        self.fleet = fleet

    def collect(self) -> Iterable[Metric]:
        f = self.fleet
        s = f.stats
        h = HistogramMetricFamily(
            "kalos_replication_lag_seconds", "Commit of a change in PostgreSQL (its clock) -> applied here."
        )
        cum = np.cumsum(s.lag_buckets).tolist()
        buckets = [(repr(b), float(c)) for b, c in zip(LAG_BOUNDS_S, cum)] + [("+Inf", float(cum[-1]))]
        h.add_metric([], buckets, s.lag_sum)
        yield h
        pos = GaugeMetricFamily(
            "kalos_replication_position", "Position of the change log applied here (part: xid, seq).", labels=["part"]
        )
        pos.add_metric(["xid"], f.applied.xid)
        pos.add_metric(["seq"], f.applied.seq)
        yield pos
        yield GaugeMetricFamily(
            "kalos_replication_connected",
            "1 while the follower is connected to PostgreSQL.",
            value=1.0 if s.connected else 0.0,
        )
        yield GaugeMetricFamily(
            "kalos_replication_staleness_seconds",
            "Seconds since the follower last found nothing newer to read (grows while PostgreSQL is unreachable).",
            value=max(0.0, time.time() - s.caught_up_at),
        )
        c = CounterMetricFamily("kalos_replication_changes", "Changes of other writers applied here.")
        c.add_metric([], s.applied)
        yield c
        r = CounterMetricFamily("kalos_replication_reloads", "Full reloads after the log was pruned past this replica.")
        r.add_metric([], s.reloads)
        yield r
