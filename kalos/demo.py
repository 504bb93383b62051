"""``kalos demo`` and ``kalos bench``: a real sidecar process, real client processes, and figures
that say what they measure.

``kalos demo`` (``make demo``) shows what Kalos is for and what it costs, in well under a minute:

1. agents remember sentences and recall them, each among its own memories (a filter), through one
   sidecar: the idea of ``examples/agent_memory.py``, with a toy embedder built in here (words
   hashed into vectors) so that nothing is downloaded;
2. recall under load: a lone agent and many concurrent agents in several processes through the
   sidecar, beside numpy in this process answering one query per call and a batch per call, with
   what each figure includes and how to read them side by side.

It imports only what ``pip install .`` brings (no extra): ``make demo`` installs nothing more
(``tests/ipc/test_docs_commands.py`` checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import tempfile
import time
from typing import IO, TYPE_CHECKING

import numpy as np

from kalos.testing.loadgen import LoadResult, LoadSpec, check_samples, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

if TYPE_CHECKING:
    from rich.console import Console

#: The namespace the text memories of part 1 go to (the load of part 2 recalls "default").
TEXT_NAMESPACE = "demo-text"

#: What each agent remembers (examples/agent_memory.py's agents remember the same) ...
MEMORIES: dict[str, list[str]] = {
    "travel": [
        "The user's flight to Lisbon leaves on the 14th at 7:40 from gate B22.",
        "The user prefers aisle seats and always checks one bag.",
        "The hotel in Lisbon is booked for four nights near Alfama.",
        "The user's passport expires in March of next year.",
        "A rental car was declined; the user will take trains in Portugal.",
    ],
    "billing": [
        "Invoice 2291 for 480 euros was paid by card on the 3rd.",
        "The user disputes a duplicate charge of 19.99 from the streaming service.",
        "The company card ending in 4417 is used for work expenses only.",
        "The user asked to move the monthly plan from premium to basic.",
        "A refund of 120 euros for the cancelled workshop is still pending.",
    ],
    "health": [
        "The user is allergic to penicillin.",
        "The dentist appointment was moved to Thursday at 15:00.",
        "The user runs 5 km three times a week and wants to train for a half marathon.",
        "The user takes vitamin D in winter on the doctor's advice.",
        "Blood test results from October were all in the normal range.",
    ],
    "code": [
        "The service deploys with a rolling restart; the sidecar starts before the workers.",
        "Unit tests must not use the network; integration tests start real processes.",
        "The team agreed to type-check the whole package with mypy in strict mode.",
        "The staging database is reset every Sunday night.",
        "Feature flags live in a YAML file reviewed like code.",
    ],
}
#: ... and asks (phrased with words of the memory it should find: the toy embedder only sees
#: words, never meaning).
QUESTIONS: dict[str, str] = {
    "travel": "When does my flight leave?",
    "billing": "Was I charged twice by the streaming service?",
    "health": "When is my dentist appointment?",
    "code": "How do we deploy the service?",
}
_STOP = frozenset(
    "a an and are at be by do does for from how i in is it me my of on or our the to was we what when "
    "where which who will with you your".split()
)


def toy_embed(texts: list[str], dim: int) -> np.ndarray:
    """A toy text embedding for the demo, **not a language model**: each word (but a few common
    ones) and its three-letter pieces are hashed into ``dim`` signed buckets, and each row is
    scaled to unit length. Texts that share words get similar vectors; synonyms do not. It is
    deterministic (blake2b, not Python's salted ``hash``) and needs no download.
    ``examples/agent_memory.py`` does the same job with a real model."""
    out = np.zeros((len(texts), dim), np.float32)
    for row, text in enumerate(texts):
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            if word in _STOP:
                continue
            w = f"<{word}>"
            for piece, weight in [(w, 2.0)] + [(w[i : i + 3], 1.0) for i in range(len(w) - 2)]:
                h = int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=8).digest(), "little")
                out[row, h % dim] += weight if h >> 63 else -weight
        norm = float(np.linalg.norm(out[row]))
        if norm:
            out[row] /= norm
    return out


async def text_memory(name: str, dim: int, k: int = 2) -> tuple[list[tuple[str, str, list[tuple[float, str]]]], int]:
    """Part 1: every agent writes its memories (vector + payload ``{"agent", "text"}``) into
    :data:`TEXT_NAMESPACE`, then asks its question among its own memories (``where=``), all
    concurrently over one pool. Returns ``(agent, question, [(score, text), ...])`` per agent
    and how many answers differ from a float64 search over the same vectors (0 expected)."""
    from kalos import RecallPool

    agents = sorted(MEMORIES)
    vectors = {a: toy_embed(MEMORIES[a], dim) for a in agents}
    wrong = 0

    async def agent(pool: RecallPool, a: str, number: int) -> tuple[str, str, list[tuple[float, str]]]:
        nonlocal wrong
        texts = MEMORIES[a]
        ids = [number * 1000 + i for i in range(len(texts))]  # one id per memory: a rerun replaces
        await pool.upsert(ids, vectors[a], [{"agent": a, "text": t} for t in texts], namespace=TEXT_NAMESPACE)
        q = toy_embed([QUESTIONS[a]], dim)[0]
        hits = await pool.recall(q, k=k, namespace=TEXT_NAMESPACE, where={"agent": a}, with_payload=True)
        best = np.sort(vectors[a].astype(np.float64) @ q.astype(np.float64))[::-1][:k]
        if (
            len(hits) != min(k, len(texts))
            or not np.allclose(hits.scores, best, atol=1e-5)
            or any(h.payload["agent"] != a for h in hits)
        ):
            wrong += 1
        return a, QUESTIONS[a], [(h.score, str(h.payload["text"])) for h in hits]

    async with RecallPool(name, size=len(agents)) as pool:
        out = await asyncio.gather(*(agent(pool, a, n) for n, a in enumerate(agents)))
    return list(out), wrong


def _duration(us: float) -> str:
    """A latency for people: microseconds below 1 ms, else milliseconds."""
    if us != us:  # NaN: nothing measured
        return "-"
    return f"{us:,.0f} us" if us < 1000 else f"{us / 1000:,.1f} ms"


def _sidecar_log_tail(log: IO[bytes], n: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


def inproc_numpy(
    matrix: np.ndarray, k: int, seconds: float = 1.0, batch: int = 1, seed: int = 1
) -> tuple[dict[str, float], float]:
    """What a user would do in their own process: scores = Q @ M.T, argpartition, sort.
    Returns (percentiles of one call in us, recalls/s)."""
    rng = np.random.default_rng(seed)
    bank = rng.standard_normal((64, batch, matrix.shape[1]), dtype=np.float32)
    lat: list[int] = []
    n = matrix.shape[0]
    kk = min(k, n)
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(lat) < 20:
        q = bank[i % 64]
        i += 1
        t = time.perf_counter_ns()
        s = q @ matrix.T
        if kk < n:
            part = np.argpartition(s, n - kk, axis=1)[:, n - kk :]
        else:
            part = np.broadcast_to(np.arange(n), s.shape)
        v = np.take_along_axis(s, part, axis=1)
        np.take_along_axis(part, np.argsort(-v, axis=1), axis=1)
        lat.append(time.perf_counter_ns() - t)
    a = np.asarray(lat[5:]) / 1e3
    p = np.percentile(a, [50, 95, 99])
    return ({"p50_us": float(p[0]), "p95_us": float(p[1]), "p99_us": float(p[2])}, batch * len(a) / (a.sum() / 1e6))


def run_demo(a: argparse.Namespace) -> int:
    """``kalos demo``: part 1 (text memory), part 2 (recall under load), figures explained."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    seed = int.from_bytes(os.urandom(4), "little")
    name = f"demo-{os.getpid()}"
    console.print(
        "[bold]Kalos demo[/]: one sidecar process holds the memories; agents in other processes recall "
        "from it through shared memory."
    )
    with tempfile.TemporaryFile() as log:  # the sidecar's log, shown only if something fails
        try:
            proc = start_sidecar_process(random_rows_args(a, seed, a.agents), name, stderr=log)
        except RuntimeError as e:
            console.print(f"[red]the sidecar did not start: {escape(str(e))}[/]\n{escape(_sidecar_log_tail(log))}")
            return 1
        try:
            backend = _backend_line(name)
            console.print(
                f"sidecar {name!r}: {backend}, {a.rows:,} random memories x {a.dim} in namespace 'default' "
                "(ephemeral: gone when it stops)\n"
            )
            console.print("[bold]1. What it is for: an agent's memories, as text[/]")
            answers, text_wrong = asyncio.run(text_memory(name, a.dim))
            console.print(
                f"{len(answers)} agents (asyncio tasks sharing one pool) write what they know into namespace "
                f"'{TEXT_NAMESPACE}': one record per sentence, a vector and the payload "
                '{"agent": ..., "text": ...}. Each then asks a question among its own memories only '
                '(where={"agent": ...}). Embeddings: [bold]a toy hashing of words, built into the demo '
                "so nothing is downloaded[/] (not a language model: it matches words, not meaning; "
                "examples/agent_memory.py does the same with a real model)."
            )
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True)
            grid.add_column()
            for agent, question, hits in answers:
                grid.add_row(f"  {agent}:", f"[italic]{escape(question)}[/]")
                for score, text in hits:
                    grid.add_row(f"  {score:7.3f}", escape(text))
            console.print(grid)
            console.print(
                "  (scores: cosine similarity, the vectors being unit length; best first; every answer "
                f"checked against a float64 search: [{'green' if not text_wrong else 'red'}]{text_wrong} wrong[/])\n"
            )
            console.print(f"[bold]2. Recall under load: the {a.rows:,} random memories, k={a.k}[/]")
            console.print(
                f"One agent alone, then {a.agents} agents (asyncio tasks, each process with its own pool) in "
                f"{a.procs} processes recall random queries through the sidecar for {a.seconds:g} s; then numpy, "
                f"in this process, answers the same kind of queries over a copy of the memories, one query per "
                f"call and {a.agents} per call."
            )
            lone_s = max(0.5, min(2.0, a.seconds / 2))
            lone = _load(
                console,
                LoadSpec(name=name, dim=a.dim, procs=1, tasks=1, duration_s=lone_s, warmup_s=0.3, k=a.k, seed=seed),
                "1 agent",
            )
            many = _load(
                console,
                LoadSpec(
                    name=name,
                    dim=a.dim,
                    procs=a.procs,
                    tasks=a.agents,
                    duration_s=a.seconds,
                    warmup_s=0.5,
                    k=a.k,
                    seed=seed + 1,
                    keep=500,
                ),
                f"{a.agents} agents in {a.procs} processes",
            )
        except Exception:
            console.print(f"[red]the demo failed; the sidecar's log:[/]\n{escape(_sidecar_log_tail(log))}")
            raise
        finally:
            stop_sidecar_process(proc)
    matrix = np.random.default_rng(seed).standard_normal((a.rows, a.dim), dtype=np.float32)
    checked, wrong = check_samples(lone.samples + many.samples, matrix, a.k)
    one, one_tput = inproc_numpy(matrix, a.k, seconds=1.0)
    batch, batch_tput = inproc_numpy(matrix, a.k, seconds=1.0, batch=a.agents)
    p1, pn = lone.percentiles_us(), many.percentiles_us()

    t = Table(title=f"recall of {a.rows:,} x {a.dim} memories, k={a.k} ({backend})")
    t.add_column("who asks")
    t.add_column("latency p50", justify="right")
    t.add_column("p99", justify="right")
    t.add_column("recalls/s", justify="right")
    t.add_row("Kalos, 1 agent", _duration(p1["p50_us"]), _duration(p1["p99_us"]), f"{lone.throughput:,.0f}")
    t.add_row(
        f"Kalos, {a.agents} agents / {a.procs} processes",
        _duration(pn["p50_us"]),
        _duration(pn["p99_us"]),
        f"{many.throughput:,.0f}",
    )
    t.add_row(
        "numpy in-process, 1 query/call",
        _duration(one["p50_us"]),
        _duration(one["p99_us"]),
        f"{one_tput:,.0f}",
    )
    t.add_row(
        f"numpy in-process, {a.agents} queries/call",
        _duration(batch["p50_us"]) + " *",
        _duration(batch["p99_us"]) + " *",
        f"{batch_tput:,.0f}",
    )
    console.print(t)
    columns, readings = _notes(
        a, backend, p1["p50_us"], one["p50_us"], many.throughput, batch_tput, os.cpu_count() or 1
    )
    for title, rows in (
        ("What the columns say", columns),
        ("Reading the rows side by side", [("-", r) for r in readings]),
    ):
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column()
        for term, text in rows:
            grid.add_row(f"  {term}", text)
        console.print(f"[bold]{title}[/]")
        console.print(grid)
    errors = lone.errors + many.errors
    console.print(
        f"{lone.count + many.count:,} recalls through Kalos, {errors} errors; {checked} answers checked against a "
        f"numpy float64 search: [{'green' if not wrong else 'red'}]{wrong} wrong[/]"
    )
    return 1 if wrong or text_wrong or errors or not many.count or not lone.count else 0


def _load(console: Console, spec: LoadSpec, label: str) -> LoadResult:
    """One :func:`~kalos.testing.loadgen.run_load` with a progress bar (gone when it ends)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[n]:>9,} recalls"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as prog:
        task = prog.add_task(f"{label} recalling", total=spec.duration_s, n=0)
        t0 = [0.0]

        def tick(n: int) -> None:
            if n and not t0[0]:
                t0[0] = time.perf_counter()
            prog.update(task, completed=time.perf_counter() - t0[0] if t0[0] else 0, n=n)

        return run_load(spec, progress_cb=tick)


def _notes(
    a: argparse.Namespace,
    backend: str,
    lone_p50_us: float,
    numpy_p50_us: float,
    many_tput: float,
    batch_tput: float,
    cpus: int,
) -> tuple[list[tuple[str, str]], list[str]]:
    """What the table's columns mean (term, meaning) and how to read its rows side by side (with
    this run's numbers)."""
    columns = [
        (
            "latency",
            "one recall, from the call to the answer in hand, as the agent sees it. Through Kalos it is a "
            "round trip to another process: the query is written to shared memory, the sidecar wakes, "
            "searches and writes the answer back. With many agents a recall also waits for the batch it "
            "joins: the sidecar searches the queries of every process together.",
        ),
        ("*", "numpy with a batch: the time of the whole call, which answers every query of the batch."),
        ("recalls/s", "answers per second, all callers together."),
    ]
    extra = lone_p50_us - numpy_p50_us
    if extra > 0:
        lone = (
            f"A lone recall through Kalos took {_duration(extra)} more than numpy in this process: what the "
            "round trip to another process and back costs on this machine now (about 10 us on an idle "
            "2-vCPU VM at 256 x 128, README 'Performance'; more where other work shares the cores)."
        )
    else:
        lone = (
            f"A lone recall through Kalos took no longer than numpy in this process ({_duration(lone_p50_us)} "
            f"against {_duration(numpy_p50_us)}): the search dominates and the round trip is lost in it."
        )
    ratio = many_tput / batch_tput if batch_tput else 0.0
    readings = [
        lone,
        f"{a.agents} agents in {a.procs} processes got {many_tput:,.0f} recalls/s, {ratio:.2f}x numpy "
        f"answering {a.agents} queries per call. Such a call is the most one process can do, and only "
        "with every query in hand at once; agents in separate processes never are: Kalos batches their "
        "queries for them.",
        f"One copy of the memories ({a.rows * a.dim * 4 / 2**20:,.1f} MiB here) serves every process. "
        "Without the sidecar each process would hold a copy of its own and would not see the others' writes.",
    ]
    if "numpy" in backend:
        readings.append(
            f"Here the sidecar, the agents and numpy share this machine's {cpus} CPU "
            f"core{'s' if cpus != 1 else ''}: the agents' own work competes with the search. With a GPU "
            "(CuPy) the sidecar searches there; README, 'Performance', has measured figures."
        )
    else:
        readings.append("The sidecar searched on the GPU; numpy's rows ran on this machine's CPU.")
    return columns, readings


def _backend_line(name: str) -> str:
    from kalos.clients._transport import Connection

    c = Connection(name)
    try:
        return {1: "numpy backend", 2: "CUDA backend"}.get(int(c.seg.header["backend"]), "?")
    finally:
        c.close()


def random_rows_args(a: argparse.Namespace, seed: int, callers: int) -> list[str]:
    """An ephemeral sidecar's arguments with ``a.rows`` random memories of ``a.dim`` (regenerable
    from ``seed``) and a slot per caller, at least 64: what the demo and ``kalos bench`` start."""
    return [
        "--ephemeral",
        *("--dim", str(a.dim), "--backend", a.backend),
        *("--random-rows", str(a.rows), "--seed", str(seed)),
        *("--slots", str(max(64, callers))),
    ]


def run_bench(a: argparse.Namespace) -> int:
    import json

    from kalos.testing.loadgen import environment

    seed = int.from_bytes(os.urandom(4), "little")
    name = f"bench-{os.getpid()}"
    proc = start_sidecar_process(random_rows_args(a, seed, a.tasks), name)
    try:
        res = run_load(
            LoadSpec(
                name=name, dim=a.dim, procs=a.procs, tasks=a.tasks, duration_s=a.seconds, k=a.k, seed=seed, loop=a.loop
            )
        )
        backend = _backend_line(name)
    finally:
        stop_sidecar_process(proc)
    matrix = np.random.default_rng(seed).standard_normal((a.rows, a.dim), dtype=np.float32)
    checked, wrong = check_samples(res.samples, matrix, a.k)
    base, base_tput = inproc_numpy(matrix, a.k)
    out = {
        "rows": a.rows,
        "dim": a.dim,
        "k": a.k,
        "tasks": a.tasks,
        "procs": a.procs,
        "loop": a.loop,
        "backend": backend,
        "broker": {**res.percentiles_us(), "recalls_per_s": res.throughput, "n": res.count, "errors": res.errors},
        "inproc_numpy": {**base, "recalls_per_s": base_tput},
        "checked": checked,
        "wrong": wrong,
        "env": environment(),
    }
    print(json.dumps(out, indent=1))
    return 1 if wrong else 0
