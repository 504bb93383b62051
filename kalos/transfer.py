"""``kalos export`` / ``kalos import``: namespaces as files, with their timestamps and TTLs.

**The format** (version 2). An export is a directory holding ``manifest.json`` and, per
namespace, four files: ``ids.npy`` (int64), ``vectors.npy`` (float32, (n, dim)),
``payloads.jsonl`` (one JSON value a line, ``null`` for none) and ``stamps.npy`` (a structured
array, one row per record: ``created_at_ns``, ``updated_at_ns``, ``expires_at_ns`` (0: never),
``ttl_ns`` (the record's own TTL, 0: none, -1: not known)). The manifest says what it holds::

    {"format": "kalos-export", "version": 2, "dim": 768, "metric": "cosine",
     "exported_at_ns": ..., "source": "broker 'default'", "stamps_precision_ns": 256,
     "namespaces": [{"name": "agent-1", "dir": ".", "records": 1234, "default_ttl_ns": null}]}

One namespace's files lie in the export's directory itself (``"dir": "."``); ``--all`` puts each
namespace in a subdirectory. The manifest is written last: an export without one is incomplete
(a failed export removes what it wrote) or an older one. Files are created 0600 and directories
0700, whatever the umask: an export holds every memory of its namespaces. **Version 1** (before
the manifest: ``vectors.npy`` and optionally ``ids.npy`` and ``payloads.jsonl``, no timestamps)
still imports, into the namespace the command names.

**Two ways to each.** Through a running sidecar (the default; any store, a fleet's too): export
reads each page of ids and then those records with their timestamps, which the protocol answers
as float64 seconds (``stamps_precision_ns`` 256: exact to a quarter of a microsecond); a record's
own TTL and a namespace's default TTL cannot be read that way (``ttl_ns`` -1, ``default_ttl_ns``
null). Import can not set timestamps through the protocol (a sidecar stamps every write with its
own clock, by design: one clock decides): each record gets ``updated_at = created_at =`` the time
it is imported, keeps its ``expires_at`` (its TTL is the time it had left, rounded up to the
millisecond), records that expired since the export are skipped, and a namespace's default TTL is
set again. With ``--data-dir DIR`` both work on the SQLite store directly, with the sidecar
stopped (the data dir's lock says so, :mod:`kalos.sidecar_cuda.storage.datadir`): every timestamp and TTL,
each record's own TTL and each namespace's default round-trip exactly, and an import into a new
directory makes the store (a way to change ``--metric``: export, then import into a new dir).

Both stream: export writes each page as it arrives (a namespace is never held in memory), import
reads the vectors through a memory map and the payloads block by block. Both report progress
(:class:`kalos.progress.RowProgress`); through a sidecar they run within one time budget
(:class:`kalos.admin.Budget`).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import IO, Any, BinaryIO, TextIO

import numpy as np
from numpy.lib import format as npy_format

from kalos.admin import Budget
from kalos.broker.clock import NS
from kalos.broker.errors import ConfigError, InvalidRequest
from kalos.broker.names import validate_namespace
from kalos.broker.validation import VectorsFor, as_ids, as_vectors, payload_lines
from kalos.clients.pool import RecallPool
from kalos.progress import RowProgress

BLOCK_ROWS = 4096  # rows per pool.upsert call (each is split over the pool's slots) or store commit
IDS, VECTORS, PAYLOADS, STAMPS, MANIFEST = "ids.npy", "vectors.npy", "payloads.jsonl", "stamps.npy", "manifest.json"
#: The files of one namespace's export, and the manifest: an export never overwrites any of them.
EXPORT_FILES = (IDS, VECTORS, PAYLOADS, STAMPS, MANIFEST)
FORMAT = "kalos-export"
FORMAT_VERSION = 2
#: One row of ``stamps.npy``.
STAMPS_DTYPE = np.dtype(
    [("created_at_ns", "<i8"), ("updated_at_ns", "<i8"), ("expires_at_ns", "<i8"), ("ttl_ns", "<i8")]
)
#: ``ttl_ns`` of a record whose own TTL the export could not read (an export through a sidecar).
TTL_UNKNOWN = -1
FILE_MODE = 0o600
DIR_MODE = 0o700
#: How far from exact the timestamps of an export through a sidecar may be: the protocol's
#: float64 seconds (half an ulp near 2^31 s, and the rounding of the conversion back).
ONLINE_PRECISION_NS = 256
#: The payload limit an import into a data dir holds payloads to (the sidecar's default
#: ``--payload-limit``; the import's ``--payload-limit`` changes it).
DEFAULT_PAYLOAD_LIMIT = 16 * 1024


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


def check_export_target(out_dir: str, *, several: bool = False) -> None:
    """Raise ConfigError if exporting to ``out_dir`` would overwrite anything: checked before the
    sidecar is asked for a single record. ``several`` (``--all``): the directory must be new or
    empty, as each namespace gets a subdirectory."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} exists and is not a directory; give kalos export a new or empty directory")
    present = [f for f in EXPORT_FILES if os.path.lexists(os.path.join(out_dir, f))]
    if present:
        raise ConfigError(
            f"{out_dir} already holds {', '.join(present)}; kalos export never "
            "overwrites: give a new directory or remove them"
        )
    if several and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir} is not empty; kalos export --all writes into a new or empty directory")


def stamps_array(created: np.ndarray, updated: np.ndarray, expires: np.ndarray, ttl: np.ndarray) -> np.ndarray:
    """The rows of ``stamps.npy`` for records of these timestamps (int64 ns each)."""
    out = np.empty(len(created), STAMPS_DTYPE)
    out["created_at_ns"], out["updated_at_ns"], out["expires_at_ns"], out["ttl_ns"] = created, updated, expires, ttl
    return out


def _private_file(path: str, binary: bool) -> IO[Any]:
    """Create ``path`` exclusively, mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8")
    except BaseException:
        os.close(fd)
        raise


class _NamespaceFiles:
    """The four files of one namespace's export, created exclusively (0600) in ``directory``."""

    def __init__(self, directory: str, dim: int, made: list[str]) -> None:
        self._open: list[IO[Any]] = []
        self._made = made

        def create(fname: str, binary: bool) -> Any:
            path = os.path.join(directory, fname)
            f = _private_file(path, binary)
            made.append(path)
            self._open.append(f)
            return f

        self.ids = NpyAppender(create(IDS, True), np.dtype(np.int64), ())
        self.vectors = NpyAppender(create(VECTORS, True), np.dtype(np.float32), (dim,))
        self.payloads: IO[str] = create(PAYLOADS, False)
        self.stamps = NpyAppender(create(STAMPS, True), STAMPS_DTYPE, ())

    def write(self, ids: np.ndarray, vectors: np.ndarray, payloads: list[Any], stamps: np.ndarray) -> None:
        self.ids.append(ids)
        self.vectors.append(vectors)
        self.payloads.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in payloads)
        self.stamps.append(stamps)

    def finish(self) -> None:
        self.ids.finish()
        self.vectors.finish()
        self.stamps.finish()
        self.close()

    def close(self) -> None:
        for f in self._open:
            f.close()


@dataclass
class _Written:
    name: str
    directory: str  # relative to the export's directory
    records: int
    default_ttl_ns: int | None


class ExportWriter:
    """An export being written into ``out_dir`` (created 0700 if missing): one namespace in the
    directory itself, or (``several``) each in a subdirectory. :meth:`finish` writes the
    manifest; :meth:`discard` removes everything written (the directory too if it was made here)."""

    def __init__(self, out_dir: str, dim: int, metric: str, source: str, precision_ns: int, several: bool) -> None:
        self.out_dir = out_dir
        self.dim, self.metric, self.source, self.precision_ns = dim, metric, source, precision_ns
        self.several = several
        self._made_dir = not os.path.isdir(out_dir)
        if self._made_dir:
            os.makedirs(out_dir, mode=DIR_MODE)
            os.chmod(out_dir, DIR_MODE)
        self._files: list[str] = []
        self._dirs: list[str] = []
        self.written: list[_Written] = []
        self._current: _NamespaceFiles | None = None

    def begin(self, namespace: str) -> _NamespaceFiles:
        """The files of the next namespace (the previous one's are finished first)."""
        if self._current is not None:
            raise RuntimeError("the previous namespace is not ended")
        if self.several:
            sub = f"{len(self.written):04d}-{namespace}"
            path = os.path.join(self.out_dir, sub)
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE)
            self._dirs.append(path)
        elif self.written:
            raise RuntimeError("an export of one namespace holds one")
        else:
            sub, path = ".", self.out_dir
        self._current = _NamespaceFiles(path, self.dim, self._files)
        self.written.append(_Written(namespace, sub, 0, None))
        return self._current

    def end(self, default_ttl_ns: int | None) -> int:
        """Finish the namespace begun last; returns its records."""
        assert self._current is not None
        self._current.finish()
        w = self.written[-1]
        w.records, w.default_ttl_ns = self._current.ids.rows, default_ttl_ns
        self._current = None
        return w.records

    def finish(self) -> None:
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dim": self.dim,
            "metric": self.metric,
            "exported_at_ns": time.time_ns(),
            "source": self.source,
            "stamps_precision_ns": self.precision_ns,
            "namespaces": [
                {"name": w.name, "dir": w.directory, "records": w.records, "default_ttl_ns": w.default_ttl_ns}
                for w in self.written
            ],
        }
        path = os.path.join(self.out_dir, MANIFEST)
        with _private_file(path, False) as f:
            self._files.append(path)
            json.dump(manifest, f, indent=1)
            f.write("\n")

    def discard(self) -> None:
        if self._current is not None:
            self._current.close()
        for path in self._files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for path in [*reversed(self._dirs), *([self.out_dir] if self._made_dir else [])]:
            try:
                os.rmdir(path)
            except OSError:
                pass


# --------------------------------------------------------------------------- export
def _online_stamps(rec: Any) -> np.ndarray:
    """The stamps of a ``get`` answer (float64 seconds; ``expires_at`` inf: never) in ns."""

    def ns(s: np.ndarray) -> np.ndarray:
        return np.rint(np.asarray(s, np.float64) * NS).astype(np.int64)

    exp = np.asarray(rec.expires_at, np.float64)
    expires = np.where(np.isinf(exp), 0, ns(np.where(np.isinf(exp), 0.0, exp)))
    m = len(rec.ids)
    return stamps_array(ns(rec.created_at), ns(rec.updated_at), expires, np.full(m, TTL_UNKNOWN, np.int64))


async def _pages(
    pool: RecallPool, namespace: str
) -> AsyncIterator[tuple[int, np.ndarray, np.ndarray, list[Any], np.ndarray]]:
    """(ids paged, ids, vectors, payloads, stamps) of each page of ``namespace``: the page's ids
    by the id cursor, then those records with their timestamps in one answer each (a record
    deleted in between is left out; one changed appears in its new form, whole)."""
    after = -1
    while True:
        page_ids, _vectors, _payloads = await pool.export_page(namespace, after)
        if not len(page_ids):
            return
        after = int(page_ids[-1])
        rec = await pool.get(page_ids, namespace=namespace)
        assert rec.vectors is not None  # (asked for)
        yield len(page_ids), rec.ids, rec.vectors, list(rec.payloads), _online_stamps(rec)


def export_namespaces(
    name: str,
    namespaces: list[str] | None,
    out_dir: str,
    *,
    timeout: float | None = None,
    progress: TextIO | None = None,
) -> list[tuple[str, int]]:
    """Export ``namespaces`` of the sidecar serving ``name`` (None: every namespace that holds
    records, each in a subdirectory) to ``out_dir``; returns (namespace, records) of each.

    ``timeout`` (seconds, None: no limit) bounds the whole export, connecting included. Refuses
    (ConfigError) before reading anything if a file of an export is there already. Pages are
    read with an id cursor, so the export stays consistent record by record while writers go
    on. A namespace that holds no record (never written, or dropped) exports 0 records. Progress
    goes to ``progress`` (default: stderr). Raises BrokerUnavailable, CommandTimeout; a failed
    export removes its files."""
    several = namespaces is None
    check_export_target(out_dir, several=several)

    async def run(budget: Budget) -> list[tuple[str, int]]:
        async with budget.pool() as pool:
            if namespaces is None:
                counts = await pool.namespaces()
                todo = [ns for ns, n in sorted(counts.items()) if n]
            else:
                todo = list(namespaces)
            writer = ExportWriter(
                out_dir, pool.layout.dim, pool.metric, f"broker {name!r}", ONLINE_PRECISION_NS, several
            )
            out = []
            try:
                for ns in todo:
                    total = await pool.count(ns)
                    files = writer.begin(ns)
                    with RowProgress(f"export {ns!r}", total, stream=progress) as shown:
                        async for paged, ids, vectors, payloads, stamps in _pages(pool, ns):
                            files.write(ids, vectors, payloads, stamps)
                            shown.advance(paged)
                    out.append((ns, writer.end(None)))
                writer.finish()
            except BaseException:
                writer.discard()
                raise
            return out

    return Budget(name, timeout).run(run)


def export_namespace(
    name: str, namespace: str, out_dir: str, *, timeout: float | None = None, progress: TextIO | None = None
) -> int:
    """:func:`export_namespaces` of one namespace, into ``out_dir`` itself; returns its records."""
    return export_namespaces(name, [namespace], out_dir, timeout=timeout, progress=progress)[0][1]


def _payload_value(raw: bytes | None) -> Any:
    return None if raw is None or raw == b"null" else json.loads(raw)


def _store_meta(path: str) -> tuple[int, str]:
    """(dim, metric) of the store file ``path``. Raises ConfigError."""
    try:
        db = sqlite3.connect(path)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
        return int(meta["dim"]), str(meta["metric"])
    except (sqlite3.Error, KeyError, ValueError) as e:
        raise ConfigError(f"cannot read the store {path}: {e}") from None


def export_data_dir(
    data_dir: str, namespaces: list[str] | None, out_dir: str, *, progress: TextIO | None = None
) -> list[tuple[str, int]]:
    """Export ``namespaces`` (None: every one that holds records or a default TTL) of the store
    in ``data_dir`` to ``out_dir``, with every timestamp, each record's TTL and each namespace's
    default exactly; returns (namespace, records) of each. The data dir is locked meanwhile
    (DataDirInUse while a sidecar serves it). Records that have expired are left out, as a
    sidecar leaves them out of every answer. Raises ConfigError."""
    from kalos.sidecar_cuda.storage.datadir import lock_data_dir
    from kalos.sidecar_cuda.storage.sqlite import DB_FILE, Persistence, prepare_data_dir

    several = namespaces is None
    check_export_target(out_dir, several=several)
    path = os.path.join(data_dir, DB_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"no store in data dir {data_dir} ({DB_FILE} is missing)")
    prepare_data_dir(data_dir)
    with lock_data_dir(data_dir, "kalos export"):
        dim, metric = _store_meta(path)
        persist = Persistence(data_dir, dim, metric)
        try:
            held = dict(persist.namespaces())
            defaults = persist.default_ttls()
            todo = sorted(held) if namespaces is None else list(namespaces)
            missing = [ns for ns in todo if ns not in held]
            if missing:
                raise ConfigError(f"data dir {data_dir} holds no namespace {missing[0]!r}")
            writer = ExportWriter(out_dir, dim, metric, f"data dir {data_dir}", 1, several)
            out = []
            try:
                now = time.time_ns()
                for ns in todo:
                    files = writer.begin(ns)
                    with RowProgress(f"export {ns!r}", held[ns], stream=progress) as shown:
                        for ids, vecs, pls, st in persist.scan(ns, dim):
                            live = np.flatnonzero((st.expires == 0) | (st.expires > now))
                            files.write(
                                ids[live],
                                vecs[live],
                                [_payload_value(pls[i]) for i in live.tolist()],
                                stamps_array(st.created[live], st.updated[live], st.expires[live], st.ttl[live]),
                            )
                            shown.advance(len(ids))
                    out.append((ns, writer.end(int(defaults.get(ns, 0)))))
                writer.finish()
            except BaseException:
                writer.discard()
                raise
            return out
        finally:
            persist.close()


# --------------------------------------------------------------------------- reading an export
@dataclass(frozen=True)
class Export:
    """One namespace of an export on disk: ids, vectors (a memory map), the payload file, if any,
    with its line count checked, and (format 2) the stamps, the namespace's name and default TTL
    (ns; 0: none; None: not known)."""

    ids: np.ndarray
    vectors: np.ndarray
    payloads_path: str | None
    stamps: np.ndarray | None = None
    name: str | None = None
    default_ttl_ns: int | None = None

    def payload_blocks(self, rows: int) -> Iterator[list[Any] | None]:
        """The payloads of consecutive blocks of ``rows`` records (None without a payload file)."""
        if self.payloads_path is None:
            yield from repeat(None)
            return
        with open(self.payloads_path, encoding="utf-8") as f:
            lines = (line for line in f if line.strip())
            while True:
                yield [json.loads(line) for line in islice(lines, rows)]


@dataclass(frozen=True)
class ExportSet:
    """An export on disk: its format version, dim, metric (None: not recorded, format 1) and
    namespaces."""

    version: int
    dim: int
    metric: str | None
    namespaces: list[Export] = field(default_factory=list)
    precision_ns: int | None = None


def read_export(src: str) -> Export:
    """Open the files of one namespace's export (format 1 or 2; ``ids.npy`` and
    ``payloads.jsonl`` are optional in format 1). Raises ConfigError when its files are missing or
    disagree on the record count."""
    try:
        vectors = np.load(os.path.join(src, VECTORS), mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {src}/{VECTORS}: {e}") from None
    ids_path = os.path.join(src, IDS)
    ids = np.load(ids_path) if os.path.exists(ids_path) else np.arange(len(vectors), dtype=np.int64)
    if vectors.ndim != 2 or len(ids) != len(vectors):
        raise ConfigError(f"{src}: {len(ids)} ids for vectors of shape {vectors.shape}")
    stamps = None
    st_path = os.path.join(src, STAMPS)
    if os.path.exists(st_path):
        try:
            stamps = np.load(st_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {st_path}: {e}") from None
        if stamps.dtype != STAMPS_DTYPE or stamps.shape != (len(ids),):
            raise ConfigError(f"{st_path}: {stamps.shape} stamps of {stamps.dtype} for {len(ids)} records")
    pl_path = os.path.join(src, PAYLOADS)
    if not os.path.exists(pl_path):
        return Export(ids, vectors, None, stamps)
    with open(pl_path, encoding="utf-8") as f:
        n = sum(1 for line in f if line.strip())
    if n != len(ids):
        raise ConfigError(f"{pl_path}: {n} payloads for {len(ids)} vectors")
    return Export(ids, vectors, pl_path, stamps)


def open_export(src: str) -> ExportSet:
    """Open the export in ``src``: format 2 by its manifest, else format 1 (one namespace, no
    name, no timestamps). Raises ConfigError."""
    mpath = os.path.join(src, MANIFEST)
    if not os.path.exists(mpath):
        one = read_export(src)
        return ExportSet(1, int(one.vectors.shape[1]), None, [one])
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
        if m.get("format") != FORMAT:
            raise ConfigError(f"{mpath} is not the manifest of a kalos export")
        version = int(m["version"])
        if version > FORMAT_VERSION:
            raise ConfigError(
                f"{src} is an export of format {version}, written by a newer kalos; this one reads "
                f"formats 1 to {FORMAT_VERSION}: upgrade kalos to import it"
            )
        dim, metric = int(m["dim"]), str(m["metric"])
        entries = [(str(e["name"]), str(e["dir"]), e.get("default_ttl_ns")) for e in m["namespaces"]]
        precision = m.get("stamps_precision_ns")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read {mpath}: {e}") from None
    out = []
    for name, sub, default in entries:
        if os.path.isabs(sub) or ".." in sub.split("/"):
            raise ConfigError(f"{mpath}: namespace {name!r} lies outside the export ({sub!r})")
        one = read_export(os.path.join(src, sub))
        if one.vectors.shape[1] != dim:
            raise ConfigError(f"{src}/{sub}: vectors of dim {one.vectors.shape[1]}, the manifest says {dim}")
        out.append(
            Export(one.ids, one.vectors, one.payloads_path, one.stamps, name, None if default is None else int(default))
        )
    return ExportSet(version, dim, metric, out, None if precision is None else int(precision))


def _targets(data: ExportSet, namespace: str | None, src: str) -> list[tuple[str, Export]]:
    """(namespace written into, its export) of each namespace to import."""
    if namespace is not None:
        validate_namespace(namespace)
        if len(data.namespaces) != 1:
            raise ConfigError(
                f"{src} holds {len(data.namespaces)} namespaces: leave out NAMESPACE to import each "
                "into its own name, or import one of its subdirectories"
            )
        return [(namespace, data.namespaces[0])]
    if any(e.name is None for e in data.namespaces):
        raise ConfigError(f"{src} is an export of format 1, which names no namespace: give one (kalos import NS {src})")
    return [(str(e.name), e) for e in data.namespaces]


# --------------------------------------------------------------------------- import
@dataclass
class ImportReport:
    """What an import did: (namespace, records written, seconds) of each, the records left out
    because they had expired, and whether the timestamps were kept (a data dir) or restamped by
    the sidecar (through one; only ``expires_at`` kept)."""

    namespaces: list[tuple[str, int, float]] = field(default_factory=list)
    expired: int = 0
    stamps_kept: bool = False
    had_stamps: bool = False
    seconds: float = 0.0

    @property
    def records(self) -> int:
        return sum(n for _ns, n, _s in self.namespaces)


def _remaining_ttls(expires: np.ndarray, now: int) -> tuple[np.ndarray, list[float]]:
    """The rows still alive at ``now`` and the TTL (seconds) each is upserted with: what it has
    left, rounded up to the millisecond (rows expiring in the same millisecond share a request),
    ``inf`` for a record that never expires."""
    live = np.flatnonzero((expires == 0) | (expires > now))
    left_ms = -((now - expires[live]) // 1_000_000)  # ceil((expires - now) / 1 ms)
    ttls = [math.inf if e == 0 else ms / 1000.0 for e, ms in zip(expires[live].tolist(), left_ms.tolist())]
    return live, ttls


def import_export(
    name: str,
    src: str,
    namespace: str | None = None,
    *,
    timeout: float | None = None,
    pool_size: int = 16,
    progress: TextIO | None = None,
) -> ImportReport:
    """Upsert the export in ``src`` through the sidecar serving ``name``: into ``namespace``
    (an export of one namespace) or each namespace into its own name (None). Blocks of rows go
    through every slot of a pool at once; each block is acknowledged (durable) before the next.
    Records keep their ``expires_at`` (format 2; those expired since are skipped), the sidecar
    stamps ``created_at``/``updated_at`` (module text). ``timeout`` (seconds, None: no limit)
    bounds the whole import, connecting included; progress goes to ``progress`` (default:
    stderr). Raises ConfigError (unreadable export, another dim), BrokerUnavailable,
    CommandTimeout and the errors of ``RecallPool.upsert``; blocks acknowledged before an error
    stay written."""
    data = open_export(src)
    targets = _targets(data, namespace, src)
    report = ImportReport(had_stamps=any(e.stamps is not None for _ns, e in targets))

    async def run(budget: Budget) -> ImportReport:
        async with budget.pool(size=pool_size) as pool:
            if data.dim != pool.layout.dim:
                raise ConfigError(
                    f"{src} holds vectors of dim {data.dim}, broker {name!r} serves dim {pool.layout.dim}"
                )
            for ns, one in targets:
                t0 = time.perf_counter()
                n = 0
                if one.default_ttl_ns is not None:  # (0: none, as the source had)
                    await pool.set_default_ttl(ns, one.default_ttl_ns / NS if one.default_ttl_ns else None)
                blocks = one.payload_blocks(BLOCK_ROWS)
                with RowProgress(f"import {ns!r}", len(one.ids), stream=progress) as shown:
                    for lo in range(0, len(one.ids), BLOCK_ROWS):
                        hi = min(len(one.ids), lo + BLOCK_ROWS)
                        ids, vectors, pls = one.ids[lo:hi], np.asarray(one.vectors[lo:hi], np.float32), next(blocks)
                        ttls: list[float] | None = None
                        if one.stamps is not None:
                            live, ttls = _remaining_ttls(one.stamps["expires_at_ns"][lo:hi], time.time_ns())
                            report.expired += (hi - lo) - len(live)
                            if len(live) < hi - lo:
                                ids, vectors = ids[live], vectors[live]
                                pls = None if pls is None else [pls[i] for i in live.tolist()]
                        if len(ids):
                            n += await pool.upsert(ids, vectors, pls, namespace=ns, ttl=ttls)
                        shown.advance(hi - lo)
                report.namespaces.append((ns, n, time.perf_counter() - t0))
        return report

    t0 = time.perf_counter()
    Budget(name, timeout, dim=data.dim, metric=data.metric).run(run)
    report.seconds = time.perf_counter() - t0
    return report


def import_namespace(
    name: str,
    namespace: str,
    src: str,
    *,
    timeout: float | None = None,
    pool_size: int = 16,
    progress: TextIO | None = None,
) -> tuple[int, float]:
    """:func:`import_export` of an export of one namespace into ``namespace``; returns
    (records, seconds)."""
    r = import_export(name, src, namespace, timeout=timeout, pool_size=pool_size, progress=progress)
    return r.records, r.seconds


def import_into_data_dir(
    data_dir: str,
    src: str,
    namespace: str | None = None,
    *,
    metric: str | None = None,
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
    progress: TextIO | None = None,
) -> ImportReport:
    """Write the export in ``src`` into the store in ``data_dir`` directly, with the sidecar
    stopped (the data dir is locked meanwhile: DataDirInUse while a sidecar serves it): every
    timestamp and TTL as exported, each namespace's default TTL too. A missing store is made with
    the export's dim and ``metric`` (default: the export's). Records that have expired are
    skipped; a record whose own TTL the export does not know (an export through a sidecar) gets
    ``expires_at - updated_at``. Vectors, ids and payloads are checked as a sidecar checks them
    (payloads up to ``payload_limit`` bytes). Each block is one transaction: blocks committed
    before an error stay written. Raises ConfigError."""
    from kalos.sidecar_cuda.storage.datadir import lock_data_dir
    from kalos.sidecar_cuda.storage.durable import resolve_writes
    from kalos.sidecar_cuda.storage.sqlite import DB_FILE, Persistence, prepare_data_dir
    from kalos.sidecar_cuda.storage.store import Stamps
    from kalos.sidecar_cuda.storage.writes import Write, WriteOp

    data = open_export(src)
    targets = _targets(data, namespace, src)
    report = ImportReport(stamps_kept=True, had_stamps=any(e.stamps is not None for _ns, e in targets))
    path = os.path.join(data_dir, DB_FILE)
    t_all = time.perf_counter()
    prepare_data_dir(data_dir)
    with lock_data_dir(data_dir, "kalos import"):
        if os.path.isfile(path):
            dim, have = _store_meta(path)
            if metric is not None and metric != have:
                raise ConfigError(
                    f"the store in {data_dir} was made with metric {have}, not {metric}; import into "
                    "a new --data-dir to change the metric"
                )
            metric = have
            if data.dim != dim:
                raise ConfigError(f"{src} holds vectors of dim {data.dim}, the store in {data_dir} has dim {dim}")
        else:
            dim, metric = data.dim, metric or data.metric
            if metric is None:
                raise ConfigError(f"{src} does not record its metric (format 1): give --metric for the new store")
        persist = Persistence(data_dir, dim, metric)
        try:
            defaults = persist.default_ttls()
            for ns, one in targets:
                t0 = time.perf_counter()
                n = 0
                if one.default_ttl_ns is not None:
                    persist.commit([Write(WriteOp.SET_TTL, ns, ttl_ns=one.default_ttl_ns)])
                    defaults[ns] = one.default_ttl_ns
                blocks = one.payload_blocks(BLOCK_ROWS)
                with RowProgress(f"import {ns!r}", len(one.ids), stream=progress) as shown:
                    for lo in range(0, len(one.ids), BLOCK_ROWS):
                        hi = min(len(one.ids), lo + BLOCK_ROWS)
                        pls = next(blocks)
                        try:
                            ids = as_ids(one.ids[lo:hi])
                            vecs = as_vectors(np.asarray(one.vectors[lo:hi]), dim, VectorsFor.UPSERT)
                            lines = None if pls is None else payload_lines(pls, hi - lo)
                        except InvalidRequest as e:
                            raise ConfigError(f"{src}: records {lo} to {hi - 1} of {ns!r}: {e}") from None
                        for row, line in enumerate(lines or ()):
                            if len(line) > payload_limit:
                                raise ConfigError(
                                    f"{src}: the payload of id {int(ids[row])} in {ns!r} is {len(line)} bytes, "
                                    f"over --payload-limit {payload_limit}"
                                )
                        now = time.time_ns()
                        if one.stamps is None:
                            stamps = Stamps.written(hi - lo, now, int(defaults.get(ns, 0)))
                        else:
                            st = one.stamps[lo:hi]
                            exp = st["expires_at_ns"].astype(np.int64)
                            ttl = st["ttl_ns"].astype(np.int64)
                            guess = np.where(exp == 0, 0, np.maximum(exp - st["updated_at_ns"], 1))
                            ttl = np.where(ttl == TTL_UNKNOWN, guess, ttl)
                            stamps = Stamps(
                                st["created_at_ns"].astype(np.int64), st["updated_at_ns"].astype(np.int64), exp, ttl
                            )
                        keep = np.flatnonzero((stamps.expires == 0) | (stamps.expires > now))
                        report.expired += (hi - lo) - len(keep)
                        if len(keep):
                            payloads = (
                                None
                                if lines is None
                                else [None if lines[i] == b"null" else lines[i] for i in keep.tolist()]
                            )
                            w = Write(
                                WriteOp.UPSERT,
                                ns,
                                ids=ids[keep],
                                vectors=vecs[keep],
                                payloads=payloads,
                                now_ns=now,
                                stamps=stamps.take(keep),
                            )
                            try:
                                resolve_writes([w], None)  # (stamped already: nothing changes)
                                persist.commit([w])
                            except Exception as e:  # StoreError
                                raise ConfigError(f"writing into the store in {data_dir} failed: {e}") from None
                            n += len(keep)
                        shown.advance(hi - lo)
                report.namespaces.append((ns, n, time.perf_counter() - t0))
        finally:
            persist.close()
    report.seconds = time.perf_counter() - t_all
    return report


__all__ = [
    "export_namespace",
    "export_namespaces",
    "export_data_dir",
    "import_namespace",
    "import_export",
    "import_into_data_dir",
    "open_export",
    "read_export",
    "check_export_target",
    "stamps_array",
    "NpyAppender",
    "Export",
    "ExportSet",
    "ExportWriter",
    "ImportReport",
    "EXPORT_FILES",
    "BLOCK_ROWS",
    "FORMAT_VERSION",
    "STAMPS_DTYPE",
    "TTL_UNKNOWN",
]
