"""The ``kalos`` command as a new user meets it (issue 22): real sidecars, the CLI in child
processes, stderr read as the user would see it (not a terminal, unless a pty is the point)."""

from __future__ import annotations

import json
import os
import pty
import pwd
import re
import select
import shlex
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, unique_name

from kalos.clients import RecallClient
from kalos.sidecar_cuda.serving.objects import cleanup, leftover_names
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

pytestmark = pytest.mark.timeout(120)
KALOS = [sys.executable, "-m", "kalos.cli"]


def kalos(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KALOS_")}
    full_env.update(env or {})
    return subprocess.run([*KALOS, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    """The command failed with one error line on stderr (after any progress lines) and no
    traceback; returns the line."""
    assert r.returncode != 0, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr, r.stderr
    progress = [line for line in lines[:-1] if re.match(r"(export|import) '[^']*': [\d,]+ ", line)]
    assert lines and len(progress) == len(lines) - 1, r.stderr
    return lines[-1]


# ------------------------------------------------------------------ item 1: --ephemeral vs a data dir
@pytest.mark.parametrize("entry", ["kalos serve", "python -m kalos.sidecar_cuda"])
def test_serve_refuses_ephemeral_beside_a_data_dir(entry: str, tmp_path: Path) -> None:
    name = unique_name("eph")
    kd3 = tmp_path / "kd3"
    if entry == "kalos serve":
        cmd = [*KALOS, "serve", "--name", name, "--data-dir", str(kd3), "--backend", "numpy"]
        env = {"KALOS_EPHEMERAL": "1"}
        want = f"--ephemeral (from KALOS_EPHEMERAL='1') conflicts with --data-dir {kd3} (from the command line)"
    else:
        cmd = [sys.executable, "-m", "kalos.sidecar_cuda", "--name", name, "--ephemeral", "--backend", "numpy"]
        env = {"KALOS_DATA_DIR": str(kd3)}
        want = f"--ephemeral (from the command line) conflicts with --data-dir {kd3} (from KALOS_DATA_DIR='{kd3}')"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    finally:
        cleanup(name, force=True)  # what a sidecar that wrongly started would leave
    assert want in one_line_error(r)
    assert r.returncode == 2
    assert not kd3.exists()


# ------------------------------------------------------------------ item 11: the data dir in words
def _serve_fails(data_dir: Path) -> str:
    name = unique_name("dd")
    try:
        r = kalos("serve", "--name", name, "--data-dir", str(data_dir), "--backend", "numpy", timeout=60)
    finally:
        leftovers = leftover_names(name)
        cleanup(name, force=True)
    # Checked before any shared object exists: nothing was created, so nothing was "unlinked".
    assert "objects unlinked" not in r.stderr and "stopped" not in r.stderr, r.stderr
    assert leftovers == []
    return one_line_error(r)


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a store")
    line = _serve_fails(afile)
    assert f"data dir {afile} exists and is not a directory" in line, line
    assert afile.read_text() == "not a store"


@pytest.mark.skipif(os.geteuid() != 0, reason="chowning a dir to another user needs root")
def test_a_data_dir_of_another_user(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    line = _serve_fails(d)
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert (
        f"data dir {d} is owned by uid {nobody.pw_uid} (nobody) but the sidecar runs as uid "
        f"{os.geteuid()} ({me}); chown it or pick another dir"
    ) in line, line


# ------------------------------------------------------------------ item 8: no sidecar
def _export_dir(tmp_path: Path, dim: int = 8, rows: int = 3) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "vectors.npy", np.ones((rows, dim), np.float32))
    return src


@pytest.mark.parametrize("command", ["namespaces", "export", "import"])
def test_without_a_sidecar_the_timeout_bounds_the_command(command: str, tmp_path: Path) -> None:
    name = unique_name("nosuch")
    args = {"namespaces": [], "export": ["ns", str(tmp_path / "out")], "import": ["ns", str(_export_dir(tmp_path))]}[
        command
    ]
    t0 = time.monotonic()
    r = kalos(command, *args, "--name", name, "--timeout", "1")
    took = time.monotonic() - t0
    print(f"kalos {command} --timeout 1 without a sidecar: {took:.2f} s (interpreter start included)")
    line = one_line_error(r)
    assert f"no sidecar serves broker {name!r}" in line and "waited 1.0 s" in line, line
    # It used to wait the client's 10 s connect timeout whatever --timeout said (10.5 s).
    assert took < 8.0
    assert not (tmp_path / "out").exists()  # a failed export leaves nothing behind


def test_the_suggested_command_works_as_given(tmp_path: Path) -> None:
    name = unique_name("hint")
    line = one_line_error(kalos("namespaces", "--name", name, "--timeout", "0.5"))
    suggested = re.findall(r"`([^`]+)`", line)
    assert suggested, line
    # DIM and METRIC are placeholders the line explains (nothing says what the vectors are).
    assert "--dim DIM --metric METRIC" in suggested[0] and "DIM: the length of your vectors" in line, line
    assert "METRIC: dot, cosine or l2" in line, line
    argv = shlex.split(suggested[0].replace("DIM", "8").replace("METRIC", "cosine"))
    assert argv[:2] == ["kalos", "serve"], argv
    proc = subprocess.Popen(
        [*KALOS, *argv[1:]],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KALOS_")},
    )
    try:
        r = kalos("namespaces", "--name", name, "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == []  # served, and no namespace until one is written
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cleanup(name, force=True)


# ------------------------------------------------------------------ item 9: KALOS_NAME everywhere
def test_kalos_name_names_the_broker_of_admin_commands(sidecar_factory, tmp_path: Path) -> None:
    h = sidecar_factory("envname", "--dim", "8", "--random-rows", "5", "--backend", "numpy")
    env = {"KALOS_NAME": h.name}
    r = kalos("namespaces", "--timeout", "30", env=env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["default\t5"], r.stderr
    r = kalos("export", "default", str(tmp_path / "e"), "--timeout", "30", env=env)
    assert r.returncode == 0, r.stderr
    r = kalos("import", "again", str(tmp_path / "e"), "--timeout", "30", env=env)
    assert r.returncode == 0, r.stderr
    r = kalos("namespaces", "--timeout", "30", env=env)
    assert sorted(r.stdout.splitlines()) == ["again\t5", "default\t5"]


# ------------------------------------------------------------------ item 12: export / import
def test_export_streams_every_page_and_import_reads_it_back(
    sidecar_factory, tmp_path: Path, rng: np.random.Generator
) -> None:
    dim, n = 16, 1000
    h = sidecar_factory("export", "--dim", str(dim), "--max-queries", "8", "--backend", "numpy")
    ids = rng.choice(2**40, size=n, replace=False).astype(np.int64)
    vecs = rng.standard_normal((n, dim), dtype=np.float32)
    payloads = [None if i % 7 == 0 else {"i": int(i), "text": f"ünïcode {i}", "tags": [int(i) % 3]} for i in range(n)]
    with RecallClient(h.name, timeout=30) as c:
        for lo in range(0, n, 8):
            c.upsert(ids[lo : lo + 8], vecs[lo : lo + 8], payloads[lo : lo + 8], namespace="big")

    out = tmp_path / "out"
    r = kalos("export", "big", str(out), "--name", h.name)
    assert r.returncode == 0, r.stderr
    assert f"exported {n} records of 'big'" in r.stdout
    # Not a terminal: progress as lines, the first and the last at least (125 pages of 8 rows).
    progress = [line for line in r.stderr.splitlines() if line.startswith("export 'big': ")]
    assert progress[0] == f"export 'big': 0 of {n:,} rows (0%)", r.stderr
    assert progress[-1] == f"export 'big': {n:,} of {n:,} rows (100%)", r.stderr

    order = np.argsort(ids)  # export is in ascending id order
    got_ids = np.load(out / "ids.npy")
    got_vecs = np.load(out / "vectors.npy")
    assert got_ids.dtype == np.int64 and got_vecs.dtype == np.float32
    np.testing.assert_array_equal(got_ids, ids[order])
    np.testing.assert_array_equal(got_vecs, vecs[order])  # stored float32: exact
    lines = (out / "payloads.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == [payloads[i] for i in order]

    r = kalos("import", "copy", str(out), "--name", h.name)
    assert r.returncode == 0, r.stderr
    assert f"imported {n} records into 'copy'" in r.stdout
    assert f"import 'copy': {n:,} of {n:,} rows (100%)" in r.stderr
    with RecallClient(h.name, timeout=30) as c:
        assert c.count("copy") == n
        for lo in range(0, n, 8):
            rec = c.get(ids[lo : lo + 8], namespace="copy")
            np.testing.assert_array_equal(rec.ids, ids[lo : lo + 8])
            np.testing.assert_array_equal(rec.vectors, vecs[lo : lo + 8])
            assert list(rec.payloads) == payloads[lo : lo + 8]


def test_export_refuses_an_existing_target_before_reading_anything(tmp_path: Path) -> None:
    # No sidecar at all, and a generous --timeout: had the export connected or read first, it
    # would have waited and then said that no sidecar serves the name.
    name = unique_name("target")
    out = tmp_path / "out"
    out.mkdir()
    (out / "vectors.npy").write_bytes(b"an earlier export")
    t0 = time.monotonic()
    line = one_line_error(kalos("export", "ns", str(out), "--name", name, "--timeout", "60"))
    print(f"refused in {time.monotonic() - t0:.2f} s")
    assert f"{out} already holds vectors.npy" in line and "never overwrites" in line, line
    assert (out / "vectors.npy").read_bytes() == b"an earlier export"
    assert sorted(os.listdir(out)) == ["vectors.npy"]
    afile = tmp_path / "afile"
    afile.write_text("mine")
    line = one_line_error(kalos("export", "ns", str(afile), "--name", name, "--timeout", "60"))
    assert f"{afile} exists and is not a directory" in line, line
    assert afile.read_text() == "mine"


def test_export_of_an_unknown_namespace_is_an_empty_export(sidecar_factory, tmp_path: Path) -> None:
    """A namespace never written holds no record: its export succeeds with none (as a recall of
    it answers no hits), not an error."""
    h = sidecar_factory("unknown", "--dim", "8", "--backend", "numpy")
    out = tmp_path / "out"
    r = kalos("export", "nope", str(out), "--name", h.name)
    assert r.returncode == 0, r.stderr
    assert f"exported 0 records of 'nope' to {out}" in r.stdout, r.stdout
    assert np.load(out / "vectors.npy").shape == (0, 8) and np.load(out / "ids.npy").shape == (0,)
    assert (out / "payloads.jsonl").read_text() == ""
    with RecallClient(h.name) as c:
        assert c.namespaces() == {}  # exporting a namespace does not create it


def test_durable_start_up_load_logs_progress(tmp_path: Path, rng: np.random.Generator) -> None:
    name = unique_name("load")
    args = ["--data-dir", str(tmp_path / "data"), "--dim", "8", "--backend", "numpy"]
    proc = start_sidecar_process(args, name)
    try:
        with RecallClient(name, timeout=30) as c:
            for lo in range(0, 96, 32):
                c.upsert(np.arange(lo, lo + 32), rng.standard_normal((32, 8), dtype=np.float32), namespace="kept")
    finally:
        stop_sidecar_process(proc)
    with open(tmp_path / "stderr", "w") as err:
        proc = start_sidecar_process(args, name, stderr=err)
    try:
        with RecallClient(name, timeout=30) as c:
            assert c.count("kept") == 96
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)
    log = (tmp_path / "stderr").read_text()
    assert re.search(r"loading 96 rows in 1 namespaces from .*kalos\.sqlite3", log), log
    assert "loaded 96 rows in 1 namespaces" in log, log  # 'kept' only: no empty 'default' nobody wrote


# ------------------------------------------------------------------ item 13: top
def test_top_finds_the_metrics_endpoint_of_a_name(sidecar_factory) -> None:
    port = free_port()
    h = sidecar_factory("topname", "--dim", "8", "--metrics-port", str(port), "--backend", "numpy")
    r = kalos("top", "--name", h.name, "--once", "--interval", "0.2", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert f"http://127.0.0.1:{port}/metrics" in r.stdout and h.name in r.stdout, r.stdout
    r = kalos("top", "--once", "--interval", "0.2", env={"KALOS_NAME": h.name, "COLUMNS": "200"})
    assert r.returncode == 0 and f":{port}/metrics" in r.stdout, r.stderr


def test_top_says_why_it_cannot_find_an_endpoint(sidecar_factory) -> None:
    h = sidecar_factory("topnone", "--dim", "8", "--backend", "numpy")  # no --metrics-port
    line = one_line_error(kalos("top", "--name", h.name, "--once"))
    assert f"cannot find the metrics endpoint of broker {h.name!r}" in line, line
    assert "listens on no TCP port: start it with --metrics-port PORT" in line and "--url" in line
    line = one_line_error(kalos("top", "--name", unique_name("none"), "--once"))
    assert "no sidecar serves it" in line, line


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    seen = b""
    end = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


def test_q_quits_top_and_restores_the_terminal(sidecar_factory) -> None:
    port = free_port()
    h = sidecar_factory("topq", "--dim", "8", "--metrics-port", str(port), "--backend", "numpy")
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALOS_")}
    proc = subprocess.Popen(
        [*KALOS, "top", "--name", h.name, "--interval", "0.2"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**env, "TERM": "xterm"},
    )
    try:
        seen = _read_until(master, b"READY", timeout=60)
        assert b"READY" in seen, seen[-2000:]
        os.write(master, b"q")
        rc = proc.wait(timeout=60)  # without q it runs until Ctrl-C
        assert rc == 0
        assert termios.tcgetattr(slave) == before  # echo and line mode are back
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


# ------------------------------------------------------------------ errors are one line
@pytest.mark.parametrize("case", ["import-missing", "import-bad-payloads", "top-bad-url"])
def test_cli_errors_are_one_line(case: str, tmp_path: Path) -> None:
    if case == "import-missing":
        r = kalos("import", "ns", str(tmp_path / "nothing"), "--timeout", "5")
        assert "cannot read" in one_line_error(r)
    elif case == "import-bad-payloads":
        src = _export_dir(tmp_path)
        (src / "payloads.jsonl").write_text('{"a": 1}\n')
        r = kalos("import", "ns", str(src), "--timeout", "5")
        assert "1 payloads for 3 vectors" in one_line_error(r)
    else:
        r = kalos("top", "--url", f"http://127.0.0.1:{free_port()}/metrics", "--once")
        assert r.returncode == 1 and "cannot read" in r.stdout and "Traceback" not in r.stderr + r.stdout


def test_an_export_past_its_timeout_stops_and_removes_its_files(sidecar_factory, tmp_path: Path) -> None:
    # 100k pages of 4 rows: far more than half a second of round trips on any machine.
    h = sidecar_factory("slowexp", "--dim", "8", "--max-queries", "4", "--random-rows", "400000", "--backend", "numpy")
    out = tmp_path / "out"
    t0 = time.monotonic()
    line = one_line_error(kalos("export", "default", str(out), "--name", h.name, "--timeout", "0.5"))
    print(f"gave up after {time.monotonic() - t0:.2f} s (interpreter start included)")
    assert "CommandTimeout: not done within --timeout 0.5 s" in line, line
    assert not out.exists()
    with RecallClient(h.name, timeout=30) as c:  # the sidecar is unharmed
        assert c.count("default") == 400_000


# ------------------------------------------------------------------ issue 25: the slot path
def _serve_ready_line(name: str, env: dict[str, str]) -> str:
    """Start ``kalos serve`` with ``env``, return its ready line, stop it."""
    proc = subprocess.Popen(
        [*KALOS, "serve", "--name", name, "--ephemeral", "--dim", "8", "--backend", "numpy"],
        stderr=subprocess.PIPE,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KALOS_")}, **env},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "ready:" in line:
                return line.strip()
        raise AssertionError(f"kalos serve exited ({proc.wait()}) without a ready line")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cleanup(name, force=True)


def test_serve_logs_its_slot_path_and_refuses_two_at_once() -> None:
    from kalos.broker.slotpath import PURE_ENV, REQUIRE_ENV
    from kalos.sidecar_cuda.serving.slotio import load_compiled

    line = _serve_ready_line(unique_name("pypath"), {PURE_ENV: "1"})
    assert "slot path python (KALOS_PURE_PYTHON=1)" in line, line
    try:
        load_compiled()
        built = True
    except ImportError:
        built = False
    if built or os.environ.get(REQUIRE_ENV, "") not in ("", "0"):  # (required: it must be built)
        line = _serve_ready_line(unique_name("cpath"), {REQUIRE_ENV: "1"})
        assert "slot path compiled (the extension is built)" in line, line
    line = one_line_error(
        kalos("serve", "--name", unique_name("both"), "--ephemeral", env={PURE_ENV: "1", REQUIRE_ENV: "1"})
    )
    assert "KALOS_PURE_PYTHON and KALOS_REQUIRE_COMPILED are both set: choose one slot path" in line, line
