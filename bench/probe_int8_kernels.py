#!/usr/bin/env python3
"""Where an int8 first-pass search spends its time: a backend over --rows x --dim float16 rows, the
int8 path forced at each batch of --batches, the last search of each inside an NVTX range
``int8_b<B>`` for Nsight Compute (``ncu --nvtx --nvtx-include 'int8_b16/' ...``), and beside it
the GPU time (CUDA events) of the int8 path and of the planner's other paths.

    ncu --clock-control none --nvtx --nvtx-include 'int8_b1/' --section SpeedOfLight \\
        python3 bench/probe_int8_kernels.py --batches 1
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batches", default="1,16")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import cupy as cp
    from cupy.cuda import nvtx

    from kalos.broker.layout import Metric
    from kalos.sidecar_cuda.backends.cuda import CupyBackend, SearchPath

    be = CupyBackend(storage_dtype="float16", host_work=0)
    m = be.new_matrix(a.dim, a.rows, Metric.DOT)
    gen = cp.random.default_rng(3)
    for lo in range(0, a.rows, 1 << 17):
        hi = min(a.rows, lo + (1 << 17))
        m.write_rows(np.arange(lo, hi), cp.asnumpy(gen.standard_normal((hi - lo, a.dim), dtype=cp.float32)))
    rng = np.random.default_rng(4)
    for b in (int(x) for x in a.batches.split(",")):
        q = rng.standard_normal((b, a.dim), dtype=np.float32)
        for _ in range(5):
            m.search(q, a.rows, 10, path=SearchPath.INT8)
        nvtx.RangePush(f"int8_b{b}")
        m.search(q, a.rows, 10, path=SearchPath.INT8)
        nvtx.RangePop()
    print(be.stats_line(), f"int8 copy {m.int8_bytes / 2**20:.0f} MiB", flush=True)
    be.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
