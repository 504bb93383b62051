"""The one exception hierarchy of Kalos, split by who is at fault.

::

    KalosError
     +-- UsageError            the caller's mistake: bad arguments or configuration
     |    +-- ConfigError      bad broker name, layout parameters, CLI options
     |    +-- ForkedPoolError  a pool used in a forked child of the process that opened it
     |    +-- InvalidRequest   wrong dim/dtype/shape, NaN/inf, k out of range, too many queries ...
     |         +-- UnknownNamespace
     |         +-- PayloadTooLarge
     +-- KalosTimeout          (also a TimeoutError)
     |    +-- AcquireTimeout   no free slot within the budget
     |    +-- ResponseTimeout  the sidecar did not answer within the budget
     |         +-- PositionTimeout  after=: the sidecar had not applied that position in time
     +-- BrokerUnavailable     no sidecar, or it died / stopped
     |    +-- UntrustedBroker  the broker's objects belong to another user or are open to others
     +-- ProtocolError         bad magic, another protocol version, a corrupt slot
     +-- ServerError           the sidecar failed serving a valid request (backend, store)
     +-- ClosedError           the pool or client was closed by its user

posix_ipc, numpy and cupy exceptions are mapped to these at the boundary and never reach callers.
The error a sidecar status code becomes is :func:`kalos.broker.layout.error_for_status`, beside ``Status``.
This module imports nothing of Kalos, so every other one may import it.
"""

from __future__ import annotations


class KalosError(Exception):
    """Base of every error Kalos raises."""


class UsageError(KalosError, ValueError):
    """The caller asked for something invalid."""


class ConfigError(UsageError):
    """Invalid configuration: broker name, layout parameters, CLI options."""


class InvalidRequest(UsageError):
    """A request that can never succeed as written (validated before touching shared memory)."""


class ForkedPoolError(UsageError):
    """A pool or client used in a process other than the one that opened it (after ``fork``):
    its slots belong to the parent. Open one in each worker after forking."""


class UnknownNamespace(InvalidRequest):
    """Recall or delete in a namespace that does not exist."""


class PayloadTooLarge(InvalidRequest):
    """Payloads of one request do not fit the slot's blob area."""


class KalosTimeout(KalosError, TimeoutError):
    """A time budget ran out."""


class AcquireTimeout(KalosTimeout):
    """No slot became free within the budget (the pool is saturated)."""


class ResponseTimeout(KalosTimeout):
    """The request was posted but not answered within the budget."""


class PositionTimeout(ResponseTimeout):
    """A read given ``after=`` a fleet position: the local sidecar had not applied the change log
    up to it within the budget (it lags behind the store, or cannot reach it)."""


class BrokerUnavailable(KalosError):
    """No sidecar serves this broker name, or it died or stopped."""


class UntrustedBroker(BrokerUnavailable):
    """The broker's shared objects are not owned by the expected user, or others can access them:
    whoever made them could read the queries and forge the answers, so the client does not attach."""


class ProtocolError(KalosError):
    """Shared memory does not follow the protocol: magic, version, or a corrupt slot."""


class ServerError(KalosError):
    """The sidecar failed while serving a valid request."""


class ClosedError(KalosError):
    """The pool or client has been closed."""
