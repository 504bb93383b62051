"""The client transport: the only client module that touches posix_ipc, fcntl and the mapping.

Attaching (owner checks, header checks), leasing slots (the lease file's lock bytes, the claim
``flock``), the semaphores (:class:`Semaphore` over posix_ipc), liveness. Every OS error is mapped
to a Kalos error here (BrokerUnavailable when the objects went away or broke), so the async pool
and the blocking client above it never see posix_ipc. Clients never create or unlink anything:
they open the segment and the semaphores, lease slots under an ``flock`` of the segment, and on
close give the leases back.

A leased slot's byte work lives in :mod:`._slots` (the two slot paths, chosen per connection:
:func:`~._slots.make_slot`), the asyncio pool's waiter thread in :mod:`._waiter`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import posix_ipc

from ..broker import leases
from ..broker.errors import BrokerUnavailable, ProtocolError, UntrustedBroker
from ..broker.layout import (
    HEADER_BYTES,
    HEARTBEAT_S,
    HEARTBEAT_STALE_S,
    HIST_BUCKETS,
    LATENCY_BOUNDS_NS,
    MAGIC_U64,
    OWNER_ABANDONED,
    PROTOCOL_VERSION,
    RING_LEN,
    S_FREE,
    Layout,
    SegmentView,
    SidecarState,
    header_field_offset,
    metric_name,
    peek_header,
    word_views,
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
from ..broker.slotpath import Choice, SlotPath
from ._slots import ClientSlot, NativeSemaphore, default_slot_path, make_slot

_BOUNDS = list(LATENCY_BOUNDS_NS)


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
            self.embed_dim = int(hdr["embed_dim"])  # its --embed model's dimension (0: none)
            self.features = int(hdr["features"])  # what it serves beyond protocol 6 (FEATURE_*)
            del hdr
            if self.layout.total_bytes != self.shm.size:
                raise ProtocolError(f"broker {name!r}: header geometry does not match segment size")
            self.seg = SegmentView(memoryview(self.mm), self.layout)
            self.w32, self.w64 = word_views(memoryview(self.mm))
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
