"""The safetensors file format (Hugging Face's weights format), read and written with numpy alone:
an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``
(plus an optional ``__metadata__``), then the raw little-endian tensors. Reading checks every
offset against the file, since a model directory is input like any other."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
}
_NAMES: dict[np.dtype[Any], str] = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<f8"): "F64"}
#: Integer tensors (buffers such as BERT's ``position_ids``): checked, not loaded.
_SKIPPED = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20


class WeightsError(ValueError):
    """A weights file that is not a valid safetensors file (or holds a dtype not supported)."""


def read(path: Path) -> dict[str, np.ndarray]:
    """Every floating-point tensor of ``path`` as float32 (BF16 widened exactly, F16 and F64
    converted); integer ones (buffers) are checked and left out."""
    data = np.memmap(path, np.uint8, mode="r")
    if len(data) < 8:
        raise WeightsError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if not 2 <= n <= min(_MAX_HEADER, len(data) - 8):
        raise WeightsError(f"{path}: header length {n} does not fit the file")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:
        raise WeightsError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header is not a JSON object")
    body = data[8 + n :]
    out: dict[str, np.ndarray] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            kind = spec["dtype"]
            size = _SKIPPED[kind] if kind in _SKIPPED else _DTYPES[kind].itemsize
            shape = tuple(int(d) for d in spec["shape"])
            start, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: tensor {name!r}: unsupported dtype or malformed entry {spec!r}") from None
        count = int(np.prod(shape)) if shape else 1
        if min(shape, default=0) < 0 or not 0 <= start <= end <= len(body) or end - start != count * size:
            raise WeightsError(f"{path}: tensor {name!r}: offsets {start}..{end} do not match shape {shape}")
        if kind in _SKIPPED:
            continue
        dtype = _DTYPES[kind]
        raw = np.frombuffer(body[start:end], dtype).reshape(shape)
        if spec["dtype"] == "BF16":  # the top half of a float32
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out[name] = raw.astype(np.float32)
    return out


def write(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write ``tensors`` (float32, float16 or float64) as a safetensors file."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        a = a.astype(a.dtype.newbyteorder("<"))
        raw = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # (the format pads the header to 8 bytes)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for raw in blobs:
            f.write(raw)


__all__ = ["WeightsError", "read", "write"]
