"""The remote tier in a served graph: the agg_router graph's two workers share one Redis (the one
`serve` starts, or a three-node Redis Cluster given by URL). A prompt served by one worker is
served again, after that worker lost its local tiers (killed and restarted without a disk tier),
with its prefix loaded from Redis -- by a process that never computed it -- and identical tokens."""

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

from redis_fixtures import needs_redis
from remote_helpers import REMOTE
from served import (
    complete,
    make_plan,
    metric,
    wait_until,
)

from dynamo_flexkv.serve import GraphError
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.redis_server import RedisCluster, free_port

pytestmark = needs_redis


def _served_from_remote(tmp_path, *overrides):
    plan = make_plan(tmp_path, "agg_router", *REMOTE, *overrides)
    launcher = Launcher(plan)
    try:
        launcher.start()
        launcher.wait_ready(120)
        prompt = "a long prompt whose prefix lives in the shared remote tier. " * 12
        before = {w.name: metric(w.port, "flexkv_requests_total") for w in plan.workers}
        first = complete(plan, prompt, 8)
        (holder,) = [w for w in plan.workers if metric(w.port, "flexkv_requests_total") > before[w.name]]
        wait_until(
            "the prefix written behind to Redis", lambda: metric(holder.port, "flexkv_remote_stored_blocks_total") > 0
        )
        # The holder loses its local tiers: killed, restarted by the launcher, empty host, no disk.
        pid = launcher.running[holder.name].pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while launcher.restarts.get(holder.name) != 1 or holder.name in launcher.starting:
            launcher.step()
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            time.sleep(0.2)
        launcher.wait_ready(120)
        again = complete(plan, prompt, 8)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
        hits = sum(metric(w.port, "flexkv_remote_hit_blocks_total") for w in plan.workers)
        assert hits > 0  # loaded from Redis by a process that never computed the prompt
        assert sum(metric(w.port, "flexkv_prompt_tokens_cached_total", tier="remote") for w in plan.workers) > 0
        for w in plan.workers:
            assert metric(w.port, "flexkv_remote_bad_values_total", reason="corrupt") == 0
    finally:
        launcher.shutdown()
    return plan


@pytest.mark.slow  # about a minute: two workers, a kill and a restart
@pytest.mark.served
def test_serve_starts_a_redis_and_a_restarted_worker_loads_from_it(tmp_path):
    plan = _served_from_remote(tmp_path)
    redis = next(p for p in plan.infra if p.name == "redis")
    conf = next(iter(redis.files))
    assert oct(os.stat(conf).st_mode & 0o777) == "0o600"
    password = next(w.env["FLEXKV_REMOTE_PASSWORD"] for w in plan.workers)
    assert all(password not in " ".join(p.argv) for p in plan.infra + plan.processes)
    for w in plan.workers:
        assert password not in next(iter(w.files.values()))
    # Every file the run wrote (logs, discovery, model directory, cache YAMLs): the redis password
    # only in 0600 redis.conf, the handover secret nowhere.
    handover = next(w.env["FLEXKV_HANDOVER_SECRET"] for w in plan.workers)
    files = _run_files(plan.run_dir)
    assert any(p.name.endswith(".log") for p in files) and len(files) > 5
    assert [p for p, (mode, data) in files.items() if password.encode() in data] == [Path(conf)]
    assert not [p for p, (_, data) in files.items() if handover.encode() in data]


@pytest.mark.slow
@pytest.mark.served
def test_a_redis_cluster_given_by_url_serves_the_same(tmp_path):
    with RedisCluster(nodes=3, maxmemory="64mb") as cluster:
        _served_from_remote(tmp_path, f"FlexKVWorker.cache.remote_cache_url={cluster.url}")


@pytest.mark.unit
def test_serve_refuses_an_unreachable_redis(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(GraphError, match="cannot connect to redis at 127.0.0.1"):
        make_plan(tmp_path, "agg_router", *REMOTE, f"FlexKVWorker.cache.remote_cache_url={url}")


@pytest.mark.unit
def test_render_k8s_takes_the_redis_url_from_a_secret(tmp_path):
    import yaml

    from dynamo_flexkv.serve.render import render_k8s

    plan = make_plan(tmp_path, "agg_router", *REMOTE, local=False)
    text = render_k8s(plan, "example/flexkv:latest")
    assert "kubectl create secret generic flexkv-agg-router-redis" in text
    worker = yaml.safe_load(text)["spec"]["services"]["FlexKVWorker"]
    env = {e["name"]: e for e in worker["envs"]}
    assert env["FLEXKV_ENABLE_REMOTE"]["value"] == "True"
    assert env["FLEXKV_REMOTE_CACHE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "flexkv-agg-router-redis",
        "key": "url",
    }
    assert "redis-from-secret" not in text


PASSWORD = "S3cret/p@ss:w0rd%"  # needs percent-encoding in a URL


def _run_files(run_dir):
    return {p: (p.stat().st_mode & 0o777, p.read_bytes()) for p in run_dir.rglob("*") if p.is_file()}


def test_a_password_in_the_url_reaches_the_workers_by_environment_never_in_a_file(tmp_path, monkeypatch):
    """serve writes each worker's cache YAML without the URL's password (the worker gets it in the
    variable remote_password_env names, as the handover secret reaches it); every file it writes is
    0600 from the start (a 0644 file left by an earlier run included); render --k8s inlines neither."""
    import importlib.util
    from urllib.parse import quote

    import yaml

    from dynamo_flexkv.core.config import CacheConfig
    from dynamo_flexkv.core.remote import RemoteStore
    from dynamo_flexkv.core.remote.config import DEFAULT_PASSWORD_ENV
    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV
    from dynamo_flexkv.serve.launcher import write_files
    from dynamo_flexkv.serve.redis_server import RedisServer
    from dynamo_flexkv.serve.render import render_k8s

    encoded = quote(PASSWORD, safe="")
    with RedisServer(maxmemory="16mb", password=PASSWORD) as s:
        url = f"redis://default:{encoded}@127.0.0.1:{s.port}/0"
        plan = make_plan(tmp_path, "agg_router", *REMOTE, f"FlexKVWorker.cache.remote_cache_url={url}")
        plan.run_dir.mkdir(parents=True)
        stale = plan.workers[0].env["FLEXKV_CONFIG_PATH"]
        with open(stale, "w") as f:  # an earlier run's file, world-readable
            f.write("old: true\n")
        os.chmod(stale, 0o644)
        for w in plan.workers:
            write_files(w)
            cfg = w.env["FLEXKV_CONFIG_PATH"]
            assert yaml.safe_load(open(cfg))["remote_cache_url"] == f"redis://default@127.0.0.1:{s.port}/0"
            assert w.env[DEFAULT_PASSWORD_ENV] == PASSWORD
            monkeypatch.setenv(DEFAULT_PASSWORD_ENV, w.env[DEFAULT_PASSWORD_ENV])  # as the launcher passes it
            RemoteStore(CacheConfig.load(cfg, env={}).remote_config(), 0, strict=True).close()  # logs in
            monkeypatch.delenv(DEFAULT_PASSWORD_ENV)
        own = make_plan(
            tmp_path,
            "agg_router",
            *REMOTE,
            f"FlexKVWorker.cache.remote_cache_url={url}",
            "FlexKVWorker.cache.remote_password_env=MY_REDIS_PW",
        )
        assert all(w.env["MY_REDIS_PW"] == PASSWORD and DEFAULT_PASSWORD_ENV not in w.env for w in own.workers)
        if importlib.util.find_spec("vllm") is not None:  # vLLM workers' cache YAML: the same
            from served import vplan

            v = vplan(
                tmp_path / "vllm", "VllmWorker.cache.enable_remote=true", f"VllmWorker.cache.remote_cache_url={url}"
            )
            for w in v.workers:
                assert w.env[DEFAULT_PASSWORD_ENV] == PASSWORD
                cache = yaml.safe_load(w.files[w.env["FLEXKV_CONFIG_PATH"]])
                assert cache["remote_cache_url"] == f"redis://default@127.0.0.1:{s.port}/0"
    files = _run_files(plan.run_dir)
    assert len(files) == 2 and all(mode == 0o600 for mode, _ in files.values()), files
    secrets = [PASSWORD, encoded] + [w.env[SECRET_ENV] for w in plan.workers]  # and the handover secret
    assert not [(p, x) for p, (_, data) in files.items() for x in secrets if x.encode() in data]
    assert not [x for x in secrets if x in repr(plan)]  # a plan printed in a traceback or a log

    # render --k8s: the URL from a Secret when the tier is on; no password inlined even when it is off.
    for on in ("true", "false"):
        text = render_k8s(
            make_plan(
                tmp_path,
                "agg_router",
                *REMOTE,
                f"FlexKVWorker.cache.enable_remote={on}",
                f"FlexKVWorker.cache.remote_cache_url={url}",
                local=False,
            ),
            "img",
        )
        assert PASSWORD not in text and encoded not in text
        env = {e["name"]: e for e in yaml.safe_load(text)["spec"]["services"]["FlexKVWorker"]["envs"]}
        assert ("valueFrom" in env["FLEXKV_REMOTE_CACHE_URL"]) == (on == "true")
