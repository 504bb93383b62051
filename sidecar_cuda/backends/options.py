"""The backends' own options, as typed values: :mod:`kalos.sidecar_cuda.config` parses the command
line into them once and passes them down; nothing under ``backends/`` reads the config."""

from __future__ import annotations

import enum
from typing import TypeVar

from ...broker.errors import ConfigError

_E = TypeVar("_E", bound=enum.Enum)


def parse_option(kind: type[_E], value: object, flag: str) -> _E:
    """An option's value as its enum (a member, or its spelling); ConfigError names the choices.
    The one parser of every option kept as an enum (``config.ServeConfig`` resolves them all at
    start; :func:`~.select.choose_backend` takes a spelling from its direct callers, too)."""
    try:
        return kind(value)
    except ValueError:
        values = [str(m.value) for m in kind]
        choices = f"{', '.join(values[:-1])} or {values[-1]}"
        raise ConfigError(f"{flag} must be {choices}, got {value!r}") from None


class BackendKind(str, enum.Enum):
    """``--backend``: CUDA where CuPy and a GPU are usable, else numpy (AUTO), or one of them."""

    AUTO = "auto"
    NUMPY = "numpy"
    CUDA = "cuda"


class StorageDtype(str, enum.Enum):
    """``--dtype``: how the rows are stored (the numpy backend: float32 only)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class FusedKernel(str, enum.Enum):
    """``--fused-kernel``: the CUDA backend's wgmma path (Hopper, float16 storage) where it was
    measured to win (AUTO), or never (OFF)."""

    AUTO = "auto"
    OFF = "off"


class Int8Pass(str, enum.Enum):
    """``--int8-pass``: the CUDA backend's int8 first pass (an int8 copy of the rows beside them,
    half the bytes of float16 rows) for the small batches where it was measured to win (AUTO), or
    never, and no copy (OFF)."""

    AUTO = "auto"
    OFF = "off"


__all__ = ["BackendKind", "FusedKernel", "Int8Pass", "StorageDtype", "parse_option"]
