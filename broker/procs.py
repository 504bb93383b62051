"""Process liveness, used for slot leases (clients write it, the sidecar's reaper checks it)."""

from __future__ import annotations

import os

#: The largest pid a Linux kernel hands out (``/proc/sys/kernel/pid_max`` is at most 2**22).
PID_MAX = 1 << 22


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22); 0 if unknown."""
    if not 0 < pid <= PID_MAX:
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return 0


def _proc_state(pid: int) -> bytes | None:
    if not 0 < pid <= PID_MAX:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :][:1]


def pid_alive(pid: int, start_ticks: int = 0) -> bool:
    """True if ``pid`` runs and, when ``start_ticks`` is given, is the same process (no pid reuse).

    A zombie (killed, not yet reaped by its parent) counts as dead.
    """
    # Any client can write a lease's pid: only values a kernel can hand out are looked up (Linux
    # caps pids at 2**22; os.kill raises OverflowError beyond a C int).
    if type(pid) is not int or not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    state = _proc_state(pid)
    if state is None:
        return os.path.exists("/proc/self") is False  # no procfs: trust kill()
    if state in (b"Z", b"X"):
        return False
    if start_ticks and process_start_ticks(pid) != start_ticks:
        return False
    return True
