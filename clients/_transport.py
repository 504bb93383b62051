"""The client transport: the only client module that touches posix_ipc and the mapped segment.

Attaching (owner checks, header checks), leasing slots, posting a request, consuming a response
(non-blocking or blocking), the waiter thread, liveness. Every OS error is mapped to a Kalos error
here (BrokerUnavailable when the objects went away or broke), so the async pool and the blocking
client above it never see posix_ipc. Clients never create or unlink anything: they open the
segment and the semaphores, lease slots under an ``flock`` of the segment, and on close give the
leases back.

**Two slot paths** (``broker.slotpath``, chosen per connection): the pure-Python one
(:class:`ClientSlot`, :class:`Semaphore` over posix_ipc) is the reference; the compiled one
(:class:`CompiledSlot`, :class:`NativeSemaphore`) does the same byte work in
``clients/_cslot.c``: a recall's rows written and posted in one call (``post_rows``), its answer
checked and decoded into ``Hits`` in one call (``read_hits``), ``answered``, ``record``. The
extension raises OSError; it becomes a Kalos error here, as posix_ipc's errors do.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import mmap
import os
import struct
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import posix_ipc

from ..broker import leases
from ..broker.errors import BrokerUnavailable, ProtocolError, UntrustedBroker
from ..broker.layout import (
    CONTROL_BYTES,
    HEADER_BYTES,
    HEARTBEAT_S,
    HEARTBEAT_STALE_S,
    HIST_BUCKETS,
    HIST_OFFSET,
    L_RECALL,
    LATENCY_BOUNDS_NS,
    LATENCY_OPS,
    MAGIC_U64,
    NAMESPACE_BYTES,
    OWNER_ABANDONED,
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
    SidecarState,
    SlotState,
    SlotView,
    Status,
    header_field_offset,
    metric_name,
    peek_header,
    slot_field_offset,
)
from ..broker.names import (
    bell_name,
    leases_path,
    req_name,
    resp_name,
    shm_name,
    validate_broker_name,
)
from ..broker.owners import sem_path, stat_problem
from ..broker.procs import process_start_ticks
from ..broker.slotpath import Choice, SlotPath, choose
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


def want_byte(n_slots: int, first: bool) -> int:
    """A lease-file byte past the sidecar's (``broker.leases``) that clients hold (shared) while
    they wait for slots, read by the elastic pools (``clients.pool.LeasePlan``): ``first``, a
    process waits for its first slot (pools give back every slot beyond their ``min_size`` as it
    frees up); else a pool's callers wait for slots the broker could not give it (pools give
    back what they hold beyond a fair share). The sidecar never looks at them; the kernel drops
    a waiter's lock when it dies, as it drops a lease's."""
    return leases.sidecar_byte(n_slots) + (1 if first else 2)


#: struct flock on Linux (as ``broker.leases`` packs it): type, whence, start, len, pid.
_FLOCK = struct.Struct("@hhqqixxxx")


class SlotWant:
    """This process waits for slots of a broker: a shared (read) lock on a :func:`want_byte` of
    the lease file, on a descriptor of its own, so it outlives the connection it was taken
    through (an attach retries with new ones). :meth:`release` ends it."""

    __slots__ = ("_fd", "_byte")

    def __init__(self, fd: int, byte: int) -> None:
        self._fd = fd
        self._byte = byte

    def release(self) -> None:
        if self._fd < 0:
            return
        try:  # unlocked first: the descriptor may share its description with a live connection
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, 0, self._byte, 1, 0))
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True, slots=True)
class SlotCensus:
    """Who holds a broker's slots (a snapshot, for the error that says why a pool got none)."""

    n_slots: int
    free: int  # leasable now
    leased: int  # held by live processes (this one's other pools included)
    reclaimable: int  # held by processes that exited, abandoned, or draining: the reaper frees them


class Semaphore:
    """A named POSIX semaphore of a broker, with Kalos errors: the one wrapper of posix_ipc's
    semaphores (a fake with the same four methods stands in for it in unit tests)."""

    __slots__ = ("_sem", "_what")

    def __init__(self, posix_name: str, what: str) -> None:
        self._what = what
        try:
            self._sem = posix_ipc.Semaphore(posix_name)
        except posix_ipc.Error as e:
            raise BrokerUnavailable(f"{what}: {e}") from None

    def try_acquire(self) -> bool:
        try:
            self._sem.acquire(0)
            return True
        except posix_ipc.BusyError:
            return False
        except posix_ipc.Error as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; False if no post came (or a signal interrupted)."""
        try:
            self._sem.acquire(timeout)
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        except posix_ipc.Error as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def release(self) -> None:
        try:
            self._sem.release()
        except posix_ipc.Error as e:
            raise BrokerUnavailable(f"{self._what}: {e}") from None

    def close(self) -> None:
        try:
            self._sem.close()
        except posix_ipc.Error:
            pass


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


#: A slot's semaphore: posix_ipc's or the compiled one (or a unit test's fake with their methods).
AnySemaphore = Semaphore | NativeSemaphore


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

    def __init__(self, conn: Connection, index: int, req: AnySemaphore, resp: AnySemaphore) -> None:
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

    def __init__(self, conn: Connection, index: int, req: AnySemaphore, resp: AnySemaphore) -> None:
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


def make_slot(conn: Connection, index: int, req: AnySemaphore, resp: AnySemaphore) -> ClientSlot:
    """The slot object of the connection's slot path."""
    if conn.cslot is not None:
        return CompiledSlot(conn, index, req, resp)
    return ClientSlot(conn, index, req, resp)


class Connection:
    """A process's attachment to one broker (one per pool or blocking client).

    ``sidecar_uid``: the user the sidecar runs as. Before anything is written, the segment and
    every semaphore must belong to that uid (default: this process's effective uid) and be closed
    to other users, and to the group too unless ``sidecar_uid`` is given (a sidecar run as a
    dedicated user shares its objects with a group: ``--shm-mode 0660``); else UntrustedBroker."""

    #: The slot path of this attachment (``slot_path.path``: compiled or python) and its module.
    slot_path: Choice
    cslot: ModuleType | None
    #: The broker's lease file (-1: none, as for a unit test's in-memory transport).
    leases_fd: int = -1

    def __init__(self, name: str, *, sidecar_uid: int | None = None, slot_path: Choice | None = None) -> None:
        self.name = validate_broker_name(name)
        self._set_slot_path(slot_path)
        own = os.geteuid()
        self._expected_uid = own if sidecar_uid is None else int(sidecar_uid)
        self._group_ok = sidecar_uid is not None
        try:
            self.shm = posix_ipc.SharedMemory(shm_name(name))
        except posix_ipc.ExistentialError:
            raise BrokerUnavailable(
                f"no sidecar serves broker {name!r} (start one: `kalos serve "
                f"--name {name} --ephemeral --dim DIM --metric METRIC`, DIM the length of "
                "your vectors, METRIC dot, cosine or l2 as your embedding model's similarity; "
                "`--data-dir DIR` instead of --ephemeral keeps the records)"
            ) from None
        except posix_ipc.PermissionsError as e:
            raise BrokerUnavailable(
                f"broker {name!r}: {e} (objects are mode 0600: run as the sidecar's user)"
            ) from None
        except posix_ipc.Error as e:
            raise BrokerUnavailable(f"broker {name!r}: {e}") from None
        try:
            self._check_owner(shm_name(name), os.fstat(self.shm.fd), "shared memory")
            # A sidecar creates the segment, sizes it, and writes the magic last: an empty segment
            # or a zero magic is one still starting (however long a loaded machine takes), which
            # callers wait for within their connect budget; anything else is not ours.
            starting = BrokerUnavailable(
                f"broker {name!r}: the sidecar is still starting (or died while starting: `kalos cleanup {name}`)"
            )
            if self.shm.size == 0:
                raise starting
            if self.shm.size < HEADER_BYTES:
                raise ProtocolError(f"broker {name!r}: segment of {self.shm.size} bytes is not a Kalos segment")
            self.mm = mmap.mmap(self.shm.fd, self.shm.size)
            hdr = peek_header(memoryview(self.mm))
            if int(hdr["magic"]) == 0:
                raise starting
            if int(hdr["magic"]) != MAGIC_U64:
                raise ProtocolError(f"broker {name!r}: bad magic; not a Kalos segment")
            if int(hdr["version"]) != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"broker {name!r} speaks protocol version {int(hdr['version'])}, this client "
                    f"speaks {PROTOCOL_VERSION}: install the kalos version matching the sidecar"
                )
            if int(hdr["hist_buckets"]) != HIST_BUCKETS or int(hdr["ring_len"]) != RING_LEN:
                raise ProtocolError(f"broker {name!r}: latency layout differs from this client's")
            self.layout = Layout.from_header(hdr)
            self.metric = metric_name(int(hdr["metric"]))  # the sidecar's --metric
            self.payload_limit = int(hdr["payload_limit"])  # the sidecar's --payload-limit
            del hdr
            if self.layout.total_bytes != self.shm.size:
                raise ProtocolError(f"broker {name!r}: header geometry does not match segment size")
            self.seg = SegmentView(memoryview(self.mm), self.layout)
            self.w32 = memoryview(self.mm).cast("I")
            self.w64 = memoryview(self.mm).cast("Q")
            for sem in [bell_name(name)] + [
                f(name, i) for i in range(self.layout.n_slots) for f in (req_name, resp_name)
            ]:
                try:
                    st = os.stat(sem_path(sem))
                except FileNotFoundError:
                    raise BrokerUnavailable(f"broker {name!r} is going away") from None
                self._check_owner(sem, st, "semaphore")
            self.bell = self._semaphore(bell_name(name), f"broker {name!r}: doorbell")
            try:
                self.leases_fd = os.open(leases_path(name), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                self.bell.close()
                raise BrokerUnavailable(f"broker {name!r} is going away") from None
            try:
                self._check_owner(leases_path(name), os.fstat(self.leases_fd), "lease file")
            except BaseException:
                os.close(self.leases_fd)
                self.bell.close()
                raise
            self._sidecar_byte = leases.sidecar_byte(self.layout.n_slots)
            self._heartbeat_word = header_field_offset("heartbeat_ns") // 8
            self.epoch = int(self.seg.header["start_epoch_ns"])
        except posix_ipc.ExistentialError:
            self.shm.close_fd()
            raise BrokerUnavailable(f"broker {name!r} is going away") from None
        except (posix_ipc.Error, OSError) as e:
            self.shm.close_fd()
            raise BrokerUnavailable(f"broker {name!r}: {e}") from None
        except BaseException:
            self.shm.close_fd()
            raise
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks(self.pid)
        self.closed = False

    def _set_slot_path(self, choice: Choice | None) -> None:
        self.slot_path = default_slot_path() if choice is None else choice
        self.cslot = self.slot_path.module if self.slot_path.path is SlotPath.COMPILED else None

    def _semaphore(self, posix_name: str, what: str) -> Semaphore | NativeSemaphore:
        if self.cslot is not None:
            return NativeSemaphore(posix_name, what, self.cslot)
        return Semaphore(posix_name, what)

    def _check_owner(self, obj: str, st: os.stat_result, what: str) -> None:
        problem = stat_problem(st, expected_uid=self._expected_uid, group_ok=self._group_ok)
        if problem is not None:
            raise UntrustedBroker(
                f"broker {self.name!r}: {what} {obj} {problem}; refusing to attach (nothing was "
                "sent). Whoever made it could read the queries and forge the answers. If the sidecar "
                "runs as another user, pass sidecar_uid=; if the object is stale or foreign, have its "
                f"owner (or root) remove it: `kalos cleanup {self.name}`"
            )

    # -- liveness -------------------------------------------------------------------------
    def sidecar_state(self) -> SidecarState:
        return SidecarState(int(self.seg.header["state"]))

    def check_alive(self) -> None:
        """Raise BrokerUnavailable if the sidecar stopped, failed or died."""
        h = self.seg.header
        state = int(h["state"])
        if state in (SidecarState.STOPPING, SidecarState.STOPPED, SidecarState.FAILED):
            raise BrokerUnavailable(f"broker {self.name!r}: sidecar is {SidecarState(state).name.lower()}")
        if not self._sidecar_locked():
            raise BrokerUnavailable(
                f"broker {self.name!r}: sidecar pid {int(h['sidecar_pid'])} is gone (its lease-file lock was released)"
            )
        age = (time.monotonic_ns() - int(h["heartbeat_ns"])) / 1e9
        if age > HEARTBEAT_STALE_S:
            raise BrokerUnavailable(f"broker {self.name!r}: sidecar heartbeat is {age:.1f} s old")

    def _sidecar_locked(self) -> bool:
        """The kernel's word on the sidecar's liveness (in any PID namespace): its lock byte."""
        try:
            return leases.is_locked(self.leases_fd, self._sidecar_byte)
        except OSError as e:
            raise BrokerUnavailable(f"broker {self.name!r}: lease file: {e}") from None

    def quiet(self) -> bool:
        """Cheap (no system call): has the heartbeat been quiet for a while? Then
        :meth:`check_alive` before posting, so a request is not sent to a dead sidecar."""
        return time.monotonic_ns() - self.w64[self._heartbeat_word] > 4 * HEARTBEAT_S * 1e9

    def is_ready(self) -> bool:
        return self.sidecar_state() == SidecarState.READY

    # -- leases ---------------------------------------------------------------------------
    def lease(self, n: int) -> list[ClientSlot]:
        """Lease up to ``n`` free slots (possibly none). Each lease is held as a lock on the slot's
        byte of the lease file, taken before the owner fields are written (the sidecar's reaper
        looks under the same flock), so the kernel ends the lease when this process dies."""
        slots = self.seg.slots
        got: list[int] = []
        with self._locked():
            free = np.flatnonzero((slots["owner_pid"] == 0) & (slots["state"] == S_FREE))
            for i in free.tolist():
                if len(got) == n:
                    break
                try:
                    if not leases.try_lock(self.leases_fd, i):
                        continue  # still held by a process that inherited it: not free
                except OSError as e:
                    raise BrokerUnavailable(f"broker {self.name!r}: lease lock: {e}") from None
                slots[i]["owner_start"] = self.start_ticks
                slots[i]["owner_pid"] = self.pid
                got.append(i)
        out: list[ClientSlot] = []
        try:
            for i in got:
                what = f"broker {self.name!r}: slot {i}"
                out.append(
                    make_slot(
                        self,
                        i,
                        self._semaphore(req_name(self.name, i), what),
                        self._semaphore(resp_name(self.name, i), what),
                    )
                )
        except BrokerUnavailable:
            for s in out:
                s.close()
            with self._locked():
                for i in got:
                    if int(slots[i]["owner_pid"]) == self.pid:
                        slots[i]["owner_start"] = 0
                        slots[i]["owner_pid"] = 0
                    self._unlock(i)
            raise
        return out

    def census(self) -> SlotCensus:
        """Count the slots by who holds them. A leased slot whose lock byte no process holds
        belongs to a process that exited (the reaper frees it); this process's own locks are
        invisible to the lock test, so its own leases are counted by pid."""
        slots = self.seg.slots
        free = leased = reclaimable = 0
        try:
            for i, (owner, state) in enumerate(zip(slots["owner_pid"].tolist(), slots["state"].tolist())):
                if owner == 0 and state == S_FREE:
                    if leases.is_locked(self.leases_fd, i):  # inherited by a forked child
                        leased += 1
                    else:
                        free += 1
                elif owner in (0, OWNER_ABANDONED):
                    reclaimable += 1
                elif owner == self.pid or leases.is_locked(self.leases_fd, i):
                    leased += 1
                else:
                    reclaimable += 1
        except OSError as e:
            raise BrokerUnavailable(f"broker {self.name!r}: lease file: {e}") from None
        return SlotCensus(self.layout.n_slots, free, leased, reclaimable)

    def want_slots(self, first: bool) -> SlotWant | None:
        """Announce that this process waits for slots (:class:`SlotWant`; ``first``: its first,
        :func:`want_byte`); None where the lock cannot be taken (no lease file): the wait goes
        on without the announcement."""
        byte = want_byte(self.layout.n_slots, first)
        if self.leases_fd < 0:
            return None
        try:
            fd = os.dup(self.leases_fd)
        except OSError:
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, 0, byte, 1, 0))
        except OSError:
            os.close(fd)
            return None
        return SlotWant(fd, byte)

    def pressure(self) -> tuple[bool, bool]:
        """(another process waits for its first slot, another pool waits for more slots): the
        :meth:`want_slots` announcements of others, two ``F_OFD_GETLK``; (False, False) where
        they cannot be read."""
        if self.leases_fd < 0:
            return False, False
        n = self.layout.n_slots
        try:
            return (
                leases.is_locked(self.leases_fd, want_byte(n, True)),
                leases.is_locked(self.leases_fd, want_byte(n, False)),
            )
        except OSError:
            return False, False

    def holders(self) -> int:
        """How many processes lease slots now (distinct owners; a snapshot read without the
        claim lock: for a fair share, not for a decision that must be exact)."""
        owners = self.seg.slots["owner_pid"]
        return len(set(owners[(owners != 0) & (owners != OWNER_ABANDONED)].tolist()))

    def give_back(self, idle: list[ClientSlot], busy: list[ClientSlot]) -> None:
        """End leases: idle slots become free now; busy ones (request in flight) are marked
        abandoned and freed by the sidecar's reaper once it is done with them. With the claim
        lock held elsewhere (LockBusy), the lease locks alone are dropped: the reaper then frees
        those slots as it frees a dead client's."""
        slots = self.seg.slots
        try:
            with self._locked():
                for s in idle:
                    if int(slots[s.index]["owner_pid"]) == self.pid:
                        slots[s.index]["owner_start"] = 0
                        slots[s.index]["owner_pid"] = 0
                for s in busy:
                    if int(slots[s.index]["owner_pid"]) == self.pid:
                        slots[s.index]["owner_pid"] = OWNER_ABANDONED
                for s in idle + busy:
                    self._unlock(s.index)
        except LockBusy:
            for s in idle + busy:
                self._unlock(s.index)
        for s in idle + busy:
            s.close()

    def _unlock(self, i: int) -> None:
        try:
            leases.unlock(self.leases_fd, i)
        except OSError:
            pass  # the file is gone with its sidecar: nothing left to release

    def _locked(self) -> _Flock:
        return _Flock(self.shm.fd, self.name)

    def waiter(
        self,
        loop: asyncio.AbstractEventLoop,
        on_wake: Callable[[], None],
        on_error: Callable[[BrokerUnavailable], None],
    ) -> Waiter:
        """A thread that blocks on one slot's response for an asyncio pool (see :class:`Waiter`)."""
        return Waiter(loop, on_wake, on_error)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bell.close()
        os.close(self.leases_fd)  # drops every lease lock this attachment still holds
        for mv in (self.w32, self.w64):
            mv.release()
        del self.seg
        self.shm.close_fd()
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes with it


#: How long a client tries for the segment's claim lock (``flock``) before it gives up this
#: attempt: every holder keeps it for microseconds, so a longer hold is a stopped or frozen
#: process, and no client may block (its event loop, its thread) behind another one.
FLOCK_WAIT_S = 0.05


class LockBusy(BrokerUnavailable):
    """The claim lock stayed held by another process for :data:`FLOCK_WAIT_S`; callers try again
    within their own budget (an attach is retried like any other BrokerUnavailable)."""


class _Flock:
    """``with`` the segment's lease lock (``flock``), never waited for without a bound: tried
    without blocking, with short pauses, for :data:`FLOCK_WAIT_S`, then LockBusy; OS errors
    become BrokerUnavailable."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self._name = name

    def __enter__(self) -> None:
        deadline = time.monotonic() + FLOCK_WAIT_S
        pause = 0.0001
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockBusy(
                        f"broker {self._name!r}: the slots' claim lock has been held by another "
                        f"process for over {FLOCK_WAIT_S * 1e3:.0f} ms (a stopped or frozen "
                        "client?)"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 0.005)
            except OSError as e:
                raise BrokerUnavailable(f"broker {self._name!r}: lease lock: {e}") from None

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass


class Waiter:
    """The thread that blocks on the response semaphore of one slot while an asyncio pool has
    nothing better to do, and wakes the loop with ``call_soon_threadsafe``.

    It never consumes an answer (it posts it back: :meth:`ClientSlot.wait_no_consume`), so the
    loop stays the only reader of responses. If waiting fails (the semaphore is gone or broke),
    ``on_error`` gets a BrokerUnavailable on the loop and the thread ends: callers are failed,
    never left hanging.

    A wait outlives :meth:`disarm` by up to its timeout, so a slot the thread may still wait on
    (:meth:`holds`) must keep its lease and its semaphores: given back meanwhile, the slot could
    be leased by another process whose answer this thread would take, and with the handle closed
    it could not post it back (that process would wait for its answer forever)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_wake: Callable[[], None],
        on_error: Callable[[BrokerUnavailable], None],
    ) -> None:
        self._loop = loop
        self._on_wake = on_wake
        self._on_error = on_error
        self._cv = threading.Condition()
        self._target: ClientSlot | None = None
        self._on: ClientSlot | None = None  # the slot the thread waits on now (past disarm too)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kalos-pool-waiter", daemon=True)
        self._thread.start()

    def arm(self, slot: ClientSlot) -> None:
        with self._cv:
            self._target = slot
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._target = None

    def holds(self, slot: ClientSlot) -> bool:
        """Whether the thread is armed on ``slot`` or may still be inside a wait on it: then the
        slot must not be given back (nor its semaphores closed) yet."""
        with self._cv:
            return slot is self._target or slot is self._on

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._target = None
            self._cv.notify()
        # Joined before the semaphores are closed: the thread may be inside sem_timedwait.
        self._thread.join(timeout=2.0)

    def _call(self, fn: Callable[..., None], *args: object) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # loop closed
            return False

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._target is None and not self._closed:
                    self._cv.wait()
                if self._closed or self._target is None:
                    return
                slot = self._on = self._target
            try:
                posted = slot.wait_no_consume(0.05)
            except BrokerUnavailable as e:
                self._call(self._on_error, e)
                return
            finally:
                with self._cv:
                    self._on = None
            if posted:
                with self._cv:  # one wake per arming: the loop re-arms when it waits again
                    if self._target is slot:
                        self._target = None
                if not self._call(self._on_wake):
                    return
