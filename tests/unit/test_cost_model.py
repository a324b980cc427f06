"""Cost-aware loading (dynamo_flexkv/core/cost.py): the online fits, the decision rule fed with
fixed observations (deterministic: no clock but a fake one, no timed asserts), the load_policy
key, and that a decision to recompute still gives the reference engine's exact tokens."""

import math

import numpy as np
import pytest
import torch

from dynamo_flexkv import CacheConfig, KVManager
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.cost import MIN_GAIN_FRACTION, MIN_GAIN_S, CostModel, LinearFit, Segment
from dynamo_flexkv.core.enums import LoadPolicy
from dynamo_flexkv.core.offload import EmbeddedOffload
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

BB = 1 << 20  # block bytes
BS = 16  # tokens per block


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def model(policy=LoadPolicy.COST_AWARE, layers=4, clock=None) -> CostModel:
    return CostModel(policy, BS, BB, layers, clock=clock or Clock())


def feed(m: CostModel, host_bw=10e9, disk_bw=None, remote_bw=None, per_token=1e-4, latency=1e-4, prompt=4096) -> None:
    """Three sizes per link (so latency and bandwidth separate) and per prefill bucket."""
    for tier, bw in (("host", host_bw), ("disk", disk_bw), ("remote", remote_bw)):
        if bw:
            for blocks in (4, 16, 64):
                m.observe_link(tier, blocks * BB, latency + blocks * BB / bw)
    for n in (64, 512, prompt - 64):
        m.observe_prefill(n, prompt, 0.002 + n * per_token)


def test_fit_separates_latency_and_bandwidth():
    f = LinearFit()
    for x in (1e6, 4e6, 16e6, 2e6, 8e6):
        f.observe(x, 0.003 + x / 2e9)
    c, m = f.coefficients()
    assert c == pytest.approx(0.003, rel=1e-6) and 1 / m == pytest.approx(2e9, rel=1e-6)
    assert f.predict(10e6) == pytest.approx(0.003 + 10e6 / 2e9)


def test_fit_without_spread_goes_through_the_origin_and_ignores_nonsense():
    f = LinearFit()
    for _ in range(3):
        f.observe(1e6, 0.01)
    assert f.coefficients() == (0.0, pytest.approx(1e-8))
    assert not f.observe(0, 1.0) and not f.observe(1e6, -1) and not f.observe(1e6, math.nan)
    assert f.count == 3


def test_fit_follows_a_changed_link_exponentially():
    f = LinearFit(alpha=0.25)
    for x in (1e6, 4e6, 16e6) * 3:
        f.observe(x, x / 1e9)
    for x in (1e6, 4e6, 16e6) * 8:  # the link became 10x slower
        f.observe(x, x / 1e8)
    assert f.predict(8e6) == pytest.approx(8e6 / 1e8, rel=0.02)


def test_cold_start_loads_everything():
    m = model()
    segs = [Segment("host", 0, 10), Segment("disk", 10, 50)]
    d = m.decide(0, segs, 50 * BS + 8, 50)
    assert (d.end, d.reason) == (50, "cold_start")
    feed(m, host_bw=10e9)  # prefill and host measured, disk not yet
    d = m.decide(0, segs, 50 * BS + 8, 50)
    assert (d.end, d.reason) == (50, "cold_start")
    assert d.token_counts(BS) == {("loaded", "host", "cold_start"): 160, ("loaded", "disk", "cold_start"): 640}


def test_slow_disk_is_recomputed_and_host_still_loaded():
    m = model()
    # Recompute: 0.1 ms per token; disk: 10 MB/s (a 1 MiB block 105 ms, its 16 tokens 1.6 ms).
    feed(m, host_bw=20e9, disk_bw=10e6)
    segs = [Segment("host", 0, 100), Segment("disk", 100, 240)]
    d = m.decide(0, segs, 240 * BS + 10, 250)
    assert (d.end, d.reason) == (100, "slower")
    assert d.predicted_s < d.recompute_s
    m.record(d)
    assert m.token_counts() == {
        ("loaded", "host", "faster"): 1600,
        ("recomputed", "disk", "slower"): 2240,
        ("recomputed", "none", "not_cached"): 160,
    }


def test_fast_disk_is_loaded():
    m = model()
    feed(m, host_bw=20e9, disk_bw=5e9)
    d = m.decide(0, [Segment("host", 0, 100), Segment("disk", 100, 240)], 240 * BS + 10, 240)
    assert (d.end, d.reason) == (240, "faster")


def test_a_peer_pull_is_decided_by_the_pulls_measured_link():
    """A router hint's blocks past this worker's own tiers are one more segment (``peer``): pulled
    while the link is unmeasured (cold start, which measures it), then only where pull + load is
    predicted to beat recomputing them."""
    m = model()
    feed(m, host_bw=20e9)  # 0.1 ms per token of prefill: a 1 MiB block recomputes in 1.6 ms
    segs = [Segment("host", 0, 10), Segment("peer", 10, 100)]
    d = m.decide(0, segs, 100 * BS + 8, 100)
    assert (d.end, d.reason) == (100, "cold_start")
    for blocks in (4, 16, 64):  # a slow link: 20 MB/s, 2 ms per pull
        m.observe_link("peer", blocks * BB, 0.002 + blocks * BB / 20e6)
    d = m.decide(0, segs, 100 * BS + 8, 100)
    assert (d.end, d.reason) == (10, "slower")  # host still loads; the peer's 90 blocks are recomputed
    assert d.token_counts(BS)[("recomputed", "peer", "slower")] == 90 * BS
    for blocks in (4, 16, 64) * 4:  # the link got fast: 5 GB/s (the fit follows it)
        m.observe_link("peer", blocks * BB, 0.002 + blocks * BB / 5e9)
    d = m.decide(0, segs, 100 * BS + 8, 100)
    assert (d.end, d.reason) == (100, "faster")


def test_slow_host_against_a_fast_engine_is_recomputed():
    m = model()
    feed(m, host_bw=1e6, per_token=1e-7)  # short prefix, fast GPU: even host loses
    d = m.decide(2, [Segment("host", 2, 20)], 20 * BS + 3, 20)
    assert (d.start, d.end, d.reason) == (2, 2, "slower")
    assert d.token_counts(BS) == {("recomputed", "host", "slower"): 18 * BS}


def test_layerwise_overlap_loads_a_tier_slower_per_block_than_recompute():
    """A remote block costs 1.5x recomputing its tokens, but 200 more blocks of the prompt are
    computed anyway: layerwise, the load hides behind that compute and is loaded; bulk (no
    overlap) it only adds, and is recomputed."""
    m = model(layers=32)
    bw = BB / (1.5 * 16 * 1e-4)
    feed(m, host_bw=50e9, remote_bw=bw, latency=0.0, prompt=8192)
    segs = [Segment("host", 0, 20), Segment("remote", 20, 200)]
    lw = m.decide(0, segs, 400 * BS, 399, layerwise=True)
    bulk = m.decide(0, segs, 400 * BS, 399, layerwise=False)
    assert (lw.end, lw.reason) == (200, "faster") and lw.predicted_s < lw.recompute_s
    assert (bulk.end, bulk.reason) == (20, "slower")


@pytest.mark.parametrize("seed", range(40))
def test_never_predicted_slower_than_recompute(seed):
    rng = np.random.default_rng(seed)
    m = model(layers=int(rng.integers(1, 64)))
    feed(
        m,
        host_bw=10 ** rng.uniform(6, 11),
        disk_bw=10 ** rng.uniform(5, 10),
        remote_bw=10 ** rng.uniform(5, 10),
        per_token=10 ** rng.uniform(-7, -3),
        latency=10 ** rng.uniform(-6, -1),
    )
    a, b, c = sorted(rng.integers(0, 300, 3))
    segs = [Segment("host", 0, a), Segment("disk", a, b), Segment("remote", b, c + 1)]
    d = m.decide(0, segs, (c + 1) * BS + 5, c + 1, layerwise=bool(rng.integers(2)))
    if d.reason in ("faster", "slower"):  # slower than recompute by at most the margin
        assert d.predicted_s <= d.recompute_s + max(MIN_GAIN_S, MIN_GAIN_FRACTION * d.predicted_s) + 1e-12


def test_policies_always_and_never():
    segs = [Segment("host", 0, 4), Segment("disk", 4, 8)]
    for policy, end in ((LoadPolicy.ALWAYS, 8), (LoadPolicy.NEVER, 0)):
        m = model(policy)
        feed(m, host_bw=20e9, disk_bw=1e3)
        d = m.decide(0, segs, 200, 12)
        assert (d.end, d.reason) == (end, policy.value)
    assert model().decide(3, [], 100, 6).reason == "not_cached"


def test_a_left_out_tier_is_probed_again_after_reprobe_s():
    clock = Clock()
    m = model(clock=clock)
    feed(m, host_bw=20e9, disk_bw=10e6)
    segs = [Segment("host", 0, 10), Segment("disk", 10, 100)]
    assert m.decide(0, segs, 1700, 100).end == 10
    clock.t += m.reprobe_s
    d = m.decide(0, segs, 1700, 100)
    assert (d.end, d.reason) == (100, "probe")
    assert m.decide(0, segs, 1700, 100).end == 10  # once: the probe's read measures the tier again


def test_unmeasured_prompt_length_uses_the_nearest_bucket():
    m = model()
    m.observe_prefill(1000, 1024, 0.1)
    m.observe_prefill(100, 1024, 0.01)
    assert m.prefill_seconds(500, 1024) == pytest.approx(0.05)
    assert m.prefill_seconds(500, 8192) == pytest.approx(0.05)
    assert m.prefill_seconds(0, 8192) == 0.0


def test_load_policy_key(monkeypatch):
    assert CacheConfig().load_policy is LoadPolicy.COST_AWARE
    assert CacheConfig(load_policy="cost-aware").load_policy is LoadPolicy.COST_AWARE
    assert CacheConfig.from_dict({"load_policy": "Always"}).load_policy is LoadPolicy.ALWAYS
    assert CacheConfig.load(env={"FLEXKV_LOAD_POLICY": "never"}).load_policy is LoadPolicy.NEVER
    with pytest.raises(ConfigError, match="load_policy='sometimes'.*cost_aware, always, never"):
        CacheConfig.from_dict({"load_policy": "sometimes"})


# ---- through the manager and the reference engine --------------------------------------------------
CFG = EngineModelConfig.preset("tiny")
ENGINE_BB = CFG.kv_spec().token_bytes() * CFG.block_size


def tiny_kv(tmp_path, **kw) -> KVManager:
    gb = ENGINE_BB / (1 << 30)
    return KVManager(
        CFG.kv_spec(),
        CacheConfig.from_dict(
            dict(
                tokens_per_block=CFG.block_size,
                cpu_cache_gb=64 * gb,
                ssd_cache_gb=256 * gb,
                ssd_cache_dir=str(tmp_path / "ssd"),
                **kw,
            )
        ),
    )


def slow_disk(kv: KVManager) -> None:
    """Measurements of a disk far slower than this CPU's prefill: 1 KB/s after 1 s latency."""
    for blocks in (1, 4, 16):
        kv.cost.observe_link("host", blocks * ENGINE_BB, 1e-6 * blocks)
        kv.cost.observe_link("disk", blocks * ENGINE_BB, 1.0 + blocks * ENGINE_BB / 1e3)
    for n in (16, 64, 256):
        kv.cost.observe_prefill(n, 512, 1e-3 * n)


def host_6_disk_12(kv: KVManager, seed: int) -> list:
    """A 12-block prompt computed and stored, host then cut to its first 6 blocks (evicting leaves
    first; disk keeps all 12), and measurements of a disk slower than recompute."""
    engine = LLMEngine(CFG, num_device_blocks=64, offload=EmbeddedOffload(kv))
    prompt = np.random.default_rng(seed).integers(0, CFG.vocab_size, 12 * CFG.block_size + 5).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.flush()
    assert kv.drain(60)
    kv.evict("host", 6)
    slow_disk(kv)
    return prompt


def test_manager_plans_only_what_the_decision_loads(tmp_path):
    with tiny_kv(tmp_path) as kv:
        prompt = host_6_disk_12(kv, seed=0)
        assert kv.match(prompt)["host"] == 6 * CFG.block_size
        assert kv.loadable_tokens(prompt[: 12 * CFG.block_size], prompt_tokens=len(prompt)) == 6 * CFG.block_size
        counts = kv.stats().prefix_tokens
        assert counts["loaded/host/faster"] == 6 * CFG.block_size
        assert counts["recomputed/disk/slower"] == 6 * CFG.block_size


def test_a_lookup_decides_only_about_the_blocks_the_engine_lacks(tmp_path):
    """vLLM asks with its own prefix-cache hit (skip_blocks): the decision weighs loading the
    rest against recomputing the rest, and counts only those tokens."""
    with tiny_kv(tmp_path) as kv:
        prompt = host_6_disk_12(kv, seed=1)
        full = prompt[: 12 * CFG.block_size]

        def decided(skip: int) -> tuple:
            before = kv.stats().prefix_tokens
            end = kv.loadable_tokens(full, prompt_tokens=len(prompt), skip_blocks=skip)
            after = kv.stats().prefix_tokens
            return end // CFG.block_size, {
                k: (n - before.get(k, 0)) // CFG.block_size for k, n in after.items() if n != before.get(k, 0)
            }

        # The engine holds 8 blocks: the 4 disk blocks beyond them are the decision, and recomputed.
        assert decided(8) == (8, {"recomputed/disk/slower": 4})
        # It holds 4: host's 2 more load, the disk's 6 are recomputed.
        assert decided(4) == (6, {"loaded/host/faster": 2, "recomputed/disk/slower": 6})
        with pytest.raises(ValueError, match="skip_blocks=13"):
            kv.loadable_tokens(full, skip_blocks=13)


def test_an_explained_lookup_says_what_each_tier_held_and_why_the_rest_is_recomputed(tmp_path):
    """What the vLLM connector's request_log records per lookup (the replay's accounting): the
    answer cached_tokens gives, and the decision behind it in tokens and milliseconds."""

    with tiny_kv(tmp_path) as kv:
        prompt = host_6_disk_12(kv, seed=2)
        full, B = prompt[: 12 * CFG.block_size], CFG.block_size
        answer, d = EmbeddedOffload(kv).explain_lookup(full, prompt_tokens=len(prompt), skip_blocks=2)
        assert answer == 6 * B == kv.loadable_tokens(full, prompt_tokens=len(prompt), skip_blocks=2)
        assert d is not None
        assert (d["reason"], d["start"], d["end"], d["found"]) == (
            "slower",
            2 * B,
            6 * B,
            {"host": 4 * B, "disk": 6 * B},
        )
        # the disk measured at 1 KB/s: loading everything was predicted far slower than what was chosen
        assert d["load_all_ms"] > d["predicted_ms"] > 0 and d["recompute_ms"] >= d["predicted_ms"]


def test_a_prefill_time_the_fit_refuses_does_not_end_the_cold_start():
    m = model()
    for bad in (float("nan"), float("inf"), float("-inf"), -0.5):
        m.observe_prefill(1000, 4000, bad)
    assert m.prefill == {} and m.prefill_seconds(1000, 4000) is None
    feed_links = [Segment("host", 0, 60)]
    m.observe_link("host", 4 * BB, 1e-4)
    assert m.decide(0, feed_links, 4000, 250).reason == "cold_start"


def test_recompute_decision_gives_exact_tokens(tmp_path):
    """The prefix is on disk only, the disk is measured slow: the engine recomputes it, and its
    tokens and logits equal those of an engine without offload."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, int(n)).tolist() for n in (100, 190, 260)]
    params = SamplingParams(max_tokens=4, record_logits=True)
    weights = LLMEngine(CFG, num_device_blocks=8).model
    expected = [LLMEngine(CFG, num_device_blocks=64, model=weights).generate([p], params)[0] for p in prompts]
    with tiny_kv(tmp_path) as kv:
        writer = LLMEngine(CFG, num_device_blocks=64, model=weights, offload=EmbeddedOffload(kv))
        writer.generate(prompts, SamplingParams(max_tokens=1))
        writer.flush()
        assert kv.drain(60)
        kv.evict("host")
        slow_disk(kv)
        engine = LLMEngine(CFG, num_device_blocks=64, model=weights, offload=EmbeddedOffload(kv), offload_puts=False)
        got = [engine.generate([p], params)[0] for p in prompts]
        for e, g in zip(expected, got):
            assert g.output == e.output
            assert g.cached_tokens == {"device": 0, "host": 0, "disk": 0}
            assert all(torch.equal(a, b) for a, b in zip(e.logits, g.logits))
        counts = kv.stats().prefix_tokens
        assert counts["recomputed/disk/slower"] == sum(len(p) // CFG.block_size for p in prompts) * CFG.block_size
        assert not any(k.startswith("loaded/") for k in counts)
        # The same prompts under load_policy=always load the disk prefix: the switch is per manager.
        kv.cost.policy = LoadPolicy.ALWAYS
        again = LLMEngine(CFG, num_device_blocks=64, model=weights, offload=EmbeddedOffload(kv), offload_puts=False)
        r = again.generate([prompts[2]], params)[0]
        assert r.cached_tokens["disk"] > 0 and r.output == expected[2].output


def test_decisions_and_tier_costs_on_the_workers_metrics(tmp_path):
    from dynamo_flexkv.integrations.dynamo_worker.metrics import _offload_families

    with tiny_kv(tmp_path) as kv:
        slow_disk(kv)
        kv.cost.record(kv.cost.decide(0, [Segment("host", 0, 2), Segment("disk", 2, 40)], 41 * CFG.block_size, 41))
        fams = {f.name: f for f in _offload_families(kv.stats())}
    samples = {tuple(sorted(s.labels.items())): s.value for s in fams["flexkv_prefix_tokens"].samples}
    assert samples[(("decision", "loaded"), ("reason", "faster"), ("tier", "host"))] == 2 * CFG.block_size
    assert samples[(("decision", "recomputed"), ("reason", "slower"), ("tier", "disk"))] == 38 * CFG.block_size
    assert samples[(("decision", "recomputed"), ("reason", "not_cached"), ("tier", "none"))] == CFG.block_size
    latency = {s.labels["tier"]: s.value for s in fams["flexkv_tier_read_latency_seconds"].samples}
    assert latency["disk"] == pytest.approx(1.0)
    bandwidth = {s.labels["tier"]: s.value for s in fams["flexkv_tier_read_bandwidth_bytes"].samples}
    assert bandwidth["disk"] == pytest.approx(1e3)
