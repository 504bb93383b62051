"""``kalos export`` / ``kalos import``: a namespace as files (ids.npy, vectors.npy, payloads.jsonl).

Both stream: export writes each page as it arrives (the namespace is never held in memory), import
reads the vectors through a memory map and the payloads block by block. Both report progress
(:class:`kalos.progress.RowProgress`) and run within one time budget (:class:`kalos.admin.Budget`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice, repeat
from typing import IO, Any, BinaryIO, TextIO

import numpy as np
from numpy.lib import format as npy_format

from kalos.admin import Budget
from kalos.broker.errors import ConfigError
from kalos.progress import RowProgress

BLOCK_ROWS = 4096  # rows per pool.upsert call (each is split over the pool's slots)
IDS, VECTORS, PAYLOADS = "ids.npy", "vectors.npy", "payloads.jsonl"
EXPORT_FILES = (IDS, VECTORS, PAYLOADS)


class NpyAppender:
    """A .npy file written row block by row block, its row count set at :meth:`finish`.

    numpy pads a header so that its first dimension can grow to any size in place (the format's
    provision for appending), so the header written first with 0 rows is rewritten at the end
    with the real count, at the same length."""

    def __init__(self, f: BinaryIO, dtype: np.dtype[Any], row_shape: tuple[int, ...]) -> None:
        self._f = f
        self._dtype = dtype
        self._row_shape = row_shape
        self.rows = 0
        self._write_header()
        self._data_start = f.tell()

    def _write_header(self) -> None:
        npy_format.write_array_header_1_0(
            self._f,
            {
                "descr": npy_format.dtype_to_descr(self._dtype),
                "fortran_order": False,
                "shape": (self.rows, *self._row_shape),
            },
        )

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, self._dtype)
        if block.shape[1:] != self._row_shape:
            raise ValueError(f"rows of shape {block.shape[1:]}, this file holds {self._row_shape}")
        self._f.write(block.tobytes())
        self.rows += len(block)

    def finish(self) -> None:
        self._f.seek(0)
        self._write_header()
        if self._f.tell() != self._data_start:  # numpy changed its padding: never corrupt a file
            raise RuntimeError("the .npy header changed length when rewritten")
        self._f.seek(0, os.SEEK_END)


def check_export_target(out_dir: str) -> None:
    """Raise ConfigError if exporting to ``out_dir`` would overwrite anything: checked before the
    sidecar is asked for a single record."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} exists and is not a directory; give kalos export a new or empty directory")
    present = [f for f in EXPORT_FILES if os.path.lexists(os.path.join(out_dir, f))]
    if present:
        raise ConfigError(
            f"{out_dir} already holds {', '.join(present)}; kalos export never "
            "overwrites: give a new directory or remove them"
        )


class _ExportFiles:
    """The three files of an export, created exclusively; :meth:`discard` removes what was
    created (the directory too if it was made here) when the export fails."""

    def __init__(self, out_dir: str, dim: int) -> None:
        self.out_dir = out_dir
        self._made_dir = not os.path.isdir(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self._made: list[str] = []
        self._open: list[IO[Any]] = []
        try:
            ids_f = self._create(IDS, "xb")
            vec_f = self._create(VECTORS, "xb")
            self.payloads: IO[str] = self._create(PAYLOADS, "x")
            self.ids = NpyAppender(ids_f, np.dtype(np.int64), ())
            self.vectors = NpyAppender(vec_f, np.dtype(np.float32), (dim,))
        except BaseException:
            self.discard()
            raise

    def _create(self, fname: str, mode: str) -> Any:
        path = os.path.join(self.out_dir, fname)
        f = open(path, mode, encoding=None if "b" in mode else "utf-8")
        self._made.append(path)
        self._open.append(f)
        return f

    def write(self, ids: np.ndarray, vectors: np.ndarray, payloads: list[Any]) -> None:
        self.ids.append(ids)
        self.vectors.append(vectors)
        self.payloads.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in payloads)

    def finish(self) -> None:
        self.ids.finish()
        self.vectors.finish()
        for f in self._open:
            f.close()

    def discard(self) -> None:
        for f in self._open:
            f.close()
        for path in self._made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self._made_dir:
            try:
                os.rmdir(self.out_dir)
            except OSError:
                pass


def export_namespace(
    name: str, namespace: str, out_dir: str, *, timeout: float | None = None, progress: TextIO | None = None
) -> int:
    """Write every record of ``namespace`` to ``out_dir``; returns the number of records.

    ``timeout`` (seconds, None: no limit) bounds the whole export, connecting included. Refuses
    (ConfigError) before reading anything if a file of the export exists there already. Pages
    are read with an id cursor, so the export stays consistent record by record while writers go
    on (a record changed during the export appears in its old or new form). Progress goes to
    ``progress`` (default: stderr). Raises
    UnknownNamespace, BrokerUnavailable, CommandTimeout; a failed export removes its files."""
    check_export_target(out_dir)

    async def run(budget: Budget) -> int:
        async with budget.pool() as pool:
            total = await pool.count(namespace)
            files = _ExportFiles(out_dir, pool.layout.dim)
            try:
                with RowProgress(f"export {namespace!r}", total, stream=progress) as shown:
                    after = -1
                    while True:
                        ids, vectors, payloads = await pool.export_page(namespace, after)
                        if not len(ids):
                            break
                        files.write(ids, vectors, payloads)
                        shown.advance(len(ids))
                        after = int(ids[-1])
                files.finish()
            except BaseException:
                files.discard()
                raise
            return files.ids.rows

    return Budget(name, timeout).run(run)


@dataclass(frozen=True)
class Export:
    """An export on disk: ids, vectors (a memory map) and the payload file, if any, with its
    line count checked."""

    ids: np.ndarray
    vectors: np.ndarray
    payloads_path: str | None

    def payload_blocks(self, rows: int) -> Iterator[list[Any] | None]:
        """The payloads of consecutive blocks of ``rows`` records (None without a payload file)."""
        if self.payloads_path is None:
            yield from repeat(None)
            return
        with open(self.payloads_path, encoding="utf-8") as f:
            lines = (line for line in f if line.strip())
            while True:
                yield [json.loads(line) for line in islice(lines, rows)]


def read_export(src: str) -> Export:
    """Open an export written by :func:`export_namespace` (``ids.npy`` and ``payloads.jsonl`` are
    optional). Raises ConfigError when its files are missing or disagree on the record count."""
    try:
        vectors = np.load(os.path.join(src, VECTORS), mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {src}/{VECTORS}: {e}") from None
    ids_path = os.path.join(src, IDS)
    ids = np.load(ids_path) if os.path.exists(ids_path) else np.arange(len(vectors), dtype=np.int64)
    if vectors.ndim != 2 or len(ids) != len(vectors):
        raise ConfigError(f"{src}: {len(ids)} ids for vectors of shape {vectors.shape}")
    pl_path = os.path.join(src, PAYLOADS)
    if not os.path.exists(pl_path):
        return Export(ids, vectors, None)
    with open(pl_path, encoding="utf-8") as f:
        n = sum(1 for line in f if line.strip())
    if n != len(ids):
        raise ConfigError(f"{pl_path}: {n} payloads for {len(ids)} vectors")
    return Export(ids, vectors, pl_path)


def import_namespace(
    name: str,
    namespace: str,
    src: str,
    *,
    timeout: float | None = None,
    pool_size: int = 16,
    progress: TextIO | None = None,
) -> tuple[int, float]:
    """Bulk-upsert an export into ``namespace``; returns (records, seconds). Blocks of rows go
    through every slot of a pool at once; each block is acknowledged (durable) before the next.
    ``timeout`` (seconds, None: no limit) bounds the whole import, connecting included; progress
    goes to ``progress`` (default: stderr). Raises
    ConfigError (unreadable export, another dim), BrokerUnavailable, CommandTimeout and the
    errors of ``RecallPool.upsert``; blocks acknowledged before an error stay written."""
    data = read_export(src)

    async def run(budget: Budget) -> int:
        n = 0
        async with budget.pool(size=pool_size) as pool:
            if data.vectors.shape[1] != pool.layout.dim:
                raise ConfigError(
                    f"{src} holds vectors of dim {data.vectors.shape[1]}, broker {name!r} serves dim {pool.layout.dim}"
                )
            blocks = data.payload_blocks(BLOCK_ROWS)
            with RowProgress(f"import {namespace!r}", len(data.ids), stream=progress) as shown:
                for lo in range(0, len(data.ids), BLOCK_ROWS):
                    hi = min(len(data.ids), lo + BLOCK_ROWS)
                    n += await pool.upsert(
                        data.ids[lo:hi], np.asarray(data.vectors[lo:hi], np.float32), next(blocks), namespace=namespace
                    )
                    shown.advance(hi - lo)
        return n

    t0 = time.perf_counter()
    n = Budget(name, timeout).run(run)
    return n, time.perf_counter() - t0


__all__ = [
    "export_namespace",
    "import_namespace",
    "read_export",
    "check_export_target",
    "NpyAppender",
    "Export",
    "EXPORT_FILES",
    "BLOCK_ROWS",
]
