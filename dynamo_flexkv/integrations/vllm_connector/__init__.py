"""dynamo_flexkv's vLLM KV connector (vLLM 0.31, ``KVConnectorBase_V1``).

    --kv-transfer-config '{"kv_connector": "FlexKVConnector",
                           "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

The scheduler half (scheduler.py) asks the worker's tiers how much of a prompt they hold and
plans loads into the blocks vLLM allocated; the worker half (worker.py) owns the KVManager and
moves the bytes, layer by layer. See docs/VLLM.md.
"""

from dynamo_flexkv.integrations.vllm_connector.connector import FlexKVConnector

__all__ = ["FlexKVConnector"]
