"""The int8 copy of a matrix's rows that the INT8 search path scores (``kalos_topk.cu``, "int8
first pass"): every stored row quantised to int8 with its own scale, and a bound on what that
rounding lost, kept on the device beside the stored rows.

It is built by the first INT8 search of a matrix (:func:`ensure`), then kept current by every write,
move and growth of the rows (``rows.py`` calls :func:`requantize` and :func:`grow`); gathered rows
get their own when searched. It costs ``copy_bytes`` of device memory: half the float16 rows, a
quarter of float32 ones, plus 8 bytes a row. Where that does not fit (:data:`FREE_FRACTION` of the
free memory at most), the matrix's traits say so and the planner keeps it off the path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from .device import Device
from .kernels import BLOCK
from .planner import Rows

log = logging.getLogger("kalos.cuda")

ROW_ALIGN = 16  # int8 values a row of the copy is padded to (16-byte rows, whole cuBLAS lines)
ROWS_ALIGN = 4  # rows of the copy are a multiple of this (cuBLAS int8: m a multiple of 4)
FREE_FRACTION = 0.5  # the copy takes at most this fraction of the device's free memory


@dataclass
class Int8Rows:
    """``data``: int8 [capacity][dp8] (zeros past the row's dim and past the stored rows);
    ``scale``: float32 [capacity][2], each row's {scale, bound on its rounding's norm}."""

    data: Any
    scale: Any
    dp8: int
    capacity: int

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes)


class HasRows(Protocol):
    """What this module reads and sets of ``rows.DeviceRows`` (which imports it)."""

    data: Any
    dpad: int
    capacity: int
    traits: Rows
    i8: Int8Rows | None


def padded_dim(dpad: int) -> int:
    return -(-dpad // ROW_ALIGN) * ROW_ALIGN


def padded_rows(capacity: int) -> int:
    return -(-capacity // ROWS_ALIGN) * ROWS_ALIGN


def copy_bytes(capacity: int, dpad: int) -> int:
    """Device memory of the int8 copy of ``capacity`` rows of ``dpad`` stored values."""
    rows = padded_rows(capacity)
    return rows * padded_dim(dpad) + 8 * rows


def ensure(dev: Device, m: HasRows) -> Int8Rows:
    """The matrix's int8 copy, built now if it has none. Raises ValueError (and marks the
    matrix's traits, so that the planner stops choosing the path) when it does not fit."""
    if m.i8 is not None:
        return m.i8
    need = copy_bytes(m.capacity, m.dpad)
    free = dev.free_bytes()
    if need > FREE_FRACTION * free:
        m.traits = replace(m.traits, int8_room=False)
        log.warning(
            "int8 first pass off for a matrix of %d rows: its copy needs %.1f MiB, %.1f MiB free",
            m.capacity,
            need / 2**20,
            free / 2**20,
        )
        raise ValueError("the int8 copy of these rows does not fit in the device's free memory")
    cap = padded_rows(m.capacity)
    dp8 = padded_dim(m.dpad)
    cp = dev.cp
    with dev.guard("building the int8 copy"), dev.stream:
        i8 = Int8Rows(cp.zeros((cap, dp8), np.int8), cp.zeros((cap, 2), np.float32), dp8, cap)
        _quantize(dev, m, i8, None, m.capacity)
    m.i8 = i8
    return i8


def requantize(dev: Device, m: HasRows, d_rows: Any, count: int) -> None:
    """Quantise rows ``d_rows`` (a device int64 array of ``count`` rows, already stored) into the
    copy, if there is one. Enqueued on the device's stream after the write or move."""
    if m.i8 is not None and count:
        with dev.guard("updating the int8 copy"):
            _quantize(dev, m, m.i8, d_rows, count)


def grow(dev: Device, m: HasRows) -> None:
    """After the rows grew to ``m.capacity``: a larger copy holding the old one (the new rows are
    zeros in both)."""
    old = m.i8
    if old is None or padded_rows(m.capacity) <= old.capacity:
        return
    cp = dev.cp
    cap = padded_rows(m.capacity)
    with dev.guard(f"growing the int8 copy to {cap} rows"), dev.stream:
        new = Int8Rows(cp.zeros((cap, old.dp8), np.int8), cp.zeros((cap, 2), np.float32), old.dp8, cap)
        new.data[: old.capacity] = old.data
        new.scale[: old.capacity] = old.scale
    m.i8 = new


def _quantize(dev: Device, m: HasRows, i8: Int8Rows, d_rows: Any, count: int) -> None:
    dev.kernels.i8_rows(
        (-(-count * 32 // BLOCK),),
        (BLOCK,),
        (
            m.data,
            np.int32(m.dpad),
            d_rows if d_rows is not None else 0,
            np.int64(0),
            np.int32(count),
            i8.data,
            np.int32(i8.dp8),
            i8.scale,
        ),
        stream=dev.stream,
    )


__all__ = ["Int8Rows", "copy_bytes", "ensure", "grow", "padded_dim", "padded_rows", "requantize"]
