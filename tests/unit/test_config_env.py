"""Serve options from KALOS_* environment variables (sidecar_cuda.config.add_serve_arguments)."""

from __future__ import annotations

import argparse

import pytest

from kalos.broker.errors import ConfigError
from kalos.sidecar_cuda.config import (
    Origin,
    ServeConfig,
    Source,
    add_serve_arguments,
    config_from_args,
    env_var,
    origin,
)

pytestmark = pytest.mark.timeout(10)


def _parser(env: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_serve_arguments(p, environ=env)
    return p


def _config(env: dict[str, str], argv: list[str] | None = None) -> ServeConfig:
    return config_from_args(_parser(env).parse_args(argv or []))


def _long_options(p: argparse.ArgumentParser) -> list[str]:
    return [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def test_env_var_names() -> None:
    assert env_var("--data-dir") == "KALOS_DATA_DIR"
    assert env_var("--max-k") == "KALOS_MAX_K"


def test_every_option_is_named_in_help() -> None:
    p = _parser({})
    text = p.format_help()
    opts = _long_options(p)
    assert len(opts) >= 20
    for o in opts:
        assert env_var(o) in text, o


def test_environment_fills_the_config_with_converted_types() -> None:
    env = {
        "KALOS_NAME": "agents",
        "KALOS_DIM": "768",
        "KALOS_SLOTS": "256",
        "KALOS_DTYPE": "float16",
        "KALOS_DATA_DIR": "/var/lib/kalos/agents",
        "KALOS_METRICS_PORT": "9464",
        "KALOS_METRICS_HOST": "0.0.0.0",
        "KALOS_SPIN_US": "12.5",
        "KALOS_SHM_MODE": "0660",
        "KALOS_BACKEND": "numpy",
        "KALOS_PIPELINE": "off",
        "KALOS_METRIC": "cosine",
    }
    cfg = _config(env)
    assert (cfg.name, cfg.dim, cfg.slots, cfg.storage_dtype) == ("agents", 768, 256, "float16")
    assert cfg.data_dir == "/var/lib/kalos/agents" and cfg.metrics_port == 9464
    assert cfg.metrics_host == "0.0.0.0" and cfg.spin_us == 12.5 and isinstance(cfg.spin_us, float)
    assert cfg.shm_mode == 0o660 and cfg.backend == "numpy" and cfg.pipeline == "off"
    assert cfg.metric == "cosine"


def test_every_integer_option_is_converted_from_the_environment() -> None:
    p = _parser({})
    int_dests = [a.dest for a in p._actions if isinstance(a.default, int) and not isinstance(a.default, bool)]
    assert {"dim", "slots", "max_k", "shards", "metrics_port"} <= set(int_dests)
    env = {env_var("--" + d.replace("_", "-")): "7" for d in int_dests}
    ns = _parser(env).parse_args([])
    for d in int_dests:
        assert getattr(ns, d) == 7, d


def test_command_line_wins_over_environment() -> None:
    cfg = _config({"KALOS_DIM": "768", "KALOS_NAME": "env"}, ["--dim", "64", "--name", "cli", "--ephemeral"])
    assert (cfg.dim, cfg.name) == (64, "cli")


def test_a_bad_variable_is_ignored_when_the_option_is_given() -> None:
    cfg = _config({"KALOS_DIM": "lots"}, ["--dim", "64", "--ephemeral"])
    assert cfg.dim == 64


@pytest.mark.parametrize(
    "raw, expected",
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("off", False)],
)
def test_ephemeral_flag_from_environment(raw: str, expected: bool) -> None:
    ns = _parser({"KALOS_EPHEMERAL": raw}).parse_args([])
    assert ns.ephemeral is expected
    assert _parser({"KALOS_EPHEMERAL": raw}).parse_args(["--ephemeral"]).ephemeral is True


def test_ephemeral_off_still_needs_a_data_dir() -> None:
    with pytest.raises(ConfigError):
        _config({"KALOS_EPHEMERAL": "0"})
    assert _config({"KALOS_EPHEMERAL": "1"}).data_dir is None


def test_empty_variable_is_unset() -> None:
    cfg = _config({"KALOS_DIM": "", "KALOS_EPHEMERAL": "1", "KALOS_METRICS_PORT": ""})
    assert cfg.dim == 128 and cfg.metrics_port is None


@pytest.mark.parametrize(
    "var, raw, needle",
    [
        ("KALOS_DIM", "abc", "is not an integer"),
        ("KALOS_SPIN_US", "fast", "is not a number"),
        ("KALOS_BACKEND", "gpu", "choose from auto, numpy, cuda"),
        ("KALOS_SHM_MODE", "0644", "choose from 0600, 0660"),
        ("KALOS_EPHEMERAL", "maybe", "is not 1/true/yes/on or 0/false/no/off"),
    ],
)
def test_bad_value_names_the_variable(var: str, raw: str, needle: str) -> None:
    with pytest.raises(argparse.ArgumentError) as exc:
        _parser({var: raw, "KALOS_DATA_DIR": "/x"}).parse_args([])
    msg = str(exc.value)
    assert f"{var}={raw!r}" in msg and needle in msg


def test_bad_value_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="t")
    add_serve_arguments(p, environ={"KALOS_SLOTS": "-x"})
    with pytest.raises(SystemExit) as exc:
        p.parse_args([])
    assert exc.value.code == 2
    assert "KALOS_SLOTS='-x' is not an integer" in capsys.readouterr().err


def test_command_line_values_are_still_checked() -> None:
    with pytest.raises(argparse.ArgumentError):
        _parser({}).parse_args(["--dim", "x"])
    with pytest.raises(argparse.ArgumentError):
        _parser({}).parse_args(["--backend", "gpu"])


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KALOS_MAX_K", "16")
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--ephemeral"]).max_k == 16


def test_devices_shards_and_the_single_device_alias() -> None:
    cfg = _config({"KALOS_DEVICES": "0,1", "KALOS_SHARDS": "4"}, ["--ephemeral"])
    assert (cfg.devices, cfg.shards) == ("0,1", 4)
    assert _config({}, ["--ephemeral"]).devices == "all"
    assert _config({"KALOS_DEVICE": "1"}, ["--ephemeral"]).devices == "1"  # --device N: --devices N
    assert _config({}, ["--ephemeral", "--device", "0", "--devices", "all"]).devices == "0"
    assert _config({}, ["--ephemeral", "--random-payloads"]).random_payloads is True


def test_fused_kernel_is_checked_and_passed_on() -> None:
    assert _config({}, ["--ephemeral"]).fused_kernel == "auto"
    assert _config({}, ["--ephemeral", "--fused-kernel", "off"]).fused_kernel == "off"
    assert _config({"KALOS_FUSED_KERNEL": "off"}, ["--ephemeral"]).fused_kernel == "off"
    assert _config({"KALOS_FUSED_KERNEL": "off"}, ["--ephemeral", "--fused-kernel", "auto"]).fused_kernel == "auto"
    with pytest.raises(ConfigError, match="fused-kernel"):
        _config({}, ["--ephemeral", "--fused-kernel", "on"])
    with pytest.raises(ConfigError, match="fused-kernel"):
        _config({"KALOS_FUSED_KERNEL": "maybe"}, ["--ephemeral"])


def test_int8_pass_is_checked_and_passed_on() -> None:
    assert _config({}, ["--ephemeral"]).int8_pass == "auto"
    assert _config({}, ["--ephemeral", "--int8-pass", "off"]).int8_pass == "off"
    assert _config({"KALOS_INT8_PASS": "off"}, ["--ephemeral"]).int8_pass == "off"
    assert _config({"KALOS_INT8_PASS": "off"}, ["--ephemeral", "--int8-pass", "auto"]).int8_pass == "auto"
    with pytest.raises(ConfigError, match="int8-pass"):
        _config({}, ["--ephemeral", "--int8-pass", "on"])
    with pytest.raises(ConfigError, match="int8-pass"):
        _config({"KALOS_INT8_PASS": "yes"}, ["--ephemeral"])


def test_host_search_work_is_checked_and_passed_on() -> None:
    assert _config({}, ["--ephemeral"]).host_search_work is None  # the backend's default
    assert _config({}, ["--ephemeral", "--host-search-work", "0"]).host_search_work == 0
    assert _config({"KALOS_HOST_SEARCH_WORK": "4096"}, ["--ephemeral"]).host_search_work == 4096
    with pytest.raises(ConfigError, match="host-search-work"):
        _config({}, ["--ephemeral", "--host-search-work", "-1"])


@pytest.mark.parametrize("ephemeral_from_env", [False, True], ids=["ephemeral-flag", "ephemeral-env"])
@pytest.mark.parametrize("data_dir_from_env", [False, True], ids=["dir-flag", "dir-env"])
def test_ephemeral_and_a_data_dir_conflict_from_any_source(ephemeral_from_env: bool, data_dir_from_env: bool) -> None:
    """A stray KALOS_EPHEMERAL (or --ephemeral) beside a data dir must not make a durable sidecar
    forget everything at its next restart: any such combination is refused, naming both sources."""
    env: dict[str, str] = {}
    argv: list[str] = []
    if ephemeral_from_env:
        env["KALOS_EPHEMERAL"] = "1"
    else:
        argv.append("--ephemeral")
    if data_dir_from_env:
        env["KALOS_DATA_DIR"] = "./kd3"
    else:
        argv += ["--data-dir", "./kd3"]
    with pytest.raises(ConfigError) as exc:
        _config(env, argv)
    msg = str(exc.value)
    eph = "KALOS_EPHEMERAL='1'" if ephemeral_from_env else "the command line"
    dd = "KALOS_DATA_DIR='./kd3'" if data_dir_from_env else "the command line"
    assert f"--ephemeral (from {eph}) conflicts with --data-dir ./kd3 (from {dd})" in msg, msg


@pytest.mark.parametrize("other", [["--ephemeral"], ["--data-dir", "./kd3"]])
def test_a_store_beside_another_home_is_refused_without_echoing_it(other: list[str]) -> None:
    """--store is the third place memories can live: with either of the others it is the same
    error, and a KALOS_STORE value (which may hold a password) is never in the message."""
    secret = "postgresql://kalos:s3cr3t-pw@db.example:5432/kalos"
    with pytest.raises(ConfigError, match="conflicts with") as exc:
        _config({"KALOS_STORE": secret}, other)
    assert "KALOS_STORE (value not shown)" in str(exc.value)
    assert "s3cr3t" not in str(exc.value) and "db.example" not in str(exc.value)
    with pytest.raises(ConfigError, match="conflicts with") as exc:
        _config({}, [*other, "--store", secret])
    assert "s3cr3t" not in str(exc.value)
    with pytest.raises(ConfigError, match="value not shown") as exc:
        _config({"KALOS_STORE": "mysql://u:s3cr3t@h/db"}, [])
    assert "s3cr3t" not in str(exc.value)


def test_the_command_line_does_not_lift_the_conflict() -> None:
    # A data dir on the command line "winning" over KALOS_DATA_DIR is still a data dir: the
    # conflict is with --ephemeral, wherever either came from.
    with pytest.raises(ConfigError, match="conflicts"):
        _config({"KALOS_DATA_DIR": "/a", "KALOS_EPHEMERAL": "yes"}, ["--data-dir", "/b"])
    assert _config({"KALOS_EPHEMERAL": "0"}, ["--data-dir", "/b"]).data_dir == "/b"


def test_origin_names_where_a_value_came_from() -> None:
    ns = _parser({"KALOS_DIM": "64"}).parse_args(["--slots", "8"])
    assert origin(ns, "slots") == Origin(Source.COMMAND_LINE, "the command line")
    assert origin(ns, "dim") == Origin(Source.ENVIRONMENT, "KALOS_DIM='64'")
    assert origin(ns, "max_k") == Origin(Source.DEFAULT, "the default")
    # The command line wins over the environment, and says so.
    ns = _parser({"KALOS_DIM": "64"}).parse_args(["--dim", "32"])
    assert origin(ns, "dim").source is Source.COMMAND_LINE and ns.dim == 32
