"""Where each value of a serve config came from: the config file or a ``--set``.

An error about one value names its origin, so a ``--set`` typo is blamed on the ``--set``, not on
the file: ``origin_of(source, "FlexKVWorker", "cache", "cpu_cache_gb")``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

COMMON = "Common"


class ConfigSource(str):
    """The config file as errors name it (this string: its path, or "defaults" without one), plus
    the file's own sections and the ``--set`` items applied over them (serve/plan.py
    apply_overrides)."""

    file_config: Mapping[str, Any]
    sets: list[tuple[tuple[str, ...], str]]  # (the path a --set names, the item as given)

    def __new__(
        cls, label: str, file_config: Mapping[str, Any] | None = None, sets: Sequence[str] = ()
    ) -> ConfigSource:
        self = super().__new__(cls, label)
        self.file_config = file_config or {}
        self.sets = [(tuple(item.partition("=")[0].split(".")), item) for item in sets]
        return self

    def of(self, section: str, *keys: str) -> str:
        """Where ``section.keys...`` came from: ``--set ITEM`` when a --set gave it (or the mapping
        it is in), else the file. A component's option it does not set itself is Common's."""
        path = (section, *keys)
        found = self._find(path)
        if found is None and section != COMMON and keys:
            found = self._find((COMMON, *keys))
        return found or str(self)

    def _find(self, path: tuple[str, ...]) -> str | None:
        for named, item in reversed(self.sets):  # the last --set wins, as apply_overrides applies them
            if path[: len(named)] == named:  # it set this value, or the mapping around it
                return f"--set {item}"
        node: Any = self.file_config
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                break
            node = node[key]
        else:
            return str(self)
        for named, item in reversed(self.sets):
            if named[: len(path)] == path:  # a --set made it: a section or mapping the file lacks
                return f"--set {item}"
        return None


def origin_of(source: str, section: str, *keys: str) -> str:
    """``source.of(section, *keys)`` for a ConfigSource; any other source is one origin for all."""
    return source.of(section, *keys) if isinstance(source, ConfigSource) else str(source)
