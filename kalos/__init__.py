"""Kalos: exact top-k recall served from a GPU sidecar over POSIX shared memory.

This is the public API (``from kalos import RecallPool``). One import package holds everything:
``kalos.broker`` (the shared-memory contract), ``kalos.clients`` and ``kalos.sidecar_cuda``, kept in
the checkout's top-level folders of those names. The applications live beside it (:mod:`kalos.cli`, the
``kalos`` command; :mod:`kalos.testing`, helpers for tests and benchmarks).
"""

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
from kalos.broker.positions import Position
from kalos.clients import Hit, Hits, PoolStatistics, RecallClient, RecallPool, Records, Written

__version__ = "0.1.0"
__all__ = [
    "RecallPool",
    "RecallClient",
    "PoolStatistics",
    "Hit",
    "Hits",
    "Records",
    "Written",
    "Recency",
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
