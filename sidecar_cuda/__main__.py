"""``python -m kalos.sidecar_cuda [OPTIONS]``: run a sidecar until SIGTERM/SIGINT (what ``kalos serve`` runs).

The sidecar parses its own options (:mod:`kalos.sidecar_cuda.config`), so it needs nothing above it.
"""

from __future__ import annotations

import argparse
import sys

from ..broker.errors import KalosError
from .config import add_serve_arguments, config_from_args, configure_logging
from .server import run

PROG = "python -m kalos.sidecar_cuda"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run a Kalos sidecar that owns the memory and serves recalls through shared memory."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: off)")
    add_serve_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return run(config_from_args(args))
    except KalosError as e:
        print(f"{PROG}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
