"""Local redis-server processes for tests and benchmarks (loopback only, no persistence)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo_flexkv.core.procgroup import stop_process
from dynamo_flexkv.core.sysutil import free_port, require_binary

__all__ = [
    "RedisCluster",
    "RedisServer",
    "free_port",
    "local_redis_settings",
    "redis_args",
    "redis_conf",
    "require_binary",
]


def local_redis_settings(
    port: int,
    workdir: str,
    maxmemory: str,
    policy: str = "allkeys-lru",
    password: str | None = None,
    host: str = "127.0.0.1",
) -> list[tuple[str, str]]:
    """The one definition of a local redis-server, for RedisServer's command line (tests, benches)
    and serve's redis.conf: loopback only, protected mode, no persistence (no RDB snapshot, no
    AOF), evicting by ``policy`` within ``maxmemory``. ``host``: a node's own address (serve.nodes)."""
    # Protected mode refuses every client but loopback's when there is no password: a server on a
    # node's address (reachable only on the nodes' own bridge) serves the other nodes without it.
    protected = "yes" if host == "127.0.0.1" or password else "no"
    out = [
        ("bind", host),
        ("port", str(port)),
        ("protected-mode", protected),
        ("save", ""),
        ("appendonly", "no"),
        ("dir", workdir),
        ("maxmemory", maxmemory),
        ("maxmemory-policy", policy),
    ]
    if password:
        out.append(("requirepass", password))
    return out


def redis_args(settings: Sequence[tuple[str, str]]) -> list[str]:
    """``settings`` as redis-server command-line options (``--save ""`` turns snapshots off)."""
    return [word for key, value in settings for word in (f"--{key}", value)]


def redis_conf(settings: Sequence[tuple[str, str]]) -> str:
    """``settings`` as a redis.conf (a password there stays off the command line, out of ps)."""
    empty = '""'  # redis.conf's spelling of an empty value (save "": no snapshots)
    return "".join(f"{key} {value or empty}\n" for key, value in settings)


@dataclass
class RedisServer:
    """One ``redis-server`` on 127.0.0.1 (or ``host`` inside network namespace ``netns``: a node of
    dynamo_flexkv.serve.nodes); ``start()`` waits until it answers PING."""

    maxmemory: str = "512mb"
    policy: str = "allkeys-lru"
    password: str | None = None
    cluster: bool = False
    tls_dir: str | None = None  # serve TLS only, with ca.crt / server.crt / server.key in it
    extra: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="flexkv-redis-"))
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    netns: str | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls_dir else 'redis'}://{self.host}:{self.port}"

    def args(self) -> list[str]:
        tls: list[str] = []
        if self.tls_dir:  # TLS only: the plain port off, the TLS one on self.port
            tls = [
                "--tls-port",
                str(self.port),
                "--tls-auth-clients",
                "no",
                "--tls-cert-file",
                os.path.join(self.tls_dir, "server.crt"),
                "--tls-key-file",
                os.path.join(self.tls_dir, "server.key"),
                "--tls-ca-cert-file",
                os.path.join(self.tls_dir, "ca.crt"),
            ]
        settings = local_redis_settings(
            0 if self.tls_dir else self.port, self.workdir, self.maxmemory, self.policy, self.password, self.host
        )
        args = [require_binary("redis-server"), *redis_args(settings), *tls]
        if self.netns:
            args = ["ip", "netns", "exec", self.netns, *args]
        if self.cluster:
            # An explicit bus port: the default (port + 10000) fails for ports above 55535.
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                os.path.join(self.workdir, "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
                "--cluster-port",
                str(free_port()),
            ]
        return args + list(self.extra)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        with open(os.path.join(self.workdir, "redis.log"), "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: see {self.workdir}/redis.log")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout_s} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as raw:
                s = raw
                if self.tls_dir:
                    s = ssl.create_default_context(cafile=os.path.join(self.tls_dir, "ca.crt")).wrap_socket(
                        raw, server_hostname="127.0.0.1"
                    )
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def cli(self, *args: str) -> str:
        cmd = [require_binary("redis-cli"), "-h", self.host, "-p", str(self.port)]
        if self.tls_dir:
            cmd += ["--tls", "--cacert", os.path.join(self.tls_dir, "ca.crt")]
        if self.password:
            cmd += ["--no-auth-warning", "-a", self.password]
        return subprocess.run(cmd + list(args), check=True, capture_output=True, text=True, timeout=30).stdout

    def kill(self) -> None:
        """SIGKILL, as a crash would (the port is free again once this returns)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisCluster:
    """Three (by default) master-only cluster nodes on loopback, slots spread by redis-cli; or one
    master per (address, network namespace) in ``on``: masters on different nodes."""

    def __init__(self, nodes: int = 3, maxmemory: str = "256mb", on: Sequence[tuple[str, str | None]] = ()) -> None:
        self.servers = [
            RedisServer(maxmemory=maxmemory, cluster=True, host=host, netns=netns)
            for host, netns in (on or [("127.0.0.1", None)] * nodes)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{s.host}:{s.port}" for s in self.servers)

    def start(self, timeout_s: float = 20.0) -> RedisCluster:
        try:
            for s in self.servers:
                s.start()
            subprocess.run(
                [
                    require_binary("redis-cli"),
                    "--cluster",
                    "create",
                    *[f"{s.host}:{s.port}" for s in self.servers],
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            deadline = time.monotonic() + timeout_s
            for s in self.servers:  # each node converges on its own; one that has not answers CLUSTERDOWN
                while "cluster_state:ok" not in s.cli("cluster", "info"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"redis cluster node {s.port} did not reach cluster_state:ok")
                    time.sleep(0.05)
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> None:
        for s in self.servers:
            s.cleanup()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
