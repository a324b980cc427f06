"""The device block pool's prefix cache stays prefix-closed and evicts leaves first, so the events
it reports are ones the router's radix tree can apply in order: a Stored always continues a known
parent, a Removed always names a known leaf."""

import random

import pytest

from dynamo_flexkv.integrations.reference_engine.kv_cache import DeviceBlockPool, NoFreeBlocks


class RouterView:
    """What a router learns from the pool's events; fails on any event it could not apply."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.removed_batches: list[list[int]] = []

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        assert len(hashes) == 1 and len(tokens) == 4
        assert parent is None or parent in self.parent, f"Stored {hashes} after unknown parent {parent}"
        for h in hashes:
            assert h not in self.parent, f"Stored {h} twice"
            self.parent[h] = parent
            if parent is not None:
                self.children[parent] = self.children.get(parent, 0) + 1
            parent = h

    def removed(self, hashes: list[int]) -> None:
        self.removed_batches.append(list(hashes))
        for h in hashes:
            assert h in self.parent, f"Removed {h} which was never stored"
            assert self.children.get(h, 0) == 0, f"Removed {h} before its children"
            p = self.parent.pop(h)
            if p is not None:
                self.children[p] -= 1


def make_pool(n: int):
    view = RouterView()
    return DeviceBlockPool(n, view.stored, view.removed), view


def run_request(pool: DeviceBlockPool, chain: list[int], extra: int = 1) -> list[int]:
    """Admits a request for ``chain`` (+ ``extra`` decode blocks), caches its blocks in order."""
    hit = pool.match(chain)
    table = hit + pool.allocate(len(chain) + extra - len(hit))
    for i in range(len(hit), len(chain)):
        pool.cache(table[i], chain[i], chain[i - 1] if i else None, [0] * 4)
    return table


def test_evicts_a_prompts_tail_before_its_head():
    pool, view = make_pool(8)
    a = run_request(pool, [1, 2, 3, 4], extra=0)
    pool.release(a)
    b = run_request(pool, [11, 12], extra=0)  # fits in the 4 free blocks: nothing evicted
    pool.release(b)
    assert view.removed_batches == []
    c = pool.allocate(5)  # 2 free blocks + 3 evicted: the oldest chain's, tail first
    assert view.removed_batches == [[4, 3, 2]]
    assert pool.peek([1, 2, 3, 4]) == 1 and pool.peek([11, 12]) == 2  # a's head is still a usable prefix
    pool.release(c)


def test_one_removal_event_per_allocation():
    pool, view = make_pool(12)
    for chain in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        pool.release(run_request(pool, chain))
    pool.allocate(12)
    assert len(view.removed_batches) == 1 and sorted(view.removed_batches[0]) == list(range(1, 10))
    assert view.parent == {} and pool.evictions == 9


def test_duplicate_prefix_pins_the_cached_copy():
    """Two requests compute the same prefix at once: one copy stays cached, and it cannot be
    evicted while the other request's later blocks hang below it."""
    pool, view = make_pool(6)
    t1 = pool.allocate(2)
    t2 = pool.allocate(3)
    pool.cache(t1[0], 1, None, [0] * 4)
    pool.cache(t2[0], 1, None, [0] * 4)  # the same prefix: t2's block stays private
    pool.release(t1)  # the first request ends; its copy of block 1 is unreferenced now
    pool.cache(t2[1], 2, 1, [0] * 4)  # still valid: block 1 is pinned by t2's duplicate
    assert pool.num_available == 2
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)
    pool.allocate(2)  # takes only free blocks; the chain 1 -> 2 is intact
    assert pool.peek([1, 2]) == 2 and view.removed_batches == []
    pool.release(t2)  # frees t2's private blocks and unpins block 1: the chain 1 -> 2 is evictable
    assert pool.num_available == 4
    pool.allocate(4)
    assert view.removed_batches == [[2, 1]]


def test_clear_uncaches_what_nobody_references_leaves_first():
    pool, view = make_pool(12)
    pool.release(run_request(pool, [1, 2, 3], extra=0))
    running = run_request(pool, [1, 2, 7], extra=1)  # a request still reads 1 -> 2 and its own 7
    pool.release(run_request(pool, [4, 5], extra=0))
    assert (pool.num_cached, pool.num_cached_in_use) == (6, 3)
    assert pool.clear() == 3  # 3 (below 2, nobody reads it), 5 then 4
    assert view.removed_batches == [[3, 5, 4]]  # least recently released leaf first, one event
    assert (pool.num_cached, pool.num_cached_in_use) == (3, 3) and pool.peek([1, 2, 7]) == 3
    assert pool.num_available == 12 - 4 and pool.evictions == 0  # a clear is not the policy's eviction
    pool.release(running)
    assert pool.clear() == 3 and pool.num_cached == 0 and pool.num_available == 12
    assert view.parent == {}


def test_uncached_parent_is_never_cached_below():
    pool, view = make_pool(4)
    t = pool.allocate(2)
    pool.cache(t[1], 2, 1, [0] * 4)  # parent 1 was never cached: block 2 stays private
    assert pool.peek([1, 2]) == 0 and view.parent == {}
    pool.release(t)
    assert pool.num_available == 4


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_router_view_exact(seed):
    """Requests over a random prefix tree, admitted, computed a few blocks at a time and finished
    in random interleavings (so two requests often compute the same prefix at once): after every
    operation the router's view equals the pool's cache, and capacity accounting is exact."""
    rng = random.Random(seed)
    pool, view = make_pool(40)
    roots = [[rng.randrange(1, 1 << 62) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    running: list[list] = []  # [chain, block table, blocks computed]
    pins = 0
    for _step in range(600):
        op = rng.random()
        if running and (op < 0.25 or pool.num_available < 12):
            pool.release(running.pop(rng.randrange(len(running)))[1])
        elif running and op < 0.6:
            r = rng.choice(running)
            chain, table, done = r
            for i in range(done, min(len(chain), done + rng.randint(1, 3))):
                twin = pool.by_hash.get(chain[i])  # another request's cached copy of this block, if any
                refs = pool.refs[twin] if twin is not None else 0
                pool.cache(table[i], chain[i], chain[i - 1] if i else None, [0] * 4)
                pins += twin is not None and twin != table[i] and pool.refs[twin] > refs  # the duplicate pins it
                r[2] = i + 1
        else:
            base = rng.choice(roots)[: rng.randint(1, 6)]
            chain = base + [rng.randrange(1, 1 << 62) for _ in range(rng.randint(0, 5))]
            if len(chain) + 1 <= pool.num_available:
                hit = pool.match(chain)
                running.append([chain, hit + pool.allocate(len(chain) + 1 - len(hit)), len(hit)])
        assert set(view.parent) == set(pool.by_hash)
        assert all(p is None or p in view.parent for p in view.parent.values())
        referenced = sum(1 for r in pool.refs if r > 0)
        assert pool.num_available == pool.num_blocks - referenced
    assert pins > 0 and pool.evictions > 0  # the interesting cases happened
    for r in running:
        pool.release(r[1])
    pool.allocate(pool.num_blocks)  # everything evictable really is: leaves first, down to the roots
    assert view.parent == {} and pool.by_hash == {}
