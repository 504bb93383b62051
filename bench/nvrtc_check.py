#!/usr/bin/env python3
"""Compile the CUDA backend's kernels with NVRTC on a machine without a GPU (no CuPy needed).

NVRTC compiles to PTX/cubin without a device, so a syntax or type error in a ``.cu`` shows here
instead of in a device call. Needs ``libnvrtc.so`` (``pip install --target DIR
nvidia-cuda-nvrtc-cu12`` and ``--lib DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12``). Every storage
of ``kalos_topk.cu`` (and ``kalos_recency.cu``) for each --arch, and ``kalos_wgmma.cu`` for sm_90a
at each query tile, with the options the backend passes.

    python3 bench/nvrtc_check.py --lib /tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_one(lib: ctypes.CDLL, src: str, name: str, options: list[str]) -> str:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if rc:
        return f"create failed ({rc})"
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    log = buf.value.decode(errors="replace").strip()
    return f"FAILED\n{log}" if rc else ("ok" + (f" (log: {log[:300]})" if log else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--arch", default="compute_70,compute_80,compute_90")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(ROOT))
    kalos = os.path.basename(ROOT)
    import importlib

    kernels = importlib.import_module(f"{kalos}.sidecar_cuda.backends.cuda.kernels")
    wgmma = importlib.import_module(f"{kalos}.sidecar_cuda.backends.cuda.wgmma")
    lib = ctypes.CDLL(a.lib)
    bad = 0
    src = kernels.kernel_source()
    for arch in a.arch.split(","):
        for storage in kernels.Storage:
            opts = [f"--gpu-architecture={arch}", *kernels.compile_options(storage)]
            r = compile_one(lib, src, "kalos_topk.cu", opts)
            bad += r.startswith("FAILED")
            print(f"kalos_topk.cu {arch} {storage.name}: {r}")
    for bq in wgmma.QUERY_TILES:
        opts = list(wgmma.compile_options(bq, wgmma.stages_for(bq, 232448)))
        r = compile_one(lib, wgmma.kernel_source(bq), "kalos_wgmma.cu", opts)
        bad += r.startswith("FAILED")
        print(f"kalos_wgmma.cu sm_90a bq={bq}: {r}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
