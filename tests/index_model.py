"""A brute-force reference for TierIndex: linear scans, no heap, no binary search.

It is the specification the randomized tests hold the real index to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass
class MBlock:
    parent: Optional[int]
    owner: object
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
        self.blocks: Dict[int, MBlock] = {}
        self.tick = 0
        self.evicted: List[int] = []

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

    def children(self, h):
        return sum(1 for b in self.blocks.values() if b.parent == h)

    def children_counts(self):
        out: Dict[int, int] = {}
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
        return [h for h, b in self.blocks.items()
                if b.ready and b.locks == 0 and h != extra_locked and h not in children]

    def evict(self, count, protect=None):
        out = []
        while len(out) < count:
            cands = self.candidates(protect)
            if not cands:
                break
            h = min(cands, key=lambda x: self.key(self.blocks[x]))
            del self.blocks[h]
            out.append(h)
        self.evicted.extend(out)
        return out

    def discard(self, root):
        """Removes ``root`` and its descendants, leaves first, sparing locked or unready ones
        (and so their ancestors)."""
        doomed, grew = {root}, True
        while grew:
            grew = False
            for h, b in self.blocks.items():
                if b.parent in doomed and h not in doomed:
                    doomed.add(h)
                    grew = True
        removed, progress = set(), True
        while progress:
            progress = False
            children = self.children_counts()
            for h in list(doomed):
                b = self.blocks[h]
                if h not in children and b.locks == 0 and b.ready:
                    del self.blocks[h]
                    doomed.discard(h)
                    removed.add(h)
                    progress = True
        return removed

    def insert(self, hashes, parent, owner, now):
        n = len(hashes)
        limit = math.floor(self.threshold * self.capacity)
        if len(self.blocks) + n > limit:
            step = max(1, math.ceil(self.ratio * self.capacity))
            while len(self.blocks) + n > limit:
                if not self.evict(step, protect=parent):
                    break
        k = min(n, self.capacity - len(self.blocks))
        prev = parent
        for h in hashes[:k]:
            self.tick += 1
            self.blocks[h] = MBlock(prev, owner, last=now, ins=self.tick, tick=self.tick)
            prev = h
        return k

    def commit(self, hashes, now):
        for h in hashes:
            b = self.blocks[h]
            self.tick += 1
            b.ready, b.owner, b.last, b.tick = True, None, now, self.tick

    def touch(self, hashes, hit, now):
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not b.ready:
                continue
            self.tick += 1
            b.last, b.tick = now, self.tick
            b.hits += hit
