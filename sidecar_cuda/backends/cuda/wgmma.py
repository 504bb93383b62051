"""The kernels of the "wgmma" path (``kalos_wgmma.cu``, Hopper only) and how they are built.

wgmma.mma_async exists only on the ``sm_90a`` target, which CuPy's ``RawModule`` cannot ask NVRTC
for (it appends its own ``-arch``), so :func:`compile_cubin` calls NVRTC directly through CuPy's
bindings and the cubin is loaded as a ``cupy.cuda.function.Module``; cubins are cached on disk
beside CuPy's own (a hash of source, options and the NVRTC version), so only the first start of a
machine pays for the compilation. Every constant the host shares with the kernels reaches the
``.cu`` as ``-D`` (:func:`compile_options`; the ``.cu`` stops with ``#error`` without them).
The pure helpers (shapes, shared memory, row parts) import without CuPy.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .kernels import BLOCK

log = logging.getLogger("kalos.cuda")

KERNEL_FILE = Path(__file__).with_name("kalos_wgmma.cu")
ARCH = "sm_90a"  # wgmma needs the architecture-specific Hopper target
THREADS = 384  # kw_fused: a producer warpgroup and two consumer warpgroups (FW_THREADS)
PREP_THREADS = BLOCK  # kw_prep and kw_exact blocks (FT_WARPS = BLOCK / 32)
MERGE_THREADS = 1024  # kw_merge: one block of 32 warps per query (FT_MTHREADS)
TILE_ROWS = 128  # rows per tile (FW_BM)
SLICE_HALVES = 64  # halves per pipeline stage: the padded dim must be a multiple (FW_BK)
CAP = 32  # staged candidates per query before a merge (FT_CAP)
KC = 32  # candidates per query (FT_KC): enough for k <= 16 (planner.WGMMA_K)
QUERY_TILES = (16, 32, 64, 128)  # queries per CTA (wgmma N) compiled on demand (FW_BQ)
MAX_STAGES = 8
MERGE_SMEM = 96 * 1024  # kw_merge holds P lists of KC candidates of a query in shared memory
L2_PREFETCH = 1  # row copies ask L2 for 256 bytes (FT_PF; measured on the H200)


def bq_for(b: int) -> int:
    """Queries per CTA of a batch of b: the smallest compiled tile >= b (128 and tiles of it above)."""
    return next((t for t in QUERY_TILES if t >= b), QUERY_TILES[-1])


def smem_fused(bq: int, stages: int, kc: int = KC) -> int:
    """Dynamic shared memory of kw_fused: 1024 alignment slack, the stages, per query a list of kc,
    a staging area of CAP, gate and count, and two mbarriers per stage."""
    return 1024 + stages * (TILE_ROWS + bq) * 128 + bq * (kc + CAP) * 8 + bq * 8 + 16 * stages


def stages_for(bq: int, smem_optin: int, kc: int = KC) -> int:
    """As many pipeline stages as fit (MAX_STAGES at most); 0 when not even 3 fit."""
    s = MAX_STAGES
    while s >= 3 and smem_fused(bq, s, kc) > smem_optin:
        s -= 1
    return s if s >= 3 else 0


def parts_for(n: int, qy: int, resident: int, kc: int = KC) -> int:
    """Row parts of a search (the grid is parts x qy query tiles, one wave of ``resident`` CTAs);
    kw_merge must hold parts lists of kc candidates in MERGE_SMEM."""
    tiles = -(-n // TILE_ROWS)
    return max(1, min(tiles, MERGE_SMEM // (8 * kc), max(1, resident // qy)))


def mma_source(bq: int) -> str:
    """fw_mma(acc, desc_a, desc_b, scale_d): one wgmma.mma_async.m64n{bq}k16.f32.f16.f16 with its
    bq / 2 accumulators listed as operands (the count is part of the instruction)."""
    n = bq // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        f"__device__ __forceinline__ void fw_mma(float (&d)[{n}], u64 da, u64 db, int scd) {{\n"
        '    asm volatile("{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, %' + str(n + 2) + ', 0;\\n\\t"\n'
        f'        "wgmma.mma_async.sync.aligned.m64n{bq}k16.f32.f16.f16 {{{regs}}}, %{n}, %{n + 1}, "\n'
        '        "p, 1, 1, 0, 0;\\n}\\n"\n'
        f"        : {outs}\n"
        '        : "l"(da), "l"(db), "r"(scd));\n'
        "}\n"
    )


def kernel_source(bq: int) -> str:
    """The .cu with the fw_mma of this query tile in place of its marker."""
    src = KERNEL_FILE.read_text()
    if "// @FW_MMA@" not in src:
        raise RuntimeError(f"{KERNEL_FILE.name} lacks the // @FW_MMA@ marker")
    return src.replace("// @FW_MMA@", mma_source(bq), 1)


def compile_options(bq: int, stages: int, kc: int = KC) -> tuple[str, ...]:
    """The NVRTC options of one shape: the target and every shared constant as -D."""
    return (
        f"--gpu-architecture={ARCH}",
        "-std=c++17",
        f"-DFW_BQ={bq}",
        f"-DFW_STAGES={stages}",
        f"-DFT_KC={kc}",
        f"-DFT_CAP={CAP}",
        f"-DFT_WARPS={PREP_THREADS // 32}",
        f"-DFT_MTHREADS={MERGE_THREADS}",
        f"-DFT_PF={L2_PREFETCH}",
    )


def _cache_dir() -> Path:
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def compile_cubin(src: str, options: tuple[str, ...]) -> bytes:
    """The cubin of ``src`` by NVRTC (from the disk cache when built before). Raises RuntimeError
    with the compiler's log when NVRTC fails."""
    from cupy_backends.cuda.libs import nvrtc

    version = ".".join(str(v) for v in nvrtc.getVersion())
    key = hashlib.sha256("\0".join((src, *options, version)).encode()).hexdigest()[:32]
    path = _cache_dir() / f"kalos_wgmma_{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    prog = nvrtc.createProgram(src, "kalos_wgmma.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as e:
            raise RuntimeError(f"NVRTC failed ({e}): {nvrtc.getProgramLog(prog)[-3000:]}") from None
        cubin: bytes = nvrtc.getCUBIN(prog)
        msg = nvrtc.getProgramLog(prog).strip()
        if msg:
            log.debug("NVRTC log of kalos_wgmma.cu %s: %s", " ".join(options), msg)
    finally:
        nvrtc.destroyProgram(prog)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass  # (no cache: compiled again next start)
    return cubin


@dataclass
class Shape:
    """One loaded query tile: its functions and launch constants."""

    bq: int
    stages: int
    smem: int
    resident: int  # CTAs of kw_fused resident at once on the device (one wave)
    prep: Any
    fused: Any
    merge: Any
    exact: Any
    module: Any  # (kept alive with its functions)


class WgmmaKernels:
    """The path's compiled shapes on the current CuPy device, built on first use (the backend
    builds the planner's shapes in its warm-up). ``smem_optin``/``sms``: the device's."""

    def __init__(self, cp: Any, smem_optin: int, sms: int) -> None:
        self._cp = cp
        self.smem_optin = smem_optin
        self.sms = sms
        self.shapes: dict[int, Shape] = {}
        self.compile_s = 0.0

    def shape(self, b: int) -> Shape:
        """The shape serving a batch of b queries (compiled and loaded when first asked)."""
        bq = bq_for(b)
        sh = self.shapes.get(bq)
        if sh is None:
            sh = self.shapes[bq] = self._load(bq)
        return sh

    def _load(self, bq: int) -> Shape:
        import time

        cp = self._cp
        stages = stages_for(bq, self.smem_optin)
        if not stages:
            raise RuntimeError(f"kw_fused with {bq} queries per CTA does not fit {self.smem_optin} B of shared memory")
        t0 = time.perf_counter()
        cubin = compile_cubin(kernel_source(bq), compile_options(bq, stages))
        self.compile_s += time.perf_counter() - t0
        mod = cp.cuda.function.Module()
        mod.load(cubin)
        drv = cp.cuda.driver
        attr = getattr(drv, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
        fused = mod.get_function("kw_fused")
        smem = smem_fused(bq, stages)
        drv.funcSetAttribute(fused.ptr, attr, smem)
        merge = mod.get_function("kw_merge")
        drv.funcSetAttribute(merge.ptr, attr, MERGE_SMEM + 8 * KC)
        occ = int(drv.occupancyMaxActiveBlocksPerMultiprocessor(fused.ptr, THREADS, smem))
        if occ < 1:
            raise RuntimeError(f"kw_fused ({bq} queries per CTA, {smem} B) cannot be resident")
        return Shape(
            bq,
            stages,
            smem,
            occ * self.sms,
            mod.get_function("kw_prep"),
            fused,
            merge,
            mod.get_function("kw_exact"),
            mod,
        )


__all__ = [
    "WgmmaKernels",
    "Shape",
    "bq_for",
    "smem_fused",
    "stages_for",
    "parts_for",
    "compile_options",
    "kernel_source",
    "mma_source",
    "KC",
    "SLICE_HALVES",
]
