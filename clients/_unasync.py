"""Generates ``clients/_ops_sync.py`` (the blocking client's operations) from ``clients/_ops.py``
(the pool's), so that no public operation is written twice by hand (as httpcore and psycopg
generate their sync code). ``python -m kalos.clients._unasync`` (``make ops``) writes the file;
``tests/unit/test_ops_generated.py`` fails when it is stale. Pure text rules, in order."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

#: (async spelling, sync spelling), applied in order.
RULES: tuple[tuple[str, str], ...] = (
    (
        '"""The public operations, written once: :class:`AsyncOps` (this file, by hand) is what',
        '"""GENERATED from ``_ops.py`` by ``_unasync.py`` (``make ops``): do not edit. The public\n'
        "operations, written once: :class:`AsyncOps` (``_ops.py``, by hand) is what",
    ),
    ("async def ", "def "),
    ("await ", ""),
    ("class AsyncOps:", "class SyncOps:"),
    (
        '"""The operations of an asyncio driver (``RecallPool``)',
        '"""The operations of a blocking driver (``RecallClient``)',
    ),
    ('__all__ = ["AsyncOps"]', '__all__ = ["SyncOps"]'),
)

HERE = Path(__file__).resolve().parent
SOURCE, TARGET = HERE / "_ops.py", HERE / "_ops_sync.py"


def sync_source(text: str) -> str:
    """The blocking twin of ``_ops.py``'s text."""
    for old, new in RULES:
        if old not in text:
            raise ValueError(f"_unasync: {old!r} not found in the async source (a rule is stale)")
        text = text.replace(old, new)
    return text


def formatted(text: str, ruff: str) -> str:
    """``text`` as ``ruff format`` leaves it (the project's style: dropping ``await`` may let a
    call fit on one line)."""
    out = subprocess.run(
        [ruff, "format", "--stdin-filename", str(TARGET), "-"], input=text, capture_output=True, text=True, check=True
    )
    return out.stdout


def main() -> int:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    TARGET.write_text(formatted(sync_source(SOURCE.read_text(encoding="utf-8")), ruff), encoding="utf-8")
    print(f"wrote {TARGET}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
