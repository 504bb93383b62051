"""Which slot path a process runs: the compiled byte work (``kalos.clients._cslot`` on a client,
``kalos.sidecar_cuda.serving._cserve`` in the sidecar) or the pure-Python one. Pure decision; the caller
imports.

The compiled path is used whenever its extension imports, unless ``KALOS_PURE_PYTHON=1`` asks for
the Python one (to compare, or to rule the extension out). ``KALOS_REQUIRE_COMPILED=1`` makes a
missing extension an error instead of a quiet fallback (the test suite sets it where a compiler
built the extensions, so that a suite claiming the compiled path runs it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

from .errors import ConfigError

PURE_ENV = "KALOS_PURE_PYTHON"
REQUIRE_ENV = "KALOS_REQUIRE_COMPILED"


class SlotPath(enum.Enum):
    COMPILED = "compiled"
    PYTHON = "python"


@dataclass(frozen=True)
class Choice:
    """The path chosen, the compiled module when it is COMPILED, and why (for logs and
    ``statistics()``)."""

    path: SlotPath
    module: ModuleType | None
    reason: str


def choose(env: Mapping[str, str], load: Callable[[], ModuleType]) -> Choice:
    """The slot path for a process whose environment is ``env``; ``load`` imports the extension
    (raising ImportError when it was not built). ConfigError when both variables are set, or the
    compiled path is required and does not load."""
    pure = env.get(PURE_ENV, "") not in ("", "0")
    required = env.get(REQUIRE_ENV, "") not in ("", "0")
    if pure and required:
        raise ConfigError(f"{PURE_ENV} and {REQUIRE_ENV} are both set: choose one slot path")
    if pure:
        return Choice(SlotPath.PYTHON, None, f"{PURE_ENV}=1")
    try:
        module = load()
    except ImportError as e:
        if required:
            raise ConfigError(f"{REQUIRE_ENV}=1 but the compiled slot path is not built: {e}") from None
        return Choice(SlotPath.PYTHON, None, f"the extension is not built ({e})")
    return Choice(SlotPath.COMPILED, module, "the extension is built")


__all__ = ["PURE_ENV", "REQUIRE_ENV", "Choice", "SlotPath", "choose"]
