"""Files that ship with the package: the serve graphs, their configs and the model presets.

The repository keeps them at its top level (``graphs/``, ``configs/``, ``configs/models/``). A
wheel carries the same folders as ``dynamo_flexkv/_data/graphs`` and ``dynamo_flexkv/_data/configs``
(``[tool.scikit-build] wheel.packages`` in pyproject.toml maps them there), so an installed package
finds them without the source tree; an editable install (no ``_data``) uses the repository's.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_SEARCH = (_PACKAGE / "_data", _PACKAGE.parent)  # wheel first, then the source checkout

GRAPHS = "graphs"
CONFIGS = "configs"
_SUFFIX = {GRAPHS: ".py", CONFIGS: ".yaml"}


def shipped_dir(kind: str) -> Path:
    """The folder holding the shipped ``graphs`` or ``configs`` (the wheel's copy when installed)."""
    if kind not in _SUFFIX:
        raise ValueError(f"unknown resource kind {kind!r}: use {GRAPHS!r} or {CONFIGS!r}")
    for base in _SEARCH:
        if (base / kind).is_dir():
            return base / kind
    return _SEARCH[0] / kind  # neither exists: lookups below then fail naming this folder


def presets_dir() -> Path:
    """The model presets: ``<name>.yaml`` of the reference engine, ``<name>/config.json`` of a
    Hugging Face architecture (hf_preset)."""
    return shipped_dir(CONFIGS) / "models"


def hf_preset(name: str) -> Path | None:
    """configs/models/<name>/ when it holds a config.json: a preset of a Hugging Face architecture
    vLLM serves (a hybrid sliding-window model, MLA), not one the reference engine computes."""
    path = presets_dir() / name
    return path if name and "/" not in name and (path / "config.json").is_file() else None


def shipped_names(kind: str) -> list[str]:
    """Names of the shipped graphs or configs, e.g. ``["agg", "agg_router"]``."""
    return sorted(p.stem for p in shipped_dir(kind).glob(f"*{_SUFFIX[kind]}"))


def resolve(kind: str, name_or_path: str) -> str:
    """A graph or config argument as a file path. An existing file is returned as given; else a
    shipped one by name (``agg_router``, ``agg_router.py``) or by its repository path
    (``graphs/agg_router.py``), so the README's commands work from any directory with an installed
    wheel. Anything else is returned unchanged for the caller's "does not exist" error."""
    shipped = shipped_dir(kind)  # also rejects an unknown kind
    given = Path(name_or_path)
    if given.is_file():
        return name_or_path
    parts = given.parts
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == kind):
        name = given.name if given.suffix else given.name + _SUFFIX[kind]
        candidate = shipped / name
        if candidate.is_file():
            return str(candidate)
    return name_or_path
