#!/usr/bin/env python3
"""Fused tensor-core top-k vs the project's GEMM paths at 1M x 768 float16, k = 10.

Per batch size: CUDA-event GPU time (median of --reps after warm-up) of
  (a) FusedTopK.launch (prep + fused + merge/rescore; queries already on the device), its stages,
      and every tile shape of the sweep; plus the wall time of FusedTopK.search (adds the proof
      check's flag read-back);
  (a2) WgmmaTopK (fused_wgmma.py: the wgmma / sm_90a scoring kernel, same selection, rescore and
      proof), its stages and its sweep (--no-wsweep skips it; --no-wgmma skips the variant);
  (b) CupyBackend.search on a matrix holding the same rows: the planner's path and each of the
      float32-score ("gemm") and half-score ("gemmh") paths forced (H2D of the float32 queries
      included: that is the path as served; h2d_ms gives that copy alone);
  (c) cuBLAS gemmEx alone (float16 in, float32 compute; float32 and float16 output) as a floor;
and the answers of (a), every sweep shape and (b) against a float64 reference (all queries).

Run from the repository root:  python3 bench/fused/probe_fused.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root
# The recorded runs (bench/results/fused-h200-2026-12-01) used a copy of the backend as committed
# at 9eb463e (``base/``), since the tree was mid-merge then; without that copy the probe uses the
# checkout's own backend.
BASE = os.path.join(HERE, "base")
if os.path.isdir(BASE):
    sys.path.insert(0, BASE)


def gpu_ms(cp: Any, fn: Callable[[], Any], reps: int, warm: int = 3, stream: Any = None) -> float:
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))


def wall_ms(cp: Any, fn: Callable[[], Any], reps: int) -> float:
    ts = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                              "clocks.max.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        info["nvidia_smi"] = out
    except Exception as e:
        info["nvidia_smi"] = f"failed: {e}"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batches", default="16,32,64,128,256")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--no-sweep", action="store_true", help="skip the mma.sync shape sweep")
    ap.add_argument("--no-wsweep", action="store_true", help="skip the wgmma shape sweep")
    ap.add_argument("--no-wgmma", action="store_true", help="skip the wgmma variant")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fused_probe.json"))
    a = ap.parse_args()

    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    from kalos.broker.layout import Metric
    from fused import ALT_CONFIGS, CONFIGS, DIAG_CONFIGS, FusedTopK
    try:
        from kalos.sidecar_cuda.backends.cuda import CupyBackend
    except ImportError:  # the 9eb463e copy
        from kalos.sidecar_cuda.cupy_backend import CupyBackend  # type: ignore[no-redef]

    n, d, k, reps = a.rows, a.dim, a.k, a.reps
    seed = int.from_bytes(os.urandom(4), "little")
    cp.random.seed(seed)
    rt = cp.cuda.runtime
    res: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "machine": machine(),
        "versions": {"cupy": cp.__version__, "cuda_runtime": rt.runtimeGetVersion(),
                     "cuda_driver": rt.driverGetVersion(), "python": sys.version.split()[0]},
        "rows": n, "dim": d, "k": k, "reps": reps, "seed": seed,
        "baseline_source": (f"HEAD {open(os.path.join(BASE, 'COMMIT')).read().strip()}"
                            if os.path.isdir(BASE) else "working tree"),
    }
    props = rt.getDeviceProperties(0)
    res["machine"]["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    res["machine"]["sms"] = props["multiProcessorCount"]

    # Fresh random rows, float16 (generated in float32 chunks on the device).
    X = cp.empty((n, d), cp.float16)
    for lo in range(0, n, 1 << 17):
        hi = min(n, lo + (1 << 17))
        X[lo:hi] = cp.random.standard_normal((hi - lo, d), dtype=cp.float32).astype(cp.float16)
    Y = cp.empty_like(X)
    t = gpu_ms(cp, lambda: cp.copyto(Y, X), 10)
    res["copy_ms"] = t
    res["copy_TBps"] = 2 * X.nbytes / (t / 1e3) / 1e12  # bytes read + written
    res["read_floor_ms"] = X.nbytes / (res["copy_TBps"] * 1e12) * 1e3
    del Y
    cp.get_default_memory_pool().free_all_blocks()

    t0 = time.perf_counter()
    ft = FusedTopK(X)
    res["fused_init_s"] = time.perf_counter() - t0
    wt = None
    if not a.no_wgmma:
        from fused_wgmma import W_ALT_CONFIGS, W_DIAG_CONFIGS, WCONFIGS, WgmmaTopK
        t0 = time.perf_counter()
        wt = WgmmaTopK(X)
        res["wgmma_init_s"] = time.perf_counter() - t0

    be = CupyBackend("float16")
    m = be.new_matrix(d, n, Metric.DOT)
    be._stream.synchronize()
    m.data[...] = X.view(cp.uint16)  # dpad == d for d = 768
    sqn = cp.empty(n, cp.float32)
    for lo in range(0, n, 1 << 16):
        blk = X[lo:lo + (1 << 16)].astype(cp.float32)
        sqn[lo:lo + (1 << 16)] = (blk * blk).sum(axis=1)
    m.sqn[...] = sqn
    m.max_norm = float(cp.sqrt(sqn.max())) * (1.0 + 2.0 ** -7) + float(np.sqrt(m.dpad)) * 2.0 ** -24
    cp.cuda.Device().synchronize()

    handle = cp.cuda.device.get_cublas_handle()
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        r: dict[str, Any] = {"batch": b}
        q = cp.random.standard_normal((b, d), dtype=cp.float32)
        qn = cp.asnumpy(q)
        # float64 reference, all queries: S64 (n, b)
        q64 = q.astype(cp.float64)
        s64 = cp.empty((n, b), cp.float64)
        for lo in range(0, n, 1 << 17):
            s64[lo:lo + (1 << 17)] = X[lo:lo + (1 << 17)].astype(cp.float64) @ q64.T
        ref = -cp.sort(-cp.sort(s64, axis=0)[n - k:], axis=0)  # (k, b) best first
        tol = 1e-5 * cp.linalg.norm(q64, axis=1) * ft.xmax

        def wrong(ids: Any) -> int:
            ids = cp.asarray(ids)
            got = s64[ids.T, cp.arange(b)[None, :]]  # (k, b)
            got = -cp.sort(-got, axis=0)
            bad = (cp.abs(got - ref) > tol[None, :]).any(axis=0)
            dup = cp.asarray([len(set(row)) != k for row in cp.asnumpy(ids).tolist()])
            return int((bad | dup).sum())

        # (a) fused
        ft.config_override = None
        pl = ft.plan(b, k)
        r["fused_config"] = pl["config"].name()
        r["fused_grid"] = pl["grid"]
        r["fused_parts"] = pl["parts"]
        r["fused_occupancy"] = pl["occupancy"]
        r["fused_smem"] = pl["smem"]
        fb0 = ft.fallbacks
        ids, _ = ft.search(q, k)
        r["fused_wrong"] = wrong(ids)
        r["fused_fallbacks"] = ft.fallbacks - fb0
        r["fused_gpu_ms"] = gpu_ms(cp, lambda: ft.launch(q, k), reps)
        r["fused_wall_ms"] = wall_ms(cp, lambda: ft.search(q, k), 10)
        ev = [cp.cuda.Event() for _ in range(4)]
        ft.stage_events = ev
        st: dict[str, list[float]] = {"prep": [], "fused": [], "merge": []}
        for _ in range(10):
            ft.launch(q, k)
            ev[3].synchronize()
            for i, name in enumerate(("prep", "fused", "merge")):
                st[name].append(cp.cuda.get_elapsed_time(ev[i], ev[i + 1]))
        ft.stage_events = None
        for name, v in st.items():
            r[f"fused_stage_{name}_ms"] = float(np.median(v))
        # the sweep of tile shapes
        if not a.no_sweep:
            sweep = {}
            for cfg in list(CONFIGS.values()) + ALT_CONFIGS + DIAG_CONFIGS:
                if cfg.bq > max(16, 2 * b):
                    continue
                ft.config_override = cfg
                try:
                    ids, _, _ = ft.launch(q, k)
                    w = wrong(ids)  # before the proof check: flagged queries may be wrong here
                    t = gpu_ms(cp, lambda: ft.launch(q, k), reps)
                    sweep[cfg.name()] = {"gpu_ms": t, "wrong_unchecked": w,
                                         "grid": ft.plan(b, k)["grid"]}
                except Exception as e:
                    sweep[cfg.name()] = {"error": f"{type(e).__name__}: {e}"}
            ft.config_override = None
            r["fused_sweep"] = sweep
            ok = {kk: v["gpu_ms"] for kk, v in sweep.items() if "gpu_ms" in v and "NOEPI" not in kk}
            if ok:
                best = min(ok, key=lambda name: ok[name])
                r["fused_best_config"], r["fused_best_gpu_ms"] = best, ok[best]

        # (a2) the wgmma variant, same rows and queries
        if wt is not None:
            wt.wconfig_override = None
            pl = wt.plan(b, k)
            r["wgmma_config"] = pl["config"].name()
            r["wgmma_stages"] = pl["stages"]
            r["wgmma_grid"] = pl["grid"]
            r["wgmma_parts"] = pl["parts"]
            r["wgmma_occupancy"] = pl["occupancy"]
            r["wgmma_smem"] = pl["smem"]
            fb0 = wt.fallbacks
            ids, _ = wt.search(q, k)
            r["wgmma_wrong"] = wrong(ids)
            r["wgmma_fallbacks"] = wt.fallbacks - fb0
            r["wgmma_gpu_ms"] = gpu_ms(cp, lambda: wt.launch(q, k), reps)
            r["wgmma_wall_ms"] = wall_ms(cp, lambda: wt.search(q, k), 10)
            smb = wt.sample_min_b
            wt.sample_min_b = 10**9  # the sampled starting gate off: the gate starts at -inf
            r["wgmma_nosample_gpu_ms"] = gpu_ms(cp, lambda: wt.launch(q, k), reps)
            wt.sample_min_b = smb
            r["wgmma_sampled_gate"] = b >= smb
            ev = [cp.cuda.Event() for _ in range(4)]
            wt.stage_events = ev
            st = {"prep": [], "fused": [], "merge": []}
            for _ in range(10):
                wt.launch(q, k)
                ev[3].synchronize()
                for i, name in enumerate(("prep", "fused", "merge")):
                    st[name].append(cp.cuda.get_elapsed_time(ev[i], ev[i + 1]))
            wt.stage_events = None
            for name, v in st.items():
                r[f"wgmma_stage_{name}_ms"] = float(np.median(v))
            if not a.no_wsweep:
                sweep = {}
                for cfg in list(WCONFIGS.values()) + W_ALT_CONFIGS + W_DIAG_CONFIGS:
                    if cfg.bq > max(16, 2 * b):
                        continue
                    wt.wconfig_override = cfg
                    try:
                        ids, _, _ = wt.launch(q, k)
                        w_ = wrong(ids)
                        t = gpu_ms(cp, lambda: wt.launch(q, k), reps)
                        sweep[cfg.name()] = {"gpu_ms": t, "wrong_unchecked": w_,
                                             "grid": wt.plan(b, k)["grid"],
                                             "stages": wt.plan(b, k)["stages"]}
                    except Exception as e:
                        sweep[cfg.name()] = {"error": f"{type(e).__name__}: {e}"}
                wt.wconfig_override = None
                r["wgmma_sweep"] = sweep
                ok = {kk: v["gpu_ms"] for kk, v in sweep.items()
                      if "gpu_ms" in v and "NOEPI" not in kk}
                if ok:
                    best = min(ok, key=lambda name: ok[name])
                    r["wgmma_best_config"], r["wgmma_best_gpu_ms"] = best, ok[best]

        # (b) the project's backend, same rows
        s = be._stream

        def backend(path: str | None) -> Any:
            return be.search(m, qn, n, k, path=path)

        paths = [("backend", None), ("backend_gemm", "gemm")] + ([("backend_gemmh", "gemmh")] if k <= 16 else [])
        for label, path in paths:
            fb = be.half_fallbacks
            ids_b, _ = backend(path)
            r[f"{label}_wrong"] = wrong(ids_b)
            pend = be.search_async(m, qn, n, k, path=path)
            pend.result()
            r[f"{label}_path"] = getattr(pend, "path", None) or pend._launch.path

            # events on the backend's stream: from before the enqueue to the end of its work
            for _ in range(3):
                backend(path)
            ts = []
            for _ in range(reps):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                p = be.search_async(m, qn, n, k, path=path)
                e1.record(s)
                p.result()
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1))
            r[f"{label}_gpu_ms"] = float(np.median(ts))
            r[f"{label}_wall_ms"] = wall_ms(cp, lambda: backend(path), 10)
            r[f"{label}_half_fallbacks"] = be.half_fallbacks - fb

        # (c) cuBLAS alone: the GEMM of both backend paths, float16 queries
        qh = q.astype(cp.float16)
        s32 = cp.empty((b, n), cp.float32)
        s16 = cp.empty((b, n), cp.float16)

        def gemm(out: Any, ctype: int) -> None:
            cublas.gemmEx(handle, 1, 0, n, b, d, alpha.ctypes.data, X.data.ptr, 2, d, qh.data.ptr, 2,
                          d, beta.ctypes.data, out.data.ptr, ctype, n, 68, -1)

        r["cublas_f32out_ms"] = gpu_ms(cp, lambda: gemm(s32, 0), reps)
        r["cublas_f16out_ms"] = gpu_ms(cp, lambda: gemm(s16, 2), reps)
        del s32, s16
        # H2D of the float32 queries from pinned memory (part of the backend's GPU time)
        hb = cp.cuda.alloc_pinned_memory(4 * b * d)
        hv = np.frombuffer(hb, np.float32, b * d)
        hv[:] = qn.reshape(-1)
        dq = cp.empty(b * d, cp.float32)
        r["h2d_ms"] = gpu_ms(cp, lambda: rt.memcpyAsync(dq.data.ptr, hv.ctypes.data, 4 * b * d,
                                                        rt.memcpyHostToDevice, 0), reps)
        flops = 2.0 * b * n * d
        r["fused_tflops"] = flops / (r["fused_gpu_ms"] / 1e3) / 1e12
        if wt is not None:
            r["wgmma_tflops"] = flops / (r["wgmma_gpu_ms"] / 1e3) / 1e12
            r["wgmma_fused_stage_tflops"] = flops / (r["wgmma_stage_fused_ms"] / 1e3) / 1e12
            r["wgmma_gpu_qps"] = b / (r["wgmma_gpu_ms"] / 1e3)
        r["cublas_tflops"] = flops / (r["cublas_f32out_ms"] / 1e3) / 1e12
        for key in ("fused_gpu_ms", "backend_gpu_ms", "cublas_f32out_ms"):
            r[key.replace("_ms", "_qps")] = b / (r[key] / 1e3)
        del s64
        cp.get_default_memory_pool().free_all_blocks()
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()
                          if kk not in ("fused_sweep", "wgmma_sweep")}), flush=True)
        if "fused_sweep" in r:
            print("  sweep:", {kk: v.get("gpu_ms", v.get("error")) for kk, v in r["fused_sweep"].items()},
                  flush=True)
        if "wgmma_sweep" in r:
            print("  wsweep:", {kk: v.get("gpu_ms", v.get("error")) for kk, v in r["wgmma_sweep"].items()},
                  flush=True)
        rows.append(r)
        res["batches"] = rows  # written after every batch: a later failure keeps what was measured
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["batches"] = rows
    if wt is not None:
        res["wgmma_fallbacks_total"] = wt.fallbacks
    res["fused_fallbacks_total"] = ft.fallbacks
    res["machine"]["nvidia_smi_after"] = machine()["nvidia_smi"]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)

    print(f"\n{res['machine'].get('device')} | {res['machine']['nvidia_smi']} | cupy {cp.__version__} "
          f"| CUDA rt {res['versions']['cuda_runtime']} | copy {res['copy_TBps']:.2f} TB/s, "
          f"one read of X {res['read_floor_ms']:.3f} ms")
    if wt is not None:
        print(f"{'B':>4} | {'wgmma ms':>8} {'TF/s':>5} {'cfg':>12} {'wrong':>5} {'fb':>3} | {'old ms':>7} | "
              f"{'backend ms':>10} {'path':>5} | {'cuBLAS32':>8} {'cuBLAS16':>8} | wgmma/backend  wgmma/old")
        for r in rows:
            print(f"{r['batch']:>4} | {r['wgmma_gpu_ms']:8.3f} {r['wgmma_tflops']:5.0f} {r['wgmma_config']:>12} "
                  f"{r['wgmma_wrong']:5d} {r['wgmma_fallbacks']:3d} | {r['fused_gpu_ms']:7.3f} | "
                  f"{r['backend_gpu_ms']:10.3f} {r['backend_path']:>5} | {r['cublas_f32out_ms']:8.3f} "
                  f"{r['cublas_f16out_ms']:8.3f} | {r['wgmma_gpu_ms'] / r['backend_gpu_ms']:.2f}  "
                  f"{r['wgmma_gpu_ms'] / r['fused_gpu_ms']:.2f}")
    hdr = (f"{'B':>4} | {'fused ms':>8} {'q/s':>8} {'cfg':>16} {'wrong':>5} | {'best':>7} | "
           f"{'backend ms':>10} {'path':>5} {'q/s':>8} {'wrong':>5} | {'gemm':>6} {'gemmh':>6} | "
           f"{'cuBLAS32':>8} {'cuBLAS16':>8} | {'h2d':>5} | fused/backend")
    print(hdr)
    for r in rows:
        print(f"{r['batch']:>4} | {r['fused_gpu_ms']:8.3f} {r['fused_gpu_qps']:8.0f} "
              f"{r['fused_config']:>16} {r['fused_wrong']:5d} | {r.get('fused_best_gpu_ms', 0):7.3f} | "
              f"{r['backend_gpu_ms']:10.3f} {r['backend_path']:>5} {r['backend_gpu_qps']:8.0f} "
              f"{r['backend_wrong']:5d} | {r['backend_gemm_gpu_ms']:6.3f} {r.get('backend_gemmh_gpu_ms', float('nan')):6.3f} | "
              f"{r['cublas_f32out_ms']:8.3f} {r['cublas_f16out_ms']:8.3f} | {r['h2d_ms']:5.3f} | "
              f"{r['fused_gpu_ms'] / r['backend_gpu_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
