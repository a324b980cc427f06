"""TierIndex against the brute-force model under randomized operation sequences."""

import random

import numpy as np
import pytest
from index_model import ModelTier, random_chains

from dynamo_flexkv.core.index.policies import EvictionPolicy
from dynamo_flexkv.core.index.tier_index import IndexInvariantError, PoolError, TierIndex

POLICIES = [p.value for p in EvictionPolicy]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def assert_same(idx: TierIndex, model: ModelTier):
    """Everything observable agrees: blocks, their state and slots, the pool, ready count."""
    assert sorted(idx.hashes()) == sorted(model.blocks)
    assert len(idx) == len(model.blocks)
    assert idx.pool.num_used == model.pool.num_used == len(model.blocks)
    assert idx.pool.num_free == model.pool.num_free
    children = model.children_counts()
    for h, mb in model.blocks.items():
        info = idx.info(h)
        assert (info.ready, info.locks, info.hits, info.parent, info.block_id) == (
            mb.ready,
            mb.locks,
            mb.hits,
            mb.parent,
            mb.slot,
        ), hex(h)
        assert info.children == children.get(h, 0)
        assert info.owner == (None if mb.ready else mb.owner)
        assert idx.pool.is_used(mb.slot)
    assert idx.num_ready == sum(b.ready for b in model.blocks.values())
    # prefix-closed: present => parent present; ready => parent ready
    for mb in model.blocks.values():
        if mb.parent is not None:
            p = model.blocks[mb.parent]
            assert not mb.ready or p.ready


def unready_run(model: ModelTier, rng: random.Random) -> list:
    """A chain of one owner's unready blocks whose first block's parent is ready (or the root):
    what a task commits in one call."""
    starts = [h for h, b in model.blocks.items() if not b.ready and (b.parent is None or model.blocks[b.parent].ready)]
    if not starts:
        return []
    run = [rng.choice(starts)]
    owner = model.blocks[run[0]].owner
    while rng.random() < 0.7:
        nxt = [h for h, b in model.blocks.items() if b.parent == run[-1] and not b.ready and b.owner == owner]
        if not nxt:
            break
        run.append(rng.choice(nxt))
    return run


def leaf_run(model: ModelTier, rng: random.Random) -> list:
    """Unready blocks of one owner ending in an unlocked leaf, parents first: what a task rolls back."""
    children = model.children_counts()
    leaves = [h for h, b in model.blocks.items() if not b.ready and b.locks == 0 and h not in children]
    if not leaves:
        return []
    run = [rng.choice(leaves)]
    while rng.random() < 0.6:
        b = model.blocks[run[0]]
        p = model.blocks.get(b.parent) if b.parent is not None else None
        if p is None or p.ready or p.owner != b.owner or p.locks or children[b.parent] != 1:
            break
        run.insert(0, b.parent)
    return run


def unchanged(idx, model, call, *args, error=IndexInvariantError):
    """A call that must fail leaves the index exactly as it was."""
    with pytest.raises(error):
        call(*args)
    assert_same(idx, model)


def run_random_ops(seed, policy, steps=600, capacity=None):
    """Drives the index and the brute-force model with the same random operations (including
    calls that must fail and change nothing) and compares everything after each one."""
    rng = random.Random(seed)
    clock = FakeClock()
    cap = capacity or rng.randrange(4, 40)
    reward = rng.choice([0.0, 0.5, 3.0])
    threshold = rng.choice([1.0, 1.0, 0.8, 0.5])
    ratio = rng.choice([0.01, 0.05, 0.25])
    removed, removed_slots = [], []

    def on_removed(name, hs, slots):
        assert name == "t" and len(hs) == len(slots)
        removed.extend(hs)
        removed_slots.extend(slots)

    idx = TierIndex(
        "t",
        cap,
        EvictionPolicy(policy),
        hit_reward_seconds=reward,
        slru_protected_hits=2,
        evict_start_threshold=threshold,
        evict_ratio=ratio,
        clock=clock,
        on_removed=on_removed,
    )
    model = ModelTier(cap, policy, reward, 2, threshold, ratio)
    chains = random_chains(rng, count=max(40, cap // 4))
    if seed % 2:  # full-width 64-bit hashes (the real ones) instead of small ints
        wide = {}
        chains = [[wide.setdefault(h, rng.getrandbits(64)) for h in c] for c in chains]
    owners = ["a", ("put", 7), 3]
    for _ in range(steps):
        clock.now += rng.choice([0.0, 0.1, 1.0])
        op = rng.random()
        chain = rng.choice(chains)
        if op < 0.08:  # a put's plan in one call: touch the held prefix, extend it when allowed
            owner = rng.choice(owners)
            held = model.match(chain, ready_only=False)
            model.touch(chain[:held], False, clock.now)
            parent = chain[held - 1] if held else None
            pb = model.blocks.get(parent) if parent is not None else None
            allowed = held < len(chain) and (parent is None or pb.ready or pb.owner == owner)
            expect = model.insert(chain[held:], parent, owner, clock.now) if allowed else []
            arg = np.array(chain, dtype=np.uint64) if rng.random() < 0.5 else chain
            run = chain[held : held + len(expect)]
            assert idx.put(arg, owner) == (held, expect, run, parent)
        elif op < 0.25:  # insert
            owner = rng.choice(owners)
            p = model.match(chain, ready_only=False)
            if p == len(chain):
                continue
            parent = chain[p - 1] if p else None
            pb = model.blocks.get(parent) if parent is not None else None
            allowed = parent is None or pb.ready or pb.owner == owner
            part = chain[p : p + rng.randrange(1, len(chain) - p + 1)]
            if not allowed:
                unchanged(idx, model, idx.insert, part, parent, owner)
                continue
            if rng.random() < 0.05 and model.blocks:  # a chain that repeats or ends in a held block
                bad = part + [rng.choice([part[0], next(iter(model.blocks))])]
                unchanged(idx, model, idx.insert, bad, parent, owner)
            arg = np.array(part, dtype=np.uint64) if rng.random() < 0.3 else part
            assert idx.insert(arg, parent, owner) == model.insert(part, parent, owner, clock.now)
        elif op < 0.40:  # commit a run of one owner, after checking wrong calls change nothing
            run = unready_run(model, rng)
            if not run:
                continue
            owner = model.blocks[run[0]].owner
            unchanged(idx, model, idx.commit, run, next(o for o in owners if o != owner))
            if len(run) > 1:
                unchanged(idx, model, idx.commit, run[::-1], owner)  # children before parents
            unchanged(idx, model, idx.commit, run + run[-1:], owner)  # a block twice
            slots = [model.blocks[h].slot for h in run]
            if len(run) > 1:  # by slots: each must hold its block
                unchanged(idx, model, idx.commit_slots, slots[1:] + slots[:1], run, owner)
            unchanged(idx, model, idx.commit_slots, slots[:-1] + [-1], run, owner, error=ValueError)
            unchanged(idx, model, idx.commit_slots, slots[:-1], run, owner, error=ValueError)  # one short
            if rng.random() < 0.5:
                idx.commit_slots(slots, run, owner)
            else:
                idx.commit(run, owner)
            model.commit(run, clock.now)
        elif op < 0.46:  # roll back unready blocks ending in a leaf
            run = leaf_run(model, rng)
            if not run:
                continue
            owner = model.blocks[run[0]].owner
            if len(run) > 1:
                unchanged(idx, model, idx.rollback, run[::-1], owner)  # parents removed first
            idx.rollback(run, owner)
            model.rollback(run)
        elif op < 0.55:  # lock (a batch may name a block twice)
            if model.blocks:
                hs = [rng.choice(list(model.blocks)) for _ in range(rng.randrange(1, 4))]
                idx.lock(hs)
                for h in hs:
                    model.blocks[h].locks += 1
        elif op < 0.64:  # unlock; unlocking more than was locked fails as a whole
            locked = [h for h, b in model.blocks.items() if b.locks]
            if locked:
                h = rng.choice(locked)
                unchanged(idx, model, idx.unlock, [h] * (model.blocks[h].locks + 1))
                idx.unlock([h])
                model.blocks[h].locks -= 1
            elif model.blocks:
                unchanged(idx, model, idx.unlock, [next(iter(model.blocks))])
        elif op < 0.76:  # touch a matched prefix
            m = model.match(chain)
            hit = rng.random() < 0.5
            idx.touch(chain[:m], hit=hit)
            model.touch(chain[:m], hit, clock.now)
        elif op < 0.82:  # explicit eviction
            count = rng.randrange(1, 4)
            assert idx.evict(count) == model.evict(count)
        elif op < 0.87:  # some blocks' bytes proved bad: drop them and what hangs below them
            ready = [h for h, b in model.blocks.items() if b.ready]
            if ready:
                roots = set(rng.sample(ready, min(len(ready), rng.randrange(1, 3))))
                ids = [model.blocks[h].slot for h in roots] + [cap + 5, -1]  # unknown ids are ignored
                expect = model.discard(roots)
                got = idx.discard_slots(ids)
                assert set(got) == expect and len(got) == len(expect)
                model.remove_in_order(got)
        elif op < 0.93:  # adopt ready blocks already in slots (a restart), after bad attempts
            p = model.match(chain)
            if p < model.match(chain, ready_only=False) or p == len(chain) or not model.pool.num_free:
                continue  # the next block is held (unready), or nothing to adopt / no room
            part = chain[p : p + rng.randrange(1, min(len(chain) - p, model.pool.num_free) + 1)]
            free = [s for s in range(cap) if not model.pool.is_used(s)]
            slots = rng.sample(free, len(part))
            parent = chain[p - 1] if p else None
            entries = [(h, parent if i == 0 else part[i - 1], s) for i, (h, s) in enumerate(zip(part, slots))]
            if model.blocks:
                held = next(iter(model.blocks))
                unchanged(idx, model, idx.adopt, entries + [(held, None, cap - 1)])
                used = model.blocks[held].slot
                unchanged(idx, model, idx.adopt, entries[:-1] + [entries[-1][:2] + (used,)], error=PoolError)
            if len(entries) > 1:
                unchanged(idx, model, idx.adopt, entries[::-1])  # children before parents
            idx.adopt(entries)
            model.adopt(entries, clock.now)
        elif op < 0.94:  # clear: refused while tasks hold blocks
            if model.busy():
                unchanged(idx, model, idx.clear)
                if rng.random() < 0.5:
                    finish_tasks(idx, model)
            if not model.busy():
                got = idx.clear()
                assert set(got) == set(model.blocks)
                model.remove_in_order(got, leaves_first=False)
        assert idx.match_length(chain) == model.match(chain)
        assert idx.match_length(chain, ready_only=False) == model.match(chain, ready_only=False)
        assert idx.match_length(np.array(chain, dtype=np.uint64)) == model.match(chain)
        assert_same(idx, model)
    assert removed == model.evicted and removed_slots == model.evicted_slots
    assert idx.evictions == model.evictions
    finish_tasks(idx, model)
    idx.evict(10**9)
    assert len(idx) == 0 and idx.pool.num_free == cap


def finish_tasks(idx: TierIndex, model: ModelTier) -> None:
    """Unlocks everything and rolls back every unready block, in index and model alike."""
    for h, b in model.blocks.items():
        idx.unlock([h] * b.locks)
        b.locks = 0
    while True:
        children = model.children_counts()
        leaves = [h for h, b in model.blocks.items() if not b.ready and h not in children]
        if not leaves:
            break
        for h in leaves:
            idx.rollback([h], model.blocks[h].owner)
            model.rollback([h])
    assert_same(idx, model)


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
    with pytest.raises(IndexInvariantError, match="unready and owned by another task"):
        idx.insert([3], 2, "b")
    with pytest.raises(IndexInvariantError, match="already present"):
        idx.insert([2], 1, "a")
    with pytest.raises(IndexInvariantError, match="absent"):
        idx.insert([9], 77, "a")
    assert len(idx.insert([3], 2, "a")) == 1
    with pytest.raises(IndexInvariantError, match="would orphan|children or locks"):
        idx.rollback([2], "a")
    idx.rollback([1, 2, 3], "a")
    assert len(idx) == 0 and idx.pool.num_free == 10


def test_clear_refuses_while_busy():
    idx = TierIndex("t", 10)
    idx.insert([1], None, "a")
    with pytest.raises(IndexInvariantError, match="in use by tasks"):
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


@pytest.mark.parametrize("policy", POLICIES)
def test_index_matches_model_large_tier(policy):
    """A tier of hundreds of blocks: the hash table grows and shrinks through many evictions."""
    run_random_ops(100 + POLICIES.index(policy), policy, steps=250, capacity=600)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(200, 204))
def test_index_matches_model_large_tier_long(policy, seed):
    run_random_ops(seed, policy, steps=1500, capacity=3000)


def test_errors_name_block_owner_and_tier():
    idx = TierIndex("host", 10)
    idx.insert([0xABC, 0xABD], None, ("put", 1))
    with pytest.raises(IndexInvariantError, match=r"host: block 0xabc is not an unready block of \('get', 2\)"):
        idx.commit([0xABC], ("get", 2))
    with pytest.raises(IndexInvariantError, match=r"host: commit of 0xabd before its parent"):
        idx.commit([0xABD], ("put", 1))
    with pytest.raises(IndexInvariantError, match=r"host: block 0x0 is not present"):
        idx.lock([0])
    slots = idx.block_ids([0xABC, 0xABD])
    with pytest.raises(IndexInvariantError, match=rf"host: block id {slots[1]} holds block 0xabd, not 0xabc"):
        idx.commit_slots(slots[::-1], [0xABC, 0xABD], ("put", 1))
    with pytest.raises(ValueError, match="got 1 block ids for 2 hashes"):
        idx.commit_slots(slots[:1], [0xABC, 0xABD], ("put", 1))
    with pytest.raises(ValueError, match="block id -3 is not a slot of this tier"):
        idx.commit_slots([-3], [0xABC], ("put", 1))
    with pytest.raises(IndexInvariantError, match="appears twice in the chain"):
        idx.insert([5, 6, 5], None, "a")
    with pytest.raises(ValueError, match="sequence hash -1 is not an unsigned 64-bit integer"):
        idx.insert([-1], None, "a")
    with pytest.raises(ValueError, match="2\\*\\*64|unsigned 64-bit"):
        idx.touch([2**64], hit=False)
    with pytest.raises(ValueError, match="evict_ratio=0 must be in"):
        TierIndex("t", 4, evict_ratio=0)
    with pytest.raises(ValueError, match="unknown eviction_policy"):
        TierIndex("t", 4, "lifo")
    with pytest.raises(ValueError, match="capacity"):
        TierIndex("t", -1)
    assert len(idx) == 2 and idx.pool.num_used == 2  # nothing above changed the index


def test_hashes_as_numpy_arrays_and_full_width():
    idx = TierIndex("t", 8)
    chain = np.array([2**64 - 1, 2**63, 7], dtype=np.uint64)
    assert idx.insert(chain, None, "o") == [0, 1, 2]
    idx.commit(chain, "o")
    assert idx.match_length(chain) == 3 and idx.match_length(chain.tolist()) == 3
    assert idx.match_length(np.array([2**64 - 1, 5], dtype=np.uint64)) == 1
    assert idx.info(2**63).parent == 2**64 - 1 and (2**64 - 1) in idx and -5 not in idx
    assert idx.block_ids(np.array([7, 2**62], dtype=np.int64)[:1]) == [2]
    assert idx.block_ids(chain[::-2]) == [2, 0]  # strided views too
    with pytest.raises(ValueError, match="not an unsigned 64-bit integer"):
        idx.lock(np.array([-3], dtype=np.int64))


def test_index_keeps_no_reference_to_finished_owners():
    """Owners (task ids) are mapped to native ids only while they hold unready blocks."""
    import gc
    import weakref

    class Task:
        pass

    idx = TierIndex("t", 64)
    tasks = [Task() for _ in range(3)]
    refs = [weakref.ref(t) for t in tasks]
    idx.insert([1, 2], None, tasks[0])
    idx.insert([3], 2, tasks[0])
    idx.insert([10], None, tasks[1])
    idx.insert([20], None, tasks[2])
    assert idx.info(3).owner is tasks[0]
    idx.commit([1, 2, 3], tasks[0])
    idx.rollback([10], tasks[1])
    with pytest.raises(IndexInvariantError):
        idx.commit([20], tasks[1])  # not its block: fails, and still no reference kept
    idx.commit([20], tasks[2])
    del tasks
    gc.collect()
    assert all(r() is None for r in refs)


def test_threads_share_one_index():
    """Tasks on several threads (batches run without the GIL) keep the index consistent."""
    import threading

    idx = TierIndex("t", 5000, EvictionPolicy.LRU)
    errors = []

    def worker(w):
        try:
            for i in range(40):
                chain = [(w << 40) | (i << 20) | j for j in range(1, 101)]
                ids = idx.insert(chain, None, (w, i))
                # Pinned while still unready (never evicted): once ready and unpinned, another
                # thread's insert may evict them, so locking after commit would race.
                idx.lock(chain[: len(ids)])
                idx.commit(chain[: len(ids)], (w, i))
                idx.touch(chain, hit=True)
                idx.unlock(chain[: len(ids)])
                assert idx.match_length(chain) <= len(ids)
        except Exception as e:  # noqa: BLE001 - a worker thread's failure, surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(idx) == idx.pool.num_used == idx.num_ready <= 5000
    assert all(idx.info(h).locks == 0 for h in idx.hashes())
    idx.evict(10**9)
    assert len(idx) == 0 and idx.pool.num_free == 5000
