"""Liveness the kernel reports: byte-range locks on the broker's lease file.

``/dev/shm/kalos.NAME.leases`` (created by the sidecar with the segment's owner and mode) holds
one lock byte per slot and one for the sidecar::

    byte i            (0 <= i < n_slots)  held by the process that leases slot i
    byte n_slots      (SIDECAR_BYTE)      held by the sidecar while it serves

The locks are Linux *open file description* locks (``F_OFD_SETLK``): the kernel drops them when
their holder dies, whatever PID namespace or container it runs in, as long as it sees the same
``/dev/shm``; closing another descriptor of the file does not drop them; a child forked by the
holder shares them until both have exited or given them up. So a lease is alive exactly while its
byte is locked; the pid in the slot is kept for diagnostics only. Testing a byte never takes it
(``F_OFD_GETLK``).

A second lock, the *claim lock*, is an ``flock`` of the segment itself: clients hold it while they
claim or give back slots, and the reaper while it frees them, so a slot's lease fields never
change under either. The sidecar only ever tries it (:func:`try_claim_lock`).
"""

from __future__ import annotations

import fcntl
import struct

# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
_FLOCK = struct.Struct("@hhqqixxxx")


def sidecar_byte(n_slots: int) -> int:
    """The byte the sidecar holds while it serves."""
    return n_slots


def _flock(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, 0, byte, 1, 0)  # whence SEEK_SET, one byte


def try_lock(fd: int, byte: int) -> bool:
    """Take the write lock of ``byte`` without waiting; False if another description holds it.
    Raises OSError for anything else."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
        return True
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held elsewhere
        return False


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte))


def is_locked(fd: int, byte: int) -> bool:
    """Whether another open file description holds ``byte`` (ours do not count)."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    return bool(_FLOCK.unpack(out)[0] != fcntl.F_UNLCK)


def locked_bytes(fd: int, n: int) -> list[bool]:
    """:func:`is_locked` for bytes 0..n-1."""
    return [is_locked(fd, i) for i in range(n)]


def try_claim_lock(fd: int) -> bool:
    """Take the segment's claim lock (``flock(LOCK_EX)`` on a descriptor of the segment, the lock
    clients lease slots under) without waiting; False if another open file description holds it.
    The sidecar never waits for it: a client stopped or frozen while holding it must not stop the
    serving loop. Raises OSError for anything else."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # EWOULDBLOCK: held elsewhere
        return False


def release_claim_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


__all__ = ["is_locked", "locked_bytes", "release_claim_lock", "sidecar_byte", "try_claim_lock", "try_lock", "unlock"]
