"""Shared fixtures: real sidecar processes on real shared memory, seeds that are printed."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import pytest_asyncio

from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process

_counter = itertools.count()
#: Run the behavioural suites against another backend: KALOS_TEST_BACKEND=cuda pytest tests/test_broker.py
TEST_BACKEND = os.environ.get("KALOS_TEST_BACKEND", "numpy")
#: ... and sharded: KALOS_TEST_SHARDS=3 gives every sidecar that names no --shards three shards.
TEST_SHARDS = os.environ.get("KALOS_TEST_SHARDS", "")
#: CUDA sidecars of the behavioural suites search on the GPU even where the work is small enough
#: for the host copy (--host-search-work 0), so the suites cover the kernels; tests/gpu covers the
#: host path. KALOS_TEST_HOST_SEARCH=default keeps the sidecar's default instead.
TEST_HOST_SEARCH = os.environ.get("KALOS_TEST_HOST_SEARCH", "0")


def unique_name(tag: str) -> str:
    return f"t{os.getpid()}-{tag}-{next(_counter)}"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    fixed = os.environ.get("KALOS_TEST_SEED")  # replay a printed seed
    s = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    print(f"\n[seed] {request.node.name}: {s}")
    return s


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


class SidecarHandle:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], args: list[str]) -> None:
        self.name = name
        self.proc = proc
        self.args = args

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def sidecar_factory():
    """Start real sidecar processes: ``start(tag, *args)``; all are stopped and cleaned at teardown."""
    handles: list[SidecarHandle] = []

    def start(
        tag: str = "s", *args: str, name: str | None = None, ephemeral: bool = True, env: dict[str, str] | None = None
    ) -> SidecarHandle:
        name = name or unique_name(tag)
        full = (["--ephemeral"] if ephemeral else []) + list(args)
        if "--backend" in full:  # KALOS_TEST_BACKEND swaps numpy; a test naming cuda keeps it
            i = full.index("--backend") + 1
            if full[i] == "numpy":
                full[i] = TEST_BACKEND
        else:
            full += ["--backend", TEST_BACKEND]
        if TEST_SHARDS and "--shards" not in full:
            full += ["--shards", TEST_SHARDS]
        if (
            full[full.index("--backend") + 1] == "cuda"
            and TEST_HOST_SEARCH != "default"
            and "--host-search-work" not in full
        ):
            full += ["--host-search-work", TEST_HOST_SEARCH]
        proc = start_sidecar_process(full, name, timeout=60, env=env)
        h = SidecarHandle(name, proc, full)
        handles.append(h)
        backend = full[full.index("--backend") + 1]
        if backend in ("numpy", "cuda"):  # assert what runs: the header names the backend
            from kalos.clients._transport import Connection

            c = Connection(name, sidecar_uid=os.geteuid())  # (--shm-mode 0660 sidecars too)
            try:
                ran = {1: "numpy", 2: "cuda"}.get(int(c.seg.header["backend"]))
            finally:
                c.close()
            assert ran == backend, f"asked for a {backend} sidecar, the header says {ran}"
        return h

    yield start
    for h in handles:
        h.stop()
        try:
            cleanup(h.name, force=True)
        except Exception:
            pass


@pytest.fixture
def sidecar(sidecar_factory, seed):
    """A numpy sidecar with 2000 random rows of dim 32 in namespace 'default' (matrix regenerable from seed)."""
    h = sidecar_factory(
        "main",
        "--dim",
        "32",
        "--random-rows",
        "2000",
        "--seed",
        str(seed),
        "--slots",
        "32",
        "--max-k",
        "64",
        "--max-queries",
        "8",
        "--backend",
        "numpy",
    )
    h.matrix = np.random.default_rng(seed).standard_normal((2000, 32), dtype=np.float32)
    return h


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-seconds", type=float, default=8.0, help="how long the fuzz test attacks a sidecar (CI: 8 s)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every async test runs under ``strict_loop``: an unhandled event-loop exception fails it."""
    for item in items:
        if item.get_closest_marker("asyncio") and "strict_loop" not in item.fixturenames:
            item.fixturenames.append("strict_loop")  # type: ignore[attr-defined]


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on the default loop and on uvloop (the application's choice)."""
    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest_asyncio.fixture
async def strict_loop():
    """An unhandled exception in the event loop fails the test."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _l, ctx: errors.append(ctx))
    yield
    await asyncio.sleep(0)
    assert not errors, f"unhandled event-loop exceptions: {errors}"


def run_py(code: str, *args: str) -> subprocess.Popen[bytes]:
    """A real client process running ``code`` (stdout piped)."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_until(pred, timeout: float = 5.0, step: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def assert_topk(
    q: np.ndarray,
    matrix: np.ndarray,
    ids: np.ndarray,
    scores: np.ndarray,
    k: int,
    metric: str = "dot",
    rtol: float = 1e-5,
) -> None:
    """Check one answer against a float64 reference by score (ties compared by value)."""
    m = matrix.astype(np.float64)
    q64 = q.astype(np.float64)
    if metric == "cosine":
        m = m / np.linalg.norm(m, axis=1, keepdims=True)
        q64 = q64 / np.linalg.norm(q64)
    if metric == "l2":
        ref = -((m - q64) ** 2).sum(axis=1)
    else:
        ref = m @ q64
    kk = min(k, len(m))
    assert len(ids) == kk, f"{len(ids)} results, expected {kk}"
    assert len(set(ids.tolist())) == kk, "duplicate ids"
    if kk == 0:  # an empty namespace (or k=0): nothing to rank
        assert len(scores) == 0, f"{len(scores)} scores for no results"
        return
    tol = rtol * (np.abs(ref).max() + 1.0)
    kth = np.sort(ref)[::-1][kk - 1]
    true = ref[ids]
    assert (true >= kth - tol).all(), "an id outside the true top-k"
    assert np.all(np.diff(true) <= tol), "not sorted best first"
    np.testing.assert_allclose(scores, true, rtol=1e-4, atol=tol)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a sidecar's --metrics-port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slots_free(name: str) -> bool:
    """Every slot of broker ``name`` is FREE and owned by no process (nothing leaked)."""
    from kalos.broker.layout import S_FREE
    from kalos.clients._transport import Connection

    c = Connection(name)
    try:
        s = c.seg.slots
        return bool(((s["owner_pid"] == 0) & (s["state"] == S_FREE)).all())
    finally:
        c.close()
