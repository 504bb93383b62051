"""Readiness for systemd (``Type=notify``): the ``sd_notify(3)`` protocol in a few lines.

The service manager passes a unix datagram socket in ``$NOTIFY_SOCKET`` (a path, or ``@name`` in
the abstract namespace); each datagram is newline-separated ``KEY=VALUE`` assignments. The sidecar
sends ``READY=1`` once the memory is loaded and the segment says READY, and ``STOPPING=1`` when it
begins to stop. Without ``$NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``) it does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("kalos.sidecar")


def sd_notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to ``$NOTIFY_SOCKET``; True if it was sent.

    Never raises: a manager that cannot be told is logged, and the sidecar serves on (systemd
    then fails the start on its own ``TimeoutStartSec=``)."""
    addr = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying", addr)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        log.warning("sd_notify(%r) to %s failed: %s", state, addr.lstrip("\0"), e)
        return False
    return True
