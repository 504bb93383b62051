"""Fused scoring + exact top-k with a wgmma (sm_90a) main loop: ``WgmmaTopK``.

Same interface, candidate lists, rescore and proof as ``fused.FusedTopK`` (ft_prep, ft_merge and
ft_exact are the same kernels); only the scoring kernel differs: ``fw_fused`` in fused_wgmma.cu
(a cp.async producer warpgroup filling 128-byte-swizzled shared-memory stages, two consumer
warpgroups running wgmma.mma_async m64n{BQ}k16 and the gated selection). Needs a Hopper GPU
(compute capability 9.0) and nvcc (wgmma needs the sm_90a target, compiled here with
``-gencode=arch=compute_90a,code=sm_90a``); cubins are cached by a hash of source + options in
``$KALOS_FW_CACHE`` (default: ``.cubin/`` beside this file, git-ignored), so a machine without
nvcc can use cubins built elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fused import CAP, MAX_K, MERGE_SMEM, MERGE_THREADS, LIST_SMEM, FusedTopK, cp, kc_for

HERE = Path(__file__).resolve().parent
COMMON_PATH = HERE / "fused_topk.cu"
KERNEL_PATH = HERE / "fused_wgmma.cu"
CACHE_DIR = Path(os.environ.get("KALOS_FW_CACHE", str(HERE / ".cubin")))
FW_THREADS = 384
FW_BM = 128
FT_THREADS = 256  # ft_prep / ft_exact block size in the shared file (FT_WARPS = 8)
SMEM_OPTIN_H100 = 232448  # 227 KB: the opt-in limit of Hopper (read off the device at run time)
SAMPLE_ROWS = 16384  # rows of the sampled starting gate (fw_gate), at most a quarter of N
SAMPLE_MIN_B = 32  # batches from this size on start from the sampled gate


@dataclass(frozen=True)
class WConfig:
    """One compiled shape of fw_fused: bq queries per CTA (wgmma N), stages deep (0: as many as
    fit, up to 8), pf an L2 256-byte prefetch hint on the row copies; dump / noepi are test and
    diagnostic builds."""

    bq: int
    stages: int = 0
    pf: int = 1
    dump: int = 0
    noepi: int = 0
    diag: int = 0  # 1: selection counters into dump (u64[4]); 2: selection fast path only

    def name(self) -> str:
        return (f"w{self.bq}s{self.stages or 'max'}" + ("pf" if self.pf else "")
                + ("DUMP" if self.dump else "") + ("NOEPI" if self.noepi else "")
                + (f"DIAG{self.diag}" if self.diag else ""))


WCONFIGS: dict[int, WConfig] = {16: WConfig(16), 32: WConfig(32), 64: WConfig(64), 128: WConfig(128)}
W_ALT_CONFIGS: list[WConfig] = [WConfig(64, pf=0), WConfig(128, pf=0), WConfig(128, stages=4),
                                WConfig(16, stages=4)]
W_DIAG_CONFIGS: list[WConfig] = [WConfig(16, noepi=1), WConfig(128, noepi=1)]


def smem_fw(bq: int, kc: int, stages: int) -> int:
    stage = (FW_BM + bq) * 128
    return 1024 + stages * stage + bq * (kc + CAP) * 8 + bq * 8 + 16 * stages


def stages_for(c: WConfig, kc: int, optin: int = SMEM_OPTIN_H100) -> int:
    if c.stages:
        return c.stages
    s = 8
    while s > 3 and smem_fw(c.bq, kc, s) > optin:
        s -= 1
    return s


def mma_source(bq: int) -> str:
    """fw_mma(acc, desc_a, desc_b, scale_d): one wgmma.mma_async.m64n{bq}k16.f32.f16.f16, its
    bq / 2 accumulators listed as operands (the count is part of the instruction)."""
    n = bq // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        f"__device__ __forceinline__ void fw_mma(float (&d)[{n}], u64 da, u64 db, int scd) {{\n"
        '    asm volatile("{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, %' + str(n + 2) + ', 0;\\n\\t"\n'
        f'        "wgmma.mma_async.sync.aligned.m64n{bq}k16.f32.f16.f16 {{{regs}}}, %{n}, %{n + 1}, "\n'
        '        "p, 1, 1, 0, 0;\\n}\\n"\n'
        f'        : {outs}\n'
        '        : "l"(da), "l"(db), "r"(scd));\n'
        "}\n")


def source_and_options(c: WConfig, kc: int, stages: int) -> tuple[str, list[str]]:
    src = (COMMON_PATH.read_text() + "\n// ==== fused_wgmma.py: fw_mma for this FW_BQ\n"
           + mma_source(c.bq)
           + "\n// ==== fused_wgmma.cu\n" + KERNEL_PATH.read_text())
    opts = ["-std=c++17", "-O3", "-DFT_NO_MMA_SYNC=1", f"-DFT_KC={kc}", f"-DFT_PF={c.pf}",
            f"-DFW_BQ={c.bq}", f"-DFW_STAGES={stages}", f"-DFW_DUMP={c.dump}",
            f"-DFW_NOEPI={c.noepi}", f"-DFW_DIAG={c.diag}"]
    return src, opts


def build_cubin(c: WConfig, kc: int, stages: int) -> Path:
    """The cubin of one shape: from the cache, else compiled with nvcc (sm_90a)."""
    src, opts = source_and_options(c, kc, stages)
    key = hashlib.sha256((src + "\0" + " ".join(opts)).encode()).hexdigest()[:24]
    out = CACHE_DIR / f"fw_{c.name()}_kc{kc}_s{stages}_{key}.cubin"
    if out.exists():
        return out
    nvcc = os.environ.get("KALOS_FW_NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        cu = Path(td) / "fw.cu"
        cu.write_text(src)
        tmp = Path(td) / "fw.cubin"
        cmd = [nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", *opts,
               "-o", str(tmp), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed for {c.name()} kc={kc}:\n{r.stderr[-4000:]}")
        (CACHE_DIR / (out.name + ".log")).write_text(r.stderr)
        shutil.move(str(tmp), str(out))
    return out


_MODULES: dict[tuple[WConfig, int, int], Any] = {}
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def _module(c: WConfig, kc: int, stages: int) -> Any:
    key = (c, kc, stages)
    mod = _MODULES.get(key)
    if mod is None:
        mod = cp.RawModule(path=str(build_cubin(c, kc, stages)))
        _MODULES[key] = mod
    return mod


class WgmmaTopK(FusedTopK):
    """Exact top-k by inner product over float16 rows (N, D), float32 queries; wgmma scoring."""

    def __init__(self, rows_fp16: Any) -> None:
        if cp is None:
            raise RuntimeError("WgmmaTopK needs CuPy")
        x = cp.asarray(rows_fp16)
        if x.ndim == 2 and x.dtype == cp.uint16:
            x = x.view(cp.float16)
        d = int(x.shape[1]) if x.ndim == 2 else 0
        if x.ndim == 2 and x.dtype == cp.float16 and d % 64:
            # one 128-byte swizzle line per stage: rows zero-padded to a multiple of 64 halves
            xp = cp.zeros((x.shape[0], -(-d // 64) * 64), cp.float16)
            xp[:, :d] = x
            super().__init__(xp)
            self.dim = d  # queries are (B, d); launch pads them to dpad
        else:
            super().__init__(x)  # (validates the input)
        cc = str(cp.cuda.Device().compute_capability)
        if cc != "90":
            raise RuntimeError(f"WgmmaTopK needs compute capability 9.0 (wgmma), got {cc}")
        self.wconfig_override: WConfig | None = None
        # Sampled starting gate: without it every CTA starts from -inf and pushes / merges
        # ~KC ln(tiles) candidates per query (measured: 250 per query per CTA at B = 256).
        self.sample_rows = SAMPLE_ROWS
        self.sample_min_b = SAMPLE_MIN_B

    # ------------------------------------------------------------------ planning
    def wconfig_for(self, b: int, k: int) -> WConfig:
        override = getattr(self, "wconfig_override", None)
        if override is not None:
            return override
        kc = kc_for(k)
        bq = next((q for q in sorted(WCONFIGS) if q >= b), max(WCONFIGS))
        while bq > 16 and bq * (kc + CAP) * 8 > LIST_SMEM:
            bq //= 2
        return WCONFIGS[bq]

    def plan(self, b: int, k: int) -> dict[str, Any]:  # type: ignore[override]
        c = self.wconfig_for(b, k)
        kc = kc_for(k)
        key = ("w", b, kc, c)
        pl = self._plans.get(key)
        if pl is not None:
            return pl
        stages = stages_for(c, kc, self.smem_optin)
        smem = smem_fw(c.bq, kc, stages)
        if smem > self.smem_optin:
            raise ValueError(f"shape {c.name()} with KC={kc} needs {smem} B of shared memory")
        mod = _module(c, kc, stages)
        fn = mod.get_function("fw_fused")
        fn.max_dynamic_shared_size_bytes = smem
        occ = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr,
                                                                          FW_THREADS, smem))
        qy = -(-b // c.bq)
        tiles = -(-self.n // FW_BM)
        resident = self.sms * max(1, occ)
        p = max(1, min(tiles, MERGE_SMEM // (8 * kc), max(1, resident // qy)))
        mfn = mod.get_function("ft_merge")
        msmem = 8 * p * kc + 8 * kc
        if msmem > 48 * 1024:
            mfn.max_dynamic_shared_size_bytes = msmem
        pl = {"config": c, "kc": kc, "qy": qy, "parts": p, "smem": smem, "stages": stages,
              "occupancy": occ, "grid": p * qy, "module": mod, "prep": mod.get_function("ft_prep"),
              "fused": fn, "merge": mfn, "merge_smem": msmem}
        self._plans[key] = pl
        return pl

    # ------------------------------------------------------------------ search
    def launch(self, queries_f32: Any, k: int, dump: Any = None) -> tuple[Any, Any, Any]:
        """Enqueue one search on the current stream: (ids, scores, flags) on the device. With a
        FW_DUMP config, ``dump`` (N x QY*BQ float32) receives the raw scaled scores instead."""
        q = cp.asarray(queries_f32, dtype=cp.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries must be (B, {self.dim}), got {q.shape}")
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
        b = int(q.shape[0])
        if self.dpad != self.dim:
            qp = cp.zeros((b, self.dpad), cp.float32)
            qp[:, :self.dim] = q
            q = qp
        q = cp.ascontiguousarray(q)
        kk = min(k, self.n)
        if b == 0:
            return cp.empty((0, kk), cp.int64), cp.empty((0, kk), cp.float32), cp.empty(0, cp.int32)
        pl = self.plan(b, k)
        c, kc, qy, p = pl["config"], pl["kc"], pl["qy"], pl["parts"]
        key = ("w", b, kk, c, kc, p)
        w = self._work.get(key)
        if w is None:
            w = {
                "qh": cp.empty((qy * c.bq, self.dpad), cp.uint16),
                "qn": cp.empty(b, cp.float32),
                "qscale": cp.empty(b, cp.float32),
                "gate": cp.empty(b, cp.uint32),
                "cand_s": cp.empty(b * p * kc, cp.float32),
                "cand_r": cp.empty(b * p * kc, cp.int32),
            }
            if len(self._work) > 32:
                self._work.clear()
            self._work[key] = w
        self._last_work = w
        ids = cp.empty((b, kk), cp.int64)
        scores = cp.empty((b, kk), cp.float32)
        flags = cp.empty(b, cp.int32)
        bpad = qy * c.bq
        i32 = np.int32
        ev = self.stage_events
        if ev:
            ev[0].record()
        pl["prep"]((bpad,), (FT_THREADS,),
                   (q, i32(b), i32(self.dpad), i32(bpad), w["qh"], w["qn"], w["qscale"], w["gate"]))
        s_rows = (min(self.sample_rows, self.n // 4) // kc) * kc
        if b >= self.sample_min_b and s_rows >= 4 * kc and not c.dump:
            self._sample_gate(w, pl, bpad, b, kc, s_rows)
        if ev:
            ev[1].record()
        dptr = dump if dump is not None else w["cand_s"]
        pl["fused"]((pl["grid"],), (FW_THREADS,),
                    (self.xbits, i32(self.n), i32(self.dpad), w["qh"], i32(b), i32(qy), i32(p),
                     w["gate"], w["cand_s"], w["cand_r"], dptr), shared_mem=pl["smem"])
        if ev:
            ev[2].record()
        if not c.dump:
            pl["merge"]((b,), (MERGE_THREADS,),
                        (w["cand_s"], w["cand_r"], i32(p), self.xbits, i32(self.dpad), q, w["qn"],
                         w["qscale"], np.float32(self.xmax), i32(kk), ids, scores, flags),
                        shared_mem=pl["merge_smem"])
        if ev:
            ev[3].record()
        self._last_q = q
        self._last_mod = pl["module"]
        self._last_threads = FT_THREADS
        return ids, scores, flags

    def _sample_gate(self, w: dict[str, Any], pl: dict[str, Any], bpad: int, b: int, kc: int,
                     s_rows: int) -> None:
        """Starting gate from the first s_rows rows: float16-query scores by cuBLAS (float32
        accumulation, the kernel's own scaled queries), the minimum of kc group maxima, then
        fw_gate (see the .cu) widens it by 2E and writes the gate."""
        from cupy_backends.cuda.libs import cublas
        sc = w.get("sample")
        if sc is None or sc.shape != (bpad, s_rows):
            sc = w["sample"] = cp.empty((bpad, s_rows), cp.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        one, zero = _ONE, _ZERO
        # column-major: C (s_rows x bpad) = X[:s_rows] (dpad x s_rows)^T . qh (dpad x bpad)
        cublas.gemmEx(handle, 1, 0, s_rows, bpad, self.dpad, one.ctypes.data, self.xbits.data.ptr,
                      2, self.dpad, w["qh"].data.ptr, 2, self.dpad, zero.ctypes.data, sc.data.ptr,
                      0, s_rows, 68, -1)
        pl["module"].get_function("fw_gate")(
            (b,), (256,), (sc, np.int32(s_rows), np.int32(kc), w["qn"], w["qscale"],
                           np.float32(self.xmax), np.int32(self.dpad), np.int32(b), w["gate"]))


__all__ = ["WgmmaTopK", "WConfig", "WCONFIGS", "W_ALT_CONFIGS", "W_DIAG_CONFIGS", "build_cubin",
           "stages_for", "smem_fw"]
