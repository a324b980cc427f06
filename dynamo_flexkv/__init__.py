"""dynamo_flexkv: multi-tier KV-cache offload for NVIDIA Dynamo."""

from dynamo_flexkv.errors import FlexKVError

__version__ = "0.1.0"

__all__ = ["FlexKVError", "KVManager", "CacheConfig", "ModelSpec", "KVLayoutType", "TaskStatus", "TaskResult"]


def __getattr__(name: str):
    # Lazy: `import dynamo_flexkv.hashing` must not pull in torch and the data plane.
    if name == "KVManager":
        from dynamo_flexkv.manager import KVManager
        return KVManager
    if name == "CacheConfig":
        from dynamo_flexkv.config import CacheConfig
        return CacheConfig
    if name in ("ModelSpec", "KVLayoutType"):
        from dynamo_flexkv import layout
        return getattr(layout, name)
    if name in ("TaskStatus", "TaskResult"):
        from dynamo_flexkv import tasks
        return getattr(tasks, name)
    raise AttributeError(name)
