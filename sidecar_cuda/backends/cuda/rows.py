"""The rows of one matrix on the GPU, as plain data (:class:`DeviceRows`), and what changes or
reads them: writes, moves, growth, reads, gathering, and the host path's copy.

Rows are stored in the device's storage dtype, padded with zeros to whole 16-byte vectors, with
the squared norm of every stored row beside them (for l2). Writes, moves and growth are
device-side updates of just those rows. Every function takes the :class:`Device` explicitly;
searches are ``search.py``'s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace

import numpy as np

from ....broker.layout import Metric
from .device import Device
from .int8 import Int8Rows, requantize
from .int8 import grow as grow_int8
from .kernels import BLOCK, Storage
from .planner import Rows


class DeviceRows:
    """Rows [0, capacity) on ``dev`` (allocated here, zeros), and what searches keep about them."""

    def __init__(self, dev: Device, dim: int, capacity: int, metric: Metric) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.metric = metric
        self.dpad = -(-dim // dev.storage.vec) * dev.storage.vec
        self.capacity = max(1, int(capacity))
        if self.capacity >= 2**31:
            raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
        self.l2 = int(metric == Metric.L2)
        # What the planner reads of these rows, kept rather than built per search. Its max_norm
        # bounds the norm of every stored row (the proving paths' error bound): raised by
        # writes, never lowered (moves and deletes leave it a valid bound).
        self.traits = Rows(dev.storage, self.dpad, bool(self.l2), 0.0)
        with dev.stream:
            self.data = dev.cp.zeros((self.capacity, self.dpad), dev.storage.bits)
            self.sqn = dev.cp.zeros(self.capacity, np.float32)
            self.times = dev.cp.zeros(self.capacity, np.int64)  # ns, for recency (set_times)
        self.ptrs = (int(self.data.data.ptr), int(self.sqn.data.ptr))
        # Rows [0, n) as stored, widened to float32, and their squared norms (l2): the host
        # path's copy, read back on first use and dropped by every write, move or growth.
        self.host: tuple[np.ndarray, np.ndarray] | None = None
        # Candidate rows of filtered searches gathered into rows of their own, by the caller's
        # key (filtered.py), dropped by every write, move or growth.
        self.gathered: OrderedDict[Hashable, DeviceRows] = OrderedDict()
        # Queries served by each way of a filtered search: "all_rows", "overfetch_<k'>",
        # "gathered", "gather_reused".
        self.filter_stats = {"gathered": 0, "gather_reused": 0}
        # The int8 copy of the rows (int8.py): built by the first int8 search, then kept current
        # by every write, move and growth.
        self.i8: Int8Rows | None = None

    @property
    def int8_bytes(self) -> int:
        """Device memory of the int8 copy (0 while there is none)."""
        return self.i8.nbytes if self.i8 is not None else 0

    @property
    def rows_bytes(self) -> int:
        """Device memory of the rows and what is kept beside them (norms, times)."""
        return int(self.data.nbytes + self.sqn.nbytes + self.times.nbytes)

    def memory(self) -> dict[str, int]:
        """Bytes held by part (``base.BackendStatistics.memory``); safe from another thread: each
        container is copied in one step before it is read."""
        host = self.host
        gathered = list(self.gathered.values())
        return {
            "rows": self.rows_bytes,
            "int8": self.int8_bytes,
            "gathered": sum(g.rows_bytes for g in gathered),
            "host_copy": 0 if host is None else int(host[0].nbytes + host[1].nbytes),
        }

    @property
    def max_norm(self) -> float:
        return self.traits.max_norm

    @max_norm.setter
    def max_norm(self, bound: float) -> None:
        self.traits = replace(self.traits, max_norm=bound)

    def changed(self) -> None:
        """The rows change: gathered copies of them, and the host copy, are stale."""
        self.gathered.clear()
        self.host = None


def write(dev: Device, m: DeviceRows, rows: np.ndarray, vectors: np.ndarray) -> None:
    """Store float32 ``vectors`` (r, dim) at ``rows``."""
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    vectors = np.ascontiguousarray(vectors, np.float32)
    if vectors.ndim != 2 or vectors.shape != (len(rows), m.dim):
        raise ValueError(f"vectors of shape {vectors.shape} for {len(rows)} rows of dim {m.dim}")
    if len(rows) == 0:
        return
    if rows.min() < 0 or rows.max() >= m.capacity:
        raise IndexError(f"row outside [0, {m.capacity})")
    dev.check_usable()
    m.changed()
    norm = float(np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64).max()))
    # Rounding to a 16-bit format lengthens a row by a relative 2^-8 at most, plus 2^-25 per
    # element where float16 values are subnormal.
    m.max_norm = max(m.max_norm, norm * (1.0 + 2.0**-7) + math.sqrt(m.dpad) * 2.0**-24)
    cp = dev.cp
    with dev.guard("write_rows"), dev.stream:
        d_rows = cp.asarray(rows)
        d_vec = cp.asarray(vectors)
        r = len(rows)
        dev.kernels.write(
            (-(-r * 32 // BLOCK),),
            (BLOCK,),
            (m.data, m.sqn, np.int32(m.dpad), d_rows, d_vec, np.int32(r), np.int32(m.dim)),
            stream=dev.stream,
        )
    requantize(dev, m, d_rows, r)


def set_times(dev: Device, m: DeviceRows, rows: np.ndarray, times_ns: np.ndarray) -> None:
    """The times (int64 ns) of rows ``rows``, which a recency-weighted search ages."""
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    times_ns = np.ascontiguousarray(times_ns, np.int64).reshape(-1)
    if len(times_ns) != len(rows):
        raise ValueError(f"{len(times_ns)} times for {len(rows)} rows")
    if len(rows) == 0:
        return
    if rows.min() < 0 or rows.max() >= m.capacity:
        raise IndexError(f"row outside [0, {m.capacity})")
    dev.check_usable()
    m.gathered.clear()  # (gathered rows carry their times)
    cp = dev.cp
    with dev.guard("set_times"), dev.stream:
        m.times[cp.asarray(rows)] = cp.asarray(times_ns)


def move(dev: Device, m: DeviceRows, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy rows ``src`` onto rows ``dst``."""
    src = np.ascontiguousarray(src, np.int64).reshape(-1)
    dst = np.ascontiguousarray(dst, np.int64).reshape(-1)
    if len(src) != len(dst):
        raise ValueError("src and dst differ in length")
    if len(src) == 0:
        return
    if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= m.capacity:
        raise IndexError(f"row outside [0, {m.capacity})")
    dev.check_usable()
    m.changed()
    cp = dev.cp
    with dev.guard("move_rows"), dev.stream:
        r = len(src)
        d_dst = cp.asarray(dst)
        dev.kernels.move(
            (-(-r * 32 // BLOCK),),
            (BLOCK,),
            (m.data, m.sqn, np.int32(m.dpad), cp.asarray(src), d_dst, np.int32(r)),
            stream=dev.stream,
        )
    requantize(dev, m, d_dst, r)


def grow(dev: Device, m: DeviceRows, capacity: int) -> None:
    """Room for ``capacity`` rows, keeping the stored ones (device-to-device)."""
    if capacity <= m.capacity:
        return
    if capacity >= 2**31:
        raise ValueError("a CUDA matrix holds fewer than 2**31 rows")
    dev.check_usable()
    m.changed()
    cp = dev.cp
    with dev.guard(f"growing a matrix to {capacity} rows"), dev.stream:
        data = cp.zeros((capacity, m.dpad), dev.storage.bits)
        sqn = cp.zeros(capacity, np.float32)
        times = cp.zeros(capacity, np.int64)
        data[: m.capacity] = m.data
        sqn[: m.capacity] = m.sqn
        times[: m.capacity] = m.times
        m.data, m.sqn, m.times, m.capacity = data, sqn, times, capacity
        m.ptrs = (int(data.data.ptr), int(sqn.data.ptr))
    grow_int8(dev, m)


def read(dev: Device, m: DeviceRows, rows: np.ndarray) -> np.ndarray:
    """Stored rows as float32 (r, dim): the storage dtype's values, widened."""
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    if len(rows) and (rows.min() < 0 or rows.max() >= m.capacity):
        raise IndexError(f"row outside [0, {m.capacity})")
    dev.check_usable()
    with dev.guard("read_rows"), dev.stream:
        sel = m.data[dev.cp.asarray(rows)][:, : m.dim]
        raw: np.ndarray = dev.cp.asnumpy(sel, stream=dev.stream)
        dev.stream.synchronize()
    if dev.storage is Storage.FLOAT32:
        return np.ascontiguousarray(raw, np.float32)
    if dev.storage is Storage.FLOAT16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


def gather(dev: Device, m: DeviceRows, rows: np.ndarray) -> DeviceRows:
    """New rows holding rows ``rows`` of ``m``, in that order (gathered on the device; nothing
    crosses to the host)."""
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    if len(rows) == 0 or rows.min() < 0 or rows.max() >= m.capacity:
        raise IndexError(f"no rows, or a row outside [0, {m.capacity})")
    dev.check_usable()
    with dev.guard("gathering candidate rows"):
        sub = DeviceRows(dev, m.dim, len(rows), m.metric)
        with dev.stream:
            d_rows = dev.cp.asarray(rows)
            sub.data[...] = m.data[d_rows]
            sub.sqn[...] = m.sqn[d_rows]
            sub.times[...] = m.times[d_rows]
    sub.max_norm = m.max_norm  # still a bound on every gathered row's norm
    return sub


def host_copy(dev: Device, m: DeviceRows, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The host copy of rows [0, n) at least, and their squared norms (l2; zeros otherwise), read
    back (behind every write on the stream) when there is none or it is shorter."""
    h = m.host
    if h is None or len(h[0]) < n:
        stored = read(dev, m, np.arange(n))
        sqn = np.zeros(n, np.float32)
        if m.l2:
            with dev.guard("reading norms"), dev.stream:
                sqn = dev.cp.asnumpy(m.sqn[:n], stream=dev.stream)
                dev.stream.synchronize()
        h = m.host = (stored, sqn)
    return h


def host_times(dev: Device, m: DeviceRows, n: int) -> np.ndarray:
    """The times of rows [0, n), read back (the host path's recency; small n)."""
    with dev.guard("reading times"), dev.stream:
        t: np.ndarray = dev.cp.asnumpy(m.times[:n], stream=dev.stream)
        dev.stream.synchronize()
    return t


__all__ = ["DeviceRows", "gather", "grow", "host_copy", "host_times", "move", "read", "set_times", "write"]
