"""Control plane: prefix index per tier, eviction policies, block pools, the cache engine."""

from dynamo_flexkv.index.cache_engine import CacheEngine, GetPlan, MatchResult, PutPlan, Tier, TierRun
from dynamo_flexkv.index.policies import EvictionPolicy
from dynamo_flexkv.index.pool import BlockPool, PoolError
from dynamo_flexkv.index.tier_index import IndexError_, TierIndex

__all__ = [
    "BlockPool", "CacheEngine", "EvictionPolicy", "GetPlan", "IndexError_", "MatchResult",
    "PoolError", "PutPlan", "Tier", "TierIndex", "TierRun",
]
