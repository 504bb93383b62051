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
from typing import Any, TypeVar

from ..broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    KalosError,
    ProtocolError,
    ResponseTimeout,
)
from ..broker.layout import Layout, Op, latency_op
from ..broker.waiting import DEFAULT_SPIN_US, MAX_SPIN_US, SpinThenBlock
from ._attach import Attacher, Attachment, Connect, drive
from ._core import Life, Step
from ._exchange import Exchange, resend_after_outage
from ._life import Driver, PoolState
from ._ops_sync import SyncOps
from ._requests import (
    NamespaceCache,
    Prepared,
    Timeout,
    fast_rows,
    resolve_timeout,
)
from ._slots import ClientSlot
from ._transport import Connection
from ._writes import out_of_budget, settle
from .results import Written

R = TypeVar("R")
_SLICE_S = 0.05  # a blocked wait looks at the sidecar's liveness this often (seconds)


class RecallClient(SyncOps):
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
        self._life = Life(os.getpid(), Driver.CLIENT)  # one life model with the pool (clients._core)
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
        self._life.open()

    def _install(self, att: Attachment) -> None:
        self._conn, self._slot = att.conn, att.slots[0]
        self._fast = fast_rows(att.conn.cslot)
        self._slot_path = att.conn.slot_path.path
        self._metric = att.conn.metric
        self._payload_limit = att.conn.payload_limit
        self._embed_dim = att.conn.embed_dim
        self._features = att.conn.features
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
            if self._life.terminate() is Step.NOTHING:
                return
            if os.getpid() != self._life.opened_in or self._conn is None:
                return  # a forked copy (the parent's lease) or no sidecar: nothing to give back
            busy = [self._slot] if self._pending is not None else []
            Attachment(self._conn, [self._slot]).end(busy)

    def _refusal(self) -> KalosError:
        err = self._life.refusal(os.getpid())
        assert err is not None
        return err

    def _break(self, e: KalosError) -> None:
        """No more service from this client: every later call raises ``e``."""
        self._life.break_(e)

    def _write(self, op: Op, preps: list[Prepared[Written]], budget: Timeout, t0: int) -> Written:
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

    def _deadline(self, budget: Timeout) -> float | None:
        timeout = resolve_timeout(budget, self._timeout)
        return None if timeout is None else time.monotonic() + timeout

    def _gate(self) -> None:
        pass  # (the state is looked at under the call's lock: _call_until)

    def _execute(self, p: Prepared[R], budget: Timeout, t0: int) -> R:
        return self._call_until(p, self._deadline(budget), t0)

    def _execute_all(self, preps: list[Prepared[R]], timeout: Timeout, t0: int) -> list[R]:
        return [self._execute(p, timeout, t0) for p in preps]

    def _call_until(self, p: Prepared[R], deadline: float | None, t0: int) -> R:
        if os.getpid() != self._life.opened_in:  # before the lock: a fork may have copied it held
            self._life.fork()
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
        if self._life.state is not PoolState.OPEN:
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
