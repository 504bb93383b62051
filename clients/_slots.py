"""A leased slot's byte work, on the two slot paths (``broker.slotpath``, chosen per connection):
the pure-Python :class:`ClientSlot` (over :class:`~kalos.clients._transport.Semaphore`, posix_ipc)
is the reference; :class:`CompiledSlot` (over :class:`NativeSemaphore`) does the same byte work in
``clients/_cslot.c``: a recall's rows written and posted in one call (``post_rows``), its answer
checked and decoded into ``Hits`` in one call (``read_hits``), ``answered``, ``record``. The
extension raises OSError; it becomes a Kalos error here.

No OS object is opened here: a slot is made over what the connection (:mod:`._transport`) mapped
and opened (:class:`SlotSource`), so the connection imports this module and never the reverse."""

from __future__ import annotations

import importlib
import mmap
import os
import time
from bisect import bisect_left
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..broker.errors import BrokerUnavailable, ProtocolError
from ..broker.layout import (
    CONTROL_BYTES,
    HIST_BUCKETS,
    HIST_OFFSET,
    L_RECALL,
    LATENCY_BOUNDS_NS,
    LATENCY_OPS,
    NAMESPACE_BYTES,
    PROTOCOL_VERSION,
    RING_LEN,
    RING_NS_MAX,
    RING_OFFSET,
    RING_OP_SHIFT,
    S_DONE,
    S_FREE,
    S_POSTED,
    S_WRITING,
    SLOT_FIELDS,
    STATS_BYTES,
    STATS_FIELDS,
    Layout,
    Op,
    SegmentView,
    SlotState,
    SlotView,
    Status,
    header_field_offset,
    slot_field_offset,
)
from ..broker.slotpath import Choice, choose
from ._requests import Prepared, hits_only, rows_only, write
from .results import Hits

if TYPE_CHECKING:
    from ._coalesce import Share
    from ._cslot import Sem as _Sem
    from ._cslot import Slot as _Slot


_BOUNDS = list(LATENCY_BOUNDS_NS)


# -- the slot path -------------------------------------------------------------------------------
def compiled_protocol() -> dict[str, int]:
    """What ``clients/_cslot.c`` must have been compiled with (its ``PROTOCOL``), from
    ``broker.layout``: an extension built against another header is refused, never run."""
    want = {
        "PROTOCOL_VERSION": PROTOCOL_VERSION,
        "CONTROL_BYTES": CONTROL_BYTES,
        "STATS_BYTES": STATS_BYTES,
        "NAMESPACE_BYTES": NAMESPACE_BYTES,
        "HIST_OFFSET": HIST_OFFSET,
        "HIST_BUCKETS": HIST_BUCKETS,
        "RING_OFFSET": RING_OFFSET,
        "RING_LEN": RING_LEN,
        "RING_OP_SHIFT": RING_OP_SHIFT,
        "RING_NS_MAX": RING_NS_MAX,
        "LATENCY_OPS": LATENCY_OPS,
        "Op.RECALL": int(Op.RECALL),
        "Status.OK": int(Status.OK),
    }
    fields = {f"slot.{name}": off for name, _t, off in SLOT_FIELDS}
    fields.update({f"stats.{name}": off for name, _t, off in STATS_FIELDS})
    for s in (SlotState.FREE, SlotState.WRITING, SlotState.POSTED, SlotState.DONE):
        want[f"SlotState.{s.name}"] = int(s)
    return {**want, **fields}


def load_compiled() -> ModuleType:
    """Import the compiled slot path (ImportError: not built, or built against another layout
    than ``broker.layout``'s, which the caller treats as not built)."""
    mod = importlib.import_module("._cslot", __package__)
    want = compiled_protocol()
    have = dict(mod.PROTOCOL)
    wrong = sorted(k for k in have if want.get(k) != have[k])
    if wrong:
        raise ImportError(
            f"kalos.clients._cslot was built against another protocol layout ({', '.join(wrong)} "
            "differ from broker/layout.py): rebuild it (make ext)"
        )
    mod.configure(ProtocolError, Hits)
    return mod


def default_slot_path() -> Choice:
    """The slot path of a new connection: ``broker.slotpath.choose`` over this process's
    environment (``KALOS_PURE_PYTHON``, ``KALOS_REQUIRE_COMPILED``); ConfigError when the
    compiled path is required and not built."""
    return choose(os.environ, load_compiled)


class SlotSemaphore(Protocol):
    """A slot's semaphore as the slot uses it: posix_ipc's (``_transport.Semaphore``), the compiled
    one (:class:`NativeSemaphore`), or a unit test's fake."""

    def try_acquire(self) -> bool: ...
    def acquire(self, timeout: float) -> bool: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


class SlotSource(Protocol):
    """What a slot is made over: the connection's mapping, views and doorbell
    (``_transport.Connection``, or ``fake.FakeConnection``)."""

    @property
    def name(self) -> str: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def seg(self) -> SegmentView: ...
    @property
    def bell(self) -> SlotSemaphore: ...
    @property
    def mm(self) -> mmap.mmap: ...
    @property
    def w32(self) -> memoryview: ...
    @property
    def w64(self) -> memoryview: ...
    @property
    def cslot(self) -> ModuleType | None: ...


class NativeSemaphore:
    """:class:`Semaphore` on the compiled slot path: the same methods and errors over
    ``_cslot.Sem`` (sem_open of the sidecar's semaphore, never created here), whose handle
    (``sem``) the compiled slot posts and consumes without a Python call."""

    __slots__ = ("sem", "_what")

    def __init__(self, posix_name: str, what: str, module: ModuleType) -> None:
        self._what = what
        try:
            self.sem: _Sem = module.Sem(posix_name)
        except OSError as e:
            raise BrokerUnavailable(f"{what}: {e}") from None

    def try_acquire(self) -> bool:
        try:
            return self.sem.trywait()
        except OSError as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; False if no post came (or a signal interrupted)."""
        try:
            return self.sem.wait(timeout)
        except OSError as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def release(self) -> None:
        try:
            self.sem.post()
        except OSError as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def close(self) -> None:
        self.sem.close()


#: A slot's semaphore (the name the modules above use).
AnySemaphore = SlotSemaphore


def _native(sem: object) -> object:
    """What a compiled slot posts or consumes: the native handle, else the object itself (the
    unit tests' fake semaphores: it calls their ``release`` / ``try_acquire``)."""
    return sem.sem if isinstance(sem, NativeSemaphore) else sem


class ClientSlot:
    """One leased slot: its views, its semaphores and the owner's bookkeeping. Its byte work is
    the pure-Python slot path, the reference :class:`CompiledSlot` is held to."""

    __slots__ = (
        "index",
        "view",
        "req",
        "resp",
        "bell",
        "_w32",
        "_w64",
        "_mm",
        "_state",
        "_op",
        "_k",
        "_nq",
        "_flags",
        "_ns_len",
        "_ns_off",
        "_blob_len",
        "_status",
        "_nres",
        "_gen",
        "_rgen",
        "_tpost",
        "_lat_count",
        "_lat_sum",
        "_err_count",
        "_timeout_count",
        "_hist0",
        "_ring0",
        "_stats",
        "_sleeping",
        "_blob_bytes",
        "generation",
        "name",
    )

    def __init__(self, conn: SlotSource, index: int, req: AnySemaphore, resp: AnySemaphore) -> None:
        L = conn.layout
        self.index = index
        self.name = conn.name
        self.view: SlotView = conn.seg.slot[index]
        self.req = req
        self.resp = resp
        self.bell = conn.bell
        self._mm = conn.mm
        self._w32 = conn.w32
        self._w64 = conn.w64

        def w(field: str, size: int) -> int:
            off = slot_field_offset(L, index, field)
            assert off % size == 0
            return off // size

        self._state, self._op, self._k, self._nq = w("state", 4), w("op", 4), w("k", 4), w("nq", 4)
        self._flags, self._ns_len, self._blob_len = w("flags", 4), w("ns_len", 4), w("blob_len", 4)
        self._status, self._nres = w("status", 4), w("n_results", 4)
        self._gen, self._rgen, self._tpost = w("generation", 8), w("resp_generation", 8), w("t_post_ns", 8)
        # Per-op fields: the word of LatencyOp 0; op i is that + i.
        self._lat_count, self._lat_sum = w("lat_count", 8), w("lat_sum_ns", 8)
        self._err_count, self._timeout_count = w("err_count", 8), w("timeout_count", 8)
        self._ns_off = slot_field_offset(L, index, "namespace")
        self._sleeping = header_field_offset("sidecar_sleeping") // 4
        self._hist0 = (L.stats_base(index) + HIST_OFFSET) // 8
        self._ring0 = (L.stats_base(index) + RING_OFFSET) // 8
        self._stats = L.stats_base(index)
        self._blob_bytes = L.blob_bytes
        self.generation = int(self._w64[self._gen])

    # -- request ---------------------------------------------------------------------------
    def post_request(self, p: Prepared[Any], t0: int) -> None:
        """Write the request ``p`` into the slot's data areas, then post it (:meth:`post`)."""
        self.post(p.op, p.ns, p.k, p.nq, p.flags, write(self.view, p), t0)

    def fast_hits(self, p: Prepared[Any], shares: Sequence[Share] | None) -> Any:
        """The answer of ``p`` decoded in one call where this slot path has one (the compiled
        path's :meth:`CompiledSlot.read_hits`), else None: the caller decodes it
        (``_requests.read``)."""
        return None

    def post(self, op: int, ns: bytes, k: int, nq: int, flags: int, blob_len: int, t0: int) -> int:
        """Write the request header and post. Payload areas must already be written."""
        w32, w64 = self._w32, self._w64
        w32[self._state] = S_WRITING
        self.generation += 1
        w64[self._gen] = self.generation
        w32[self._op] = op
        w32[self._k] = k
        w32[self._nq] = nq
        w32[self._flags] = flags
        w32[self._blob_len] = blob_len
        w32[self._ns_len] = len(ns)
        self._mm[self._ns_off : self._ns_off + len(ns)] = ns
        w64[self._tpost] = time.monotonic_ns()
        # Order matters: every field above, then POSTED, then req (a full fence), then the doorbell
        # only if the sidecar announced that it sleeps (see the handshake in broker.layout).
        w32[self._state] = S_POSTED
        self.req.release()
        if w32[self._sleeping]:
            self.bell.release()
        return self.generation

    def is_done(self) -> bool:
        return self._w32[self._state] == S_DONE

    def try_consume(self) -> bool:
        """Consume the response post of a DONE slot (the fence before reading results)."""
        return self.resp.try_acquire()

    def answered(self) -> bool:
        """Is the answer in? DONE, and its response post consumed (the fence before reading);
        no system call while it is not DONE. The pool's poller asks this of every request in
        flight on every look, so it is one call."""
        return self._w32[self._state] == S_DONE and self.resp.try_acquire()

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the response post and consume it. False if none
        came (or a signal interrupted the wait); BrokerUnavailable if the semaphore broke."""
        return self.resp.acquire(timeout)

    def wait_no_consume(self, timeout: float) -> bool:
        """Block until a response is posted, then post it back for :meth:`try_consume` (the
        waiter thread's wait: the loop stays the only consumer of answers)."""
        if not self.wait(timeout):
            return False
        self.resp.release()
        return True

    def outcome(self) -> tuple[int, int, int]:
        """(status, n_results, blob_len) of a consumed response, each field read once (the
        sidecar's words are untrusted): the generation echo checked, blob_len within the blob
        area (ProtocolError otherwise)."""
        w32 = self._w32
        rgen = self._w64[self._rgen]
        if rgen != self.generation:
            raise ProtocolError(f"slot {self.index}: response for request {rgen}, expected {self.generation}")
        blob_len = w32[self._blob_len]
        if blob_len > self._blob_bytes:
            raise ProtocolError(
                f"slot {self.index}: blob_len {blob_len} beyond the blob area of {self._blob_bytes} bytes"
            )
        status = w32[self._status]
        if status >= 1 << 31:  # an i32 field
            status -= 1 << 32
        return (status, w32[self._nres], blob_len)

    def blob_text(self, n: int) -> bytes:
        return bytes(self.view.blob[:n].tobytes())

    def set_free(self) -> None:
        self._w32[self._state] = S_FREE

    # -- client-side latency accounting (only the lease owner writes these) ------------------
    def record(self, latency_ns: int, ok: bool, timed_out: bool = False, op: int = L_RECALL) -> None:
        """Account one finished request of kind ``op`` (a LatencyOp; ``broker.layout.latency_op``)
        in the slot's stats block: its latency if ``ok``, else an error or (``timed_out``: the
        caller gave up or was cancelled) a timeout."""
        w64 = self._w64
        try:
            if not ok:
                w64[(self._timeout_count if timed_out else self._err_count) + op] += 1
                return
            lat = latency_ns if latency_ns < RING_NS_MAX else RING_NS_MAX
            w64[self._hist0 + op * HIST_BUCKETS + bisect_left(_BOUNDS, lat)] += 1
            w64[self._lat_sum + op] += lat
            n = w64[self._lat_count]
            w64[self._ring0 + n % RING_LEN] = op << RING_OP_SHIFT | lat
            w64[self._lat_count] = n + 1  # last: the sidecar reads the ring up to this index
        except (ValueError, OverflowError):
            # A counter at 2**64 - 1, left by an earlier owner of the slot (what a client wrote is
            # untrusted): start the block over. The exporter takes a decrease for a new owner.
            self._mm[self._stats : self._stats + STATS_BYTES] = bytes(STATS_BYTES)

    def record_shares(
        self, now: int, shares: Sequence[Share], gone: Sequence[bool], ok: bool, op_single: int, op_many: int
    ) -> None:
        """Account each caller of a shared slot (``shares``: ``clients._coalesce.Share``, in
        row order) as :meth:`record` accounts one: its latency from its own t0 to ``now``, of its
        own kind (``op_single`` for a recall, ``op_many`` for recall_many), a caller that went
        away (``gone``) as a timeout."""
        for s, left in zip(shares, gone):
            op = op_single if s.single else op_many
            if left:
                self.record(now - s.t0, ok=False, timed_out=True, op=op)
            else:
                self.record(now - s.t0, ok=ok, op=op)

    def close(self) -> None:
        self.req.close()
        self.resp.close()


class CompiledSlot(ClientSlot):
    """A :class:`ClientSlot` whose byte work runs compiled (``clients/_cslot.c``), with the same
    effect on the segment byte for byte and the same errors (``tests/unit/test_cslot.py``).
    Two operations exist only here, each one call for what the Python path does in several:
    :meth:`post_rows` (a recall's rows, header fields, POSTED, the posts) and :meth:`read_hits`
    (generation echo, bounds, status, the ``Hits``)."""

    __slots__ = ("native", "_where")

    def __init__(self, conn: SlotSource, index: int, req: AnySemaphore, resp: AnySemaphore) -> None:
        super().__init__(conn, index, req, resp)
        L = conn.layout
        assert conn.cslot is not None
        self._where = f"broker {conn.name!r}: slot {index}"
        self.native: _Slot = conn.cslot.Slot(
            buffer=conn.mm,
            index=index,
            control_base=L.control_base(index),
            stats_base=L.stats_base(index),
            data_base=L.data_base(index),
            slot_bytes=L.slot_bytes,
            query_offset=L.query_offset,
            ids_offset=L.ids_offset,
            result_ids_offset=L.result_ids_offset,
            result_scores_offset=L.result_scores_offset,
            blob_offset=L.blob_offset,
            dim=L.dim,
            max_k=L.max_k,
            max_queries=L.max_queries,
            blob_bytes=L.blob_bytes,
            sleeping_offset=header_field_offset("sidecar_sleeping"),
            bounds=LATENCY_BOUNDS_NS,
            req=_native(req),
            resp=_native(resp),
            bell=_native(conn.bell),
        )

    def post(self, op: int, ns: bytes, k: int, nq: int, flags: int, blob_len: int, t0: int) -> int:
        self.generation += 1
        try:
            self.native.post(self.generation, op, ns, k, nq, flags, blob_len)
        except OSError as e:
            raise BrokerUnavailable(f"{self._where}: {e}") from None
        return self.generation

    def post_request(self, p: Prepared[Any], t0: int) -> None:
        """A recall of rows alone is written and posted in one call (:meth:`post_rows`)."""
        if rows_only(p):
            assert p.vectors is not None
            self.post_rows(p.vectors, p.k, p.ns, p.flags)
        else:
            super().post_request(p, t0)

    def fast_hits(self, p: Prepared[Any], shares: Sequence[Share] | None) -> Any:
        """A recall's ids and scores checked and decoded in one call (:meth:`read_hits`; None
        for an error status, which the caller maps); None for any other answer."""
        return self.read_hits(p.nq, p.k, p.single, shares) if hits_only(p) else None

    def post_rows(self, rows: np.ndarray, k: int, ns: bytes, flags: int) -> int:
        """Post a recall whose request is ``rows`` (C-contiguous float32 (n, dim), as
        ``broker.validation.as_vectors`` returns them) and its header fields: no filter blob, no
        fleet position. ValueError for rows of another shape or type (nothing written)."""
        self.generation += 1
        try:
            self.native.post_rows(self.generation, rows, k, ns, flags)
        except OSError as e:
            raise BrokerUnavailable(f"{self._where}: {e}") from None
        return self.generation

    def read_hits(self, nq: int, k: int, single: bool, shares: Sequence[Share] | None = None) -> Any:
        """The answer of a consumed recall without payloads: one Hits (``single``) or one per
        row, checked as :meth:`outcome` and ``_requests.read`` check it (ProtocolError); None
        when the status is not OK (``_requests.read`` then maps it to its error). ``shares``
        (a shared slot's callers, in row order): the answer split per caller as
        ``clients._coalesce.split`` splits it, each cut to its own k."""
        return self.native.read_hits(self.generation, nq, k, single, shares)

    def is_done(self) -> bool:
        return self.native.is_done()

    def answered(self) -> bool:
        try:
            return self.native.answered()
        except OSError as e:
            raise BrokerUnavailable(f"{self._where}: {e}") from None

    def set_free(self) -> None:
        self.native.set_free()

    def record(self, latency_ns: int, ok: bool, timed_out: bool = False, op: int = L_RECALL) -> None:
        self.native.record(latency_ns, ok, timed_out, op)

    def record_shares(
        self, now: int, shares: Sequence[Share], gone: Sequence[bool], ok: bool, op_single: int, op_many: int
    ) -> None:
        self.native.record_shares(now, shares, gone, ok, op_single, op_many)


def make_slot(conn: SlotSource, index: int, req: AnySemaphore, resp: AnySemaphore) -> ClientSlot:
    """The slot object of the connection's slot path."""
    if conn.cslot is not None:
        return CompiledSlot(conn, index, req, resp)
    return ClientSlot(conn, index, req, resp)
