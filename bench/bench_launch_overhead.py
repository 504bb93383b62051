#!/usr/bin/env python3
"""What the launch policy costs a lone caller: the sidecar's host time for one recall (a pass of
the serving loop that takes it, searches it and answers it), under each ``--launch`` policy,
alternating in one run. No client process and no wake-ups: one slot of an in-process sidecar is
posted, served by ``serve_pending()`` and read back, so the difference is the policy's own work
(asking it, reporting to it) and not the machine's noise. JSON under bench/results/.

    python3 bench/bench_launch_overhead.py                     # 256 x 128, 20000 recalls per policy
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from kalos.broker.layout import Op
from kalos.clients._slots import ClientSlot
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.backends.options import BackendKind
from kalos.sidecar_cuda.config import ServeConfig
from kalos.sidecar_cuda.server import Sidecar
from kalos.testing.loadgen import environment


def one_recall(sc: Sidecar, slot: ClientSlot, q: np.ndarray) -> int:
    """Post one recall, serve it, consume the answer: the sidecar's pass time (ns)."""
    slot.view.queries[0] = q
    slot.post(int(Op.RECALL), b"default", 10, 1, 0, 0, time.monotonic_ns())
    t = time.perf_counter_ns()
    served = sc.serve_pending()
    dt_ns = time.perf_counter_ns() - t
    assert served == 1 and slot.answered()
    slot.set_free()
    return dt_ns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--recalls", type=int, default=20000, help="per policy")
    ap.add_argument("--policies", default="eager,fill")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    policies = a.policies.split(",")
    rng = np.random.default_rng(1)
    bank = rng.standard_normal((1024, a.dim), dtype=np.float32)
    sides: dict[str, tuple[Sidecar, Connection, ClientSlot]] = {}
    lat: dict[str, list[int]] = {p: [] for p in policies}
    try:
        for pol in policies:
            cfg = ServeConfig(
                name=f"blo{os.getpid()}{pol}",
                dim=a.dim,
                slots=4,
                backend=BackendKind.NUMPY,
                random_rows=a.rows,
                launch=pol,
            )
            sc = Sidecar(cfg)
            sc.start()
            conn = Connection(cfg.name)
            sides[pol] = (sc, conn, conn.lease(1)[0])
        for i in range(200):  # warm-up
            for pol in policies:
                sc, _c, slot = sides[pol]
                one_recall(sc, slot, bank[i % 1024])
        chunk = 500
        for start in range(0, a.recalls, chunk):  # alternating in chunks
            for pol in policies[:: 1 if (start // chunk) % 2 == 0 else -1]:
                sc, _c, slot = sides[pol]
                for i in range(start, min(a.recalls, start + chunk)):
                    lat[pol].append(one_recall(sc, slot, bank[i % 1024]))
    finally:
        for sc, conn, _slot in sides.values():
            conn.close()
            sc.close()
    rows: list[dict[str, Any]] = []
    for pol in policies:
        x = np.asarray(lat[pol], np.float64) / 1e3
        p50, p95, p99 = np.percentile(x, [50, 95, 99])
        rows.append(
            {
                "policy": pol,
                "recalls": len(x),
                "p50_us": round(p50, 2),
                "p95_us": round(p95, 2),
                "p99_us": round(p99, 2),
            }
        )
        print(f"{pol:6} sidecar pass for one lone recall: p50 {p50:7.2f} us  p95 {p95:7.2f}  p99 {p99:7.2f}")
    if len(rows) == 2:
        print(
            f"difference of p50s: {rows[1]['p50_us'] - rows[0]['p50_us']:+.2f} us ({rows[1]['policy']} - {rows[0]['policy']})"
        )
    path = a.out or os.path.join(HERE, "results", f"launch-overhead-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "benchmark": "launch-overhead",
                "command": " ".join(["python3", *sys.argv]),
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "env": environment(),
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
