"""Remote tier data plane: KV blocks in Redis / Redis Cluster (see docs/REMOTE.md).

``RemoteStore.open(url, fingerprint, ...)`` -> ``exists_prefix``, ``get_into``, ``put``, ``stats``.
"""

from dynamo_flexkv.core.remote.breaker import BreakerState, CircuitBreaker
from dynamo_flexkv.core.remote.codec import HEADER_BYTES, Verdict, fingerprint_of
from dynamo_flexkv.core.remote.config import RemoteConfig, RemoteConfigError, parse_url
from dynamo_flexkv.core.remote.store import (
    RemoteAuthError,
    RemoteClosedError,
    RemoteError,
    RemoteStats,
    RemoteStore,
    RemoteUnavailableError,
)

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "HEADER_BYTES",
    "Verdict",
    "fingerprint_of",
    "RemoteConfig",
    "RemoteConfigError",
    "parse_url",
    "RemoteAuthError",
    "RemoteClosedError",
    "RemoteError",
    "RemoteStats",
    "RemoteStore",
    "RemoteUnavailableError",
]
