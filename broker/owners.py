"""Who owns a broker's named objects, and whether a process may trust them.

POSIX shared memory and named semaphores live in one flat namespace per host (``/dev/shm`` on
Linux): any local user can create ``/kalos.NAME`` before the real sidecar does. So a client checks,
before it writes a byte, that every object it opens belongs to the uid it expects (its own unless
told otherwise) and is not open to other users; the sidecar refuses to start over objects it does
not own and never unlinks them. ``/dev/shm`` is sticky: once a name is owned by the expected uid,
nobody else can remove or replace it.
"""

from __future__ import annotations

import os
import pwd
import stat

#: Where Linux keeps POSIX shared memory (``NAME``) and named semaphores (``sem.NAME``).
SHM_DIR = "/dev/shm"


def shm_path(posix_name: str) -> str:
    """File of a shared memory object named like ``/kalos.NAME``."""
    return f"{SHM_DIR}/{posix_name.lstrip('/')}"


def sem_path(posix_name: str) -> str:
    """File of a named semaphore (glibc keeps ``/x`` as ``/dev/shm/sem.x``)."""
    return f"{SHM_DIR}/sem.{posix_name.lstrip('/')}"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return "unknown user"


def owner_problem(uid: int, mode: int, *, expected_uid: int, group_ok: bool) -> str | None:
    """Why an object with this owner and mode must not be trusted, or None if it may be. Pure.

    ``group_ok``: the sidecar runs as a dedicated user and shares its objects with a group (mode
    0660); others must never have access."""
    if uid != expected_uid:
        return (
            f"belongs to uid {uid} ({user_name(uid)}), not to the expected uid "
            f"{expected_uid} ({user_name(expected_uid)})"
        )
    loose = mode & (0o007 if group_ok else 0o077)
    if loose:
        who = "other users" if group_ok else "its group or other users"
        return f"has mode {stat.S_IMODE(mode):04o}, open to {who}"
    return None


def stat_problem(st: os.stat_result, *, expected_uid: int, group_ok: bool) -> str | None:
    return owner_problem(st.st_uid, st.st_mode, expected_uid=expected_uid, group_ok=group_ok)


__all__ = ["SHM_DIR", "owner_problem", "sem_path", "shm_path", "stat_problem", "user_name"]
