"""docs/deploy.md, "Trying several nodes on one machine" and "Privileges", run as written (issue 33,
item 11): a private PostgreSQL server on a Unix socket, the role and the database the recipe
creates, three nodes on a socket URI, a write on one read on another with ``after=``; then a node
whose role has only the documented grants, and one whose role has none (refused at start).

What the test changes, as tests/ipc/test_readme_quickstart.py does: the server's directory and
port, the broker names and metrics ports (free ones), ``--backend numpy`` through
``KALOS_BACKEND``; the server runs as ``nobody`` when the test runs as root (PostgreSQL refuses
root)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, unique_name
from fleetkit import pg_server  # noqa: F401 (fixture: installs PostgreSQL where it can, else skips)

from kalos.sidecar_cuda.serving.objects import cleanup

pytestmark = pytest.mark.timeout(240)
DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
KALOS = Path(sys.executable).parent / "kalos"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    return text.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


class Recipe:
    """The section's commands with the test's directory, port and names."""

    def __init__(self, kpg: str, port: int) -> None:
        self.kpg, self.port = kpg, port
        self.as_server = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self.nodes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.names = {n: unique_name(n) for n in ("node-a", "node-b", "node-c", "node-d", "node-x")}

    def fix(self, text: str) -> str:
        text = text.replace("55432", str(self.port))
        for doc_name, name in self.names.items():
            text = text.replace(f'"{doc_name}"', f'"{name}"').replace(f"--name {doc_name} ", f"--name {name} ")
        return text

    def server_shell(self, script: str) -> subprocess.CompletedProcess[str]:
        """A bash script as the server's user, with the recipe's ``KPG``."""
        return subprocess.run(
            [*self.as_server, "bash", "-e", "-c", f"KPG={shlex.quote(self.kpg)}\n{script}"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def serve(self, line: str, store: str) -> subprocess.Popen[bytes]:
        """One ``kalos serve ... &`` line of the recipe, on free metrics ports, numpy backend."""
        args = shlex.split(self.fix(line).rstrip("& \n"))
        assert args[:2] == ["kalos", "serve"], line
        if "--metrics-port" in args:
            args[args.index("--metrics-port") + 1] = str(free_port())
        env = {**os.environ, "KALOS_STORE": store, "KALOS_BACKEND": "numpy"}
        log = open(os.path.join(self.kpg, f"node-{len(self.nodes)}.log"), "wb")
        proc = subprocess.Popen([str(KALOS), *args[1:]], env=env, stderr=log, stdout=log)
        self.nodes.append((args[args.index("--name") + 1], proc))
        return proc

    def stop(self) -> None:
        for name, proc in self.nodes:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            try:
                cleanup(name, force=True)
            except Exception:
                pass


@pytest.fixture
def recipe(pg_server) -> Iterator[Recipe]:
    if not [d for d in Path("/usr/lib/postgresql").glob("*/bin") if (d / "initdb").exists()]:
        pytest.skip("the recipe finds PostgreSQL under /usr/lib/postgresql/N/bin (Debian's layout)")
    kpg = tempfile.mkdtemp(prefix="kpg", dir="/tmp")  # short: a socket path has ~100 bytes
    if os.geteuid() == 0:
        shutil.chown(kpg, "nobody")
    r = Recipe(kpg, free_port())
    try:
        yield r
    finally:
        r.stop()
        pgbin = max(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda d: int(d.parent.name))
        if os.path.exists(os.path.join(kpg, "data", "postmaster.pid")):
            subprocess.run(
                [*r.as_server, str(pgbin / "pg_ctl"), "-D", os.path.join(kpg, "data"), "-m", "immediate", "stop"],
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(kpg, ignore_errors=True)


def _psql(r: Recipe, sql: str, user: str = "postgres", db: str = "kalos") -> subprocess.CompletedProcess[str]:
    script = (
        'PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)\n"$PGBIN/psql" -h "$KPG/sock" '
        f"-p {r.port} -U {user} -d {db} -v ON_ERROR_STOP=1 <<'SQL'\n{sql}\nSQL\n"
    )
    return r.server_shell(script)


def test_several_nodes_on_one_machine_as_documented(recipe: Recipe) -> None:
    r = recipe
    section = _section("Trying several nodes on one machine")
    server, nodes = _blocks(section, "bash")
    (client,) = _blocks(section, "python")
    # 1. The server, the role and the database (the recipe's first block, verbatim but for KPG).
    assert server.count("KPG=$HOME/kalos-pg") == 1
    out = r.server_shell(r.fix(server.replace("KPG=$HOME/kalos-pg", "true")))
    assert out.returncode == 0, out.stdout + out.stderr
    # 2. Three nodes on the socket URI.
    export = re.search(r'^export KALOS_STORE="(.*)"$', nodes, re.M)
    assert export, nodes
    store = r.fix(export.group(1)).replace("$KPG", r.kpg)
    assert store == f"postgresql://kalos@/kalos?host={r.kpg}/sock&port={r.port}"
    serve_lines = [line for line in nodes.splitlines() if line.startswith("kalos serve ")]
    assert len(serve_lines) == 3
    for line in serve_lines:
        r.serve(line, store)
    # 3. The client block: a write on node a, read on node b with after=.
    run = subprocess.run([sys.executable, "-c", r.fix(client)], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[{'text': 'written on node a'}]"
    for _name, proc in r.nodes:
        assert proc.poll() is None
    logs = "".join(Path(r.kpg, f"node-{i}.log").read_text(errors="replace") for i in range(3))
    assert logs.count("created the kalos schema") == 1, logs[-3000:]

    # 4. Privileges: the documented grants suffice for a node of another role ...
    (grants,) = _blocks(_section("Privileges"), "sql")
    out = _psql(r, grants)
    assert out.returncode == 0, out.stdout + out.stderr
    node_store = store.replace("postgresql://kalos@", "postgresql://kalos_node@")
    r.serve("kalos serve --name node-d --dim 768 --metrics-port 9467 &", node_store)
    check = f"""
import numpy as np
from kalos import RecallClient
v = np.ones(768, np.float32)
with RecallClient({r.names["node-d"]!r}, connect_timeout=30) as d, RecallClient({r.names["node-a"]!r}) as a:
    w = d.upsert([2], v[None], [{{"by": "node_d"}}], namespace="shared")
    got = a.get([1, 2], namespace="shared", after=w.position, timeout=10.0)
    assert got.payloads == [{{"text": "written on node a"}}, {{"by": "node_d"}}], got
    d.touch([2], namespace="shared", ttl=60)
    d.set_default_ttl("shared", 3600)
    assert d.delete([2], namespace="shared") == 1
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr + Path(r.kpg, "node-3.log").read_text()

    # ... a role without them is refused at start, with the database's words, and so is a
    # database that does not exist.
    assert _psql(r, "CREATE ROLE kalos_bare LOGIN;").returncode == 0
    for uri, words in (
        (store.replace("postgresql://kalos@", "postgresql://kalos_bare@"), "permission denied"),
        (store.replace("/kalos?", "/no_such_db?"), 'database "no_such_db" does not exist'),
    ):
        env = {**os.environ, "KALOS_STORE": uri, "KALOS_BACKEND": "numpy"}
        out = subprocess.run(
            [str(KALOS), "serve", "--name", r.names["node-x"], "--dim", "768"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]

    # 5. The recipe's way to stop the server.
    r.stop()
    stop = re.search(r'`("\$PGBIN/pg_ctl" -D "\$KPG/data" stop)`', section)
    assert stop, "the recipe lost its stop command"
    out = r.server_shell("PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)\n" + stop.group(1))
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 30
    while os.path.exists(os.path.join(r.kpg, "data", "postmaster.pid")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(os.path.join(r.kpg, "data", "postmaster.pid"))
