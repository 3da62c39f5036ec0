"""The tree's floors and rooms (docs/layout.md): which folder may import which, no import circles,
and no module importing another's private name. Read from the sources' imports (ast), not by
importing them."""

from __future__ import annotations

import ast
import functools
import re
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


# Modules whose job is to gather other modules' names, each listing them in ``__all__`` on purpose;
# every other module lists only names it defines, and nothing imports a name from a module that
# only imported it.
GATHERERS = {
    "tether": "the stable surface (tether/__init__.py): the names a training script needs, from their modules",
    "tether.worker.data.parquet": "Parquet's public names, gathered from the five parquet_* modules that hold the code",
}


@functools.cache
def _bound_names(path: Path) -> dict[str, str | None]:
    """The names a module binds outside its functions and classes, each with where it comes from:
    the tether module it imports it from (a module it imports: that module's name), or None where
    the module defines it or imports it from outside tether."""
    names: dict[str, str | None] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names[child.name] = None
                continue
            if isinstance(child, ast.ImportFrom):
                home = child.module or ""
                tether_home = home if child.level == 0 and home.split(".")[0] == "tether" else None
                for a in child.names:
                    names[a.asname or a.name] = f"{home}.{a.name}" if f"{home}.{a.name}" in MODULES else tether_home
            elif isinstance(child, ast.Import):
                for a in child.names:
                    bound = a.asname or a.name.split(".")[0]
                    names[bound] = a.name if a.asname and a.name.split(".")[0] == "tether" else None
            elif isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for target in child.targets if isinstance(child, ast.Assign) else [child.target]:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            names.setdefault(n.id, None)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _all_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


PACKAGE = {**MODULES, "tether": ROOT / "tether" / "__init__.py"}


def test_a_module_lists_in_all_only_the_names_it_defines() -> None:
    """No re-exports: a name in ``__all__`` is the module's own, not one it imports from another
    tether module (save the gatherers'). An old path of a name a module re-exported is kept by
    tether.common.moved, with a DeprecationWarning, not by the module holding the name."""
    wrong, gathered = [], set()
    for mod, path in PACKAGE.items():
        bound = _bound_names(path)
        borrowed = [f"{name} (from {bound[name]})" for name in _all_of(path) if bound.get(name) not in (None, f"{mod}.{name}")]
        if mod in GATHERERS and borrowed:
            gathered.add(mod)
        elif borrowed:
            wrong.append(f"{path.relative_to(ROOT)}: {', '.join(borrowed)}")
    assert wrong == []
    assert gathered == set(GATHERERS), "a gatherer that gathers nothing leaves GATHERERS"


def _python_sources() -> list[tuple[str, str]]:
    """(where, source) of every Python file of the tree's package, tests, benchmarks and examples,
    and of each ```python block of the docs."""
    sources = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.values())]
    for folder in ("tests", "bench", "examples"):
        sources += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sorted((ROOT / folder).rglob("*.py"))]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)):
            sources.append((f"{page.relative_to(ROOT)} block {i + 1}", block))
    return sources


def test_each_name_is_imported_from_the_module_that_defines_it() -> None:
    """``from tether.x import Name`` names Name's own module (or a gatherer, or a package's
    submodule), anywhere in the tree: in tests, benchmarks, examples and the docs' code too."""
    bound = {mod: _bound_names(path) for mod, path in PACKAGE.items()}
    wrong = []
    for where, source in _python_sources():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in bound or node.module in GATHERERS:
                continue
            for a in node.names:
                home = bound[node.module].get(a.name)
                if home is not None and home != f"{node.module}.{a.name}":
                    wrong.append(f"{where}:{node.lineno} imports {a.name} from {node.module}, not from {home}")
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
