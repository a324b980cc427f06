"""Eviction policies of the index: the enum lives in dynamo_flexkv.core.enums (so reading a config
loads no index); the keys that order a tier's candidates are computed in native code
(``TierIndexCore::key_of`` in native/src/tier_index.cpp)."""

from dynamo_flexkv.core.enums import EvictionPolicy

__all__ = ["EvictionPolicy"]
