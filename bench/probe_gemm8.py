#!/usr/bin/env python3
"""What an 8-bit first pass could gain at 1M-2M x 768, measured before building one (issue 27).

Two questions, one GPU process:

* **Cost.** CUDA-event time (median of --reps) of the scoring GEMM alone, every variant on the same
  random rows and queries, interleaved rep by rep: cuBLAS float16 x float16 with float16 scores
  (what the half-score path runs) and float32 scores (the GEMM path), cuBLAS int8 x int8 with
  int32 scores (``CUBLAS_COMPUTE_32I``: the only int8 tensor-core output wider than 8 bits), and,
  where torch is importable, torch's ``_int_mm`` (int8 -> int32) and ``_scaled_mm`` (float8 e4m3 ->
  float16 scores). Beside them the time to read the score matrix once at the copy bandwidth
  measured in the same run (what any top-k pass over it costs at least).
* **Proof.** An 8-bit first pass is exact only if it rescores enough candidates: rows and queries
  quantised to int8 with one scale per row / per query, the approximate score a = sq sr (q8 . r8)
  (exact integer dot: |q8 . r8| <= 127^2 D < 2^24, exact in float32), and the tightest bound that
  holds for every row, |q.x - a| <= |q^| |dr| + |dq| |x| (Cauchy-Schwarz on both roundings, with
  each row's own residual norm |dr| and norm |x|). Candidates are the KC rows with the highest
  upper bound u = a + that bound; the answer is proven when the k-th float64 score among them is
  >= the KC-th u. Printed: queries proven per KC and k, on fresh standard-normal rows.

    python3 bench/probe_gemm8.py --rows 1000000,2097152 --batches 16,64,128,256 --out gemm8.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

CUDA_R_16F, CUDA_R_32F, CUDA_R_8I, CUDA_R_32I = 2, 0, 3, 10
COMPUTE_32F, COMPUTE_32I = 68, 72
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", default="1000000,2097152")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batches", default="16,64,128,256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--proof-rows", type=int, default=1000000)
    ap.add_argument("--proof-queries", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    try:
        import torch

        have_torch = torch.cuda.is_available()
    except Exception:
        have_torch = False
    d = a.dim
    handle = cp.cuda.device.get_cublas_handle()
    one_f, zero_f = np.ones(1, np.float32), np.zeros(1, np.float32)
    one_i, zero_i = np.ones(1, np.int32), np.zeros(1, np.int32)
    res: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "cupy": cp.__version__,
        "torch": torch.__version__ if have_torch else None,
        "dim": d,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    gen = cp.random.default_rng(a.seed)

    # copy bandwidth (read + write of 1 GiB), the floor of any pass over a score matrix
    big = cp.empty(1 << 28, cp.float32)
    dst = cp.empty_like(big)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        e0.record()
        dst[...] = big
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    copy_tbs = 2 * big.nbytes / (float(np.median(ts)) * 1e-3) / 1e12
    res["copy_tb_s"] = round(copy_tbs, 3)
    del big, dst
    print(f"copy bandwidth {copy_tbs:.2f} TB/s (read + write)", flush=True)

    for n in (int(x) for x in a.rows.split(",")):
        x16 = gen.standard_normal((n, d), dtype=cp.float32).astype(cp.float16)
        sr = cp.abs(x16.astype(cp.float32)).max(axis=1) / 127.0
        x8 = cp.rint(x16.astype(cp.float32) / sr[:, None]).astype(cp.int8)
        if have_torch:
            tx8 = torch.as_tensor(x8, device="cuda")
            tx16 = torch.as_tensor(x16, device="cuda")
            tfp8 = (tx16.float() / tx16.float().abs().amax(dim=1, keepdim=True) * 448.0).to(torch.float8_e4m3fn)
        for b in (int(x) for x in a.batches.split(",")):
            q16 = gen.standard_normal((b, d), dtype=cp.float32).astype(cp.float16)
            q8 = cp.rint(q16.astype(cp.float32) / (cp.abs(q16.astype(cp.float32)).max() / 127.0)).astype(cp.int8)
            s16 = cp.empty((b, n), cp.float16)
            s32 = cp.empty((b, n), cp.float32)
            si = cp.empty((b, n), cp.int32)

            def g16(out: Any, ctype: int) -> None:
                cublas.gemmEx(
                    handle,
                    OP_T,
                    OP_N,
                    n,
                    b,
                    d,
                    one_f.ctypes.data,
                    x16.data.ptr,
                    CUDA_R_16F,
                    d,
                    q16.data.ptr,
                    CUDA_R_16F,
                    d,
                    zero_f.ctypes.data,
                    out.data.ptr,
                    ctype,
                    n,
                    COMPUTE_32F,
                    GEMM_DEFAULT,
                )

            def g8() -> None:
                cublas.gemmEx(
                    handle,
                    OP_T,
                    OP_N,
                    n,
                    b,
                    d,
                    one_i.ctypes.data,
                    x8.data.ptr,
                    CUDA_R_8I,
                    d,
                    q8.data.ptr,
                    CUDA_R_8I,
                    d,
                    zero_i.ctypes.data,
                    si.data.ptr,
                    CUDA_R_32I,
                    n,
                    COMPUTE_32I,
                    GEMM_DEFAULT,
                )

            cases: dict[str, Any] = {
                "f16_f16out": lambda: g16(s16, CUDA_R_16F),
                "f16_f32out": lambda: g16(s32, CUDA_R_32F),
                "i8_i32out": g8,
            }
            if have_torch:
                tq8 = torch.as_tensor(q8, device="cuda")
                tqf8 = torch.as_tensor(q16, device="cuda").float().clamp(-448, 448).to(torch.float8_e4m3fn)
                one_t = torch.ones((), device="cuda")
                if b >= 17 and b % 8 == 0:
                    cases["torch_int_mm"] = lambda: torch._int_mm(tq8, tx8.t())
                cases["torch_fp8_f16out"] = lambda: torch._scaled_mm(
                    tqf8, tfp8.t(), scale_a=one_t, scale_b=one_t, out_dtype=torch.float16
                )
            row: dict[str, Any] = {"rows": n, "b": b}
            times: dict[str, list[float]] = {c: [] for c in cases}
            for name, fn in list(cases.items()):
                try:
                    for _ in range(2):
                        fn()
                    cp.cuda.Device().synchronize()
                except Exception as e:
                    row[name] = {"refused": f"{type(e).__name__}: {e}"[:200]}
                    del cases[name]
                    del times[name]
            for _ in range(a.reps):
                for name, fn in cases.items():
                    e0.record()
                    fn()
                    e1.record()
                    e1.synchronize()
                    times[name].append(cp.cuda.get_elapsed_time(e0, e1))
            flop = 2.0 * b * n * d
            for name, t in times.items():
                ms = float(np.median(t))
                row[name] = {"ms": round(ms, 4), "tops": round(flop / (ms * 1e-3) / 1e12, 1)}
            # (int8 check: the int32 scores equal the exact integer dot products of a few rows)
            ref = q8[:2].astype(cp.float64) @ x8[:64].astype(cp.float64).T
            g8()
            row["i8_exact"] = bool(cp.all(si[:2, :64].astype(cp.float64) == ref))
            for label, nbytes in (("read_f16_scores_ms", 2 * b * n), ("read_i32_scores_ms", 4 * b * n)):
                row[label] = round(nbytes / (copy_tbs / 2 * 1e12) * 1e3, 4)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        if have_torch:
            del tx8, tx16, tfp8
            torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()

    res["proof"] = proof(cp, a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def proof(cp: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Queries an int8 first pass proves exact, per candidate count KC and k (module docstring)."""
    t0 = time.perf_counter()
    n, d, bq = a.proof_rows, a.dim, a.proof_queries
    gen = cp.random.default_rng(a.seed + 1)
    x = gen.standard_normal((n, d), dtype=cp.float32).astype(cp.float16).astype(cp.float32)
    q = gen.standard_normal((bq, d), dtype=cp.float32)

    def quant(v: Any) -> tuple[Any, Any]:
        s = cp.abs(v).max(axis=1) / 127.0
        s[s == 0] = 1.0
        return cp.rint(v / s[:, None]), s

    x8, sr = quant(x)
    q8, sq = quant(q)
    dr = cp.linalg.norm(x - x8 * sr[:, None], axis=1).astype(cp.float64)
    xn = cp.linalg.norm(x, axis=1).astype(cp.float64)
    qh = cp.linalg.norm(q8 * sq[:, None], axis=1).astype(cp.float64)
    dq = cp.linalg.norm(q - q8 * sq[:, None], axis=1).astype(cp.float64)
    x64 = x.astype(cp.float64)
    out: list[dict[str, Any]] = []
    proven: dict[tuple[int, int], int] = {}
    kcs, ks = (32, 64, 128, 256, 512), (1, 10, 16)
    for lo in range(0, bq, 32):
        hi = min(bq, lo + 32)
        ints = q8[lo:hi] @ x8.T  # exact: every partial sum is an integer below 2^24
        approx = ints.astype(cp.float64) * sq[lo:hi, None].astype(cp.float64) * sr[None, :].astype(cp.float64)
        upper = approx + qh[lo:hi, None] * dr[None, :] + dq[lo:hi, None] * xn[None, :]
        exact = q[lo:hi].astype(cp.float64) @ x64.T
        for kc in kcs:
            cand = cp.argpartition(-upper, kc, axis=1)[:, :kc]
            u_kc = cp.take_along_axis(upper, cand, axis=1).min(axis=1)
            top = -cp.sort(-cp.take_along_axis(exact, cand, axis=1), axis=1)
            for k in ks:
                proven[(kc, k)] = proven.get((kc, k), 0) + int(cp.sum(top[:, k - 1] >= u_kc))
        del ints, approx, upper, exact
    bound_sigma = float(
        cp.median((qh[:, None] * dr.max() + dq[:, None] * xn.max()).ravel())
        / (float(cp.linalg.norm(q, axis=1).mean()) * float(xn.mean()) / np.sqrt(d))
    )
    for (kc, k), p in sorted(proven.items()):
        out.append({"kc": kc, "k": k, "proven": p, "queries": bq})
        print(f"proof rows {n} KC {kc:4d} k {k:2d}: {p}/{bq} queries proven", flush=True)
    print(f"bound / score sigma ~{bound_sigma:.2f}; proof probe {time.perf_counter() - t0:.1f} s", flush=True)
    return out + [{"bound_over_sigma": round(bound_sigma, 3), "rows": n}]


if __name__ == "__main__":
    raise SystemExit(main())
