"""Imports point one way, and no module of ours takes part in an import circle.

Layers (a package may import itself and the packages listed, nothing else of ours)::

    broker        the shared-memory contract: imports nothing of ours
    clients       -> broker
    sidecar_cuda  -> broker
    kalos         -> broker, clients, sidecar_cuda (the applications and the public API)

Modules are parsed, not imported. Every import statement counts, wherever it is: at module level,
inside a function (a deferred import is still a dependency), and under ``if TYPE_CHECKING:`` too
(none is needed today, and ``../shared/tools/check_layers.py`` counts those as well).
``from pkg import name`` depends on ``pkg`` (its ``__init__`` runs, and ``name`` is read from it)
and, when ``pkg.name`` is a module of ours, on that module as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: dict[str, frozenset[str]] = {
    "broker": frozenset(),
    "clients": frozenset({"broker"}),
    "sidecar_cuda": frozenset({"broker"}),
    "kalos": frozenset({"broker", "clients", "sidecar_cuda"}),
}

Graph = dict[str, set[str]]


#: Installed as ``kalos.broker``, ``kalos.clients`` and ``kalos.sidecar_cuda`` (``kalos/broker`` etc.
#: are symlinks to the top-level folders): ``kalos.broker.x`` is the module ``broker.x`` here.
MOUNTED = frozenset({"broker", "clients", "sidecar_cuda"})


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under the layered packages, and
    every ``.pyi`` stub without one (a compiled extension, e.g. ``clients/_cslot``: its stub's
    imports are its edges) (the symlinks under ``kalos/`` are not walked: their files are counted
    once, under their folder)."""
    modules: dict[str, Path] = {}
    for top in LAYERS:
        sources = sorted((root / top).rglob("*.py"))
        sources += [p for p in sorted((root / top).rglob("*.pyi")) if not p.with_suffix(".py").exists()]
        for path in sources:
            if any((root / d).is_symlink() for d in path.relative_to(root).parents):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _ours(name: str, modules: dict[str, Path], layer: str) -> str | None:
    """The module of ours that importing ``name`` loads (its longest known prefix), if any. In the
    ``kalos`` layer ``kalos.broker.x`` is ``broker.x``; below it an absolute ``kalos.*`` import stays
    an import of ``kalos`` (it runs ``kalos/__init__``, which imports the clients): those packages
    import each other relatively (``from ..broker import layout``)."""
    parts = name.split(".")
    if layer == "kalos" and len(parts) > 1 and parts[0] == "kalos" and parts[1] in MOUNTED:
        parts = parts[1:]
    if parts[0] not in LAYERS:
        return None
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return name  # a module of ours that does not exist: still an edge, so it is reported


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that ``module`` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            plain = base[len("kalos.") :] if base.split(".")[:2][-1] in MOUNTED and base.startswith("kalos.") else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{plain}.{alias.name}" in modules]
        else:
            continue
        for target in targets:
            ours = _ours(target, modules, module.split(".")[0])
            if ours is not None:
                found.add(ours)
    return found


def import_graph(root: Path) -> Graph:
    modules = find_modules(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def layer_violations(graph: Graph) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        layer = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != layer and other not in LAYERS[layer]:
                wrong.append(f"{module} imports {target}")
    return wrong


def import_circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of the graph that form a circle (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(circles)


#: The sidecar's wings (sub-packages of ``sidecar_cuda``) and the wings each may import, besides
#: itself and the broker. The top level (the composition root ``server``, ``config``, ``__main__``)
#: may import every wing; no wing imports the top level: options reach the backends as typed values
#: (``backends/options.py``), and storage never reaches into serving.
WINGS: dict[str, frozenset[str]] = {
    "backends": frozenset(),
    "embedding": frozenset(),  # the text model: imports no other wing
    "storage": frozenset({"backends"}),
    "serving": frozenset({"backends", "storage", "embedding"}),
    "metrics": frozenset({"backends", "serving", "embedding"}),
}
#: The only modules at the top of ``sidecar_cuda/``.
SIDECAR_TOP = frozenset({"sidecar_cuda", "sidecar_cuda.__main__", "sidecar_cuda.config", "sidecar_cuda.server"})


def wing_of(module: str) -> str | None:
    """``storage`` for ``sidecar_cuda.storage.store``; None for the top level and other layers."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sidecar_cuda" and len(parts) > 1 and parts[1] in WINGS else None


def wing_violations(graph: Graph) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        wing = wing_of(module)
        if wing is None:
            continue
        for target in sorted(targets):
            if target.split(".")[0] != "sidecar_cuda":
                continue
            other = wing_of(target)
            if other != wing and other not in WINGS[wing]:
                wrong.append(f"{module} ({wing}) imports {target} ({other or 'the top level'})")
    return wrong


def test_the_sidecars_wings_point_one_way() -> None:
    wrong = wing_violations(import_graph(ROOT))
    assert not wrong, "imports against the sidecar's wings:\n  " + "\n  ".join(wrong)


def test_the_sidecars_top_level_is_only_its_composition_root_and_config() -> None:
    top = {m for m in find_modules(ROOT) if m.startswith("sidecar_cuda") and wing_of(m) is None}
    assert top == SIDECAR_TOP, sorted(top - SIDECAR_TOP)


def test_the_wing_check_catches_what_it_should(tmp_path: Path) -> None:
    files = {
        "sidecar_cuda/__init__.py": "",
        "sidecar_cuda/config.py": "from .backends.options import FusedKernel\n",
        "sidecar_cuda/backends/__init__.py": "",
        "sidecar_cuda/backends/options.py": "",
        "sidecar_cuda/backends/select.py": "from ..config import FusedKernel\n",
        "sidecar_cuda/storage/__init__.py": "",
        "sidecar_cuda/storage/expiry.py": "from ..serving.stats import SidecarStats\n",
        "sidecar_cuda/serving/__init__.py": "",
        "sidecar_cuda/serving/stats.py": "from ..storage import expiry\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert wing_violations(import_graph(tmp_path)) == [
        "sidecar_cuda.backends.select (backends) imports sidecar_cuda.config (the top level)",
        "sidecar_cuda.storage.expiry (storage) imports sidecar_cuda.serving.stats (serving)",
    ]


def test_layers_point_one_way() -> None:
    wrong = layer_violations(import_graph(ROOT))
    assert not wrong, "imports against the layers:\n  " + "\n  ".join(wrong)


def test_no_import_circles() -> None:
    circles = import_circles(import_graph(ROOT))
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)


def test_every_layer_is_parsed() -> None:
    tops = {m.split(".")[0] for m in find_modules(ROOT)}
    assert tops == set(LAYERS)


def test_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The checks above can fail: a tree with each kind of mistake is caught."""
    files = {
        "broker/__init__.py": "",
        "broker/layout.py": "def check():\n    from broker.errors import ConfigError\n",
        "broker/errors.py": "from broker.layout import Status\n",
        "broker/cli.py": "import sidecar_cuda.server\n",
        "clients/__init__.py": "from clients.pool import RecallPool\n",
        "clients/pool.py": "from clients import _requests\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kalos import x\n",
        "clients/_requests.py": "from . import pool\n",
        "sidecar_cuda/__init__.py": "",
        "sidecar_cuda/server.py": "from . import objects\n",
        "sidecar_cuda/serving/objects.py": "import clients.pool as pool\n",
        "kalos/__init__.py": "import broker\n",
        "kalos/cli.py": "from kalos.clients import pool\nfrom kalos.sidecar_cuda import server\n",
        "clients/fake.py": "from kalos.broker import layout\nfrom ..broker import errors\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert layer_violations(graph) == [
        "broker.cli imports sidecar_cuda.server",
        "clients.fake imports kalos",
        "clients.pool imports kalos",
        "sidecar_cuda.serving.objects imports clients.pool",
    ]
    assert graph["kalos.cli"] == {"clients", "clients.pool", "sidecar_cuda", "sidecar_cuda.server"}
    assert "broker.errors" in graph["clients.fake"]
    assert import_circles(graph) == [
        ["broker.errors", "broker.layout"],
        ["clients", "clients._requests", "clients.pool"],
    ]
