"""sd_notify over a real unix datagram socket (path and abstract address), and its no-op cases."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kalos.sidecar_cuda.serving.notify import sd_notify

pytestmark = pytest.mark.timeout(10)


def test_sends_the_state_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(5)
        assert sd_notify("READY=1\nSTATUS=x", {"NOTIFY_SOCKET": path}) is True
        assert s.recv(4096) == b"READY=1\nSTATUS=x"


def test_sends_to_an_abstract_socket() -> None:
    name = f"kalos-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(5)
        assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name}) is True
        assert s.recv(4096) == b"STOPPING=1"


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "vsock:2:1234"}])
def test_no_socket_is_a_no_op(env: dict[str, str]) -> None:
    assert sd_notify("READY=1", env) is False


def test_a_missing_socket_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False
    assert "sd_notify" in caplog.text
