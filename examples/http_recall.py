"""An HTTP recall endpoint served by several uvicorn workers next to one Kalos sidecar.

    kalos serve --name default --dim 16 --ephemeral --random-rows 3000 &
    KALOS_NAME=default uvicorn examples.http_recall:app --workers 4 --port 8000
    curl 'localhost:8000/recall?seed=7&k=5'

The pattern for pre-fork servers: **open the pool in each worker, after the fork** (here in the
ASGI lifespan, which uvicorn runs in every worker process; with gunicorn, the same code in
``post_fork`` or the app's startup). A pool opened in the master before forking raises
ForkedPoolError in the workers.

Across a sidecar restart a request waits for the new sidecar up to ``KALOS_TIMEOUT`` seconds
(default 2) and otherwise answers 503 with ``Retry-After``; the pools re-attach by themselves.
The query vector is derived from ``seed`` so that a caller can check the answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import numpy as np

from kalos import BrokerUnavailable, InvalidRequest, KalosTimeout, RecallPool

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def query_for(seed: int, dim: int) -> np.ndarray:
    """The query vector of ``seed`` (the caller can recompute it)."""
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


class RecallApp:
    def __init__(self) -> None:
        self.pool: RecallPool | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.http(scope, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                # In the worker, after the fork: one pool per worker process.
                self.pool = RecallPool(
                    os.environ.get("KALOS_NAME", "default"),
                    size=8,
                    timeout=float(os.environ.get("KALOS_TIMEOUT", "2")),
                    connect_timeout=30,
                )
                await self.pool.open()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.pool is not None:
                    await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def http(self, scope: Scope, send: Send) -> None:
        if scope["path"] != "/recall" or self.pool is None:
            await respond(send, 404, {"error": "GET /recall?seed=N&k=K"})
            return
        args = parse_qs(scope["query_string"].decode())
        try:
            seed, k = int(args["seed"][0]), int(args.get("k", ["10"])[0])
            hits = await self.pool.recall(query_for(seed, self.pool.layout.dim), k=k)
        except (KeyError, ValueError, InvalidRequest) as e:
            await respond(send, 400, {"error": str(e)})
        except (BrokerUnavailable, KalosTimeout) as e:
            await respond(send, 503, {"error": str(e)}, retry_after=True)
        else:
            await respond(send, 200, {"ids": hits.ids.tolist(), "scores": hits.scores.tolist(), "worker": os.getpid()})


async def respond(send: Send, status: int, body: dict[str, Any], retry_after: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


app = RecallApp()
