"""A store's way to the sidecar, shared by the three integrations: :class:`Connections`.

Sync methods run their plan (``_plans``) on one blocking ``RecallClient``; async methods run the
same plan on the running loop's ``RecallPool`` (``_loops.LoopPools``: one per loop). Both are
opened on the first request a plan makes (a plan that returns before asking for anything, or
that refuses its input, opens nothing), or given to the store (then used in every loop and never
closed by it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kalos.broker.errors import UsageError
from kalos.clients.blocking import RecallClient
from kalos.clients.pool import RecallPool

from ._loops import LoopPools
from ._plans import Plan, Step

R = TypeVar("R")
S = TypeVar("S", bound="ConnectedStore")


def require_similarity(metric: str, what: str) -> None:
    """Stores that promise cosine similarities need a sidecar that scores by inner product:
    raise UsageError (naming the sidecar's metric) for one started with ``--metric l2``."""
    if metric not in ("cosine", "dot"):
        raise UsageError(
            f"{what} needs a sidecar started with --metric cosine or dot (its scores "
            f"are then cosine similarities); this one scores with {metric!r}"
        )


class Connections:
    """The client and pools of one store, and the two drivers of its plans.

    ``timeout``: seconds per Kalos request (None: no limit); ``connect_timeout``: seconds to
    wait for a sidecar when opening; ``pool_size``: slots of each loop's pool; ``client`` /
    ``pool``: the caller's, used instead of opening one; ``similarity_for``: the store's name
    when it promises cosine similarities (an ``l2`` sidecar then raises UsageError on use).
    """

    def __init__(
        self,
        name: str,
        *,
        timeout: float | None,
        connect_timeout: float = 10.0,
        pool_size: int = 4,
        client: RecallClient | None = None,
        pool: RecallPool | None = None,
        similarity_for: str | None = None,
    ) -> None:
        self.name = name
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._pool_size = pool_size
        self._similarity_for = similarity_for
        self._lock = threading.Lock()
        self._client = client
        self._owns_client = False
        self._given_pool = pool
        self._pools: LoopPools[RecallPool] = LoopPools(self._open_pool)
        #: Namespaces the store has seen holding records (a hint: a write's reads into one that
        #: is not here start with a count, and none means nothing to read; ``_plans.read_probes``).
        self.filled: set[str] = set()

    # ------------------------------------------------------------------ connections
    def client(self) -> RecallClient:
        """The blocking client (opened on first use, once, whichever thread asks)."""
        with self._lock:
            if self._client is None:
                self._client = RecallClient(self.name, timeout=self._timeout, connect_timeout=self._connect_timeout)
                self._owns_client = True
            client = self._client
        self._check(client.metric)
        return client

    async def pool(self) -> RecallPool:
        """The running loop's pool (the given one in every loop), opened on first use: waits up
        to ``connect_timeout`` seconds for a sidecar, then raises BrokerUnavailable; raises
        UsageError for an ``l2`` sidecar when the store promises cosine similarities."""
        pool = self._given_pool if self._given_pool is not None else await self._pools.get()
        self._check(pool.metric)
        return pool

    def metric(self) -> str:
        """The sidecar's ``--metric``: from an open pool if there is one (no client is opened
        then), else from the client."""
        pool = self._given_pool if self._given_pool is not None else self._pools.opened()
        return pool.metric if pool is not None else self.client().metric

    @property
    def opened(self) -> bool:
        """Whether the store opened a client or a pool."""
        return self._owns_client or self._pools.loops() > 0

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """The sidecar model's vectors of ``texts`` as lists (the frameworks' embedding format),
        over the blocking client; none for none."""
        if not texts:
            return []
        vectors: list[list[float]] = self.client().embed(list(texts)).tolist()
        return vectors

    async def aembed(self, texts: Sequence[str]) -> list[list[float]]:
        """:meth:`embed` over the running loop's pool."""
        if not texts:
            return []
        pool = await self.pool()
        vectors: list[list[float]] = (await pool.embed(list(texts))).tolist()
        return vectors

    def _open_pool(self) -> Coroutine[Any, Any, RecallPool]:
        return RecallPool(
            self.name, size=self._pool_size, timeout=self._timeout, connect_timeout=self._connect_timeout
        ).open()

    def _check(self, metric: str) -> None:
        if self._similarity_for is not None:
            require_similarity(metric, self._similarity_for)

    def close(self) -> None:
        """Close the client the store opened, and terminate the pools of loops that have ended.
        Closing twice is fine; pools of running loops need :meth:`aclose` there."""
        with self._lock:
            client, owned = self._client, self._owns_client
            if owned:
                self._client, self._owns_client = None, False
        if owned and client is not None:
            client.close()
        self._pools.reap()

    async def aclose(self) -> None:
        """Close the running loop's pool (waiting for its requests), then as :meth:`close`."""
        await self._pools.aclose()
        self.close()

    # ------------------------------------------------------------------ drivers
    def run(self, plan: Plan[R]) -> R:
        """Run ``plan`` on the blocking client, step after step; raises what a step raises
        (errors it does not catch), the client's errors included."""
        client: RecallClient | None = None
        try:
            steps = next(plan)
            while True:
                if client is None:
                    client = self.client()
                steps = plan.send([_run(client, s) for s in steps])
        except StopIteration as done:
            result: R = done.value
            return result
        finally:
            plan.close()

    async def arun(self, plan: Plan[R]) -> R:
        """Run ``plan`` on the running loop's pool, the steps of each round concurrently (all
        of them finish before the first uncaught error is raised). Each request has the store's
        ``timeout`` (seconds); raises what :meth:`pool` and the steps raise (Kalos errors)."""
        pool: RecallPool | None = None
        try:
            steps = next(plan)
            while True:
                if pool is None:
                    pool = await self.pool()
                steps = plan.send(await _arun_all(pool, steps))
        except StopIteration as done:
            result: R = done.value
            return result
        finally:
            plan.close()


def _run(client: RecallClient, step: Step[Any]) -> Any:
    try:
        return step.run(client)
    except step.catch as e:
        return e


async def _arun(pool: RecallPool, step: Step[Any]) -> tuple[Any]:
    """The step's result (or caught error) in a 1-tuple, told apart from an uncaught error."""
    try:
        return (await step.arun(pool),)
    except step.catch as e:
        return (e,)


async def _arun_all(pool: RecallPool, steps: Sequence[Step[Any]]) -> list[Any]:
    if len(steps) == 1:  # the common case, without a task
        return [(await _arun(pool, steps[0]))[0]]
    outcomes = await asyncio.gather(*(_arun(pool, s) for s in steps), return_exceptions=True)
    results: list[Any] = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        results.append(outcome[0])
    return results


class ConnectedStore:
    """What every store does with its :class:`Connections` (``self._conns``): close, aclose and
    the (async) context managers."""

    _conns: Connections

    def close(self) -> None:
        """Close the blocking client the store opened (not one passed in) and terminate the
        pools of event loops that have ended. Closing twice is fine; the pool of a running loop
        needs :meth:`aclose` there."""
        self._conns.close()

    async def aclose(self) -> None:
        """Close what the store opened: the running loop's pool (waiting for its requests),
        then as :meth:`close`."""
        await self._conns.aclose()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
