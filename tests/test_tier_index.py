"""TierIndex against the brute-force model under randomized operation sequences."""

import random

import pytest

from dynamo_flexkv.index.policies import EvictionPolicy
from dynamo_flexkv.index.tier_index import IndexError_, TierIndex
from index_model import ModelTier

POLICIES = [p.value for p in EvictionPolicy]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def random_chains(rng, count=40, max_len=12):
    """Chains of sequence hashes that share prefixes, like prompts of one workload."""
    chains, next_hash = [], 1
    for _ in range(count):
        base = list(rng.choice(chains)[: rng.randrange(0, max_len)]) if chains and rng.random() < 0.7 else []
        extra = rng.randrange(1, max_len)
        chain = base + list(range(next_hash, next_hash + extra))
        next_hash += extra
        chains.append(chain)
    return chains


def assert_same(idx: TierIndex, model: ModelTier):
    assert set(idx.hashes()) == set(model.blocks)
    assert idx.pool.num_used == len(model.blocks)
    ids = set()
    children = model.children_counts()
    for h, mb in model.blocks.items():
        info = idx.info(h)
        assert (info.ready, info.locks, info.hits, info.parent) == (mb.ready, mb.locks, mb.hits, mb.parent)
        assert info.children == children.get(h, 0)
        assert idx.pool.is_used(info.block_id)
        ids.add(info.block_id)
    assert len(ids) == len(model.blocks), "two blocks share a slot"
    assert idx.num_ready == sum(b.ready for b in model.blocks.values())
    # prefix-closed: present => parent present; ready => parent ready
    for h, mb in model.blocks.items():
        if mb.parent is not None:
            p = model.blocks[mb.parent]
            assert not mb.ready or p.ready


def run_random_ops(seed, policy, steps=600):
    rng = random.Random(seed)
    clock = FakeClock()
    cap = rng.randrange(4, 40)
    reward = rng.choice([0.0, 0.5, 3.0])
    threshold = rng.choice([1.0, 1.0, 0.8, 0.5])
    ratio = rng.choice([0.01, 0.05, 0.25])
    removed = []
    idx = TierIndex("t", cap, EvictionPolicy(policy), hit_reward_seconds=reward, slru_protected_hits=2,
                    evict_start_threshold=threshold, evict_ratio=ratio, clock=clock,
                    on_removed=lambda name, hs, slots: removed.extend(hs))
    model = ModelTier(cap, policy, reward, 2, threshold, ratio)
    chains = random_chains(rng)
    owners = ["a", "b", "c"]
    for _ in range(steps):
        clock.now += rng.choice([0.0, 0.1, 1.0])
        op = rng.random()
        chain = rng.choice(chains)
        if op < 0.3:  # insert
            owner = rng.choice(owners)
            p = model.match(chain, ready_only=False)
            if p == len(chain):
                continue
            parent = chain[p - 1] if p else None
            pb = model.blocks.get(parent) if parent is not None else None
            allowed = parent is None or pb.ready or pb.owner == owner
            part = chain[p:p + rng.randrange(1, len(chain) - p + 1)]
            if not allowed:
                with pytest.raises(IndexError_):
                    idx.insert(part, parent, owner)
                continue
            assert len(idx.insert(part, parent, owner)) == model.insert(part, parent, owner, clock.now)
        elif op < 0.5:  # commit one unready block whose parent is ready
            ready_parent = [h for h, b in model.blocks.items() if not b.ready
                            and (b.parent is None or model.blocks[b.parent].ready)]
            if not ready_parent:
                continue
            h = rng.choice(ready_parent)
            owner = model.blocks[h].owner
            wrong = next(o for o in owners if o != owner)
            with pytest.raises(IndexError_):
                idx.commit([h], wrong)
            idx.commit([h], owner)
            model.commit([h], clock.now)
        elif op < 0.58:  # rollback an unready leaf
            leaves = [h for h, b in model.blocks.items() if not b.ready and b.locks == 0 and model.children(h) == 0]
            if not leaves:
                continue
            h = rng.choice(leaves)
            idx.rollback([h], model.blocks[h].owner)
            del model.blocks[h]
        elif op < 0.68:  # lock
            if model.blocks:
                h = rng.choice(list(model.blocks))
                idx.lock([h])
                model.blocks[h].locks += 1
        elif op < 0.78:  # unlock
            locked = [h for h, b in model.blocks.items() if b.locks]
            if locked:
                h = rng.choice(locked)
                idx.unlock([h])
                model.blocks[h].locks -= 1
            elif model.blocks:
                with pytest.raises(IndexError_):
                    idx.unlock([next(iter(model.blocks))])
        elif op < 0.9:  # touch a matched prefix
            m = model.match(chain)
            hit = rng.random() < 0.5
            idx.touch(chain[:m], hit=hit)
            model.touch(chain[:m], hit, clock.now)
        elif op < 0.95:  # explicit eviction
            count = rng.randrange(1, 4)
            assert idx.evict(count) == model.evict(count)
        else:  # a block's bytes proved bad: drop it and what hangs below it
            ready = [h for h, b in model.blocks.items() if b.ready]
            if ready:
                h = rng.choice(ready)
                got = idx.discard_slots([idx.info(h).block_id])
                assert set(got) == model.discard(h)
                model.evicted.extend(got)  # the callback reports them in the index's order
        assert idx.match_length(chain) == model.match(chain)
        assert idx.match_length(chain, ready_only=False) == model.match(chain, ready_only=False)
        assert_same(idx, model)
    assert removed == model.evicted
    # Drain: unlock and roll back everything; the pool must come back whole.
    for h, b in list(model.blocks.items()):
        for _ in range(b.locks):
            idx.unlock([h])
    while True:
        leaves = [h for h in idx.hashes() if not idx.info(h).ready and idx.info(h).children == 0]
        if not leaves:
            break
        for h in leaves:
            idx.rollback([h], idx.info(h).owner)
    idx.evict(10**9)
    assert len(idx) == 0 and idx.pool.num_free == cap


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_index_matches_model(policy, seed):
    run_random_ops(seed, policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6, 60))
def test_index_matches_model_long(policy, seed):
    run_random_ops(seed, policy, steps=3000)


def test_policy_orders_on_a_simple_history():
    """Four single-block prompts: a, b, c inserted in order, c touched, b hit twice, d newest."""
    expected = {
        "lru": ["a", "c", "b", "d"],
        "mru": ["d", "b", "c", "a"],
        "lfu": ["a", "c", "d", "b"],
        "fifo": ["a", "b", "c", "d"],
        "filo": ["d", "c", "b", "a"],
        "slru": ["a", "c", "d", "b"],
    }
    names = {"a": 1, "b": 2, "c": 3, "d": 4}
    for policy, order in expected.items():
        clock = FakeClock()
        idx = TierIndex("t", 8, EvictionPolicy(policy), clock=clock)
        for name in "abc":
            clock.now += 1
            idx.insert([names[name]], None, "o")
            idx.commit([names[name]], "o")
        clock.now += 1
        idx.touch([names["c"]], hit=False)
        clock.now += 1
        idx.touch([names["b"]], hit=True)
        idx.touch([names["b"]], hit=True)
        clock.now += 1
        idx.insert([names["d"]], None, "o")
        idx.commit([names["d"]], "o")
        got = [next(k for k, v in names.items() if v == h) for h in idx.evict(4)]
        assert got == order, policy


def test_hit_reward_keeps_reused_blocks():
    clock = FakeClock()
    idx = TierIndex("t", 8, EvictionPolicy.LRU, hit_reward_seconds=100.0, clock=clock)
    for h in (1, 2):
        clock.now += 1
        idx.insert([h], None, "o")
        idx.commit([h], "o")
    idx.touch([1], hit=True)  # older but reused: worth 100 s of recency
    clock.now += 10
    idx.touch([2], hit=False)
    assert idx.evict(1) == [2]


def test_only_ready_unlocked_leaves_are_evicted():
    idx = TierIndex("t", 10, EvictionPolicy.LRU)
    idx.insert([1, 2, 3], None, "o")
    assert idx.evict(10) == []  # unready
    idx.commit([1, 2, 3], "o")
    idx.lock([3])
    assert idx.evict(10) == []  # 3 locked, 1 and 2 are not leaves
    idx.unlock([3])
    assert idx.evict(10) == [3, 2, 1]


def test_proactive_eviction_in_steps():
    idx = TierIndex("t", 100, EvictionPolicy.FIFO, evict_start_threshold=0.9, evict_ratio=0.1)
    for h in range(1, 91):
        idx.insert([h], None, "o")
        idx.commit([h], "o")
    assert len(idx) == 90
    idx.insert([1000], None, "o")  # 91 > 90: evicts one step of 10 oldest
    assert len(idx) == 81 and not idx.is_ready(1) and idx.is_ready(11)


def test_insert_refuses_foreign_unready_parent_and_duplicates():
    idx = TierIndex("t", 10)
    idx.insert([1, 2], None, "a")
    with pytest.raises(IndexError_, match="unready and owned by another task"):
        idx.insert([3], 2, "b")
    with pytest.raises(IndexError_, match="already present"):
        idx.insert([2], 1, "a")
    with pytest.raises(IndexError_, match="absent"):
        idx.insert([9], 77, "a")
    assert len(idx.insert([3], 2, "a")) == 1
    with pytest.raises(IndexError_, match="would orphan|children or locks"):
        idx.rollback([2], "a")
    idx.rollback([1, 2, 3], "a")
    assert len(idx) == 0 and idx.pool.num_free == 10


def test_clear_refuses_while_busy():
    idx = TierIndex("t", 10)
    idx.insert([1], None, "a")
    with pytest.raises(IndexError_, match="in use by tasks"):
        idx.clear()
    idx.commit([1], "a")
    assert idx.clear() == [1] and idx.pool.num_free == 10


def test_discarded_block_reinserted_keeps_policy_order():
    """A block removed by discard_slots leaves heap entries behind; once its hash is inserted
    again those entries must not count for the new block."""
    clock = FakeClock()
    idx = TierIndex("t", 8, EvictionPolicy.LRU, clock=clock)
    clock.now = 1
    idx.insert([1], None, "o")
    idx.commit([1], "o")  # heap: (t=1, block 1)
    clock.now = 2
    idx.insert([2], None, "o")
    idx.commit([2], "o")
    idx.discard_slots([idx.info(1).block_id])  # block 1 goes, its entry stays in the heap
    clock.now = 3
    idx.insert([1], None, "o")
    idx.commit([1], "o")  # block 1 again, now the most recent
    assert idx.evict(1) == [2]  # LRU: 2 (t=2) before the new 1 (t=3)
