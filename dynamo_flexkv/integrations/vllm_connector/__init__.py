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


def _register_by_name() -> None:
    """vLLM's MultiConnector (the P/D graphs: NixlConnector + ours) rebuilds each child's stats in
    the API process by connector *name* from KVConnectorFactory, which knows only vLLM's own; a
    child loaded by module path is imported there first (its prom metrics), so registering here
    makes the name resolve."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("FlexKVConnector", __name__, "FlexKVConnector")
    except ValueError:  # already registered (imported twice, or a vLLM that ships the name)
        pass


_register_by_name()
