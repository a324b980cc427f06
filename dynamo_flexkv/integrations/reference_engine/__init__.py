"""Reference engine: a small Llama-style model over a paged KV cache with continuous batching,
offloading through KVManager the way a production engine's connector does.

Lazy: ``from dynamo_flexkv.integrations.reference_engine import EngineModelConfig`` (the model
presets, read when a graph is planned or rendered) must not load torch and the data plane that the
engine itself needs."""

from typing import Any

__all__ = ["EngineModelConfig", "LLMEngine", "LlamaModel", "Request", "RequestOutput", "SamplingParams"]

_HOMES = {
    "EngineModelConfig": "config",
    "LLMEngine": "llm",
    "LlamaModel": "model",
    "Request": "request",
    "RequestOutput": "request",
    "SamplingParams": "request",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
