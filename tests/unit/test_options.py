"""Options checked once, at the edge: ``ServeConfig`` turns ``--pipeline`` and ``--fused-kernel``
into enums (from the command line, the environment or direct construction), and nothing downstream
sees their spellings."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kalos.broker.errors import ConfigError
from kalos.sidecar_cuda.backends.select import choose_backend
from kalos.sidecar_cuda.config import (
    FusedKernel,
    Pipelining,
    ServeConfig,
    add_serve_arguments,
    config_from_args,
)
from kalos.sidecar_cuda.serving.batching import Route
from kalos.sidecar_cuda.serving.stats import ROUTES

pytestmark = pytest.mark.timeout(10)


def _config(argv: list[str], env: dict[str, str] | None = None) -> ServeConfig:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_serve_arguments(p, environ=env or {})
    return config_from_args(p.parse_args(["--ephemeral", *argv]))


def test_the_options_become_enums_wherever_they_come_from():
    cfg = _config([])
    assert cfg.pipeline is Pipelining.AUTO and cfg.fused_kernel is FusedKernel.AUTO
    cfg = _config(["--pipeline", "off", "--fused-kernel", "off"])
    assert cfg.pipeline is Pipelining.OFF and cfg.fused_kernel is FusedKernel.OFF
    cfg = _config([], {"KALOS_PIPELINE": "on", "KALOS_FUSED_KERNEL": "off"})
    assert cfg.pipeline is Pipelining.ON and cfg.fused_kernel is FusedKernel.OFF
    direct = ServeConfig(pipeline="on", fused_kernel="off")  # type: ignore[arg-type]  # (tests, the harness)
    assert direct.pipeline is Pipelining.ON and direct.fused_kernel is FusedKernel.OFF
    assert dataclasses.replace(direct, pipeline=Pipelining.OFF).pipeline is Pipelining.OFF
    assert ServeConfig().pipeline is Pipelining.AUTO


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("pipeline", "sometimes", "--pipeline must be auto, on or off"),
        ("fused_kernel", "on", "--fused-kernel must be auto or off"),
        ("pipeline", None, "--pipeline"),
        ("fused_kernel", 1, "--fused-kernel"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_option(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        ServeConfig(**{field: value})


def test_a_bad_value_on_the_command_line_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="--fused-kernel must be auto or off, got 'maybe'"):
        _config(["--fused-kernel", "maybe"])
    with pytest.raises(argparse.ArgumentError, match="KALOS_PIPELINE"):
        _config([], {"KALOS_PIPELINE": "sometimes"})


def test_the_backend_is_chosen_with_the_typed_option():
    be = choose_backend("numpy", fused_kernel=FusedKernel.OFF)
    try:
        assert be.name == "numpy"
    finally:
        be.close()


def test_route_labels_are_the_routes():
    assert ROUTES == tuple(r.value for r in Route) == ("single", "uniform", "mixed", "general", "embed")
