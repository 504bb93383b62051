"""Names: which broker and namespace names are valid, and the POSIX objects of a broker.

A broker name scopes every shared object of one sidecar (see the objects drawn in
:mod:`kalos.broker.layout`); a namespace name travels in a slot's ``namespace`` field, so the longest
one is ``NAMESPACE_BYTES``. Clients check names before anything touches shared memory; the sidecar
checks what it reads back from a slot with :func:`decode_namespace`.
"""

from __future__ import annotations

import re

from .errors import ConfigError, InvalidRequest
from .layout import NAMESPACE_BYTES

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_NS_RE = re.compile(rf"^[A-Za-z0-9_.:@-]{{1,{NAMESPACE_BYTES}}}$")


def validate_broker_name(name: str) -> str:
    """``name`` itself; ConfigError unless it is 1-40 of ``[A-Za-z0-9_-]`` (it lands in /dev/shm)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"broker name must match {_NAME_RE.pattern}, got {name!r}")
    return name


def validate_namespace(ns: str) -> bytes:
    """The bytes a slot carries for ``ns``; InvalidRequest unless it is a valid namespace name."""
    if not isinstance(ns, str) or not _NS_RE.match(ns):
        raise InvalidRequest(f"namespace must match {_NS_RE.pattern}, got {ns!r}")
    return ns.encode()


def decode_namespace(raw: bytes, length: int) -> str | None:
    """Namespace from a slot, or None if what a client wrote there is not a valid name."""
    if not 1 <= length <= NAMESPACE_BYTES or len(raw) < length:
        return None
    try:
        ns = bytes(raw[:length]).decode()
    except UnicodeDecodeError:
        return None
    return ns if _NS_RE.match(ns) else None


def shm_name(name: str) -> str:
    """The shared memory segment of broker ``name``."""
    return f"/kalos.{name}"


def bell_name(name: str) -> str:
    """The doorbell semaphore of broker ``name``."""
    return f"/kalos.{name}.bell"


def req_name(name: str, i: int) -> str:
    """The request semaphore of slot ``i``."""
    return f"/kalos.{name}.{i}.req"


def resp_name(name: str, i: int) -> str:
    """The response semaphore of slot ``i``."""
    return f"/kalos.{name}.{i}.resp"


def leases_path(name: str) -> str:
    """The lease-lock file of broker ``name`` (a plain file beside the POSIX objects; see
    :mod:`kalos.broker.leases`)."""
    return f"/dev/shm/kalos.{name}.leases"
