"""deploy/container/Containerfile built for real and run the way a pod runs it.

No registry is reachable and no OCI runtime works on the test machines (crun stops on setrlimit and
on hybrid cgroups), so: the base image comes from a Debian mirror and the image is built with
``podman build --isolation chroot`` (deploy/container/build-local.sh); its filesystem is exported
and each "container" is a process tree under ``unshare`` (own PID and mount namespaces) chrooted
into it, read-only, as uid/gid 10001 without capabilities, with the image's entrypoint, working
directory and environment. Sidecar and clients share one tmpfs at /dev/shm (an emptyDir of
medium Memory) and nothing else; the sidecar alone mounts the durable /var/lib/kalos.

Root only; skipped where debootstrap, podman or unshare are missing, failed instead with
KALOS_REQUIRE_IMAGE_TEST=1 (CI). The debootstrapped base is kept under $KALOS_IMAGE_CACHE (default
/var/tmp/kalos-image-cache) and the image in podman's storage, so a second run of an unchanged
checkout builds nothing (cold, base included: about a minute and a half on 2 cores)."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from conftest import assert_topk, wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "container" / "build-local.sh"
TAG = "localhost/kalos:test-cpu"
UID = 10001  # the Containerfile's USER, the manifests' runAsUser
DIM = 32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _unavailable() -> str | None:
    missing = [t for t in ("debootstrap", "podman", "unshare", "mount", "umount") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install debootstrap podman util-linux)"
    if os.geteuid() != 0:
        return "needs root (debootstrap, podman's storage, mounts)"
    return None


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    """Skipped without the tools, unless KALOS_REQUIRE_IMAGE_TEST=1 (CI): then it fails."""
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("KALOS_REQUIRE_IMAGE_TEST") == "1":
            pytest.fail(f"{reason}; KALOS_REQUIRE_IMAGE_TEST=1 says this test must run")
        pytest.skip(reason)


# One container: private mounts over the exported image, then the image's own programs as 10001.
# It runs as pid 1 of a new PID namespace (unshare --pid --fork) and stays pid 1 through the execs.
CONTAINER_SH = r"""
set -eu
root=$1 shm=$2 data=$3 wd=$4; shift 4
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"                       # readOnlyRootFilesystem
mount -t tmpfs -o mode=0755,size=64k,nosuid tmpfs "$root/dev"
for d in null zero full random urandom tty; do : > "$root/dev/$d"; mount --bind "/dev/$d" "$root/dev/$d"; done
ln -s /proc/self/fd "$root/dev/fd"
mkdir "$root/dev/shm"
mount --bind "$shm" "$root/dev/shm"                    # the one shared tmpfs
mount -t tmpfs -o mode=1777,size=16m tmpfs "$root/tmp"
if [ -n "$data" ]; then mount --bind "$data" "$root/var/lib/kalos"; fi
mount -t proc proc "$root/proc"                        # this PID namespace's view
exec unshare --root="$root" --wd="$wd" --setgid=10001 --setuid=10001 -- /usr/bin/env -i "$@"
"""

# A client inside the image: JSON commands on stdin, one JSON answer per line on stdout.
CLIENT_PY = r"""
import asyncio, json, os, sys
import numpy as np
import kalos
from kalos import RecallClient, RecallPool

def whoami(conn):
    return {"pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "executable": sys.executable, "real": os.path.realpath(sys.executable),
            "kalos": kalos.__file__, "sees_checkout": os.path.exists(sys.argv[2]),
            "sidecar_pid": int(conn.seg.header["sidecar_pid"]),
            "pid_ns": os.readlink("/proc/self/ns/pid")}

def answer(hits):
    return {"ids": [h.ids.tolist() for h in hits], "scores": [h.scores.tolist() for h in hits]}

def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()

def blocking():
    with RecallClient(timeout=30.0, connect_timeout=30.0) as c:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "whoami":
                reply(whoami(c._conn))
            elif cmd["op"] == "upsert":
                reply({"n": c.upsert(np.array(cmd["ids"]), np.array(cmd["vectors"], np.float32))})
            elif cmd["op"] == "recall":
                reply(answer(c.recall_many(np.array(cmd["q"], np.float32), k=cmd["k"])))

async def pooled():
    loop = asyncio.get_running_loop()
    async with RecallPool(size=4, timeout=30.0, connect_timeout=30.0) as pool:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "whoami":
                reply(whoami(pool._sender.conn))
            elif cmd["op"] == "upsert":
                reply({"n": await pool.upsert(np.array(cmd["ids"]),
                                              np.array(cmd["vectors"], np.float32))})
            elif cmd["op"] == "recall":
                qs = np.array(cmd["q"], np.float32)
                hits = await asyncio.gather(*(pool.recall(q, k=cmd["k"]) for q in qs))
                reply(answer(hits))
            elif cmd["op"] == "spin":  # recall on every slot until killed
                q = np.array(cmd["q"], np.float32)
                async def forever():
                    while True:
                        await pool.recall(q, k=cmd["k"])
                tasks = [asyncio.create_task(forever()) for _ in range(8)]
                await asyncio.sleep(0.5)
                reply({"spinning": len(tasks)})

(blocking if sys.argv[1] == "blocking" else lambda: asyncio.run(pooled()))()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(*argv: str, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    """Build (or find built) the CPU image; its config (Env, Entrypoint, Cmd, User, ...)."""
    t0 = time.monotonic()
    r = _run("bash", str(BUILD), TAG, env={**os.environ, "VARIANT": "cpu"})
    print(f"\n[image] {TAG} built in {time.monotonic() - t0:.1f} s; {r.stderr.count('Using cache')} cached steps")
    config: dict[str, Any] = json.loads(_run("podman", "image", "inspect", TAG).stdout)[0]["Config"]
    return config


@pytest.fixture(scope="module")
def rootfs(image: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image's filesystem, exported from a created (never started) container."""
    path = tmp_path_factory.mktemp("image") / "rootfs"
    path.mkdir()
    cid = _run("podman", "create", TAG).stdout.strip()
    try:
        with subprocess.Popen(["podman", "export", cid], stdout=subprocess.PIPE) as export:
            _run("tar", "-C", str(path), "-xf", "-", stdin=export.stdout)
        assert export.returncode == 0
    finally:
        _run("podman", "rm", cid)
    yield path
    shutil.rmtree(path)


class Container:
    """One process tree of the pod; ``proc`` is the host's ``unshare``, ``pid`` the host pid of the
    container's pid 1 (the image's program)."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log
        self._lines: queue.Queue[str] = queue.Queue()
        if proc.stdout is not None:
            threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()
        assert wait_until(lambda: self._child() is not None or proc.poll() is not None, 10)
        child = self._child()
        assert child is not None, f"the container did not start:\n{self.log.read_text()}"
        self.pid = child

    def _child(self) -> int | None:
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def _read(self, out: IO[str]) -> None:
        for line in out:
            self._lines.put(line)

    def nspid(self) -> list[int]:
        """The pid 1 of the container as each PID namespace sees it, outermost first."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        return [int(p) for p in re.search(r"^NSpid:\s+(.*)$", status, re.M).group(1).split()]  # type: ignore[union-attr]

    def call(self, op: str, timeout: float = 60, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no answer to {op} in {timeout} s:\n{self.log.read_text()}") from None

    def signal(self, sig: int) -> int:
        """Send ``sig`` to the container's pid 1 from the host; its exit status (unshare's)."""
        os.kill(self.pid, sig)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        # The container's pid 1, not unshare: its namespace goes with it. (unshare --kill-child
        # would not do: the parent-death signal is cleared when the child changes its uid.)
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Pod:
    """Containers from one exported image sharing one /dev/shm tmpfs, like a pod's emptyDir."""

    def __init__(self, rootfs: Path, image: dict[str, Any], work: Path) -> None:
        self.rootfs = rootfs
        self.image = image
        self.work = work
        self.shm = work / "shm"
        self.data = work / "data"
        self.shm.mkdir()
        self.data.mkdir(mode=0o700)
        os.chown(self.data, UID, UID)
        _run("mount", "-t", "tmpfs", "-o", f"size=64m,uid={UID},gid={UID},mode=0700", "tmpfs", str(self.shm))
        self.containers: list[Container] = []

    def start(self, argv: list[str], env: dict[str, str], *, data: bool = False, stdio: bool = False) -> Container:
        """Run ``argv`` (resolved on the image's PATH) with the image's environment plus ``env``."""
        image_env = dict(e.split("=", 1) for e in self.image["Env"])
        full = [f"{k}={v}" for k, v in {**image_env, **env}.items()]
        log = self.work / f"c{len(self.containers)}.log"
        proc = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                CONTAINER_SH,
                "container",
                str(self.rootfs),
                str(self.shm),
                str(self.data) if data else "",
                self.image["WorkingDir"],
                *full,
                *argv,
            ],
            stdin=subprocess.PIPE if stdio else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdio else subprocess.DEVNULL,
            stderr=log.open("w"),
            text=True,
        )
        c = Container(proc, log)
        self.containers.append(c)
        return c

    def close(self) -> None:
        for c in self.containers:
            c.kill()
        subprocess.run(["umount", "-l", str(self.shm)], check=False)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kalos_[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def _wait_ready(c: Container, port: int, timeout: float = 60) -> None:
    """The kubelet's startupProbe: /readyz on the metrics port answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        assert c.proc.poll() is None, f"the sidecar exited:\n{c.log.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"not ready in {timeout} s:\n{c.log.read_text()}"
        time.sleep(0.1)


def _check(c: Container, matrix: np.ndarray, queries: np.ndarray, k: int = 10) -> None:
    got = c.call("recall", q=queries.tolist(), k=k)
    for q, ids, scores in zip(queries, got["ids"], got["scores"]):
        assert_topk(q, matrix, np.array(ids), np.array(scores, np.float32), k)


def test_image_is_the_containerfile(image: dict[str, Any]) -> None:
    """What the manifests and docs rely on, read back from the built image."""
    assert image["User"] == f"{UID}:{UID}"
    assert image["Entrypoint"] == ["kalos"] and image["Cmd"] == ["serve"]
    assert set(image["Volumes"]) == {"/dev/shm", "/var/lib/kalos"}
    assert image["WorkingDir"] == "/var/lib/kalos"
    env = dict(e.split("=", 1) for e in image["Env"])
    assert env["PATH"].startswith("/opt/kalos/venv/bin:") and "/usr/bin" in env["PATH"].split(":")
    assert env["KALOS_DATA_DIR"] == "/var/lib/kalos/default"


def test_sidecar_and_two_clients_from_the_image(rootfs: Path, image: dict[str, Any], tmp_path: Path, seed: int) -> None:
    """Sidecar and two clients, each in its own PID and mount namespace, share only /dev/shm and
    the uid: recalls are exact; a client killed with -9 leaves the other working and its slots
    reclaimed; a restarted sidecar reloads the durable store and both old and new clients get
    exact answers from it."""
    rng = np.random.default_rng(seed)
    matrix = rng.standard_normal((2000, DIM), dtype=np.float32)
    queries = rng.standard_normal((8, DIM), dtype=np.float32)
    port = _free_port()
    sidecar_env = {
        "KALOS_DIM": str(DIM),
        "KALOS_BACKEND": "numpy",
        "KALOS_METRICS_HOST": "127.0.0.1",
        "KALOS_METRICS_PORT": str(port),
    }
    sidecar_argv = image["Entrypoint"] + image["Cmd"]
    client_argv = ["python", "-c", CLIENT_PY]
    pod = Pod(rootfs, image, tmp_path)
    try:
        sidecar = pod.start(sidecar_argv, sidecar_env, data=True)
        _wait_ready(sidecar, port)
        a = pod.start(client_argv + ["blocking", str(ROOT)], {}, stdio=True)
        b = pod.start(client_argv + ["pool", str(ROOT)], {}, stdio=True)

        # What ran: the image's interpreter and package, chrooted (the checkout is not there), as
        # 10001 without the host's groups, each process pid 1 of its own PID namespace.
        namespaces = set()
        for c in (a, b):
            who = c.call("whoami")
            assert who["executable"] == "/opt/kalos/venv/bin/python", who
            assert who["real"].startswith("/usr/bin/python3"), who  # Debian's, not the host venv's
            assert who["kalos"].startswith("/opt/kalos/venv/lib/"), who
            assert not who["sees_checkout"], who
            assert (who["uid"], who["gid"], who["groups"]) == (UID, UID, []), who
            assert who["pid"] == 1 and who["sidecar_pid"] == 1, who  # two pid 1s: two namespaces
            namespaces.add(who["pid_ns"])
        for c in (sidecar, a, b):
            host_pid, inner = c.nspid()
            assert host_pid == c.pid and inner == 1
            namespaces.add(os.readlink(f"/proc/{c.pid}/ns/pid"))
            assert os.readlink(f"/proc/{c.pid}/root") == str(rootfs)
            assert os.readlink(f"/proc/{c.pid}/exe").startswith(f"{rootfs}/usr/bin/python3")
            status = Path(f"/proc/{c.pid}/status").read_text()
            assert re.search(rf"^Uid:\s+{UID}\s+{UID}\s+{UID}\s+{UID}$", status, re.M), status
            assert re.search(r"^CapEff:\s+0+$", status, re.M), status
        assert len(namespaces) == 3 and os.readlink("/proc/self/ns/pid") not in namespaces
        cmdline = Path(f"/proc/{sidecar.pid}/cmdline").read_bytes().split(b"\0")[:-1]
        assert cmdline[0].startswith(b"/opt/kalos/venv/bin/python"), cmdline  # the entrypoint's
        assert cmdline[1:] == [b"/opt/kalos/venv/bin/kalos", b"serve"], cmdline  # shebang
        # The broker's objects are in the pod's tmpfs, and only there.
        objects = {p.name for p in pod.shm.iterdir()}
        assert {"kalos.default", "kalos.default.leases", "sem.kalos.default.bell"} <= objects, objects
        assert not any(os.path.exists(f"/dev/shm/{o}") for o in objects)

        # Both clients write, both read every row exactly.
        assert a.call("upsert", ids=list(range(1000)), vectors=matrix[:1000].tolist())["n"] == 1000
        assert b.call("upsert", ids=list(range(1000, 2000)), vectors=matrix[1000:].tolist())["n"] == 1000
        _check(a, matrix, queries)
        _check(b, matrix, queries)

        # kill -9 a client while it has requests on every slot: the sidecar, in another PID
        # namespace, sees it die (kernel locks on the shared lease file) and takes its slots back.
        before = _metrics(port)
        assert b.call("spin", q=queries[0].tolist(), k=10)["spinning"] == 8
        b.signal(signal.SIGKILL)
        assert wait_until(lambda: _metrics(port)["kalos_slots_leased"] == 1, 15), _metrics(port)
        after = _metrics(port)
        assert after["kalos_slots_reclaimed_total"] > before["kalos_slots_reclaimed_total"], after
        _check(a, matrix, queries)
        changed = rng.choice(2000, 300, replace=False)
        matrix[changed] = rng.standard_normal((300, DIM), dtype=np.float32)
        assert a.call("upsert", ids=changed.tolist(), vectors=matrix[changed].tolist())["n"] == 300
        _check(a, matrix, queries)

        # Restart the sidecar (SIGTERM, as at pod termination or a rollout): it stops cleanly and
        # unlinks its objects; a new one loads the durable store; the old client re-attaches.
        assert sidecar.signal(signal.SIGTERM) == 0, sidecar.log.read_text()
        assert not [p.name for p in pod.shm.iterdir() if "kalos." in p.name]
        sidecar = pod.start(sidecar_argv, sidecar_env, data=True)
        _wait_ready(sidecar, port)
        _check(a, matrix, queries)
        c = pod.start(client_argv + ["pool", str(ROOT)], {}, stdio=True)
        _check(c, matrix, queries)
        assert _metrics(port)["kalos_memory_rows"] == 2000
        assert sidecar.signal(signal.SIGTERM) == 0, sidecar.log.read_text()
    finally:
        pod.close()
