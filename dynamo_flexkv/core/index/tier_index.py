"""Prefix index of one local tier (host or disk), keyed by sequence hash. The remote tier has
no index here: the manager asks the store which prefix it holds (RemoteStore.exists_prefix) and
the cache engine plans those blocks into new host blocks, whose read verifies them.

Invariants (checked by tests against the brute-force model in tests/helpers/index_model.py):

* Prefix-closed: a block is present only if its parent is present, and ready only if its parent
  is ready. Sequence hashes chain, so "block i of a request is ready" is monotone in i and the
  longest ready prefix is a binary search: O(log n) lookups for an n-block prompt.
* A block is inserted *unready* by one owner (a task), becomes *ready* on commit after its bytes
  landed, or is rolled back. Only ready blocks match. A task may extend only a ready block or an
  unready block it owns itself, so a rollback never orphans another task's blocks.
* Eviction takes only ready, unlocked leaves, smallest policy key first (EvictionPolicy in
  dynamo_flexkv/core/enums.py; the keys are TierIndexCore::key_of in native/src/tier_index.cpp).
* Every mutation checks all of its input before it changes anything.

The block table, slot pool and eviction order live in native code (native/src/tier_index.cpp):
batches run there without the GIL. This class keeps the typed API, the clock and the callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.enums import EvictionPolicy
from dynamo_flexkv.core.errors import FlexKVError

RemovedCallback = Callable[[str, list[int], list[int]], None]  # (tier, hashes, slots)
Hashes = Sequence[int] | np.ndarray  # a list/tuple of ints or an integer numpy array


class IndexInvariantError(RuntimeError, FlexKVError):
    """A request that would break an index invariant (caller bug), with what and why."""


class PoolError(RuntimeError, FlexKVError):
    """A block id freed twice or one the pool never handed out: a bookkeeping bug upstream."""


_native.set_index_error_types(IndexInvariantError, PoolError)


@dataclass(frozen=True)
class BlockInfo:
    block_id: int
    parent: int | None
    ready: bool
    locks: int
    children: int
    hits: int
    owner: Hashable | None


@dataclass(frozen=True)
class Census:
    """What a tier holds now, by state (TierIndex.census)."""

    ready: int  # landed: what a get can find
    filling: int  # unready: a copy into it is in flight
    in_use: int  # ready and locked: a load or a tier write reads it
    parents: int  # ready, unlocked, with children: a prefix of the blocks below it
    oldest_s: float | None  # seconds since the least recently used ready block was used (None: none)
    newest_s: float | None


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
        on_removed: RemovedCallback | None = None,
    ) -> None:
        policy = EvictionPolicy.parse(policy)
        for key, value in (("evict_start_threshold", evict_start_threshold), ("evict_ratio", evict_ratio)):
            if not 0 < value <= 1:
                raise ValueError(f"{key}={value} must be in (0, 1]")
        if hit_reward_seconds < 0 or slru_protected_hits < 0:
            raise ValueError(
                f"hit_reward_seconds={hit_reward_seconds} and slru_protected_hits={slru_protected_hits} must be >= 0"
            )
        self.name = name
        self.policy = policy
        self.on_removed = on_removed
        self._clock = clock
        self._native = _native.TierIndex(
            name,
            capacity,
            policy.value,
            float(hit_reward_seconds),
            int(slru_protected_hits),
            float(evict_start_threshold),
            float(evict_ratio),
        )
        # The tier's slot pool lives in the native index: capacity, num_used, num_free, is_used().
        self.pool = self._native

    # ---- queries (no side effects) ----------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._native.capacity

    @property
    def evict_start_threshold(self) -> float:
        return self._native.evict_start_threshold

    @property
    def evict_ratio(self) -> float:
        return self._native.evict_ratio

    @property
    def evictions(self) -> int:
        """Blocks evicted so far (by evict() and by inserts making room)."""
        return self._native.evictions

    def __len__(self) -> int:
        return len(self._native)

    def __contains__(self, seq_hash: int) -> bool:
        return seq_hash in self._native

    @property
    def num_ready(self) -> int:
        return self._native.num_ready

    def is_ready(self, seq_hash: int) -> bool:
        return self._native.is_ready(seq_hash)

    def match_length(self, hashes: Hashes, *, ready_only: bool = True) -> int:
        """Length of the longest prefix of ``hashes`` held (ready, or present when
        ``ready_only=False``). Binary search: valid because the index is prefix-closed."""
        return self._native.match_length(hashes, ready_only)

    def block_ids(self, hashes: Hashes) -> list[int]:
        return self._native.block_ids(hashes)

    def info(self, seq_hash: int) -> BlockInfo | None:
        got = self._native.info(seq_hash)
        return None if got is None else BlockInfo(*got)

    def can_extend(self, parent: int | None, owner: Hashable) -> bool:
        """Whether ``owner`` may insert a child of ``parent`` (root, ready, or its own unready)."""
        return self._native.can_extend(parent, owner)

    def hashes(self) -> list[int]:
        """Every block's sequence hash, by slot."""
        return self._native.hashes()

    def census(self) -> Census:
        """Blocks by state and the ready blocks' last use, in one pass (an operator's listing)."""
        ready, filling, in_use, parents, oldest, newest = self._native.census()
        now = self._clock()
        return Census(
            ready,
            filling,
            in_use,
            parents,
            None if oldest is None else max(0.0, now - oldest),
            None if newest is None else max(0.0, now - newest),
        )

    # ---- mutations ---------------------------------------------------------------------------
    def insert(self, hashes: Hashes, parent: int | None, owner: Hashable) -> list[int]:
        """Inserts the chain ``hashes`` (continuing after ``parent``) as unready blocks owned by
        ``owner``, evicting to make room. Returns the slots of those that fit: a prefix."""
        slots, evicted = self._native.insert(hashes, parent, owner, self._clock())
        if evicted is not None:
            self._report(*evicted)
        return slots

    def put(self, hashes: Hashes, owner: Hashable) -> tuple[int, list[int], list[int], int | None]:
        """A put's plan in one native call: ``held``, the longest present prefix, is touched (no
        hit); the rest is inserted after it as unready blocks of ``owner`` when the owner may extend
        it (``can_extend``). Returns (held, slots of the inserted prefix that fit, their hashes,
        the hash before them or None at the root)."""
        held, slots, inserted, parent, evicted = self._native.put(hashes, owner, self._clock())
        if evicted is not None:
            self._report(*evicted)
        return held, slots, inserted, parent

    def commit(self, hashes: Hashes, owner: Hashable) -> None:
        """Unready -> ready, parents first. Call only after the blocks' bytes landed."""
        self._native.commit(hashes, owner, self._clock())

    def commit_slots(self, block_ids: Sequence[int], hashes: Hashes, owner: Hashable) -> None:
        """commit() of blocks whose slots are known (a run's block ids; no lookups): block_ids[i]
        must hold hashes[i]."""
        self._native.commit_slots(block_ids, hashes, owner, self._clock())

    def rollback(self, hashes: Hashes, owner: Hashable) -> None:
        """Removes unready blocks of ``owner`` (a failed or cancelled transfer), leaves first."""
        self._native.rollback(hashes, owner)

    def lock(self, hashes: Hashes) -> None:
        """Pins present blocks against eviction (a task reads them)."""
        self._native.lock(hashes)

    def unlock(self, hashes: Hashes) -> None:
        self._native.unlock(hashes)

    def touch(self, hashes: Hashes, *, hit: bool) -> None:
        """Records an access (and a reuse when ``hit``) to ready blocks, for the policy."""
        self._native.touch(hashes, hit, self._clock())

    def evict(self, count: int) -> list[int]:
        """Evicts up to ``count`` ready, unlocked leaves by policy; returns their hashes."""
        if count < 0:
            raise ValueError(f"evict(count={count}): count is how many blocks to evict, pass a number >= 0")
        hashes, slots = self._native.evict(count)
        self._report(hashes, slots)
        return hashes

    def clear(self) -> list[int]:
        """Drops every block; refuses while any block is locked or unready (tasks in flight)."""
        hashes, slots = self._native.clear()
        self._report(hashes, slots)
        return hashes

    def discard_slots(self, block_ids: Sequence[int]) -> list[int]:
        """Removes the blocks in these slots and everything below them (their bytes are bad),
        leaves first; blocks a task still locks stay until a later call. Returns removed hashes."""
        hashes, slots = self._native.discard_slots(block_ids)
        self._report(hashes, slots)
        return hashes

    def adopt(self, entries: Sequence[tuple[int, int | None, int]]) -> None:
        """Re-inserts ready blocks that already sit in their slots (restart), given as
        (seq_hash, parent, block_id) with parents first."""
        self._native.adopt(entries, self._clock())

    # ---- internals ---------------------------------------------------------------------------
    def _report(self, hashes: list[int], slots: list[int]) -> None:
        if hashes and self.on_removed is not None:
            self.on_removed(self.name, hashes, slots)
