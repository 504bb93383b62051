"""docs/api.md covers the public API as the code defines it (issue 33, item 12): every public
method and property of RecallPool and RecallClient with every parameter, the constructors'
parameters, every name ``kalos`` exports, every PoolStatistics field; the client's methods take
the pool's parameters, as the page says; and two of its claims about results, on a real sidecar."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import kalos
from kalos import PoolStatistics, RecallClient, RecallPool

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
_HIDDEN = {"connect"}  # the transport factory the unit tests inject: not for users


def _public(cls: type) -> dict[str, object]:
    return {n: m for n, m in inspect.getmembers(cls) if not n.startswith("_")}


def _section(heading: str) -> str:
    """The text under ``### heading`` (a heading may name several members: ``### A.x, A.y``)."""
    for part in DOC.split("\n### ")[1:]:
        if heading in part.split("\n", 1)[0].split(", "):
            return part
    raise AssertionError(f"docs/api.md has no section '### {heading}'")


def _params(fn: object) -> list[str]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [p for p in sig.parameters if p != "self" and p not in _HIDDEN]


def test_every_pool_method_and_parameter_is_documented() -> None:
    for name, member in _public(RecallPool).items():
        section = _section(f"RecallPool.{name}")
        if isinstance(member, property):
            continue
        for p in _params(member):
            assert re.search(rf"\b{p}\b", section), f"RecallPool.{name}: parameter {p!r} not in its section"


def test_client_methods_take_the_pools_parameters_or_have_their_own_section() -> None:
    pool = _public(RecallPool)
    listed = DOC.split("### RecallClient methods", 1)[1].split("\n### ", 1)[0]
    for name, member in _public(RecallClient).items():
        if isinstance(member, property) or name == "close":
            assert _section(f"RecallClient.{name}")
            continue
        assert f"`{name}`" in listed, name
        assert _params(member) == _params(pool[name]), name


def test_constructors_exports_and_statistics() -> None:
    for cls in (RecallPool, RecallClient):
        block = DOC.split(f"\n## {cls.__name__}\n", 1)[1].split("```", 2)[1]
        for p in _params(cls):
            shown = re.search(rf"\b{p}=([^,\n)]+)", block)
            assert shown, f"{cls.__name__}: {p} not in the signature shown"
            default, text = inspect.signature(cls).parameters[p].default, shown.group(1)
            if isinstance(default, bool) or default is None:
                assert text == repr(default), (cls.__name__, p, text)
            elif isinstance(default, str):
                assert text == f'"{default}"', (cls.__name__, p, text)
            else:
                assert float(text) == float(default), (cls.__name__, p, text)
    imports = DOC.split("```python", 1)[1].split("```", 1)[0]
    for name in kalos.__all__:
        assert re.search(rf"\b{name}\b", imports), f"{name} (kalos.__all__) not in the import block"
    stats = DOC.split("**`PoolStatistics`**", 1)[1].split("\n\n", 1)[0]
    for f in dataclasses.fields(PoolStatistics):
        assert f"`{f.name}`" in stats, f.name


@pytest.mark.timeout(60)
def test_written_position_and_records_as_documented(sidecar_factory) -> None:
    """``Written.position`` is None without a change log; ``get`` answers an id asked twice twice."""
    h = sidecar_factory("apidoc", "--dim", "4", "--backend", "numpy")
    with RecallClient(h.name) as c:
        w = c.upsert([1, 2], np.eye(4, dtype=np.float32)[:2])
        assert w == 2 and w.position is None
        rec = c.get([2, 1, 2, 9], with_vectors=False)
        assert rec.ids.tolist() == [2, 1, 2] and rec.missing.tolist() == [9] and rec.vectors is None
        assert c.delete([1, 1, 1]) == 1
