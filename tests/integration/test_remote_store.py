"""Remote tier data plane against real redis-server processes: exact bytes or a clean miss."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
from redis_fixtures import needs_redis, redis_cluster, redis_server  # noqa: F401 (fixtures)
from remote_helpers import make_test_certs
from served import wait_until

from dynamo_flexkv.core.remote import (
    HEADER_BYTES,
    BreakerState,
    CircuitBreaker,
    RemoteAuthError,
    RemoteClosedError,
    RemoteConfig,
    RemoteConfigError,
    RemoteError,
    RemoteStore,
    RemoteUnavailableError,
    Verdict,
    fingerprint_of,
    parse_url,
)
from dynamo_flexkv.core.remote.cluster import key_slot
from dynamo_flexkv.core.remote.codec import block_key, check_header, encode_header
from dynamo_flexkv.core.remote.resp import RespConnection, encode_command
from dynamo_flexkv.core.sysutil import find_binary
from dynamo_flexkv.serve.redis_server import RedisServer, free_port

FP = fingerprint_of({"model": "test", "dtype": "bfloat16", "tokens_per_block": 16})
SECRET = "s3cr3t-pw"


def blocks(n: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 2**63, size=n, dtype=np.uint64), rng.integers(0, 256, size=(n, size), dtype=np.uint8)


def raw(server: RedisServer) -> RespConnection:
    conn = RespConnection("127.0.0.1", server.port, timeout_s=5, connect_timeout_s=5)
    if server.password:
        conn.call(b"AUTH", server.password)
    return conn


# ---- config, codec, routing, breaker (no server) ----


def test_url_forms() -> None:
    p = parse_url("redis://127.0.0.1:7000/2")
    assert (p.tls, p.cluster, p.nodes, p.db, p.password) == (False, False, (("127.0.0.1", 7000),), 2, None)
    p = parse_url("rediss://user:p%40ss@cache.example:6380")
    assert p.tls and p.username == "user" and p.password == "p@ss" and p.nodes == (("cache.example", 6380),)
    p = parse_url("redis+cluster://:pw@a:7000,b:7001,[::1]:7002")
    assert p.cluster and p.nodes == (("a", 7000), ("b", 7001), ("::1", 7002)) and p.password == "pw"
    assert parse_url("redis://h").nodes == (("h", 6379),)


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://h:1", "unknown scheme"),
        ("redis://a:1,b:2", "redis+cluster://"),
        ("redis://h:99999", "port"),
        ("redis+cluster://a:1,b:2/3", "only database 0"),
        ("redis://", "names no host"),
        ("redis://h/abc", "must be a number"),
        ("redis://:pw@h:1?ssl=1", "query options"),
        ("", "empty"),
    ],
)
def test_bad_urls_name_the_key_and_the_fix(url: str, words: str) -> None:
    with pytest.raises(RemoteConfigError, match="remote_cache_url") as e:
        RemoteConfig(url=url)
    assert words in str(e.value)


def test_password_never_shown() -> None:
    cfg = RemoteConfig(url=f"redis://user:{SECRET}@127.0.0.1:1/0")
    assert SECRET not in repr(cfg) and SECRET not in cfg.redacted_url and "***" in cfg.redacted_url
    with pytest.raises(RemoteConfigError) as e:
        RemoteConfig(url=f"redis://:{SECRET}@h:notaport")
    assert SECRET not in str(e.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:abc/topsecret@127.0.0.1:6379",  # unencoded '/' (read as a path before)
        "redis://:p@ss:w/rd%@h",  # '@', ':', '/' and a bare '%'
        "redis://user:top?secret#x@h:1/0",  # '?' and '#'
        "redis://:topsecret%zz@h",  # a '%' that is no %XX escape
        "redis://top secret@h",  # a space (no ':' at all: still redacted whole)
        ":abc/topsecret@h:1",  # no scheme
        "redis//:abc/topsecret@h:1",  # a mistyped scheme
    ],
)
def test_a_malformed_password_is_never_shown_and_the_fix_is_named(url: str) -> None:
    """Everything between '//' and the last '@' is redacted; an unparsable user:password part is
    refused, saying what to percent-encode, and none of it is echoed."""
    with pytest.raises(RemoteConfigError, match="remote_cache_url") as e:
        RemoteConfig(url=url)
    msg = str(e.value)
    for part in ("abc", "secret", "p@ss", "ss:w", "rd%", "%zz"):
        assert part not in msg, (part, msg)
    assert "***" in msg
    if "://" in url:
        assert "percent-encoded" in msg and "%2F" in msg


def test_redacted_url_hides_the_whole_user_part() -> None:
    assert RemoteConfig(url="redis://user:p%40ss@h:1/2").redacted_url == "redis://***@h:1/2"
    assert RemoteConfig(url="redis://h:1").redacted_url == "redis://h:1"
    p = parse_url("redis://user:p%2Fs%3As%40@h:1")  # every special character, encoded, logs in
    assert (p.username, p.password) == ("user", "p/s:s@")


@pytest.mark.parametrize(
    "url, without, password",
    [
        ("redis://:pw@h:1", "redis://h:1", "pw"),
        ("rediss://us%40er:p%2Fs%3As%40@h:1/2", "rediss://us%40er@h:1/2", "p/s:s@"),  # decoded, user kept
        ("redis+cluster://:x@a:1,b:2", "redis+cluster://a:1,b:2", "x"),
        ("redis://:abc/topsecret@h:1", "redis://h:1", "abc/topsecret"),  # refused by parse_url: still split off
        ("redis://h:1", "redis://h:1", None),
        ("redis://user@h:1", "redis://user@h:1", None),
    ],
)
def test_split_password_keeps_no_password_in_the_url(url: str, without: str, password) -> None:
    """serve writes the URL without its password and hands the password over by environment."""
    from dynamo_flexkv.core.remote.config import split_password

    assert split_password(url) == (without, password)
    if password is not None and "/topsecret" not in url:
        assert RemoteConfig(url=without).parsed.nodes == RemoteConfig(url=url).parsed.nodes


def test_password_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_REDIS_PW", SECRET)
    assert RemoteConfig(url="redis://h:1", password_env="MY_REDIS_PW").password == SECRET
    assert RemoteConfig(url="redis://:fromurl@h:1", password_env="MY_REDIS_PW").password == "fromurl"


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"timeout_s": 0}, "remote_timeout_s"),
        ({"pipeline_depth": 0}, "remote_pipeline_depth"),
        ({"pipeline_bytes": 0}, "remote_pipeline_bytes"),
        ({"ttl_s": -1}, "remote_ttl_s"),
        ({"key_prefix": "a{b}"}, "remote_key_prefix"),
        ({"tls_ca_file": "/nonexistent.pem"}, "remote_tls_ca_file"),
        ({"timeout_s": float("inf")}, "remote_timeout_s"),
        ({"connect_timeout_s": float("nan")}, "remote_connect_timeout_s"),
        ({"breaker_cooldown_s": float("inf")}, "remote_breaker_cooldown_s"),
        ({"ttl_s": float("inf")}, "remote_ttl_s"),
        ({"ttl_s": float("nan")}, "remote_ttl_s"),
        ({"timeout_s": "2"}, "remote_timeout_s"),
    ],
)
def test_bad_settings(kwargs: dict, key: str) -> None:
    with pytest.raises(RemoteConfigError, match=key):
        RemoteConfig(url="redis://h:1", **kwargs)


def test_header_verdicts() -> None:
    payload = memoryview(bytearray(b"kv" * 100))
    head = memoryview(encode_header(FP, 7, 3, payload))
    assert len(head) == HEADER_BYTES
    assert check_header(head, FP, 7, 3, payload.nbytes)[0] is Verdict.OK
    assert check_header(head, FP ^ 1, 7, 3, payload.nbytes)[0] is Verdict.FOREIGN
    assert check_header(head, FP, 8, 3, payload.nbytes)[0] is Verdict.CORRUPT  # copied under another key
    assert check_header(head, FP, 7, None, payload.nbytes)[0] is Verdict.CORRUPT  # parent differs
    assert check_header(head, FP, 7, 3, payload.nbytes + 1)[0] is Verdict.TRUNCATED
    bad = bytearray(head)
    bad[0:4] = b"XXXX"
    assert check_header(memoryview(bad), FP, 7, 3, payload.nbytes)[0] is Verdict.CORRUPT
    assert fingerprint_of({"a": 1, "b": 2}) == fingerprint_of({"b": 2, "a": 1}) != fingerprint_of({"a": 1})


def test_key_slot_matches_redis_cluster_spec() -> None:
    assert key_slot(b"123456789") == 0x31C3 % 16384  # CRC16-XMODEM check value
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers") == key_slot(b"user1000")
    assert key_slot(b"foo{}{bar}") == key_slot(b"foo{}{bar}")  # empty tag: the whole key is hashed


def test_breaker_opens_cools_down_and_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    now[0] = 4.9
    assert not b.allow()
    now[0] = 5.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # one trial at a time
    b.failure()  # the trial failed: open again for a full cool-down
    assert b.state is BreakerState.OPEN and not b.allow()
    now[0] = 10.1
    assert b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED and b.times_opened == 2


# ---- against a real server ----


@needs_redis
@pytest.mark.parametrize("pipeline_bytes", [4 << 20, 100_000])  # the second: 1-3 values in flight
def test_randomized_round_trip(redis_server: RedisServer, pipeline_bytes: int) -> None:
    rng = np.random.default_rng(1)
    with RemoteStore.open(redis_server.url, FP, pipeline_depth=4, pipeline_bytes=pipeline_bytes) as store:
        for trial in range(6):
            n, size = int(rng.integers(1, 80)), int(rng.integers(1, 300_000))
            seq, data = blocks(n, size, seed=trial)
            assert store.exists_prefix(seq) == 0
            assert store.put(seq, list(data)) == n
            assert store.exists_prefix(seq) == n
            dst = np.zeros_like(data)
            assert store.get_into(seq, list(dst)) == n
            assert np.array_equal(dst, data)
            # Range by range (layerwise loads): the first range checks headers, then whole blocks verify.
            dst[:] = 0
            cut = size // 3
            n1, sums = store.get_range_into(seq, [d[:cut] for d in dst], 0, size)
            n2, _ = store.get_range_into(seq, [d[cut:] for d in dst], cut, size)
            assert n1 == n2 == n and store.verify_landed(list(dst), sums) == n
            assert np.array_equal(dst, data)
            # The chain is part of what a block is: a different parent is not this block.
            assert store.get_into(seq[1:2], [dst[1]], parents=[12345]) == 0
        s = store.stats()
        assert s.hits > 0 and s.corrupt == 6 and s.op_errors == 0 and s.connects == 1


@needs_redis
def test_exists_prefix_chunks_and_gaps(redis_server: RedisServer) -> None:
    seq, data = blocks(300, 64)
    with RemoteStore.open(redis_server.url, FP, exists_chunk=128) as store:
        store.put(seq, list(data))
        assert store.exists_prefix(seq) == 300
        store.delete([seq[200]])
        assert store.exists_prefix(seq) == 200
        assert store.exists_prefix([]) == 0
        with RemoteStore.open(redis_server.url, FP ^ 0xFF) as other:  # another model or namespace
            assert other.exists_prefix(seq) == 0


@needs_redis
def test_put_is_idempotent_and_skip_existing_sends_nothing(redis_server: RedisServer) -> None:
    seq, data = blocks(20, 4096)
    with RemoteStore.open(redis_server.url, FP) as store:
        assert store.put(seq[:10], list(data[:10])) == 10
        assert store.put(seq, list(data), skip_existing=True) == 20
        s = store.stats()
        assert (s.puts, s.put_skipped) == (20, 10)
        assert store.put(seq, list(data)) == 20  # rewriting the same content changes nothing
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == 20 and np.array_equal(dst, data)


@needs_redis
def test_value_evicted_between_lookup_and_read(redis_server: RedisServer) -> None:
    seq, data = blocks(10, 1000)
    with RemoteStore.open(redis_server.url, FP) as store:
        store.put(seq, list(data))
        assert store.exists_prefix(seq) == 10
        redis_server.cli("DEL", block_key(b"flexkv:", FP, int(seq[6])).decode())
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == 6
        assert np.array_equal(dst[:6], data[:6])
        assert store.stats().misses == 1


def _damage(server: RedisServer, seq, data, i: int, damage: str) -> bytes:
    """Replaces block i's value (raw connection, as a torn write or another writer would) and
    returns its key."""
    conn = raw(server)
    key = block_key(b"flexkv:", FP, int(seq[i]))
    value = bytearray(conn.call(b"GET", key))
    if damage == "flip":
        value[HEADER_BYTES + 1234] ^= 0x40
    elif damage == "truncate":
        value = value[:-100]
    elif damage == "foreign":
        with RemoteStore.open(server.url, FP ^ 1) as other:
            other.put(seq[i : i + 1], [data[i]], parents=[int(seq[i - 1])])
        value = bytearray(conn.call(b"GET", block_key(b"flexkv:", FP ^ 1, int(seq[i]))))
    elif damage == "other_key":
        value = bytearray(conn.call(b"GET", block_key(b"flexkv:", FP, int(seq[i + 1]))))
    elif damage == "magic":
        value[:4] = b"XXXX"
    else:
        value = bytearray(b"not a flexkv value")
    conn.call(b"SET", key, bytes(value))
    conn.close()
    return key


@needs_redis
@pytest.mark.parametrize(
    "damage, verdict",
    [
        ("flip", "corrupt"),
        ("truncate", "truncated"),
        ("foreign", "foreign"),
        ("other_key", "corrupt"),
        ("garbage", "truncated"),
    ],
)
def test_damaged_value_ends_the_prefix(redis_server: RedisServer, damage: str, verdict: str) -> None:
    seq, data = blocks(8, 5000)
    with RemoteStore.open(redis_server.url, FP) as store:
        store.put(seq, list(data))
        _damage(redis_server, seq, data, 3, damage)
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == 3
        assert np.array_equal(dst[:3], data[:3])
        assert getattr(store.stats(), verdict) == 1
        # The connection stayed in sync: the next read is whole again once the block is rewritten.
        store.put(seq[3:4], [data[3]], parents=[int(seq[2])])
        assert store.get_into(seq, list(dst)) == 8 and np.array_equal(dst, data)


@needs_redis
@pytest.mark.parametrize(
    "damage, verdict, first_range",
    [
        ("delete", "misses", 3),
        ("empty", "truncated", 3),
        ("append", "truncated", 8),
        ("truncate", "truncated", 8),
        ("header_only", "truncated", 3),
    ],
)
def test_ranged_reads_tell_a_bad_value_from_a_missing_one(
    redis_server: RedisServer, damage: str, verdict: str, first_range: int
) -> None:
    """Layerwise reads (GETRANGE): an empty value is bad (truncated), not an eviction (missing),
    though both read as zero bytes; a value longer or shorter than header + payload ends the prefix
    at the range that reaches the payload's end (it asks for one byte more), as a bulk get would."""
    size, cut = 5000, 1200
    seq, data = blocks(8, size, seed=5)
    with RemoteStore.open(redis_server.url, FP) as store:
        store.put(seq, list(data))
        conn = raw(redis_server)
        key = block_key(b"flexkv:", FP, int(seq[3]))
        value = conn.call(b"GET", key)
        new = {
            "delete": None,
            "empty": b"",
            "append": value + b"\xde\xad",
            "truncate": value[:-1],
            "header_only": value[:HEADER_BYTES],
        }[damage]
        if new is None:
            conn.call(b"DEL", key)
        else:
            conn.call(b"SET", key, new)
        conn.close()
        dst = np.zeros_like(data)
        n1, sums = store.get_range_into(seq, [d[:cut] for d in dst], 0, size)
        assert n1 == first_range
        n2, _ = store.get_range_into(seq[:n1], [d[cut:] for d in dst[:n1]], cut, size)
        assert n2 == 3 and store.verify_landed(list(dst[:n2]), sums) == 3
        assert np.array_equal(dst[:3], data[:3])
        s = store.stats()
        assert getattr(s, verdict) == 1 and s.misses + s.truncated + s.corrupt + s.foreign == 1 and s.hits == 3
        # The connection stayed in sync, and the repaired block reads whole.
        store.put(seq[3:4], [data[3]], parents=[int(seq[2])])
        n1, sums = store.get_range_into(seq, [d[:cut] for d in dst], 0, size)
        n2, _ = store.get_range_into(seq, [d[cut:] for d in dst], cut, size)
        assert n1 == n2 == 8 and store.verify_landed(list(dst), sums) == 8 and np.array_equal(dst, data)


def _dropped_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dynamo_flexkv.core.remote.store" and "bad value" in r.getMessage()]


@needs_redis
@pytest.mark.parametrize(
    "damage, verdict, why, ranged_why",
    [
        ("flip", "corrupt", "payload checksum mismatch", "payload checksum mismatch (read layer by layer)"),
        (
            "truncate",
            "truncated",
            "wrong size: 4948 bytes, not the 48-byte header + 5000 bytes",
            "wrong size: bytes 1248..5048 of the value are 3700 bytes, not 3800",
        ),  # at the range ending the payload
        (
            "garbage",
            "truncated",
            "wrong size: 18 bytes, shorter than the 48-byte header",
            "wrong size: bytes 0..1247 of the value are 18 bytes, not 1248",
        ),
        ("other_key", "corrupt", "bad header: it is block ", "bad header: it is block "),
        ("magic", "corrupt", "bad header: magic is not FKVR", "bad header: magic is not FKVR"),
        (
            "foreign",
            "foreign",
            f"written under fingerprint {FP ^ 1:016x}, not this model's {FP:016x}",
            f"written under fingerprint {FP ^ 1:016x}, not this model's {FP:016x}",
        ),
    ],
    ids=["flip", "truncate", "garbage", "other_key", "magic", "foreign"],
)
@pytest.mark.parametrize("layerwise", [False, True], ids=["get", "layerwise"])
def test_a_refused_value_is_deleted_with_one_warning_naming_its_key_and_why(
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    damage: str,
    verdict: str,
    why: str,
    ranged_why: str,
    layerwise: bool,
) -> None:
    """What the remote mover does with the value that ended a read's prefix: the store reports it
    (refused=) only when verification refused it, drop_refused deletes it and logs one WARNING with
    the key (hex hashes, not the value), the reason and that it was deleted."""
    size, cut = 5000, 1200
    seq, data = blocks(8, size, seed=11)
    caplog.set_level(logging.WARNING, logger="dynamo_flexkv.core.remote.store")
    with RemoteStore.open(redis_server.url, FP) as store:
        store.put(seq, list(data))
        key = _damage(redis_server, seq, data, 3, damage)
        dst = np.zeros_like(data)
        refused: list = []
        if layerwise:
            n, sums = store.get_range_into(seq, [d[:cut] for d in dst], 0, size, refused=refused)
            n, _ = store.get_range_into(seq[:n], [d[cut:] for d in dst[:n]], cut, size, refused=refused)
            n = store.verify_landed(list(dst[:n]), sums[:n], seq_hashes=seq[:n], refused=refused)
            why = ranged_why
        else:
            n = store.get_into(seq, list(dst), refused=refused)
        assert n == 3 and len(refused) == 1, refused
        (bad,) = refused
        assert (bad.seq_hash, bad.verdict.value) == (int(seq[3]), verdict) and why in bad.why, bad
        assert not _dropped_lines(caplog)  # reporting is not dropping
        assert store.drop_refused(bad)
        assert store.exists(seq[3:4]) == [False]  # the next put rewrites it
        (line,) = _dropped_lines(caplog)
        msg = line.getMessage()
        assert line.levelno == logging.WARNING
        assert f"deleted bad value {key.decode()} ({verdict}: " in msg and why in msg, msg
        assert "recomputed" in msg
        store.put(seq[3:4], [data[3]], parents=[int(seq[2])])
        assert store.get_into(seq, list(dst), refused=refused) == 8 and np.array_equal(dst, data)
        assert len(refused) == 1


@needs_redis
def test_a_miss_and_a_server_error_are_not_reported_as_refused(redis_server: RedisServer) -> None:
    seq, data = blocks(4, 1000, seed=12)
    with RemoteStore.open(redis_server.url, FP) as store:
        store.put(seq, list(data))
        store.delete(seq[2:3])  # evicted: missing, not bad
        refused: list = []
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst), refused=refused) == 2
        n, _ = store.get_range_into(seq, [d[:100] for d in dst], 0, 1000, refused=refused)
        assert n == 2 and refused == []


@needs_redis
def test_bad_value_lines_are_at_most_one_a_second_with_a_count_of_the_others(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Many bad values at once (a corrupting writer, a flushed DB of another format) make one
    line a second: the next line that goes out, or the store's close, counts those left out."""
    seq, data = blocks(8, 2000, seed=13)
    caplog.set_level(logging.WARNING, logger="dynamo_flexkv.core.remote.store")
    now = [100.0]
    with RemoteStore.open(redis_server.url, FP, clock=lambda: now[0]) as store:
        store.put(seq, list(data))
        for i in range(6):
            _damage(redis_server, seq, data, i, "flip")
        dst = np.zeros_like(data)
        for i in range(6):  # 6 reads, each ending at a bad value: 5 within one second, then one more
            now[0] += 0.1 if i < 5 else 1.0
            refused: list = []
            assert store.get_into(seq[i : i + 1], [dst[i]], [int(seq[i - 1]) if i else None], refused=refused) == 0
            assert store.drop_refused(refused[0])
            assert len(_dropped_lines(caplog)) == (1 if i < 5 else 2)
        assert "and 4 more like it since the last such line" in _dropped_lines(caplog)[1].getMessage()
        assert not any(store.exists(seq[:6]))
        _damage(redis_server, seq, data, 6, "flip")  # one more, within the second of that line: left out
        now[0] += 0.1
        refused = []
        assert store.get_into(seq[6:7], [dst[6]], [int(seq[5])], refused=refused) == 0
        assert store.drop_refused(refused[0])
        assert len(_dropped_lines(caplog)) == 2
    closing = [r.getMessage() for r in caplog.records if "not logged one by one" in r.getMessage()]
    assert closing[-1] == "1 more bad values refused and dropped since the last such line, not logged one by one"


def test_rate_limited_log_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    from dynamo_flexkv.core.logutil import RateLimitedLog

    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("flexkv.test.ratelog"), 1.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="flexkv.test.ratelog")
    assert limited.warning("a %d", 1) and not limited.warning("a %d", 2) and not limited.warning("a %d", 3)
    now[0] = 0.999
    assert not limited.warning("a %d", 4)
    now[0] = 1.0
    assert limited.warning("a %d", 5)
    limited.flush("a lines")  # nothing left out since
    assert [r.getMessage() for r in caplog.records if r.name == "flexkv.test.ratelog"] == [
        "a 1",
        "a 5 (and 3 more like it since the last such line, not logged one by one)",
    ]


@needs_redis
def test_ttl_expires_values(redis_server: RedisServer) -> None:
    seq, data = blocks(4, 100)
    with RemoteStore.open(redis_server.url, FP, ttl_s=0.3) as store:
        store.put(seq, list(data))
        key = block_key(b"flexkv:", FP, int(seq[0])).decode()
        assert 0 < int(redis_server.cli("PTTL", key)) <= 300
        wait_until("the value expired", lambda: int(redis_server.cli("EXISTS", key)) == 0, timeout=10, every=0.05)
        assert store.get_into(seq, list(np.zeros_like(data))) == 0


def test_server_down_at_open_names_url_and_fix() -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailableError) as e:
        RemoteStore.open(url, FP)
    msg = str(e.value)
    assert SECRET not in msg and "127.0.0.1" in msg and "start Redis" in msg and "enable_remote" in msg
    assert time.monotonic() - t0 < 5


@needs_redis
def test_server_down_at_open_non_strict_starts_later(caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(maxmemory="16mb")
    seq, data = blocks(3, 100)
    try:
        with caplog.at_level(logging.WARNING):
            store = RemoteStore.open(server.url, FP, strict=False, breaker_cooldown_s=0.3)
        assert "starts disabled" in caplog.text and store.breaker_state is BreakerState.OPEN
        assert store.put(seq, list(data)) == 0 and store.exists_prefix(seq) == 0
        assert store.stats().connects == 0 and store.stats().breaker_refused == 2
        server.start()
        time.sleep(0.35)
        assert store.put(seq, list(data)) == 3 and store.breaker_state is BreakerState.CLOSED
        store.close()
    finally:
        server.cleanup()


@needs_redis
def test_password(monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer(maxmemory="16mb", password=SECRET) as server:
        with pytest.raises(RemoteAuthError, match="FLEXKV_REMOTE_PASSWORD") as e:
            RemoteStore.open(server.url, FP)  # no password
        with pytest.raises(RemoteAuthError, match="refused the credentials") as e:
            RemoteStore.open(f"redis://:wrong-{SECRET}@127.0.0.1:{server.port}", FP)
        assert SECRET not in str(e.value)
        monkeypatch.setenv("FLEXKV_REMOTE_PASSWORD", SECRET)
        seq, data = blocks(2, 10)
        with RemoteStore.open(server.url, FP) as store:
            assert store.put(seq, list(data)) == 2
        with pytest.raises(RemoteError, match=r"refused database 16 .*databases 0\.\.15") as e:
            RemoteStore.open(server.url + "/16", FP)  # right password, a database it lacks
        assert not isinstance(e.value, RemoteAuthError) and "password" not in str(e.value)
        with RemoteStore.open(server.url + "/15", FP) as store:  # the last one it has
            assert store.exists_prefix(seq) == 0
    # a password given to a server that has none
    with RedisServer(maxmemory="16mb") as server, pytest.raises(RemoteAuthError, match="has no password"):
        RemoteStore.open(server.url, FP)


@needs_redis
def test_noeviction_warns_and_full_server_refuses_writes(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(maxmemory="3mb", policy="noeviction") as server:
        with caplog.at_level(logging.WARNING):
            store = RemoteStore.open(server.url, FP)
        assert "maxmemory-policy noeviction" in caplog.text and "allkeys-lru" in caplog.text
        seq, data = blocks(64, 128 << 10)
        stored = store.put(seq, list(data))
        s = store.stats()
        assert 0 < stored < 64 and s.put_refused == 64 - stored and s.op_errors == 0
        assert store.breaker_state is BreakerState.CLOSED
        dst = np.zeros_like(data)
        got = store.get_into(seq, list(dst))
        assert got >= 1 and np.array_equal(dst[:got], data[:got])
        store.close()


@needs_redis
def test_server_killed_and_restarted(redis_server: RedisServer) -> None:
    seq, data = blocks(16, 64 << 10)
    store = RemoteStore.open(redis_server.url, FP, timeout_s=1.0, breaker_failures=2, breaker_cooldown_s=1.0)
    store.put(seq, list(data))
    redis_server.kill()
    dst = np.zeros_like(data)
    t0 = time.monotonic()
    assert store.get_into(seq, list(dst)) == 0
    assert store.exists_prefix(seq) == 0
    assert time.monotonic() - t0 < 2.5  # within the timeout, no exception
    assert store.breaker_state is BreakerState.OPEN
    connects = store.stats().connects
    for _ in range(20):  # refused at once: the dead server is not hammered
        assert store.put(seq, list(data)) == 0
    assert store.stats().connects == connects and store.stats().breaker_refused == 20
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(1.05)
    assert store.put(seq, list(data)) == 16
    assert store.get_into(seq, list(dst)) == 16 and np.array_equal(dst, data)
    assert store.breaker_state is BreakerState.CLOSED and store.stats().breaker_opened == 1
    store.close()


@needs_redis
def test_restart_between_ops_reconnects_without_a_failed_op(redis_server: RedisServer) -> None:
    seq, data = blocks(5, 1000)
    with RemoteStore.open(redis_server.url, FP) as store:
        assert store.put(seq, list(data)) == 5
        redis_server.kill()
        redis_server.start()  # the pooled connection is dead; the op retries once on a new one
        assert store.put(seq, list(data)) == 5
        s = store.stats()
        assert (s.op_errors, s.connects) == (0, 2)


@needs_redis
def test_server_killed_during_a_read(redis_server: RedisServer) -> None:
    """A server SIGKILLed while a read is in flight: the read ends within its timeout, reports a
    prefix, and that prefix is exact. The kill is aimed, not timed: the test waits for the first
    block to land, freezes the server (SIGSTOP), and kills it only if the read is still going;
    a read that already finished is tried again (new blocks; 25 MB each, inside maxmemory)."""
    fds = open_fds()
    n = 200
    with RemoteStore.open(redis_server.url, FP, timeout_s=1.0, pipeline_depth=2) as store:
        for attempt in range(8):
            seq, data = blocks(n, 128 << 10, seed=attempt)
            assert store.put(seq, list(data)) == n
            dst = np.zeros_like(data)
            got: list[int] = []
            reader = threading.Thread(target=lambda: got.append(store.get_into(seq, list(dst))))
            reader.start()
            while reader.is_alive() and not np.array_equal(dst[0, :64], data[0, :64]):
                time.sleep(0.0005)
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            if not got:
                break  # caught mid-read: the server answers nothing more
            os.kill(redis_server.proc.pid, signal.SIGCONT)
            reader.join()
        else:
            pytest.fail("every read finished before the server could be frozen")
        redis_server.kill()
        reader.join(timeout=10)
        assert not reader.is_alive() and 0 <= got[0] < n
        assert np.array_equal(dst[: got[0]], data[: got[0]])  # what it reports as read is exact
    assert open_fds() == fds  # the broken connection was closed, not leaked


@needs_redis
def test_stalled_server_fails_within_the_timeout(redis_server: RedisServer) -> None:
    seq, data = blocks(4, 1000)
    with RemoteStore.open(redis_server.url, FP, timeout_s=0.3) as store:
        store.put(seq, list(data))
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts bytes, answers nothing
        try:
            t0 = time.monotonic()
            assert store.get_into(seq, list(np.zeros_like(data))) == 0
            assert time.monotonic() - t0 < 1.0
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert store.stats().op_errors == 1
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == 4 and np.array_equal(dst, data)  # a fresh connection


@needs_redis
def test_a_put_cut_short_counts_its_blocks_in_put_failed_and_one_op_error(redis_server: RedisServer) -> None:
    """A frozen server: the put returns (nothing raised), op_errors counts the op, put_failed its
    blocks; with the breaker open the next put is not tried (breaker_refused) and its blocks are
    put_failed too; refusals by the server stay in put_refused."""
    seq, data = blocks(6, 1000, seed=9)
    with RemoteStore.open(redis_server.url, FP, timeout_s=0.3, breaker_failures=1, breaker_cooldown_s=60) as store:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert store.put(seq[:4], list(data[:4])) == 0
            assert store.put(seq[4:], list(data[4:]), skip_existing=True) == 0  # breaker open
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        s = store.stats()
        assert (s.op_errors, s.put_failed, s.puts, s.put_refused, s.breaker_refused) == (1, 6, 0, 0, 2)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_redis
def test_threads_share_one_store(redis_server: RedisServer) -> None:
    fds = open_fds()
    with RemoteStore.open(redis_server.url, FP) as store:
        errors: list[str] = []

        def worker(k: int) -> None:
            seq, data = blocks(30, 20_000, seed=100 + k)
            for _ in range(3):
                dst = np.zeros_like(data)
                if (
                    store.put(seq, list(data)) != 30
                    or store.get_into(seq, list(dst)) != 30
                    or not np.array_equal(dst, data)
                ):
                    errors.append(f"worker {k}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    assert open_fds() == fds  # every pooled connection closed


@needs_redis
def test_closed_store_and_bad_arguments(redis_server: RedisServer) -> None:
    store = RemoteStore.open(redis_server.url, FP)
    seq, data = blocks(2, 10)
    with pytest.raises(ValueError, match="destination buffers"):
        store.get_into(seq, [data[0]])
    with pytest.raises(ValueError, match="writable"):
        store.get_into(seq[:1], [bytes(10)])
    store.close()
    store.close()
    with pytest.raises(RemoteClosedError):
        store.exists_prefix(seq)


@needs_redis
def test_hashes_outside_u64_are_refused_not_aliased(redis_server: RedisServer) -> None:
    """2**64 would land on hash 0's key and -1 on 0xffff...ffff: each call refuses them, naming the
    value and the range; a numpy uint64 array (the fast path) and ints up to 2**64-1 work."""
    u64max = 2**64 - 1
    with RemoteStore.open(redis_server.url, FP) as store:
        for bad, shown in (
            ([2**64], "18446744073709551616"),
            ([5, -1], "-1"),
            (np.array([3, -2], dtype=np.int64), "-2"),
            ([np.int64(-7)], "-7"),
        ):
            for call in (
                lambda: store.put(bad, [bytearray(8)] * len(bad)),
                lambda: store.exists(bad),
                lambda: store.exists_prefix(bad),
                lambda: store.get_into(bad, [bytearray(8)] * len(bad)),
                lambda: store.get_range_into(bad, [bytearray(8)] * len(bad), 0, 8),
                lambda: store.delete(bad),
            ):
                with pytest.raises(
                    ValueError, match=rf"seq_hashes holds {shown}, outside the u64 range \[0, 2\*\*64\)"
                ):
                    call()
        with pytest.raises(ValueError, match="parents holds -1"):
            store.put([1], [bytearray(8)], parents=[-1])
        assert store.exists([0, u64max]) == [False, False]  # nothing was written under them
        seq = np.array([0, u64max, 2**63], dtype=np.uint64)
        assert store.put(seq, [bytearray(b"x" * 8)] * 3) == 3
        assert store.put([0, u64max, 2**63], [bytearray(b"x" * 8)] * 3, skip_existing=True) == 3
        assert store.exists_prefix(seq) == 3 and store.exists_prefix(seq.astype(np.uint32)[:1]) == 1
        assert store.exists_prefix(np.array([0, 5], dtype=np.int64)) == 1  # non-negative int64: fine


@needs_redis
@pytest.mark.parametrize("arg", ["123", b"123", bytearray(b"12")])
def test_a_string_is_not_a_list_of_hashes_anywhere(redis_server: RedisServer, arg) -> None:
    with RemoteStore.open(redis_server.url, FP) as store:
        for call in (
            lambda: store.exists_prefix(arg),
            lambda: store.exists(arg),
            lambda: store.delete(arg),
            lambda: store.put(arg, [bytearray(8)] * len(arg)),
            lambda: store.get_into(arg, [bytearray(8)] * len(arg)),
            lambda: store.put([1, 2], [bytearray(8)] * 2, parents=arg[:2]),
        ):
            with pytest.raises(TypeError, match=r"(seq_hashes|parents) must be a sequence of u64 .*numpy uint64"):
                call()


@needs_redis
def test_blocks_per_node_on_one_server_and_after_close(redis_server: RedisServer) -> None:
    with RemoteStore.open(redis_server.url, FP) as store:
        assert store.blocks_per_node([1, 2, 3]) == {f"127.0.0.1:{redis_server.port}": 3}
        with pytest.raises(ValueError, match="outside the u64 range"):
            store.blocks_per_node([-1])
    with pytest.raises(RemoteClosedError):
        store.blocks_per_node([1])


@needs_redis
@pytest.mark.parametrize(
    "arg,match",
    [
        ([1.5, 2.0], r"must hold integers .*not float \(1\.5\)"),
        (["1", "2"], r"not str \('1'\)"),
        (np.array([1.0, 2.0]), r"not a float64 array: pass a numpy uint64 array"),
        (np.zeros((2, 2), dtype=np.uint64), r"not a 2-D uint64 array"),
        (5, r"not int"),
        (np.uint64(5), r"not uint64"),
        ([float("nan")], r"not float"),
        ([1, None], r"not NoneType"),
        ([True, False], r"not bool"),
        ({1, 2}, r"not set"),
        ({1: 2}, r"not dict"),
    ],
)
def test_hashes_of_the_wrong_type_are_refused_not_truncated(redis_server: RedisServer, arg, match) -> None:
    """A float hash would be truncated onto another block's key (a float64 holds 53 bits)."""
    with RemoteStore.open(redis_server.url, FP) as store:
        for call in (
            lambda: store.exists(arg),
            lambda: store.blocks_per_node(arg),
            lambda: store.get_into(arg, [bytearray(8)] * 2),
        ):
            with pytest.raises(TypeError, match=match):
                call()


@needs_redis
def test_an_object_array_of_u64_ints_is_accepted(redis_server: RedisServer) -> None:
    with RemoteStore.open(redis_server.url, FP) as store:
        assert store.exists(np.array([1, 2**64 - 1], dtype=object)) == [False, False]


@pytest.mark.unit
def test_blocks_per_node_refuses_fast_while_the_breaker_pauses_the_tier() -> None:
    # strict=False on a cluster nobody answers: the tier starts paused, as after failed ops
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with RemoteStore.open(url, FP, strict=False, breaker_failures=1, breaker_cooldown_s=60) as store:
        assert store.breaker_state is BreakerState.OPEN
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match="paused for 60 s"):
            store.blocks_per_node([1, 2])
        assert time.monotonic() - t0 < 1.0 and store.stats().breaker_refused == 1
        assert store.stats().op_errors == 0  # refused by the breaker, not by a failed connection


@needs_redis
def test_standalone_url_on_a_cluster_node_says_use_cluster(redis_cluster) -> None:
    port = redis_cluster.servers[0].port
    with pytest.raises(RemoteError, match=rf"redis\+cluster://127.0.0.1:{port}"):
        RemoteStore.open(f"redis://127.0.0.1:{port}", FP)


@needs_redis
def test_cluster_round_trip_spreads_keys(redis_cluster) -> None:
    seq, data = blocks(120, 30_000, seed=7)
    with RemoteStore.open(redis_cluster.url, FP) as store:
        assert store.put(seq, list(data)) == 120
        assert store.exists_prefix(seq) == 120
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == 120 and np.array_equal(dst, data)
        per_node = [int(s.cli("DBSIZE")) for s in redis_cluster.servers]
        assert all(k > 0 for k in per_node) and sum(per_node) >= 120
        # What the store says each node serves is what each node holds: asked of every node, a
        # key it does not serve answers MOVED (an error reply), one it holds answers 1.
        keys = [encode_command(b"EXISTS", block_key(b"flexkv:", FP, int(h))) for h in seq]
        held = {}
        for server in redis_cluster.servers:
            conn = RespConnection("127.0.0.1", server.port, timeout_s=30, connect_timeout_s=5)
            try:
                held[f"127.0.0.1:{server.port}"] = sum(r == 1 for r in conn.pipeline(keys))
            finally:
                conn.close()
        placed = store.blocks_per_node(seq)
        assert placed == held and sum(placed.values()) == 120 and len(placed) == 3
        assert store.blocks_per_node(np.asarray(seq, dtype=np.uint64)) == placed
        assert store.blocks_per_node([]) == {node: 0 for node in placed}  # every node, 0 included
        one = store.blocks_per_node(seq[:1])
        assert sorted(one.values()) == [0, 0, 1] and one.keys() == placed.keys()
        for h in seq[:5]:
            key = block_key(b"flexkv:", FP, int(h))
            assert int(redis_cluster.servers[0].cli("CLUSTER", "KEYSLOT", key.decode())) == key_slot(key)
        store.delete([seq[77]])
        assert store.exists_prefix(seq) == 77 and store.get_into(seq, list(dst)) == 77
        store.delete(seq)


@needs_redis
def test_tls_round_trip_and_untrusted_certificate(tmp_path) -> None:
    if find_binary("openssl") is None:
        pytest.skip("openssl not installed")
    certs = make_test_certs(str(tmp_path))
    with RedisServer(maxmemory="16mb", tls_dir=certs) as server:
        seq, data = blocks(40, 70_000)
        with RemoteStore.open(server.url, FP, tls_ca_file=os.path.join(certs, "ca.crt")) as store:
            assert store.put(seq, list(data)) == 40
            dst = np.zeros_like(data)
            assert store.get_into(seq, list(dst)) == 40 and np.array_equal(dst, data)
        with pytest.raises(RemoteUnavailableError, match="CERTIFICATE_VERIFY_FAILED|certificate"):
            RemoteStore.open(server.url, FP)  # the system CAs do not trust the test CA


@needs_redis
def test_cluster_stale_slot_map_ends_prefix_then_refreshes(redis_cluster) -> None:
    """As after a resharding: nodes answer MOVED for keys the map sends to the wrong node."""
    seq, data = blocks(60, 2000, seed=9)
    with RemoteStore.open(redis_cluster.url, FP) as store:
        assert store.put(seq, list(data)) == 60
        slots = store._nodes.slots  # a stale map, as after a resharding
        first_elsewhere = next(
            i for i, h in enumerate(seq) if slots.owner[key_slot(block_key(b"flexkv:", FP, int(h)))] != 0
        )
        placed = store.blocks_per_node(seq)
        slots.owner = [0] * len(slots.owner)  # every slot "moved" to node 0 in our stale view
        assert store.blocks_per_node(seq) == placed  # asks the cluster, not the stale view
        k = first_elsewhere  # a block node 0 does not serve: asking node 0 for it gets a MOVED
        for op in (lambda: store.exists(seq) != [True] * 60, lambda: store.delete(seq[k : k + 1]) == 0):
            # EXISTS or DEL answered MOVED: counted, and the next op fetches the map again
            slots = store._nodes.slots
            slots.owner = [0] * len(slots.owner)
            errors = store.stats().server_errors
            assert op() and store.stats().server_errors > errors and store._nodes.slots_stale
            assert store.exists(seq) == [True] * 60  # the MOVED deleted nothing
        slots = store._nodes.slots
        slots.owner = [0] * len(slots.owner)
        dst = np.zeros_like(data)
        assert store.get_into(seq, list(dst)) == first_elsewhere
        assert store.stats().server_errors >= 1 and store.stats().op_errors == 0
        assert store.get_into(seq, list(dst)) == 60 and np.array_equal(dst, data)  # map refreshed
        store.delete(seq)


@needs_redis
@pytest.mark.slow
def test_soak_kill_restart_cycles_never_return_wrong_bytes(redis_server: RedisServer) -> None:
    """Readers and writers on four threads while the server dies and comes back five times: every
    read is exact bytes or a shorter prefix, nothing raises, and the tier recovers each time."""
    store = RemoteStore.open(redis_server.url, FP, timeout_s=0.5, breaker_failures=2, breaker_cooldown_s=0.2)
    stop = threading.Event()
    errors: list[str] = []
    counts = {"full": 0, "short": 0}

    def worker(k: int) -> None:
        seq, data = blocks(40, 50_000, seed=500 + k)
        while not stop.is_set():
            try:
                store.put(seq, list(data), skip_existing=k % 2 == 0)
                dst = np.zeros_like(data)
                got = store.get_into(seq, list(dst))
                if not np.array_equal(dst[:got], data[:got]):
                    errors.append(f"worker {k}: wrong bytes in the first {got} blocks")
                counts["full" if got == 40 else "short"] += 1
            except Exception as e:  # noqa: BLE001 -- any escape is a failure of the contract
                errors.append(f"worker {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            time.sleep(0.6)
            redis_server.kill()
            time.sleep(0.4)
            redis_server.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors[:5]
    assert counts["full"] > 0 and counts["short"] > 0
    s = store.stats()
    assert s.op_errors > 0 and s.breaker_opened >= 1
    seq, data = blocks(10, 1000, seed=1)
    time.sleep(0.25)
    assert store.put(seq, list(data)) == 10 and store.breaker_state is BreakerState.CLOSED
    store.close()
