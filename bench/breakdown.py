"""Where the microseconds of one lone recall go (issue 14, item 4): one instrumented run.

A sidecar process (``--backend``, rows from ``--random-rows``) and one blocking client in this
process doing recalls one after another. Each recall is stamped on both sides with
CLOCK_MONOTONIC (the sidecar's stamps are the slot's ``t_pick_ns`` / ``t_done_ns``, which every
answer carries), so each stage is measured on the same requests:

    client encode     validate + encode the query (clients/_requests.recall)
    client write      copy into the slot's views (_requests.write)
    post              header, POSTED, req semaphore (+ doorbell when the sidecar sleeps)
    sidecar wake      t_post -> t_pick: the sidecar notices and takes the slot
    sidecar serve     t_pick -> t_done: classify, stage, launch, kernel, sync, write the answer
    client wake       t_done -> the client sees DONE and consumes the response (it spins here, as
                      the pool does within its spin window)
    client decode     _requests.read -> Hits
    release           latency record + slot freed

Then, in this process on the same shape (``--backend cuda``): the search through the backend
(wall time) and its GPU time from CUDA events, which split "sidecar serve" into kernel, launch +
sync, and the sidecar's own Python (the rest). Prints the table of p50s (and the sum against the
measured end-to-end p50) and writes JSON.

    python3 bench/breakdown.py --backend cuda --sizes 256x128:float32,1Mx768:float16 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kalos.clients import _requests  # noqa: E402
from kalos.clients.blocking import RecallClient  # noqa: E402
from kalos.testing.loadgen import environment  # noqa: E402
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process  # noqa: E402

STAGES = ["client encode", "client write", "post", "sidecar wake", "sidecar serve", "client wake",
          "client decode", "release"]


def parse_size(s: str) -> tuple[int, int, str]:
    shape, _, dtype = s.partition(":")
    rows, dim = shape.lower().split("x")
    mult = {"k": 1000, "m": 1000_000}.get(rows[-1], 1)
    return int(float(rows.rstrip("km")) * mult), int(dim), dtype or "float32"


def client_stages(name: str, dim: int, k: int, n: int, warm: int, seed: int) -> dict[str, np.ndarray]:
    """Per-stage ns of ``n`` lone recalls (after ``warm``), as listed in the module docstring."""
    rng = np.random.default_rng(seed)
    qs = rng.standard_normal((n + warm, dim), dtype=np.float32)
    out = {s: np.zeros(n, np.int64) for s in STAGES + ["end to end"]}
    with RecallClient(name) as c:
        c.recall(qs[0], k=k)  # attach
        s = c._slot  # the instrumented path below is RecallClient._roundtrip, stamped
        nsb = c._ns.encode("default")
        w64 = s._w64
        base = s._tpost  # t_post_ns; t_pick_ns and t_done_ns follow it (8 bytes each)
        for i in range(n + warm):
            t0 = time.monotonic_ns()
            p = _requests.recall(c.layout, qs[i], k, nsb, False, True, None)
            t1 = time.monotonic_ns()
            blob_len = _requests.write(s.view, p)
            t2 = time.monotonic_ns()
            s.post(p.op, p.ns, p.k, p.nq, p.flags, blob_len, t0)
            t3 = time.monotonic_ns()
            while not (s.is_done() and s.try_consume()):
                pass
            t4 = time.monotonic_ns()
            hits = _requests.read(s.view, s.outcome(), p)
            t5 = time.monotonic_ns()
            s.record(t5 - t0, ok=True)
            s.set_free()
            t6 = time.monotonic_ns()
            assert len(hits) == k
            if i < warm:
                continue
            j = i - warm
            t_post, t_pick, t_done = int(w64[base]), int(w64[base + 1]), int(w64[base + 2])
            out["client encode"][j] = t1 - t0
            out["client write"][j] = t2 - t1
            out["post"][j] = t3 - t2
            out["sidecar wake"][j] = t_pick - t_post
            out["sidecar serve"][j] = t_done - t_pick
            out["client wake"][j] = t4 - t_done
            out["client decode"][j] = t5 - t4
            out["release"][j] = t6 - t5
            out["end to end"][j] = t6 - t0
    return out


def inprocess(backend: str, rows: int, dim: int, dtype: str, k: int, seed: int, reps: int,
              host_work: int | None = None) -> dict[str, Any]:
    """The backend's search of one query in this process: wall and GPU time (p50, us), and the
    path the CUDA backend took."""
    if backend != "cuda":
        from kalos.sidecar_cuda.backends.numpy_backend import NumpyBackend
        from kalos.broker.layout import Metric

        be: Any = NumpyBackend()
    else:
        from kalos.sidecar_cuda.backends.cuda.backend import CupyBackend
        from kalos.broker.layout import Metric

        be = CupyBackend(storage_dtype=dtype, **({} if host_work is None else {"host_work": host_work}))
    rng = np.random.default_rng(seed)
    m = be.new_matrix(dim, rows, Metric.DOT)
    chunk = 1 << 17
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        m.write_rows(np.arange(r0, r1), rng.standard_normal((r1 - r0, dim), dtype=np.float32))
    q = rng.standard_normal((reps + 10, 1, dim), dtype=np.float32)
    wall, gpu = [], []
    ev = None
    if backend == "cuda":
        import cupy as cp

        ev = (cp.cuda.Event(), cp.cuda.Event())
    for i in range(reps + 10):
        t0 = time.perf_counter_ns()
        if ev is not None:
            ev[0].record(be._stream)
        m.search(q[i], rows, k)
        if ev is not None:
            ev[1].record(be._stream)
            ev[1].synchronize()
        t1 = time.perf_counter_ns()
        if i >= 10:
            wall.append(t1 - t0)
            if ev is not None:
                import cupy as cp

                gpu.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e6)
    res: dict[str, Any] = {"search wall": float(np.median(wall)) / 1e3}
    paths = sorted(p for p, _bucket in getattr(be, "search_stats", {}))
    if paths:
        res["path"] = ",".join(paths)
    if gpu and paths != ["host"]:
        res["GPU time (events)"] = float(np.median(gpu)) / 1e3
    be.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--sizes", default="256x128:float32")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("-n", type=int, default=3000, help="recalls measured (after 300 of warm-up)")
    ap.add_argument("--reps", type=int, default=300, help="in-process searches")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sidecar-args", default="")
    ap.add_argument("--host-search-work", type=int, default=None,
                    help="cuda: the sidecar's and the in-process backend's --host-search-work "
                         "(default: theirs; 0: always the GPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = []
    for size in a.sizes.split(","):
        rows, dim, dtype = parse_size(size)
        name = f"kbd{os.getpid()}x{rows}"
        args = ["--dim", str(dim), "--backend", a.backend, "--dtype", dtype, "--ephemeral",
                "--random-rows", str(rows), "--seed", str(a.seed), *a.sidecar_args.split()]
        if a.host_search_work is not None:
            args += ["--host-search-work", str(a.host_search_work)]
        proc = start_sidecar_process(args, name, timeout=600)
        try:
            st = client_stages(name, dim, a.k, a.n, 300, a.seed + 1)
        finally:
            stop_sidecar_process(proc)
        ip = inprocess(a.backend, rows, dim, dtype, a.k, a.seed, a.reps, a.host_search_work)
        p50 = {s: float(np.median(v)) / 1e3 for s, v in st.items()}
        p99 = {s: float(np.percentile(v, 99)) / 1e3 for s, v in st.items()}
        serve = p50["sidecar serve"]
        split = {}
        if "GPU time (events)" in ip:
            split = {"kernel (GPU time)": ip["GPU time (events)"],
                     "launch + sync (backend wall - GPU)": ip["search wall"] - ip["GPU time (events)"],
                     "sidecar Python (serve - backend wall)": serve - ip["search wall"]}
        else:  # numpy, or the CUDA backend's host path
            split = {"search (in-process wall)": ip["search wall"],
                     "sidecar Python (serve - search)": serve - ip["search wall"]}
        print(f"\n{rows}x{dim} {dtype} backend={a.backend} k={a.k}: {a.n} lone recalls")
        print(f"  {'stage':40s} {'p50 us':>9s} {'p99 us':>9s}")
        for s in STAGES:
            print(f"  {s:40s} {p50[s]:9.1f} {p99[s]:9.1f}")
            if s == "sidecar serve":
                for name2, v in split.items():
                    print(f"    {name2:38s} {v:9.1f}")
        print(f"  {'sum of stage p50s':40s} {sum(p50[s] for s in STAGES):9.1f}")
        print(f"  {'end to end (measured)':40s} {p50['end to end']:9.1f} {p99['end to end']:9.1f}")
        print("  in-process search: " + ", ".join(f"{kk} {v:.1f} us" if isinstance(v, float) else f"{kk} {v}"
                                                  for kk, v in ip.items()))
        results.append({"size": size, "rows": rows, "dim": dim, "dtype": dtype, "k": a.k, "n": a.n,
                        "p50_us": p50, "p99_us": p99, "serve_split_us": split, "inprocess_us": ip})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "environment": environment(), "backend": a.backend,
                       "results": results}, f, indent=1)
        print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
