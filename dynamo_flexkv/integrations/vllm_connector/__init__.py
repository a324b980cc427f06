"""dynamo_flexkv's vLLM KV connector (vLLM 0.31, ``KVConnectorBase_V1``).

    --kv-transfer-config '{"kv_connector": "FlexKVConnector",
                           "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

The scheduler half (scheduler.py) asks the worker's tiers how much of a prompt they hold and
plans loads into the blocks vLLM allocated; the worker half (worker.py) owns the KVManager and
moves the bytes, layer by layer. See docs/VLLM.md.
"""

import sys
from typing import Any

__all__ = ["FlexKVConnector"]


def __getattr__(name: str) -> Any:
    # Lazy: importing this package's settings (serve checks connector options with them) must not
    # load vLLM; vLLM's loader takes the class by name, which imports it.
    if name == "FlexKVConnector":
        from dynamo_flexkv.integrations.vllm_connector.connector import FlexKVConnector

        _register_by_name()  # also when this package was imported before vLLM was
        return FlexKVConnector
    raise AttributeError(name)


def _register_by_name() -> None:
    """vLLM's MultiConnector (the P/D graphs: NixlConnector + ours) rebuilds each child's stats in
    the API process by connector *name* from KVConnectorFactory, which knows only vLLM's own; a
    child loaded by module path is imported there first (its prom metrics), so registering here
    makes the name resolve."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # another vLLM: the connector's start-up check (vllm_api.py) names what differs
        return
    try:
        KVConnectorFactory.register_connector("FlexKVConnector", __name__, "FlexKVConnector")
    except ValueError:  # already registered (imported twice, or a vLLM that ships the name)
        pass


if "vllm" in sys.modules:  # imported by vLLM (by module path): make the name resolve at once, as before
    _register_by_name()
