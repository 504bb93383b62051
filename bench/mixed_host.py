#!/usr/bin/env python3
"""The sidecar's host work for a MIXED batch (plain recalls over many namespaces), in process.

A sidecar (numpy backend) holds ``--namespaces`` namespaces of ``--rows`` rows; one pass of its
serving loop takes ``--batch`` posted recalls, one per slot, slot i naming namespace i mod N, and
answers them. With ``--stub`` (the default) the backend's mixed search answers at once (rows
0..k-1 of each namespace), so what is timed is the host's part alone: scanning, classifying,
grouping by namespace, the store's bookkeeping, mapping rows to ids, writing the answers: what a
GPU sidecar spends on the CPU per request. Without it the numpy search runs and is taken out of
each pass (host = pass - search).

An A/B across checkouts: ``--root DIR`` imports Kalos from DIR (old and new alternating, run by
the caller)::

    for r in 1 2 3; do for side in old new; do
      python bench/mixed_host.py --root /tmp/ab/$side --label $side; done; done

Prints the per-pass and per-request p50 (microseconds) of ``--passes`` timed passes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from typing import Any

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--label", default="")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--namespaces", type=int, default=256)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--passes", type=int, default=500)
    ap.add_argument("--no-stub", dest="stub", action="store_false", help="run the numpy search (taken out)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.root))
    import posix_ipc

    from kalos.broker.layout import S_FREE, S_POSTED, Op, SegmentView
    from kalos.broker.names import req_name, resp_name, shm_name
    from kalos.sidecar_cuda.backends.base import completed
    from kalos.sidecar_cuda.config import ServeConfig
    from kalos.sidecar_cuda.server import Sidecar

    try:
        from kalos.sidecar_cuda.storage.writes import Write, WriteOp, apply_write
    except ImportError:  # a checkout from before the sidecar's wings
        from kalos.sidecar_cuda.writes import Write, WriteOp, apply_write  # type: ignore[no-redef]

    b, dim, k = a.batch, 128, 10
    old_spelling: dict[str, Any] = {"backend": "numpy"}  # (a checkout before BackendKind takes the string)
    cfg = ServeConfig(name=f"mixhost{os.getpid()}", dim=dim, slots=b, max_k=64, max_queries=4, **old_spelling)
    cfg.gather_us = 0.0
    sc = Sidecar(cfg)
    sc.start()
    assert sc.pipeline is not None
    rng = np.random.default_rng(0)
    for i in range(a.namespaces):
        w = Write(WriteOp.UPSERT, f"ns{i}", ids=np.arange(a.rows, dtype=np.int64) + 1000 * i,
                  vectors=rng.standard_normal((a.rows, dim), dtype=np.float32))  # fmt: skip
        w.resolve(sc.store)
        apply_write(sc.store, w)
    searched = [0]
    inner = sc.store.backend.search_mixed
    rows = np.tile(np.arange(k, dtype=np.int64), (b, 1))
    zeros = np.zeros((b, k), np.float32)

    def search_mixed(mats, n, of, q, kk):  # type: ignore[no-untyped-def]
        if a.stub:
            return completed(rows[: len(of), :kk].copy(), zeros[: len(of), :kk].copy())
        t = time.perf_counter_ns()
        try:
            return inner(mats, n, of, q, kk)
        finally:
            searched[0] += time.perf_counter_ns() - t

    sc.store.backend.search_mixed = search_mixed  # type: ignore[method-assign]
    shm = posix_ipc.SharedMemory(shm_name(cfg.name))
    mm = mmap.mmap(shm.fd, sc.layout.total_bytes)
    shm.close_fd()
    seg = SegmentView(memoryview(mm), sc.layout)
    req = [posix_ipc.Semaphore(req_name(cfg.name, i)) for i in range(b)]
    resp = [posix_ipc.Semaphore(resp_name(cfg.name, i)) for i in range(b)]
    s = seg.slots
    s["op"][:b], s["k"][:b], s["nq"][:b], s["flags"][:b], s["blob_len"][:b] = int(Op.RECALL), k, 1, 0, 0
    for i in range(b):
        name = f"ns{i % a.namespaces}".encode()
        s["namespace"][i], s["ns_len"][i] = name, len(name)
    gen = [0]

    def one() -> int:
        gen[0] += 1
        seg.all_queries[:b, 0] = rng.standard_normal((b, dim), dtype=np.float32)
        s["generation"][:b], s["t_post_ns"][:b], s["state"][:b] = gen[0], time.monotonic_ns(), S_POSTED
        for r in req:
            r.release()
        searched[0] = 0
        t0 = time.perf_counter_ns()
        served = sc.serve_pending() + sc.pipeline.finish_inflight()  # type: ignore[union-attr]
        t = time.perf_counter_ns() - t0 - searched[0]
        if served != b:
            raise RuntimeError(f"a pass served {served} of {b}")
        for r in resp:
            r.acquire(0)
        if not ((s["resp_generation"][:b] == gen[0]).all() and (s["status"][:b] == 0).all()):
            raise RuntimeError("a slot was not answered OK for this pass")
        s["state"][:b] = S_FREE
        return t

    try:
        for _ in range(30):
            one()
        ts = np.asarray([one() for _ in range(a.passes)]) / 1e3
    finally:
        for sem in req + resp:
            sem.close()
        sc.close()
    p50 = float(np.median(ts))
    print(
        f"{a.label or a.root} batch={b} namespaces={a.namespaces} rows={a.rows} stub={a.stub}: host per pass "
        f"p50 {p50:.1f} us (p95 {np.percentile(ts, 95):.1f}), per request {p50 / b:.2f} us",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
