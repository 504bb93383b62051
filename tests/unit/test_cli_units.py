"""The kalos command's pure parts: every option's help and default, one --name for every command,
progress lines, the streaming .npy writer, the /proc socket table, key reading on a terminal."""

from __future__ import annotations

import argparse
import io
import os
import pty
import socket
import struct
import termios

import numpy as np
import pytest

from kalos.broker.errors import ConfigError
from kalos.cli import build_parser
from kalos.progress import RowProgress
from kalos.sidecar_cuda.__main__ import build_parser as sidecar_parser
from kalos.top import Keys, listening_sockets, metrics_url
from kalos.transfer import NpyAppender, check_export_target

pytestmark = pytest.mark.timeout(30)

#: Commands that talk to (or serve) one broker: each takes --name / KALOS_NAME.
BROKER_COMMANDS = ("serve", "cleanup", "namespaces", "export", "import", "top")
#: Required positionals, to parse each command.
POSITIONALS = {"export": ["ns", "out"], "import": ["ns", "src"]}


@pytest.fixture(autouse=True)
def _no_kalos_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults as shipped: a KALOS_* variable of the caller's shell would change them."""
    for var in [v for v in os.environ if v.startswith("KALOS_")]:
        monkeypatch.delenv(var)


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    return [
        ("kalos", top),
        *(("kalos " + n, s) for n, s in _subparsers(top).items()),
        ("python -m kalos.sidecar_cuda", sidecar_parser()),
    ]


def test_every_option_of_every_command_has_help_with_its_default() -> None:
    checked = 0
    for where, p in _parsers():
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            label = f"{where} {'/'.join(a.option_strings) or a.dest}"
            assert a.help, f"{label}: no help text"
            if not a.option_strings:
                continue  # a required positional has no default
            text = fmt._expand_help(a)  # what --help prints, %-expanded
            assert "(default: " in text, f"{label}: help does not show the default: {text!r}"
            d = a.default
            if d is not None and not isinstance(d, bool):
                assert f"(default: {d}" in text, f"{label}: default {d!r} not shown in {text!r}"
            checked += 1
    assert checked >= 60, checked


def test_every_command_parses_and_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    for name in _subparsers(build_parser()):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args([name, "--help"])
        assert exc.value.code == 0
        assert "default:" in capsys.readouterr().out, name


@pytest.mark.parametrize("cmd", BROKER_COMMANDS)
def test_kalos_name_names_the_broker_of_every_command(cmd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KALOS_NAME", "m1")
    argv = [cmd, *POSITIONALS.get(cmd, [])]
    assert build_parser().parse_args(argv).name == "m1"
    assert build_parser().parse_args([*argv, "--name", "m2"]).name == "m2"  # the command line wins
    monkeypatch.delenv("KALOS_NAME")
    assert build_parser().parse_args(argv).name == "default"


def test_name_is_one_option_defined_once() -> None:
    """Every command's --name is the same option: same help, same variable, same default."""
    subs = _subparsers(build_parser())
    helps = set()
    for cmd in BROKER_COMMANDS:
        (action,) = [a for a in subs[cmd]._actions if "--name" in a.option_strings]
        helps.add((action.help, action.default, action.dest))
    assert len(helps) == 1, helps
    assert "KALOS_NAME" in next(iter(helps))[0]


def test_cleanup_takes_the_name_as_argument_or_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KALOS_NAME", "from-env")
    a = build_parser().parse_args(["cleanup"])
    assert (a.broker or a.name) == "from-env"  # the systemd unit: kalos cleanup ${KALOS_NAME}
    a = build_parser().parse_args(["cleanup", "given"])
    assert (a.broker or a.name) == "given"


@pytest.mark.parametrize("raw", ["0", "-1", "soon"])
def test_timeout_must_be_positive_seconds(raw: str) -> None:
    p = build_parser()
    p.exit_on_error = False
    with pytest.raises(SystemExit):
        p.parse_args(["namespaces", "--timeout", raw])


def test_admin_timeouts() -> None:
    p = build_parser()
    assert p.parse_args(["namespaces"]).timeout == 5.0
    assert p.parse_args(["export", "ns", "d"]).timeout is None  # a big export takes what it takes
    assert p.parse_args(["import", "ns", "d", "--timeout", "2.5"]).timeout == 2.5


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_when_not_on_a_terminal() -> None:
    out, clock = io.StringIO(), _Clock()
    with RowProgress("export 'x'", 1000, stream=out, every_s=2.0, clock=clock) as p:
        p.advance(100)  # 0 s since the first line: none
        clock.t += 2.0
        p.advance(300)  # 2 s: a line
        clock.t += 1.0
        p.advance(100)  # 1 s: none
        clock.t += 5.0
        p.advance(500)
    assert out.getvalue().splitlines() == [
        "export 'x': 0 of 1,000 rows (0%)",
        "export 'x': 400 of 1,000 rows (40%)",
        "export 'x': 1,000 of 1,000 rows (100%)",
        "export 'x': 1,000 of 1,000 rows (100%)",
    ]


def test_progress_says_nothing_final_after_an_error() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with RowProgress("import 'x'", None, stream=out) as p:
            p.advance(7)
            raise RuntimeError("boom")
    assert out.getvalue().splitlines() == ["import 'x': 0 rows"]


def test_npy_appender_writes_what_numpy_reads(tmp_path, rng: np.random.Generator) -> None:
    blocks = [rng.standard_normal((int(n), 24), dtype=np.float32) for n in rng.integers(0, 50, 20)]
    ids = [rng.integers(0, 2**62, len(b), dtype=np.int64) for b in blocks]
    with open(tmp_path / "v.npy", "xb") as fv, open(tmp_path / "i.npy", "xb") as fi:
        v, i = NpyAppender(fv, np.dtype(np.float32), (24,)), NpyAppender(fi, np.dtype(np.int64), ())
        for b, j in zip(blocks, ids):
            v.append(b)
            i.append(j)
        v.finish()
        i.finish()
    np.testing.assert_array_equal(np.load(tmp_path / "v.npy"), np.concatenate(blocks))
    np.testing.assert_array_equal(np.load(tmp_path / "i.npy"), np.concatenate(ids))


def test_npy_header_keeps_its_length_for_any_row_count(tmp_path) -> None:
    path = tmp_path / "big.npy"
    with open(path, "xb") as f:
        a = NpyAppender(f, np.dtype(np.float32), (65536,))
        header_len = f.tell()
        a.rows = 10**17  # as if that many rows had been written: only the header is rewritten
        a.finish()
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        assert version == (1, 0)
        shape, _, _ = np.lib.format.read_array_header_1_0(f)
        assert f.tell() == header_len  # the data did not move
    assert shape == (10**17, 65536)


def test_export_target_checks(tmp_path) -> None:
    check_export_target(str(tmp_path / "new"))  # missing: fine, created later
    check_export_target(str(tmp_path))  # empty directory: fine
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_export_target(str(tmp_path / "afile"))
    (tmp_path / "vectors.npy").write_bytes(b"mine")
    with pytest.raises(ConfigError, match="already holds vectors.npy"):
        check_export_target(str(tmp_path))


def _tcp_line(sl: int, ip: str, port: int, state: str, inode: int, v6: bool = False) -> str:
    raw = socket.inet_pton(socket.AF_INET6 if v6 else socket.AF_INET, ip)
    # /proc/net/tcp prints each 32-bit word of the address as a host-order integer
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    hexaddr = "".join(f"{w:08X}" for w in words)
    return (
        f"{sl:4d}: {hexaddr}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 "
        f"00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0"
    )


def test_listening_sockets_of_a_proc_table() -> None:
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
    table = "\n".join(
        [
            head,
            _tcp_line(0, "127.0.0.1", 9464, "0A", 111),
            _tcp_line(1, "0.0.0.0", 19000, "0A", 222),
            _tcp_line(2, "127.0.0.1", 40000, "01", 111),  # established: not a listener
            _tcp_line(3, "10.1.2.3", 8080, "0A", 999),
        ]
    )  # another process's socket
    assert listening_sockets(table, {111, 222}) == [("127.0.0.1", 9464), ("0.0.0.0", 19000)]
    table6 = "\n".join([head, _tcp_line(0, "::", 9500, "0A", 333, v6=True)])
    assert listening_sockets(table6, {333}) == [("::", 9500)]
    assert metrics_url("0.0.0.0", 19000) == "http://127.0.0.1:19000/metrics"
    assert metrics_url("::", 9500) == "http://[::1]:9500/metrics"
    assert metrics_url("10.1.2.3", 80) == "http://10.1.2.3:80/metrics"


def test_keys_reads_a_key_without_enter_and_restores_the_terminal() -> None:
    master, slave = pty.openpty()
    try:
        before = termios.tcgetattr(slave)
        with os.fdopen(os.dup(slave), "r") as stream, Keys(stream) as keys:
            during = termios.tcgetattr(slave)
            assert not during[3] & termios.ICANON  # cbreak: a key arrives without Enter
            assert during[3] & termios.ISIG  # Ctrl-C still interrupts
            assert keys.wait(0.01) == ""
            os.write(master, b"q")
            assert keys.wait(10.0) == "q"
        assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)


def test_keys_off_a_terminal_only_waits() -> None:
    with Keys(io.StringIO()) as keys:
        assert keys.wait(0.0) == ""
