#!/usr/bin/env python3
"""Requests (round trips) each integration store operation sends, counted by the sidecar
(``kalos_requests_total`` on its ``--metrics-port``), with the client process's CPU time.
Public entry points only (stores closed with ``close()``, which every version has), so the
same script measures another checkout::

    python bench/integrations_requests.py --nodes 2000 --out requests.json
    git archive 4d39810 | tar -x -C /tmp/kalos-before
    PYTHONPATH=/tmp/kalos-before python bench/integrations_requests.py

Operations (sync methods, one blocking client per store, fresh namespaces): LlamaIndex ``add``
of N new nodes, then of the same N again, then of N new ones beside them; LangChain ``add_texts`` of N texts into a namespace
that does not exist yet, then N new ones beside them, then 300 searches; LangGraph ``batch`` of N
new puts, then the same N again, then N new ones beside them, then one ``get``. Prints one JSON object: ``{"nodes", "dim",
"max_queries", "ops": {name: {"requests", "client_cpu_ms"}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from contextlib import closing
from typing import Any

import numpy as np
from langchain_core.embeddings import Embeddings
from langgraph.store.base import PutOp
from llama_index.core.schema import TextNode

from kalos.integrations.langchain import KalosVectorStore
from kalos.integrations.langgraph import KalosStore
from kalos.integrations.llamaindex import KalosLlamaVectorStore
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process


class TableEmbeddings(Embeddings):
    """Text ``"i"`` embeds as row i of a fixed table (no model in the measurement)."""

    def __init__(self, vectors: list[list[float]]) -> None:
        self.vectors = vectors

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.vectors[int(t)] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.vectors[int(text)]


def served(port: int) -> int:
    """Requests the sidecar has served so far (every op, errors too)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        m = re.search(r"^kalos_requests_total (\S+)$", r.read().decode(), re.MULTILINE)
    if m is None:
        raise RuntimeError("the sidecar exports no kalos_requests_total")
    return int(float(m.group(1)))


def measure(port: int, op: Callable[[], Any]) -> dict[str, float]:
    """Requests ``op`` sent and the CPU time (ms) this process spent on it."""
    before = served(port)
    t = time.process_time()
    op()
    cpu = time.process_time() - t
    time.sleep(0.05)  # the sidecar counts a request just after answering it
    return {"requests": served(port) - before, "client_cpu_ms": round(cpu * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2000, help="keys per write (default 2000)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--max-queries", type=int, default=32, help="the sidecar's ids per request")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    n = args.nodes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    name = f"ireq{os.getpid()}"
    proc = start_sidecar_process(
        [
            "--ephemeral",
            "--dim",
            str(args.dim),
            "--backend",
            "numpy",
            "--metric",
            "cosine",
            "--max-queries",
            str(args.max_queries),
            "--metrics-port",
            str(port),
        ],
        name,
    )
    ops: dict[str, dict[str, float]] = {}
    try:
        vectors = np.random.default_rng(0).standard_normal((2 * n, args.dim)).tolist()
        nodes = [TextNode(text=f"t{i}", id_=f"n{i}", embedding=vectors[i]) for i in range(2 * n)]
        with closing(KalosLlamaVectorStore(name, namespace="li", timeout=30.0)) as li:
            ops["llamaindex add N new nodes"] = measure(port, lambda: li.add(nodes[:n]))
            ops["llamaindex add the N again"] = measure(port, lambda: li.add(nodes[:n]))
            ops["llamaindex add N new beside them"] = measure(port, lambda: li.add(nodes[n:]))
        with closing(KalosVectorStore(TableEmbeddings(vectors), name=name, namespace="lc")) as lc:
            texts = [str(i) for i in range(2 * n)]
            ids = [f"d{i}" for i in range(2 * n)]
            ops["langchain add_texts N, no namespace yet"] = measure(port, lambda: lc.add_texts(texts[:n], ids=ids[:n]))
            ops["langchain add_texts N new beside them"] = measure(port, lambda: lc.add_texts(texts[n:], ids=ids[n:]))
            ops["langchain 300 searches"] = measure(
                port, lambda: [lc.similarity_search_by_vector(vectors[i], 10) for i in range(300)]
            )
        with closing(KalosStore(name, namespace="lg")) as lg:
            puts = [PutOp(("bench", str(i % 7)), f"k{i}", {"i": i}) for i in range(2 * n)]
            ops["langgraph batch of N new puts"] = measure(port, lambda: lg.batch(puts[:n]))
            ops["langgraph batch of the N again"] = measure(port, lambda: lg.batch(puts[:n]))
            ops["langgraph batch of N new beside them"] = measure(port, lambda: lg.batch(puts[n:]))
            ops["langgraph get 1"] = measure(port, lambda: lg.get(("bench", "0"), "k0"))
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)
    result = {"nodes": n, "dim": args.dim, "max_queries": args.max_queries, "ops": ops}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
