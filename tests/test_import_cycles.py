"""No import cycle anywhere in the package, function-level imports included (a cycle closed by
an import inside a function still ties the two modules into one): every module's imports form a
graph without a strongly connected component of more than one module. Imports under
``if TYPE_CHECKING:`` are annotations only and do not count; the native extension is a leaf, and
only core/native.py imports it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dynamo_flexkv"
EXTENSION = f"{PACKAGE}._native"


def _modules() -> Dict[str, Path]:
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "_data" in rel.parts or "__pycache__" in rel.parts:
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    tree = ast.parse(path.read_text())
    skip: Set[int] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    is_pkg = path.name == "__init__.py"
    out: Set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules or f"{base}.{a.name}" == EXTENSION else base
                for a in node.names
            ]
        for t in targets:
            if t == EXTENSION:
                out.add(t)
                continue
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

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
