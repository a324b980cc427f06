"""The reference engine with offload: restored KV is exact, and outputs do not change."""

import numpy as np
import pytest
import torch

from dynamo_flexkv import CacheConfig, KVManager
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.offload import EmbeddedOffload
from dynamo_flexkv.core.transfer.graph import OpKind
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

CFG = EngineModelConfig.preset("tiny")
BS = CFG.block_size
BLOCK_BYTES = CFG.kv_spec().token_bytes() * BS


def offload_config(tmp_path, host_blocks, disk_blocks):
    gb = BLOCK_BYTES / (1 << 30)
    # These tests are about what loads bring back: load every cached block. (cost_aware, the
    # default, would recompute blocks whose measured load is slower: tests/unit/test_cost_model.py.)
    d = dict(tokens_per_block=BS, cpu_cache_gb=host_blocks * gb, load_policy="always")
    if disk_blocks:
        d.update(ssd_cache_gb=disk_blocks * gb, ssd_cache_dir=str(tmp_path / "ssd"))
    return CacheConfig.from_dict(d)


def workload(seed, n, vocab=CFG.vocab_size):
    """Multi-turn-like prompts: most extend an earlier prompt (its whole text, or a prefix)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if out and rng.random() < 0.75:
            base = out[int(rng.integers(len(out)))]
            base = base[: int(rng.integers(min(BS, len(base)), len(base) + 1))]
        else:
            base = []
        out.append(base + rng.integers(0, vocab, int(rng.integers(5, 3 * BS))).tolist())
    return [p[: 12 * BS] for p in out]


def run(engine, prompts, params):
    """One request at a time (so cache state, not batching, decides what is reused)."""
    return [engine.generate([p], params)[0] for p in prompts]


def block_bytes(engine, block: int) -> torch.Tensor:
    """One device block's K and V in every layer, as one tensor (a copy)."""
    return torch.stack([layer[block] for layer in engine.kv_cache.layers]).clone()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "bulk"])
@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_offload_serves_same_tokens_and_logits(tmp_path, layerwise, tiers):
    """Offload never changes a generated token, and the logits stay within 1e-3 of an engine that
    never evicts. Where every block of the cached prefix (device hits and loads) holds the same bytes
    as the reference engine's block for that prefix, and the boundary is the same, the logits are
    bit-equal: the same inputs through the same kernels. (A block's bytes depend on the prefill
    chunks that computed it: this engine may have computed a prefix with another cached boundary
    than the reference did, which moves the low bits. Restored bytes == stored bytes is
    test_restored_kv_bytes_equal_stored.)"""
    prompts = workload(1 if layerwise else 2, 120)
    params = SamplingParams(max_tokens=3, record_logits=True)
    model = LLMEngine(CFG, num_device_blocks=4096).model  # one set of weights for both engines
    reference = LLMEngine(CFG, num_device_blocks=4096, model=model)  # never evicts
    expected, computed = [], {}  # computed: prefix hash -> the reference's bytes of that block
    for p in prompts:
        e = reference.generate([p], params)[0]
        for i, h in enumerate(e.hashes.sequence[: len(p) // BS]):
            computed.setdefault(int(h), block_bytes(reference, e.block_table[i]))
        expected.append(e)
    host, disk = (512, 0) if tiers == "host" else (24, 1024)
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, host, disk)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=40, model=model, offload=EmbeddedOffload(kv, layerwise))
        got, prefix_as_reference = [], []
        for p in prompts:
            g = engine.generate([p], params)[0]
            cached = (g.device_hit_tokens + g.offload_hit_tokens) // BS
            prefix_as_reference.append(
                all(
                    torch.equal(block_bytes(engine, g.block_table[i]), computed[int(g.hashes.sequence[i])])
                    for i in range(cached)
                )
            )
            got.append(g)
            engine.flush()
        served = bit_checked = 0
        for n, (e, g) in enumerate(zip(expected, got)):
            assert g.output == e.output, "offload changed the generated tokens"
            same_boundary = g.device_hit_tokens + g.offload_hit_tokens == e.device_hit_tokens
            strict = same_boundary and prefix_as_reference[n]
            bit_checked += strict
            for le, lg in zip(e.logits, g.logits):
                diff = float((le - lg).abs().max())
                if strict:
                    assert torch.equal(le, lg), (
                        f"prompt {n}: the same cached prefix ({e.device_hit_tokens} tokens, every block the "
                        f"reference's bytes), logits differ by {diff:.3g}"
                    )
                else:
                    assert diff < 1e-3, f"prompt {n}: logits differ by {diff:.3g}"
            served += g.offload_hit_tokens
        assert served > 20 * BS, "the workload never hit the offload tiers"
        assert bit_checked >= len(prompts) // 2, f"only {bit_checked} of {len(prompts)} prompts were bit-checked"
        if tiers == "host+disk":
            assert kv.stats().links[OpKind.DISK2H.value].bytes > 0
        assert engine.pool.evictions > 0


def test_restored_kv_bytes_equal_stored(tmp_path):
    prompts = workload(3, 40)
    params = SamplingParams(max_tokens=1)
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 256, 512)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=4096, offload=EmbeddedOffload(kv))
        reference = {}
        for p in prompts:  # compute everything once; remember each block's bytes by prefix hash
            r = engine.generate([p], params)[0]
            engine.flush()
            for i, h in enumerate(r.hashes.sequence[: len(p) // BS]):
                b = r.block_table[i]
                reference[int(h)] = [layer[b].clone() for layer in engine.kv_cache.layers]
        checked = 0
        fresh = LLMEngine(CFG, num_device_blocks=4096, offload=EmbeddedOffload(kv), model=engine.model)
        for p in prompts:  # a new engine has an empty device cache: every hit comes from offload
            r = fresh.generate([p], params)[0]
            for i in range(r.offload_hit_tokens // BS):
                b = r.block_table[i]
                want = reference[int(r.hashes.sequence[i])]
                assert all(torch.equal(layer[b], w) for layer, w in zip(fresh.kv_cache.layers, want))
                checked += 1
            fresh.flush()
        assert checked > 40


def test_recompute_matches_within_rounding():
    """Against a full recompute (no cache at all), chunked prefill differs by rounding only."""
    prompts = workload(4, 30)
    params = SamplingParams(max_tokens=2, record_logits=True)
    cached = LLMEngine(CFG, num_device_blocks=4096)
    model = cached.model
    worst = 0.0
    for p in prompts:
        a = cached.generate([p], params)[0]
        b = LLMEngine(CFG, num_device_blocks=64, model=model).generate([p], params)[0]
        worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)))
        assert a.output == b.output
    print(f"largest logit difference, cached vs full recompute: {worst:.3g}")
    assert worst < 1e-3


def test_failed_load_is_recomputed(tmp_path):
    prompt = list(range(5 * BS + 3))
    params = SamplingParams(max_tokens=3, record_logits=True)
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 256, 0)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=64, offload=EmbeddedOffload(kv))
        first = engine.generate([prompt], params)[0]
        engine.flush()
        fresh = LLMEngine(CFG, num_device_blocks=64, offload=EmbeddedOffload(kv), model=engine.model)
        mover = kv.transfer.movers[OpKind.H2D]  # the one registered for `fresh`
        orig = mover.run
        mover.run = lambda op: (_ for _ in ()).throw(OSError(5, "injected H2D failure"))
        try:
            again = fresh.generate([prompt], params)[0]
        finally:
            mover.run = orig
        assert fresh.recomputed_loads == 1
        assert again.output == first.output
        assert again.offload_hit_tokens == 0


def test_continuous_batching_and_queue_prefetch(tmp_path):
    prompts = workload(5, 24)
    params = SamplingParams(max_tokens=4)
    ref = LLMEngine(CFG, num_device_blocks=4096)
    one_by_one = [ref.generate([p], params)[0].output for p in prompts]
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 64, 512)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=48, model=ref.model, offload=EmbeddedOffload(kv), max_running=4)
        batched = engine.generate(prompts, params)
        engine.flush()
        assert [r.output for r in batched] == one_by_one  # batching changes no request's tokens
        assert sum(r.prefetch_task is not None for r in batched) >= len(prompts) - 4
        assert kv.stats().tasks.in_flight == 0  # every task's result was collected


def test_bad_requests():
    engine = LLMEngine(CFG, num_device_blocks=8)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([CFG.vocab_size])
    with pytest.raises(ValueError, match="needs 9 blocks; the device cache has 8"):
        engine.add_request([1] * (8 * BS), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


def test_seeded_sampling_and_stop_tokens():
    engine = LLMEngine(CFG, num_device_blocks=64)
    prompt = list(range(40))
    a = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3))[0].output
    b = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3))[0].output
    c = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=4))[0].output
    assert a == b and a != c
    stop = engine.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[a[0]], temperature=1.0, seed=3))[0]
    assert stop.output == [a[0]] and stop.finish_reason == "stop"


def test_loads_hugging_face_directory(tmp_path):
    """A local HF-style Llama directory (config.json + safetensors) loads and computes exactly
    what the same weights compute in memory."""
    import json

    from safetensors.torch import save_file

    from dynamo_flexkv.integrations.reference_engine import LlamaModel

    src = LLMEngine(CFG, num_device_blocks=64, seed=11).model
    names = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
    }
    tensors = {
        "model.embed_tokens.weight": src.w["embed"],
        "model.norm.weight": src.w["norm"],
        "lm_head.weight": src.w["lm_head"],
    }
    for i in range(CFG.num_layers):
        for short, hf in names.items():
            tensors[f"model.layers.{i}.{hf}.weight"] = src.w[f"{i}.{short}"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": CFG.vocab_size,
                "hidden_size": CFG.hidden_size,
                "num_hidden_layers": CFG.num_layers,
                "num_attention_heads": CFG.num_heads,
                "num_key_value_heads": CFG.num_kv_heads,
                "head_dim": CFG.head_dim,
                "intermediate_size": CFG.intermediate_size,
                "rope_theta": CFG.rope_theta,
                "rms_norm_eps": CFG.rms_norm_eps,
                "torch_dtype": "float32",
            }
        )
    )
    loaded = LlamaModel.from_pretrained(tmp_path)
    params = SamplingParams(max_tokens=4, record_logits=True)
    a = LLMEngine(CFG, num_device_blocks=64, model=src).generate([list(range(50))], params)[0]
    b = LLMEngine(loaded.cfg, num_device_blocks=64, model=loaded).generate([list(range(50))], params)[0]
    assert a.output == b.output
    # Same weights, same math; BLAS may pick other kernels for tensors at other alignments
    # (safetensors' buffers), so allow float32 rounding.
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < 1e-4


def test_without_device_prefix_cache_reuse_comes_from_offload(tmp_path):
    prompt = list(range(6 * BS + 2))
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 128, 0)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=64, offload=EmbeddedOffload(kv), device_prefix_cache=False)
        first = engine.generate([prompt], SamplingParams(max_tokens=2))[0]
        engine.flush()
        again = engine.generate([prompt], SamplingParams(max_tokens=2))[0]
        assert first.device_hit_tokens == 0 and again.device_hit_tokens == 0
        assert again.offload_hit_tokens == 6 * BS and again.output == first.output
        assert engine.pool.by_hash == {}  # nothing stayed cached on the device


# ---- abort ---------------------------------------------------------------------------------------
def idle(engine, kv=None) -> None:
    """Steps until nothing is pending, then checks nothing leaked: every device block is free or
    an evictable prefix-cache block, and every offload task was collected."""
    for _ in range(10_000):
        if not engine.busy:
            break
        engine.step()
    assert not engine.busy
    assert engine.pool.num_available == engine.pool.num_blocks, "device blocks leaked"
    assert all(r == 0 for r in engine.pool.refs)
    if kv is not None:
        assert kv.stats().tasks.in_flight == 0, "offload tasks left behind"


def test_abort_running_and_waiting_requests_frees_blocks_and_keeps_computed_prefix():
    engine = LLMEngine(CFG, num_device_blocks=64, max_running=2)
    prompts = [list(range(i, i + 3 * BS + 5)) for i in range(4)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in prompts]
    engine.step()  # two prefills run, two wait
    engine.step()
    assert [r.id for r in engine.running] == ids[:2] and [r.id for r in engine.waiting] == ids[2:]
    engine.abort(ids[0])  # decoding
    engine.abort(ids[3])  # waiting
    engine.abort("never-issued")
    seen = set()
    while engine.has_unfinished():
        seen |= {o.request_id for o in engine.step()}
    assert ids[0] not in seen and ids[3] not in seen and {ids[1], ids[2]} <= seen
    assert engine.aborted == 2
    # The aborted request's computed full prompt blocks stay cached (evictable); nothing is used.
    assert engine.pool.peek(block_hashes(prompts[0], BS).sequence) == 3
    idle(engine)


def test_abort_does_not_change_other_requests():
    prompts = workload(6, 12)
    params = SamplingParams(max_tokens=6)
    ref = LLMEngine(CFG, num_device_blocks=4096)
    expected = {i: r.output for i, r in enumerate(ref.generate(prompts, params))}
    engine = LLMEngine(CFG, num_device_blocks=256, model=ref.model, max_running=6)
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    victims = set(list(ids)[::3])
    outputs = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id] = o.output
        steps += 1
        if steps == 2:
            for v in victims:
                engine.abort(v)
    for rid, i in ids.items():
        if rid not in victims:
            assert outputs[rid] == expected[i]
    idle(engine)


def test_abort_cancels_an_inflight_load_and_returns_its_blocks(tmp_path):
    """A request whose offload load is still running when it is aborted: the load is cancelled,
    its blocks come back only after the copies drained, and no task stays in flight."""
    cached = list(range(1, 8 * BS + 1))
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 16, 64)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=64, offload=EmbeddedOffload(kv), device_prefix_cache=False)
        engine.generate([cached], SamplingParams(max_tokens=1))
        engine.flush()
        # A long uncached prefill takes the whole batch budget: the cached request is admitted
        # (its load starts) but not computed this step.
        engine.max_batch_tokens = 2 * BS
        hog = engine.add_request(list(range(200, 200 + 6 * BS)), SamplingParams(max_tokens=2))
        victim = engine.add_request(cached + [7, 8, 9], SamplingParams(max_tokens=2))
        engine.step()
        r = next(r for r in engine.running if r.id == victim)
        assert r.load_task is not None, "the victim's load should be in flight"
        engine.abort(victim)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert {o.request_id for o in outs} == {hog}
        idle(engine, kv)
        # The host/disk copies are intact: a new request still loads the prefix.
        engine.max_batch_tokens = 16384
        again = engine.generate([cached + [7, 8, 9]], SamplingParams(max_tokens=1))[0]
        assert again.offload_hit_tokens == 8 * BS
        engine.flush()
        idle(engine, kv)


def test_abort_from_another_thread_while_stepping(tmp_path):
    """Randomized: requests aborted from a second thread at arbitrary times; afterwards nothing
    leaks, and every request either finished normally or was aborted (never both)."""
    import random
    import threading

    prompts = workload(7, 40)
    with KVManager(CFG.kv_spec(), offload_config(tmp_path, 32, 256)) as kv:
        engine = LLMEngine(
            CFG, num_device_blocks=96, offload=EmbeddedOffload(kv), max_running=6, max_batch_tokens=3 * BS
        )
        ids = [engine.add_request(p, SamplingParams(max_tokens=1 + i % 9)) for i, p in enumerate(prompts)]
        rng = random.Random(7)
        victims = rng.sample(ids, 15)
        done = threading.Event()

        def aborter():
            for v in victims:
                if done.wait(rng.random() * 0.01):
                    return
                engine.abort(v)

        t = threading.Thread(target=aborter)
        t.start()
        finished = {}
        while engine.has_unfinished() or t.is_alive():
            for o in engine.step():
                assert o.request_id not in finished, "output after the request finished"
                if o.finished:
                    finished[o.request_id] = o.finish_reason
        done.set()
        t.join()
        aborted = {r.id for r in engine.take_finished() if r.finish_reason == "abort"}
        assert not aborted & set(finished)
        assert aborted | set(finished) == set(ids)
        assert engine.aborted == len(aborted) and aborted <= set(victims)
        idle(engine, kv)
