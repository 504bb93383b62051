#!/usr/bin/env python3
"""The seed article's design beside Kalos, in one run: its single-slot C/CUDA sidecar (flags in a
shared header, a query copy, a dot kernel, all scores copied back, argmax on the CPU) driven by its
Python client, at its sizes, in its two modes (the reference's 1 us sleeps between polls, and both
sides busy-spinning); then the Kalos broker at the same size with 1 task (k = 1, the seed's top-1,
and k = 10), and in-process torch and this backend at the same size. p50/p95/p99 of each, JSON.

The seed's files are not part of this repository (they live in the shared folder beside it) and the
device machine gets only the repository: copy them into the ignored folder first,

    mkdir -p .dev/seed && cp /work/shared/baselines/seed_* .dev/seed/
    python3 bench/bench_seed.py --out DIR/seed.json              # ~1 min on an H200
    python3 bench/bench_seed.py --backend numpy --sizes 256x128  # no GPU: the broker part only

The sidecar is built there with nvcc (into --seed-dir, `-O3 -arch=sm_90`, without -arch if that
fails) and driven by seed_client.run(); its latencies are taken from the client as it measured
them (no copy of the client here). The seed's matrix is its own fixed pattern and its check is its
own (argmax against numpy float32 every 100th query); the broker's answers are checked against
numpy float64 on the regenerated rows as in bench_gpu.py. Without nvcc or a CUDA device the seed
part is skipped with the reason in the JSON; `--backend numpy` then still measures the broker.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_gpu import (
    RTOL,
    copy_bandwidth,
    gpu_environment,
    kalos_inproc,
    latency_sample,
    log,
    parse_size,
    sidecar_matrix,
    torch_baselines,
)
from bench_scaling import Interrupted, cuda_or_reason, host_copy_bandwidth, human, write

from kalos.demo import inproc_numpy
from kalos.testing.loadgen import LoadSpec, check_samples, environment, run_load
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

SEED_FILES = ("seed_sidecar.cu", "seed_client.py")
VARIANTS = {"reference": (0, 0), "spinning": (1, 1)}  # (server spin, client spin)
COPY_HINT = "mkdir -p .dev/seed && cp /work/shared/baselines/seed_* .dev/seed/"


# ---------------------------------------------------------------------------- the seed
def build_seed(seed_dir: str, nvcc: str, arch: str) -> tuple[str | None, dict[str, Any]]:
    """Compile seed_sidecar.cu into seed_dir. Returns (binary or None, what happened)."""
    exe = shutil.which(nvcc)
    if exe is None:
        return None, {"skipped": f"{nvcc} not found"}
    src = os.path.join(seed_dir, "seed_sidecar.cu")
    out = os.path.join(seed_dir, "seed_sidecar")
    info: dict[str, Any] = {}
    try:
        info["nvcc"] = (
            subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            .stdout.strip()
            .splitlines()[-1]
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    for flags in ([f"-arch={arch}"] if arch else [], []):
        cmd = [exe, "-O3", "-std=c++17", *flags, "-o", out, src]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            info.update(command=" ".join(cmd), seconds=round(time.perf_counter() - t0, 1))
            return out, info
        log(f"# {' '.join(cmd)} failed: {r.stderr.strip()[-500:]}")
        info.setdefault("failed", []).append({"command": " ".join(cmd), "stderr": r.stderr.strip()[-500:]})
        if not flags:
            break
    return None, info


def load_client(seed_dir: str) -> Any:
    spec = importlib.util.spec_from_file_location("seed_client", os.path.join(seed_dir, "seed_client.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_seed(client: Any, binary: str, n: int, d: int, variant: str, iters: int, timeout_s: float) -> dict[str, Any]:
    """One seed_client.run(), with the latencies it measured (caught where it summarises them)
    and its sidecar killed if it has not finished within timeout_s."""
    caught: list[np.ndarray] = []
    servers: list[subprocess.Popen[bytes]] = []
    orig_pct, orig_sub = client.pct, client.subprocess

    def pct(a: Any) -> dict[str, Any]:
        caught.append(np.asarray(a, np.int64))
        summary: dict[str, Any] = orig_pct(a)
        return summary

    def popen(*args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        servers.append(subprocess.Popen(*args, **kw))
        return servers[-1]

    def alarm(_signum: int, _frame: Any) -> None:
        raise TimeoutError(f"seed run not finished in {timeout_s:.0f} s")

    client.pct = pct
    client.subprocess = types.SimpleNamespace(Popen=popen)
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        ss, cs = VARIANTS[variant]
        r = client.run(binary, n, d, ss, cs, iters=iters)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        client.pct, client.subprocess = orig_pct, orig_sub
        for p in servers:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:  # the seed sidecar unlinks its segment on a clean stop only
            os.unlink(f"/dev/shm/kalos_seed_{os.getpid()}")
        except OSError:
            pass
    lat = caught[-1]
    return {
        "what": "seed",
        "variant": variant,
        "server_spin": ss,
        "client_spin": cs,
        "k": 1,
        **{kk: round(r[kk], 1) for kk in ("p50_us", "p95_us", "p99_us")},
        "count": len(lat),
        "checked": len(range(200, iters + 200, 100)),
        "wrong": int(r["wrong_checks"]),
        "lat_sample_us": latency_sample(lat),
    }


# ---------------------------------------------------------------------------- Kalos at that size
def broker_rows(
    a: argparse.Namespace, n: int, d: int, ks: list[int], seed: int, matrix: np.ndarray, base: dict[str, Any]
) -> list[dict[str, Any]]:
    """One sidecar at this size; a 1-task run for each k."""
    name = f"bseed{os.getpid()}x{n}"
    proc = start_sidecar_process(
        [
            "--ephemeral",
            "--backend",
            a.backend,
            "--dtype",
            "float32",
            "--dim",
            str(d),
            "--random-rows",
            str(n),
            "--seed",
            str(seed),
            "--slots",
            "64",
            "--max-k",
            "64",
            "--max-queries",
            "4",
            *(["--device", "0"] if a.backend == "cuda" else []),
        ],
        name,
        timeout=300,
    )
    out = []
    try:
        for k in ks:
            res = run_load(
                LoadSpec(
                    name=name,
                    dim=d,
                    procs=1,
                    tasks=1,
                    duration_s=a.seconds,
                    warmup_s=0.5,
                    k=k,
                    seed=seed,
                    loop=a.loop,
                    keep=100,
                )
            )
            checked, wrong = check_samples(res.samples, matrix, k, rtol=RTOL["float32"])
            p = res.percentiles_us()
            out.append(
                {
                    **base,
                    "what": "broker",
                    "k": k,
                    "tasks": 1,
                    "procs": 1,
                    **{kk: round(v, 1) for kk, v in p.items()},
                    "recalls_per_s": round(res.throughput),
                    "count": res.count,
                    "errors": res.errors,
                    "checked": checked,
                    "wrong": wrong,
                    "lat_sample_us": latency_sample(res.latencies_ns),
                }
            )
    finally:
        stop_sidecar_process(proc)
    return out


def inproc(a: argparse.Namespace, cp: Any, matrix: np.ndarray, k: int, seed: int) -> list[dict[str, Any]]:
    if a.backend != "cuda":
        p, tput = inproc_numpy(matrix, k, seconds=max(0.5, a.seconds / 2), batch=1)
        return [
            {"what": "numpy_single", "k": k, **{kk: round(v, 2) for kk, v in p.items()}, "recalls_per_s": round(tput)}
        ]
    bank = np.random.default_rng(seed + 1).standard_normal((1024, matrix.shape[1]), dtype=np.float32)
    out = []
    for fn in (torch_baselines, lambda *x: kalos_inproc(cp, *x)):
        try:
            out += [{"k": k, **r} for r in fn(matrix, "float32", k, bank, a.reps)]
        except Exception as e:  # a baseline that fails is reported, not fatal
            log(f"# in-process baseline failed: {type(e).__name__}: {e}")
            out.append({"what": "inproc_error", "k": k, "error": f"{type(e).__name__}: {e}"})
    return out


# ---------------------------------------------------------------------------- main
def table(rows: list[dict[str, Any]]) -> str:
    head = ("size", "case", "k", "p50 us", "p95 us", "p99 us", "checked/wrong")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "p50_us" not in r or r["what"].startswith(("torch_batch", "kalos_batch")):
            continue
        case = r["what"] + (f" ({r['variant']})" if "variant" in r else "")
        lines.append(
            " | ".join(
                [
                    f"{human(r['n'])} x {r['dim']}",
                    case,
                    str(r.get("k", "")),
                    f"{r['p50_us']:,.1f}",
                    f"{r['p95_us']:,.1f}",
                    f"{r['p99_us']:,.1f}",
                    f"{r.get('checked', '-')}/{r.get('wrong', '-')}",
                ]
            )
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--seed-dir",
        default=os.path.join(".dev", "seed"),
        help=f"folder holding {' and '.join(SEED_FILES)} (ignored by git; `{COPY_HINT}`)",
    )
    ap.add_argument("--seed-binary", default=None, help="a seed sidecar already built (skips nvcc)")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--arch", default="sm_90", help="nvcc -arch (empty: nvcc's default)")
    ap.add_argument("--sizes", default="256x128,100kx768", help="float32 N x D sizes (the seed stores float32)")
    ap.add_argument("--iters", type=int, default=2000, help="seed round trips measured per mode")
    ap.add_argument("--seed-timeout", type=float, default=120.0, help="seconds one seed run may take")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "numpy"])
    ap.add_argument("--ks", default="1,10", help="k of the broker runs (the seed answers top-1)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per broker run")
    ap.add_argument("--reps", type=int, default=1000, help="in-process repetitions")
    ap.add_argument("--loop", default="uvloop")
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/seed-BACKEND-DATE.json)")
    a = ap.parse_args()

    gpu, gpu_why = cuda_or_reason()  # the seed needs one whatever the backend
    if a.backend == "cuda" and gpu is None:
        log(
            f"# skipped: {gpu_why}. The seed and the Kalos CUDA sidecar need a CUDA GPU; "
            f"`--backend numpy` measures the broker part on the CPU."
        )
        return 0
    cp = gpu if a.backend == "cuda" else None
    ks = [int(k) for k in a.ks.split(",")]
    sizes = [parse_size(s)[:2] for s in a.sizes.split(",")]
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"# seed {seed}")
    env = gpu_environment(cp) if cp is not None else environment()
    env["backend"] = a.backend
    bw = copy_bandwidth(cp) if cp is not None else host_copy_bandwidth()

    # The seed: its files, its build.
    missing = [f for f in SEED_FILES if not os.path.exists(os.path.join(a.seed_dir, f))]
    if missing:
        log(f"# {', '.join(missing)} not in {a.seed_dir}: copy them there first ({COPY_HINT})")
        return 2
    client = None
    if a.seed_binary:
        binary, build = a.seed_binary, {"given": a.seed_binary}
    else:
        binary, build = build_seed(a.seed_dir, a.nvcc, a.arch)  # nvcc needs no GPU
        if binary is not None and gpu is None:
            build["skipped"] = f"built, but no CUDA device to run it on ({gpu_why})"
            binary = None
    if binary is not None:
        client = load_client(a.seed_dir)
        log(f"# seed sidecar: {binary} ({build.get('command', 'given')})")
    else:
        log(f"# seed skipped: {build.get('skipped') or 'build failed'}")

    path = a.out or os.path.join(HERE, "results", f"seed-{a.backend}-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "seed",
        "command": " ".join(["python3", *sys.argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "seed": seed,
        "env": env,
        "copy_TBps": round(bw, 3),
        "seed_build": build,
        "rows": [],
    }

    def on_term(signum: int, _frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    status = 0
    try:
        for n, d in sizes:
            base = {"n": n, "dim": d, "dtype": "float32", "floor_us": round(n * d * 4 / (bw * 1e12) * 1e6, 2)}
            rows: list[dict[str, Any]] = []
            if client is not None:
                for variant in VARIANTS:
                    try:
                        r = {**base, **run_seed(client, binary, n, d, variant, a.iters, a.seed_timeout)}
                    except Exception as e:
                        log(f"# seed {variant} at {n}x{d} failed: {type(e).__name__}: {e}")
                        r = {**base, "what": "seed_error", "variant": variant, "error": f"{type(e).__name__}: {e}"}
                    rows.append(r)
            matrix = sidecar_matrix(n, d, seed)
            if not a.skip_inproc:
                rows += [{**base, **r} for r in inproc(a, cp, matrix, ks[0], seed)]
            rows += broker_rows(a, n, d, ks, seed, matrix, base)
            del matrix
            for r in rows:
                if "p50_us" in r and not r["what"].startswith(("torch_batch", "kalos_batch")):
                    log(
                        f"{human(n):>5} x{d:<4} {r['what'] + ('/' + r['variant'] if 'variant' in r else ''):28} "
                        f"k={r.get('k', '')!s:<3} p50={r['p50_us']:9.1f}us p95={r['p95_us']:9.1f} "
                        f"p99={r['p99_us']:9.1f}  checked/wrong {r.get('checked', '-')}/{r.get('wrong', '-')}"
                    )
            doc["rows"] += rows
            write(path, doc)
    except (Interrupted, KeyboardInterrupt) as e:
        log(f"# interrupted ({e}): writing what was measured")
        doc["interrupted"] = True
        status = 2
    except Exception as e:
        log(f"# failed: {type(e).__name__}: {e}")
        doc["error"] = f"{type(e).__name__}: {e}"
        status = 1
    write(path, doc)
    log("")
    log(table(doc["rows"]))
    log(f"# wrote {path}")
    bad = [r for r in doc["rows"] if r["what"] == "broker" and (r.get("wrong") or r.get("errors"))]
    return status or (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
