"""A small blocking client for code without an event loop, on the same contract as the pool."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, cast

import numpy as np

from ..broker.errors import (
    AcquireTimeout, BrokerUnavailable, ClosedError, ForkedPoolError, KalosError, ProtocolError, ResponseTimeout,
)
from ..broker.layout import Layout, Op, latency_op
from ..broker.positions import Position
from ._requests import (
    DEFAULT, Timeout, resolve_timeout, NamespaceCache, Prepared, count as encode_count, delete as encode_delete, drop as encode_drop, export_page as encode_export_page, get as encode_get, list_namespaces as encode_list_namespaces, merge_records, read as read_slot, recall as encode_recall, upsert as encode_upsert, wait_after, write as write_slot,
)
from ._attach import Attachment, Connect, attach
from ._transport import ClientSlot, Connection
from ._writes import failure, fate
from .results import Hits, Records, Written, written

DEFAULT_SPIN_US = 250.0
_READS = frozenset({Op.RECALL, Op.LIST_NAMESPACES, Op.EXPORT, Op.GET, Op.COUNT})
_SLICE_S = 0.05
_NO_IDS = np.empty(0, np.int64)  # a delete by filter names no ids


class RecallClient:
    """One leased slot; one request at a time (calls from several threads are serialised).

    ``timeout`` (seconds, None = no limit) is the default budget of each call. A request that times
    out stays in flight: the next call first waits for the sidecar to finish it, so a stale answer
    never reaches a later caller. Opening waits up to ``connect_timeout`` for a sidecar to serve
    the name. Restarts and forks as for :class:`~kalos.clients.pool.RecallPool` (``reconnect``).
    """

    def __init__(self, name: str = "default", *, timeout: float | None = None,
                 spin_us: float = DEFAULT_SPIN_US, max_spin_us: float = 2000.0,
                 connect_timeout: float = 10.0, sidecar_uid: int | None = None,
                 reconnect: bool = True, connect: Connect | None = None) -> None:
        self.name = name
        self._connect: Connect = connect or _connect
        self._sidecar_uid = sidecar_uid
        self._reconnect = reconnect
        self._rng = random.Random()
        self._pid = os.getpid()
        self._broken: Exception | None = None
        self._conn: Connection | None = None
        self._slot: ClientSlot
        self._timeout = timeout
        self._spin_s = spin_us * 1e-6
        self._max_spin_s = max(self._spin_s, max_spin_us * 1e-6)
        self._rt_ewma_s = 0.0  # typical post -> answer time; the spin window follows it
        self._lock = threading.Lock()
        self._pending = False  # a timed-out request is still in the slot
        self._closed = False
        self._ns = NamespaceCache()
        self._attach(time.monotonic() + connect_timeout, reconnect, f"within {connect_timeout} s")
        assert self._conn is not None
        self._layout: Layout = self._conn.layout

    def _attach(self, deadline: float | None, wait_for_sidecar: bool, within: str) -> None:
        """Attach and lease one slot (:func:`clients._attach.attach`, its pauses slept here:
        each one clipped to ``deadline``)."""
        steps = attach(self._connect, self.name, self._sidecar_uid, size=1, min_size=1,
                       deadline=deadline, wait_for_sidecar=wait_for_sidecar, within=within,
                       clock=time.monotonic, rng=self._rng)
        try:
            while True:
                time.sleep(next(steps))
        except StopIteration as done:
            conn, slots = cast(Attachment, done.value)
        finally:
            steps.close()
        self._conn, self._slot = conn, slots[0]
        self._metric = conn.metric
        self._pending = False
        self._payload_limit = conn.payload_limit

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def metric(self) -> str:
        """The sidecar's ``--metric`` (``"dot"``, ``"cosine"`` or ``"l2"``): what the scores mean."""
        return self._metric

    def __enter__(self) -> RecallClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the slot back. Closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if os.getpid() != self._pid or self._conn is None:
                return  # a forked copy (the parent's lease) or no sidecar: nothing to give back
            try:
                if self._pending:
                    self._conn.give_back([], [self._slot])
                else:
                    self._conn.give_back([self._slot], [])
            except BrokerUnavailable:
                pass
            finally:
                self._conn.close()

    def recall(self, vector: Any, k: int = 10, *, namespace: str = "default",
               timeout: Timeout = DEFAULT, with_payload: bool = False,
               where: dict[str, Any] | None = None, after: Position | str | None = None) -> Hits:
        """Top-k of one vector; see RecallPool.recall for semantics (``after=`` too) and errors."""
        t0 = time.monotonic_ns()
        p = encode_recall(self.layout, vector, k, self._ns.encode(namespace), with_payload, True,
                             where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast(Hits, self._call(p, timeout, t0))

    def recall_many(self, vectors: Any, k: int = 10, *, namespace: str = "default",
                    timeout: Timeout = DEFAULT, with_payload: bool = False,
                    where: dict[str, Any] | None = None,
                    after: Position | str | None = None) -> list[Hits]:
        t0 = time.monotonic_ns()
        p = encode_recall(self.layout, vectors, k, self._ns.encode(namespace), with_payload, False,
                             where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast("list[Hits]", self._call(p, timeout, t0))

    def upsert(self, ids: Any, vectors: Any, payloads: list[Any] | None = None, *,
               namespace: str = "default", timeout: Timeout = DEFAULT) -> Written:
        """Insert or replace records; see RecallPool.upsert. Chunks go one after the other; after
        a failure no further chunk is sent."""
        return self._write(Op.UPSERT, encode_upsert(self.layout, ids, vectors, payloads, namespace,
                                                    self._payload_limit), timeout)

    def delete(self, ids: Any = None, *, where: dict[str, Any] | None = None,
               namespace: str = "default", timeout: Timeout = DEFAULT) -> Written:
        """Delete by ids or by filter; see RecallPool.delete."""
        return self._write(Op.DELETE, encode_delete(self.layout, ids, namespace, where), timeout)

    def _write(self, op: Op, preps: list[Prepared], budget: Timeout) -> Written:
        """The chunks of one upsert or delete, in turn, within one budget; the error of a call
        that fails part way names the ids by fate (clients._writes.failure)."""
        deadline = self._deadline(budget)
        results: list[Any] = [None] * len(preps)
        for i in range(len(preps)):
            try:
                if deadline is not None and time.monotonic() >= deadline:  # never post what
                    raise AcquireTimeout(  # nobody will wait for
                        "the call's time budget ran out before this part was sent")
                # Each chunk is timed from its own start (its latency), the budget is the call's.
                results[i] = self._call_until(preps[i], deadline, time.monotonic_ns())
            except KalosError as e:
                fates = [fate(isinstance(r, int), p.posted, p.status) for p, r in zip(preps, results)]
                err = failure(op, e, [p.ids if p.ids is not None else _NO_IDS for p in preps], fates)
                if err is e:
                    raise
                raise err from e
        return written(results)

    def get(self, ids: Any, *, namespace: str = "default", with_vectors: bool = True,
            timeout: Timeout = DEFAULT, after: Position | str | None = None) -> Records:
        """Records by id; see RecallPool.get for semantics and errors."""
        t0 = time.monotonic_ns()
        preps = encode_get(self.layout, ids, namespace, with_vectors)
        if after is not None:
            wait_after(preps, after, t0, resolve_timeout(timeout, self._timeout))
        parts = [cast(Records, self._call(p, timeout, t0)) for p in preps]
        return merge_records(preps, parts, self.layout.dim)

    def drop_namespace(self, namespace: str, *, timeout: Timeout = DEFAULT) -> Written:
        return cast(Written, self._call(encode_drop(namespace), timeout, time.monotonic_ns()))

    def namespaces(self, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Every namespace with its row count."""
        return cast("dict[str, int]", self._call(encode_list_namespaces(), timeout, time.monotonic_ns()))

    def export_page(self, namespace: str, after: int = -1, *, where: dict[str, Any] | None = None,
                    timeout: Timeout = DEFAULT) -> tuple[Any, Any, list[Any]]:
        """Up to max_queries records with id > ``after`` in ascending id order (matching ``where``
        if given): (ids int64, vectors float32 as stored, payloads). Raises UnknownNamespace."""
        return cast("tuple[Any, Any, list[Any]]", self._call(
            encode_export_page(self.layout, namespace, after, where), timeout, time.monotonic_ns()))

    def count(self, namespace: str = "default", where: dict[str, Any] | None = None, *,
              timeout: Timeout = DEFAULT, after: Position | str | None = None) -> int:
        """Records in ``namespace`` (matching ``where`` if given); see RecallPool.count."""
        t0 = time.monotonic_ns()
        p = encode_count(self.layout, namespace, where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return cast(int, self._call(p, timeout, t0))

    def _deadline(self, budget: Timeout) -> float | None:
        timeout = resolve_timeout(budget, self._timeout)
        return None if timeout is None else time.monotonic() + timeout

    def _call(self, p: Prepared, budget: Timeout, t0: int) -> Any:
        return self._call_until(p, self._deadline(budget), t0)

    def _call_until(self, p: Prepared, deadline: float | None, t0: int) -> Any:
        if os.getpid() != self._pid:  # before the lock: a fork may have copied it held
            raise ForkedPoolError(
                f"this client was opened in process {self._pid} and cannot be used in process "
                f"{os.getpid()} (a fork): open one in each worker after forking")
        # Another thread's call holds the slot: waiting for it is part of this call's budget.
        if not self._lock.acquire(timeout=-1 if deadline is None
                                  else max(0.0, deadline - time.monotonic())):
            raise AcquireTimeout("no slot within the time budget (the client's one slot was "
                                 "busy with another thread's call)")
        try:
            return self._call_locked(p, deadline, t0)
        finally:
            self._lock.release()

    def _call_locked(self, p: Prepared, deadline: float | None, t0: int) -> Any:
        if self._closed:
            raise ClosedError("client is closed")
        if self._broken is not None:
            raise self._broken
        while True:
            if self._conn is None or self._conn.quiet():
                self._ensure_attached(deadline)
            assert self._conn is not None
            try:
                return self._roundtrip(self._slot, p, deadline, t0)
            except BrokerUnavailable as e:
                if not self._reconnect:
                    self._broken = e
                    raise
                self._drop()  # the answer can no longer come from this sidecar
                if p.op in _READS and (deadline is None or time.monotonic() < deadline):
                    continue  # a read: send it again to the next sidecar, same budget
                raise BrokerUnavailable(f"{e} (the request was in flight; the client "
                                        "re-attaches on its next call)") from None

    def _ensure_attached(self, deadline: float | None) -> None:
        """Before posting: a sidecar that died or stopped is replaced (waiting within the
        call's budget for the next one to serve the name)."""
        if self._conn is not None:
            try:
                self._conn.check_alive()
                return
            except BrokerUnavailable as e:
                if not self._reconnect:
                    self._broken = e
                    raise
                self._drop()
        self._attach(deadline, True, "within the call's time budget")
        assert self._conn is not None
        new = self._conn.layout
        old = self._layout
        if (new.dim, new.max_k, new.max_queries, new.blob_bytes) != \
                (old.dim, old.max_k, old.max_queries, old.blob_bytes):
            self._drop(give_back=True)
            self._broken = ProtocolError(
                f"broker {self.name!r} came back with another geometry (dim {new.dim}, was "
                f"{old.dim}; max_k {new.max_k}, was {old.max_k}): reopen the client")
            raise self._broken

    def _drop(self, give_back: bool = False) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if give_back:
                    conn.give_back([self._slot], [])
            except BrokerUnavailable:
                pass
            finally:
                conn.close()
        self._pending = False

    def _roundtrip(self, s: ClientSlot, p: Prepared, deadline: float | None,
                   t0: int) -> Any:
        op = latency_op(p.op, p.single)
        if self._pending:  # finish the abandoned request first
            self._wait(s, deadline, op)
            s.set_free()
            self._pending = False
        blob_len = write_slot(s.view, p)
        s.post(p.op, p.ns, p.k, p.nq, p.flags, blob_len, t0)
        p.posted = True
        self._pending = True
        self._wait(s, deadline, op)
        self._pending = False
        try:
            result = read_slot(s.view, s.outcome(), p)
        except Exception:
            s.record(time.monotonic_ns() - t0, ok=False, op=op)
            s.set_free()
            raise
        s.record(time.monotonic_ns() - t0, ok=True, op=op)
        s.set_free()
        return result

    def _wait(self, s: ClientSlot, deadline: float | None, op: int) -> None:
        """Spin briefly on the slot state, then block on its response semaphore in slices,
        checking the sidecar's liveness between slices."""
        t0 = time.perf_counter()
        end = t0 + (min(self._max_spin_s, max(self._spin_s, 2.0 * self._rt_ewma_s)) if self._spin_s else 0.0)
        while time.perf_counter() < end:
            if s.is_done() and s.try_consume():
                self._rt_ewma_s += 0.2 * (time.perf_counter() - t0 - self._rt_ewma_s)
                return
        while True:
            budget = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if budget <= 0:
                s.record(0, ok=False, timed_out=True, op=op)
                raise ResponseTimeout("no answer within the time budget")
            if s.wait(budget):
                self._rt_ewma_s += 0.2 * (time.perf_counter() - t0 - self._rt_ewma_s)
                return
            assert self._conn is not None
            self._conn.check_alive()


def _connect(name: str, sidecar_uid: int | None) -> Connection:
    return Connection(name, sidecar_uid=sidecar_uid)
