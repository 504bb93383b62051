"""One data dir, one sidecar: a second sidecar on a directory another serves is refused with an
error naming the directory and the holder, and a sidecar killed with kill -9 leaves nothing that
blocks its restart (sidecar_cuda.storage.datadir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import unique_name

from kalos.broker.errors import ConfigError
from kalos.clients import RecallClient
from kalos.sidecar_cuda.serving.objects import cleanup, leftover_names
from kalos.sidecar_cuda.storage.datadir import LOCK_FILE, DataDirInUse, lock_data_dir
from kalos.testing.sidecar import running_sidecar, start_sidecar_process, stop_sidecar_process

pytestmark = pytest.mark.timeout(120)
SERVE = [sys.executable, "-m", "kalos.cli", "serve", "--dim", "8", "--backend", "numpy"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KALOS_") or k == "KALOS_REQUIRE_COMPILED"}


def test_a_second_sidecar_on_a_served_data_dir_is_refused_naming_the_dir_and_the_holder(tmp_path: Path) -> None:
    first, second = unique_name("dirA"), unique_name("dirB")
    data = tmp_path / "kalos-data"
    proc = start_sidecar_process(["--data-dir", str(data), "--dim", "8", "--backend", "numpy"], first)
    try:
        with RecallClient(first, timeout=30) as c:
            c.upsert([777], np.ones((1, 8), np.float32), [{"who": "via first"}])
        # The same directory under another spelling (relative, through a symlink): one inode, one lock.
        (tmp_path / "link").symlink_to(data)
        for spelling, cwd in ((str(tmp_path / "link"), None), ("./kalos-data", str(tmp_path))):
            r = subprocess.run(
                [*SERVE, "--name", second, "--data-dir", spelling],
                capture_output=True,
                text=True,
                timeout=90,
                env=_env(),
                cwd=cwd,
            )
            assert r.returncode == 2, r.stderr
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
            line = lines[0]
            assert line.startswith(f"kalos serve: DataDirInUse: data dir {spelling} is in use by "), line
            assert f"the sidecar of broker {first!r} (pid {proc.pid} on host {os.uname().nodename}" in line, line
            assert "another --data-dir" in line, line
            assert not leftover_names(second)  # refused before any shared object was made
        # The first serves on, its store untouched by the refused one.
        with RecallClient(first, timeout=30) as c:
            assert c.get([777]).payloads == [{"who": "via first"}]
    finally:
        stop_sidecar_process(proc)
        cleanup(first, force=True)
        cleanup(second, force=True)
    # Stopped: the directory is free again, for any broker name.
    with running_sidecar(["--data-dir", str(data), "--dim", "8", "--backend", "numpy"], second):
        with RecallClient(second, timeout=30) as c:
            assert c.get([777]).payloads == [{"who": "via first"}]


def test_a_sidecar_killed_with_kill_9_restarts_on_its_data_dir(tmp_path: Path) -> None:
    name = unique_name("dir9")
    args = ["--data-dir", str(tmp_path / "d"), "--dim", "8", "--backend", "numpy"]
    proc = start_sidecar_process(args, name)
    try:
        with RecallClient(name, timeout=30) as c:
            c.upsert([1, 2], np.ones((2, 8), np.float32), namespace="kept")
        proc.kill()  # kill -9: no close(), no unlock; the kernel drops the flock
        proc.wait()
        assert (tmp_path / "d" / LOCK_FILE).exists()  # the file stays; its lock did not
        proc = start_sidecar_process(args, name)
        with RecallClient(name, timeout=30) as c:
            assert c.count("kept") == 2
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)


def test_the_lock_is_refused_in_the_same_process_and_free_after_release(tmp_path: Path) -> None:
    d = str(tmp_path)
    with lock_data_dir(d, "kalos import") as held:
        assert os.stat(held.path).st_mode & 0o777 == 0o600
        with pytest.raises(DataDirInUse, match=rf"data dir {d} is in use by kalos import \(pid {os.getpid()} "):
            lock_data_dir(d, "sidecar", "other")
        assert isinstance(DataDirInUse("x"), ConfigError)
    with lock_data_dir(d, "sidecar", "other") as again:
        assert again.held
    assert not again.held
    assert (tmp_path / LOCK_FILE).read_text() == ""  # no stale holder for the next reader
