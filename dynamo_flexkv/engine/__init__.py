"""Reference engine: a small Llama-style model over a paged KV cache with continuous batching,
offloading through KVManager the way a production engine's connector does."""

from dynamo_flexkv.engine.config import EngineModelConfig
from dynamo_flexkv.engine.llm import LLMEngine
from dynamo_flexkv.engine.model import LlamaModel
from dynamo_flexkv.engine.request import Request, RequestOutput, SamplingParams

__all__ = ["EngineModelConfig", "LLMEngine", "LlamaModel", "Request", "RequestOutput", "SamplingParams"]
