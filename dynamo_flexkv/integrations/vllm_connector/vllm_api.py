"""The parts of vLLM's scheduler API and parallel config the connector reads, checked once at
start-up against the installed vLLM: the connector reads them directly (no ``getattr`` with a
default that would turn a renamed field of the next vLLM into a silent miss), so a vLLM whose API
differs fails here, naming what it lacks. Pinned: vLLM 0.31."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

PINNED = "0.31"

# Attributes of a Request (read by scheduler.py): set on the instance or properties of the class.
REQUEST = (
    "request_id",
    "prompt_token_ids",
    "lora_request",
    "prompt_embeds",
    "mm_features",
    "block_hashes",
    "kv_transfer_params",
    "cache_salt",
    "num_computed_tokens",
    "all_token_ids",
    "num_prompt_tokens",
    "num_tokens",
)
# Dataclass fields: (module, class) -> fields.
FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.v1.core.sched.output", "SchedulerOutput"): (
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
    ),
    ("vllm.v1.core.sched.output", "NewRequestData"): ("req_id", "prompt_token_ids", "prompt_embeds", "block_ids"),
    ("vllm.v1.core.sched.output", "CachedRequestData"): (
        "req_ids",
        "resumed_req_ids",
        "new_block_ids",
        "num_output_tokens",
    ),
    ("vllm.v1.outputs", "KVConnectorOutput"): ("finished_recving", "kv_cache_events"),
    ("vllm.lora.request", "LoRARequest"): ("lora_name", "lora_path"),
    # settings.py: the parallel sizes it keys tiers and sockets by, and the one it refuses above 1
    ("vllm.config.parallel", "ParallelConfig"): (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_index",
    ),
}


def _missing_fields(module: str, name: str, fields: Iterable[str]) -> list[str]:
    import importlib

    cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        return [f"{module}.{name}"]
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    have |= set(dir(cls)) | set(getattr(cls, "__annotations__", {})) | _instance_attributes(cls)
    return [f"{name}.{f}" for f in fields if f not in have]


def _instance_attributes(cls: type) -> set[str]:
    """Names a class and its bases assign on ``self`` (``self.x = ...``, ``self.x: T = ...``), read
    from their source's syntax tree (comments, strings and comparisons do not count)."""
    import ast
    import inspect
    import textwrap

    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # a class without Python source
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else ([node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            )
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return names


def missing() -> list[str]:
    """What the installed vLLM lacks of what the connector reads ([] on the pinned one)."""
    from vllm.v1.request import Request

    assigned = _instance_attributes(Request)
    out = [f"Request.{a}" for a in REQUEST if a not in assigned and not hasattr(Request, a)]
    for (module, name), fields in FIELDS.items():
        out += _missing_fields(module, name, fields)
    return out


def check() -> None:
    """Raises, naming each missing part, on a vLLM whose scheduler API differs from the pinned one."""
    gone = missing()
    if gone:
        import vllm

        raise RuntimeError(
            f"FlexKVConnector: vLLM {getattr(vllm, '__version__', '?')} lacks {', '.join(gone)}, which "
            f"the connector reads (it is built for vLLM {PINNED}): install vllm=={PINNED}.0"
        )
