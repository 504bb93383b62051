"""Sharded memory: every namespace's rows spread over several backends (one per GPU, several on
one GPU, or several numpy backends on the CPU), searched on all of them at once and merged into the
exact global top-k. The store sees one :class:`~kalos.sidecar_cuda.backends.base.Matrix` as before.

Placement: global row ``r`` lives in block ``r // BLOCK``; blocks go round-robin over the S shards
(block ``j`` on shard ``j % S``, as that shard's local block ``j // S``). The store keeps rows
dense ([0, n) live, compaction after deletes), so every shard's live rows are a prefix of its
local rows too, and shards differ by at most one block: writes and deletes stay balanced without
any bookkeeping. A compaction move between two shards is a read of the row on one and a write on
the other (the stored values are copied, widened and narrowed again, without change).

A search is started on every shard (each backend has its own stream and buffers, or its own worker
thread on the CPU) before any is waited for; each returns its top-k, and the merge on the host
(S x k candidates per query) picks the global top-k: exact, since every row of the global top-k is
in its own shard's top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...broker.errors import ConfigError
from ...broker.layout import Metric
from .base import (
    Backend,
    BackendStatistics,
    Decay,
    Matrix,
    PendingSearch,
    PolledFuture,
    SearchResult,
    Subset,
    completed,
    merge_statistics,
    search_each,
)

BLOCK = 1024  # rows per placement block


# --------------------------------------------------------------------------- placement (pure)


def place(rows: np.ndarray, shards: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local row) of each global row. Pure."""
    rows = np.asarray(rows, np.int64)
    blk = rows // block
    return blk % shards, (blk // shards) * block + rows % block


def global_rows(local: np.ndarray, shard: int, shards: int, block: int = BLOCK) -> np.ndarray:
    """The global rows of shard ``shard``'s local rows. Pure."""
    local = np.asarray(local, np.int64)
    out: np.ndarray = ((local // block) * shards + shard) * block + local % block
    return out


def live_rows(n: int, shard: int, shards: int, block: int = BLOCK) -> int:
    """How many local rows of shard ``shard`` are live when global rows [0, n) are. Pure."""
    full, rest = divmod(n, block * shards)
    extra = min(block, max(0, rest - shard * block))
    return full * block + extra


def local_capacity(capacity: int, shards: int, block: int = BLOCK) -> int:
    """Local rows each shard needs for global rows [0, capacity): whole blocks. Pure."""
    return -(-capacity // (block * shards)) * block


def merge_top(parts: Sequence[SearchResult], k: int) -> SearchResult:
    """The best ``k`` (rows, scores) per query of the shards' answers (at least one; each best
    first), best first; on equal scores the lower shard, then its order, comes first. Pure."""
    if len(parts) == 1:
        rows, scores = parts[0]
        return rows[:, :k], scores[:, :k]
    rows = np.concatenate([p[0] for p in parts], axis=1)
    scores = np.concatenate([p[1] for p in parts], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)


def parse_devices(spec: str, count: int) -> list[int]:
    """``all`` or a comma list of device ordinals (``0,1``) as a list, checked against the
    ``count`` visible devices. Raises ConfigError. Pure."""
    spec = spec.strip()
    if spec == "all":
        if count < 1:
            raise ConfigError("--devices all: no CUDA device is visible")
        return list(range(count))
    try:
        devs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--devices must be 'all' or a comma list of ordinals like 0,1; got {spec!r}") from None
    if not devs:
        raise ConfigError("--devices names no device")
    if len(set(devs)) != len(devs):
        raise ConfigError(f"--devices names a device twice: {spec!r}")
    bad = [d for d in devs if not 0 <= d < count]
    if bad:
        raise ConfigError(f"--devices: no CUDA device {bad[0]} ({count} visible)")
    return devs


# --------------------------------------------------------------------------- the matrix


class ShardedSearch(PolledFuture[SearchResult]):
    """A search started on every shard: done when all are; collected into the merged top-k."""

    def __init__(
        self,
        parts: list[tuple[int, PendingSearch]],
        shards: int,
        block: int,
        b: int,
        k: int,
        row_ids: np.ndarray | None,
    ) -> None:
        super().__init__()
        self._parts = parts
        self._shards = shards
        self._block = block
        self._b = b
        self._k = k
        self._row_ids = row_ids

    def _poll(self) -> bool:
        return all(f.done() for _s, f in self._parts)

    def _collect(self) -> SearchResult:
        got = []
        error: BaseException | None = None
        for s, f in self._parts:  # collect every shard, even after one failed (buffers freed)
            try:
                rows, scores = f.result()
            except BaseException as e:
                error = error or e
                continue
            got.append((global_rows(rows, s, self._shards, self._block), scores))
        if error is not None:
            raise error
        if got:
            rows, scores = merge_top(got, self._k)
        else:  # no shard holds a live row
            rows, scores = np.empty((self._b, 0), np.int64), np.empty((self._b, 0), np.float32)
        if self._row_ids is not None:
            rows = self._row_ids[rows]
        return rows, scores


class ShardedMatrix:
    """One namespace's rows over several shards (see the module docstring)."""

    def __init__(self, parts: list[Matrix], dim: int, block: int = BLOCK) -> None:
        self.parts = parts
        self.shards = len(parts)
        self.block = block
        self.dim = dim
        self.capacity = min(p.capacity for p in parts) * self.shards

    def _by_shard(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(shard, positions in ``rows``, local rows) for each shard that ``rows`` touch."""
        shard, local = place(rows, self.shards, self.block)
        out = []
        for s in range(self.shards):
            pos = np.flatnonzero(shard == s)
            if len(pos):
                out.append((s, pos, local[pos]))
        return out

    def _check(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.capacity):
            raise IndexError(f"row outside [0, {self.capacity})")
        return rows

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        rows = self._check(rows)
        vectors = np.ascontiguousarray(vectors, np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(rows), self.dim):
            raise ValueError(f"vectors of shape {vectors.shape} for {len(rows)} rows of dim {self.dim}")
        for s, pos, local in self._by_shard(rows):
            self.parts[s].write_rows(local, vectors[pos])

    def set_times(self, rows: np.ndarray, times_ns: np.ndarray) -> None:
        rows = self._check(rows)
        times_ns = np.asarray(times_ns, np.int64).reshape(-1)
        for s, pos, local in self._by_shard(rows):
            self.parts[s].set_times(local, times_ns[pos])

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = self._check(src), self._check(dst)
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        s_sh, s_loc = place(src, self.shards, self.block)
        d_sh, d_loc = place(dst, self.shards, self.block)
        same = s_sh == d_sh
        for s in range(self.shards):
            pick = same & (s_sh == s)
            if pick.any():
                self.parts[s].move_rows(s_loc[pick], d_loc[pick])
        cross = np.flatnonzero(~same)
        if len(cross):
            vecs = self.read_rows(src[cross])  # every source read before any destination written
            self.write_rows(dst[cross], vecs)
        # (times are not moved: Matrix.set_times, the store sets them again for the moved rows)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        local = local_capacity(capacity, self.shards, self.block)
        for p in self.parts:
            p.grow(local)
        self.capacity = min(p.capacity for p in self.parts) * self.shards

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = self._check(rows)
        out = np.empty((len(rows), self.dim), np.float32)
        for s, pos, local in self._by_shard(rows):
            out[pos] = self.parts[s].read_rows(local)
        return out

    def _shares(self, n: int, within: Subset | None) -> list[tuple[int, int, Subset | None]]:
        """Each shard's part of a search over rows [0, n): (shard, its live rows, its candidates
        under its own key, or None)."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n={n} outside the matrix capacity {self.capacity}")
        blk, shards = self.block, self.shards
        if within is None:
            return [(s, ns, None) for s in range(shards) if (ns := live_rows(n, s, shards, blk))]
        key = within.key
        return [
            (s, live_rows(n, s, shards, blk), Subset(local, None if key is None else (key, s)))
            for s, _pos, local in self._by_shard(np.asarray(within.rows, np.int64))
        ]

    def search(
        self, queries: np.ndarray, n: int, k: int, *, within: Subset | None = None, decay: Decay | None = None
    ) -> SearchResult:
        if within is None and decay is None:
            return self.search_start(queries, n, k).result()
        # Each shard's top-k (recency-weighted, or over its own candidates), merged: every row of
        # the global top-k is in its own shard's. One shard after the other.
        got = []
        for s, ns, sub in self._shares(n, within):
            rows, scores = self.parts[s].search(queries, ns, k, within=sub, decay=decay)
            got.append((global_rows(rows, s, self.shards, self.block), scores))
        if not got:
            return np.empty((len(queries), 0), np.int64), np.empty((len(queries), 0), np.float32)
        return merge_top(got, k)

    def search_start(self, queries: np.ndarray, n: int, k: int, *, row_ids: np.ndarray | None = None) -> PendingSearch:
        parts = [(s, self.parts[s].search_start(queries, ns, k)) for s, ns, _ in self._shares(n, None)]
        return ShardedSearch(parts, self.shards, self.block, len(queries), k, row_ids)


class ShardedBackend:
    """Several backends of one kind serving as one (see the module docstring)."""

    def __init__(self, backends: list[Backend], labels: list[str], block: int = BLOCK) -> None:
        if not backends:
            raise ConfigError("a sharded backend needs at least one shard")
        if len({b.name for b in backends}) != 1:
            raise ConfigError("the shards of a sidecar are all of one backend kind")
        self.backends = backends
        self.name = backends[0].name
        self.code = backends[0].code
        self.max_k = min(b.max_k for b in backends)
        self.mixed_rows = 1 << 62  # (search_mixed: one search per namespace, each on every shard)
        self.labels = labels
        self.block = block
        self.placement = ",".join(labels)
        self.description = f"{len(backends)} shards ({', '.join(labels)}) of {backends[0].description}"

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> ShardedMatrix:
        local = local_capacity(max(1, capacity), len(self.backends), self.block)
        return ShardedMatrix([b.new_matrix(dim, local, metric) for b in self.backends], dim, self.block)

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        return self.backends[0].host_buffer(shape, dtype)

    def search_mixed(
        self, matrices: Sequence[Matrix], n: np.ndarray, of_query: np.ndarray, queries: np.ndarray, k: int
    ) -> PendingSearch:
        return completed(*search_each(matrices, n, of_query, queries, k))

    def statistics(self) -> BackendStatistics:
        """The shards' statistics summed (a batch searched on every shard counts once per shard)."""
        return merge_statistics(b.statistics() for b in self.backends)

    def close(self) -> None:
        for b in self.backends:
            b.close()
