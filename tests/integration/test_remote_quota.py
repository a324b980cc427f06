"""Quotas per tenant in the remote tier, against real redis-server processes: a tenant that floods
the tier evicts only its own oldest blocks and never holds more than its quota; another tenant's
blocks all stay and load bit-exact (core/remote/quota.py)."""

from __future__ import annotations

import numpy as np
import pytest
from redis_fixtures import needs_redis, redis_cluster, redis_server  # noqa: F401 (fixtures)

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.remote import HEADER_BYTES, RemoteStore, fingerprint_of
from dynamo_flexkv.core.remote.codec import key_prefix_bytes
from dynamo_flexkv.core.remote.resp import RespConnection
from dynamo_flexkv.serve.redis_server import RedisServer

SIZE = 32 << 10  # payload bytes per block
VALUE = HEADER_BYTES + SIZE
FP_A = fingerprint_of({"model": "m", "namespace": "acme"})
FP_B = fingerprint_of({"model": "m", "namespace": "bolt"})


def blocks(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 2**63, size=n, dtype=np.uint64), rng.integers(0, 256, size=(n, SIZE), dtype=np.uint8)


def keys_of(server: RedisServer, fp: int) -> list[bytes]:
    """The block keys of one fingerprint the server holds now (SCAN, as an operator would)."""
    conn = RespConnection("127.0.0.1", server.port, timeout_s=5, connect_timeout_s=5)
    try:
        pattern = key_prefix_bytes("flexkv:", fp) + b"*"
        cursor, out = b"0", []
        while True:
            reply = conn.call(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000")
            assert isinstance(reply, list)
            cursor, found = reply
            out += found
            if cursor == b"0":
                return out
    finally:
        conn.close()


def loads_exactly(store: RemoteStore, seq: np.ndarray, data: np.ndarray) -> int:
    dst = np.zeros_like(data)
    n = store.get_into(seq, list(dst))
    assert np.array_equal(dst[:n], data[:n]), "a block loaded with other bytes"
    return n


@needs_redis
def test_a_flooding_tenant_evicts_only_its_own_blocks(redis_server: RedisServer) -> None:
    quota_a, quota_b = 10 * VALUE, 40 * VALUE
    url = redis_server.url
    with (
        RemoteStore.open(url, FP_A, quota_bytes=quota_a, tenant="acme") as a,
        RemoteStore.open(url, FP_B, quota_bytes=quota_b, tenant="bolt") as b,
    ):
        seq_b, data_b = blocks(30, seed=1)
        assert b.put(seq_b, list(data_b)) == 30
        assert b.quota_usage() == 30 * VALUE
        last: tuple[np.ndarray, np.ndarray] = blocks(0, 0)
        for batch in range(20):  # 20 x 6 blocks: 12 times acme's quota
            last = blocks(6, seed=100 + batch)
            assert a.put(*(last[0], list(last[1]))) == 6
            used = a.quota_usage()
            assert used is not None and used <= quota_a
            assert len(keys_of(redis_server, a.fingerprint)) * VALUE <= quota_a  # a tenant's own keys
        # acme holds its newest blocks, up to its quota; bolt every block it stored, bit-exact.
        assert loads_exactly(a, *last) == 6
        assert a.quota_usage() == 10 * VALUE and len(keys_of(redis_server, a.fingerprint)) == 10
        assert a.stats().quota_evicted == 20 * 6 - 10
        assert loads_exactly(b, seq_b, data_b) == 30
        assert b.stats().quota_evicted == 0 and b.quota_usage() == 30 * VALUE


@needs_redis
def test_a_batch_larger_than_the_quota_keeps_its_prefix(redis_server: RedisServer) -> None:
    with RemoteStore.open(redis_server.url, FP_A, quota_bytes=4 * VALUE, tenant="acme") as a:
        seq, data = blocks(10, seed=2)
        assert a.put(seq, list(data)) == 4  # the first 4: a prefix a later get can use
        assert loads_exactly(a, seq, data) == 4
        assert a.quota_usage() == 4 * VALUE
        # Written again, a block is the tenant's youngest: a new block evicts the others first.
        assert a.put(seq[:1], [data[0]]) == 1
        more, more_data = blocks(3, seed=3)
        assert a.put(more, list(more_data)) == 3
        assert a.exists(seq[:4]) == [True, False, False, False]
        # delete() forgets what it removes: the account follows.
        assert a.delete(more[:2]) == 2 and a.quota_usage() == 2 * VALUE


@needs_redis
def test_workers_of_one_tenant_share_its_account(redis_server: RedisServer) -> None:
    """Two stores naming one tenant (two workers, or a tenant's two models) draw on one quota."""
    fp2 = fingerprint_of({"model": "other", "namespace": "acme"})
    with (
        RemoteStore.open(redis_server.url, FP_A, quota_bytes=8 * VALUE, tenant="acme") as a1,
        RemoteStore.open(redis_server.url, fp2, quota_bytes=8 * VALUE, tenant="acme") as a2,
    ):
        seq1, data1 = blocks(6, seed=4)
        seq2, data2 = blocks(6, seed=5)
        assert a1.put(seq1, list(data1)) == 6
        assert a2.put(seq2, list(data2)) == 6
        assert a1.quota_usage() == a2.quota_usage() == 8 * VALUE
        assert len(keys_of(redis_server, a1.fingerprint)) + len(keys_of(redis_server, a2.fingerprint)) == 8
        assert loads_exactly(a2, seq2, data2) == 6  # the older model's blocks went first


@needs_redis
def test_quota_on_a_cluster_keeps_each_tenant_to_its_quota(redis_cluster) -> None:
    """The account's keys share one slot (a hash tag of the tenant); the blocks stay spread."""
    url = redis_cluster.url
    with (
        RemoteStore.open(url, FP_A, quota_bytes=10 * VALUE, tenant="acme") as a,
        RemoteStore.open(url, FP_B, quota_bytes=40 * VALUE, tenant="bolt") as b,
    ):
        seq_b, data_b = blocks(30, seed=6)
        assert b.put(seq_b, list(data_b)) == 30
        assert len(b.blocks_per_node(seq_b)) == 3 and min(b.blocks_per_node(seq_b).values()) > 0
        for batch in range(8):
            seq, data = blocks(6, seed=200 + batch)
            assert a.put(seq, list(data)) == 6
            assert (a.quota_usage() or 0) <= 10 * VALUE
        assert a.exists_prefix(seq) == 6 and sum(a.exists(seq_b)) == 0
        assert loads_exactly(b, seq_b, data_b) == 30


def test_a_remote_quota_without_the_remote_tier_is_refused() -> None:
    with pytest.raises(ConfigError, match="remote_quota_gb=2.0 bounds the remote tier, which is off"):
        CacheConfig(remote_quota_gb=2)
    with pytest.raises(ConfigError, match="remote_quota_gb=-1.0 must be >= 0"):
        CacheConfig(remote_quota_gb=-1)
