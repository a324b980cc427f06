"""docs/ARCHITECTURE.md maps every module of the package: a new module without its line there
fails here (the map is how a reader finds where things live). A module counts as mapped only
under its own folder in the map's tree, so a new serve/hashing.py is not taken for core/hashing.py."""

import re
from collections.abc import Iterator

from repo_paths import ROOT

PACKAGE = ROOT / "dynamo_flexkv"


def modules() -> Iterator[str]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or "_data" in rel.parts or "__pycache__" in rel.parts:
            continue
        yield rel.as_posix()


def mapped(doc: str) -> set[str]:
    """The module paths (relative to the package) the source-layout tree names: each line's
    folder is the nearest less-indented ``name/`` line above it; a line may name several files."""
    lines = doc.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "dynamo_flexkv/")
    out: set[str] = set()
    stack = []  # (indent, folder)
    for line in lines[start + 1 :]:
        if line.strip().startswith("```"):
            break
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if re.fullmatch(r"[\w.]+\.py,?|[\w]+/", first):  # a new entry: leave the folders it is not in
            while stack and stack[-1][0] >= indent:
                stack.pop()
        if first.endswith("/"):
            stack.append((indent, first.rstrip("/")))
        folder = "/".join(name for _, name in stack)
        for name in re.findall(r"\b\w+\.py\b", line):
            out.add(f"{folder}/{name}" if folder else name)
    return out


def test_every_module_has_its_place_in_the_architecture_map():
    have = mapped((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    missing = [rel for rel in modules() if rel not in have]
    assert not missing, (
        f"modules docs/ARCHITECTURE.md's source layout does not name under their folder: {missing}; "
        "add each with a few words on what it holds"
    )


def test_the_map_is_read_by_folder():
    doc = """
    dynamo_flexkv/
      core/             the core
        hashing.py        hashing
        remote/           remote tier: store.py RemoteStore,
                          resp.py client
        tasks.py          tasks
      serve/            serving
        plan.py           plans
    ```
    """
    assert mapped(doc) == {
        "core/hashing.py",
        "core/remote/store.py",
        "core/remote/resp.py",
        "core/tasks.py",
        "serve/plan.py",
    }
