"""One data dir, one user at a time: a lock held on ``DIR/kalos.lock`` for as long as a sidecar
serves the directory (or ``kalos import`` / ``kalos export --data-dir`` works on it).

Two sidecars on one ``--data-dir`` would each load the store, serve their own memory and write
over each other's records in SQLite (the last writer wins), so the second is refused before it
opens the store, with an error naming the directory and the holder.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on a file inside the directory, held through an open file
descriptor: the kernel drops it when the holder exits, however it exits (kill -9, a crash, the
OOM killer), so a stale lock never blocks a restart, and no pid file has to be judged alive or
dead. It is taken on the directory's inode, whatever path names it (``./data``, a symlink, an
absolute path). ``flock`` locks belong to the open file description, so a second lock taken in
the same process is refused too, and the descriptor is close-on-exec: a child the holder starts
does not keep the directory locked after the holder is gone.

Who holds it is written into the file (JSON: what, broker, pid, host, since) after the lock is
taken, for the refusal's message only: the lock decides, never the file's contents. A fleet's
store (``--store postgresql://``) has no local directory to lock: its sidecars are replicas of one
database that follow one change log, by design.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from types import TracebackType

from ...broker.errors import ConfigError

LOCK_FILE = "kalos.lock"
#: Bytes of the holder's description read back for a refusal (it is a short JSON line).
_HOLDER_BYTES = 4096


@dataclass(frozen=True)
class Holder:
    """Who holds a data dir: ``what`` ("sidecar", "kalos import", "kalos export"), the broker a
    sidecar serves (None for the tools), its pid, host and start (seconds since the epoch)."""

    what: str
    broker: str | None
    pid: int
    host: str
    since: float

    def describe(self) -> str:
        who = f"the sidecar of broker {self.broker!r}" if self.what == "sidecar" else self.what
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{who} (pid {self.pid} on host {self.host}, since {since})"

    def to_json(self) -> str:
        return json.dumps(
            {"what": self.what, "broker": self.broker, "pid": self.pid, "host": self.host, "since": self.since}
        )

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        """The holder a lock file describes, or None when it describes none (empty: the holder
        is just starting; garbage)."""
        try:
            d = json.loads(text)
            return cls(str(d["what"]), d["broker"], int(d["pid"]), str(d["host"]), float(d["since"]))
        except (ValueError, TypeError, KeyError):
            return None


class DataDirInUse(ConfigError):
    """The data dir is locked by another sidecar or tool (the message names it)."""


class DataDirLock:
    """The lock on one data dir, held until :meth:`release` (or the process exits)."""

    def __init__(self, directory: str, fd: int, holder: Holder) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.holder = holder
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it could let a newcomer lock a
        new file while another waits on the old one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no stale description for a reader who finds it unlocked
            except OSError:
                pass
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> Holder | None:
    try:
        return Holder.from_json(os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", errors="replace"))
    except OSError:
        return None


def lock_data_dir(directory: str, what: str, broker: str | None = None) -> DataDirLock:
    """Lock ``directory`` (which must exist: :func:`kalos.sidecar_cuda.storage.sqlite.prepare_data_dir`
    makes and checks it) for ``what`` ("sidecar", with the ``broker`` it serves, or the tool's
    name), or raise :class:`DataDirInUse` naming the directory and who holds it. Never waits.
    Raises ConfigError when the lock file cannot be opened."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot open the lock file {path} of data dir {directory}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"cannot lock data dir {directory} ({path}): {e.strerror}") from None
            other = _read_holder(fd)
            who = other.describe() if other is not None else "another process (it is just starting)"
            if what == "sidecar":
                why = (
                    "one data dir serves one sidecar, or two would overwrite each other's records. "
                    "Stop that one first, or give this one another --data-dir (several sidecars "
                    "sharing memories: --store postgresql://...)"
                )
            else:
                why = (
                    f"{what} --data-dir works on a store no sidecar serves. Stop the sidecar first, "
                    "or leave out --data-dir to go through the running sidecar"
                )
            raise DataDirInUse(f"data dir {directory} is in use by {who}: {why}") from None
        mode = os.fstat(fd).st_mode & 0o777
        if mode & 0o077:
            os.fchmod(fd, 0o600)
        holder = Holder(what, broker, os.getpid(), socket.gethostname(), time.time())
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder.to_json() + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return DataDirLock(directory, fd, holder)


__all__ = ["LOCK_FILE", "DataDirInUse", "DataDirLock", "Holder", "lock_data_dir"]
