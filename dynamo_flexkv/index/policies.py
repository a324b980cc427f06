"""Eviction policies as sort keys: the evictable block with the smallest key goes first.

Only ready, unlocked leaves are ever candidates (the tier stays prefix-closed); the policy only
orders them. Keys are total orders (they end in a unique tick), so eviction is deterministic.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Tuple

Key = Tuple[float, ...]


class EvictionPolicy(str, Enum):
    LRU = "lru"    # least recently used; each hit adds hit_reward_seconds of recency
    LFU = "lfu"    # fewest hits, then least recent
    SLRU = "slru"  # probation (hits < slru_protected_hits) before protected, LRU within each
    FIFO = "fifo"  # oldest insert
    FILO = "filo"  # newest insert
    MRU = "mru"    # most recently used

    @classmethod
    def parse(cls, value: Any) -> "EvictionPolicy":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown eviction_policy {value!r}: use one of {names}") from None


def make_key_fn(
    policy: EvictionPolicy, hit_reward_seconds: float = 0.0, slru_protected_hits: int = 2
) -> Callable[[int, float, int, int], Key]:
    """Returns key(hits, last_access, insert_tick, touch_tick) for ``policy``."""
    if policy is EvictionPolicy.LRU:
        return lambda hits, last, ins, tick: (last + hit_reward_seconds * hits, tick)
    if policy is EvictionPolicy.MRU:
        return lambda hits, last, ins, tick: (-last, -tick)
    if policy is EvictionPolicy.LFU:
        return lambda hits, last, ins, tick: (hits, last, tick)
    if policy is EvictionPolicy.FIFO:
        return lambda hits, last, ins, tick: (ins,)
    if policy is EvictionPolicy.FILO:
        return lambda hits, last, ins, tick: (-ins,)
    if policy is EvictionPolicy.SLRU:
        return lambda hits, last, ins, tick: (1 if hits >= slru_protected_hits else 0, last, tick)
    raise ValueError(f"no key for policy {policy!r}")
