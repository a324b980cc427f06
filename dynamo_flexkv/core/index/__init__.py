"""Control plane: prefix index per tier, eviction policies, the cache engine."""

from dynamo_flexkv.core.index.cache_engine import CacheEngine, GetPlan, MatchResult, PutPlan, Tier, TierRun
from dynamo_flexkv.core.index.policies import EvictionPolicy
from dynamo_flexkv.core.index.tier_index import IndexInvariantError, PoolError, TierIndex

__all__ = [
    "CacheEngine",
    "EvictionPolicy",
    "GetPlan",
    "IndexInvariantError",
    "MatchResult",
    "PoolError",
    "PutPlan",
    "Tier",
    "TierIndex",
    "TierRun",
]
