"""The blocking driver of the client core: :class:`RecallClient`, one leased slot for code
without an event loop, on the same contract as the pool.

It drives the same pieces as the pool (``clients._attach``, ``clients._exchange``,
``clients._writes``, ``broker.waiting``) in the calling thread: attaching and re-attaching sleep
their pauses, and waiting for an answer polls the slot for the spin-then-block policy's window,
then blocks on the response semaphore in slices, checking the sidecar's liveness between them.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from ..broker.clock import Recency
from ..broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    KalosError,
    ProtocolError,
    ResponseTimeout,
)
from ..broker.layout import Layout, Op, latency_op
from ..broker.positions import Position
from ..broker.waiting import DEFAULT_SPIN_US, MAX_SPIN_US, SpinThenBlock
from ._attach import Attacher, Attachment, Connect, drive
from ._exchange import Exchange, resend_after_outage
from ._life import Driver, PoolState, refusal
from ._requests import (
    DEFAULT,
    FastRows,
    NamespaceCache,
    Prepared,
    Timeout,
    merge_records,
    recall_one,
    recall_rows,
    resolve_timeout,
    wait_after,
)
from ._requests import count as encode_count
from ._requests import delete as encode_delete
from ._requests import drop as encode_drop
from ._requests import export_page as encode_export_page
from ._requests import get as encode_get
from ._requests import list_namespaces as encode_list_namespaces
from ._requests import set_ttl as encode_set_ttl
from ._requests import touch as encode_touch
from ._requests import upsert as encode_upsert
from ._slots import ClientSlot
from ._transport import Connection
from ._writes import out_of_budget, settle
from .results import Hits, Records, Written

R = TypeVar("R")
_SLICE_S = 0.05  # a blocked wait looks at the sidecar's liveness this often (seconds)


class RecallClient:
    """One leased slot; one request at a time (calls from several threads are serialised).

    ``timeout`` (seconds, None = no limit) is the default budget of each call. A request that times
    out stays in flight: the next call first waits for the sidecar to finish it, so a stale answer
    never reaches a later caller. Opening waits up to ``connect_timeout`` for a sidecar to serve
    the name, and for a slot while other processes hold every one (elastic pools give back what
    they hold beyond their ``min_size``; then SlotsExhausted). Restarts and forks as for
    :class:`~kalos.clients.pool.RecallPool` (``reconnect``).
    """

    def __init__(
        self,
        name: str = "default",
        *,
        timeout: float | None = None,
        spin_us: float = DEFAULT_SPIN_US,
        max_spin_us: float = MAX_SPIN_US,
        connect_timeout: float = 10.0,
        sidecar_uid: int | None = None,
        reconnect: bool = True,
        connect: Connect | None = None,
    ) -> None:
        self.name = name
        # Slots held by others are waited for (within the budget, announced to the elastic
        # pools, which give back what they hold beyond their min_size): clients.pool.LeasePlan.
        self._attacher = Attacher(
            connect or _connect,
            name,
            sidecar_uid,
            size=1,
            min_size=1,
            for_pool=False,
            rng=random.Random(),
            wait_for_slots=True,
        )
        self._reconnect = reconnect
        self._pid = os.getpid()
        self._state = PoolState.NEW
        self._broken: KalosError | None = None  # the cause, while BROKEN
        self._timeout = timeout
        self._policy = SpinThenBlock(spin_us, max_spin_us)
        self._lock = threading.Lock()
        self._pending: Exchange[Any, None] | None = None  # a timed-out request still in the slot
        self._ns = NamespaceCache()
        self._conn: Connection | None = None
        self._slot: ClientSlot
        self._install(
            drive(self._attacher.attach(time.monotonic() + connect_timeout, reconnect, f"within {connect_timeout} s"))
        )
        assert self._conn is not None
        self._layout: Layout = self._conn.layout
        self._state = PoolState.OPEN

    def _install(self, att: Attachment) -> None:
        self._conn, self._slot = att.conn, att.slots[0]
        self._fast = cast("FastRows | None", att.conn.cslot)
        self._slot_path = att.conn.slot_path.path
        self._metric = att.conn.metric
        self._payload_limit = att.conn.payload_limit
        self._pending = None

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def metric(self) -> str:
        """The sidecar's ``--metric`` (``"dot"``, ``"cosine"`` or ``"l2"``): what the scores mean."""
        return self._metric

    @property
    def slot_path(self) -> str:
        """``"compiled"`` (``clients/_cslot.c``) or ``"python"``: who does this client's byte
        work on the slot (``broker.slotpath``; ``KALOS_PURE_PYTHON=1`` forces Python)."""
        return self._slot_path.value

    def __enter__(self) -> RecallClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the slot back (to the sidecar's reaper if a request is still in it). Closing
        twice is fine."""
        with self._lock:
            if self._state is PoolState.CLOSED:
                return
            self._state = PoolState.CLOSED
            if os.getpid() != self._pid or self._conn is None:
                return  # a forked copy (the parent's lease) or no sidecar: nothing to give back
            busy = [self._slot] if self._pending is not None else []
            Attachment(self._conn, [self._slot]).end(busy)

    def _refusal(self) -> KalosError:
        err = refusal(self._state, self._broken, self._pid, os.getpid(), Driver.CLIENT)
        assert err is not None
        return err

    def _break(self, e: KalosError) -> None:
        """No more service from this client: every later call raises ``e``."""
        self._state, self._broken = PoolState.BROKEN, e

    def recall(
        self,
        vector: Any,
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        with_payload: bool = False,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        with_times: bool = False,
        refresh_ttl: bool = False,
    ) -> Hits:
        """Top-k of one vector; see RecallPool.recall for semantics (``after=``, ``recency=``,
        ``with_times``, ``refresh_ttl`` too) and errors."""
        t0 = time.monotonic_ns()
        p = recall_one(
            self.layout,
            vector,
            k,
            self._ns.encode(namespace),
            with_payload,
            where,
            self._fast,
            recency=recency,
            with_times=with_times,
            refresh_ttl=refresh_ttl,
        )
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return self._call(p, timeout, t0)

    def recall_many(
        self,
        vectors: Any,
        k: int = 10,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        with_payload: bool = False,
        where: dict[str, Any] | None = None,
        after: Position | str | None = None,
        recency: Recency | None = None,
        with_times: bool = False,
        refresh_ttl: bool = False,
    ) -> list[Hits]:
        """Top-k for each row; see RecallPool.recall_many."""
        t0 = time.monotonic_ns()
        p = recall_rows(
            self.layout,
            vectors,
            k,
            self._ns.encode(namespace),
            with_payload,
            where,
            self._fast,
            recency=recency,
            with_times=with_times,
            refresh_ttl=refresh_ttl,
        )
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return self._call(p, timeout, t0)

    def upsert(
        self,
        ids: Any,
        vectors: Any,
        payloads: list[Any] | None = None,
        *,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
        ttl: float | Sequence[float | None] | None = None,
    ) -> Written:
        """Insert or replace records (``ttl``: as for RecallPool.upsert); see RecallPool.upsert.
        Chunks go one after the other; after a failure no further chunk is sent."""
        return self._write(
            Op.UPSERT, encode_upsert(self.layout, ids, vectors, payloads, namespace, self._payload_limit, ttl), timeout
        )

    def touch(
        self, ids: Any, *, namespace: str = "default", ttl: float | None = None, timeout: Timeout = DEFAULT
    ) -> Written:
        """Restart the expiry clock of records; see RecallPool.touch."""
        return self._write(Op.TOUCH, encode_touch(self.layout, ids, namespace, ttl), timeout)

    def set_default_ttl(self, namespace: str, ttl: float | None, *, timeout: Timeout = DEFAULT) -> Written:
        """The namespace's default TTL; see RecallPool.set_default_ttl."""
        return self._call(encode_set_ttl(namespace, ttl), timeout, time.monotonic_ns())

    def delete(
        self,
        ids: Any = None,
        *,
        where: dict[str, Any] | None = None,
        namespace: str = "default",
        timeout: Timeout = DEFAULT,
    ) -> Written:
        """Delete by ids or by filter; see RecallPool.delete."""
        return self._write(Op.DELETE, encode_delete(self.layout, ids, namespace, where), timeout)

    def _write(self, op: Op, preps: list[Prepared[Written]], budget: Timeout) -> Written:
        """The chunks of one upsert or delete, in turn, within one budget; after a failure no
        further chunk is sent, and the error names the ids by fate (clients._writes.settle)."""
        deadline = self._deadline(budget)
        results: list[object] = [None] * len(preps)
        for i, p in enumerate(preps):
            try:
                spent = out_of_budget(deadline, time.monotonic())
                if spent is not None:
                    raise spent
                # Each chunk is timed from its own start (its latency), the budget is the call's.
                results[i] = self._call_until(p, deadline, time.monotonic_ns())
            except KalosError as e:
                results[i] = e
                break
        return settle(op, preps, results)

    def get(
        self,
        ids: Any,
        *,
        namespace: str = "default",
        with_vectors: bool = True,
        timeout: Timeout = DEFAULT,
        after: Position | str | None = None,
        refresh_ttl: bool = False,
    ) -> Records:
        """Records by id; see RecallPool.get for semantics and errors."""
        t0 = time.monotonic_ns()
        preps = encode_get(self.layout, ids, namespace, with_vectors, refresh_ttl)
        if after is not None:
            wait_after(preps, after, t0, resolve_timeout(timeout, self._timeout))
        parts = [self._call(p, timeout, t0) for p in preps]
        return merge_records(preps, parts, self.layout.dim)

    def drop_namespace(self, namespace: str, *, timeout: Timeout = DEFAULT) -> Written:
        return self._call(encode_drop(namespace), timeout, time.monotonic_ns())

    def namespaces(self, *, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """Every namespace with its row count."""
        return self._call(encode_list_namespaces(), timeout, time.monotonic_ns())

    def export_page(
        self, namespace: str, after: int = -1, *, where: dict[str, Any] | None = None, timeout: Timeout = DEFAULT
    ) -> tuple[Any, Any, list[Any]]:
        """Up to max_queries records with id > ``after`` in ascending id order (matching ``where``
        if given): (ids int64, vectors float32 as stored, payloads); none for a namespace that
        does not exist."""
        return self._call(encode_export_page(self.layout, namespace, after, where), timeout, time.monotonic_ns())

    def count(
        self,
        namespace: str = "default",
        where: dict[str, Any] | None = None,
        *,
        timeout: Timeout = DEFAULT,
        after: Position | str | None = None,
    ) -> int:
        """Records in ``namespace`` (matching ``where`` if given); see RecallPool.count."""
        t0 = time.monotonic_ns()
        p = encode_count(self.layout, namespace, where)
        if after is not None:
            wait_after([p], after, t0, resolve_timeout(timeout, self._timeout))
        return self._call(p, timeout, t0)

    def _deadline(self, budget: Timeout) -> float | None:
        timeout = resolve_timeout(budget, self._timeout)
        return None if timeout is None else time.monotonic() + timeout

    def _call(self, p: Prepared[R], budget: Timeout, t0: int) -> R:
        return self._call_until(p, self._deadline(budget), t0)

    def _call_until(self, p: Prepared[R], deadline: float | None, t0: int) -> R:
        if os.getpid() != self._pid:  # before the lock: a fork may have copied it held
            self._state = PoolState.FORKED
            raise self._refusal()
        # Another thread's call holds the slot: waiting for it is part of this call's budget.
        if not self._lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise AcquireTimeout(
                "no slot within the time budget (the client's one slot was busy with another thread's call)"
            )
        try:
            return self._call_locked(p, deadline, t0)
        finally:
            self._lock.release()

    def _call_locked(self, p: Prepared[R], deadline: float | None, t0: int) -> R:
        if self._state is not PoolState.OPEN:
            raise self._refusal()
        while True:
            if self._conn is None or self._conn.quiet():
                self._ensure_attached(deadline)
            try:
                return self._roundtrip(p, deadline, t0)
            except BrokerUnavailable as e:
                if not self._reconnect:
                    self._break(e)
                    raise
                self._drop()  # the answer can no longer come from this sidecar
                if resend_after_outage(p, deadline, time.monotonic()):
                    continue  # a read: send it again to the next sidecar, same budget
                raise BrokerUnavailable(
                    f"{e} (the request was in flight; the client re-attaches on its next call)"
                ) from None

    def _ensure_attached(self, deadline: float | None) -> None:
        """Before posting: a sidecar that died or stopped is replaced (waiting within the
        call's budget for the next one to serve the name)."""
        if self._conn is not None:
            try:
                self._conn.check_alive()
                return
            except BrokerUnavailable as e:
                if not self._reconnect:
                    self._break(e)
                    raise
                self._drop()
        att = drive(self._attacher.attach(deadline, True, "within the call's time budget"))
        try:
            self._install(self._attacher.check_geometry(att, self._layout))
        except ProtocolError as e:
            self._break(e)  # every later call too: the client's requests no longer fit
            raise

    def _drop(self) -> None:
        """Forget an attachment whose sidecar is gone (its leases end with the connection)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            Attachment(conn, [self._slot]).end(give_back=False)
        self._pending = None

    def _roundtrip(self, p: Prepared[R], deadline: float | None, t0: int) -> R:
        op = latency_op(p.op, p.single)
        pending = self._pending
        if pending is not None:  # finish the abandoned request first
            self._wait(pending, deadline, op)
            pending.discard()
            self._pending = None
        ex = Exchange(self._slot, p, None, t0)
        ex.send()
        self._pending = ex
        self._wait(ex, deadline, op)
        self._pending = None
        _, value, error, _ = ex.answer(False)
        if error is not None:
            raise error
        assert value is not None
        return value

    def _wait(self, ex: Exchange[Any, None], deadline: float | None, op: int) -> None:
        """Poll the slot for the policy's window, then block on its response semaphore in
        slices, checking the sidecar's liveness between slices. On ResponseTimeout the
        request stays in the slot (``_pending``) and the timeout is recorded now."""
        clock = time.perf_counter_ns
        t0 = clock()
        spinning = self._policy.spinning
        slot = ex.slot
        while spinning(clock() - t0):
            if slot.answered():
                self._policy.observe(clock() - t0)
                return
        while True:
            budget = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if budget <= 0:
                slot.record(0, ok=False, timed_out=True, op=op)
                raise ResponseTimeout("no answer within the time budget")
            if slot.wait(budget):
                self._policy.observe(clock() - t0)
                return
            assert self._conn is not None
            self._conn.check_alive()


def _connect(name: str, sidecar_uid: int | None) -> Connection:
    return Connection(name, sidecar_uid=sidecar_uid)
