"""dynamo_flexkv: multi-tier KV-cache offload for NVIDIA Dynamo."""

from typing import Any

from dynamo_flexkv.core.errors import FlexKVError

# The one place the version is written (pyproject.toml reads it from here); CHANGELOG.md says what it brought.
__version__ = "0.2.0"

__all__ = [
    "FlexKVError",
    "KVManager",
    "open_offload",
    "EngineOffload",
    "CacheConfig",
    "ModelSpec",
    "KVLayoutType",
    "TaskStatus",
    "TaskResult",
    "ManagerStats",
    "ManagerClosed",
    "TaskFailed",
    "TooManyTasks",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import dynamo_flexkv.core.hashing` must not pull in torch and the data plane.
    if name == "KVManager":
        from dynamo_flexkv.core.manager import KVManager

        return KVManager
    if name in ("open_offload", "EngineOffload"):
        from dynamo_flexkv.core import offload

        return getattr(offload, name)
    if name == "CacheConfig":
        from dynamo_flexkv.core.config import CacheConfig

        return CacheConfig
    if name in ("ModelSpec", "KVLayoutType"):
        from dynamo_flexkv.core import layout

        return getattr(layout, name)
    if name in ("TaskStatus", "TaskResult", "ManagerClosed", "TaskFailed", "TooManyTasks"):
        from dynamo_flexkv.core import tasks

        return getattr(tasks, name)
    if name == "ManagerStats":
        from dynamo_flexkv.core.stats import ManagerStats

        return ManagerStats
    raise AttributeError(name)
