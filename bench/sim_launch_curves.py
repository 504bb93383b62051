#!/usr/bin/env python3
"""The launch policies in simulation (``kalos.testing.launchsim``) over two measured device-time
curves: does a path that makes small batches cheaper change what the policy does under load?

The curves are the planner's GPU time per batch at 1M x 768 fp16 on the H200 before and after the
int8 first pass (bench/results/h200-2026-12-02g/: ``paths-before.json``, ``paths-int8.log``,
``paths-int8-top32-design.log``); callers turn around in ~150 us as the broker's pools did there.

    python3 bench/sim_launch_curves.py --out bench/results/h200-2026-12-02g/sim-launch-int8.json

``--history``: one policy serves the caller counts in turn, as one sidecar did in the broker A/B
(bench_gpu.py runs 1, 8, 64, 256 tasks against one sidecar), beside a fresh policy at each count:
does what the policy measured at small batches (cheaper after the int8 pass) steer it later?

    python3 bench/sim_launch_curves.py --history --callers 1,8,64,256 \
        --out bench/results/h200-2026-12-02g/sim-launch-int8-history.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from kalos.sidecar_cuda.serving.launch import EagerPolicy, FillPolicy, LaunchPolicy
from kalos.testing.launchsim import SimSpec, run

# batch size -> GPU ms of the planner's path (measured; linear in between)
BEFORE = {1: 0.435, 4: 0.465, 8: 0.517, 16: 0.505, 32: 0.64, 64: 0.63, 128: 0.714, 256: 1.054}
AFTER = {**BEFORE, 1: 0.349, 4: 0.356, 8: 0.36, 16: 0.374}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--callers", default="8,64,256")
    ap.add_argument("--history", action="store_true", help="one policy serves the caller counts in turn")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    duration = 400_000_000
    for name, tab in (("before", BEFORE), ("after", AFTER)):
        curve = tuple((n, int(ms * 1e6)) for n, ms in sorted(tab.items()))
        carried: dict[str, LaunchPolicy] = {"fill": FillPolicy(1_000_000), "eager": EagerPolicy(1_000_000)}
        for i, callers in enumerate(int(x) for x in a.callers.split(",")):
            spec = SimSpec(callers=callers, base_ns=150_000, duration_ns=duration, device_curve=curve)
            runs: list[tuple[str, LaunchPolicy, SimSpec]] = [
                ("fill", FillPolicy(1_000_000), spec),
                ("eager", EagerPolicy(1_000_000), spec),
            ]
            if a.history:  # the same policies as the last count's, later on their clock
                later = replace(spec, start_ns=i * (duration + 50_000_000))
                runs += [(f"{label}+history", policy, later) for label, policy in carried.items()]
            for label, policy, sp in runs:
                r = run(sp, policy)
                row = {"curve": name, "callers": callers, "policy": label, **r.summary()}
                rows.append(row)
                print(f"{name:6} {callers:4} {label:13} {r.throughput / 1e3:7.1f} k/s  mean batch {r.mean_batch:6.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"command": " ".join(["python3", *sys.argv]), "before": BEFORE, "after": AFTER, "rows": rows},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
