"""No public operation is written twice by hand: the blocking client's operations
(``clients/_ops_sync.py``) are generated from the pool's (``clients/_ops.py``) by
``clients/_unasync.py``; this fails when the generated file is stale (run ``make ops``)."""

from __future__ import annotations

import inspect
import shutil
import sys
from pathlib import Path

import pytest

from kalos.clients import RecallClient, RecallPool, _unasync
from kalos.clients._ops import AsyncOps
from kalos.clients._ops_sync import SyncOps


def _ruff() -> str:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (the dev extra)")
    return ruff


def test_the_blocking_operations_are_generated_from_the_async_ones() -> None:
    want = _unasync.formatted(_unasync.sync_source(_unasync.SOURCE.read_text(encoding="utf-8")), _ruff())
    assert _unasync.TARGET.read_text(encoding="utf-8") == want, "clients/_ops_sync.py is stale: run `make ops`"


def test_a_stale_rule_is_an_error_not_a_silent_copy() -> None:
    with pytest.raises(ValueError, match="not found"):
        _unasync.sync_source("class Other:\n    pass\n")


def test_both_drivers_offer_the_same_operations_with_the_same_signatures() -> None:
    public = [n for n, f in vars(AsyncOps).items() if callable(f) and not n.startswith("_")]
    assert {"recall", "recall_many", "upsert", "touch", "set_default_ttl", "delete", "get", "drop_namespace",
            "namespaces", "export_page", "count", "embed", "upsert_text", "recall_text",
            "recall_text_many"} == set(public)  # fmt: skip
    for name in public:
        a, s = getattr(RecallPool, name), getattr(RecallClient, name)
        assert a is getattr(AsyncOps, name) and s is getattr(SyncOps, name)  # inherited, not redefined
        assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s)
        assert inspect.signature(a) == inspect.signature(s), name
        assert a.__doc__ == s.__doc__, name
