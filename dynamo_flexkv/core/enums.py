"""Plain enums that a config names and the layers below it act on. Imports nothing of ours, so
``dynamo_flexkv.core.config`` can read a file without loading the index (and its native extension)."""

from __future__ import annotations

from enum import Enum
from typing import Any


class EvictionPolicy(str, Enum):
    """Which evictable block of a tier goes first. Only ready, unlocked leaves are candidates (a
    tier stays prefix-closed); the policy only orders them, by a key computed in native code
    (``TierIndexCore::key_of`` in native/src/tier_index.cpp). Every key ends in a tick no other
    block shares, so eviction is deterministic."""

    LRU = "lru"  # least recently used; each hit adds hit_reward_seconds of recency
    LFU = "lfu"  # fewest hits, then least recent
    SLRU = "slru"  # probation (hits < slru_protected_hits) before protected, LRU within each
    FIFO = "fifo"  # oldest insert
    FILO = "filo"  # newest insert
    MRU = "mru"  # most recently used

    @classmethod
    def parse(cls, value: Any) -> EvictionPolicy:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown eviction_policy {value!r}: use one of {names}") from None


class LoadPolicy(str, Enum):
    """Per request, how much of a cached prefix a get loads (core/cost.py, docs/POLICIES.md)."""

    COST_AWARE = "cost_aware"  # load what is predicted faster than recomputing it (measured online)
    ALWAYS = "always"  # load every cached block (the behaviour before cost-aware loading)
    NEVER = "never"  # load nothing: recompute every prompt (the tiers still store)

    @classmethod
    def parse(cls, value: Any) -> LoadPolicy:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower().replace("-", "_"))
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown load_policy {value!r}: use one of {names}") from None
