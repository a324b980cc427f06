"""The remote tier behind KVManager, against real redis-server processes: a manager that never saw
a prompt loads its exact bytes from Redis; every fault ends in exact bytes or a clean recompute,
with no slot, lock or task left behind."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from kv_helpers import TPB, config, holds
from redis_fixtures import needs_redis, redis_cluster, redis_server  # noqa: F401 (fixtures)
from remote_helpers import DEVICE_BLOCKS, LAYOUT, Engine, check_clean, manager, prompt_of

from dynamo_flexkv import KVManager, TaskStatus
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.remote import RemoteAuthError, RemoteUnavailableError
from dynamo_flexkv.core.remote.resp import RespConnection
from dynamo_flexkv.serve.redis_server import RedisServer, free_port

pytestmark = needs_redis


@pytest.mark.parametrize("layerwise", [False, True])
def test_second_manager_loads_exact_bytes_from_remote(tmp_path, redis_server, layerwise):
    """Bulk: one GET per block. Layerwise: one GETRANGE per block and layer span, chained, the
    last span verifying whole blocks."""
    rng = np.random.default_rng(1)
    p = prompt_of(rng, 10)
    with manager(tmp_path / "a", redis_server.url) as kv0, manager(tmp_path / "b", redis_server.url) as kv1:
        e0, e1 = Engine(kv0, 0), Engine(kv1, 1)
        e0.put(p)
        assert kv0.stats().remote.puts == 10
        assert kv1.match(p) == {"host": 0, "remote": 10 * TPB}
        r, planned = e1.get(p, layerwise=layerwise)  # kv1 never saw the prompt
        assert r.num_tokens == 10 * TPB and planned == {"host": 0, "disk": 0, "remote": 10 * TPB}
        s = kv1.stats()
        assert s.remote.hits == 10 and s.remote.bytes_read == 10 * kv1.host.layout.block_bytes
        conn, _ = _keys(redis_server)
        try:
            ranges = conn.call(b"INFO", b"commandstats").decode().count("cmdstat_getrange:")
        finally:
            conn.close()
        assert ranges == (1 if layerwise else 0)
        # Now on kv1's host tier: the next get reads host only.
        r, planned = e1.get(p)
        assert planned == {"host": 10 * TPB, "disk": 0, "remote": 0}
        # A longer prompt sharing the prefix: host part + remote part + recomputed tail.
        longer = p[: 10 * TPB] + prompt_of(rng, 4)
        e0.put(longer)
        r, planned = e1.get(longer, layerwise=layerwise)
        assert planned == {"host": 10 * TPB, "disk": 0, "remote": 4 * TPB}
        # A different namespace is a different fingerprint: nothing to load.
        for kv in (kv0, kv1):
            check_clean(kv)
    with manager(tmp_path / "c", redis_server.url, namespace="other") as kv2:
        assert kv2.match(p) == {"host": 0, "remote": 0}


def test_a_get_that_skips_device_held_blocks_still_loads_the_rest_from_remote(tmp_path, redis_server):
    rng = np.random.default_rng(8)
    p = prompt_of(rng, 8)
    with manager(tmp_path / "a", redis_server.url) as kv0, manager(tmp_path / "b", redis_server.url) as kv1:
        Engine(kv0).put(p)
        e1 = Engine(kv1, 1)
        h = kv1.hashes(p).sequence
        ids = e1.rng.choice(DEVICE_BLOCKS, size=len(h), replace=False)
        t = kv1.get_async(p, ids, skip_blocks=3)  # the engine's device holds blocks 0-2
        assert kv1.planned_tokens_by_tier(t) == {"host": 0, "disk": 0, "remote": 5 * TPB}
        r = kv1.wait([t], timeout=30)[t]
        assert r.ok and r.num_tokens == 5 * TPB
        assert all(holds(e1.dev, LAYOUT, int(ids[i]), int(h[i])) for i in range(3, 8))
        assert kv1.match(p)["host"] == 8 * TPB  # host stays prefix-closed: blocks 0-2 came along
        check_clean(kv1)


def test_prefetch_brings_remote_blocks_to_host(tmp_path, redis_server):
    rng = np.random.default_rng(2)
    p = prompt_of(rng, 6)
    with manager(tmp_path / "a", redis_server.url) as kv0, manager(tmp_path / "b", redis_server.url) as kv1:
        Engine(kv0).put(p)
        e1 = Engine(kv1, 3)
        t = kv1.prefetch_async(p)
        r = kv1.wait([t], timeout=30)[t]
        assert r.ok and r.num_tokens == 6 * TPB
        assert kv1.match(p)["host"] == 6 * TPB
        r, planned = e1.get(p)
        assert planned["host"] == 6 * TPB
        check_clean(kv1)


@pytest.mark.parametrize("layerwise", [False, True])
def test_cluster_round_trip(tmp_path, redis_cluster, layerwise):
    rng = np.random.default_rng(3)
    p = prompt_of(rng, 12)
    with manager(tmp_path / "a", redis_cluster.url) as kv0, manager(tmp_path / "b", redis_cluster.url) as kv1:
        Engine(kv0).put(p)
        r, planned = Engine(kv1, 1).get(p, layerwise=layerwise)
        assert planned["remote"] == 12 * TPB and r.num_tokens == 12 * TPB
        check_clean(kv0)
        check_clean(kv1)


def test_startup_errors_name_the_fix(tmp_path):
    port = free_port()
    with pytest.raises(RemoteUnavailableError, match="127.0.0.1"):
        manager(tmp_path, f"redis://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="remote_cache_url"):
        config(tmp_path, disk_blocks=0, enable_remote=True)
    with RedisServer(maxmemory="16mb", password="right-pass") as server:
        with pytest.raises(RemoteAuthError) as e:
            manager(tmp_path, server.url)
        assert "right-pass" not in str(e.value)
        with pytest.raises(RemoteAuthError) as e:
            manager(tmp_path, f"redis://:wrong-pass@127.0.0.1:{server.port}")
        assert "wrong-pass" not in str(e.value)
        with manager(tmp_path, f"redis://:right-pass@127.0.0.1:{server.port}") as kv:
            assert "right-pass" not in repr(kv.config) and "right-pass" not in str(kv.stats())


def test_worker_without_redis_keeps_serving_locally(tmp_path):
    """remote_required=false: Redis down at start, the worker serves from host; when Redis comes
    up on that port, the tier reconnects after the breaker's cool-down."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    rng = np.random.default_rng(4)
    p = prompt_of(rng, 4)
    with manager(tmp_path, url, remote_required=False) as kv:
        e = Engine(kv)
        e.put(p)
        r, planned = e.get(p)
        assert planned == {"host": 4 * TPB, "disk": 0, "remote": 0}
        assert kv.stats().remote.breaker_state == "open"
        check_clean(kv)


def test_redis_killed_and_restarted_mid_run(tmp_path):
    rng = np.random.default_rng(5)
    server = RedisServer(maxmemory="32mb").start()
    try:
        with manager(tmp_path / "a", server.url) as kv0, manager(tmp_path / "b", server.url) as kv1:
            e0, e1 = Engine(kv0), Engine(kv1, 1)
            p = prompt_of(rng, 6)
            e0.put(p)
            server.kill()
            t0 = time.monotonic()
            r, planned = e1.get(p, expect_status=TaskStatus.NOT_FOUND)  # probe fails fast: recompute
            q = prompt_of(rng, 5)
            e0.put(q)  # the write-behind fails, counted; host keeps the blocks
            r, planned = e0.get(q)
            assert planned["host"] == 5 * TPB
            for _ in range(6):  # the breaker opens and stops touching the dead server
                kv1.match(p)
            assert time.monotonic() - t0 < 20
            s = kv1.stats().remote
            assert s.breaker_opened >= 1 and s.breaker_refused >= 1
            check_clean(kv0)
            check_clean(kv1)
            # Back on the same port (empty: no persistence): after the cool-down the tier works again.
            server = RedisServer(maxmemory="32mb", port=server.port).start()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                fresh = prompt_of(rng, 3)
                e0.put(fresh)
                if kv1.match(fresh)["remote"] == 3 * TPB:
                    break
                time.sleep(0.5)
            r, planned = e1.get(fresh)
            assert planned["remote"] == 3 * TPB
            check_clean(kv0)
            check_clean(kv1)
    finally:
        server.cleanup()


def _keys(server, pattern=b"*"):
    conn = RespConnection("127.0.0.1", server.port, timeout_s=2, connect_timeout_s=1)
    try:
        return conn, sorted(conn.call(b"KEYS", pattern))
    except BaseException:
        conn.close()
        raise


@pytest.mark.parametrize(
    "fault,layerwise",
    [(f, False) for f in ("evicted", "corrupt", "truncated", "wrong_block", "foreign")]
    + [(f, True) for f in ("evicted", "evicted_mid", "corrupt", "truncated", "wrong_block")],
)
def test_bad_value_ends_the_prefix_and_the_get_recomputes(tmp_path, redis_server, fault, layerwise, caplog):
    """A value evicted between lookup and read (layerwise: also between two layer spans), corrupt,
    truncated, or of another model: the get fails cleanly (the engine recomputes), blocks verified
    before it stay on host (whole: every layer), nothing leaks. A bad value (not an evicted one) is
    deleted, in one WARNING line that names its key and why."""
    import logging

    caplog.set_level(logging.WARNING, logger="dynamo_flexkv.core.remote.store")
    rng = np.random.default_rng(6)
    p = prompt_of(rng, 8)
    with manager(tmp_path / "a", redis_server.url) as kv0, manager(tmp_path / "b", redis_server.url) as kv1:
        e0, e1 = Engine(kv0), Engine(kv1, 1)
        e0.put(p)
        seq = kv1.hashes(p).sequence
        key = kv1.remote.key(int(seq[5]))
        conn = RespConnection("127.0.0.1", redis_server.port, timeout_s=2, connect_timeout_s=1)
        try:
            if fault == "corrupt":
                value = bytearray(conn.call(b"GET", key))
                value[100] ^= 0xFF
                conn.call(b"SET", key, bytes(value))
            elif fault == "truncated":
                conn.call(b"SET", key, conn.call(b"GET", key)[:-7])
            elif fault == "wrong_block":  # this model's value of another block
                other = kv1.remote.key(int(seq[2]))
                conn.call(b"SET", key, conn.call(b"GET", other))
            elif fault == "foreign":  # a value written by another namespace (another fingerprint)
                with manager(tmp_path / "c", redis_server.url, namespace="other") as kv2:
                    Engine(kv2, 2).put(p)
                    seq2 = kv2.hashes(p).sequence
                    conn.call(b"SET", key, conn.call(b"GET", kv2.remote.key(int(seq2[5]))))
            store = kv1.remote
            real_get, real_range = store.get_into, store.get_range_into

            def evicting_get(hashes, dests, parents=None, **kw):
                if fault == "evicted":  # Redis evicts the key between the probe and the read
                    conn.call(b"DEL", key)
                return real_get(hashes, dests, parents, **kw)

            def evicting_range(hashes, dests, offset, block_bytes, parents=None, **kw):
                if (fault == "evicted" and offset == 0) or (fault == "evicted_mid" and offset > 0):
                    conn.call(b"DEL", key)  # before the first span, or after it landed
                return real_range(hashes, dests, offset, block_bytes, parents, **kw)

            store.get_into, store.get_range_into = evicting_get, evicting_range
            assert kv1.match(p)["remote"] == 8 * TPB or fault.startswith("evicted")
            r, _ = e1.get(p, expect_status=TaskStatus.FAILED, layerwise=layerwise)
            assert "remote tier verified 5 of 8" in r.error
            store.get_into, store.get_range_into = real_get, real_range
            dropped = [rec.getMessage() for rec in caplog.records if "bad value" in rec.getMessage()]
            if fault.startswith("evicted"):
                assert dropped == []
            else:
                reason = {
                    "corrupt": "corrupt: payload checksum mismatch",
                    "truncated": "truncated: wrong size",
                    "wrong_block": "corrupt: bad header: it is block",
                    "foreign": "foreign: written under fingerprint",
                }[fault]
                assert len(dropped) == 1 and f"deleted bad value {key.decode()} ({reason}" in dropped[0], dropped
                assert conn.call(b"EXISTS", key) == 0
        finally:
            conn.close()
        check_clean(kv1)
        assert kv1.match(p)["host"] == 5 * TPB  # the verified blocks stayed
        s = kv1.stats().remote
        assert s.short_reads == 1 and s.hits == 5
        assert (
            getattr(
                s,
                {
                    "evicted": "misses",
                    "evicted_mid": "misses",
                    "corrupt": "corrupt",
                    "truncated": "truncated",
                    "wrong_block": "corrupt",
                    "foreign": "foreign",
                }[fault],
            )
            == 1
        )
        r, planned = e1.get(p)  # the next get loads the 5 verified blocks from host, exactly
        assert planned == {"host": 5 * TPB, "disk": 0, "remote": 0}


def test_full_redis_refuses_writes_and_nothing_else_breaks(tmp_path):
    rng = np.random.default_rng(7)
    with (
        RedisServer(maxmemory="2mb", policy="noeviction") as server,
        manager(tmp_path / "a", server.url, host_blocks=256) as kv0,
    ):
        e0 = Engine(kv0)
        prompts = [prompt_of(rng, 8) for _ in range(20)]  # 20 x 8 x 24 KiB = 3.8 MB > 2 MB
        for p in prompts:
            e0.put(p)
        s = kv0.stats().remote
        assert s.put_refused > 0 and s.puts > 0 and s.breaker_state == "closed"
        for p in prompts[:3]:
            r, planned = e0.get(p)
            assert planned["host"] == 8 * TPB
        check_clean(kv0)


def test_doctor_reports_the_remote_tier(tmp_path, redis_server):
    from dynamo_flexkv.doctor import Status, check_remote

    ok = check_remote(config(tmp_path, disk_blocks=0, enable_remote=True, remote_cache_url=redis_server.url))
    assert ok.status is Status.OK and redis_server.url in ok.detail
    down = f"redis://:pw@127.0.0.1:{free_port()}"
    bad = check_remote(config(tmp_path, disk_blocks=0, enable_remote=True, remote_cache_url=down))
    assert bad.status is Status.MISSING and "pw@" not in bad.detail and "cannot connect" in bad.detail
    assert check_remote(config(tmp_path, disk_blocks=0)).detail.startswith("disabled")
    with RedisServer(maxmemory="16mb", policy="noeviction") as full:
        warn = check_remote(config(tmp_path, disk_blocks=0, enable_remote=True, remote_cache_url=full.url))
        assert warn.status is Status.FALLBACK and "allkeys-lru" in warn.detail


@pytest.mark.parametrize(
    "env, words",
    [
        (
            {"FLEXKV_ENABLE_REMOTE": "true", "FLEXKV_REMOTE_CACHE_URL": "redis://:p@ss/w0rd@127.0.0.1:1"},
            "percent-encoded",
        ),
        ({"FLEXKV_TOKENS_PER_BLOCK": "3"}, "tokens_per_block=3"),
        ({"FLEXKV_CPU_CACHE_GB": "abc"}, "cpu_cache_gb='abc' in environment variable FLEXKV_CPU_CACHE_GB is invalid"),
    ],
)
def test_doctor_reports_an_invalid_config_as_a_failed_check(tmp_path, monkeypatch, capsys, env, words):
    """A bad config key is the "config" check (invalid, with the ConfigError's message, which names
    the variable) and the remote check says it was not run: no exception, exit status 1, no password."""
    import dynamo_flexkv.doctor as doctor

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(doctor, "check_nixl", lambda: [])  # its child process is not what is tested
    assert doctor.main([str(tmp_path)], as_json=True) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["config"]["status"] == "invalid" and words in checks["config"]["detail"]
    assert checks["remote tier (Redis)"]["status"] == "invalid"
    assert "w0rd" not in json.dumps(checks) and "p@ss" not in json.dumps(checks)


def test_doctor_never_shows_a_password_a_library_echoed():
    from dynamo_flexkv.doctor import _scrub

    assert (
        _scrub("error at redis://u:s3cret@h:1/0, see rediss://:a@b@h2")
        == "error at redis://***@h:1/0, see rediss://***@h2"
    )
    assert _scrub("remote_cache_url 'redis://***@h:1': @ is %40") == "remote_cache_url 'redis://***@h:1': @ is %40"


def test_redis_stalled_mid_read_fails_the_get_within_the_timeout(tmp_path, redis_server):
    """The server freezes (SIGSTOP) between the lookup and the read: the read gives up after
    remote_timeout_s, the get fails cleanly (recompute), nothing leaks; once the server runs again
    the next get loads from it."""
    import os
    import signal

    rng = np.random.default_rng(9)
    p = prompt_of(rng, 6)
    with manager(tmp_path / "a", redis_server.url) as kv0, manager(tmp_path / "b", redis_server.url) as kv1:
        Engine(kv0).put(p)
        e1 = Engine(kv1, 1)
        store, real_get = kv1.remote, kv1.remote.get_into

        def stalled_get(hashes, dests, parents=None, **kw):
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            return real_get(hashes, dests, parents, **kw)

        store.get_into = stalled_get
        t0 = time.monotonic()
        try:
            r, _ = e1.get(p, expect_status=TaskStatus.FAILED)
        finally:
            store.get_into = real_get
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert time.monotonic() - t0 < 10  # remote_timeout_s = 1 bounds each socket wait
        assert kv1.stats().remote.op_errors >= 1
        check_clean(kv1)
        r, planned = e1.get(p)
        assert planned["remote"] == 6 * TPB
        check_clean(kv1)


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "bulk"])
def test_engine_reports_remote_cached_tokens_and_same_tokens(tmp_path, redis_server, layerwise):
    """The reference engine on a manager whose own tiers are empty: the prefix comes from Redis,
    the tokens equal a recompute's, and the response names the tier it came from."""
    from dynamo_flexkv.core.config import CacheConfig
    from dynamo_flexkv.core.offload import EmbeddedOffload
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

    cfg = EngineModelConfig.preset("tiny")
    cache = CacheConfig.from_dict(
        dict(tokens_per_block=cfg.block_size, cpu_cache_gb=0.01, enable_remote=True, remote_cache_url=redis_server.url)
    )
    prompt = np.random.default_rng(9).integers(0, cfg.vocab_size, 6 * cfg.block_size + 3).tolist()
    params = SamplingParams(max_tokens=3)
    model = LLMEngine(cfg, num_device_blocks=64).model
    want = LLMEngine(cfg, num_device_blocks=64, model=model).generate([prompt], params)[0].output
    with KVManager(cfg.kv_spec(), cache) as writer, KVManager(cfg.kv_spec(), cache) as reader:
        e = LLMEngine(cfg, num_device_blocks=64, model=model, offload=EmbeddedOffload(writer))
        e.generate([prompt], params)
        e.flush()
        assert writer.drain(30) and writer.stats().remote.puts == 6
        e = LLMEngine(
            cfg, num_device_blocks=64, model=model, offload=EmbeddedOffload(reader, layerwise), offload_puts=False
        )
        r = e.generate([prompt], params)[0]
        e.flush()
        assert r.output == want
        assert r.cached_tokens == {"device": 0, "host": 0, "disk": 0, "remote": 6 * cfg.block_size}
        assert reader.stats().remote.hits == 6
        check_clean(reader)


def test_tensor_parallel_ranks_key_their_own_shards(tmp_path, redis_server):
    """Each TP rank holds another shard of the same prompt's KV: ranks share nothing in Redis, the
    same rank of another worker finds its blocks."""
    p = prompt_of(np.random.default_rng(10), 4)
    with (
        manager(tmp_path / "a", redis_server.url, tp_rank=0, tp_size=2) as r0,
        manager(tmp_path / "b", redis_server.url, tp_rank=1, tp_size=2) as r1,
        manager(tmp_path / "c", redis_server.url, tp_rank=1, tp_size=2) as r1b,
    ):
        Engine(r0).put(p)
        assert r1.match(p)["remote"] == 0  # rank 1 must not load rank 0's shard
        Engine(r1, 1).put(p)
        assert r1b.match(p)["remote"] == 4 * TPB
        assert len({kv.remote.fingerprint for kv in (r0, r1)}) == 2 and r1.remote.fingerprint == r1b.remote.fingerprint
        for kv in (r0, r1, r1b):
            check_clean(kv)
    with pytest.raises(ConfigError, match="tp_rank=2 with tp_size=2"):
        config(tmp_path / "d", host_blocks=8, disk_blocks=0, tp_rank=2, tp_size=2)


def test_every_remote_failure_counter_reaches_metrics():
    """Each of RemoteStats' failure counters is a /metrics family, with its value."""
    from dynamo_flexkv.core.stats import RemoteTierStats
    from dynamo_flexkv.integrations.dynamo_worker.metrics import _remote_families

    stats = RemoteTierStats(put_failed=7, op_errors=3, put_refused=2)  # as KVManager.stats().remote
    values = {m.name: m.samples[0].value for m in _remote_families(stats) if len(m.samples) == 1}
    assert values["flexkv_remote_put_failed"] == 7
    assert values["flexkv_remote_op_errors"] == 3
    assert values["flexkv_remote_put_refused"] == 2
