"""No import cycle anywhere in the package, by the same rule as the team's cycle tool
(shared/tools/import_cycles.py): every import counts, inside a function or under
``if TYPE_CHECKING:`` too (an annotation-only import still ties two modules together for a reader),
and ``from pkg import name`` is an import of ``pkg`` (its ``__init__`` runs) and of ``pkg.name``
when that is a module. The native extension is a leaf inside the core, and only core/native.py
imports it."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT

PACKAGE = "dynamo_flexkv"
EXTENSION = f"{PACKAGE}.core._native"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "_data" in rel.parts or "__pycache__" in rel.parts:
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            named.add(base)
            named.update(f"{base}.{a.name}" for a in node.names)
    out: set[str] = set()
    for t in named:
        if t == EXTENSION:
            out.add(t)
            continue
        while t and t not in modules:
            t = t.rpartition(".")[0]
        if t and t != name:
            out.add(t)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(edges)
    detail = [" <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(edges[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles:\n  " + "\n  ".join(detail)


def test_only_core_native_imports_the_extension():
    modules = _modules()
    users = sorted(name for name, path in modules.items() if EXTENSION in _imports(name, path, modules))
    assert users == [f"{PACKAGE}.core.native"], users


def test_the_checker_sees_a_cycle_closed_inside_a_function():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_checker_counts_type_checking_and_package_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "def f():\n    from dynamo_flexkv.core import hashing\n"
        "if TYPE_CHECKING:\n    from dynamo_flexkv.core.node.server import NodeCacheServer\n"
    )
    modules = _modules()
    got = _imports(f"{PACKAGE}.core.x", src, modules)
    assert got == {f"{PACKAGE}.core", f"{PACKAGE}.core.hashing", f"{PACKAGE}.core.node.server"}, got
