"""The tree's floors and rooms (docs/layout.md): which folder may import which, no import circles,
and no module importing another's private name. Read from the sources' imports (ast), not by
importing them."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("common", "rules", "protos", "server", "worker", "deploy")
# What each folder may import besides itself (DESIGN.md, Layout): server -> rules -> protos <- worker.
ALLOWED = {
    "common": {"common", "protos"},
    "protos": {"protos", "common"},
    "rules": {"rules", "protos", "common"},
    "server": {"server", "rules", "protos", "common"},
    "worker": {"worker", "rules", "protos", "common"},
    "deploy": {"deploy", "server", "worker", "rules", "protos", "common"},
}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.startswith("tether_pb2"):
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(["tether", *parts])] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module a dotted import names (``tether.a.b.Name`` -> ``tether.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[str, str, bool, int]]:
    """(module imported, name imported or "", under TYPE_CHECKING, line) for each tether import in ``path``."""
    found: list[tuple[str, str, bool, int]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            tc = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                found.extend((a.name, "", typing_only, child.lineno) for a in child.names if a.name.startswith("tether."))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("tether."):
                for a in child.names:
                    full = f"{child.module}.{a.name}"
                    if full in MODULES:
                        found.append((full, "", typing_only, child.lineno))
                    else:
                        found.append((child.module or "", a.name, typing_only, child.lineno))
            visit(child, tc)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _edges(typing_too: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        for target, _, typing_only, _ in _imports(path):
            owner = _owner(target)
            if owner and owner != mod and (typing_too or not typing_only):
                graph[mod].add(owner)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            connect(v)
    return found


def test_the_tree_has_the_folders_the_layout_names() -> None:
    assert len(MODULES) > 100
    for room in ("rules", "server.serving", "server.storage", "server.checkpoints", "worker.client", "worker.cache",
                 "worker.data", "worker.training", "worker.ctr"):
        assert f"tether.{room}" in MODULES, room


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_imports_only_the_floors_below_it(folder: str) -> None:
    wrong = []
    for mod, path in MODULES.items():
        if mod.split(".")[1] != folder:
            continue
        for target, _, _, line in _imports(path):
            if target.split(".")[1] not in ALLOWED[folder]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert wrong == []


def test_no_import_circles_not_even_for_types() -> None:
    assert _circles(_edges(typing_too=False)) == []
    assert _circles(_edges(typing_too=True)) == []


def test_no_module_imports_another_modules_private_name() -> None:
    wrong = []
    for mod, path in MODULES.items():
        for target, name, _, line in _imports(path):
            if name.startswith("_") and _owner(target) != mod:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    assert wrong == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_hop_the_layout_page_follows_a_flag_through_exists() -> None:
    """docs/layout.md's walks of --mode and --cache-bound name real functions (``room/module:Class.method``)."""
    import importlib
    import re

    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    walk = text[text.index("## How a flag travels"):]
    hops = set(re.findall(r"([a-z_]+(?:/[a-z_]+)?):([A-Za-z_][\w.]*)", " ".join(re.findall(r"`([^`]+)`", walk))))
    hops -= {("module", "function"), ("ssp", "S")}  # the page's notation and a mode, not hops
    assert len(hops) > 25
    missing = []
    for path, attrs in sorted(hops):
        suffix = "." + path.replace("/", ".")
        found = False
        for mod in (m for m in MODULES if m.endswith(suffix)):
            obj: object = importlib.import_module(mod)
            try:
                for a in attrs.split("."):
                    obj = getattr(obj, a)
            except AttributeError:
                continue
            found = True
        if not found:
            missing.append(f"{path}:{attrs}")
    assert missing == []
