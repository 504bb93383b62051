"""The ``kalos`` command: serve, demo, bench, cleanup, namespaces, export, import, top."""

from __future__ import annotations

import argparse
import logging
import sys

from kalos.broker.errors import KalosError
from kalos.sidecar_cuda.config import add_serve_arguments, config_from_args


def cmd_serve(a: argparse.Namespace) -> int:
    from kalos.sidecar_cuda.server import run

    return run(config_from_args(a))


def cmd_cleanup(a: argparse.Namespace) -> int:
    from kalos.sidecar_cuda.objects import cleanup

    removed = cleanup(a.name, force=a.force)
    for r in removed:
        print(f"removed {r}")
    if not removed:
        print(f"nothing left of broker {a.name!r}")
    return 0


def cmd_namespaces(a: argparse.Namespace) -> int:
    from kalos.clients.blocking import RecallClient

    with RecallClient(a.name, timeout=a.timeout) as c:
        counts = c.namespaces()
    for ns, n in counts.items():
        print(f"{ns}\t{n}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from kalos.demo import run_demo

    return run_demo(a)


def cmd_bench(a: argparse.Namespace) -> int:
    from kalos.demo import run_bench

    return run_bench(a)


def cmd_export(a: argparse.Namespace) -> int:
    from kalos.transfer import export_namespace

    n = export_namespace(a.name, a.namespace, a.out, timeout=a.timeout)
    print(f"exported {n} records of {a.namespace!r} to {a.out}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from kalos.transfer import import_namespace

    n, secs = import_namespace(a.name, a.namespace, a.src, timeout=a.timeout)
    print(f"imported {n} records into {a.namespace!r} in {secs:.2f} s ({n / max(secs, 1e-9):,.0f}/s)")
    return 0


def cmd_top(a: argparse.Namespace) -> int:
    from kalos.top import run_top

    return run_top(a.url, a.interval, once=a.once)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kalos", description="Kalos recall broker: GPU sidecar + shared-memory clients")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run a sidecar (until SIGTERM/SIGINT)",
                       description="Run a sidecar that owns the memory and serves recalls through shared memory.")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="the main job on the embedded default: sidecar + concurrent async agents",
                       description="Start a sidecar (CUDA if available, else numpy), build a memory set, run "
                                   "concurrent async agents, print latency percentiles and check answers.")
    d.add_argument("--rows", type=int, default=50_000)
    d.add_argument("--dim", type=int, default=128)
    d.add_argument("--agents", type=int, default=32, help="concurrent async agents (tasks)")
    d.add_argument("--procs", type=int, default=2, help="client processes the agents are spread over")
    d.add_argument("--seconds", type=float, default=4.0)
    d.add_argument("-k", type=int, default=10)
    d.add_argument("--backend", choices=["auto", "numpy", "cuda"], default="auto")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="one benchmark point through the broker, beside in-process numpy",
                       description="Measure recall latency/throughput through a fresh sidecar beside in-process numpy. "
                                   "The full matrix is bench/bench_broker.py.")
    b.add_argument("--rows", type=int, default=256)
    b.add_argument("--dim", type=int, default=128)
    b.add_argument("--tasks", type=int, default=1)
    b.add_argument("--procs", type=int, default=1)
    b.add_argument("--seconds", type=float, default=3.0)
    b.add_argument("-k", type=int, default=10)
    b.add_argument("--backend", choices=["auto", "numpy", "cuda"], default="auto")
    b.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("cleanup", help="remove shared objects left by a crashed sidecar")
    c.add_argument("name", help="broker name")
    c.add_argument("--force", action="store_true", help="remove even if the recorded sidecar looks alive")
    c.set_defaults(func=cmd_cleanup)

    n = sub.add_parser("namespaces", help="list namespaces and their row counts")
    n.add_argument("--name", default="default")
    n.add_argument("--timeout", type=float, default=5.0)
    n.set_defaults(func=cmd_namespaces)

    e = sub.add_parser("export", help="export a namespace to DIR (vectors.npy, ids.npy, payloads.jsonl)")
    e.add_argument("namespace")
    e.add_argument("out", help="output directory (created)")
    e.add_argument("--name", default="default")
    e.add_argument("--timeout", type=float, default=60.0)
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("import", help="bulk-import a namespace from DIR written by `kalos export`")
    i.add_argument("namespace")
    i.add_argument("src", help="directory with vectors.npy, ids.npy and optionally payloads.jsonl")
    i.add_argument("--name", default="default")
    i.add_argument("--timeout", type=float, default=60.0)
    i.set_defaults(func=cmd_import)

    t = sub.add_parser("top", help="live terminal view of a sidecar's metrics")
    t.add_argument("--url", default="http://127.0.0.1:9464/metrics", help="the sidecar's /metrics URL")
    t.add_argument("--interval", type=float, default=1.0)
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.set_defaults(func=cmd_top)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KalosError as e:
        print(f"kalos {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser"]
