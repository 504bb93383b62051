"""What the ``kalos`` command says, as a new user reads it: ``--version``, a "start one" hint
that names --dim and --metric, help without issue numbers, errors that name the option,
``kalos top`` into a pipe, and a ``kalos cleanup`` that fits on a screen."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, unique_name

from kalos import __version__
from kalos.broker.errors import BrokerUnavailable, ConfigError
from kalos.broker.layout import PROTOCOL_VERSION
from kalos.cli import build_parser
from kalos.clients import RecallClient
from kalos.sidecar_cuda.config import ServeConfig
from kalos.sidecar_cuda.serving.objects import cleanup, leftover_names
from kalos.testing.sidecar import start_sidecar_process

pytestmark = pytest.mark.timeout(120)
KALOS = [sys.executable, "-m", "kalos.cli"]
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def kalos(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALOS_") or k == "KALOS_REQUIRE_COMPILED"}
    return subprocess.run(
        [*KALOS, *args], capture_output=True, text=True, timeout=timeout, env={**env, "COLUMNS": "100"}
    )


def test_kalos_version() -> None:
    r = kalos("--version")
    assert r.returncode == 0 and r.stdout == f"kalos {__version__} (protocol {PROTOCOL_VERSION})\n", r
    # The package's version and the installed distribution's (pyproject.toml) are one.
    assert importlib.metadata.version("kalos-recall") == __version__


def test_help_names_no_issue_and_the_data_dir_text_names_store() -> None:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {"kalos": kalos("--help")}
    for cmd in sub.choices:
        helps[f"kalos {cmd}"] = kalos(cmd, "--help")
    helps["python -m kalos.sidecar_cuda"] = subprocess.run(
        [sys.executable, "-m", "kalos.sidecar_cuda", "--help"], capture_output=True, text=True, timeout=60
    )
    for where, r in helps.items():
        assert r.returncode == 0, (where, r.stderr)
        assert not ISSUE.search(r.stdout), f"{where} --help: {ISSUE.search(r.stdout)}"
    serve = " ".join(helps["kalos serve"].stdout.split())
    data_dir = serve[serve.index("--data-dir DATA_DIR") : serve.index("--ephemeral ")]
    assert "--store" in data_dir and "--ephemeral" in data_dir, data_dir


def test_the_start_hint_names_dim_and_metric(tmp_path: Path) -> None:
    name = unique_name("hintdm")
    # Nothing says what the vectors are: placeholders, each explained.
    r = kalos("namespaces", "--name", name, "--timeout", "0.5")
    assert f"`kalos serve --name {name} --ephemeral --dim DIM --metric METRIC`" in r.stderr, r.stderr
    assert "DIM: the length of your vectors" in r.stderr and "METRIC: dot, cosine or l2" in r.stderr
    with pytest.raises(BrokerUnavailable) as e:
        RecallClient(name, connect_timeout=0.2, reconnect=False)
    assert "--dim DIM --metric METRIC" in str(e.value) and "DIM the length of your vectors" in str(e.value)
    # An import knows its export's dim and metric: the hint is the command to run.
    src = tmp_path / "exp"
    src.mkdir()
    np.save(src / "vectors.npy", np.ones((2, 24), np.float32))
    (src / "manifest.json").write_text(
        '{"format": "kalos-export", "version": 2, "dim": 24, "metric": "cosine", '
        '"namespaces": [{"name": "n", "dir": ".", "records": 2, "default_ttl_ns": null}]}'
    )
    r = kalos("import", str(src), "--name", name, "--timeout", "0.5")
    assert f"`kalos serve --name {name} --ephemeral --dim 24 --metric cosine`" in r.stderr, r.stderr
    assert "DIM:" not in r.stderr and "METRIC:" not in r.stderr


@pytest.mark.parametrize(
    ("field", "flag", "value"),
    [("slots", "--slots", 0), ("slots", "--slots", 5000), ("max_k", "--max-k", 0), ("blob_bytes", "--blob-bytes", 5)],
)
def test_a_geometry_error_names_the_option(field: str, flag: str, value: int) -> None:
    with pytest.raises(ConfigError) as e:
        ServeConfig(**{field: value}).layout()  # type: ignore[arg-type]
    assert str(e.value).startswith(f"{flag} must be an integer in ["), e.value
    assert "n_slots" not in str(e.value)


def test_serve_says_slots_not_n_slots() -> None:
    r = kalos("serve", "--ephemeral", "--slots", "0", "--backend", "numpy", "--name", unique_name("sl"))
    assert r.returncode == 2 and "ConfigError: --slots must be an integer in [1, 4096], got 0" in r.stderr, r.stderr


def test_top_into_a_pipe_prints_frames(sidecar_factory) -> None:
    port = free_port()
    h = sidecar_factory("toppipe", "--dim", "8", "--metrics-port", str(port), "--backend", "numpy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KALOS_")}
    proc = subprocess.Popen(
        [*KALOS, "top", "--name", h.name, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "COLUMNS": "120"},
        # Ctrl-C as a terminal delivers it: a suite started in the background (nohup ... &)
        # ignores SIGINT, its children inherit that, and Python then installs no handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = b""
    try:
        assert proc.stdout is not None
        end = time.monotonic() + 60
        while seen.count(b"kalos top  http://") < 2 and time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
        assert seen.count(b"kalos top  http://") >= 2, (seen, proc.poll())
        assert f":{port}/metrics".encode() in seen and b"\x1b[" not in seen  # plain text, no cursor moves
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)  # (read on: a full pipe would block its last write and flush)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The reader closing the pipe ends it quietly.
    r = subprocess.run(
        f"{' '.join(KALOS)} top --name {h.name} --interval 0.1 | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2 and "Traceback" not in r.stderr, r


def _leave_objects(name: str) -> None:
    proc = start_sidecar_process(["--ephemeral", "--dim", "8", "--slots", "64", "--backend", "numpy"], name)
    proc.kill()  # kill -9: every object stays
    proc.wait()
    assert len(leftover_names(name)) == 131


def test_cleanup_prints_a_summary_and_lists_on_verbose() -> None:
    name = unique_name("clean")
    try:
        _leave_objects(name)
        r = kalos("cleanup", name)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [
            f"removed what was left of broker {name!r}: its shared memory, lease file, doorbell, "
            "128 slot semaphores (131 objects; --verbose lists them)"
        ], r.stdout
        assert not leftover_names(name)
        r = kalos("cleanup", name)
        assert r.stdout.splitlines() == [f"nothing left of broker {name!r}"]
        _leave_objects(name)
        r = kalos("cleanup", name, "--verbose")
        lines = r.stdout.splitlines()
        assert len(lines) == 132 and lines[0].startswith("removed /") and "131 objects" in lines[-1], lines[:3]
    finally:
        cleanup(name, force=True)
