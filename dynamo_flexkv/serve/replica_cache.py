"""A worker replica's cache config as serve plans it: the section's values with ``{replica}``
filled in, checked as the worker will load them (CacheConfig), its SSD directories free and
owned by no other replica, a local redis-server when remote is on without a URL, written to the
file the worker reads (FLEXKV_CONFIG_PATH)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dynamo_flexkv.core.config import CacheConfig, ConfigError, cite_origins
from dynamo_flexkv.core.remote.config import split_password
from dynamo_flexkv.core.storage.ssd import SsdInUseError, check_dir_free
from dynamo_flexkv.serve.graph import GraphError
from dynamo_flexkv.serve.infra import check_remote_reachable, use_local_redis
from dynamo_flexkv.serve.sources import origin_of

if TYPE_CHECKING:
    from dynamo_flexkv.serve.ports import PortBook


@dataclass(frozen=True)
class PlanContext:
    """What planning every component of one graph shares (serve/plan.py build_plan makes one).
    ``redis`` and ``dirs`` fill up as the components are planned: the graph's own redis-server
    (port and password, once a worker enables remote without a URL) and every SSD directory taken
    so far (real path -> its owner: no two may share one). A worker's served model name is not
    here: each worker component has its own."""

    run_dir: Path
    discovery: str  # serve --discovery-backend: file or etcd
    event_plane: str  # serve --event-plane: zmq or nats
    env: dict[str, str]  # the planes' environment every component starts with
    ports: PortBook
    source: str  # the config file, as errors name it (a ConfigSource: also where each --set put a value)
    local: bool  # False: rendering for elsewhere (no ports or SSD directories probed here)
    redis: dict[str, Any]
    dirs: dict[str, str]


def replica_cache(
    ctx: PlanContext,
    name: str,
    pname: str,
    i: int,
    o: Mapping[str, Any],
    spec: Any | None,
    block_size: int,
    penv: dict[str, str],
):
    """One replica's tiers from the worker's ``cache`` section: checked (sizes against ``spec``, the
    KV shape, unless None; SSD directories free and not shared; a given Redis reachable), written to
    ``ctx.run_dir/<pname>.cache.yaml``, which FLEXKV_CONFIG_PATH names (CacheConfig.load reads it).
    A password in remote_cache_url stays out of that file: the worker gets it in the variable
    remote_password_env names (as the handover secret and the local redis's password reach it).
    Returns (CacheConfig, {path: text})."""
    source, local = ctx.source, ctx.local
    values = {k: per_replica(v, i) for k, v in o["cache"].items()}
    values["tokens_per_block"] = block_size
    given_url = bool(values.get("remote_cache_url"))
    if _parse_flag(values.get("enable_remote")) and not given_url and local:
        use_local_redis(ctx.redis, ctx.ports, values, penv)
    origins = {key: origin_of(source, name, "cache", key) for key in o["cache"]}
    try:
        checked = values if local else dict(values, ssd_cache_dir=tempfile.gettempdir())  # not our disks
        if not local and not given_url:  # Kubernetes: the URL comes from a Secret (render --k8s)
            checked["remote_cache_url"] = "redis://redis-from-secret:6379"
        cache = CacheConfig.from_dict(checked, source, origins)  # its errors name each value's origin
    except ConfigError as e:
        raise GraphError(f"{name}.cache: {e}") from None
    try:
        if spec is not None:
            cache.tier_blocks(spec)
    except ConfigError as e:
        raise GraphError(f"{name}.cache: {cite_origins(str(e), origins)}") from None
    if local and i == 0:  # every replica's host tier is this machine's memory
        _check_host_memory(name, cache.cpu_cache_gb, o["replicas"], origins.get("cpu_cache_gb", str(source)))
    if local and cache.enable_remote and given_url:
        check_remote_reachable(cache, f"{origin_of(source, name, 'cache', 'remote_cache_url')}: {name}.cache")
    dir_origin = origin_of(source, name, "cache", "ssd_cache_dir")
    claim_ssd_dirs(
        ctx,
        f"{dir_origin}: {name}.cache",
        _dirs(values.get("ssd_cache_dir")) if cache.ssd_cache_gb > 0 else (),
        pname,
        lambda d, holder: (
            f"{dir_origin}: {name}.cache.ssd_cache_dir {d} is shared by {holder} "
            f"and {pname}: each worker needs its own; put {{replica}} in the path"
        ),
    )
    url = values.get("remote_cache_url")
    url, password = split_password(url) if isinstance(url, str) else (url, None)
    if password is not None:  # the file names the server; its password goes by environment, like the local redis's
        values["remote_cache_url"] = url
        penv[cache.remote_password_env] = password
    cfg_path = str(ctx.run_dir / f"{pname}.cache.yaml")
    penv["FLEXKV_CONFIG_PATH"] = cfg_path
    return cache, {cfg_path: yaml.safe_dump(values, sort_keys=True)}


def claim_ssd_dirs(
    ctx: PlanContext, where: str, dirs: Sequence[str], owner: str, shared: Callable[[str, str], str]
) -> None:
    """Books ``dirs`` for ``owner`` in ``ctx.dirs``: each free on this machine (``local``; ``where``
    prefixes that error: "<source>: <section>.cache") and no other owner's (``shared(dir, holder)``:
    that error's message)."""
    for d in dirs:
        if ctx.local:
            try:
                check_dir_free(d)
            except SsdInUseError as e:
                raise GraphError(f"{where}: {e}") from None
        real = os.path.realpath(d)
        if real in ctx.dirs:
            raise GraphError(shared(d, ctx.dirs[real]))
        ctx.dirs[real] = owner


def _parse_flag(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "on")


def per_replica(value: Any, replica: int) -> Any:
    if isinstance(value, str):
        return value.replace("{replica}", str(replica))
    if isinstance(value, list):
        return [per_replica(v, replica) for v in value]
    return value


def _dirs(value: Any) -> list[str]:
    """ssd_cache_dir as CacheConfig reads it: a list, or one string with ';' between directories."""
    if value is None:
        return []
    return [d for d in value.split(";") if d] if isinstance(value, str) else [str(d) for d in value]


def _check_host_memory(section: str, gb: float, replicas: int, origin: str) -> None:
    """GraphError when ``replicas`` host tiers of ``gb`` GB do not fit this machine's memory (they
    would be swapped, or a worker killed by the OOM killer once they fill), naming where the size
    came from and one that fits."""
    from dynamo_flexkv.core.sysutil import host_memory_shortfall

    short = host_memory_shortfall(gb, replicas)
    if short is not None:
        times = f" x {section}.replicas {replicas}" if replicas > 1 else ""
        what = short[0].replace(" is ", " are ", 1)
        raise GraphError(
            f"{origin}: {section}.cache.cpu_cache_gb={gb:g}{times}: the host tiers {what}: set "
            f"--set {section}.cache.cpu_cache_gb={short[1]:.0f} or less"
            + (f" or lower {section}.replicas" if replicas > 1 else "")
        )
