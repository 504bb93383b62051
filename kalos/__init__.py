"""Kalos: exact top-k recall served from a GPU sidecar over POSIX shared memory.

This is the public API (``from kalos import RecallPool``). One import package holds everything:
``kalos.broker`` (the shared-memory contract), ``kalos.clients`` and ``kalos.sidecar_cuda``, kept in
the checkout's top-level folders of those names. The applications live beside it (:mod:`kalos.cli`, the
``kalos`` command; :mod:`kalos.testing`, helpers for tests and benchmarks).

The clients' compiled slot path (``kalos.clients._cslot``) is imported here, with the package, not at
the first connection: a server started as root that imports Kalos and then drops to a service user
may no longer be able to read the package's directory (a checkout under /root, a 0700 directory), and
would otherwise fall back to the Python path, or fail under ``KALOS_REQUIRE_COMPILED=1``.
"""

import os as _os

from kalos.broker.clock import Recency
from kalos.broker.errors import (
    AcquireTimeout,
    BrokerUnavailable,
    ClosedError,
    ConfigError,
    ForkedPoolError,
    InvalidRequest,
    KalosError,
    KalosTimeout,
    PartialWrite,
    PayloadTooLarge,
    PositionTimeout,
    ProtocolError,
    ResponseTimeout,
    ServerError,
    SlotsExhausted,
    UnknownNamespace,
    UsageError,
)
from kalos.broker.layout import PROTOCOL_VERSION
from kalos.broker.lexical import Hybrid
from kalos.broker.positions import Position
from kalos.clients import Hit, Hits, PoolStatistics, RecallClient, RecallPool, Records, Written

__version__ = "0.1.0"


def _import_slot_path() -> None:
    """Import the compiled slot path now (see the module's text); ``KALOS_PURE_PYTHON=1`` rules it
    out, as it does at connection time. Nothing is decided here: each connection still chooses
    (:func:`kalos.clients._slots.default_slot_path`) and says why when the extension is
    missing; it then finds the module already imported."""
    from kalos.broker.slotpath import PURE_ENV
    from kalos.clients._slots import load_compiled

    if _os.environ.get(PURE_ENV, "") in ("", "0"):
        try:
            load_compiled()
        except ImportError:  # not built: the connection's choice reports it
            pass


_import_slot_path()
__all__ = [
    "RecallPool",
    "RecallClient",
    "PoolStatistics",
    "Hit",
    "Hits",
    "Records",
    "Written",
    "Recency",
    "Hybrid",
    "Position",
    "AcquireTimeout",
    "BrokerUnavailable",
    "ClosedError",
    "ConfigError",
    "ForkedPoolError",
    "InvalidRequest",
    "KalosError",
    "KalosTimeout",
    "PartialWrite",
    "PayloadTooLarge",
    "PositionTimeout",
    "ProtocolError",
    "ResponseTimeout",
    "ServerError",
    "SlotsExhausted",
    "UnknownNamespace",
    "UsageError",
    "PROTOCOL_VERSION",
]
