"""Fixed pool of block slots for one tier (host memory slots, disk file slots)."""

from __future__ import annotations

from typing import Iterable, List

import numpy as np
from dynamo_flexkv.errors import FlexKVError


class PoolError(RuntimeError, FlexKVError):
    """A block id freed twice or one the pool never handed out: a bookkeeping bug upstream."""


class BlockPool:
    """Hands out block ids in [0, capacity); detects double frees and foreign ids."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"pool capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        # Pop from the end: low ids first, so a fresh tier fills its files front to back.
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self._in_use = np.zeros(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> List[int]:
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
