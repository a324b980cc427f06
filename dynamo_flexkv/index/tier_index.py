"""Prefix index of one tier (host, disk, remote), keyed by sequence hash.

Invariants (checked by tests against a brute-force model):

* Prefix-closed: a block is present only if its parent is present, and ready only if its parent
  is ready. Sequence hashes chain, so "block i of a request is ready" is monotone in i and the
  longest ready prefix is a binary search: O(log n) dict lookups for an n-block prompt.
* A block is inserted *unready* by one owner (a task), becomes *ready* on commit after its bytes
  landed, or is rolled back. Only ready blocks match. A task may extend only a ready block or an
  unready block it owns itself, so a rollback never orphans another task's blocks.
* Eviction takes only ready, unlocked leaves, smallest policy key first.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from dynamo_flexkv.index.policies import EvictionPolicy, Key, make_key_fn
from dynamo_flexkv.index.pool import BlockPool

RemovedCallback = Callable[[str, List[int], List[int]], None]  # (tier, hashes, slots)


class IndexError_(RuntimeError):
    """A request that would break an index invariant (caller bug), with what and why."""


@dataclass(frozen=True)
class BlockInfo:
    block_id: int
    parent: Optional[int]
    ready: bool
    locks: int
    children: int
    hits: int
    owner: Optional[Hashable]


class _Block:
    __slots__ = ("block_id", "parent", "ready", "locks", "children", "owner", "hits",
                 "last_access", "insert_tick", "touch_tick", "version")

    def __init__(self, block_id: int, parent: Optional[int], owner: Hashable, now: float, tick: int):
        self.block_id = block_id
        self.parent = parent
        self.ready = False
        self.locks = 0
        self.children = 0
        self.owner: Optional[Hashable] = owner
        self.hits = 0
        self.last_access = now
        self.insert_tick = tick
        self.touch_tick = tick
        self.version = 0


class TierIndex:
    def __init__(
        self,
        name: str,
        capacity: int,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        *,
        hit_reward_seconds: float = 0.0,
        slru_protected_hits: int = 2,
        evict_start_threshold: float = 1.0,
        evict_ratio: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        on_removed: Optional[RemovedCallback] = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.pool = BlockPool(capacity)
        self.evict_start_threshold = evict_start_threshold
        self.evict_ratio = evict_ratio
        self.on_removed = on_removed
        self._key: Callable[[int, float, int, int], Key] = make_key_fn(
            policy, hit_reward_seconds, slru_protected_hits
        )
        self._clock = clock
        self._blocks: Dict[int, _Block] = {}
        self._heap: List[Tuple[Key, int, int]] = []  # (key, seq hash, version); stale ones skipped
        self._tick = 0
        self._versions = 0
        self._num_ready = 0
        self.evictions = 0

    # ---- queries (no side effects) ----------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, seq_hash: int) -> bool:
        return seq_hash in self._blocks

    @property
    def num_ready(self) -> int:
        return self._num_ready

    def is_ready(self, seq_hash: int) -> bool:
        b = self._blocks.get(seq_hash)
        return b is not None and b.ready

    def match_length(self, hashes: Sequence[int], *, ready_only: bool = True) -> int:
        """Length of the longest prefix of ``hashes`` held (ready, or present when
        ``ready_only=False``). Binary search: valid because the index is prefix-closed."""
        blocks = self._blocks
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            b = blocks.get(int(hashes[mid]))
            if b is not None and (b.ready or not ready_only):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def block_ids(self, hashes: Sequence[int]) -> List[int]:
        blocks = self._blocks
        return [blocks[int(h)].block_id for h in hashes]

    def info(self, seq_hash: int) -> Optional[BlockInfo]:
        b = self._blocks.get(seq_hash)
        if b is None:
            return None
        return BlockInfo(b.block_id, b.parent, b.ready, b.locks, b.children, b.hits, b.owner)

    def can_extend(self, parent: Optional[int], owner: Hashable) -> bool:
        """Whether ``owner`` may insert a child of ``parent`` (root, ready, or its own unready)."""
        if parent is None:
            return True
        b = self._blocks.get(parent)
        return b is not None and (b.ready or b.owner == owner)

    def hashes(self) -> List[int]:
        return list(self._blocks)

    # ---- mutations ---------------------------------------------------------------------------
    def insert(self, hashes: Sequence[int], parent: Optional[int], owner: Hashable) -> List[int]:
        """Inserts the chain ``hashes`` (continuing after ``parent``) as unready blocks owned by
        ``owner``, evicting to make room. Returns the slots of those that fit: a prefix."""
        if not self.can_extend(parent, owner):
            state = "absent" if parent not in self._blocks else "unready and owned by another task"
            raise IndexError_(f"{self.name}: cannot insert after parent {parent:#x}: it is {state}")
        for h in hashes:
            if h in self._blocks:
                raise IndexError_(f"{self.name}: block {h:#x} is already present")
        p = self._blocks.get(parent) if parent is not None else None
        if p is not None:
            p.locks += 1  # the parent is a leaf; keep eviction away from it while making room
        try:
            self._make_room(len(hashes))
        finally:
            if p is not None:
                self._unlock_block(parent, p)
        ids = self.pool.allocate(len(hashes))
        if not ids:
            return ids
        now, prev, tick, blocks = self._clock(), parent, self._tick, self._blocks
        for h, bid in zip(hashes, ids):
            tick += 1
            b = blocks[h] = _Block(bid, prev, owner, now, tick)
            b.children = 1  # the next block of the chain; the last one is fixed below
            prev = h
        b.children = 0
        self._tick = tick
        if p is not None:
            p.children += 1
        return ids

    def commit(self, hashes: Sequence[int], owner: Hashable) -> None:
        """Unready -> ready, parents first. Call only after the blocks' bytes landed."""
        blocks = [self._owned_unready(h, owner) for h in hashes]
        if blocks and blocks[0].parent is not None and not self._blocks[blocks[0].parent].ready:
            raise IndexError_(f"{self.name}: commit of {int(hashes[0]):#x} before its parent")
        now, tick = self._clock(), self._tick
        for b in blocks:
            tick += 1
            b.ready, b.owner, b.last_access, b.touch_tick = True, None, now, tick
        self._tick = tick
        self._num_ready += len(blocks)
        for h, b in zip(hashes, blocks):
            if b.children == 0 and b.locks == 0:  # only leaves can become candidates
                self._maybe_push(int(h), b)

    def rollback(self, hashes: Sequence[int], owner: Hashable) -> None:
        """Removes unready blocks of ``owner`` (a failed or cancelled transfer), leaves first."""
        blocks = [self._owned_unready(h, owner) for h in hashes]
        for h, b in zip(reversed(hashes), reversed(blocks)):
            if b.children or b.locks:
                raise IndexError_(f"{self.name}: rollback of {int(h):#x} while it has children or locks")
            self._remove(int(h), b)

    def lock(self, hashes: Sequence[int]) -> None:
        """Pins present blocks against eviction (a task reads them)."""
        blocks = [self._present(h) for h in hashes]
        for b in blocks:
            b.locks += 1

    def unlock(self, hashes: Sequence[int]) -> None:
        blocks = [self._present(h) for h in hashes]
        for h, b in zip(hashes, blocks):
            if b.locks <= 0:
                raise IndexError_(f"{self.name}: unlock of {int(h):#x} which is not locked")
        for h, b in zip(hashes, blocks):
            self._unlock_block(int(h), b)

    def touch(self, hashes: Sequence[int], *, hit: bool) -> None:
        """Records an access (and a reuse when ``hit``) to ready blocks, for the policy."""
        now = self._clock()
        for h in hashes:
            b = self._blocks.get(int(h))
            if b is None or not b.ready:
                continue
            b.last_access = now
            self._tick += 1
            b.touch_tick = self._tick
            if hit:
                b.hits += 1
            if b.children == 0 and b.locks == 0:
                self._maybe_push(int(h), b)

    def evict(self, count: int) -> List[int]:
        """Evicts up to ``count`` ready, unlocked leaves by policy; returns their hashes."""
        out: List[int] = []
        freed: List[int] = []
        blocks = self._blocks
        while len(out) < count and self._heap:  # re-read: a push may compact (replace) the heap
            _, h, version = heapq.heappop(self._heap)
            b = blocks.get(h)
            if b is None or b.version != version or not self._candidate(b):
                continue
            self._remove(h, b, freed)
            out.append(h)
        self.pool.free(freed)
        if out:
            self.evictions += len(out)
            if self.on_removed is not None:
                self.on_removed(self.name, out, freed)
        return out

    def clear(self) -> List[int]:
        """Drops every block; refuses while any block is locked or unready (tasks in flight)."""
        busy = [h for h, b in self._blocks.items() if b.locks or not b.ready]
        if busy:
            raise IndexError_(f"{self.name}: clear with {len(busy)} blocks in use by tasks")
        removed = list(self._blocks)
        slots = [b.block_id for b in self._blocks.values()]
        self.pool.free(slots)
        self._blocks.clear()
        self._heap.clear()
        self._num_ready = 0
        if removed and self.on_removed is not None:
            self.on_removed(self.name, removed, slots)
        return removed

    def discard_slots(self, block_ids: Sequence[int]) -> List[int]:
        """Removes the blocks in these slots and everything below them (their bytes are bad),
        leaves first; blocks a task still locks stay until a later call. Returns removed hashes."""
        wanted = set(int(b) for b in block_ids)
        doomed = {h for h, b in self._blocks.items() if b.block_id in wanted}
        children: Dict[int, List[int]] = {}
        for h, b in self._blocks.items():
            if b.parent is not None:
                children.setdefault(b.parent, []).append(h)
        stack = list(doomed)
        while stack:
            for c in children.get(stack.pop(), ()):
                if c not in doomed:
                    doomed.add(c)
                    stack.append(c)
        removed: List[int] = []
        freed: List[int] = []
        progress = True
        while progress:
            progress = False
            for h in list(doomed):
                b = self._blocks[h]
                if b.children == 0 and b.locks == 0 and b.ready:
                    self._remove(h, b, freed)
                    doomed.discard(h)
                    removed.append(h)
                    progress = True
        self.pool.free(freed)
        if removed and self.on_removed is not None:
            self.on_removed(self.name, removed, freed)
        return removed

    def adopt(self, entries: Sequence[Tuple[int, Optional[int], int]]) -> None:
        """Re-inserts ready blocks that already sit in their slots (restart), given as
        (seq_hash, parent, block_id) with parents first."""
        for h, parent, _ in entries:
            if h in self._blocks:
                raise IndexError_(f"{self.name}: block {h:#x} is already present")
        self.pool.take(b for _, _, b in entries)
        now = self._clock()
        for h, parent, block_id in entries:
            if parent is not None and not self.is_ready(parent):
                raise IndexError_(f"{self.name}: adopt of {h:#x} before its parent")
            self._tick += 1
            b = _Block(block_id, parent, None, now, self._tick)
            b.ready = True
            self._blocks[h] = b
            self._num_ready += 1
            if parent is not None:
                self._blocks[parent].children += 1
        for h, _, _ in entries:
            self._maybe_push(h, self._blocks[h])

    # ---- internals ---------------------------------------------------------------------------
    def _candidate(self, b: _Block) -> bool:
        return b.ready and b.locks == 0 and b.children == 0

    def _maybe_push(self, h: int, b: _Block) -> None:
        # Versions come from one counter for the whole index, so a heap entry left behind by an
        # earlier incarnation of the same hash (e.g. one discard_slots removed) can never match.
        self._versions += 1
        b.version = self._versions
        if self._candidate(b):
            heapq.heappush(self._heap, (self._key(b.hits, b.last_access, b.insert_tick, b.touch_tick), h, b.version))
            if len(self._heap) > 2 * len(self._blocks) + 1024:
                self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [e for e in self._heap if (b := self._blocks.get(e[1])) is not None
                      and b.version == e[2] and self._candidate(b)]
        heapq.heapify(self._heap)

    def _unlock_block(self, h: int, b: _Block) -> None:
        b.locks -= 1
        if b.locks == 0:
            self._maybe_push(h, b)

    def _remove(self, h: int, b: _Block, freed: Optional[List[int]] = None) -> None:
        """Unlinks a leaf; its slot goes back to the pool now, or into ``freed`` for a batch."""
        del self._blocks[h]
        if freed is None:
            self.pool.free((b.block_id,))
        else:
            freed.append(b.block_id)
        if b.ready:
            self._num_ready -= 1
        if b.parent is not None:
            p = self._blocks[b.parent]
            p.children -= 1
            if p.children == 0:
                self._maybe_push(b.parent, p)

    def _make_room(self, n: int) -> None:
        """Evicts so that ``n`` more blocks keep usage within evict_start_threshold, in steps of
        evict_ratio of the tier (batching keeps eviction off the per-block path)."""
        cap = self.pool.capacity
        limit = math.floor(self.evict_start_threshold * cap)
        if self.pool.num_used + n <= limit:
            return
        step = max(1, math.ceil(self.evict_ratio * cap))
        while self.pool.num_used + n > limit:
            if not self.evict(step):
                break

    def _present(self, h: int) -> _Block:
        b = self._blocks.get(int(h))
        if b is None:
            raise IndexError_(f"{self.name}: block {int(h):#x} is not present")
        return b

    def _owned_unready(self, h: int, owner: Hashable) -> _Block:
        b = self._present(h)
        if b.ready or b.owner != owner:
            raise IndexError_(f"{self.name}: block {int(h):#x} is not an unready block of {owner!r}")
        return b
