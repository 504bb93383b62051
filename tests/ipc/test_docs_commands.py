"""The commands the docs give, run as written (issue 33, items 6, 10 and 12), as
tests/ipc/test_readme_quickstart.py does for the quick start:

* docs/backup.md: both SQLite online backups while a sidecar serves and writes, and the restore:
  a sidecar on the restored directory serves every record with its timestamps and TTL;
* clients/c/README.md: the build, the example's run and the line that links a program;
* the install commands of README.md, docs/ and clients/c/README.md: a checkout's path or a wheel,
  never the name (Kalos is not on PyPI), extras that exist, and the form pip accepts;
* the Makefile: ``make demo`` installs the package alone, ``make test`` the dev extra, neither
  again after the other (a fake Python records what pip is asked);
* ``kalos demo`` imports nothing that install does not bring, and says what its figures mean.

What a test changes is said where it does: broker names, directories, dims (never a command's form).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from kalos import RecallClient

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
KALOS = Path(sys.executable).parent / "kalos"
#: Tests of packaging and of the Makefile: the same whichever slot path runs, so not again in
#: `make test`'s second pass over tests/ipc with KALOS_PURE_PYTHON=1.
once = pytest.mark.skipif(
    os.environ.get("KALOS_PURE_PYTHON") == "1", reason="slot-path independent: run in the first pass"
)


def _blocks(text: str, lang: str = "bash") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _section(path: Path, title: str) -> str:
    return path.read_text(encoding="utf-8").split(title, 1)[1].split("\n## ", 1)[0]


# --------------------------------------------------------------------------- docs/backup.md, SQLite
def test_sqlite_online_backups_and_restore_as_documented(sidecar_factory, tmp_path: Path) -> None:
    """Both backups are taken while the sidecar serves and a writer keeps writing; each restored
    copy, served by a new sidecar, holds every record written before the backup began (vectors,
    payloads, timestamps, TTLs, default TTLs) and a consistent part of what came during it."""
    section = _section(ROOT / "docs" / "backup.md", "## SQLite")
    shell, python, restore = _blocks(section)
    serve = next(line for line in restore.splitlines() if line.startswith("kalos serve "))
    data = tmp_path / "kalos-data"
    dim = "16"  # the one change to the restore's serve line: the test's dim (and broker name)
    h = sidecar_factory("bk", "--dim", dim, "--backend", "numpy", "--data-dir", str(data), ephemeral=False)
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((400, int(dim)), dtype=np.float32)
    with RecallClient(h.name) as c:
        c.set_default_ttl("notes", 7200)
        c.upsert(np.arange(300), vecs[:300], [{"i": i} for i in range(300)], namespace="notes")
        c.upsert(np.arange(300, 400), vecs[300:], namespace="forever", ttl=[None, 600.0] * 50)
        want = c.get(np.arange(300), namespace="notes"), c.get(np.arange(300, 400), namespace="forever")

    copies = []
    written = [0]  # ids 0..n-1 of namespace "busy", acknowledged in order, across both backups
    for name, script in (("VACUUM INTO", shell), ("Python's backup API", python)):
        if name == "VACUUM INTO" and shutil.which("sqlite3") is None:
            continue
        stop = threading.Event()

        def write_on() -> None:  # acknowledged upserts of one id after another during the backup
            with RecallClient(h.name) as w:
                while not stop.is_set():
                    w.upsert([written[0]], vecs[:1], [{"n": written[0]}], namespace="busy")
                    written[0] += 1

        writer = threading.Thread(target=write_on)
        writer.start()
        try:
            out = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        finally:
            stop.set()
            writer.join()
        assert out.returncode == 0, f"{name}: {out.stderr}"
        assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout
        backup = tmp_path / "kalos-backup.sqlite3"
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600  # umask 077
        copies.append((name, backup.rename(tmp_path / f"copy-{len(copies)}.sqlite3"), written[0]))
    assert copies

    for i, (name, copy, acknowledged) in enumerate(copies):
        # The restore block, verbatim, from a directory where the backup has the documented name.
        where = tmp_path / f"restore-{i}"
        where.mkdir()
        shutil.copy(copy, where / "kalos-backup.sqlite3")
        setup = "\n".join(line for line in restore.splitlines() if not line.startswith("kalos serve "))
        out = subprocess.run(["bash", "-e", "-c", setup], cwd=where, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        restored = where / "kalos-restored"
        assert stat.S_IMODE(restored.stat().st_mode) == 0o700
        assert stat.S_IMODE((restored / "kalos.sqlite3").stat().st_mode) == 0o600
        args = shlex.split(serve)[2:]
        args[args.index("--dim") + 1] = dim
        args[args.index("--data-dir") + 1] = str(restored)
        args.remove("--name")
        args.remove("default")
        r = sidecar_factory("restored", *args, "--backend", "numpy", ephemeral=False)
        with RecallClient(r.name) as c:
            got = c.get(np.arange(300), namespace="notes"), c.get(np.arange(300, 400), namespace="forever")
            for b, a in zip(want, got):
                np.testing.assert_array_equal(a.ids, b.ids)
                np.testing.assert_array_equal(a.vectors, b.vectors)
                assert a.payloads == b.payloads
                for field in ("created_at", "updated_at", "expires_at"):
                    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            # A consistent state: ids 0..n-1 of the writer, n at most what it had written when
            # the backup ended (each upsert acknowledged before the next was sent).
            busy = c.count("busy") if "busy" in c.namespaces() else 0
            assert busy <= acknowledged, name
            assert busy == 0 or c.get(np.arange(busy), namespace="busy").missing.size == 0
            c.upsert([1000], vecs[:1], namespace="notes")  # the default TTL came back with the store
            assert np.isfinite(c.get([1000], namespace="notes").expires_at).all()
        r.stop()


# --------------------------------------------------------------------------- clients/c/README.md
@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None, reason="no make or cc")
def test_c_client_readme_commands(sidecar_factory, tmp_path: Path) -> None:
    text = (ROOT / "clients" / "c" / "README.md").read_text(encoding="utf-8")
    build, run, link = _blocks(text)
    # The build, into a directory of the test's (O=..., as the README's comment says) and not
    # into the checkout.
    make = shlex.split(build.splitlines()[0].split("#")[0])
    assert make == ["make", "-C", "clients/c"]
    out = subprocess.run([*make, f"O={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for f in ("libkalos.a", "libkalos.so", "example", "driver"):
        assert (tmp_path / f).is_file(), f
    # The run: a sidecar as the README starts it (the test's broker name), then the example.
    serve, example = (line.split("#")[0].strip() for line in run.strip().splitlines())
    assert serve == "kalos serve --name demo --dim 64 --ephemeral &"
    assert example == "clients/c/build/example demo"
    h = sidecar_factory("creadme", "--dim", "64", "--backend", "numpy")
    got = subprocess.run([str(tmp_path / "example"), h.name], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert lines[0] == "metric dot dim 64" and len(lines) == 6
    scores = [float(line.split()[1]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True)
    # Linking a program of one's own: the README's line, with example.c as the program.
    line = link.strip().replace("clients/c/build/", f"{tmp_path}/").replace("your_program.c", "clients/c/example.c")
    line = line.replace("-o your_program", f"-o {tmp_path / 'mine'}")
    out = subprocess.run(shlex.split(line), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    again = subprocess.run([str(tmp_path / "mine"), h.name], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == got.stdout


# --------------------------------------------------------------------------- pip install lines
_DOCS = [ROOT / "README.md", ROOT / "clients" / "c" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PIP = re.compile(r"pip install ((?:-e |-q |--no-deps )*)(['\"]?)([^\s'\"`]+)\2")


def _pip_targets() -> list[tuple[Path, str, str]]:
    """(doc, target, its extras) of every `pip install X` the docs give (not the `build` tool)."""
    out = []
    for doc in _DOCS:
        for m in _PIP.finditer(doc.read_text(encoding="utf-8")):
            target = m.group(3)
            if target in ("build", "-r"):
                continue
            extras = target.split("[", 1)[1].rstrip("]") if "[" in target else ""
            out.append((doc, target, extras))
    return out


@once
def test_install_commands_name_a_checkout_or_a_wheel_and_real_extras(tmp_path: Path) -> None:
    extras = set(metadata.metadata("kalos-recall").get_all("Provides-Extra") or [])
    assert {"cuda12", "postgres", "langchain", "dev"} <= extras, extras
    found = _pip_targets()
    assert len(found) >= 10, found
    named = set()
    for doc, target, ex in found:
        base = target.split("[", 1)[0]
        # Kalos is not on PyPI: a path (., ./kalos, /src, ...) or a wheel file, never the name.
        assert base.startswith((".", "/")) or base.endswith(".whl") or base.startswith("dist/"), (doc, target)
        for e in filter(None, ex.split(",")):
            assert e in extras, (doc, target, e)
            named.add(e)
    # pip takes a checkout's path with extras in brackets (the form every doc uses): a dry run
    # on a copy of the tracked files, nothing installed, no index asked.
    src = tmp_path / "kalos"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    tar = subprocess.run(["tar", "-c", "--null", "-T", "-", "-f", "-"], cwd=ROOT, input=files, capture_output=True)
    src.mkdir()
    subprocess.run(["tar", "-x", "-f", "-"], cwd=src, input=tar.stdout, check=True)
    report = tmp_path / "report.json"
    spec = f"./kalos[{','.join(sorted(named))}]"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-q", "--report", str(report), spec],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "kalos-recall"
    assert sorted(item["requested_extras"]) == sorted(named)


# --------------------------------------------------------------------------- the Makefile's installs
_FAKE_PY = """#!/bin/sh
# A stand-in Python: `-m venv DIR` makes DIR/bin/{python,kalos,ruff,mypy} (this script); every
# call is logged as one line (program name and arguments).
echo "$(basename "$0") $*" >> "$MAKE_LOG"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"
    for p in python kalos ruff mypy; do cp "$0" "$3/bin/$p"; done
fi
exit 0
"""


def _make(where: Path, target: str, log: Path) -> list[str]:
    """``make TARGET`` in ``where`` with the fake Python; the lines logged by this run."""
    before = log.read_text().splitlines() if log.exists() else []
    env = {**os.environ, "MAKE_LOG": str(log), "MAKEFLAGS": ""}
    out = subprocess.run(
        ["make", "--no-print-directory", target, f"PY={where / 'fakepy'}"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return log.read_text().splitlines()[len(before) :]


def _pips(lines: list[str]) -> list[str]:
    return [line for line in lines if "-m pip install" in line]


@once
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("first", ["demo", "test"])
def test_make_demo_installs_the_package_alone_and_neither_target_reinstalls(tmp_path: Path, first: str) -> None:
    """The Makefile in a scratch directory (the files it names, empty), with a Python that only
    records what it is asked: what ``make demo`` and ``make test`` install, in either order."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for f in (
        "pyproject.toml",
        "setup.py",
        "broker/kalos_protocol.h",
        "clients/_cslot.c",
        "sidecar_cuda/serving/_cserve.c",
    ):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
        os.utime(tmp_path / f, (1e9, 1e9))  # older than anything make will touch
    fake = tmp_path / "fakepy"
    fake.write_text(_FAKE_PY)
    fake.chmod(0o755)
    log = tmp_path / "make.log"
    demo_only = "python -m pip install -q -e ."
    dev = "python -m pip install -q -e .[dev]"
    other = "test" if first == "demo" else "demo"

    ran = _make(tmp_path, first, log)
    assert ran[0].endswith("-m venv .venv") and _pips(ran)[0] == "python -m pip install -q --upgrade pip setuptools>=77"
    assert _pips(ran)[1:] == [demo_only if first == "demo" else dev]
    assert ("kalos demo" in ran) == (first == "demo")

    ran = _make(tmp_path, other, log)
    assert not any("-m venv" in line for line in ran)
    # After the demo, the tests add the dev extra once; after the tests, the demo installs nothing.
    assert _pips(ran) == ([dev] if other == "test" else [])
    for target in ("demo", "test"):
        assert _pips(_make(tmp_path, target, log)) == []

    # A .venv made before the demo had its own stamp (only the dev install's): nothing either.
    (tmp_path / ".venv" / ".installed-demo").unlink()
    assert _pips(_make(tmp_path, "demo", log)) == []


# --------------------------------------------------------------------------- kalos demo
_AUDIT = """import os, sys
_seen = set()
def _hook(event, args):
    if event == "import":
        top = args[0].partition(".")[0]
        if top not in _seen:
            _seen.add(top)
            with open(os.environ["KALOS_IMPORT_LOG"], "a") as f:
                f.write(top + "\\n")
sys.addaudithook(_hook)
"""


def _base_distributions() -> set[str]:
    """kalos-recall and everything its requirements (no extra) bring, recursively, by the names
    ``importlib.metadata`` gives; plus setuptools and pip, which ``make demo`` puts in the venv."""
    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[str] = set()
    todo = ["kalos-recall"]
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen | {"setuptools", "pip"}


@once
def test_kalos_demo_imports_what_its_install_brings_and_explains_its_figures(tmp_path: Path) -> None:
    """``kalos demo`` (small: its own options) in every process it starts (the CLI, the sidecar,
    the load generator's workers): each module imported comes from the standard library, Kalos,
    or a distribution ``pip install .`` installs (no extra), which is what ``make demo`` installs."""
    (tmp_path / "sitecustomize.py").write_text(_AUDIT)
    log = tmp_path / "imports.txt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "KALOS_IMPORT_LOG": str(log),
        "COLUMNS": "200",
    }
    args = ["demo", "--rows", "3000", "--seconds", "0.6", "--agents", "4", "--procs", "2", "--backend", "numpy"]
    out = subprocess.run([str(KALOS), *args], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = " ".join(out.stdout.split())  # (the console wraps lines; words are what count)
    for words in (
        "1. What it is for",
        "a toy hashing of words",
        "not a language model",
        "examples/agent_memory.py",
        "2. Recall under load",
        "Kalos, 1 agent",
        "Kalos, 4 agents / 2 processes",
        "numpy in-process, 4 queries/call",
        "What the columns say",
        "round trip to another process",
        "Reading the rows side by side",
        "0 wrong",
    ):
        assert words in text, (words, text)
    assert "When is my dentist appointment?" in text and "The dentist appointment was moved" in text
    assert "errors; " in text and " 0 errors" in text

    tops = set(log.read_text().split())
    owners = metadata.packages_distributions()
    allowed = _base_distributions()
    stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"sitecustomize", "__main__"}
    outside = {}
    for top in sorted(tops - stdlib):
        if top == "kalos" or importlib.util.find_spec(top) is None:  # (an attempt that failed: org.python, ...)
            continue
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(top, [])}
        if not dists & allowed:
            outside[top] = sorted(dists) or ["(no distribution)"]
    assert not outside, f"kalos demo imports what `pip install .` does not bring: {outside}"


# --------------------------------------------------------------------------- docs/metric.md
def test_a_data_dir_keeps_its_metric_as_documented(tmp_path: Path) -> None:
    """The guide's refusal, word for word: a data dir made with dot, then a sidecar with cosine."""
    text = (ROOT / "docs" / "metric.md").read_text(encoding="utf-8")
    (message,) = _blocks(text.split("## The choice is kept with the data", 1)[1], "")
    name = f"t{os.getpid()}-metric"
    first = subprocess.Popen(
        [str(KALOS), "serve", "--name", name, "--dim", "8", "--backend", "numpy", "--data-dir", "kalos-data"],
        cwd=tmp_path,
        stderr=subprocess.DEVNULL,
    )
    try:
        RecallClient(name, connect_timeout=30).close()  # it serves: the store exists
    finally:
        first.terminate()
        first.wait(timeout=30)
    out = subprocess.run(
        [str(KALOS), "serve", "--name", name, "--dim", "8", "--backend", "numpy", "--data-dir", "kalos-data"]
        + ["--metric", "cosine"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message.strip() in out.stderr, out.stderr
