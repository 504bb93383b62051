"""The C client (``clients/c``), built with ``cc``, against real sidecars beside Python clients:
recalls checked against numpy float64, writes seen by Python, every error code, objects and
answers it must not trust, timeouts, and a C client killed while it holds leases.

The C side runs as ``clients/c/driver.c``: the library driven by line commands (one process, one
client), so that a test can interleave C calls with signals and Python calls.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
from conftest import assert_topk, free_port, slots_free, unique_name, wait_until

from kalos.broker.errors import ProtocolError, SlotsExhausted
from kalos.broker.layout import (
    _STATUS_ERRORS,
    MAGIC_U64,
    OWNER_ABANDONED,
    S_BUSY,
    S_DONE,
    S_POSTED,
    LatencyOp,
    Layout,
    SegmentView,
    SidecarState,
    Status,
)
from kalos.broker.names import bell_name, leases_path, shm_name
from kalos.broker.owners import sem_path, shm_path
from kalos.clients import RecallClient, RecallPool
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.serving.objects import create, unlink

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "clients" / "c"
CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O2", f"-I{SRC}", f"-I{ROOT / 'broker'}"]
DIM, NS = 32, "c-ns"
NOBODY = 65534

# How the C codes map the protocol's statuses: as broker/layout.py maps them to exceptions.
CODE_OF_ERROR = {
    "InvalidRequest": "KALOS_E_INVALID",
    "UnknownNamespace": "KALOS_E_UNKNOWN_NAMESPACE",
    "PayloadTooLarge": "KALOS_E_PAYLOAD_TOO_LARGE",
    "ServerError": "KALOS_E_SERVER",
    "ProtocolError": "KALOS_E_PROTOCOL",
    "PositionTimeout": "KALOS_E_TIMEOUT",
}


# --------------------------------------------------------------------------- build


@dataclass(frozen=True)
class Build:
    driver: Path
    example: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The library with the driver and the example, and the shared library, built with cc."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler (cc)")
    out = tmp_path_factory.mktemp("cclient")
    lib = SRC / "kalos.c"
    for args in (
        [str(SRC / "driver.c"), str(lib), "-o", str(out / "driver"), "-lpthread"],
        [str(SRC / "example.c"), str(lib), "-o", str(out / "example"), "-lpthread"],
        ["-shared", "-fPIC", "-fvisibility=hidden", str(lib), "-o", str(out / "libkalos.so"), "-lpthread"],
    ):
        r = subprocess.run([cc, *CFLAGS, *args], capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()
    return Build(out / "driver", out / "example")


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None, reason="no make or cc")
def test_makefile_builds_the_libraries_and_programs(tmp_path: Path) -> None:
    r = subprocess.run(["make", "-C", str(SRC), f"O={tmp_path}"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    for f in ("libkalos.a", "libkalos.so", "example", "driver"):
        assert (tmp_path / f).is_file(), f


# --------------------------------------------------------------------------- the driver


class CError(Exception):
    """A C call's error: its code name (KALOS_E_...), the rows a write applied, the detail."""

    def __init__(self, code: str, done: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code, self.done, self.detail = code, done, detail


def _floats(a: np.ndarray) -> str:
    return " ".join(float(x).hex() for x in np.asarray(a, np.float32).ravel())


def _hits(tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([int(t) for t in tokens[0::2]], np.int64), np.array(
        [float.fromhex(t) for t in tokens[1::2]], np.float32
    )


class Driver:
    """One C client process (clients/c/driver.c) and its command lines."""

    def __init__(self, exe: Path) -> None:
        self.p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""

    def line(self, timeout: float = 30.0) -> str:
        assert self.p.stdout is not None
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            assert left > 0, "the C driver did not answer in time"
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if ready:
                chunk = os.read(self.p.stdout.fileno(), 1 << 20)
                assert chunk, f"the C driver exited (code {self.p.poll()})"
                self._buf += chunk
        text, self._buf = self._buf.split(b"\n", 1)
        return text.decode()

    def cmd(self, text: str, timeout: float = 30.0) -> list[str]:
        assert self.p.stdin is not None
        self.p.stdin.write(text.encode() + b"\n")
        self.p.stdin.flush()
        words = self.line(timeout).split(" ")
        if words[0] == "err":
            raise CError(words[1], int(words[2]), " ".join(words[3:]))
        assert words[0] != "bad", f"the driver refused {text[:80]!r}"
        return words

    def open(self, name: str, *, uid: int = -1, slots: int = 1, connect_ms: int = 0, spin_us: int = 250) -> list[str]:
        return self.cmd(f"open {name} {uid} {slots} {connect_ms} {spin_us}")

    def recall(self, q: np.ndarray, k: int, *, ns: str = NS, timeout_ms: int = 10_000, dim: int | None = None):
        words = self.cmd(f"recall {ns} {k} {timeout_ms} {dim or q.size} {_floats(q)}")
        assert int(words[1]) * 2 == len(words) - 2
        return _hits(words[2:])

    def recall_many(self, qs: np.ndarray, k: int, *, ns: str = NS, timeout_ms: int = 10_000):
        words = self.cmd(f"recall_many {ns} {k} {timeout_ms} {len(qs)} {qs.shape[1]} {_floats(qs)}")
        return [_hits(self.line().split()) for _ in range(int(words[2]))]

    def upsert(
        self,
        ids,
        vecs: np.ndarray,
        payloads: list[bytes | None] | None = None,
        *,
        ns: str = NS,
        timeout_ms: int = 10_000,
    ) -> int:
        text = f"upsert {ns} {timeout_ms} {len(ids)} {vecs.shape[1]} {' '.join(str(i) for i in ids)} {_floats(vecs)}"
        if payloads is not None:
            text += " " + " ".join("-" if p is None else p.hex() for p in payloads)
        return int(self.cmd(text)[1])

    def embed(self, texts: list[bytes], *, timeout_ms: int = 10_000) -> np.ndarray:
        words = self.cmd(f"embed {timeout_ms} {len(texts)} " + " ".join(t.hex() or "-" for t in texts))
        n, dim = int(words[1]), int(words[2])
        return np.array([float.fromhex(x) for x in words[3:]], np.float32).reshape(n, dim)

    def delete(self, ids, *, ns: str = NS, timeout_ms: int = 10_000) -> int:
        return int(self.cmd(f"delete {ns} {timeout_ms} {len(ids)} {' '.join(str(i) for i in ids)}")[1])

    def end(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def drivers(build: Build) -> Iterator[list[Driver]]:
    """``drivers.append(Driver(...))``: every driver is ended (killed if need be) at teardown."""
    made: list[Driver] = []
    yield made
    for d in made:
        d.end()


def new_driver(drivers: list[Driver], build: Build) -> Driver:
    d = Driver(build.driver)
    drivers.append(d)
    return d


def sidecar_with_rows(sidecar_factory, rng: np.random.Generator, *args: str, rows: int = 500):
    """A numpy sidecar of dim 32 (8 slots, max_k 64, 8 queries a slot), ``rows`` fresh random rows
    upserted into NS from Python; the rows are returned as the float64 reference's matrix."""
    h = sidecar_factory(
        "c", "--dim", str(DIM), "--slots", "8", "--max-k", "64", "--max-queries", "8", "--backend", "numpy", *args
    )
    matrix = rng.standard_normal((rows, DIM), dtype=np.float32)
    with RecallClient(h.name) as c:
        assert c.upsert(np.arange(rows), matrix, namespace=NS) == rows
    return h, matrix


def scrape(port: int) -> dict[tuple[str, str], float]:
    """kalos_client_requests_total by (op, outcome) from a sidecar's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for op, outcome, v in re.findall(
        r'^kalos_client_requests_total\{op="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.MULTILINE
    ):
        out[(op, outcome)] = float(v)
    return out


# --------------------------------------------------------------------------- recalls


def test_recalls_from_c_match_numpy_beside_a_python_pool(sidecar_factory, rng, build, drivers):
    """recall and recall_many from C (from one thread and from several on one client) are the
    exact top-k of fresh queries against float64, while a Python RecallPool recalls on the same
    sidecar; the sidecar's metrics count the C client's calls by kind."""
    port = free_port()
    h, matrix = sidecar_with_rows(sidecar_factory, rng, "--metrics-port", str(port))
    stop = threading.Event()
    pool_done = {"recalls": 0}
    pool_error: list[BaseException] = []
    pool_seed = int(rng.integers(2**32))

    def python_pool() -> None:
        async def main() -> None:
            prng = np.random.default_rng(pool_seed)
            async with RecallPool(h.name, size=4) as pool:

                async def task() -> None:
                    while not stop.is_set():
                        q = prng.standard_normal(DIM, dtype=np.float32)
                        hits = await pool.recall(q, k=10, namespace=NS, timeout=10)
                        assert_topk(q, matrix, hits.ids, hits.scores, 10)
                        pool_done["recalls"] += 1

                await asyncio.gather(*(task() for _ in range(4)))

        try:
            asyncio.run(main())
        except BaseException as e:
            pool_error.append(e)

    t = threading.Thread(target=python_pool, daemon=True)
    t.start()
    try:
        d = new_driver(drivers, build)
        assert d.open(h.name, slots=3) == ["ok", str(DIM), "64", "8", "dot", "3"]
        for k in (1, 10, 64):
            q = rng.standard_normal(DIM, dtype=np.float32)
            ids, scores = d.recall(q, k)
            assert_topk(q, matrix, ids, scores, k)
        for nq in (1, 3, 8):
            qs = rng.standard_normal((nq, DIM), dtype=np.float32)
            answers = d.recall_many(qs, 10)
            assert len(answers) == nq
            for q, (ids, scores) in zip(qs, answers):
                assert_topk(q, matrix, ids, scores, 10)
        # Several threads on one client: 40 recalls over 6 threads and its 3 slots.
        qs = rng.standard_normal((40, DIM), dtype=np.float32)
        words = d.cmd(f"parallel {NS} 7 10000 6 40 {DIM} {_floats(qs)}")
        assert words == ["ok", "40"]
        for q in qs:
            tokens = d.line().split()
            assert tokens[0] == "7", tokens
            ids, scores = _hits(tokens[1:])
            assert_topk(q, matrix, ids, scores, 7)
        assert wait_until(lambda: pool_done["recalls"] >= 20, 30), "the Python pool made no progress"
    finally:
        stop.set()
        t.join(timeout=30)
    assert not pool_error, pool_error
    # Counted by the sidecar from the slots' stats blocks: the C client's 3 + 40 recalls and 3
    # recall_many beside the pool's recalls (read while the C client is attached).
    expected = {("recall", "ok"): 43 + pool_done["recalls"], ("recall_many", "ok"): 3, ("recall", "timeout"): 0}

    def counted() -> dict:
        got = scrape(port)
        return {key: got.get(key) for key in expected}

    assert wait_until(lambda: counted() == expected, 10), (counted(), expected)


def test_example_program(sidecar_factory, rng, build):
    """The example upserts 100 records with payloads and prints the top 5 of record 7: checked
    against float64 on the vectors and payloads Python reads back."""
    h = sidecar_factory("cx", "--dim", "24", "--backend", "numpy")
    r = subprocess.run([str(build.example), h.name, "ex"], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "metric dot dim 24"
    hits = np.array([line.split() for line in lines[1:]], float)
    with RecallClient(h.name) as c:
        rec = c.get(np.arange(100), namespace="ex")
    assert rec.missing.size == 0 and rec.payloads == [{"row": i} for i in range(100)]
    assert_topk(rec.vectors[7], rec.vectors, hits[:, 0].astype(np.int64), hits[:, 1].astype(np.float32), 5)


# --------------------------------------------------------------------------- writes


def test_writes_from_c_are_seen_by_python(sidecar_factory, rng, build, drivers):
    """Upserts (chunked: more rows than a slot holds) and deletes from C, read back by Python;
    what a failed write left (the chunks before it) as the header says."""
    h, matrix = sidecar_with_rows(sidecar_factory, rng, "--blob-bytes", "1024", rows=50)
    d = new_driver(drivers, build)
    d.open(h.name)
    ids = np.arange(1000, 1037)  # 5 chunks of at most 8 rows
    vecs = rng.standard_normal((37, DIM), dtype=np.float32)
    payloads = [None if i % 3 == 0 else json.dumps({"i": int(i), "tag": "c"}).encode() for i in ids]
    assert d.upsert(ids, vecs, payloads, ns="fresh") == 37
    with RecallClient(h.name) as c:
        rec = c.get(ids, namespace="fresh")
        np.testing.assert_array_equal(rec.ids, ids)
        np.testing.assert_array_equal(rec.vectors, vecs)  # float32 exactly, as sent
        assert rec.payloads == [None if p is None else json.loads(p) for p in payloads]
        # Python's recall finds the C rows; C's recall finds Python's and its own.
        q = rng.standard_normal(DIM, dtype=np.float32)
        hits = c.recall(q, k=5, namespace="fresh")
        assert_topk(q, vecs, hits.ids - 1000, hits.scores, 5)
        both = np.concatenate([matrix, vecs])
        d.upsert(ids, vecs)  # the same records into NS too (payloads replaced by none)
        ids_c, scores_c = d.recall(q, 20)
        assert_topk(q, both, np.where(ids_c >= 1000, ids_c - 1000 + 50, ids_c), scores_c, 20)
        # Deletes in chunks; unknown ids count nothing.
        assert d.delete([*ids[:20].tolist(), 5_000_000], ns="fresh") == 20
        assert c.count(namespace="fresh") == 17
        assert c.get(ids, namespace="fresh").missing.tolist() == ids[:20].tolist()
        assert d.delete([1, 2], ns="never-made") == 0
        # Payloads pack the chunks too: 3 of these fill a slot's 1024-byte blob area; one
        # larger than the area is refused before anything is sent.
        big = [json.dumps({"i": i, "pad": "x" * 290}).encode() for i in range(12)]
        assert d.upsert(np.arange(3000, 3012), rng.standard_normal((12, DIM), dtype=np.float32), big, ns="big") == 12
        # (read back two at a time: a get's answer carries each record's 32-byte timestamps too)
        read = [x for lo in range(3000, 3012, 2) for x in c.get(np.arange(lo, lo + 2), namespace="big").payloads]
        assert read == [json.loads(p) for p in big]
        with pytest.raises(CError, match="at most 1024") as e:
            d.upsert([3100], rng.standard_normal((1, DIM), dtype=np.float32), [b'"' + b"y" * 1100 + b'"'], ns="big")
        assert e.value.code == "KALOS_E_PAYLOAD_TOO_LARGE" and e.value.done == 0
        assert c.count(namespace="big") == 12
        # A payload the sidecar refuses (not JSON) in the second chunk: the first chunk was
        # applied, the rest not, and the error says how many rows were.
        bad = [b'{"ok": 1}'] * 10 + [b"{not json"] + [b"1"] * 5
        with pytest.raises(CError) as e:
            d.upsert(np.arange(2000, 2016), rng.standard_normal((16, DIM), dtype=np.float32), bad, ns="partial")
        assert e.value.code == "KALOS_E_PROTOCOL" and "BAD_REQUEST" in e.value.detail and e.value.done == 8
        assert c.get(np.arange(2000, 2016), namespace="partial").ids.tolist() == list(range(2000, 2008))


def test_error_codes(sidecar_factory, rng, build, drivers):
    """Every error a C caller can meet without a broken sidecar, with its code and detail; and
    the mapping of every protocol status, against broker/layout.py's."""
    h, matrix = sidecar_with_rows(sidecar_factory, rng, rows=20)
    d = new_driver(drivers, build)
    # Before a sidecar: a name none serves, at once and after waiting; a malformed name.
    gone = unique_name("none")
    with pytest.raises(CError, match="no sidecar serves") as e:
        d.open(gone)
    assert e.value.code == "KALOS_E_UNAVAILABLE"
    t0 = time.monotonic()
    with pytest.raises(CError) as e:
        d.open(gone, connect_ms=300)
    assert e.value.code == "KALOS_E_UNAVAILABLE" and time.monotonic() - t0 >= 0.25
    with pytest.raises(CError, match="broker name must match") as e:
        d.open("../etc")
    assert e.value.code == "KALOS_E_INVALID"
    with pytest.raises(CError, match="9 slots asked for; broker .* has 8") as e:
        d.open(h.name, slots=9)
    assert e.value.code == "KALOS_E_INVALID"
    d.open(h.name)
    q = rng.standard_normal(DIM, dtype=np.float32)
    # A client belongs to the process that opened it: in a forked child every call is refused.
    child = d.cmd(f"forked {NS} 3 {DIM} {_floats(q)}")
    assert child[0] == "KALOS_E_INVALID" and "(a fork)" in " ".join(child), child
    ids, scores = d.recall(q, 3)  # and the parent's client is untouched
    assert_topk(q, matrix, ids, scores, 3)
    # A namespace never written holds nothing: KALOS_OK and no hits, one query or several.
    ids, scores = d.recall(q, 5, ns="nope")
    assert ids.tolist() == [] and scores.tolist() == []
    assert [h[0].tolist() for h in d.recall_many(np.stack([q, -q]), 5, ns="nope")] == [[], []]
    NEWLINE_JSON = b"[1,\n2]".hex()  # valid JSON, but not one line
    cases = [
        (f"recall {NS} 5 1000 {DIM - 1} {_floats(q[:-1])}", "KALOS_E_INVALID", "dim 31; the sidecar's dim is 32"),
        (f"recall {NS} 0 1000 {DIM} {_floats(q)}", "KALOS_E_INVALID", "k must be in 1..64, got 0"),
        (f"recall {NS} 65 1000 {DIM} {_floats(q)}", "KALOS_E_INVALID", "k must be in 1..64, got 65"),
        (f"recall bad/ns 5 1000 {DIM} {_floats(q)}", "KALOS_E_INVALID", "namespace must match"),
        (f"recall {NS} 5 1000 {DIM} nan {_floats(q[1:])}", "KALOS_E_INVALID", "NaN or infinity"),
        (
            f"recall_many {NS} 5 1000 9 {DIM} {_floats(np.ones((9, DIM)))}",
            "KALOS_E_INVALID",
            "9 queries; 1..8 fit one slot",
        ),
        (f"upsert {NS} 1000 1 {DIM} -4 {_floats(q)}", "KALOS_E_INVALID", "ids must be >= 0"),
        (f"upsert {NS} 1000 1 {DIM} 4 {_floats(q)} {NEWLINE_JSON}", "KALOS_E_INVALID", "newline"),
        (
            f"upsert {NS} 1000 1 {DIM} 4 {_floats(q)} {(b'1' * 20000).hex()}",
            "KALOS_E_PAYLOAD_TOO_LARGE",
            "at most 16384",
        ),
    ]
    for text, code, detail in cases:
        with pytest.raises(CError) as e:
            d.cmd(text)
        assert e.value.code == code and detail in e.value.detail, (text[:40], e.value)
    with RecallClient(h.name) as c:
        assert c.count(namespace=NS) == 20, "a refused write changed something"
    ids, scores = d.recall(q, 5)  # and the client goes on
    assert_topk(q, matrix, ids, scores, 5)
    for status in list(Status) + [99, -1]:
        expected = "KALOS_OK" if status == 0 else CODE_OF_ERROR[_STATUS_ERRORS.get(status, ProtocolError).__name__]
        assert d.cmd(f"status {int(status)}") == [expected], status


# --------------------------------------------------------------------------- trust


def test_objects_it_must_not_trust_are_refused(sidecar_factory, build, drivers):
    """Owner and mode of every object, checked before a byte is written."""
    h = sidecar_factory("ct", "--dim", "8", "--backend", "numpy", "--slots", "2")
    d = new_driver(drivers, build)
    with pytest.raises(CError, match=rf"belongs to uid {os.geteuid()}, not to the expected uid {NOBODY}") as e:
        d.open(h.name, uid=NOBODY)
    assert e.value.code == "KALOS_E_UNTRUSTED"
    for path, mode, what in (
        (shm_path(shm_name(h.name)), 0o606, "shared memory"),
        (sem_path(bell_name(h.name)), 0o640, "semaphore"),
        (leases_path(h.name), 0o604, "lease file"),
    ):
        os.chmod(path, mode)
        try:
            with pytest.raises(CError, match=rf"{what} .* has mode {mode:04o}") as e:
                d.open(h.name)
            assert e.value.code == "KALOS_E_UNTRUSTED"
        finally:
            os.chmod(path, 0o600)
    # Group access is what a sidecar run as a dedicated user grants (its uid given); others never.
    seg = shm_path(shm_name(h.name))
    os.chmod(seg, 0o660)
    try:
        with pytest.raises(CError, match="open to its group"):
            d.open(h.name)
        assert d.open(h.name, uid=os.geteuid())[0] == "ok"
    finally:
        os.chmod(seg, 0o600)
    if os.geteuid() == 0:  # another owner, as a squatter would have it
        os.chown(seg, NOBODY, -1)
        try:
            with pytest.raises(CError, match=f"belongs to uid {NOBODY}") as e:
                d.open(h.name)
            assert e.value.code == "KALOS_E_UNTRUSTED"
        finally:
            os.chown(seg, 0, -1)
    assert d.open(h.name)[0] == "ok"


@pytest.fixture
def forged_segment() -> Iterator[Callable[..., str]]:
    """``make(size, header_edits)``: a segment of this uid, mode 0600, with a valid header for a
    small geometry, then edited; no sidecar, no semaphores (the checks before them refuse it)."""
    made: list[str] = []

    def make(size: int | None, **edits: int) -> str:
        name = unique_name("forged")
        made.append(name)
        lay = Layout(n_slots=2, dim=4, max_k=4, max_queries=2, blob_bytes=1024)
        total = lay.total_bytes if size is None else size
        shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=0o600, size=total)
        if total >= lay.total_bytes:
            mm = mmap.mmap(shm.fd, total)
            seg = SegmentView(memoryview(mm), lay)
            seg.init_header(metric=1, backend=1, pid=os.getpid(), start_epoch_ns=time.time_ns(), payload_limit=100)
            for field, value in edits.items():
                seg.header[field] = value
            del seg
            mm.close()
        shm.close_fd()
        return name

    yield make
    for name in made:
        posix_ipc.unlink_shared_memory(shm_name(name))


def test_segments_that_are_not_a_kalos_sidecars_are_refused(build, drivers, forged_segment):
    d = new_driver(drivers, build)
    lay = Layout(n_slots=2, dim=4, max_k=4, max_queries=2, blob_bytes=1024)
    for name, code, detail in (
        (forged_segment(0), "KALOS_E_UNAVAILABLE", "still starting"),
        (forged_segment(100), "KALOS_E_PROTOCOL", "segment of 100 bytes is not a Kalos segment"),
        (forged_segment(None, magic=0), "KALOS_E_UNAVAILABLE", "still starting"),
        (forged_segment(None, magic=MAGIC_U64 ^ 1), "KALOS_E_PROTOCOL", "bad magic"),
        (forged_segment(None, version=4), "KALOS_E_PROTOCOL", "speaks protocol version 4"),
        (forged_segment(None, n_slots=3), "KALOS_E_PROTOCOL", "does not match the segment"),
        (forged_segment(None, dim=0), "KALOS_E_PROTOCOL", "does not match the segment"),
        (forged_segment(None, blob_bytes=2**63), "KALOS_E_PROTOCOL", "does not match the segment"),
        (forged_segment(None, slot_bytes=lay.slot_bytes + 4096), "KALOS_E_PROTOCOL", "does not match"),
        (forged_segment(None, hist_buckets=39), "KALOS_E_PROTOCOL", "latency layout"),
    ):
        with pytest.raises(CError) as e:
            d.open(name)
        assert e.value.code == code and detail in e.value.detail, (name, e.value)


class ForgedSidecar:
    """A sidecar of this process (real objects, its lock byte held, a live heartbeat) whose
    answers the test writes, so that answers breaking the protocol can be sent to a client."""

    def __init__(self, name: str) -> None:
        self.layout = Layout(n_slots=2, dim=4, max_k=4, max_queries=2, blob_bytes=1024)
        self.name = name
        self.objs = create(name, self.layout)
        self.seg = SegmentView(memoryview(self.objs.mm), self.layout)
        self.seg.init_header(metric=1, backend=1, pid=os.getpid(), start_epoch_ns=time.time_ns(), payload_limit=100)
        self.seg.header["heartbeat_ns"] = time.monotonic_ns()
        self.seg.header["state"] = SidecarState.READY
        self.answers: queue.Queue[dict | None] = queue.Queue()  # None: hold the request unanswered
        self.held: list[tuple[int, int]] = []
        self.asked: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.seg.header["heartbeat_ns"] = time.monotonic_ns()
            for i in range(self.layout.n_slots):
                try:
                    self.objs.req[i].acquire(0)
                except posix_ipc.BusyError:
                    continue
                how = self.answers.get(timeout=10)  # (put by the test before the client posts)
                with self._lock:
                    ctl = self.seg.slots[i]
                    assert int(ctl["state"]) == S_POSTED
                    ctl["state"] = S_BUSY
                    self.asked.append(self.seg.slot[i].queries[0].copy())
                    if how is None:
                        self.held.append((i, int(ctl["generation"])))
                    else:
                        self._answer(i, int(ctl["generation"]), **how)
            time.sleep(0.001)

    def _answer(self, i: int, gen: int, ids=(), status=0, n=None, blob=b"", echo=None, blob_len=None, state=S_DONE):
        v, ctl = self.seg.slot[i], self.seg.slots[i]
        v.result_ids[0, : len(ids)] = ids
        v.result_scores[0, : len(ids)] = np.arange(len(ids), 0, -1)
        v.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
        ctl["status"] = status
        ctl["n_results"] = len(ids) if n is None else n
        ctl["blob_len"] = len(blob) if blob_len is None else blob_len
        ctl["resp_generation"] = gen if echo is None else echo
        ctl["t_done_ns"] = time.monotonic_ns()
        ctl["state"] = state
        self.objs.resp[i].release()

    def answer_held(self, **how) -> None:
        with self._lock:
            i, gen = self.held.pop(0)
            self._answer(i, gen, **how)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        del self.seg
        unlink(self.name, self.objs)


def test_answers_that_break_the_protocol_are_refused(build, drivers):
    """Everything a sidecar writes is untrusted too: an answer to another request, counts beyond
    what was asked, a blob beyond its area, an unknown status, a post without DONE. Each is a
    clear error, and the client goes on; a late answer is consumed, never handed to the next
    call."""
    sc = ForgedSidecar(unique_name("liar"))
    try:
        d = new_driver(drivers, build)
        d.open(sc.name, spin_us=0)
        q = np.array([1, 2, 3, 4], np.float32)

        def recall(**how) -> tuple[np.ndarray, np.ndarray]:
            sc.answers.put(how)
            return d.recall(q, 3, ns="x", timeout_ms=5000)

        ids, scores = recall(ids=[7, 5, 3])
        assert ids.tolist() == [7, 5, 3] and scores.tolist() == [3, 2, 1]
        for how, detail in (
            (dict(ids=[1], echo=12345), "response for request 12345"),
            (dict(ids=[1, 2, 3], n=4), "n_results 4 for 3 asked"),
            (dict(status=Status.K_OUT_OF_RANGE, blob=b"x", blob_len=1025), "blob_len 1025 beyond the blob area"),
            (dict(status=99, blob=b"what"), "status 99: what"),
            (dict(ids=[1], state=S_BUSY), "posted in state 3, not DONE"),
        ):
            with pytest.raises(CError) as e:
                recall(**how)
            assert e.value.code == "KALOS_E_PROTOCOL" and detail in e.value.detail, e.value
        with pytest.raises(CError) as e:  # the sidecar's text, made printable
            recall(status=Status.K_OUT_OF_RANGE, blob=b"k too\nbig")
        assert e.value.code == "KALOS_E_INVALID" and e.value.detail == "K_OUT_OF_RANGE: k too?big"
        # No answer within the budget: a timeout; the request stays in the slot.
        sc.answers.put(None)
        with pytest.raises(CError) as e:
            d.recall(q, 3, ns="x", timeout_ms=200)
        assert e.value.code == "KALOS_E_TIMEOUT"
        sc.answer_held(ids=[111])  # the late answer
        ids, _ = recall(ids=[222])
        assert ids.tolist() == [222], "the late answer reached the next call"
        assert len(sc.asked) == 9 and (sc.asked[-1] == q).all()
    finally:
        for dr in drivers:
            dr.end()
        sc.stop()


# --------------------------------------------------------------------------- timeouts, kills


def test_a_timeout_keeps_the_slot_until_the_late_answer(sidecar_factory, rng, build, drivers):
    """The sidecar stopped (SIGSTOP): a recall times out and its request stays POSTED in the
    slot, counted as a timeout in the slot's stats; once the sidecar resumes, the next call
    consumes the late answer and gets its own. Closed with a request in flight, the slot is
    abandoned to the reaper, which frees it."""
    h, matrix = sidecar_with_rows(sidecar_factory, rng, rows=100)
    d = new_driver(drivers, build)
    d.open(h.name, spin_us=0)
    watch = Connection(h.name)
    try:
        mine = np.flatnonzero(watch.seg.slots["owner_pid"] == d.p.pid)
        assert mine.size == 1
        i = int(mine[0])
        q1, q2 = rng.standard_normal((2, DIM), dtype=np.float32)
        h.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(CError) as e:
                d.recall(q1, 5, timeout_ms=300)
            assert e.value.code == "KALOS_E_TIMEOUT"
            assert int(watch.seg.slots[i]["state"]) == S_POSTED
            assert int(watch.seg.stats[i]["timeout_count"][LatencyOp.RECALL]) == 1
        finally:
            h.proc.send_signal(signal.SIGCONT)
        ids, scores = d.recall(q2, 5)
        assert_topk(q2, matrix, ids, scores, 5)
        lat_count = int(watch.seg.stats[i]["lat_count"])
        assert lat_count >= 1 and int(watch.seg.slot[i].hist[LatencyOp.RECALL].sum()) >= 1
        # Closed while a request is in flight: abandoned (-1) until the reaper frees it.
        h.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(CError):
                d.recall(q1, 5, timeout_ms=100)
            d.cmd("close")
            assert int(watch.seg.slots[i]["owner_pid"]) == OWNER_ABANDONED
        finally:
            h.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: slots_free(h.name), 10), "the abandoned slot was not freed"
    finally:
        watch.close()


def test_a_killed_c_client_gives_its_slots_back(sidecar_factory, rng, build, drivers):
    """A C client leasing every slot: the reaper leaves live leases alone, other clients get
    SlotsExhausted; killed with SIGKILL, its slots are reclaimed and a Python pool leases them
    all."""
    h = sidecar_factory("ck", "--dim", "8", "--backend", "numpy", "--slots", "4", "--random-rows", "50")
    holder = new_driver(drivers, build)
    assert holder.open(h.name, slots=4)[-1] == "4"
    assert holder.cmd("hold") == ["holding"]
    time.sleep(0.6)  # two passes of the reaper: a live lease is kept
    assert not slots_free(h.name)
    other = new_driver(drivers, build)
    with pytest.raises(CError, match="1 slot\\(s\\) asked for, 0 of its 4 free") as e:
        other.open(h.name)
    assert e.value.code == "KALOS_E_SLOTS_EXHAUSTED"
    with pytest.raises(SlotsExhausted):
        RecallClient(h.name, connect_timeout=0.2)
    holder.p.kill()
    holder.p.wait()
    assert wait_until(lambda: slots_free(h.name), 10), "the killed client's slots were not reclaimed"

    async def python_pool() -> int:
        async with RecallPool(h.name, size=4, min_size=4) as pool:
            hits = await asyncio.gather(
                *(pool.recall(np.ones(8, np.float32), k=3, namespace="default") for _ in range(8))
            )
            return len(hits)

    assert asyncio.run(python_pool()) == 8
    assert other.open(h.name, connect_ms=2000)[0] == "ok"


def test_texts_from_c_are_embedded_by_the_sidecars_model(sidecar_factory, rng, build, drivers, tmp_path):
    """kalos_embed: the vectors Python's client gets, in chunks (more texts than a slot holds);
    a bad text refused before sending or by the sidecar (invalid UTF-8), a sidecar with no model."""
    pytest.importorskip("tokenizers")
    from kalos.testing.tinymodel import WORDS, build_tiny_model

    model = build_tiny_model(tmp_path / "m", dim=16, heads=2, seed=9)
    h = sidecar_factory("cembed", "--dim", "16", "--metric", "cosine", "--max-queries", "8", "--embed", str(model))
    d = new_driver(drivers, build)
    d.open(h.name)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(1, 12)))).encode() for _ in range(19)] + ["東京 café".encode()]
    got = d.embed(texts)  # 20 texts: 3 requests
    with RecallClient(h.name) as c:
        want = c.embed([t.decode() for t in texts])
    np.testing.assert_array_equal(got, want)  # the same model, the same float32 answers
    for bad, code, match in (
        ([b"ok", b"   "], "KALOS_E_INVALID", "text 1 is empty"),
        ([b"x" * 16385], "KALOS_E_INVALID", "text 0 is 16385 bytes"),
        ([b"fine", b"\xff\xfe"], "KALOS_E_PROTOCOL", "text 1 is not valid UTF-8"),
    ):
        with pytest.raises(CError, match=match) as e:
            d.embed(bad)
        assert e.value.code == code
    plain = sidecar_factory("cplain", "--dim", "16")
    p = new_driver(drivers, build)
    p.open(plain.name)
    with pytest.raises(CError, match="serves no embedding model") as e:
        p.embed([b"hello"])
    assert e.value.code == "KALOS_E_INVALID"
