#!/usr/bin/env python3
"""Where the wgmma kernel's selection time goes (1M x 768 fp16, k = 10): per batch, the default
config's GPU time, the NOEPI (no selection) and DIAG2 (gate compare + vote only) builds, and the
DIAG1 counters (tiles, push rounds, pushes, merges summed over CTAs).
    python3 bench/fused/diag_wgmma.py [--ncu B]   (--ncu: three launches of B only, for ncu)"""
import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from fused_wgmma import WgmmaTopK  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--batches", default="16,64,128,256")
ap.add_argument("--ncu", type=int, default=0)
ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "diag_wgmma.json"))
a = ap.parse_args()
n, d, k = 1_000_000, 768, 10
X = cp.empty((n, d), cp.float16)
for lo in range(0, n, 1 << 17):
    hi = min(n, lo + (1 << 17))
    X[lo:hi] = cp.random.standard_normal((hi - lo, d), dtype=cp.float32).astype(cp.float16)
wt = WgmmaTopK(X)
if a.ncu:
    q = cp.random.standard_normal((a.ncu, d), dtype=cp.float32)
    for _ in range(3):
        wt.launch(q, k)
    cp.cuda.Device().synchronize()
    sys.exit(0)


def gpu_ms(fn, reps=20):
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))


out = []
for b in [int(x) for x in a.batches.split(",")]:
    q = cp.random.standard_normal((b, d), dtype=cp.float32)
    wt.wconfig_override = None
    base = wt.wconfig_for(b, k)
    r = {"batch": b, "config": base.name()}
    for label, cfg in (("full", base), ("noepi", replace(base, noepi=1)),
                       ("fastpath", replace(base, diag=2)), ("stats", replace(base, diag=1))):
        wt.wconfig_override = cfg
        cnt = cp.zeros(8, cp.float32)
        if label == "stats":
            wt.launch(q, k, dump=cnt)
            cp.cuda.Device().synchronize()
            c = cp.asnumpy(cnt).view(np.uint64)[:4]
            r.update(tiles=int(c[0]), push_rounds=int(c[1]), pushes=int(c[2]), merges=int(c[3]),
                     grid=wt.plan(b, k)["grid"])
        r[label + "_ms"] = gpu_ms(lambda: wt.launch(q, k, dump=cnt))
    wt.wconfig_override = None
    print(json.dumps(r), flush=True)
    out.append(r)
with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
