"""The backends' own options, as typed values: :mod:`kalos.sidecar_cuda.config` parses the command
line into them once and passes them down; nothing under ``backends/`` reads the config."""

from __future__ import annotations

import enum


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


__all__ = ["FusedKernel", "Int8Pass"]
