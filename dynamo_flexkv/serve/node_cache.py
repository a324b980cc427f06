"""The node cache in a serve graph: one ``dynamo-flexkv cache-server`` per node for the workers whose
cache says ``mode: node`` (docs/NODE_CACHE.md).

The ``NodeCache`` section (beside Common, in any graph's config) holds the service's options: its
``cache`` (the node's tiers: cpu_cache_gb, ssd_cache_gb, ssd_cache_dir, eviction, remote, ...),
``max-clients``, ``max-models``, ``quotas`` (per tenant: the cache-server's --tenant-quota and
--default-quota), ``metrics-port`` (0: a free port; the service always
serves metrics under serve, which waits for them) and its restart policy. A worker in node mode uses only
``mode`` and ``node_socket`` of its own ``cache`` (its tier keys, e.g. a shipped config's, are the
embedded cache's: ignored, and serve says so). Without ``node_socket`` serve gives it the socket
of its node's service, which it starts, supervises like a worker (restarted on death; the engines
re-attach by themselves) and stops after them; with one, the worker attaches to the cache server
already listening there (``dynamo-flexkv cache-server --socket PATH``, the operator's) and serve
starts none for it."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from dynamo_flexkv.core.config import CacheConfig, ConfigError, cite_origins
from dynamo_flexkv.core.node.quota import TenantQuotas
from dynamo_flexkv.core.sysutil import listening, not_a_socket
from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.options import (
    SECONDS_OPTIONS,
    OnDeath,
    RestartPolicy,
    float_option,
    int_option,
    mapping_option,
    parse_section,
    seconds_problem,
    str_option,
)
from dynamo_flexkv.serve.ports import LOOPBACK
from dynamo_flexkv.serve.process import Process
from dynamo_flexkv.serve.replica_cache import PlanContext, claim_ssd_dirs
from dynamo_flexkv.serve.sources import origin_of

SECTION = "NodeCache"
SOCKET_MAX = 100  # sun_path holds 107 bytes
RENDER_SOCKET_DIR = "/run/dynamo-flexkv"  # a rendered DaemonSet's hostPath, mounted by the workers too
RENDER_METRICS_PORT = 9400  # a rendered cache server's /metrics, on its pod's address
# Worker cache keys that mean something in node mode (tokens_per_block: serve sets it; node_socket:
# serve sets it to its own service's unless the user names a running one).
NODE_WORKER_KEYS = ("mode", "node_socket", "tokens_per_block")

OPTIONS: dict[str, Callable[[Any], Any]] = {
    "cache": mapping_option,
    "max-clients": int_option,
    "max-models": int_option,
    "quotas": TenantQuotas.from_mapping,
    "metrics-port": int_option,
    "on-death": str_option,
    "max-restarts": int_option,
    "restart-window-s": float_option,
    "restart-backoff-s": float_option,
}
DEFAULTS: dict[str, Any] = {
    "cache": {},
    "max-clients": 64,
    "max-models": 1,
    "quotas": None,
    "metrics-port": 0,
    "on-death": "restart",
    "max-restarts": 5,
    "restart-window-s": 300.0,
    "restart-backoff-s": 1.0,
}


def options(raw: Any, source: str) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise GraphError(f"{origin_of(source, SECTION)}: {SECTION} must be a mapping of options")
    out = parse_section(DEFAULTS, raw, OPTIONS, source, SECTION, "the node cache")
    for key in ("max-clients", "max-models"):
        if out[key] < 1:
            raise GraphError(f"{origin_of(source, SECTION, key)}: {SECTION}.{key}={out[key]} must be >= 1")
    if out["on-death"] not in {d.value for d in OnDeath}:
        raise GraphError(
            f"{origin_of(source, SECTION, 'on-death')}: {SECTION}.on-death={out['on-death']!r}: use restart or stop"
        )
    for key in ("restart-window-s", "restart-backoff-s"):
        problem = seconds_problem(out[key], *SECONDS_OPTIONS[key])
        if problem is not None:
            raise GraphError(f"{origin_of(source, SECTION, key)}: {SECTION}.{key}={problem}")
    return out


def in_node_mode(name: str, worker_options: Mapping[str, Any], source: str) -> bool:
    """Whether a worker attaches to a node cache (``cache.mode: node``, offload on). A
    ``node_socket`` without ``mode: node`` would be unused: refused, naming both keys."""
    cache = worker_options.get("cache") or {}
    node = str(cache.get("mode", "embedded")).strip() == "node"
    if cache.get("node_socket") and not node and worker_options.get("offload", True):
        where = origin_of(source, name, "cache", "node_socket")
        raise GraphError(
            f"{where}: {name}.cache.node_socket={cache['node_socket']!r} names a node cache server, but "
            f"{name}.cache.mode is not node: set --set {name}.cache.mode=node to attach to it, or remove "
            "node_socket for the worker's own tiers"
        )
    return bool(worker_options.get("offload", True)) and node


def node_worker_cache(name: str, cache: Mapping[str, Any], tiers: str) -> tuple[dict[str, Any], str | None]:
    """(the keys a node-mode worker uses, a note naming the ones it ignores or None). Its other keys
    (a shipped config's tier sizes and directories, eviction, ...) are the embedded cache's: the
    node's tiers are ``tiers`` (where they come from, for the note)."""
    kept = {k: v for k, v in cache.items() if k in NODE_WORKER_KEYS}
    ignored = sorted(k for k in cache if k not in NODE_WORKER_KEYS)
    if not ignored:
        return kept, None
    return kept, (
        f"{name}.cache: mode: node ignores {', '.join(ignored)} (the keys of a worker's own, embedded "
        f"tiers); its tiers are the node cache's: {tiers}"
    )


def external_socket(name: str, path: str, replicas: int, source: str) -> str:
    """A ``node_socket`` the user gave a worker: an absolute path (the workers run in the run
    directory) where a cache server listens now (each replica's, ``{replica}`` filled in), or a
    GraphError naming the key and the fix. Serve starts no service for such a worker and never
    replaces the path."""
    sock = os.path.abspath(os.path.expanduser(path))
    key = f"{name}.cache.node_socket"
    where = origin_of(source, name, "cache", "node_socket")
    for i in range(replicas):
        each = sock.replace("{replica}", str(i))
        start = f"dynamo-flexkv cache-server --socket {each} -f node-cache.yaml"
        other = not_a_socket(each)
        if other:
            raise GraphError(
                f"{where}: {key}={path!r}: {each} is {other}, not a socket: name the socket of a running "
                f"cache server (its ready line prints it; {start}), or remove {key} and let serve start "
                f"one ({SECTION})"
            )
        try:
            up = listening(each)
        except OSError as e:
            raise GraphError(
                f"{where}: {key}={path!r}: cannot connect to {each} ({e.strerror or e}): name the socket "
                f"of a running cache server ({start}), or remove {key} and let serve start one ({SECTION})"
            ) from None
        if not up:
            what = "no socket there" if not os.path.exists(each) else "a socket file, but nothing listens on it"
            raise GraphError(
                f"{where}: {key}={path!r}: no cache server listens on {each} ({what}): start it first "
                f"({start}), or remove {key} and let serve start one ({SECTION})"
            )
    return sock


def socket_path(run_dir: Path, node: str | None, local: bool) -> str:
    if not local:
        return f"{RENDER_SOCKET_DIR}/node.sock"
    name = f"node-cache{'-' + node if node else ''}.sock"
    path = str(run_dir / name)
    if len(path) > SOCKET_MAX:
        # A run directory too deep for a socket path: a directory of the run's own in the temp dir,
        # made owner-only by the cache server (never the shared temp dir itself, where another
        # user could take the name first).
        digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
        path = os.path.join(tempfile.gettempdir(), f"dynamo-flexkv-{os.getuid()}-{digest}", name)
    return path


def process(
    ctx: PlanContext, o: Mapping[str, Any], node: str | None, sock: str, spec: Any | None, block_size: int
) -> Process:
    """One node's cache server: its tiers checked (sizes against the workers' KV shape; its SSD
    directories free and no worker's), its config written for it, a metrics port of its own (serve
    waits for it, and reads it like a worker's)."""
    source, local = ctx.source, ctx.local
    name = f"{SECTION}-{node}" if node else SECTION
    values = dict(o["cache"])
    values["tokens_per_block"] = block_size
    for key in ("mode", "node_socket"):
        if key in values:
            raise GraphError(
                f"{origin_of(source, SECTION, 'cache', key)}: "
                f"{SECTION}.cache.{key}: the server is the node cache; remove it"
            )
    origins = {key: origin_of(source, SECTION, "cache", key) for key in o["cache"]}
    try:
        checked = values if local else dict(values, ssd_cache_dir=tempfile.gettempdir())
        cache = CacheConfig.from_dict(checked, source, origins)  # its errors name each value's origin
    except ConfigError as e:
        raise GraphError(f"{SECTION}.cache: {e}") from None
    try:
        if spec is not None:
            cache.tier_blocks(spec)
    except ConfigError as e:
        raise GraphError(f"{SECTION}.cache: {cite_origins(str(e), origins)}") from None
    quotas = o["quotas"]
    if quotas is not None:
        try:
            quotas.check(cache)
        except ConfigError as e:
            raise GraphError(
                f"{origin_of(source, SECTION, 'quotas')}: {SECTION}.quotas: {cite_origins(str(e), origins)}"
            ) from None
    if local:  # as cache-server checks it: without quotas each model gets its own host tier
        from dynamo_flexkv.core.sysutil import host_memory_shortfall

        models = 1 if quotas is not None else o["max-models"]
        short = host_memory_shortfall(cache.cpu_cache_gb, models)
        if short is not None:
            times = f" x {SECTION}.max-models {models} (each model its own host tier without quotas)" * (models > 1)
            raise GraphError(
                f"{origin_of(source, SECTION, 'cache', 'cpu_cache_gb')}: {SECTION}.cache.cpu_cache_gb="
                f"{cache.cpu_cache_gb:g}{times}: the host tier {short[0]}: set --set {SECTION}.cache.cpu_cache_gb="
                f"{short[1]:.0f} or less" + (f" or lower {SECTION}.max-models" if models > 1 else "")
            )
    if cache.ssd_cache_gb > 0 and local:
        claim_ssd_dirs(
            ctx,
            f"{origin_of(source, SECTION, 'cache')}: {SECTION}.cache",
            list(cache.ssd_cache_dir),
            name,
            lambda d, holder: (
                f"{origin_of(source, SECTION, 'cache')}: {SECTION}.cache.ssd_cache_dir {d} is also "
                f"{holder}'s: give the node cache a directory of its own"
            ),
        )
    cfg_path = str(ctx.run_dir / f"{name}.cache.yaml")
    port = ctx.ports.take(
        o["metrics-port"], f"{SECTION}.metrics-port", origin_of(source, SECTION, "metrics-port"), any_port=True
    )
    argv = [
        sys.executable,
        "-m",
        "dynamo_flexkv.cli",
        "cache-server",
        "--socket",
        sock,
        "-f",
        cfg_path,
        "--max-clients",
        str(o["max-clients"]),
        "--max-models",
        str(o["max-models"]),
        "--metrics-port",
        str(port),
        "--metrics-host",
        LOOPBACK,
        *(quotas.argv() if quotas is not None else []),
    ]
    policy = RestartPolicy(
        OnDeath(o["on-death"]), o["max-restarts"], o["restart-window-s"], o["restart-backoff-s"], liveness_s=0.0
    )
    return Process(
        name,
        argv,
        {},
        Kind.CACHE,
        port,
        cache,
        {cfg_path: yaml.safe_dump(values, sort_keys=True)},
        policy,
        engine="cache",
        block_size=block_size,
    )


def render_daemonset(
    proc: Process,
    name: str,
    image: str,
    *,
    node_selector: Mapping[str, str],
    host_dir: str,
    pod_security: dict[str, Any],
    owner_init: Callable[[str, list[dict[str, Any]]], dict[str, Any]],
    resources: dict[str, Any],
    annotations: Mapping[str, str],
) -> dict[str, Any]:
    """How a Kubernetes user runs a per-node service: a DaemonSet (one pod per node, on the nodes
    ``node_selector`` picks) whose socket directory is a hostPath the node's worker pods mount too.
    hostPID: the service fences a dead engine's writes by its process id (pidfd), which it must
    see; its disk tier is a hostPath too (under ``host_dir``), so a restarted service re-adopts it.
    ``owner_init`` makes the init container that gives those directories to the pods' user;
    ``annotations`` say why the pod needs the host (render.py)."""
    args = list(proc.argv[proc.argv.index("cache-server") + 1 :])
    for flag, value in (
        ("--socket", f"{RENDER_SOCKET_DIR}/node.sock"),
        ("-f", "/etc/flexkv/node-cache.yaml"),
        ("--metrics-port", str(RENDER_METRICS_PORT)),
        ("--metrics-host", "$(POD_IP)"),
    ):
        args[args.index(flag) + 1] = value
    config = next(iter(proc.files.values()))
    values = yaml.safe_load(config) or {}
    dirs = values.get("ssd_cache_dir") or [] if float(values.get("ssd_cache_gb") or 0) > 0 else []
    dirs = dirs.split(";") if isinstance(dirs, str) else list(dirs)
    host_mounts = [{"name": "socket-dir", "mountPath": RENDER_SOCKET_DIR}]
    volumes: list[dict[str, Any]] = [
        {"name": "socket-dir", "hostPath": {"path": RENDER_SOCKET_DIR, "type": "DirectoryOrCreate"}},
        {"name": "config", "configMap": {"name": f"{name}-node-cache"}},
    ]
    for i, d in enumerate(dirs):  # the node's directory, where the config says the tier is
        host_mounts.append({"name": f"ssd-{i}", "mountPath": d})
        volumes.append({"name": f"ssd-{i}", "hostPath": {"path": f"{host_dir}/ssd-{i}", "type": "DirectoryOrCreate"}})
    mounts = host_mounts + [{"name": "config", "mountPath": "/etc/flexkv"}]

    def labels() -> dict[str, str]:  # a fresh dict each time: the manifest carries no YAML aliases
        return {"app": f"{name}-node-cache"}

    spec: dict[str, Any] = {
        "hostPID": True,
        "securityContext": pod_security,
        "initContainers": [owner_init(image, host_mounts)],
        "volumes": volumes,
        "containers": [
            {
                "name": "cache-server",
                "image": image,
                "command": ["python3", "-m", "dynamo_flexkv.cli", "cache-server"],
                "args": args,
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "resources": resources,
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": mounts,
                "ports": [{"name": "metrics", "containerPort": RENDER_METRICS_PORT}],
            }
        ],
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "configMap": {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-node-cache"},
            "data": {"node-cache.yaml": config},
        },
        "daemonSet": {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": f"{name}-node-cache", "annotations": dict(annotations)},
            "spec": {
                "selector": {"matchLabels": labels()},
                "template": {"metadata": {"labels": labels(), "annotations": dict(annotations)}, "spec": spec},
            },
        },
    }


def worker_mounts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) a node-mode worker pod needs: its node's cache socket directory."""
    return (
        {"name": "node-cache", "hostPath": {"path": RENDER_SOCKET_DIR, "type": "Directory"}},
        {"name": "node-cache", "mountPath": RENDER_SOCKET_DIR},
    )
