"""The installed distribution: one import package (``kalos``), a distribution name of our own.

The wheel is built from the checkout and installed into a fresh virtual environment (its
dependencies from pip's cache or the index, as a user's ``pip install`` would). A user project with
its own top-level ``clients/`` and ``broker/`` packages then imports ``kalos`` from the wheel, starts
a sidecar with ``python -m kalos.sidecar_cuda`` and recalls through it: nothing of ours is looked up
under the generic names (issue 22, items 3 and 4).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import unique_name

ROOT = Path(__file__).resolve().parents[2]
DIST = "kalos-recall"

pytestmark = pytest.mark.timeout(600)


def test_distribution_name_is_ours_and_docs_use_it() -> None:
    assert re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1] == DIST  # type: ignore[index]
    # Every extra the docs tell users to install names this distribution, never the other "kalos".
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "kalos-sidecar.service"]:
        text = doc.read_text()
        assert "install 'kalos[" not in text and 'install "kalos[' not in text, doc


def _build_wheel(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files, so the checkout gets no build/ folder.
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(
        ["tar", "-c", "--null", "-T", "-", "-f", "-"],
        cwd=ROOT,
        input=files,
        check=True,
        stdout=open(src / "src.tar", "wb"),
    )
    subprocess.run(["tar", "-x", "-f", "src.tar"], cwd=src, check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
    )
    (whl,) = out.glob("kalos_recall-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory, dict(os.environ))


@pytest.fixture(scope="module")
def wheel_without_compiler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel a machine without a working C compiler builds: ``CC`` fails every compile."""
    return _build_wheel(tmp_path_factory, {**os.environ, "CC": "/bin/false", "LDSHARED": "/bin/false"})


def _venv_with(wheel: Path, where: Path) -> Path:
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True)
    return py


_CHOSEN = (
    "import os; from kalos.broker.slotpath import choose; import importlib; "
    "print(choose(os.environ, lambda: importlib.import_module('kalos.clients._cslot')).path.value, "
    "choose(os.environ, lambda: importlib.import_module('kalos.sidecar_cuda.serving._cserve')).path.value)"
)
_PLAIN_ENV = {
    k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KALOS_PURE_PYTHON", "KALOS_REQUIRE_COMPILED")
}


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the compiled wheel cannot be built")
def test_the_wheel_carries_the_compiled_slot_path(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for ext in ("kalos/clients/_cslot", "kalos/sidecar_cuda/serving/_cserve"):
        assert any(n.startswith(ext) and n.endswith(".so") for n in names), ext
    py = _venv_with(wheel, tmp_path)
    r = subprocess.run([str(py), "-c", _CHOSEN], cwd=tmp_path, env=_PLAIN_ENV, capture_output=True, text=True)
    assert r.stdout.split() == ["compiled", "compiled"], r.stderr


def test_an_install_without_a_compiler_runs_the_python_slot_path(wheel_without_compiler: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel_without_compiler).namelist()
    assert not [n for n in names if n.endswith(".so")], names
    py = _venv_with(wheel_without_compiler, tmp_path)
    r = subprocess.run([str(py), "-c", _CHOSEN], cwd=tmp_path, env=_PLAIN_ENV, capture_output=True, text=True)
    assert r.stdout.split() == ["python", "python"], r.stderr
    _recall_beside_a_user_project(py, tmp_path)


def test_wheel_holds_one_import_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"kalos"}
    for sub in (
        "broker/layout.py",
        "clients/pool.py",
        "sidecar_cuda/server.py",
        "sidecar_cuda/backends/cuda/kalos_topk.cu",
    ):
        assert f"kalos/{sub}" in names, sub


def test_wheel_beside_a_project_with_its_own_clients_and_broker(wheel: Path, tmp_path: Path) -> None:
    _recall_beside_a_user_project(_venv_with(wheel, tmp_path), tmp_path)


def _recall_beside_a_user_project(py: Path, tmp_path: Path) -> None:
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for generic in ("broker", "clients", "sidecar_cuda"):
        assert not (site / generic).exists(), f"{generic} installed at the top of site-packages"
    # The user's project: generic package names of its own, on sys.path first (cwd).
    project = tmp_path / "userproj"
    for pkg in ("clients", "broker"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text(f"USER_{pkg.upper()} = True\n")
    name = unique_name("wheel")
    env = _PLAIN_ENV
    sidecar = subprocess.Popen(
        [str(py), "-m", "kalos.sidecar_cuda", "--name", name, "--ephemeral", "--dim", "8", "--backend", "numpy"],
        cwd=project,
        env=env,
    )
    try:
        code = """
import asyncio, numpy as np
import clients, broker
assert clients.USER_CLIENTS and broker.USER_BROKER        # the project's own packages
import kalos
from kalos import RecallPool
assert kalos.__file__.startswith(SITE), kalos.__file__    # ours, from the wheel
async def main():
    async with RecallPool(NAME, size=2, connect_timeout=60) as pool:
        rng = np.random.default_rng(0)
        m = rng.standard_normal((50, 8)).astype(np.float32)
        await pool.upsert(np.arange(50), m)
        q = m[7]
        hits = await pool.recall(q, k=3)
        ref = np.argsort(-(m.astype(np.float64) @ q.astype(np.float64)))[:3]
        assert list(hits.ids) == list(ref), (hits.ids, ref)
        print("ok", list(hits.ids))
asyncio.run(main())
""".replace("SITE", repr(str(site))).replace("NAME", repr(name))
        r = subprocess.run([str(py), "-c", code], cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("ok")
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=30)
