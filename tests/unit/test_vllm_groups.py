"""A hybrid model's KV cache groups in the tiers (vllm_connector/groups.py, hybrid.py), without
vLLM's engine: two real embedded offloads over shared CPU tensors as vLLM packs a hybrid model's
groups, block tables per group as vLLM's hybrid KV cache manager hands them (a sliding window's
blocks outside the window null), and the bytes that come back checked block by block."""

from __future__ import annotations

import random
import time

import pytest
import torch

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.contract import no_task_on_tier_fault
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.offload import open_offload
from dynamo_flexkv.core.tasks import TooManyTasks
from dynamo_flexkv.integrations.vllm_connector.groups import KVGroup, aux_share, check_groups, read_groups
from dynamo_flexkv.integrations.vllm_connector.hybrid import GroupTiers

BS = 16
WINDOW = 40  # tokens: a hit needs ceil(39 / 16) = 3 blocks before it
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
DEVICE_BLOCKS = 128
GROUPS = [
    KVGroup(0, "sliding_window", BS, WINDOW, ("model.layers.0.attn",)),
    KVGroup(1, "full_attention", BS, 0, ("model.layers.1.attn",)),
]


@pytest.fixture
def tiers():
    layout = KVLayout(KVLayoutType.LAYERBLOCK, SPEC, BS, DEVICE_BLOCKS)
    layers = [torch.zeros(layout.layer_shape()) for _ in range(SPEC.num_layers)]
    cfg = CacheConfig(tokens_per_block=BS, cpu_cache_gb=0.004)
    main = open_offload(SPEC, cfg, model_id="m")
    aux = open_offload(SPEC, cfg, model_id="m", namespace="groups")
    for off in (main, aux):
        off.register(layers)
    t = GroupTiers(GROUPS, main, aux, BS)
    t.layers = layers
    yield t
    main.shutdown()
    aux.shutdown()


def _tokens(seed: int, blocks: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 30000) for _ in range(blocks * BS)]


def _tables(first: int, blocks: int, window_held: int = 3) -> dict[int, list[int]]:
    """vLLM's block ids per group for a request of ``blocks`` full blocks: the window group holds
    only its last ``window_held`` (the rest are the null block, id 0)."""
    full = list(range(first, first + blocks))
    return {0: [0] * (blocks - window_held) + [first + 40 + i for i in range(window_held)], 1: full}


def _fill(t: GroupTiers, ids: list[int]) -> None:
    for layer in t.layers:
        for b in ids:
            if b:
                layer[b] = torch.randn(layer.shape[1:])


def _wait_holds(t: GroupTiers, key: str, count: int) -> None:
    got, deadline = 0, time.monotonic() + 30
    while got < count:
        got += sum(1 for h in t.main.finished_holds() + t.aux.finished_holds() if h.key == key)
        assert time.monotonic() < deadline, f"{got} of {count} stores came back"
        time.sleep(0.005)


def _store(t: GroupTiers, tokens: list[int], tables: dict[int, list[int]], key: str) -> int:
    for ids in tables.values():
        _fill(t, ids)
    started = t.store(tokens, tables, key, None, None, None)
    _wait_holds(t, key, started)
    return started


def _load(t: GroupTiers, tokens: list[int], tables: dict[int, list[int]], local: int = 0) -> bool:
    parts = t.load(tokens, tables, local, None, None)
    if parts is None:
        return False
    for off, tid in parts:
        for layer in range(SPEC.num_layers):
            assert off.wait_layer(tid, layer, 30)
        assert off.finish(tid).ok
    return True


def test_a_returning_prefix_loads_every_full_block_and_only_the_window(tiers):
    tokens = _tokens(1, 10)
    src = _tables(1, 10)
    assert _store(tiers, tokens, src, "a") == 2  # the full group's chain, the window at its end
    before = [layer.clone() for layer in tiers.layers]
    turn2 = tokens + _tokens(2, 3)  # the conversation goes on: its previous end is the hit point
    assert tiers.cached_tokens(tokens, None, None, len(tokens), 0) == 10 * BS
    assert tiers.cached_tokens(turn2, None, None, len(turn2), 0) == 10 * BS
    for layer in tiers.layers:
        layer.zero_()
    dst = _tables(21, 10)
    assert _load(tiers, tokens, dst)
    for old, new in zip(before, tiers.layers):
        for s, d in zip(src[1], dst[1]):
            assert torch.equal(old[s], new[d])  # every block of the full group
        for s, d in zip(src[0][7:], dst[0][7:]):
            assert torch.equal(old[s], new[d])  # the window's three
    outside = [
        b
        for layer in tiers.layers
        for b in range(DEVICE_BLOCKS)
        if b not in dst[0] + dst[1] and layer[b].abs().sum() != 0
    ]
    assert not outside, f"a load wrote blocks it was not given: {sorted(set(outside))}"


def test_a_prefix_without_its_window_is_not_cached(tiers):
    tokens = _tokens(3, 10)
    _store(tiers, tokens, _tables(1, 10), "a")
    # A shorter prompt of the same prefix: the full group has its blocks, but no window ends there.
    assert tiers.cached_tokens(tokens[: 8 * BS], None, None, 8 * BS, 0) == 0
    # vLLM freed a block of the window before the request finished: no window, nothing to hit.
    other = _tokens(4, 10)
    tables = _tables(30, 10)
    tables[0][7] = 0
    before = tiers.windows_skipped
    _store(tiers, other, tables, "b")
    assert tiers.windows_skipped == before + 1
    assert tiers.cached_tokens(other, None, None, len(other), 0) == 0
    assert tiers.load(other, _tables(60, 10), 0, None, None) is None


def test_a_salt_or_lora_keeps_windows_apart(tiers):
    tokens = _tokens(5, 6)
    tables = _tables(1, 6)
    for ids in tables.values():
        _fill(tiers, ids)
    started = tiers.store(tokens, tables, "s", None, "tenant-a", None)
    _wait_holds(tiers, "s", started)
    assert tiers.cached_tokens(tokens, None, "tenant-a", len(tokens), 0) == 6 * BS
    assert tiers.cached_tokens(tokens, None, "tenant-b", len(tokens), 0) == 0
    assert tiers.cached_tokens(tokens, None, None, len(tokens), 0) == 0


def test_vllm_holding_the_window_loads_the_rest(tiers):
    tokens = _tokens(6, 10)
    src = _tables(1, 10)
    _store(tiers, tokens, src, "a")
    before = [layer.clone() for layer in tiers.layers]
    dst = _tables(21, 10)
    # vLLM's own prefix cache holds the first 8 blocks; the window ends at 10 and starts at 7.
    assert tiers.cached_tokens(tokens, None, None, len(tokens), 8) == 10 * BS
    assert _load(tiers, tokens, dst, local=8)
    for old, new in zip(before, tiers.layers):
        for s, d in list(zip(src[1], dst[1]))[8:] + list(zip(src[0], dst[0]))[8:]:
            assert torch.equal(old[s], new[d])


def test_groups_refused_name_their_layers():
    mamba = KVGroup(2, "mamba", BS, 0, ("model.layers.2.mixer", "model.layers.5.mixer"))
    with pytest.raises(
        ValueError,
        match=r"group 2 \(mamba\): model.layers.2.mixer, model.layers.5.mixer.*"
        r"offload: false",
    ):
        check_groups(GROUPS + [mamba])
    with pytest.raises(ValueError, match=r"different block sizes \[16, 32\].*--block-size"):
        check_groups([GROUPS[0], KVGroup(1, "full_attention", 32, 0, ("x",))])
    check_groups(GROUPS)


def test_read_groups_from_vllm_kv_cache_config():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=256)
    cfg = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l.0", "l.3"], sw), KVCacheGroupSpec(["l.2", "l.5"], full)],
    )
    groups = read_groups(cfg)
    assert [(g.kind, g.window, g.window_blocks, g.layer_names) for g in groups] == [
        ("sliding_window", 256, 4, ("l.0", "l.3")),
        ("full_attention", 0, 0, ("l.2", "l.5")),
    ]
    mamba = MambaSpec(block_size=64, shapes=((4, 4),), dtypes=(torch.float32,))
    cfg.kv_cache_groups.append(KVCacheGroupSpec(["l.1"], mamba))
    with pytest.raises(ValueError, match=r"group 2 \(mamba\): l.1"):
        read_groups(cfg)


def test_the_aux_budget_share_follows_the_blocks_it_holds():
    # Gemma-3-like: two window groups of 4 blocks beside one full group, 128 blocks per request.
    gemma = [
        KVGroup(0, "sliding_window", 64, 256, ()),
        KVGroup(1, "sliding_window", 64, 256, ()),
        KVGroup(2, "full_attention", 64, 0, ()),
    ]
    assert aux_share(gemma, 64, 16384) == pytest.approx(8 / 136)
    assert aux_share([KVGroup(0, "full_attention", 64, 0, ())], 64, 16384) == 0.0
    assert (
        aux_share([KVGroup(0, "full_attention", 64, 0, ()), KVGroup(1, "full_attention", 64, 0, ())], 64, 16384) == 0.5
    )


class _Refusing:
    """An offload that refuses new tasks while ``armed`` (as a full task table does: TooManyTasks)."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # The contract's rule, as both implementations apply it: a tier fault is a miss (no task).
    @no_task_on_tier_fault
    def load(self, *a, **kw):
        if self.armed:
            raise TooManyTasks("no room for another task")
        return self.inner.load(*a, **kw)

    @no_task_on_tier_fault
    def store(self, *a, **kw):
        if self.armed:
            raise TooManyTasks("no room for another task")
        return self.inner.store(*a, **kw)


def test_a_group_that_cannot_start_leaves_no_other_group_writing(tiers):
    tokens = _tokens(8, 10)
    _store(tiers, tokens, _tables(1, 10), "a")
    refusing = _Refusing(tiers.aux)
    t = GroupTiers(GROUPS, tiers.main, refusing, BS)
    t.layers = tiers.layers
    refusing.armed = True
    for layer in tiers.layers:
        layer.zero_()
    assert t.load(tokens, _tables(21, 10), 0, None, None) is None  # the main group's part started first
    assert refusing.tier_faults == 1
    # It was cancelled and collected before the miss came back: no task of it is left to write the
    # blocks the engine now gives up (what it wrote before the cancel, the recompute overwrites).
    tasks = tiers.main.stats().tasks
    assert tiers.main.tasks_pending == 0 and tasks.in_flight == 0 and tasks.uncollected_results == 0, tasks
    # A store whose window part cannot start: the main group's store is started and counted.
    other = _tokens(9, 10)
    tables = _tables(30, 10)
    for ids in tables.values():
        _fill(t, ids)
    assert t.store(other, tables, "b", None, None, None) == 1
    _wait_holds(t, "b", 1)
    assert t.windows_skipped == 1 and t.cached_tokens(other, None, None, len(other), 0) == 0
