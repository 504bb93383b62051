#!/usr/bin/env python3
"""A/B of client-side coalescing on this machine: ``bench/bench_broker.py`` run alternately
without ("base") and with ("new") ``--coalesce``, ``--runs`` times each, base first. With
``--base DIR`` (another checkout, e.g. ``git archive HEAD | tar -x -C /tmp/kalos-base``) three
sides alternate: "base" (that checkout, coalescing off), "new-off" (this tree, off) and "new" (this
tree, on). Optionally every case again with BLAS limited to one thread (``--blas1``:
``OPENBLAS_NUM_THREADS=1`` etc. in every process, to show what the sidecar's BLAS threads cost on
a 2-vCPU machine). Writes every run's rows and the medians per row.

    python bench/ab_coalesce.py --runs 3 --blas1 --out coalesce.json

(bench/results/coalesce-vm-2026-12-01.json was made with ``--base``, a checkout of 7a7f306, when
coalescing was the pool's default and the script had two sides: "base" is off, "new" is on.)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from kalos.testing.loadgen import environment

BLAS1 = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
FIELDS = (
    "p50_us",
    "p99_us",
    "recalls_per_s",
    "inproc_numpy_1q_p50_us",
    "inproc_numpy_b64_recalls_per_s",
    "overhead_p50_us",
    "throughput_vs_b64",
    "client_cpu_us_per_recall",
)


def one_run(tree: str, args: list[str], env_extra: dict[str, str]) -> dict[str, Any]:
    """One bench_broker.py run from ``tree`` with ``args``; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        env = {**os.environ, "PYTHONPATH": tree, **env_extra}
        cmd = [sys.executable, os.path.join(tree, "bench", "bench_broker.py"), *args, "--out", out]
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        print(p.stdout, end="", flush=True)
        if p.returncode not in (0, 1) or not os.path.exists(out):
            raise RuntimeError(f"bench failed ({p.returncode}): {p.stderr[-2000:]}")
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
        return res


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    for r in runs:
        for row in r["rows"]:
            rows.setdefault((row["n"], row["dim"], row["tasks"], row["procs"]), []).append(row)
    out = []
    for (n, d, tasks, procs), rs in rows.items():
        m: dict[str, Any] = {"n": n, "dim": d, "tasks": tasks, "procs": procs, "runs": len(rs)}
        for f in FIELDS:
            if all(f in r for r in rs):  # (older checkouts lack the newer fields)
                m[f] = round(statistics.median(r[f] for r in rs), 3)
        m["wrong"] = sum(r["wrong"] for r in rs)
        m["errors"] = sum(r["errors"] for r in rs)
        out.append(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="a checkout whose default run is the 'off' side")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--blas1", action="store_true", help="also run every case with BLAS on one thread")
    ap.add_argument("--bench-args", default="--sizes 256x128 --tasks 1,64 --procs 1,4 --seconds 3")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    args = a.bench_args.split()
    sides: list[tuple[str, str, list[str]]] = [("base", a.base or HERE, [])]
    if a.base:
        sides.append(("new-off", HERE, []))
    sides.append(("new", HERE, ["--coalesce"]))
    envs: list[tuple[str, dict[str, str]]] = [("default", {})] + ([("blas1", BLAS1)] if a.blas1 else [])
    result: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "bench_command": f"python bench/bench_broker.py {a.bench_args}",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "env": environment(),
        "method": f"sides {[s for s, _t, _m in sides]} alternately, {a.runs} runs each, in that order; medians per row",
        "cases": {},
    }
    for label, extra in envs:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side, _t, _m in sides}
        for i in range(a.runs):
            for side, tree, more in sides:
                print(f"# {label} {side} run {i + 1}/{a.runs}", flush=True)
                runs[side].append(one_run(tree, args + more, extra))
        result["cases"][label] = {
            "env_extra": extra,
            **{side: {"median": medians(rs), "runs": [r["rows"] for r in rs]} for side, rs in runs.items()},
        }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for label, case in result["cases"].items():
        for side, _t, _m in sides:
            for m in case[side]["median"]:
                cpu = m.get("client_cpu_us_per_recall")
                print(
                    f"{label:8} {side:7} tasks={m['tasks']:<3} procs={m['procs']}  p50 {m['p50_us']:8.1f} us"
                    f"  {m['recalls_per_s']:9,.0f}/s  x{m['throughput_vs_b64']:.3f} of b64 "
                    f"({m['inproc_numpy_b64_recalls_per_s']:,.0f}/s)  overhead {m['overhead_p50_us']:+.1f} us"
                    + ("" if cpu is None else f"  client CPU {cpu:.1f} us/recall")
                )
    print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
