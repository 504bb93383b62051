#!/usr/bin/env python3
"""Where the GEMM path's time goes at 1M x 768 fp16 (GPU only, no broker): CUDA-event times of
cuBLAS gemmEx writing float32 vs float16 scores, of one read of each score matrix, of the
backend's whole GEMM and half-score GEMM searches, and torch's matmul for comparison, at
several batch sizes.

    python3 bench/probe_gemm.py --rows 1000000 --dim 768 --batches 64,128,256 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kalos.broker.layout import Metric  # noqa: E402


def events_ms(cp, fn, reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    cp.cuda.Stream.null.synchronize()
    ts = []
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--sweep", action="store_true", help="also time the half-score kernel's variants")
    a = ap.parse_args()

    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    from kalos.sidecar_cuda.backends.cuda import CupyBackend

    n, d = a.rows, a.dim
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    be = CupyBackend("float16")
    un0, blocks0 = be.half_unroll, be.half_blocks
    m = be.new_matrix(d, n, Metric.DOT)
    for lo in range(0, n, 131072):
        hi = min(n, lo + 131072)
        m.write_rows(np.arange(lo, hi), rng.standard_normal((hi - lo, d), dtype=np.float32))
    be._stream.synchronize()
    X = m.data  # (n, dpad) uint16 bits of float16
    handle = cp.cuda.device.get_cublas_handle()
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        q = rng.standard_normal((b, d), dtype=np.float32)
        qh = cp.asarray(q.astype(np.float16))
        s32 = cp.empty((b, n), cp.float32)
        s16 = cp.empty((b, n), cp.float16)

        def gemm(out, ctype):
            cublas.gemmEx(handle, 1, 0, n, b, d, alpha.ctypes.data, X.data.ptr, 2, d, qh.data.ptr, 2, d,
                          beta.ctypes.data, out.data.ptr, ctype, n, 68, -1)

        r = {"rows": n, "dim": d, "batch": b}
        r["gemm_f32out_ms"] = events_ms(cp, lambda: gemm(s32, 0))
        r["gemm_f16out_ms"] = events_ms(cp, lambda: gemm(s16, 2))
        r["read_f32_ms"] = events_ms(cp, lambda: s32.max())
        r["read_f16_ms"] = events_ms(cp, lambda: s16.max())
        del s32, s16
        cp.get_default_memory_pool().free_all_blocks()
        for path in ("gemm", "gemmh"):
            be.search(m, q, n, a.k, path=path)
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                be.search(m, q, n, a.k, path=path)
                ts.append(time.perf_counter() - t)
            r[f"backend_{path}_search_ms"] = float(np.median(ts)) * 1e3
        r["half_fallbacks"] = be.half_fallbacks
        # GPU time of each stage of one half-score search (single chunk: the GEMM event is the
        # last chunk's), and the host's time around it.
        ev = [cp.cuda.Event() for _ in range(6)]
        be.stage_events = ev
        stages: dict[str, list[float]] = {}
        for _ in range(10):
            t = time.perf_counter()
            be.search(m, q, n, a.k, path="gemmh")
            stages.setdefault("wall", []).append((time.perf_counter() - t) * 1e3)
            for i, name in enumerate(("h2d", "prep", "gemm", "topk", "rescore")):
                stages.setdefault(name, []).append(cp.cuda.get_elapsed_time(ev[i], ev[i + 1]))
            stages.setdefault("gpu_total", []).append(cp.cuda.get_elapsed_time(ev[0], ev[5]))
        be.stage_events = None
        for name, v in stages.items():
            r[f"gemmh_stage_{name}_ms"] = float(np.median(v))
        if a.sweep:  # the half-score top-k kernel's loads in flight and grid size
            for un in (2, 4, 8):
                for blocks in (528, 1056, 2112, 4224):
                    be.half_unroll, be.half_blocks = un, blocks
                    be.search(m, q, n, a.k, path="gemmh")
                    ts = []
                    for _ in range(10):
                        t = time.perf_counter()
                        be.search(m, q, n, a.k, path="gemmh")
                        ts.append(time.perf_counter() - t)
                    r[f"gemmh_u{un}_b{blocks}_ms"] = float(np.median(ts)) * 1e3
            be.half_unroll, be.half_blocks = un0, blocks0
        r["tflops_f16out"] = 2 * b * n * d / (r["gemm_f16out_ms"] / 1e3) / 1e12
        try:
            import torch

            tx = torch.as_tensor(X.view(cp.float16), device="cuda")[:, :d]
            tq = torch.as_tensor(qh, device="cuda")
            torch.cuda.synchronize()
            r["torch_mm_ms"] = events_ms(cp, lambda: torch.mm(tq, tx.T))
            r["torch_mm_topk_ms"] = events_ms(cp, lambda: torch.topk(torch.mm(tq, tx.T), a.k, dim=1))
        except Exception as e:  # torch optional
            r["torch_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps({kk: round(v, 4) if isinstance(v, float) else v for kk, v in r.items()}),
              flush=True)
        rows.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(["python3", *sys.argv]), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
