"""The handover's integrity check: the prefill side sends an xxh3 per handed-over block, the
decode side verifies the blocks it pulled before anything uses them. A block corrupted between
the two (here: the prefill worker's copy after it was handed over) is recomputed, exactly, counted
as a failed handover with one WARNING line."""

import logging
from dataclasses import replace

import pytest
import torch
from disagg_helpers import decode_one, engine_pair, serve_releases

pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from dynamo_flexkv.core.transfer.nixl_agent import block_checksums
from dynamo_flexkv.integrations.disagg import HandoverParams, HandoverRefused
from dynamo_flexkv.integrations.disagg.params import KEY
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import SamplingParams

CFG = EngineModelConfig.load("tiny")


@pytest.fixture
def pair():
    with engine_pair() as p:
        yield p


@pytest.mark.unit
def test_checksums_are_per_block_and_see_every_layer():
    engine = LLMEngine(CFG, num_device_blocks=8)
    torch.manual_seed(0)
    for layer in engine.kv_cache.layers:
        layer.normal_()
    before = block_checksums(engine.kv_cache.layers, [0, 3, 5])
    assert len(set(before)) == 3 and before == block_checksums(engine.kv_cache.layers, [0, 3, 5])
    engine.kv_cache.layers[-1][3, 1, 0, 0, 0] += 1  # one value of one layer of block 3
    after = block_checksums(engine.kv_cache.layers, [0, 3, 5])
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]


@pytest.mark.unit
def test_checksums_are_xxh3_of_each_layers_span_then_of_those_digests():
    """The definition both sides of a handover hash by (the native call, checked against the
    xxhash package over the same bytes), for blocks in any order, and refused out of range."""
    import numpy as np
    import xxhash

    torch.manual_seed(1)
    layers = [torch.randn(40, 2, 16, 8).to(torch.bfloat16) for _ in range(5)]
    blocks = [39, 0, 17, 17, 4]

    def reference(b: int) -> int:
        per_layer = [xxhash.xxh3_64_intdigest(x[b].contiguous().view(torch.uint8).numpy().tobytes()) for x in layers]
        return xxhash.xxh3_64_intdigest(np.asarray(per_layer, dtype="<u8").tobytes())

    assert block_checksums(layers, blocks) == [reference(b) for b in blocks]
    assert block_checksums(layers, []) == []
    for bad in ([40], [-1]):
        with pytest.raises(ValueError, match=r"block ids must be in \[0, 40\)"):
            block_checksums(layers, bad)


def test_a_corrupted_block_is_recomputed_exactly_and_counted_as_a_failed_handover(pair, caplog):
    prefill, decode, p_side, d_side = pair
    agg = LLMEngine(CFG, num_device_blocks=48)
    prompt = list(range(1, 100))
    params = SamplingParams(max_tokens=6)
    (want,) = agg.generate([prompt], params)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    handover = p_side.hand_over(prompt)
    assert len(HandoverParams.from_dict(handover).checksums) == len(handover[KEY]["blocks"])
    prefill.kv_cache.layers[1][handover[KEY]["blocks"][2]].fill_(7.0)  # after hashing, before the read
    with caplog.at_level(logging.WARNING, logger="dynamo_flexkv.integrations.disagg.roles"):
        got = decode_one(decode, d_side, "c1", prompt, params, handover)
    assert got == want.output
    assert d_side.stats.failed == 1 and d_side.stats.ok == 0 and d_side.stats.pulled_blocks == 0
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "dynamo_flexkv.integrations.disagg.roles"
    ]
    assert len(warnings) == 1 and "checksum" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    serve_releases(p_side)  # the read completed: its notification still ends the lease
    assert decode.pool.num_available == decode.pool.num_blocks
    # What decode recomputed entered its prefix cache as computed blocks: the next request hits
    # them and, with an intact handover of the same prompt, needs nothing from the prefill worker.
    prefill.kv_cache.layers[1].zero_()  # nothing of the prefill worker's KV may be used any more
    assert decode_one(decode, d_side, "c2", prompt, params, p_side.hand_over(prompt)) == want.output
    assert d_side.stats.local == 1


@pytest.mark.unit
def test_checksums_travel_signed_and_must_match_the_blocks():
    p = HandoverParams("agent", None, "L-1", [4, 5], 123, [1000, 2000], 64, "DRAM", 0, 1e9, 8, checksums=[1, 2**64 - 1])
    assert HandoverParams.from_dict(p.to_dict()) == p
    for bad in (
        dict(p.to_dict()[KEY], checksums=p.to_dict()[KEY]["checksums"][:-2]),  # not 8 bytes per block
        {k: v for k, v in p.to_dict()[KEY].items() if k != "checksums"},
        dict(p.to_dict()[KEY], checksums="***"),
    ):
        with pytest.raises(HandoverRefused):
            HandoverParams.from_dict({KEY: bad})
    signed = p.signed(b"s")
    signed.verify(b"s")
    with pytest.raises(HandoverRefused, match="forged"):  # checksums that fit another prompt's blocks
        HandoverParams.from_dict(replace(signed, checksums=[2, 1]).to_dict()).verify(b"s")
