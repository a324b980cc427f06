"""Adversarial tests of the remote tier (Redis), through the public interface only: KVManager with
enable_remote, RemoteStore / RemoteConfig / parse_url from dynamo_flexkv.core.remote, and values written
by hand under the documented key scheme (`{prefix}{fingerprint:016x}:{seq_hash:016x}`, 48-byte
header "FKVR" | ver u16 | flags u16 | fp | seq | parent | len | xxh3)."""

from __future__ import annotations

import logging
import os
import signal
import struct
import threading
import time
import urllib.parse
import zlib

import numpy as np
import pytest
import xxhash
from kv_helpers import MODEL, TPB, config, holds
from redis_fixtures import needs_redis, redis_server  # noqa: F401 (fixture)  # noqa: F401 (fixture)
from remote_helpers import LAYOUT, REMOTE, Engine, check_clean, manager, prompt_of
from served import wait_until

from dynamo_flexkv import TaskStatus
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.remote import (
    RemoteAuthError,
    RemoteClosedError,
    RemoteConfig,
    RemoteConfigError,
    RemoteError,
    RemoteStore,
    RemoteUnavailableError,
    parse_url,
)
from dynamo_flexkv.core.remote.resp import RespConnection
from dynamo_flexkv.serve.redis_server import RedisServer

pytestmark = needs_redis
HDR = struct.Struct("<4sHHQQQQQ")


def key_of(kv, seq_hash: int) -> bytes:
    return b"flexkv:%016x:%016x" % (kv.remote.fingerprint, int(seq_hash))


def conn_to(server) -> RespConnection:
    return RespConnection("127.0.0.1", server.port, timeout_s=5, connect_timeout_s=1)


def load(kv, e: Engine, prompt, layerwise=False):
    """get_async of the whole prompt into poisoned device blocks: (result, which blocks hold the
    exact bytes)."""
    h = kv.hashes(prompt).sequence
    ids = e.rng.choice(64, size=len(h), replace=False)
    for b in ids:
        for layer in range(MODEL.num_layers):
            e.dev[layer][int(b)].fill_(0)
    t = kv.get_async(prompt, ids, layerwise=layerwise)
    r = kv.wait([t], timeout=30)[t]
    return r, [holds(e.dev, LAYOUT, int(ids[i]), int(h[i])) for i in range(len(h))]


# ---------------------------------------------------------------- hand-crafted values


def _crafted(orig: bytes, case: str) -> bytes:
    m, ver, flags, fp, sh, par, ln, xx = HDR.unpack(orig[:48])
    payload = orig[48:]
    evil = bytes(len(payload))  # zeros: a block that must never reach the device

    def mk(pl=evil, tail=b"", **kw):
        d = dict(m=m, ver=ver, flags=flags, fp=fp, sh=sh, par=par, ln=ln)
        d.update(kw)
        return (
            HDR.pack(d["m"], d["ver"], d["flags"], d["fp"], d["sh"], d["par"], d["ln"], xxhash.xxh3_64_intdigest(pl))
            + pl
            + tail
        )

    return {
        "foreign_fp_valid_checksum": lambda: mk(fp=fp ^ 1),
        "wrong_parent": lambda: mk(par=par ^ 1),
        "parent_flag_cleared": lambda: mk(flags=0, par=0),
        "future_version": lambda: mk(ver=ver + 1),
        "header_len_and_value_short": lambda: mk(ln=ln - 8, pl=evil[:-8]),
        "header_len_lies_long": lambda: mk(ln=ln + 16, tail=b"\0" * 16),
        "huge_value": lambda: mk(ln=8 << 20, pl=bytes(8 << 20)),
        "header_only": lambda: mk(ln=0, pl=b""),
        "bad_magic": lambda: mk(m=b"fkvr"),
        "flip_one_payload_byte": lambda: orig[:200] + bytes([orig[200] ^ 1]) + orig[201:],
        "flip_checksum_byte": lambda: orig[:40] + bytes([orig[40] ^ 1]) + orig[41:],
        "empty": lambda: b"",
        "four_bytes": lambda: b"FKVR",
    }[case]()


CRAFTED = [
    "foreign_fp_valid_checksum",
    "wrong_parent",
    "parent_flag_cleared",
    "future_version",
    "header_len_and_value_short",
    "header_len_lies_long",
    "huge_value",
    "header_only",
    "bad_magic",
    "flip_one_payload_byte",
    "flip_checksum_byte",
    "empty",
    "four_bytes",
]


@pytest.fixture(scope="module")
def big_redis():
    with RedisServer(maxmemory="128mb") as server:
        yield server


@pytest.mark.parametrize(
    "case,layerwise",
    [pytest.param(c, lw, id=f"{c}-{'layerwise' if lw else 'bulk'}") for c in CRAFTED for lw in (False, True)],
)
def test_hand_crafted_bad_value_is_a_clean_miss(tmp_path, big_redis, case, layerwise):
    """Block 3 of 6 replaced by a hand-written bad value: the get fails cleanly (recompute), never
    reports a block holding the wrong bytes, keeps blocks 0-2 on host, deletes the bad value."""
    # A seed of its own per case and variant (hash() of a str changes with PYTHONHASHSEED): the
    # variants never share keys on the module's server.
    p = prompt_of(np.random.default_rng(zlib.crc32(f"{case}-{layerwise}".encode())), 6)
    with manager(tmp_path / "w", big_redis.url) as kv0, manager(tmp_path / "r", big_redis.url) as kv1:
        Engine(kv0).put(p)
        seq = kv0.hashes(p).sequence
        c = conn_to(big_redis)
        try:
            k = key_of(kv0, seq[3])
            c.call(b"SET", k, _crafted(c.call(b"GET", k), case))
            r, ok = load(kv1, Engine(kv1, 1), p, layerwise)
            assert r.status is TaskStatus.FAILED and "verified 3 of 6" in r.error, r
            assert c.call(b"EXISTS", k) == 0  # the bad value was deleted
        finally:
            c.close()
        s = kv1.stats().remote
        assert s.short_reads == 1 and s.hits == 3
        assert kv1.match(p)["host"] == 3 * TPB
        check_clean(kv1)


def test_an_empty_value_fails_one_layerwise_get_not_every_one(tmp_path, redis_server):
    p = prompt_of(np.random.default_rng(79), 6)
    with manager(tmp_path / "w", redis_server.url) as kv0, manager(tmp_path / "r", redis_server.url) as kv1:
        Engine(kv0).put(p)
        c = conn_to(redis_server)
        try:
            c.call(b"SET", key_of(kv0, kv0.hashes(p).sequence[3]), b"")
        finally:
            c.close()
        e = Engine(kv1, 1)
        r, _ = load(kv1, e, p, layerwise=True)
        assert r.status is TaskStatus.FAILED  # the first get meets the bad value: recompute
        r, ok = load(kv1, e, p, layerwise=True)  # the next one must not plan it again
        assert r.ok and r.num_tokens == 3 * TPB and all(ok[:3]), r
        check_clean(kv1)


def test_layerwise_rejects_a_value_longer_than_its_header_like_bulk(tmp_path, big_redis):
    p = prompt_of(np.random.default_rng(77), 6)
    with manager(tmp_path / "w", big_redis.url) as kv0, manager(tmp_path / "r", big_redis.url) as kv1:
        Engine(kv0).put(p)
        seq = kv0.hashes(p).sequence
        c = conn_to(big_redis)
        try:
            k = key_of(kv0, seq[3])
            c.call(b"APPEND", k, b"\xde\xad\xbe\xef" * 4)  # 16 stray bytes after a genuine value
            r, ok = load(kv1, Engine(kv1, 1), p, layerwise=True)
            assert r.status is TaskStatus.FAILED and "verified 3 of 6" in r.error, r
        finally:
            c.close()
        check_clean(kv1)


def test_bulk_rejects_a_value_longer_than_its_header(tmp_path, big_redis):
    p = prompt_of(np.random.default_rng(78), 6)
    with manager(tmp_path / "w", big_redis.url) as kv0, manager(tmp_path / "r", big_redis.url) as kv1:
        Engine(kv0).put(p)
        c = conn_to(big_redis)
        try:
            c.call(b"APPEND", key_of(kv0, kv0.hashes(p).sequence[3]), b"\xde\xad\xbe\xef" * 4)
            r, ok = load(kv1, Engine(kv1, 1), p, layerwise=False)
            assert r.status is TaskStatus.FAILED and "verified 3 of 6" in r.error, r
        finally:
            c.close()
        assert kv1.stats().remote.truncated == 1
        check_clean(kv1)


def test_key_of_another_redis_type_is_a_clean_miss(tmp_path, redis_server):
    """A LIST under a block's key: EXISTS says yes, GET answers WRONGTYPE: the prefix ends there."""
    p = prompt_of(np.random.default_rng(11), 5)
    with manager(tmp_path / "w", redis_server.url) as kv0, manager(tmp_path / "r", redis_server.url) as kv1:
        Engine(kv0).put(p)
        c = conn_to(redis_server)
        try:
            k = key_of(kv0, kv0.hashes(p).sequence[2])
            c.call(b"DEL", k)
            c.call(b"LPUSH", k, b"x")
            for lw in (False, True):
                kv1.reset()
                r, ok = load(kv1, Engine(kv1, 1), p, lw)
                assert r.status is TaskStatus.FAILED or r.num_tokens <= 2 * TPB
                assert all(ok[: r.num_tokens // TPB])
                check_clean(kv1)
        finally:
            c.close()


def test_middle_block_missing_loads_only_the_prefix_before_it(tmp_path, redis_server):
    p = prompt_of(np.random.default_rng(12), 6)
    with manager(tmp_path / "w", redis_server.url) as kv0, manager(tmp_path / "r", redis_server.url) as kv1:
        Engine(kv0).put(p)
        c = conn_to(redis_server)
        try:
            c.call(b"DEL", key_of(kv0, kv0.hashes(p).sequence[3]))
        finally:
            c.close()
        assert kv1.match(p) == {"host": 0, "remote": 3 * TPB}
        r, ok = load(kv1, Engine(kv1, 1), p)
        assert r.ok and r.num_tokens == 3 * TPB and all(ok[:3])
        check_clean(kv1)


def test_ttl_expiry_is_a_clean_miss(tmp_path, redis_server):
    p = prompt_of(np.random.default_rng(13), 4)
    with (
        manager(tmp_path / "w", redis_server.url, remote_ttl_s=0.3) as kv0,
        manager(tmp_path / "r", redis_server.url) as kv1,
    ):
        Engine(kv0).put(p)
        assert int(redis_server.cli("DBSIZE")) > 0
        wait_until("the values expired in Redis", lambda: int(redis_server.cli("DBSIZE")) == 0, timeout=10, every=0.05)
        assert kv1.match(p) == {"host": 0, "remote": 0}
        r, ok = load(kv1, Engine(kv1, 1), p)
        assert r.status is TaskStatus.NOT_FOUND
        check_clean(kv1)


# ---------------------------------------------------------------- sharing and isolation


def test_concurrent_workers_putting_one_prefix_write_it_once_and_a_reader_gets_exact_bytes(tmp_path, redis_server):
    p = prompt_of(np.random.default_rng(14), 8)
    kvs = [manager(tmp_path / f"w{i}", redis_server.url) for i in range(4)]
    try:
        engines = [Engine(kv, i) for i, kv in enumerate(kvs)]
        errors = []

        def run(e):
            try:
                for _ in range(3):
                    e.put(p)
            except BaseException as ex:  # noqa: BLE001
                errors.append(ex)

        threads = [threading.Thread(target=run, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        c = conn_to(redis_server)
        try:
            assert len(c.call(b"KEYS", b"flexkv:%016x:*" % kvs[0].remote.fingerprint)) == 8
        finally:
            c.close()
        assert sum(kv.stats().remote.puts for kv in kvs) >= 8
        with manager(tmp_path / "r", redis_server.url) as reader:
            for lw in (False, True):
                reader.reset()
                r, ok = load(reader, Engine(reader, 9), p, lw)
                assert r.ok and r.num_tokens == 8 * TPB and all(ok)
            check_clean(reader)
        for kv in kvs:
            check_clean(kv)
    finally:
        for kv in kvs:
            kv.shutdown()


@pytest.mark.parametrize("other", [dict(namespace="b"), dict(tp_rank=1, tp_size=2)], ids=["namespace", "tp_rank"])
def test_other_namespace_or_rank_never_shares(tmp_path, redis_server, other):
    p = prompt_of(np.random.default_rng(15), 4)
    with manager(tmp_path / "w", redis_server.url) as kv0, manager(tmp_path / "r", redis_server.url, **other) as kv1:
        Engine(kv0).put(p)
        assert kv1.match(p)["remote"] == 0
        assert kv1.remote.fingerprint != kv0.remote.fingerprint


def test_a_prompt_longer_than_the_host_tier_loads_what_fits_exactly(tmp_path, redis_server):
    """300 remote blocks (more than two 128-key existence chunks), a 32-block host tier."""
    p = prompt_of(np.random.default_rng(16), 300)
    with (
        manager(tmp_path / "w", redis_server.url, host_blocks=320) as kv0,
        manager(tmp_path / "r", redis_server.url, host_blocks=32) as kv1,
    ):
        Engine(kv0, device_blocks=320).put(p)
        assert kv1.match(p)["remote"] == 300 * TPB
        e1 = Engine(kv1, 1, device_blocks=320)
        h = kv1.hashes(p).sequence
        ids = e1.rng.choice(320, size=len(h), replace=False)
        t = kv1.get_async(p, ids, layerwise=True)
        r = kv1.wait([t], timeout=60)[t]
        assert r.ok and 0 < r.num_tokens <= 32 * TPB
        assert all(holds(e1.dev, LAYOUT, int(ids[i]), int(h[i])) for i in range(r.num_tokens // TPB))
        check_clean(kv1)


# ---------------------------------------------------------------- faults


def test_redis_frozen_during_write_behind_drain_returns_and_nothing_leaks(tmp_path, redis_server):
    rng = np.random.default_rng(17)
    with manager(tmp_path / "w", redis_server.url) as kv:
        e = Engine(kv)
        e.put(prompt_of(rng, 2))
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            e.put(prompt_of(rng, 6))  # asserts the put succeeded and drain(30) returned True
            st = kv.stats().remote
            assert st.op_errors >= 1 and st.put_failed >= 1 and st.write_failures == 0
            check_clean(kv)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_redis_killed_between_layer_spans_fails_cleanly(tmp_path):
    """Layerwise get: Redis dies after the first layer span landed: the get fails (recompute),
    no block is reported that does not hold its bytes, nothing leaks."""
    p = prompt_of(np.random.default_rng(18), 6)
    server = RedisServer(maxmemory="32mb").start()
    try:
        with manager(tmp_path / "w", server.url) as kv0, manager(tmp_path / "r", server.url) as kv1:
            Engine(kv0).put(p)
            store, real = kv1.remote, kv1.remote.get_range_into

            def dying(hashes, dests, offset, block_bytes, parents=None, **kw):
                if offset > 0 and server.proc is not None and server.proc.poll() is None:
                    server.kill()
                return real(hashes, dests, offset, block_bytes, parents, **kw)

            store.get_range_into = dying
            try:
                r, ok = load(kv1, Engine(kv1, 1), p, layerwise=True)
            finally:
                store.get_range_into = real
            assert r.status is TaskStatus.FAILED
            check_clean(kv1)
            assert kv1.match(p)["host"] == 0
    finally:
        server.cleanup()


def test_noeviction_warning_names_the_fix_and_no_password_anywhere(tmp_path, caplog):
    secret = "Sup3r$ecret-XYZ"
    with RedisServer(maxmemory="16mb", policy="noeviction", password=secret) as s:
        url = f"redis://:{urllib.parse.quote(secret, safe='')}@127.0.0.1:{s.port}"
        with caplog.at_level(logging.DEBUG), manager(tmp_path, url) as kv:
            e = Engine(kv)
            e.put(prompt_of(np.random.default_rng(19), 3))
            assert secret not in repr(kv.config) and secret not in str(kv.stats())
            os.kill(s.proc.pid, signal.SIGSTOP)  # make it fail and log
            try:
                kv.match(prompt_of(np.random.default_rng(20), 3))
            finally:
                os.kill(s.proc.pid, signal.SIGCONT)
        assert "allkeys-lru" in caplog.text and "noeviction" in caplog.text
        assert secret not in caplog.text and urllib.parse.quote(secret, safe="") not in caplog.text


def test_shutdown_twice_and_calls_after_close(tmp_path, redis_server):
    # ManagerClosed after shutdown: tests/unit/test_manager.py, every public call.
    kv = manager(tmp_path, redis_server.url)
    kv.shutdown()
    kv.shutdown()  # the remote tier is closed once
    st = RemoteStore(RemoteConfig(url=redis_server.url), 5)
    st.close()
    with pytest.raises(RemoteClosedError):
        st.exists_prefix([1])
    st.close()


# ---------------------------------------------------------------- URLs and config


def test_rediss_against_a_plain_server_fails_bounded_naming_the_fix(redis_server):
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match="remote_cache_url"):
        RemoteStore(RemoteConfig(url=f"rediss://127.0.0.1:{redis_server.port}", timeout_s=1, connect_timeout_s=1), 1)
    assert time.monotonic() - t0 < 15


def test_cluster_url_against_a_plain_server_is_refused(redis_server):
    with pytest.raises(RemoteError, match="cluster"):
        RemoteStore(RemoteConfig(url=f"redis+cluster://127.0.0.1:{redis_server.port}"), 1)


def test_percent_encoded_password_with_special_characters_logs_in():
    secret = "p@ss:w/rd%#?"
    with RedisServer(maxmemory="16mb", password=secret) as s:
        enc = urllib.parse.quote(secret, safe="")
        for url in (f"redis://:{enc}@127.0.0.1:{s.port}", f"redis://default:{enc}@127.0.0.1:{s.port}"):
            st = RemoteStore(RemoteConfig(url=url), 1)
            try:
                assert st.exists_prefix([1, 2]) == 0
            finally:
                st.close()


def test_unencoded_password_never_appears_in_the_error(tmp_path):
    url = "redis://:abc/topsecret@127.0.0.1:6379"
    with pytest.raises((ConfigError, RemoteConfigError)) as e1:
        config(tmp_path, disk_blocks=0, enable_remote=True, remote_cache_url=url)
    with pytest.raises(RemoteConfigError) as e2:
        parse_url(url)
    assert "topsecret" not in str(e1.value) and "topsecret" not in str(e2.value)


def test_database_out_of_range_is_not_reported_as_a_password_problem(tmp_path, redis_server):
    with pytest.raises(RemoteError) as e:
        manager(tmp_path, redis_server.url + "/99")
    assert not isinstance(e.value, RemoteAuthError)
    assert "password" not in str(e.value) and "99" in str(e.value)


def test_remote_config_refuses_an_infinite_timeout(redis_server):
    with pytest.raises(RemoteConfigError, match="timeout_s"):
        RemoteStore(RemoteConfig(url=redis_server.url, timeout_s=float("inf")), 1).close()


def test_cache_config_refuses_an_infinite_timeout(tmp_path):
    with pytest.raises(ConfigError, match="remote_timeout_s"):
        config(
            tmp_path,
            disk_blocks=0,
            enable_remote=True,
            remote_cache_url="redis://127.0.0.1:1",
            remote_timeout_s=float("inf"),
        )


def test_out_of_range_sequence_hash_is_refused_not_aliased(redis_server):
    st = RemoteStore(RemoteConfig(url=redis_server.url), 9)
    try:
        try:
            st.put([2**64], [bytearray(b"A" * 64)])
        except (ValueError, OverflowError):
            pass
        dest = [bytearray(64)]
        assert st.get_into([0], dest) == 0, "hash 2**64's bytes were served for hash 0"
    finally:
        st.close()


def test_a_string_is_not_a_list_of_hashes(redis_server):
    st = RemoteStore(RemoteConfig(url=redis_server.url), 9)
    try:
        st.put([1, 2, 3], [bytearray(64)] * 3)
        with pytest.raises(TypeError):
            st.exists_prefix("123")
    finally:
        st.close()


# ---------------------------------------------------------------- doctor and serve


def _doctor(env_url: str):
    import subprocess
    import sys

    env = dict(os.environ, FLEXKV_ENABLE_REMOTE="true", FLEXKV_REMOTE_CACHE_URL=env_url)
    exe = os.path.join(os.path.dirname(sys.executable), "dynamo-flexkv")
    return subprocess.run([exe, "doctor"], env=env, capture_output=True, text=True, timeout=120)


def test_doctor_reports_a_bad_remote_url_without_traceback_or_password():
    out = _doctor("redis://:abc/topsecret@127.0.0.1:1")
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "topsecret" not in text and "remote_cache_url" in text


def test_doctor_reports_an_unreachable_remote_with_the_password_redacted():
    out = _doctor("redis://:abc%2Ftopsecret@127.0.0.1:1")
    text = out.stdout + out.stderr
    assert "cannot connect" in text and "topsecret" not in text and "Traceback" not in text


def test_serve_refuses_a_wrong_password_without_echoing_it(tmp_path):
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    from served import make_plan

    from dynamo_flexkv.serve import GraphError

    with RedisServer(maxmemory="16mb", password="TopS3cretPW") as s:
        with pytest.raises(GraphError, match="refused the credentials") as e:
            make_plan(
                tmp_path,
                "agg_router",
                *REMOTE,
                f"FlexKVWorker.cache.remote_cache_url=redis://:wrongpw-XYZ@127.0.0.1:{s.port}",
            )
        assert "wrongpw-XYZ" not in str(e.value) and "TopS3cretPW" not in str(e.value)
