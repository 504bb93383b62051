"""Rules the docs state, checked against the code that makes them true:

* the command the docs quote for starting a sidecar is the one the errors give (kalos.admin's
  start hint, the client's "no sidecar" message);
* README.md's CLI block names every ``kalos`` command and ``--version``;
* docs/metric.md's way to change the metric, its steps run as written: refused while a sidecar
  holds the data dir, then an export of the stopped store and an import into a new one with the
  new metric, which a sidecar serves with every timestamp and default TTL of the old one.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import unique_name

from kalos.admin import start_hint
from kalos.broker.errors import BrokerUnavailable
from kalos.cli import build_parser
from kalos.clients import RecallClient
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HINT = "kalos serve --name X --ephemeral --dim DIM --metric METRIC"
DIM = 8
HOUR = 3600.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KALOS_") or k == "KALOS_REQUIRE_COMPILED"}


def test_the_start_command_the_docs_quote_is_the_one_the_errors_give() -> None:
    quoted = {  # (a quote wrapped over two lines counts as one)
        (doc.name, " ".join(m.group(0).split()))
        for doc in DOCS
        for m in re.finditer(r"kalos serve --name \S+ --ephemeral[^`]*", doc.read_text(encoding="utf-8"))
    }
    assert quoted, "no doc quotes the start command"
    assert {q for _doc, q in quoted} == {HINT}, quoted
    assert f"`{HINT}`" in start_hint("X")
    name = unique_name("nobody")
    with pytest.raises(BrokerUnavailable) as e:
        Connection(name)
    assert f"`{HINT.replace('--name X', f'--name {name}')}`" in str(e.value), str(e.value)


def test_the_readme_cli_block_names_every_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("\n## CLI\n", 1)[1].split("```", 2)[1]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in sub.choices:
        assert re.search(rf"^kalos {cmd}\b", block, re.M), cmd
    assert re.search(r"^kalos --version\b", block, re.M)


def _steps() -> list[list[str]]:
    """The ``kalos ...`` commands of docs/metric.md's way to switch the metric, in order."""
    text = (ROOT / "docs" / "metric.md").read_text(encoding="utf-8")
    steps = text.split("To switch, move the records", 1)[1].split("\n\n`OLD` stays", 1)[0]
    return [shlex.split(c) for c in re.findall(r"`(kalos [^`]+)`", steps)]


def _kalos(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert args[0] == "kalos"
    return subprocess.run(
        [sys.executable, "-m", "kalos.cli", *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=120, env=_env()
    )


def test_the_metric_switch_runs_as_documented(tmp_path: Path, rng: np.random.Generator) -> None:
    export, load = _steps()
    assert export[:2] == ["kalos", "export"] and load[:2] == ["kalos", "import"], (export, load)
    metric = load[load.index("--metric") + 1]
    assert metric == "cosine"
    name = unique_name("mswitch")
    vecs = rng.standard_normal((30, DIM), dtype=np.float32) * 3
    proc = start_sidecar_process(
        ["--data-dir", str(tmp_path / "OLD"), "--dim", str(DIM), "--backend", "numpy"], name, stderr=subprocess.DEVNULL
    )
    try:
        with RecallClient(name, timeout=30) as c:
            assert c.metric == "dot"
            c.set_default_ttl("notes", 2 * HOUR)
            c.upsert(np.arange(20), vecs[:20], [{"i": i} for i in range(20)], namespace="notes")
            time.sleep(0.01)
            c.upsert(np.arange(20, 30), vecs[20:], namespace="facts", ttl=[HOUR, np.inf] * 5)
            c.touch([0, 1], namespace="notes")
            before = {ns: c.get(np.arange(30), namespace=ns) for ns in ("notes", "facts")}
        # Step 1: the commands are refused while a sidecar serves the data dir.
        r = _kalos(export, tmp_path)
        assert r.returncode == 2 and "is in use by the sidecar of broker" in r.stderr, r.stderr
        assert not (tmp_path / "exp").exists()
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)
    for step in (export, load):  # steps 2 and 3, as written, in a directory with OLD in it
        r = _kalos(step, tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (step, r.stdout, r.stderr)
    # Step 4: a sidecar with the new metric on NEW serves every record as it was, timestamps included.
    proc = start_sidecar_process(
        ["--data-dir", str(tmp_path / "NEW"), "--dim", str(DIM), "--metric", metric, "--backend", "numpy"],
        name,
        stderr=subprocess.DEVNULL,
    )
    try:
        with RecallClient(name, timeout=30) as c:
            assert c.metric == "cosine" and c.namespaces() == {"notes": 20, "facts": 10}
            for ns, want in before.items():
                got = c.get(np.arange(30), namespace=ns)
                assert got.ids.tolist() == want.ids.tolist() and got.payloads == want.payloads
                assert got.vectors is not None and want.vectors is not None
                unit = want.vectors / np.linalg.norm(want.vectors, axis=1, keepdims=True)
                np.testing.assert_allclose(got.vectors, unit, rtol=1e-5, atol=1e-6)
                for field in ("created_at", "updated_at", "expires_at"):
                    np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
            c.upsert([99], vecs[:1], namespace="notes")  # no ttl=: the namespace's default came along
            (exp,) = c.get([99], namespace="notes").expires_at  # type: ignore[misc]
            assert abs(exp - time.time() - 2 * HOUR) < 60
    finally:
        stop_sidecar_process(proc)
        cleanup(name, force=True)
