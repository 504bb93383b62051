"""Kalos broker core: the shared-memory contract, errors and validation shared by sidecar and clients."""

from .errors import (
    AcquireTimeout,
    BrokerUnavailable,
    ClosedError,
    ConfigError,
    ForkedPoolError,
    InvalidRequest,
    KalosError,
    KalosTimeout,
    PayloadTooLarge,
    ProtocolError,
    ResponseTimeout,
    ServerError,
    UnknownNamespace,
    UntrustedBroker,
    UsageError,
)
from .layout import PROTOCOL_VERSION

__all__ = [
    "AcquireTimeout",
    "BrokerUnavailable",
    "ClosedError",
    "ConfigError",
    "ForkedPoolError",
    "InvalidRequest",
    "KalosError",
    "KalosTimeout",
    "PayloadTooLarge",
    "ProtocolError",
    "ResponseTimeout",
    "ServerError",
    "UnknownNamespace",
    "UntrustedBroker",
    "UsageError",
    "PROTOCOL_VERSION",
]
