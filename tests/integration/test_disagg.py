"""Disaggregated prefill/decode inside one process: two engines with their own NIXL (UCX) agents,
the real lease table and the real pull. Decode tokens must equal the aggregated engine's, the
pulled KV bytes must equal the prefill engine's, and no lease or block may be left behind."""

import random

import pytest
import torch
from disagg_helpers import Clock, decode_one, engine_pair, serve_releases

pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from repo_paths import HELPERS

from dynamo_flexkv.core.transfer.nixl_agent import KVAgent, _indices, _layer_offsets
from dynamo_flexkv.integrations.disagg import HandoverParams, HandoverRefused, LeaseTable
from dynamo_flexkv.integrations.disagg.params import KEY
from dynamo_flexkv.integrations.disagg.roles import DecodeSide, PrefillSide
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import SamplingParams

CFG = EngineModelConfig.load("tiny")


@pytest.mark.unit
def test_lease_ends_on_release_or_expiry_never_twice():
    clock = Clock()
    table = LeaseTable(5.0, clock)
    a, b = table.grant([1, 2]), table.grant([3])
    assert a.id != b.id and len(table) == 2
    assert table.release(a.id).blocks == [1, 2]
    assert table.release(a.id) is None  # a repeated notice releases nothing twice
    clock.now = 4.9
    assert table.expire() == []
    clock.now = 5.0
    assert [x.id for x in table.expire()] == [b.id]
    assert table.release(b.id) is None and len(table) == 0  # a late notice after expiry
    assert (table.granted, table.released, table.expired_count) == (2, 1, 1)
    with pytest.raises(ValueError, match="ttl"):
        LeaseTable(0)


@pytest.mark.unit
def test_params_round_trip_and_refuse_malformed_payloads():
    p = HandoverParams("agent", "bWV0YQ==", "L-1", [4, 5], 123, [1000, 2000], 64, "DRAM", 0, 1e9, 8, checksums=[7, 8])
    assert HandoverParams.from_dict(p.to_dict()) == p
    assert HandoverParams.from_dict({}) is None and HandoverParams.from_dict(None) is None
    for bad in (
        {KEY: {"version": 99}},
        {KEY: "x"},
        {KEY: dict(p.to_dict()[KEY], blocks="no")},
        {KEY: dict(p.to_dict()[KEY], mem="HBM")},
        {KEY: {k: v for k, v in p.to_dict()[KEY].items() if k != "lease"}},
        {KEY: dict(p.to_dict()[KEY], blocks=[4, 8])},
        {KEY: dict(p.to_dict()[KEY], num_blocks=0)},
        {KEY: dict(p.to_dict()[KEY], version=2)},
    ):
        with pytest.raises(HandoverRefused):
            HandoverParams.from_dict(bad)


@pytest.mark.unit
def test_descriptor_indices_are_layer_major_like_the_prepared_lists():
    assert _indices(_layer_offsets(2, 10), [3, 4, 9]) == [3, 4, 9, 13, 14, 19]
    assert _indices(_layer_offsets(2, 10), []) == []
    with pytest.raises(ValueError, match="32-bit"):
        _layer_offsets(80, 2**25)


def _prompts(n, rng):
    """Mixed lengths; about half share a prefix with an earlier prompt."""
    out = []
    for _ in range(n):
        if out and rng.random() < 0.5:
            base = rng.choice(out)
            keep = rng.randint(1, len(base))
            out.append(base[:keep] + [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 60))])
        else:
            out.append([rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 120))])
    return out


@pytest.fixture
def pair():
    with engine_pair() as p:
        yield p


def test_decode_tokens_and_pulled_bytes_equal_aggregated_and_prefill(pair):
    prefill, decode, p_side, d_side = pair
    agg = LLMEngine(CFG, num_device_blocks=48)
    rng = random.Random(7)
    params = SamplingParams(max_tokens=5)
    pulled = []
    handed = {}  # request id -> the handover it was given (what decode pulls from)
    fill = d_side.fill

    def recording_fill(req, first, cap):
        got = fill(req, first, cap)
        if got:
            p = handed[req.id]
            pulled.append((list(p.blocks[first : first + got]), list(req.block_table[first : first + got])))
        return got

    decode.remote_fill = recording_fill

    for i, prompt in enumerate(_prompts(6, rng)):
        (want,) = agg.generate([prompt], params)
        prefill.generate([prompt], SamplingParams(max_tokens=1))
        handover = p_side.hand_over(prompt)
        assert bool(handover) == (len(prompt) > CFG.block_size)
        handed[f"d{i}"] = HandoverParams.from_dict(handover)
        got = decode_one(decode, d_side, f"d{i}", prompt, params, handover)
        assert got == want.output, f"prompt {i} ({len(prompt)} tokens)"
        for remote, local in pulled:  # the bytes decode computes on are the prefill worker's
            for layer in range(CFG.num_layers):
                assert torch.equal(decode.kv_cache.layers[layer][local], prefill.kv_cache.layers[layer][remote])
        pulled.clear()
        serve_releases(p_side)  # before the next prompt (its blocks stay referenced while leased)
    assert d_side.stats.pulled_blocks > 0 and d_side.stats.local_blocks > 0  # shared prefixes hit locally
    assert d_side.stats.failed == 0
    # Every lease ended on its release notice; every block is free or evictable on both sides.
    assert len(p_side.leases) == 0 and p_side.leases.released == p_side.leases.granted > 0
    assert prefill.pool.num_available == prefill.pool.num_blocks
    assert decode.pool.num_available == decode.pool.num_blocks


def test_a_refused_or_failed_handover_is_recomputed_exactly_and_the_lease_still_ends(pair):
    prefill, decode, p_side, d_side = pair
    agg = LLMEngine(CFG, num_device_blocks=48)
    prompt = list(range(1, 100))
    params = SamplingParams(max_tokens=4)
    (want,) = agg.generate([prompt], params)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    good = p_side.hand_over(prompt)
    # Another prompt's handover (its hash differs): refused, recomputed, lease released.
    other = dict(good[KEY], last_hash=good[KEY]["last_hash"] ^ 1)
    assert decode_one(decode, d_side, "r1", prompt, params, {KEY: other}) == want.output
    assert d_side.stats.failed == 1
    # A lease that ended (or ends before a read could): refused, recomputed.
    decode.pool = type(decode.pool)(decode.pool.num_blocks)  # forget what r1 computed
    late = dict(good[KEY], lease_expires_unix=0.5)
    assert decode_one(decode, d_side, "r0", prompt, params, {KEY: late}) == want.output
    assert d_side.stats.failed == 2 and d_side.stats.pulled_blocks == 0
    # An agent that does not exist: the pull fails, the prompt is recomputed.
    decode.pool = type(decode.pool)(decode.pool.num_blocks)  # forget what r1 computed
    ghost = dict(good[KEY], agent="flexkv-kv-gone", metadata="bm90IG1ldGFkYXRh")
    assert decode_one(decode, d_side, "r2", prompt, params, {KEY: ghost}) == want.output
    assert d_side.stats.failed == 3
    serve_releases(p_side)  # r1's release notice ended the one real lease
    assert p_side.leases.released == 1 and p_side.leases.expired_count == 0
    # A lease whose decode worker never answers ends by timeout.
    clock = Clock()
    p_side.leases = LeaseTable(3.0, clock)
    p_side.hand_over(prompt)
    assert prefill.pool.num_available < prefill.pool.num_blocks
    clock.now = 3.0
    p_side.service()
    assert len(p_side.leases) == 0 and prefill.pool.num_available == prefill.pool.num_blocks


def test_prefill_process_killed_after_handing_over_decode_recomputes_exactly(tmp_path):
    """A real prefill process: its first handover is pulled across processes; then it is killed
    (SIGKILL) after handing over a second prompt, before the decode worker reads it."""
    import json
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "disagg_prefill_proc.py"), "30"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        decode = LLMEngine(CFG, num_device_blocks=48)
        agent = KVAgent(decode.kv_cache.layers)
        side = DecodeSide(decode, agent, pull_timeout=3)
        fills = []

        def timed_fill(req, first, cap):
            t0 = time.monotonic()
            try:
                return side.fill(req, first, cap)
            finally:
                fills.append(time.monotonic() - t0)

        decode.remote_fill = timed_fill
        agg = LLMEngine(CFG, num_device_blocks=48, device_prefix_cache=False)
        params = SamplingParams(max_tokens=4)
        first, second = list(range(3, 90)), list(range(200, 300))
        for i, prompt in enumerate((first, second)):
            proc.stdin.write(json.dumps(prompt) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            while not line.startswith("HANDOVER "):
                assert line, "the prefill process died"
                line = proc.stdout.readline()
            handover = json.loads(line[len("HANDOVER ") :])
            if i == 1:
                proc.kill()
                proc.wait(10)
            got = decode_one(decode, side, f"k{i}", prompt, params, handover)
            assert got == agg.generate([prompt], params)[0].output
        assert len(fills) == 2 and max(fills) < 3 + 2  # bounded by the pull timeout, never a hang
        assert side.stats.pulled_blocks == (len(first) - 1) // CFG.block_size  # the first, across processes
        assert side.stats.failed == 1  # the dead prefill's handover: recomputed
        assert decode.pool.num_available == decode.pool.num_blocks and side.pending_handovers == 0
        agent.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_signed_handover_is_pulled_and_an_unsigned_or_differently_signed_one_recomputed():
    """With the graph's secret, decode pulls what the prefill side signed; a handover signed with
    another secret or not at all is recomputed (same tokens) and gets no release from decode."""
    prefill, decode, agg = (LLMEngine(CFG, num_device_blocks=48) for _ in range(3))
    p_agent, d_agent = KVAgent(prefill.kv_cache.layers), KVAgent(decode.kv_cache.layers)
    signer, other = PrefillSide(prefill, p_agent, 30, secret=b"graph"), PrefillSide(prefill, p_agent, 30, b"other")
    unsigned = PrefillSide(prefill, p_agent, 30)
    d_side = DecodeSide(decode, d_agent, pull_timeout=10, secret=b"graph")
    decode.remote_fill = d_side.fill
    try:
        params = SamplingParams(max_tokens=4)
        for i, side in enumerate((signer, other, unsigned)):
            prompt = list(range(10 + 130 * i, 110 + 130 * i))
            (want,) = agg.generate([prompt], params)
            prefill.generate([prompt], SamplingParams(max_tokens=1))
            handover = side.hand_over(prompt)
            assert decode_one(decode, d_side, f"s{i}", prompt, params, handover) == want.output
            assert d_side.stats.failed == i and d_side.stats.pulled_blocks > 0
        serve_releases(signer)
        assert len(other.leases) == len(unsigned.leases) == 1  # no release sent
    finally:
        for side in (signer, other, unsigned):
            side.close()
        d_agent.close()
        p_agent.close()
