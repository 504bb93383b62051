"""Fused tensor-core scoring + exact top-k for batched recalls (issue 14, item 1).

``FusedTopK(rows)`` keeps a float16 matrix on the GPU; ``search(queries, k)`` returns the exact
top-k rows by inner product for a batch of float32 queries, without ever writing a B x N score
matrix: see fused_topk.cu for the kernels and the exactness argument. Every answer is proven exact
under float32 scores (float32 query . float16 row, float32 accumulation) or redone in float32 for
the queries where the proof fails (``fallbacks`` counts them).

Tile shapes are compile-time constants of the .cu, passed as -D options; one cupy.RawModule is
compiled per shape (and per candidate-list size KC) on first use and cached for the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:  # the module imports without CuPy; FusedTopK needs it
    import cupy as cp
except Exception:  # pragma: no cover - no CuPy on this machine
    cp = None

KERNEL_PATH = Path(__file__).with_name("fused_topk.cu")
THREADS = 256
MERGE_THREADS = 1024  # FT_MTHREADS in the .cu
CAP = 32  # staged candidates per query per insertion round (FT_CAP in the .cu)
MAX_K = 128  # largest k served (KC = 256 candidates per query)
LIST_SMEM = 80 * 1024  # per-block budget for the candidate lists + staging of ft_fused
MERGE_SMEM = 96 * 1024  # ft_merge holds P lists of KC candidates of a query in shared memory
EXACT_CHUNK = 16  # flagged queries redone per ft_exact launch (16 x N float32 scores)


@dataclass(frozen=True)
class Config:
    """One compiled shape of ft_fused: bq queries x bm rows per block tile, wn warps along the
    queries (8 // wn along the rows), bk halves per pipeline stage, stages deep, minb blocks per
    SM promised to ptxas, pf an L2 prefetch hint on the row copies."""

    bq: int
    wn: int
    bm: int = 128
    bk: int = 32
    stages: int = 4
    minb: int = 1
    pf: int = 0  # 1: the row copies ask L2 for a 256-byte prefetch
    warps: int = 8  # warps per block
    rot: int = 1  # 1: blocks start their k loop at different slices (spreads L2 load)
    noepi: int = 0  # diagnostic only (probe): no selection, wrong answers, time of the multiply

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def name(self) -> str:
        return (f"q{self.bq}w{self.wn}m{self.bm}k{self.bk}s{self.stages}b{self.minb}"
                + ("pf" if self.pf else "") + (f"x{self.warps}" if self.warps != 8 else "")
                + ("" if self.rot else "r0") + ("NOEPI" if self.noepi else ""))


# Queries per block -> default shape (the planner takes the smallest bq >= the batch, 128 max).
CONFIGS: dict[int, Config] = {
    16: Config(16, 1, bk=64, minb=2, pf=1),
    32: Config(32, 2, bk=64, minb=2, pf=1),
    64: Config(64, 2, minb=2, pf=1),
    128: Config(128, 4, bk=64, minb=1, warps=16),
}
# Extra shapes the probe times against the defaults.
ALT_CONFIGS: list[Config] = [
    Config(16, 1, bk=64, stages=3, minb=3, pf=1),
    Config(32, 2, minb=2, pf=1),
    Config(64, 2, bk=64, minb=1, pf=1),
    Config(64, 4, bk=64, minb=1, warps=16),
    Config(128, 4, bk=64, minb=1),
    Config(128, 4, bm=256, minb=1, warps=16),
]
# Diagnostics the probe times (never served: they skip the selection).
DIAG_CONFIGS: list[Config] = [
    Config(16, 1, bk=64, minb=2, pf=1, noepi=1),
    Config(128, 4, bk=64, minb=1, warps=16, noepi=1),
]


def kc_for(k: int) -> int:
    """Candidates kept per query: about 2k or more, so the proof has a margin between the k-th
    rescored score and the KC-th approximate one."""
    if k <= 16:
        return 32
    if k <= 32:
        return 64
    if k <= 64:
        return 128
    if k <= MAX_K:
        return 256
    raise ValueError(f"k must be <= {MAX_K}, got {k}")


def smem_fused(c: Config, kc: int) -> int:
    pipe = c.stages * (c.bm + c.bq) * (c.bk + 8) * 2
    return pipe + c.bq * (kc + CAP) * 8 + c.bq * 8


_MODULES: dict[tuple[Config, int], Any] = {}


def _module(c: Config, kc: int) -> Any:
    key = (c, kc)
    mod = _MODULES.get(key)
    if mod is None:
        opts = ("-std=c++17", f"-DFT_BQ={c.bq}", f"-DFT_WN={c.wn}", f"-DFT_BM={c.bm}",
                f"-DFT_BK={c.bk}", f"-DFT_STAGES={c.stages}", f"-DFT_KC={kc}",
                f"-DFT_MINB={c.minb}", f"-DFT_PF={c.pf}", f"-DFT_WARPS={c.warps}",
                f"-DFT_ROT={c.rot}", f"-DFT_NOEPI={c.noepi}")
        mod = cp.RawModule(code=KERNEL_PATH.read_text(), options=opts)
        _MODULES[key] = mod
    return mod


class FusedTopK:
    """Exact top-k by inner product over float16 rows (N, D), float32 queries, on one GPU."""

    def __init__(self, rows_fp16: Any) -> None:
        if cp is None:
            raise RuntimeError("FusedTopK needs CuPy")
        x = cp.asarray(rows_fp16)
        if x.ndim != 2:
            raise ValueError(f"rows must be (N, D), got shape {x.shape}")
        if x.dtype == cp.uint16:
            x = x.view(cp.float16)
        if x.dtype != cp.float16:
            raise ValueError(f"rows must be float16, got {x.dtype}")
        n, d = x.shape
        if n < 1 or n >= 2**31 - 1 or d < 1:
            raise ValueError(f"unsupported shape {x.shape}")
        self.n, self.dim = int(n), int(d)
        # Rows padded with zeros to a multiple of 32 halves (one k-slice; 16-byte copies).
        self.dpad = -(-d // 32) * 32
        if self.dpad != d or not x.flags.c_contiguous:
            xp = cp.zeros((n, self.dpad), cp.float16)
            xp[:, :d] = x
            x = xp
        self.x = x
        self.xbits = x.view(cp.uint16)
        # xmax bounds every row norm (the proof's error bound): float32 sums of squares of
        # float16 values, widened by a relative 2^-16 for their rounding.
        mx = 0.0
        for lo in range(0, n, 1 << 16):
            blk = x[lo:lo + (1 << 16)].astype(cp.float32)
            mx = max(mx, float(cp.sqrt((blk * blk).sum(axis=1)).max()))
        self.xmax = float(mx * (1.0 + 2.0**-16) + 1e-30)
        rt = cp.cuda.runtime
        dev = cp.cuda.Device().id
        self.sms = int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev))
        self.smem_optin = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))
        self.fallbacks = 0  # queries whose answer was not proven and was redone in float32
        self.config_override: Config | None = None  # the probe's sweep sets this
        self._plans: dict[tuple[Any, ...], dict[str, Any]] = {}
        # Profiling aid (probe_fused.py): 4 CUDA events recorded around prep, fused and merge.
        self.stage_events: list[Any] | None = None
        self._work: dict[tuple[Any, ...], dict[str, Any]] = {}

    # ------------------------------------------------------------------ planning
    def config_for(self, b: int, k: int) -> Config:
        if self.config_override is not None:
            return self.config_override
        kc = kc_for(k)
        bq = next((q for q in sorted(CONFIGS) if q >= b), max(CONFIGS))
        # Large candidate lists take shared memory from the queries per block.
        while bq > 16 and bq * (kc + CAP) * 8 > LIST_SMEM:
            bq //= 2
        return CONFIGS[bq]

    def plan(self, b: int, k: int) -> dict[str, Any]:
        """The launch shape of a search of b queries (cached; also the probe's record)."""
        c = self.config_for(b, k)
        kc = kc_for(k)
        key = (b, kc, c)
        pl = self._plans.get(key)
        if pl is not None:
            return pl
        if self.dpad % c.bk:
            raise ValueError(f"shape {c.name()} needs the padded dim {self.dpad} to be a multiple of {c.bk}")
        mod = _module(c, kc)
        fn = mod.get_function("ft_fused")
        smem = smem_fused(c, kc)
        if smem > self.smem_optin:
            raise ValueError(f"shape {c.name()} with KC={kc} needs {smem} B of shared memory")
        fn.max_dynamic_shared_size_bytes = smem
        occ = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr,
                                                                          c.threads, smem))
        qy = -(-b // c.bq)
        tiles = -(-self.n // c.bm)
        resident = self.sms * max(1, occ)
        # One wave: every block resident, so the blocks of one row part run side by side.
        p = max(1, min(tiles, MERGE_SMEM // (8 * kc), max(1, resident // qy)))
        mfn = mod.get_function("ft_merge")
        msmem = 8 * p * kc + 8 * kc
        if msmem > 48 * 1024:
            mfn.max_dynamic_shared_size_bytes = msmem
        pl = {"config": c, "kc": kc, "qy": qy, "parts": p, "smem": smem, "occupancy": occ,
              "grid": p * qy, "module": mod, "prep": mod.get_function("ft_prep"), "fused": fn,
              "merge": mfn, "merge_smem": msmem}
        self._plans[key] = pl
        return pl

    # ------------------------------------------------------------------ search
    def launch(self, queries_f32: Any, k: int) -> tuple[Any, Any, Any]:
        """Enqueue one search on the current stream: (ids, scores, flags) on the device; flags[b]
        is 1 where the answer is not proven exact (``search`` redoes those)."""
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
        key = (b, kk, c, kc, p)
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
        ids = cp.empty((b, kk), cp.int64)
        scores = cp.empty((b, kk), cp.float32)
        flags = cp.empty(b, cp.int32)
        bpad = qy * c.bq
        i32 = np.int32
        ev = self.stage_events
        if ev:
            ev[0].record()
        pl["prep"]((bpad,), (c.threads,),
                   (q, i32(b), i32(self.dpad), i32(bpad), w["qh"], w["qn"], w["qscale"], w["gate"]))
        if ev:
            ev[1].record()
        pl["fused"]((pl["grid"],), (c.threads,),
                    (self.xbits, i32(self.n), i32(self.dpad), w["qh"], i32(b), i32(qy), i32(p),
                     w["gate"], w["cand_s"], w["cand_r"]), shared_mem=pl["smem"])
        if ev:
            ev[2].record()
        pl["merge"]((b,), (MERGE_THREADS,),
                    (w["cand_s"], w["cand_r"], i32(p), self.xbits, i32(self.dpad), q, w["qn"],
                     w["qscale"], np.float32(self.xmax), i32(kk), ids, scores, flags),
                    shared_mem=pl["merge_smem"])
        if ev:
            ev[3].record()
        self._last_q = q  # the padded float32 queries, for search's fallback
        self._last_mod = pl["module"]
        self._last_threads = c.threads  # ft_exact's indexing assumes the module's FT_THREADS
        return ids, scores, flags

    def search(self, queries_f32: Any, k: int) -> tuple[Any, Any]:
        """(ids (B, min(k, N)) int64, scores float32), best first; exact under float32 scores."""
        ids, scores, flags = self.launch(queries_f32, k)
        if ids.shape[0] == 0:
            return ids, scores
        bad = cp.flatnonzero(flags)
        nbad = int(bad.size)  # (synchronizes: the proof decides whether more work is needed)
        if nbad:
            self.fallbacks += nbad
            self._redo(bad, ids, scores)
        return ids, scores

    def _redo(self, bad: Any, ids: Any, scores: Any) -> None:
        """Float32 scores of every row for the unproven queries, then a full sort: exact."""
        q, mod = self._last_q, self._last_mod
        kk = ids.shape[1]
        fn = mod.get_function("ft_exact")
        bad = bad.astype(cp.int32)
        for lo in range(0, int(bad.size), EXACT_CHUNK):
            sel = cp.ascontiguousarray(bad[lo:lo + EXACT_CHUNK])
            f = int(sel.size)
            s = cp.empty((f, self.n), cp.float32)
            nt = self._last_threads
            blocks = max(1, min(-(-self.n // (nt // 32)), 4 * self.sms))
            fn((blocks, f), (nt,), (self.xbits, np.int32(self.n), np.int32(self.dpad), q, sel, s))
            order = cp.argsort(-s, axis=1)[:, :kk]
            ids[sel] = order.astype(cp.int64)
            scores[sel] = cp.take_along_axis(s, order, axis=1)


__all__ = ["FusedTopK", "Config", "CONFIGS", "ALT_CONFIGS", "kc_for", "MAX_K"]
