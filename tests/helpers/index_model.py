"""A brute-force reference for TierIndex: linear scans, no heap, no hash table, no binary search.

It is the specification the randomized tests hold the native index to: which blocks a match
finds, which block each eviction takes, and which slot each block gets. Slots come from the
Python BlockPool (a stack: freed slots are reused last-freed first, fresh ones low first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dynamo_flexkv.core.index.tier_index import PoolError


class BlockPool:
    """Hands out block ids in [0, capacity); detects double frees and foreign ids."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"pool capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        # Pop from the end: low ids first, so a fresh tier fills its files front to back.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._in_use = np.zeros(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Up to ``n`` ids (fewer when the pool runs short)."""
        take = min(n, len(self._free))
        if take <= 0:
            return []
        ids = self._free[-take:]
        del self._free[-take:]
        ids.reverse()
        self._in_use[ids] = True
        return ids

    def take(self, ids: Iterable[int]) -> None:
        """Claims specific ids (re-adopting blocks that already sit in those slots)."""
        ids = list(ids)
        for b in ids:
            if not 0 <= b < self.capacity or self._in_use[b]:
                raise PoolError(f"block id {b} cannot be claimed: out of range or in use")
        if len(set(ids)) != len(ids):
            raise PoolError(f"block ids {ids} repeat: each may be claimed once")
        self._in_use[ids] = True
        self._free = [b for b in self._free if not self._in_use[b]]

    def free(self, ids: Iterable[int]) -> None:
        """Returns ids to the pool; checks them all before changing anything."""
        ids = list(ids)
        for b in ids:
            if not 0 <= b < self.capacity:
                raise PoolError(f"block id {b} is outside this pool of {self.capacity}")
            if not self._in_use[b]:
                raise PoolError(f"block id {b} freed twice")
        if len(set(ids)) != len(ids):
            raise PoolError(f"block ids {ids} repeat: each may be freed once")
        self._in_use[ids] = False
        self._free.extend(ids)

    def is_used(self, block_id: int) -> bool:
        return bool(self._in_use[block_id])


@dataclass
class MBlock:
    parent: int | None
    owner: object
    slot: int
    ready: bool = False
    locks: int = 0
    hits: int = 0
    last: float = 0.0
    ins: int = 0
    tick: int = 0


class ModelTier:
    def __init__(self, capacity, policy, reward=0.0, protected=2, threshold=1.0, ratio=0.05):
        self.capacity, self.policy = capacity, policy
        self.reward, self.protected, self.threshold, self.ratio = reward, protected, threshold, ratio
        self.blocks: dict[int, MBlock] = {}
        self.pool = BlockPool(capacity)
        self.tick = 0
        self.evicted: list[int] = []  # every removal the index reports, in its order
        self.evicted_slots: list[int] = []  # and the slots they held
        self.evictions = 0  # by evict() and inserts making room (not discard or clear)

    def key(self, b: MBlock):
        p = self.policy
        if p == "lru":
            return (b.last + self.reward * b.hits, b.tick)
        if p == "mru":
            return (-b.last, -b.tick)
        if p == "lfu":
            return (b.hits, b.last, b.tick)
        if p == "fifo":
            return (b.ins,)
        if p == "filo":
            return (-b.ins,)
        if p == "slru":
            return (1 if b.hits >= self.protected else 0, b.last, b.tick)
        raise AssertionError(p)

    # ---- queries ------------------------------------------------------------------------------
    def children(self, h):
        return sum(1 for b in self.blocks.values() if b.parent == h)

    def children_counts(self):
        out: dict[int, int] = {}
        for b in self.blocks.values():
            if b.parent is not None:
                out[b.parent] = out.get(b.parent, 0) + 1
        return out

    def match(self, hashes, ready_only=True):
        n = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or (ready_only and not b.ready):
                break
            n += 1
        return n

    def candidates(self, extra_locked=None):
        children = self.children_counts()
        return [
            h for h, b in self.blocks.items() if b.ready and b.locks == 0 and h != extra_locked and h not in children
        ]

    def busy(self) -> bool:
        return any(b.locks or not b.ready for b in self.blocks.values())

    # ---- mutations -----------------------------------------------------------------------------
    def _remove(self, h: int) -> int:
        slot = self.blocks.pop(h).slot
        self.pool.free([slot])
        return slot

    def evict(self, count, protect=None):
        out = []
        while len(out) < count:
            cands = self.candidates(protect)
            if not cands:
                break
            h = min(cands, key=lambda x: self.key(self.blocks[x]))
            self.evicted_slots.append(self._remove(h))
            out.append(h)
        self.evicted.extend(out)
        self.evictions += len(out)
        return out

    def discard(self, roots: set[int]) -> set[int]:
        """What discarding ``roots`` removes: them and their descendants, sparing locked or
        unready ones (and so their ancestors)."""
        doomed, grew = set(roots), True
        while grew:
            grew = False
            for h, b in self.blocks.items():
                if b.parent in doomed and h not in doomed:
                    doomed.add(h)
                    grew = True
        removed, progress = set(), True
        children = self.children_counts()
        while progress:
            progress = False
            for h in list(doomed):
                b = self.blocks[h]
                if children.get(h, 0) == 0 and b.locks == 0 and b.ready:
                    doomed.discard(h)
                    removed.add(h)
                    if b.parent is not None:
                        children[b.parent] -= 1
                    progress = True
        return removed

    def remove_in_order(self, order: Sequence[int], leaves_first: bool = True) -> None:
        """Applies the index's removal order (discard: checked to be leaves first; clear)."""
        for h in order:
            assert not leaves_first or self.children(h) == 0, f"{h:#x} removed before its children"
            self.evicted_slots.append(self._remove(h))
        self.evicted.extend(order)

    def insert(self, hashes, parent, owner, now) -> list[int]:
        n = len(hashes)
        limit = math.floor(self.threshold * self.capacity)
        if len(self.blocks) + n > limit:
            step = max(1, math.ceil(self.ratio * self.capacity))
            while len(self.blocks) + n > limit:
                if not self.evict(step, protect=parent):
                    break
        slots = self.pool.allocate(n)
        prev = parent
        for h, slot in zip(hashes, slots):
            self.tick += 1
            self.blocks[h] = MBlock(prev, owner, slot, last=now, ins=self.tick, tick=self.tick)
            prev = h
        return slots

    def commit(self, hashes, now):
        for h in hashes:
            b = self.blocks[h]
            self.tick += 1
            b.ready, b.owner, b.last, b.tick = True, None, now, self.tick

    def rollback(self, hashes):
        for h in reversed(hashes):
            self._remove(h)

    def touch(self, hashes, hit, now):
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.ready:
                continue
            self.tick += 1
            b.last, b.tick = now, self.tick
            b.hits += hit

    def adopt(self, entries: Sequence[tuple[int, int | None, int]], now) -> None:
        self.pool.take(slot for _, _, slot in entries)
        for h, parent, slot in entries:
            self.tick += 1
            self.blocks[h] = MBlock(parent, None, slot, ready=True, last=now, ins=self.tick, tick=self.tick)


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
