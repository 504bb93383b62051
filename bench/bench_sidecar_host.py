#!/usr/bin/env python3
"""The sidecar's host cost per slot, compiled slot path against the pure-Python one (issue 25),
alternating in one run. Writes JSON to bench/results/.

1. In process: two sidecars (numpy backend, 256 x 128, k=10), one on each slot path, serve
   batches of 1, 64 and 256 plain recalls posted the way any client posts them (docs/protocol.md:
   the layout's views, the semaphores opened by name). One pass of the serving loop is timed, and
   the backend's search inside it (timed by a backend wrapper injected through the Sidecar's
   constructor) is taken out: host = pass - search, per pass and per slot. The two paths
   alternate pass by pass, in blocks whose order flips; each block's medians are reported, then
   the median and spread (min-max) over the blocks. Every answer's generation is checked, and
   the first answers of each block against float64.
2. Through the broker: the same two paths as sidecar processes (only the sidecar's environment
   differs; clients as they are), 64 tasks over 4 client processes (uvloop), beside in-process
   numpy batch-64 measured in the same rounds; the order of the paths flips each round. Also the
   sidecar's CPU per request (its /proc CPU time over its own request counter).

    python bench/bench_sidecar_host.py                 # both parts, defaults below
    python bench/bench_sidecar_host.py --blocks 3 --rounds 3 --seconds 3 --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import posix_ipc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import S_DONE, S_FREE, S_POSTED, Layout, Metric, Op, SegmentView
from kalos.broker.names import req_name, resp_name, shm_name
from kalos.broker.slotpath import PURE_ENV, REQUIRE_ENV, Choice, SlotPath, choose
from kalos.demo import inproc_numpy
from kalos.sidecar_cuda.backends.base import (
    BackendStatistics,
    Decay,
    Matrix,
    PendingSearch,
    SearchResult,
    Subset,
    completed,
    search_each,
)
from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
from kalos.sidecar_cuda.backends.options import BackendKind
from kalos.sidecar_cuda.config import ServeConfig
from kalos.sidecar_cuda.server import Sidecar
from kalos.sidecar_cuda.serving.slotio import load_compiled
from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

PATHS = (SlotPath.COMPILED, SlotPath.PYTHON)
ROWS, DIM, K = 256, 128, 10


# --------------------------------------------------------------------------- 1. in process


class SearchClock:
    """Nanoseconds spent inside the backend's searches since the last reset."""

    def __init__(self) -> None:
        self.ns = 0


class TimedMatrix:
    """A numpy matrix whose searches add their time to a clock (at these sizes the numpy
    backend searches on the calling thread, so the time is the whole search)."""

    def __init__(self, inner: Matrix, clock: SearchClock) -> None:
        self._inner = inner
        self._clock = clock

    @property
    def capacity(self) -> int:
        return self._inner.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._inner.capacity = value

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        self._inner.write_rows(rows, vectors)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._inner.move_rows(src, dst)

    def grow(self, capacity: int) -> None:
        self._inner.grow(capacity)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        return self._inner.read_rows(rows)

    def set_times(self, rows: np.ndarray, times_s: np.ndarray) -> None:
        self._inner.set_times(rows, times_s)

    def search(
        self, queries: np.ndarray, n: int, k: int, *, within: Subset | None = None, decay: Decay | None = None
    ) -> SearchResult:
        t = time.perf_counter_ns()
        try:
            return self._inner.search(queries, n, k, within=within, decay=decay)
        finally:
            self._clock.ns += time.perf_counter_ns() - t

    def search_start(self, queries: np.ndarray, n: int, k: int, *, row_ids: np.ndarray | None = None) -> PendingSearch:
        t = time.perf_counter_ns()
        try:
            return self._inner.search_start(queries, n, k, row_ids=row_ids)
        finally:
            self._clock.ns += time.perf_counter_ns() - t


class TimedBackend:
    """The numpy backend, its matrices' searches timed (a Backend, injected into the Sidecar)."""

    def __init__(self, clock: SearchClock) -> None:
        self._inner = NumpyBackend()
        self.clock = clock
        self.name, self.code, self.max_k = self._inner.name, self._inner.code, self._inner.max_k
        self.description, self.placement = self._inner.description, self._inner.placement

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> Matrix:
        return TimedMatrix(self._inner.new_matrix(dim, capacity, metric), self.clock)

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        return self._inner.host_buffer(shape, dtype)

    mixed_rows = NumpyBackend.mixed_rows

    def search_mixed(
        self, matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> PendingSearch:
        return completed(*search_each(matrices, n, of_query, queries, k))  # (each search timed)

    def statistics(self) -> BackendStatistics:
        return self._inner.statistics()

    def close(self) -> None:
        self._inner.close()


class Poster:
    """Plain recalls written into slots 0..b-1 the way any client writes them, and their answers
    read back (outside the timed pass)."""

    def __init__(self, name: str, layout: Layout, b: int) -> None:
        shm = posix_ipc.SharedMemory(shm_name(name))
        self.mm = mmap.mmap(shm.fd, layout.total_bytes)
        shm.close_fd()
        self.seg = SegmentView(memoryview(self.mm), layout)
        self.b = b
        self.req = [posix_ipc.Semaphore(req_name(name, i)) for i in range(b)]
        self.resp = [posix_ipc.Semaphore(resp_name(name, i)) for i in range(b)]
        self.generation = 0
        s = self.seg.slots
        s["op"][:b] = int(Op.RECALL)
        s["k"][:b] = K
        s["nq"][:b] = 1
        s["flags"][:b] = 0
        s["blob_len"][:b] = 0
        s["namespace"][:b] = b"default"
        s["ns_len"][:b] = len(b"default")

    def post(self, queries: np.ndarray) -> None:
        b, s = self.b, self.seg.slots
        self.generation += 1
        self.seg.all_queries[:b, 0] = queries
        s["generation"][:b] = self.generation
        s["t_post_ns"][:b] = time.monotonic_ns()
        s["state"][:b] = S_POSTED
        for r in self.req:
            r.release()

    def collect(self) -> np.ndarray:
        """The answers' ids (b, K); raises if a slot was not answered, or answered for another
        generation or not OK."""
        b, s = self.b, self.seg.slots
        for r in self.resp:
            r.acquire(0)  # posted by the pass (BusyError otherwise)
        if not ((s["state"][:b] == S_DONE).all() and (s["resp_generation"][:b] == self.generation).all()):
            raise RuntimeError("a slot was not answered, or answered for another request")
        if not ((s["status"][:b] == 0).all() and (s["n_results"][:b] == K).all()):
            raise RuntimeError("an answer was not OK")
        ids = np.array(self.seg.all_result_ids[:b, 0, :K])
        s["state"][:b] = S_FREE
        return ids

    def close(self) -> None:
        for sem in self.req + self.resp:
            sem.close()
        del self.seg
        self.mm.close()


def path_choice(path: SlotPath) -> Choice:
    env = {PURE_ENV: "1"} if path is SlotPath.PYTHON else {REQUIRE_ENV: "1"}
    return choose(env, load_compiled)


def in_process(batches: list[int], blocks: int, passes: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    matrix = np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)
    rows: list[dict[str, Any]] = []
    for b in batches:
        clock = SearchClock()
        sides: dict[SlotPath, tuple[Sidecar, Poster]] = {}
        for path in PATHS:
            cfg = ServeConfig(
                name=f"host{os.getpid()}-{path.value}-{b}",
                dim=DIM,
                slots=max(b, 1),
                max_k=64,
                max_queries=4,
                backend=BackendKind.NUMPY,
                random_rows=ROWS,
                seed=seed,
                gather_us=0.0,  # every batch is posted whole: nothing to wait for
            )
            sc = Sidecar(cfg, backend=TimedBackend(clock), slot_path=path_choice(path))
            sc.start()
            assert sc.slot_path.path is path
            sides[path] = (sc, Poster(cfg.name, sc.layout, b))
        try:
            per_block: dict[SlotPath, list[dict[str, float]]] = {p: [] for p in PATHS}
            checked = wrong = 0
            for blk in range(blocks):
                order = PATHS if blk % 2 == 0 else PATHS[::-1]
                host: dict[SlotPath, list[int]] = {p: [] for p in PATHS}
                search: dict[SlotPath, list[int]] = {p: [] for p in PATHS}
                for i in range(passes + 20):  # the first 20: warm-up
                    for path in order:
                        sc, poster = sides[path]
                        q = rng.standard_normal((b, DIM), dtype=np.float32)
                        poster.post(q)
                        clock.ns = 0
                        t0 = time.perf_counter_ns()
                        served = sc.serve_pending()
                        served += sc.pipeline.finish_inflight() if sc.pipeline is not None else 0
                        t = time.perf_counter_ns() - t0
                        if served != b:
                            raise RuntimeError(f"a pass served {served} of {b}")
                        ids = poster.collect()
                        if i < 3:
                            c, w = check_samples([(q[j], ids[j], ids[j]) for j in range(b)], matrix, K)
                            checked, wrong = checked + c, wrong + w
                        if i >= 20:
                            host[path].append(t - clock.ns)
                            search[path].append(clock.ns)
                for path in PATHS:
                    h = np.asarray(host[path]) / 1e3
                    p50, p95, p99 = np.percentile(h, [50, 95, 99])
                    per_block[path].append(
                        {
                            "host_p50_us": float(p50),
                            "host_p95_us": float(p95),
                            "host_p99_us": float(p99),
                            "host_per_slot_p50_us": float(p50) / b,
                            "search_p50_us": float(np.median(search[path]) / 1e3),
                        }
                    )
            for path in PATHS:
                blocks_ = per_block[path]
                row: dict[str, Any] = {"part": "in-process", "batch": b, "path": path.value, "blocks": blocks_}
                for key in blocks_[0]:
                    vals = [x[key] for x in blocks_]
                    row[key] = round(float(np.median(vals)), 3)
                    row[key + "_spread"] = [round(min(vals), 3), round(max(vals), 3)]
                row["checked"], row["wrong"] = checked, wrong
                rows.append(row)
                print(
                    f"in-process batch {b:>3} {path.value:8}: host p50 {row['host_p50_us']:8.1f} us "
                    f"({row['host_p50_us_spread'][0]:.1f}-{row['host_p50_us_spread'][1]:.1f}), "
                    f"p95 {row['host_p95_us']:8.1f}, p99 {row['host_p99_us']:8.1f}; "
                    f"per slot {row['host_per_slot_p50_us']:6.3f} us; search p50 {row['search_p50_us']:7.1f} us; "
                    f"wrong {wrong}/{checked}",
                    flush=True,
                )
        finally:
            for sc, poster in sides.values():
                poster.close()
                sc.close()
    return rows


# --------------------------------------------------------------------------- 2. through the broker


def scrape_counts(port: int) -> tuple[float, float]:
    """(requests, batches) the sidecar has served."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    out = []
    for name in ("kalos_requests_total", "kalos_batches_total"):
        m = re.search(rf"^{name} (\S+)$", body, re.M)
        if m is None:
            raise RuntimeError(f"no {name} in /metrics")
        out.append(float(m.group(1)))
    return out[0], out[1]


def scrape_path(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    m = re.search(r'^kalos_slot_path_info\{.*path="(\w+)"', body, re.M)
    return m.group(1) if m else "unknown"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def broker(rounds: int, seconds: float, tasks: int, procs: int, seed: int) -> list[dict[str, Any]]:
    matrix = np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)
    procs_: dict[SlotPath, tuple[Any, str, int]] = {}
    base_env = {k: v for k, v in os.environ.items() if k not in (PURE_ENV, REQUIRE_ENV)}
    try:
        for path in PATHS:
            name, port = f"hostb{os.getpid()}-{path.value}", free_port()
            env = {**base_env, (PURE_ENV if path is SlotPath.PYTHON else REQUIRE_ENV): "1"}
            args = ["--ephemeral", "--dim", str(DIM), "--backend", "numpy", "--random-rows", str(ROWS)]
            args += ["--seed", str(seed), "--slots", str(max(64, tasks)), "--metrics-port", str(port)]
            procs_[path] = (start_sidecar_process(args, name, timeout=120, env=env), name, port)
            served = scrape_path(port)
            if served != path.value:
                raise RuntimeError(f"the {path.value} sidecar serves the {served} path")
        runs: dict[SlotPath, list[dict[str, Any]]] = {p: [] for p in PATHS}
        baselines: list[float] = []
        for rnd in range(rounds):
            _p, b64 = inproc_numpy(matrix, K, seconds=max(1.0, seconds / 2), batch=64)
            baselines.append(b64)
            for path in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                proc, name, port = procs_[path]
                c0, (r0, b0) = cpu_s(proc.pid), scrape_counts(port)
                res = run_load(
                    LoadSpec(name=name, dim=DIM, procs=procs, tasks=tasks, duration_s=seconds, k=K, seed=seed + rnd)
                )
                c1, (r1, b1) = cpu_s(proc.pid), scrape_counts(port)
                checked, wrong = check_samples(res.samples, matrix, K)
                p = res.percentiles_us()
                run = {
                    "recalls_per_s": res.throughput,
                    **p,
                    "vs_numpy_b64": res.throughput / b64,
                    "numpy_b64_per_s": b64,
                    "sidecar_cpu_us_per_request": (c1 - c0) / max(1.0, r1 - r0) * 1e6,
                    "requests_per_batch": (r1 - r0) / max(1.0, b1 - b0),
                    "client_cpu_us_per_recall": res.client_cpu_s / max(1, res.count) * 1e6,
                    "errors": res.errors,
                    "checked": checked,
                    "wrong": wrong,
                }
                runs[path].append(run)
                print(
                    f"broker round {rnd} {path.value:8}: {res.throughput:9,.0f}/s = {run['vs_numpy_b64']:.3f}x numpy "
                    f"b64 ({b64:,.0f}/s); p50 {p['p50_us']:.0f} p95 {p['p95_us']:.0f} p99 {p['p99_us']:.0f} us; "
                    f"{run['requests_per_batch']:.1f} requests/batch, "
                    f"sidecar CPU {run['sidecar_cpu_us_per_request']:.2f} us/request, client CPU "
                    f"{run['client_cpu_us_per_recall']:.1f} us/recall; wrong {wrong}/{checked}",
                    flush=True,
                )
        rows = []
        for path in PATHS:
            row: dict[str, Any] = {"part": "broker", "path": path.value, "tasks": tasks, "procs": procs}
            row["runs"] = runs[path]
            for key in (
                "recalls_per_s",
                "p50_us",
                "p95_us",
                "p99_us",
                "vs_numpy_b64",
                "sidecar_cpu_us_per_request",
                "requests_per_batch",
                "client_cpu_us_per_recall",
            ):
                vals = [r[key] for r in runs[path]]
                row[key] = round(float(np.median(vals)), 3)
                row[key + "_spread"] = [round(min(vals), 3), round(max(vals), 3)]
            row["numpy_b64_per_s"] = round(float(np.median(baselines)))
            row["wrong"] = sum(r["wrong"] for r in runs[path])
            row["errors"] = sum(r["errors"] for r in runs[path])
            rows.append(row)
            print(
                f"broker {path.value:8}: median {row['recalls_per_s']:,.0f}/s "
                f"({row['recalls_per_s_spread'][0]:,.0f}-{row['recalls_per_s_spread'][1]:,.0f}) = "
                f"{row['vs_numpy_b64']:.3f}x numpy b64 {row['numpy_b64_per_s']:,}/s; sidecar CPU "
                f"{row['sidecar_cpu_us_per_request']:.2f} us/request",
                flush=True,
            )
        return rows
    finally:
        for proc, _name, _port in procs_.values():
            stop_sidecar_process(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--blocks", type=int, default=5, help="in-process blocks (the order flips each)")
    ap.add_argument("--passes", type=int, default=400, help="timed passes per path and block")
    ap.add_argument("--rounds", type=int, default=4, help="broker rounds (the order flips each)")
    ap.add_argument("--seconds", type=float, default=3.0, help="broker load per path and round")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--skip", choices=["in-process", "broker"], default=None)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/sidecar-host-<host>-<date>.json)")
    a = ap.parse_args()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"# seed {seed}", flush=True)
    rows: list[dict[str, Any]] = []
    if a.skip != "in-process":
        rows += in_process([int(x) for x in a.batches.split(",")], a.blocks, a.passes, seed)
    if a.skip != "broker":
        rows += broker(a.rounds, a.seconds, a.tasks, a.procs, seed)
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"sidecar-host-{os.uname().nodename}-{dt.date.today()}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": environment(),
                "seed": seed,
                "sizes": {"rows": ROWS, "dim": DIM, "k": K, "backend": "numpy"},
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"# wrote {out}")
    return 1 if any(r.get("wrong") or r.get("errors") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
