"""A decode worker's token accounting and handover metrics, driven the way Dynamo's Worker calls it
(generate with a prefill_result), against a prefill engine in this process: tokens pulled from
the prefill worker are counted as handed over, not as computed, and every handover shows on
/metrics (ok / local / failed, bytes, seconds)."""

import asyncio
import time

import pytest

pytest.importorskip("dynamo.common.backend", reason="ai-dynamo is installed by make test")
pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
from dynamo_flexkv.integrations.disagg.params import KEY
from dynamo_flexkv.integrations.disagg.roles import PrefillSide
from dynamo_flexkv.integrations.dynamo_worker.args import build_parser
from dynamo_flexkv.integrations.dynamo_worker.component import FlexKVWorkerEngine
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

CFG = EngineModelConfig.load("tiny")
BS = CFG.block_size


class Context:
    def __init__(self, request_id: str) -> None:
        self._id = request_id

    def id(self) -> str:
        return self._id


def samples(worker: FlexKVWorkerEngine) -> dict[str, float]:
    """Every flexkv_* sample of the worker's collector, keyed like /metrics shows it."""
    out = {}
    for family in worker.collector().collect():
        for s in family.samples:
            assert s.labels.get("source") == "reference", s  # the one schema's source label (core/metric_schema.py)
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "source")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def decode_request(tokens, max_tokens, handover):
    return {
        "token_ids": tokens,
        "stop_conditions": {"max_tokens": max_tokens},
        "sampling_options": {},
        "prefill_result": {"disaggregated_params": handover},
    }


@pytest.fixture
def prefill():
    engine = LLMEngine(CFG, num_device_blocks=48)
    agent = KVAgent(engine.kv_cache.layers)
    side = PrefillSide(engine, agent, lease_ttl=30)
    yield engine, side
    side.close()
    agent.close()


def test_decode_counts_pulled_tokens_as_handed_over_not_computed(tmp_path, prefill):
    p_engine, p_side = prefill
    args = build_parser().parse_args(
        [
            "--model",
            "tiny",
            "--model-dir",
            str(tmp_path / "model"),
            "--no-offload",
            "--num-device-blocks",
            "64",
            "--disaggregation-mode",
            "decode",
        ]
    )
    worker = FlexKVWorkerEngine(args)
    prompt = list(range(1, 100))  # 6 full blocks before the last token: 96 tokens handed over
    p_engine.generate([prompt], SamplingParams(max_tokens=1))
    handover = p_side.hand_over(prompt)
    assert len(handover[KEY]["blocks"]) == 6

    async def scenario():
        await worker.start(0)
        try:
            chunks = [c async for c in worker.generate(decode_request(prompt, 3, handover), Context("a"))]
            assert chunks[-1]["engine_data"]["flexkv"]["handover_tokens"] == 96
            # The same prompt again: the decode worker's own device prefix cache has every block.
            again = dict(handover[KEY], lease="another")
            chunks = [c async for c in worker.generate(decode_request(prompt, 3, {KEY: again}), Context("b"))]
            assert chunks[-1]["engine_data"]["flexkv"]["handover_tokens"] == 0
        finally:
            await worker.cleanup()

    asyncio.run(scenario())
    m = samples(worker)
    assert m["flexkv_prompt_tokens_total"] == 2 * len(prompt)
    assert m["flexkv_handover_tokens_total"] == 96
    assert m['flexkv_prompt_tokens_cached_total{tier="device"}'] == 96  # the second request's own cache
    assert m["flexkv_prompt_tokens_computed_total"] == 2 * len(prompt) - 96 - 96  # the last 3 tokens, twice
    assert m['flexkv_handovers_total{result="ok"}'] == 1
    assert m['flexkv_handovers_total{result="local"}'] == 1
    assert m['flexkv_handovers_total{result="failed"}'] == 0
    block_bytes = p_engine.kv_cache.layers[0][0].nbytes
    assert m["flexkv_handover_bytes_total"] == 6 * block_bytes * CFG.num_layers
    assert m["flexkv_handover_seconds_total"] > 0
    deadline = time.monotonic() + 10  # the release rode on the read: it arrives asynchronously
    while len(p_side.leases):
        p_side.service()
        assert time.monotonic() < deadline, "the decode worker's release notice never arrived"
        time.sleep(0.01)


def test_an_aggregated_worker_exports_the_handover_families_as_zeros(tmp_path):
    args = build_parser().parse_args(
        ["--model", "tiny", "--model-dir", str(tmp_path / "model"), "--no-offload", "--num-device-blocks", "64"]
    )
    worker = FlexKVWorkerEngine(args)

    async def scenario():
        await worker.start(0)
        await worker.cleanup()

    asyncio.run(scenario())
    m = samples(worker)
    assert m["flexkv_handover_tokens_total"] == 0 and m['flexkv_handovers_total{result="ok"}'] == 0
