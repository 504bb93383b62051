"""Creating, finding and removing a broker's named objects. Only the sidecar and `kalos cleanup`
use this: clients attach and close, they never create or unlink."""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass

import posix_ipc

from ...broker import leases
from ...broker.errors import ConfigError
from ...broker.layout import MAGIC_U64, Layout, SidecarState, peek_header
from ...broker.names import bell_name, leases_path, req_name, resp_name, shm_name
from ...broker.owners import owner_problem, sem_path, shm_path
from ...broker.procs import pid_alive

log = logging.getLogger("kalos.sidecar")
MODE = 0o600


@dataclass
class Objects:
    shm: posix_ipc.SharedMemory
    mm: mmap.mmap
    bell: posix_ipc.Semaphore
    req: list[posix_ipc.Semaphore]
    resp: list[posix_ipc.Semaphore]
    leases_fd: int  # the lease-lock file; this process holds its sidecar byte while it lives


def _leftover_owner(name: str) -> tuple[int, int, int] | None:
    """(pid, state, n_slots) recorded in an existing segment of this name, or None if there is
    none."""
    try:
        shm = posix_ipc.SharedMemory(shm_name(name))
    except posix_ipc.ExistentialError:
        return None
    try:
        if shm.size < 4096:
            return (0, SidecarState.FAILED, 0)
        mm = mmap.mmap(shm.fd, 4096)
        try:
            hdr = peek_header(memoryview(mm))
            if int(hdr["magic"]) != MAGIC_U64:
                return (0, SidecarState.FAILED, 0)
            out = (int(hdr["sidecar_pid"]), int(hdr["state"]), int(hdr["n_slots"]))
            del hdr
        finally:
            mm.close()
        return out
    finally:
        shm.close_fd()


def leftover_names(name: str) -> list[str]:
    """Names of this broker's objects that exist now (Linux keeps them under /dev/shm)."""
    found = []
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        entries = []
    if f"kalos.{name}" in entries:
        found.append(shm_name(name))
    if f"kalos.{name}.leases" in entries:
        found.append(leases_path(name))
    prefix = f"sem.kalos.{name}."
    for e in entries:
        if e.startswith(prefix):
            rest = e[len(prefix) :]
            if rest == "bell" or (rest.endswith((".req", ".resp")) and rest.split(".")[0].isdigit()):
                found.append("/" + e[len("sem.") :])
    return sorted(found)


def _path(obj: str, name: str) -> str:
    if obj == leases_path(name):
        return obj
    return shm_path(obj) if obj == shm_name(name) else sem_path(obj)


def foreign_objects(name: str) -> list[str]:
    """This broker's existing objects that this process's user does not own: never ours to serve
    over or remove (another user may have made them to catch our clients' queries)."""
    out = []
    for obj in leftover_names(name):
        try:
            st = os.stat(_path(obj, name))
        except FileNotFoundError:
            continue
        problem = owner_problem(st.st_uid, 0, expected_uid=os.geteuid(), group_ok=True)
        if problem is not None:
            out.append(f"{_path(obj, name)} {problem}")
    return out


def _refuse_foreign(name: str, doing: str) -> None:
    foreign = foreign_objects(name)
    if foreign:
        more = f" (and {len(foreign) - 3} more)" if len(foreign) > 3 else ""
        raise ConfigError(
            f"cannot {doing} broker {name!r}: its objects are not ours: {'; '.join(foreign[:3])}"
            f"{more}. Kalos never serves over or removes objects it does not own. Have their owner "
            f"run `kalos cleanup {name}` (or remove them as root), or choose another --name"
        )


def live_sidecar(name: str) -> int | None:
    """The pid recorded by a sidecar that still serves ``name`` (its lease file's sidecar byte is
    locked, which the kernel drops when it dies, in any PID namespace), else None. Objects of an
    older version without a lease file fall back to the recorded pid."""
    owner = _leftover_owner(name)
    if owner is None:
        return None
    pid, state, n_slots = owner
    if state in (SidecarState.STOPPED, SidecarState.FAILED):
        return None
    try:
        fd = os.open(leases_path(name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return pid if pid and pid_alive(pid) else None
    try:
        return pid if leases.is_locked(fd, leases.sidecar_byte(n_slots)) else None
    finally:
        os.close(fd)


def cleanup(name: str, *, force: bool = False) -> list[str]:
    """Unlink every object of broker ``name``. Refuses while a live sidecar owns them (unless
    force), and always when an object belongs to another user."""
    _refuse_foreign(name, "clean up")
    if not force:
        pid = live_sidecar(name)
        if pid is not None:
            raise ConfigError(f"broker {name!r} is served by a live sidecar (pid {pid}); stop it first")
    removed = []
    for obj in leftover_names(name):
        try:
            if obj == leases_path(name):
                os.unlink(obj)
            elif obj == shm_name(name):
                posix_ipc.unlink_shared_memory(obj)
            else:
                posix_ipc.unlink_semaphore(obj)
            removed.append(obj)
        except (posix_ipc.ExistentialError, FileNotFoundError):
            pass
    return removed


def create(name: str, layout: Layout, mode: int = MODE) -> Objects:
    """Create every object exclusively (``mode``: 0600, or 0660 to share with the group; set
    explicitly, whatever the umask). Leftovers of a dead sidecar are removed first,
    with a log line; a live sidecar of the same name, or objects of another user, are an error."""
    if mode not in (0o600, 0o660):
        raise ConfigError(f"shm mode must be 0600 or 0660, got {mode:04o}")
    _refuse_foreign(name, "serve")
    if leftover_names(name):
        live = live_sidecar(name)
        if live is not None:
            raise ConfigError(f"broker {name!r} is already served by pid {live}")
        owner = _leftover_owner(name)
        pid = owner[0] if owner else 0
        removed = cleanup(name, force=True)
        log.warning(
            "removed %d objects left by a dead sidecar (pid %s) of broker %r", len(removed), pid or "unknown", name
        )
    made: list[str] = []
    try:
        shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=mode, size=layout.total_bytes)
        made.append(shm_name(name))
        mm = mmap.mmap(shm.fd, layout.total_bytes)
        bell = posix_ipc.Semaphore(bell_name(name), posix_ipc.O_CREX, mode=mode, initial_value=0)
        made.append(bell_name(name))
        req, resp = [], []
        for i in range(layout.n_slots):
            req.append(posix_ipc.Semaphore(req_name(name, i), posix_ipc.O_CREX, mode=mode, initial_value=0))
            made.append(req_name(name, i))
            resp.append(posix_ipc.Semaphore(resp_name(name, i), posix_ipc.O_CREX, mode=mode, initial_value=0))
            made.append(resp_name(name, i))
        fd = os.open(leases_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        made.append(leases_path(name))
        if mode != MODE:  # posix_ipc applies the umask; the group bits must be set explicitly
            os.fchmod(shm.fd, mode)
            os.fchmod(fd, mode)
            for sem_obj in made[1:-1]:
                os.chmod(sem_path(sem_obj), mode)
        # Held for the life of this process: clients see the sidecar alive while it is taken,
        # in any PID namespace (broker.leases).
        if not leases.try_lock(fd, leases.sidecar_byte(layout.n_slots)):
            raise OSError("the sidecar lock of the new lease file is held by another process")
    except (posix_ipc.Error, OSError) as e:
        cleanup(name, force=True)
        raise ConfigError(f"cannot create shared objects for broker {name!r}: {e}") from None
    return Objects(shm, mm, bell, req, resp, fd)


def unlink(name: str, objs: Objects) -> None:
    for s in [objs.bell, *objs.req, *objs.resp]:
        try:
            s.unlink()
        except posix_ipc.ExistentialError:
            pass
        s.close()
    try:
        objs.shm.unlink()
    except posix_ipc.ExistentialError:
        pass
    try:
        os.unlink(leases_path(name))
    except FileNotFoundError:
        pass
    os.close(objs.leases_fd)  # drops the sidecar lock: clients now see the sidecar gone
