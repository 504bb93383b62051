"""The one exception hierarchy of Kalos, split by who is at fault.

::

    KalosError
     +-- UsageError            the caller's mistake: bad arguments or configuration
     |    +-- ConfigError      bad broker name, layout parameters, CLI options, a pool larger
     |    |                    than the sidecar's --slots
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
     +-- SlotsExhausted        the sidecar serves, but other processes hold the slots a pool or client
     |                         needs to open (its min_size), for all of its connect_timeout
     +-- ProtocolError         bad magic, another protocol version, a corrupt slot
     +-- ServerError           the sidecar failed serving a valid request (backend, store)
     +-- ClosedError           the pool or client was closed by its user
     +-- PartialWrite          a chunked upsert/delete failed after part of it was applied; raised
                               as a subclass of the error that stopped it (:func:`partial_write`)

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
    """The sidecar's UNKNOWN_NAMESPACE status. A current sidecar never answers it: a namespace that
    was never written (or was dropped) holds no record, so reads of it answer empty (no hits,
    count 0) and writes of it count 0, as LangGraph's store and mem0 answer for a user with no
    memories. Kept so that clients decode the status of an older sidecar."""


class PayloadTooLarge(InvalidRequest):
    """Payloads of one request do not fit the slot's blob area."""


class KalosTimeout(KalosError, TimeoutError):
    """A time budget ran out. Also a ``TimeoutError``, so (on Python 3.11+, where
    ``asyncio.TimeoutError is TimeoutError``) an ``except asyncio.TimeoutError`` catches it too:
    the clients never tell a sidecar's answer from their own budget that way
    (``clients._exchange.settled_within``)."""


class AcquireTimeout(KalosTimeout):
    """No slot became free within the budget (the pool is saturated)."""


class ResponseTimeout(KalosTimeout):
    """The request was posted but not answered within the budget."""


class PositionTimeout(ResponseTimeout):
    """A read given ``after=`` a fleet position: the local sidecar had not applied the change log
    up to it within the budget (it lags behind the store, or cannot reach it)."""


class BrokerUnavailable(KalosError):
    """No sidecar serves this broker name, or it died or stopped."""


class SlotsExhausted(KalosError):
    """The sidecar serves the name, but fewer of its slots came free than a pool needs to open
    (its ``min_size``) or a RecallClient (one), within its ``connect_timeout``: other processes
    lease them and keep them (elastic pools give back what they hold beyond their ``min_size``
    while a process waits for its first). Not an outage (the sidecar is fine) and not a mistake
    in the call: a question of sizing (the sidecar's ``--slots`` against the ``min_size`` of
    every process's pools and clients). A pool that is open never raises it: when it cannot
    lease more slots its callers queue for its own."""


class UntrustedBroker(BrokerUnavailable):
    """The broker's shared objects are not owned by the expected user, or others can access them:
    whoever made them could read the queries and forge the answers, so the client does not attach."""


class ProtocolError(KalosError):
    """Shared memory does not follow the protocol: magic, version, or a corrupt slot."""


class ServerError(KalosError):
    """The sidecar failed while serving a valid request."""


class ClosedError(KalosError):
    """The pool or client has been closed."""


class PartialWrite(KalosError):
    """A chunked upsert or delete (more rows than one slot carries) failed after some of its
    chunks were applied, or while some were in flight: the call was not all or nothing.

    Never raised as itself: :func:`partial_write` raises a subclass of both this class and the
    error that stopped the call (``except BrokerUnavailable`` still catches an outage mid-call).
    The ids are the call's, deduplicated, in the order given:

    * ``written``: acknowledged by the sidecar (durable with ``--data-dir``);
    * ``unwritten``: not applied: never sent, or refused by the sidecar before it wrote anything;
    * ``in_doubt``: sent but never answered (the sidecar died, the budget ran out), or failed on
      the sidecar after its store took them: applied or not. Upsert and delete are idempotent, so
      sending these again is safe.
    """

    written: tuple[int, ...]
    unwritten: tuple[int, ...]
    in_doubt: tuple[int, ...]

    def __init__(
        self,
        message: str,
        *,
        written: tuple[int, ...] = (),
        unwritten: tuple[int, ...] = (),
        in_doubt: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.written = written
        self.unwritten = unwritten
        self.in_doubt = in_doubt

    def __reduce__(self) -> tuple[object, ...]:
        # The class is made at run time: pickle the error it stands for instead of the class.
        cause = next(c for c in type(self).__mro__[1:] if issubclass(c, KalosError) and not issubclass(c, PartialWrite))
        return (
            _rebuild_partial,
            (cause, self.args[0] if self.args else "", self.written, self.unwritten, self.in_doubt),
        )


_PARTIAL_CLASSES: dict[type[KalosError], type[PartialWrite]] = {}


def partial_write_class(cause: type[KalosError]) -> type[PartialWrite]:
    """``PartialWrite[cause]``: a subclass of both (made once per cause class)."""
    cls = _PARTIAL_CLASSES.get(cause)
    if cls is None:
        cls = type(
            f"PartialWrite[{cause.__name__}]",
            (PartialWrite, cause),
            {"__module__": __name__, "__doc__": PartialWrite.__doc__},
        )
        _PARTIAL_CLASSES[cause] = cls
    return cls


def partial_write(
    cause: KalosError, message: str, *, written: tuple[int, ...], unwritten: tuple[int, ...], in_doubt: tuple[int, ...]
) -> PartialWrite:
    """The error for a call stopped by ``cause`` after a part of it was applied (or was in
    flight): an instance of ``PartialWrite`` and of ``type(cause)``."""
    return partial_write_class(type(cause))(message, written=written, unwritten=unwritten, in_doubt=in_doubt)


def _rebuild_partial(
    cause: type[KalosError],
    message: str,
    written: tuple[int, ...],
    unwritten: tuple[int, ...],
    in_doubt: tuple[int, ...],
) -> PartialWrite:
    return partial_write_class(cause)(message, written=written, unwritten=unwritten, in_doubt=in_doubt)
