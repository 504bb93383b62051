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
from collections.abc import Callable
from typing import Any

from kalos.broker.errors import KalosError, UsageError
from kalos.sidecar_cuda.backends.options import BackendKind
from kalos.sidecar_cuda.config import (
    add_name_argument,
    add_serve_arguments,
    config_from_args,
    configure_logging,
    shown_default,
)

log = logging.getLogger("kalos.cli")
EXIT_ERROR = 2  # a Kalos or OS error: the message says what to change
EXIT_BUG = 1  # anything else


# A command's docstring is its --help description (plain text: argparse refills it).


def cmd_serve(a: argparse.Namespace) -> int:
    """Run a sidecar that owns the memory and serves recalls through shared memory."""
    from kalos.sidecar_cuda.server import run

    return run(config_from_args(a))


def cleanup_summary(name: str, removed: list[str]) -> str:
    """One line for what ``kalos cleanup`` removed: the kinds of objects and their count (a
    broker has two semaphores a slot: 64 slots make 131 objects)."""
    from kalos.broker.names import bell_name, leases_path, shm_name

    if not removed:
        return f"nothing left of broker {name!r}"
    kinds = []
    if shm_name(name) in removed:
        kinds.append("its shared memory")
    if leases_path(name) in removed:
        kinds.append("lease file")
    if bell_name(name) in removed:
        kinds.append("doorbell")
    sems = len(removed) - len(kinds)
    if sems:
        kinds.append(f"{sems} slot semaphores")
    return (
        f"removed what was left of broker {name!r}: {', '.join(kinds)} ({len(removed)} objects; --verbose lists them)"
    )


def cmd_cleanup(a: argparse.Namespace) -> int:
    from kalos.sidecar_cuda.serving.objects import cleanup

    name = a.broker or a.name
    removed = cleanup(name, force=a.force)
    if a.details or a.verbose:
        for r in removed:
            print(f"removed {r}")
    print(cleanup_summary(name, removed))
    return 0


def cmd_namespaces(a: argparse.Namespace) -> int:
    from kalos.admin import Budget, list_namespaces

    counts = Budget(a.name, a.timeout).run(list_namespaces)
    for ns, n in counts.items():
        print(f"{ns}\t{n}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    """Start a sidecar (CUDA if available, else numpy), build a memory set, run concurrent async
    agents, print latency percentiles and check answers."""
    from kalos.demo import run_demo

    return run_demo(a)


def cmd_bench(a: argparse.Namespace) -> int:
    """Measure recall latency/throughput through a fresh sidecar beside in-process numpy. The
    full matrix is bench/bench_broker.py."""
    from kalos.demo import run_bench

    return run_bench(a)


def _namespace_and_dir(a: argparse.Namespace) -> tuple[str | None, str]:
    """(NAMESPACE or None, DIR) of ``kalos export``/``import``, whose NAMESPACE is optional."""
    if a.dir is None:  # one positional: it is the directory
        return None, a.namespace
    return a.namespace, a.dir


def cmd_export(a: argparse.Namespace) -> int:
    """Stream a namespace (or --all of them) to DIR: manifest.json, then per namespace ids.npy,
    vectors.npy, payloads.jsonl and stamps.npy (created_at, updated_at, expires_at, TTL), files
    0600. Through the running sidecar by default; with --data-dir, from its store directly while
    it is stopped (every timestamp and TTL exact). Refuses to overwrite an earlier export.
    Progress goes to stderr."""
    from kalos.transfer import export_data_dir, export_namespaces

    namespace, out = _namespace_and_dir(a)
    if (namespace is None) == (not a.all):
        raise UsageError("kalos export takes NAMESPACE DIR, or --all DIR (every namespace)")
    names = None if a.all else [str(namespace)]
    if a.data_dir is not None:
        done = export_data_dir(a.data_dir, names, out)
    else:
        done = export_namespaces(a.name, names, out, timeout=a.timeout)
    for ns, n in done:
        print(f"exported {n} records of {ns!r} to {out}")
    if a.all:
        print(f"exported {len(done)} namespaces, {sum(n for _ns, n in done)} records, to {out}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    """Upsert the records of an export: into NAMESPACE (an export of one namespace), or each
    namespace into its own name. Through the running sidecar by default, a block at a time over a
    pool of slots (records keep expires_at; the sidecar stamps created_at and updated_at); with
    --data-dir, into its store directly while it is stopped (every timestamp and TTL as
    exported). Exports of the first format (no manifest) need NAMESPACE. Progress goes to
    stderr."""
    from kalos.transfer import DEFAULT_PAYLOAD_LIMIT, import_export, import_into_data_dir

    namespace, src = _namespace_and_dir(a)
    if a.data_dir is None and (a.metric is not None or a.payload_limit is not None):
        raise UsageError("--metric and --payload-limit are for an import into a --data-dir")
    if a.data_dir is not None:
        limit = DEFAULT_PAYLOAD_LIMIT if a.payload_limit is None else a.payload_limit
        r = import_into_data_dir(a.data_dir, src, namespace, metric=a.metric, payload_limit=limit)
    else:
        r = import_export(a.name, src, namespace, timeout=a.timeout)
    for ns, n, secs in r.namespaces:
        where = f" of data dir {a.data_dir}" if a.data_dir is not None else ""
        print(f"imported {n} records into {ns!r}{where} in {secs:.2f} s ({n / max(secs, 1e-9):,.0f}/s)")
    if r.expired:
        print(f"left out {r.expired} records that have expired since the export")
    if r.had_stamps and not r.stamps_kept:
        print(
            "timestamps: each record keeps its expires_at; created_at and updated_at are the time of "
            "this import (a sidecar stamps what it is sent). To keep them too, import with the "
            "sidecar stopped: kalos import --data-dir DIR"
        )
    return 0


def cmd_top(a: argparse.Namespace) -> int:
    """A live view of one sidecar's /metrics: slots, throughput, batch sizes, latency quantiles,
    errors, rows. q or Ctrl-C quits. Where output is not a terminal (a pipe, a file) it prints
    one frame every --interval seconds instead, until Ctrl-C or the reader closes the pipe;
    --once prints one and exits."""
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


def _command(sub: Any, run: Callable[[argparse.Namespace], int], **kw: Any) -> argparse.ArgumentParser:
    """The subcommand that ``run`` (``cmd_NAME``) runs, described by its docstring."""
    p: argparse.ArgumentParser = sub.add_parser(run.__name__.removeprefix("cmd_"), description=run.__doc__, **kw)
    p.set_defaults(func=run)
    return p


def _add_transfer_arguments(p: argparse.ArgumentParser, *, namespace: str, dir: str, data_dir: str) -> None:
    """What ``export`` and ``import`` share: NAMESPACE and DIR (:func:`_namespace_and_dir`), and
    where the records are: the store in ``--data-dir``, else the sidecar serving ``--name``."""
    p.add_argument("namespace", metavar="NAMESPACE", help=namespace)
    p.add_argument("dir", nargs="?", metavar="DIR", help=dir)
    _opt(p, "--data-dir", metavar="DATA_DIR", shown="none: through the sidecar serving --name", help=data_dir)
    add_name_argument(p)
    _add_timeout(p, None)


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
        choices=[b.value for b in BackendKind],
        default=BackendKind.AUTO.value,
        help="the sidecar's backend: auto is CUDA if CuPy and a GPU are usable, else numpy",
    )


def version_line() -> str:
    """``kalos 0.1.0 (protocol 6)``: the package and the shared-memory protocol it speaks (a
    client and a sidecar must speak the same)."""
    from kalos import PROTOCOL_VERSION, __version__

    return f"kalos {__version__} (protocol {PROTOCOL_VERSION})"


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
    p.add_argument(  # (acted on where it stands: before a command is asked for)
        "--version",
        action="version",
        version=version_line(),
        default=False,
        help=f"print the version ({version_line()}) and exit (default: off)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    s = _command(sub, cmd_serve, help="run a sidecar (until SIGTERM/SIGINT)")
    add_serve_arguments(s)

    d = _command(sub, cmd_demo, help="the main job on the embedded default: sidecar + concurrent async agents")
    _add_load_options(d, rows=50_000, seconds=4.0)
    _opt(d, "--agents", type=int, default=32, help="concurrent async agents (tasks)")
    _opt(d, "--procs", type=int, default=2, help="client processes the agents are spread over")

    b = _command(sub, cmd_bench, help="one benchmark point through the broker, beside in-process numpy")
    _add_load_options(b, rows=256, seconds=3.0)
    _opt(b, "--tasks", type=int, default=1, help="concurrent recalling tasks")
    _opt(b, "--procs", type=int, default=1, help="client processes the tasks are spread over")
    _opt(b, "--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the clients' event loop")

    c = _command(sub, cmd_cleanup, help="remove shared objects left by a crashed sidecar")
    c.add_argument("broker", nargs="?", metavar="NAME", help="broker name (default: --name)")
    add_name_argument(c)
    _opt(c, "--force", action="store_true", default=False, help="remove even if the recorded sidecar looks alive")
    _opt(
        c,
        "-v",
        "--verbose",
        dest="details",
        action="store_true",
        default=False,
        help="list every object removed, not only how many of each kind",
    )

    n = _command(sub, cmd_namespaces, help="list namespaces and their row counts")
    add_name_argument(n)
    _add_timeout(n, 5.0)

    e = _command(
        sub,
        cmd_export,
        usage="%(prog)s [options] (NAMESPACE | --all) DIR",
        help="export a namespace, or every one, with timestamps and TTLs to DIR",
    )
    _add_transfer_arguments(
        e,
        namespace="the namespace to export (left out with --all)",
        dir="output directory (created 0700 if missing; must not hold an export; empty for --all)",
        data_dir="read the store in DATA_DIR directly (the sidecar stopped: its lock is taken)",
    )
    _opt(
        e, "--all", action="store_true", default=False, help="every namespace that holds records, one subdirectory each"
    )

    i = _command(
        sub,
        cmd_import,
        usage="%(prog)s [options] [NAMESPACE] DIR",
        help="bulk-import an export (kalos export) from DIR",
    )
    _add_transfer_arguments(
        i,
        namespace="the namespace to write into (optional: see above)",
        dir="an export's directory (manifest.json, or vectors.npy with optionally ids.npy and payloads.jsonl)",
        data_dir="write into the store in DATA_DIR directly (the sidecar stopped: its lock is taken; made if missing)",
    )
    _opt(
        i,
        "--metric",
        choices=["dot", "cosine", "l2"],
        shown="the export's",
        help="--data-dir: the metric of a new store (an existing one keeps its own)",
    )
    _opt(
        i,
        "--payload-limit",
        type=int,
        shown="16384, the sidecar's default",
        help="--data-dir: the largest payload (bytes) accepted, as the sidecar's --payload-limit",
    )

    t = _command(sub, cmd_top, help="live terminal view of a sidecar's metrics (q quits)")
    add_name_argument(t)
    _opt(
        t,
        "--url",
        shown="the endpoint of the sidecar serving --name, found through /proc, else http://127.0.0.1:9464/metrics",
        help="the sidecar's /metrics URL",
    )
    _opt(t, "--interval", type=float, default=1.0, help="seconds between scrapes")
    _opt(t, "--once", action="store_true", default=False, help="print one frame and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
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
