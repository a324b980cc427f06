"""The processes a graph needs beside its components: etcd, NATS or the ZMQ event broker for the
planes, and a local redis-server for the remote tier; each on loopback, each binary checked."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.remote.config import DEFAULT_PASSWORD_ENV
from dynamo_flexkv.core.sysutil import find_binary
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV
from dynamo_flexkv.serve.graph import GraphError
from dynamo_flexkv.serve.logs import COMPONENT_LOG_ENV
from dynamo_flexkv.serve.ports import LOOPBACK, PortBook
from dynamo_flexkv.serve.process import Process
from dynamo_flexkv.serve.redis_server import local_redis_settings, redis_conf


def use_local_redis(redis: dict[str, Any], ports: PortBook, values: dict[str, Any], penv: dict[str, str]) -> None:
    """Points a worker at the graph's own redis-server (one for every worker: they share remote
    blocks). Its password is generated and reaches workers by environment only, never a file
    they log or a command line."""
    if not redis:
        redis.update(port=ports.take(0, "redis", "", any_port=True), password=secrets.token_hex(16))
    values["remote_cache_url"] = f"redis://{LOOPBACK}:{redis['port']}"
    env_var = values.get("remote_password_env") or DEFAULT_PASSWORD_ENV
    penv[env_var] = redis["password"]


def redis_process(run_dir: Path, redis: dict[str, Any], maxmemory: str = "1gb") -> Process:
    """redis-server for the graph: loopback, no persistence, allkeys-lru within maxmemory; the
    password sits in a 0600 config file (not on the command line, where ps would show it)."""
    exe = need_binary("redis-server", "redis-server")
    conf = run_dir / "redis" / "redis.conf"
    text = redis_conf(
        local_redis_settings(redis["port"], str(run_dir / "redis"), maxmemory, password=redis["password"])
    )
    return Process("redis", [exe, str(conf)], {}, None, redis["port"], files={str(conf): text})


def check_remote_reachable(cache: CacheConfig, where: str) -> None:
    """serve refuses to start workers against a Redis it cannot reach or log in to."""
    from dynamo_flexkv.core.remote import RemoteError, RemoteStore

    try:
        RemoteStore(cache.remote_config(), 0, strict=True).close()
    except RemoteError as e:
        raise GraphError(f"{where}: {e}") from None


def infra_processes(run_dir: Path, discovery: str, event_plane: str, ports: PortBook):
    """etcd and NATS for the non-default planes, on loopback, unless the environment names servers."""
    # The model directory is local: never download. Logs in plain text (serve.logs).
    env = dict(LOOPBACK_ENV, HF_HUB_OFFLINE="1", **COMPONENT_LOG_ENV)
    if discovery == "file":
        env["DYN_FILE_KV"] = str(run_dir / "discovery")
    procs = []
    if discovery == "etcd" and not os.environ.get("ETCD_ENDPOINTS"):
        exe = need_binary("etcd", "etcd-server")
        client, peer = ports.take(0, "etcd", "", any_port=True), ports.take(0, "etcd peer", "", any_port=True)
        procs.append(Process("etcd", etcd_argv(exe, "flexkv", str(run_dir / "etcd"), client, peer), {}, None, client))
        env["ETCD_ENDPOINTS"] = f"http://{LOOPBACK}:{client}"
    if event_plane == "zmq" and not os.environ.get("DYN_ZMQ_BROKER_URL"):
        xsub, xpub = (f"tcp://{LOOPBACK}:{ports.take(0, 'zmq broker', '', any_port=True)}" for _ in range(2))
        procs.append(
            Process(
                "zmq-broker",
                [sys.executable, "-m", "dynamo_flexkv.serve.zmq_broker", xsub, xpub],
                {},
                None,
                int(xpub.rsplit(":", 1)[1]),
            )
        )
        env["DYN_ZMQ_BROKER_URL"] = f"xsub={xsub} , xpub={xpub}"
    if event_plane == "nats" and not os.environ.get("NATS_SERVER"):
        exe = need_binary("nats-server", "nats-server")
        port = ports.take(0, "nats", "", any_port=True)
        procs.append(
            Process("nats", [exe, "-a", LOOPBACK, "-p", str(port), "-js", "-sd", str(run_dir / "nats")], {}, None, port)
        )
        env["NATS_SERVER"] = f"nats://{LOOPBACK}:{port}"
    return procs, env


def etcd_argv(exe: str, name: str, data_dir: str, client: int, peer: int) -> list[str]:
    """A single-node etcd on loopback: clients on ``client``, its peer URL on ``peer``."""
    url, purl = f"http://{LOOPBACK}:{client}", f"http://{LOOPBACK}:{peer}"
    return [
        exe,
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        purl,
        "--initial-advertise-peer-urls",
        purl,
        "--initial-cluster",
        f"{name}={purl}",
    ]


def need_binary(exe: str, package: str) -> str:
    path = find_binary(exe)
    if path is None:
        raise GraphError(
            f"{exe} is not installed: `apt-get install {package}` (scripts/install.sh does), "
            f"or point {'ETCD_ENDPOINTS' if exe == 'etcd' else 'NATS_SERVER'} at a running server"
        )
    return path
