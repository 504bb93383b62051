"""A throwaway PostgreSQL server for the fleet tests and benchmarks: Debian's binaries, ``initdb``
in a temporary directory, run as an unprivileged user (``nobody`` when we are root, since the
server refuses to run as root), on a Unix socket and a loopback port.

Trust on the socket (fixtures connect without a password); scram-sha-256 on the loopback port,
with the superuser's password :data:`PASSWORD`, so the tests can try a wrong one.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

PASSWORD = "kalos-test-secret-pw"
USER = "kalos"


def find_bin() -> str | None:
    """The newest ``/usr/lib/postgresql/N/bin`` that has initdb and pg_ctl, or None."""
    found = [
        d
        for d in glob.glob("/usr/lib/postgresql/*/bin")
        if os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "pg_ctl"))
    ]
    if found:
        return max(found, key=lambda d: int(d.split("/")[-2]) if d.split("/")[-2].isdigit() else 0)
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One server. ``dsn(db)``: a URI over the socket (no password needed); ``tcp_dsn(db, pw)``."""

    def __init__(self, bindir: str, *, fsync: bool = False) -> None:
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="kalos-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = _free_port()
        self.fsync = fsync
        self._run_as = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        if self._run_as:
            os.chown(self.dir, _uid("nobody"), -1)
        pwfile = os.path.join(self.dir, "pw")
        with open(pwfile, "w") as f:
            f.write(PASSWORD + "\n")
        if self._run_as:
            os.chown(pwfile, _uid("nobody"), -1)
        self._pg(
            "initdb",
            "-D",
            self.data,
            "-U",
            USER,
            "--pwfile",
            pwfile,
            "-E",
            "UTF8",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-sync",
        )
        os.unlink(pwfile)
        self.start()

    def _pg(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*self._run_as, os.path.join(self.bindir, tool), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=check,
            timeout=120,
        )

    def start(self) -> None:
        opts = (
            f"-k {self.dir} -p {self.port} -c listen_addresses=127.0.0.1 "
            f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200"
        )
        out = self._pg(
            "pg_ctl",
            "-D",
            self.data,
            "-l",
            os.path.join(self.dir, "log"),
            "-w",
            "-t",
            "60",
            "-o",
            opts,
            "start",
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {out.stdout.decode(errors='replace')}{self.log_tail()}")

    def stop(self, mode: str = "fast") -> None:
        self._pg("pg_ctl", "-D", self.data, "-m", mode, "-w", "stop", check=False)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.dir, "log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://{USER}@/{db}?host={self.dir}&port={self.port}"

    def tcp_dsn(self, db: str = "postgres", password: str | None = None) -> str:
        pw = f":{password}" if password is not None else ""
        return f"postgresql://{USER}{pw}@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str, db: str = "postgres") -> str:
        out = subprocess.run(
            [
                os.path.join(self.bindir, "psql"),
                "-X",
                "-q",
                "-t",
                "-A",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                self.dsn(db),
                "-c",
                sql,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"psql failed: {out.stdout.decode(errors='replace')}")
        return out.stdout.decode().strip()

    def create_db(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def close(self) -> None:
        self.stop("immediate")
        deadline = time.monotonic() + 10
        while os.path.exists(os.path.join(self.data, "postmaster.pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.dir, ignore_errors=True)


def _uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid
