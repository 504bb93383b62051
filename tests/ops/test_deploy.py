"""deploy/ checked by the tools that consume it, offline: the systemd unit (systemd-analyze, and a
real sidecar notifying a real socket), the Kubernetes manifests (kubectl kustomize, validated
against the Kubernetes API models), the Containerfile, the shm sizing script."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients._transport import Connection
from sidecar_cuda.__main__ import build_parser
from sidecar_cuda.config import env_var
from sidecar_cuda.objects import cleanup

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "kalos-sidecar.service"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------- systemd
def _unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file, continuation lines joined, comments dropped."""
    out: list[tuple[str, str, str]] = []
    section, pending = "", ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def test_systemd_unit_verifies() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    r = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True,
                       timeout=60)
    out = r.stdout + r.stderr
    problems = [ln for ln in out.splitlines()
                if any(w in ln.lower() for w in ("unknown", "ignoring", "not executable", "failed",
                                                 "invalid"))]
    assert r.returncode == 0 and not problems, out


def test_systemd_unit_settings() -> None:
    entries = _unit_entries(UNIT.read_text())
    svc = {}
    for section, key, value in entries:
        if section == "Service":
            svc.setdefault(key, []).append(value)
    one = {k: v[-1] for k, v in svc.items()}
    # A pip-installed kalos: no checkout path, options from the environment.
    assert one["ExecStart"] == "/usr/bin/env kalos serve"
    assert not any("/opt/" in value or ".venv" in value for _, _, value in entries)
    assert one["Type"] == "notify"
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                       ("ProtectHome", "yes"), ("StateDirectoryMode", "0700"),
                       ("RuntimeDirectoryMode", "0700")]:
        assert one.get(key) == value, key
    assert one.get("StateDirectory") and one.get("RuntimeDirectory")
    # /dev/shm must stay the host's: each of these would hide or delete the broker's objects.
    assert one.get("PrivateDevices", "no") == "no"
    assert one.get("RemoveIPC", "no") == "no"
    assert "DynamicUser" not in one or one["DynamicUser"] == "no"
    # Every KALOS_* variable set there is a real serve option.
    options = {env_var(s) for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    env_vars = [v.split("=", 1)[0] for v in svc["Environment"]]
    kalos_vars = [v for v in env_vars if v.startswith("KALOS_")]
    assert {"KALOS_NAME", "KALOS_DATA_DIR"} <= set(kalos_vars)
    assert set(kalos_vars) <= options, set(kalos_vars) - options
    assert one["Environment"] and svc["EnvironmentFile"]


def test_sidecar_notifies_ready_and_stopping_to_a_real_socket(tmp_path: Path) -> None:
    """A real sidecar configured only by KALOS_* variables sends READY=1 once its segment says
    READY (a client attaching at that moment finds it ready) and STOPPING=1 on SIGTERM."""
    name = f"t{os.getpid()}-notify"
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "KALOS_NAME": name, "KALOS_DIM": "16",
           "KALOS_EPHEMERAL": "1", "KALOS_BACKEND": "numpy", "KALOS_SLOTS": "4",
           "KALOS_RANDOM_ROWS": "1000"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar_cuda"], env=env)
    try:
        msg = sock.recv(4096).decode()
        assert msg.splitlines()[0] == "READY=1", msg
        c = Connection(name, sidecar_uid=os.geteuid())
        try:
            assert c.is_ready()
            assert int(c.seg.header["sidecar_pid"]) == proc.pid
            assert int(c.seg.header["dim"]) == 16 and int(c.seg.header["n_slots"]) == 4
        finally:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert proc.wait(timeout=30) == 0
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cleanup(name)
