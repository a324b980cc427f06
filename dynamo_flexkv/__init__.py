"""dynamo_flexkv: multi-tier KV-cache offload for NVIDIA Dynamo."""

__version__ = "0.1.0"
