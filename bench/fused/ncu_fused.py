#!/usr/bin/env python3
"""Three launches of the fused search at 1M x 768 for ncu (profile the third ft_fused):
    ncu --clock-control none --kernel-name ft_fused --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 bench/fused/ncu_fused.py [B]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp  # noqa: E402

from fused import FusedTopK  # noqa: E402

b = int(sys.argv[1]) if len(sys.argv) > 1 else 256
n, d = 1_000_000, 768
x = cp.empty((n, d), cp.float16)
for lo in range(0, n, 1 << 17):
    x[lo:lo + (1 << 17)] = cp.random.standard_normal((min(n, lo + (1 << 17)) - lo, d), dtype=cp.float32)
ft = FusedTopK(x)
q = cp.random.standard_normal((b, d), dtype=cp.float32)
print(ft.plan(b, 10)["config"].name())
for _ in range(3):
    ft.launch(q, 10)
cp.cuda.Device().synchronize()
