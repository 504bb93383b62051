"""A real PostgreSQL server for the fleet tests, and fleet sidecars on it (fixtures: test modules
import them by name; a conftest.py here would shadow tests/conftest.py's module name).

The server is Debian's (``/usr/lib/postgresql/N/bin``), started once per session as an
unprivileged user in a temporary directory (:mod:`kalos.testing.postgres`); each test gets its
own database. A missing server is installed (``apt-get``, as root); where it cannot be, the tests
skip with the reason, unless ``KALOS_REQUIRE_POSTGRES=1`` (``.ci/run`` sets it once it has
installed the package): then a missing server fails them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import unique_name  # (tests/conftest.py: the root's)

from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process

pytest.importorskip("psycopg", reason="the fleet store needs psycopg 3 (pip install '.[postgres]' from a checkout)")

from kalos.testing.postgres import PgServer, find_bin

_dbs = itertools.count()


def _install_postgresql() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"]
    if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        subprocess.run(cmd, env=env, capture_output=True, timeout=600)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = find_bin()
    if bindir is None and os.geteuid() == 0 and shutil.which("apt-get"):
        _install_postgresql()  # (as tests/ops/test_prometheus.py does for prometheus)
        bindir = find_bin()
    if bindir is None:
        why = "PostgreSQL server binaries not installed (apt-get install postgresql)"
        if os.environ.get("KALOS_REQUIRE_POSTGRES") == "1":
            pytest.fail(why + ", but KALOS_REQUIRE_POSTGRES=1")
        pytest.skip(why)
    server = PgServer(bindir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg(pg_server: PgServer) -> Iterator[PgServer]:
    """The session's server, started again if a test left it stopped."""
    if not os.path.exists(os.path.join(pg_server.data, "postmaster.pid")):
        pg_server.start()
    yield pg_server
    if not os.path.exists(os.path.join(pg_server.data, "postmaster.pid")):
        pg_server.start()


@pytest.fixture
def fleet_dsn(pg: PgServer) -> str:
    """A fresh database of the session's server (a URI over its socket, no password)."""
    return pg.create_db(f"t{os.getpid()}_{next(_dbs)}")


class Node:
    """One fleet sidecar process (a "node"), restartable under the same name; its log is kept."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log_path = os.path.join(tempfile.gettempdir(), f"{name}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Node:
        with open(self.log_path, "ab") as log:
            old = {k: os.environ.get(k) for k in self.env}
            os.environ.update(self.env)
            try:
                self.proc = start_sidecar_process(self.args, self.name, timeout=timeout, stderr=log)
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


@pytest.fixture
def fleet(fleet_dsn: str) -> Iterator:
    """``start(tag, *args, store=DSN)``: a sidecar following the test's database (numpy, dim 16
    unless ``args`` say otherwise; the store given through KALOS_STORE, as an operator would
    hide a password). Every node is stopped and cleaned at teardown."""
    nodes: list[Node] = []

    def start(
        tag: str = "n", *args: str, store: str | None = None, env: dict[str, str] | None = None, start: bool = True
    ) -> Node:
        full = list(args)
        if "--dim" not in full:
            full += ["--dim", "16"]
        if "--backend" not in full:
            full += ["--backend", "numpy"]
        node = Node(unique_name(tag), full, {"KALOS_STORE": store or fleet_dsn, **(env or {})})
        nodes.append(node)
        return node.start() if start else node

    yield start
    for n in nodes:
        n.stop()
        try:
            cleanup(n.name, force=True)
        except Exception:
            pass
        if os.path.exists(n.log_path):
            os.unlink(n.log_path)


def run_serve(args: list[str], env: dict[str, str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m kalos.sidecar_cuda ARGS`` expected to fail at start: its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "kalos.sidecar_cuda", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(pred, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
