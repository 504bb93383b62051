"""A sidecar in a child process, for the demo, the benchmarks and the tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from kalos.broker.errors import BrokerUnavailable
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.serving.objects import cleanup


def start_sidecar_process(
    args: list[str],
    name: str,
    timeout: float = 60.0,
    stderr: int | IO[Any] | None = None,
    python_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python [PYTHON_ARGS] -m kalos.sidecar_cuda --name NAME ARGS`` and wait until it is ready.

    ``timeout`` is in seconds; ``python_args`` e.g. ``-m cProfile -o FILE``; ``env``: the
    sidecar's environment (default: this process's; e.g. ``KALOS_PURE_PYTHON=1`` for its slot
    path alone). Raises RuntimeError if the sidecar exits during start or is not ready within
    ``timeout`` (it is killed then)."""
    proc = subprocess.Popen(
        [sys.executable, *python_args, "-m", "kalos.sidecar_cuda", "--name", name, *args],
        stderr=stderr,
        env=None if env is None else dict(env),
    )
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with code {proc.returncode} during start")
        try:
            c = Connection(name, sidecar_uid=os.geteuid())
            try:
                if c.is_ready() and int(c.seg.header["sidecar_pid"]) == proc.pid:
                    return proc
            finally:
                c.close()
        except BrokerUnavailable:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("sidecar did not become ready in time")
        time.sleep(0.02)


def stop_sidecar_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_sidecar(
    args: list[str],
    name: str,
    timeout: float = 60.0,
    stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`start_sidecar_process` for the block, then :func:`stop_sidecar_process` and its
    broker's objects unlinked (``cleanup(name, force=True)``: those of a sidecar that was killed
    too), however the block ends."""
    proc = start_sidecar_process(args, name, timeout=timeout, stderr=stderr, env=env)
    try:
        yield proc
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)
