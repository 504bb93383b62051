"""The ``kalos`` command: serve, demo, bench, cleanup, namespaces, export, import, top.

Every option's help shows its default. ``--name`` (``$KALOS_NAME``) is defined once
(:func:`kalos.sidecar_cuda.config.add_name_argument`) and means the same broker for every
command that talks to one; ``--timeout`` bounds a whole admin command, connecting included. An
error is one line on stderr and a non-zero exit (``-v`` adds the traceback of an unexpected one).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kalos.broker.errors import KalosError
from kalos.sidecar_cuda.config import (
    add_name_argument,
    add_serve_arguments,
    config_from_args,
    shown_default,
)

log = logging.getLogger("kalos.cli")
EXIT_ERROR = 2  # a Kalos or OS error: the message says what to change
EXIT_BUG = 1  # anything else


def cmd_serve(a: argparse.Namespace) -> int:
    from kalos.sidecar_cuda.server import run

    return run(config_from_args(a))


def cmd_cleanup(a: argparse.Namespace) -> int:
    from kalos.sidecar_cuda.objects import cleanup

    name = a.broker or a.name
    removed = cleanup(name, force=a.force)
    for r in removed:
        print(f"removed {r}")
    if not removed:
        print(f"nothing left of broker {name!r}")
    return 0


def cmd_namespaces(a: argparse.Namespace) -> int:
    from kalos.admin import Budget, list_namespaces

    counts = Budget(a.name, a.timeout).run(list_namespaces)
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
    from kalos.top import find_metrics_url, run_top

    url = a.url or find_metrics_url(a.name)
    return run_top(url, a.interval, once=a.once)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw!r}: give a number of seconds > 0")
    return value


def _opt(
    p: argparse.ArgumentParser, *flags: str, help: str, default: Any = None, shown: str | None = None, **kw: Any
) -> None:
    """An option whose help ends with its default (``shown`` if given)."""
    p.add_argument(
        *flags,
        default=default,
        **kw,
        help=f"{help} (default: {shown if shown is not None else shown_default(default)})",
    )


def _add_timeout(p: argparse.ArgumentParser, default: float | None) -> None:
    _opt(
        p,
        "--timeout",
        type=_seconds,
        default=default,
        metavar="SECONDS",
        shown=None if default is not None else "none, no limit",
        help="seconds the whole command may take, connecting to the sidecar included",
    )


def _add_load_options(p: argparse.ArgumentParser, *, rows: int, seconds: float) -> None:
    """What ``demo`` and ``bench`` share: the throwaway sidecar they start (named after the
    process, never --name: they must not touch a sidecar that serves real memories)."""
    _opt(p, "--rows", type=int, default=rows, help="random memories in the sidecar")
    _opt(p, "--dim", type=int, default=128, help="vector dimension")
    _opt(p, "--seconds", type=float, default=seconds, help="how long the load runs")
    _opt(p, "-k", type=int, default=10, help="neighbours per recall")
    _opt(
        p,
        "--backend",
        choices=["auto", "numpy", "cuda"],
        default="auto",
        help="the sidecar's backend: auto is CUDA if CuPy and a GPU are usable, else numpy",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kalos", description="Kalos recall broker: GPU sidecar + shared-memory clients")
    _opt(
        p,
        "-v",
        "--verbose",
        action="store_true",
        default=False,
        help="debug logging, and the traceback of an unexpected error",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser(
        "serve",
        help="run a sidecar (until SIGTERM/SIGINT)",
        description="Run a sidecar that owns the memory and serves recalls through shared memory.",
    )
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser(
        "demo",
        help="the main job on the embedded default: sidecar + concurrent async agents",
        description="Start a sidecar (CUDA if available, else numpy), build a memory set, run "
        "concurrent async agents, print latency percentiles and check answers.",
    )
    _add_load_options(d, rows=50_000, seconds=4.0)
    _opt(d, "--agents", type=int, default=32, help="concurrent async agents (tasks)")
    _opt(d, "--procs", type=int, default=2, help="client processes the agents are spread over")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser(
        "bench",
        help="one benchmark point through the broker, beside in-process numpy",
        description="Measure recall latency/throughput through a fresh sidecar beside in-process numpy. "
        "The full matrix is bench/bench_broker.py.",
    )
    _add_load_options(b, rows=256, seconds=3.0)
    _opt(b, "--tasks", type=int, default=1, help="concurrent recalling tasks")
    _opt(b, "--procs", type=int, default=1, help="client processes the tasks are spread over")
    _opt(b, "--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the clients' event loop")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("cleanup", help="remove shared objects left by a crashed sidecar")
    c.add_argument("broker", nargs="?", metavar="NAME", help="broker name (default: --name)")
    add_name_argument(c)
    _opt(c, "--force", action="store_true", default=False, help="remove even if the recorded sidecar looks alive")
    c.set_defaults(func=cmd_cleanup)

    n = sub.add_parser("namespaces", help="list namespaces and their row counts")
    add_name_argument(n)
    _add_timeout(n, 5.0)
    n.set_defaults(func=cmd_namespaces)

    e = sub.add_parser(
        "export",
        help="export a namespace to DIR (vectors.npy, ids.npy, payloads.jsonl)",
        description="Stream a namespace to DIR page by page; refuses to overwrite an "
        "earlier export. Progress goes to stderr.",
    )
    e.add_argument("namespace", help="the namespace to export")
    e.add_argument("out", metavar="DIR", help="output directory (created if missing; must not hold an export)")
    add_name_argument(e)
    _add_timeout(e, None)
    e.set_defaults(func=cmd_export)

    i = sub.add_parser(
        "import",
        help="bulk-import a namespace from DIR written by `kalos export`",
        description="Upsert the records of an export into a namespace, a block at a "
        "time over a pool of slots. Progress goes to stderr.",
    )
    i.add_argument("namespace", help="the namespace to write into")
    i.add_argument("src", metavar="DIR", help="directory with vectors.npy, and optionally ids.npy and payloads.jsonl")
    add_name_argument(i)
    _add_timeout(i, None)
    i.set_defaults(func=cmd_import)

    t = sub.add_parser(
        "top",
        help="live terminal view of a sidecar's metrics (q quits)",
        description="A live view of one sidecar's /metrics: slots, throughput, batch "
        "sizes, latency quantiles, errors, rows. q or Ctrl-C quits.",
    )
    add_name_argument(t)
    _opt(
        t,
        "--url",
        shown="the endpoint of the sidecar serving --name, found through /proc, else http://127.0.0.1:9464/metrics",
        help="the sidecar's /metrics URL",
    )
    _opt(t, "--interval", type=float, default=1.0, help="seconds between scrapes")
    _opt(t, "--once", action="store_true", default=False, help="print one frame and exit")
    t.set_defaults(func=cmd_top)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # a pool's INFO lines (its slot path) are for applications' logs, not a command's stderr
        logging.getLogger("kalos.clients").setLevel(logging.WARNING)
    where = f"kalos {args.cmd}"
    try:
        return int(args.func(args) or 0)
    except KalosError as e:
        print(f"{where}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        print(f"{where}: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line; -v shows where
        if args.verbose:
            log.exception("unexpected error")
        print(f"{where}: unexpected {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser"]
