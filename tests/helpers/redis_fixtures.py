"""Real redis-server processes for the remote-tier tests (loopback, no persistence, stopped after)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamo_flexkv.core.sysutil import find_binary
from dynamo_flexkv.serve.redis_server import RedisCluster, RedisServer

needs_redis = pytest.mark.skipif(
    find_binary("redis-server") is None or find_binary("redis-cli") is None,
    reason="redis-server/redis-cli not installed (Debian redis-server; scripts/install.sh)",
)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh server per test: 64 MB, allkeys-lru."""
    with RedisServer(maxmemory="64mb") as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster(nodes=3, maxmemory="64mb") as cluster:
        yield cluster
