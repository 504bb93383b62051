"""The README's quick start runs as written: its Python block, against a real sidecar started with
the dim its `kalos serve` line gives (issue 22, item 15)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)
README = Path(__file__).resolve().parents[2] / "README.md"


def _quick_start() -> tuple[str, str]:
    """(the bash block, the python block) of the README's "Quick start" section."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    py = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and py, "the quick start lost a code block"
    return bash.group(1), py.group(1)


def test_readme_quick_start_runs_verbatim(sidecar_factory) -> None:
    bash, code = _quick_start()
    serve = next(line for line in bash.splitlines() if " serve " in line)
    dim = int(re.search(r"--dim (\d+)", serve).group(1))  # type: ignore[union-attr]
    ast.parse(code)
    # The one change: the broker's name, so the test never meets a real "default" sidecar.
    assert code.count('RecallPool("default"') == 1
    h = sidecar_factory("readme", "--dim", str(dim), "--backend", "numpy")
    run = code.replace('RecallPool("default"', f'RecallPool("{h.name}"')
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout
    hit_id, score, payload = lines[0].split(" ", 2)
    assert hit_id == "42" and payload == "{'text': 'user likes tea'}"
    # The snippet's vector, recomputed here: its score against itself in float64.
    vec = np.random.default_rng(0).standard_normal(dim, dtype=np.float32).astype(np.float64)
    assert float(score) == pytest.approx(float(vec @ vec), rel=1e-5)
    assert lines[1] == "2 answers"
