"""What the node cache service is configured with (ServerOptions) and one namespace: the tiers
shared by the engines whose KV bytes are interchangeable (server.py, protocol.attach_key)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.layout import ModelSpec
from dynamo_flexkv.core.manager import KVManager
from dynamo_flexkv.core.node.mirror import EventMirror
from dynamo_flexkv.core.node.protocol import describe_key
from dynamo_flexkv.core.node.quota import Quota, TenantQuotas


@dataclass(frozen=True)
class ServerOptions:
    socket_path: str
    max_clients: int = 64  # attached engines (ranks count one each); more are refused, the others served
    max_models: int = 1  # namespaces: each holds its own tiers of the configured sizes (quotas off)
    max_queued_mb: int = 256  # per engine: events and copies queued for an engine that does not read
    # Quotas per tenant (quota.py): the configured sizes are the node's budget, each namespace's
    # tiers its tenant's quota. None: off, every namespace gets tiers of the configured sizes.
    quotas: TenantQuotas | None = None

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ConfigError("the node cache needs a socket path (node_socket)")
        if len(os.fsencode(self.socket_path)) > 107:
            raise ConfigError(
                f"node_socket {self.socket_path!r} is longer than a Unix socket path may be (107 "
                "bytes): choose a shorter one"
            )
        for name in ("max_clients", "max_models", "max_queued_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")


class Namespace:
    """The tiers shared by the engines of one attach_key."""

    def __init__(
        self,
        key: tuple[Any, ...],
        config: CacheConfig,
        ssd_root: tuple[str, ...],
        index: int,
        ranks: int = 1,
        quota: Quota | None = None,
    ) -> None:
        """``quota``: its tenant's (the tiers are that big, not the configured sizes); None: quotas off."""
        self.key = key
        self.quota = quota
        d = describe_key(key)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        self.tenant: str = d["tenant"]
        self.salt = f"{d['tenant']}" if d["tenant"] else ""
        host_gb, disk_gb = (
            (config.cpu_cache_gb, config.ssd_cache_gb) if quota is None else (quota.host_gb, quota.disk_gb)
        )
        # A tensor-parallel model's shards split its tiers: one model's memory and disk in all.
        # Each shard's bytes are its own in the remote tier too (its rank is in the key fingerprint).
        rank, _, of = (d["shard"] or "0/1").partition("/")
        cfg = config.replace(
            mode="embedded",  # the service owns these tiers (its own config may say node: it is shared)
            node_socket="",
            tokens_per_block=d["tokens_per_block"],
            cpu_cache_gb=host_gb / ranks,
            ssd_cache_gb=disk_gb / ranks,
            ssd_cache_dir=tuple(os.path.join(r, f"ns-{digest}") for r in ssd_root),
            tp_rank=int(rank),
            tp_size=int(of),
        )
        if quota is not None and quota.remote_gb > 0:
            # One account per tenant in Redis, shared by its shards, models and every node's engines.
            cfg = cfg.replace(remote_quota_gb=quota.remote_gb, remote_tenant=self.tenant)
        model = ModelSpec(
            num_layers=d["num_layers"],
            num_kv_heads=d["num_kv_heads"],
            head_size=d["head_size"],
            dtype=d["dtype"],
            kv_dim=d["kv_dim"],
        )
        self.mirror = EventMirror(d["tokens_per_block"])
        self.kv = KVManager(
            model, cfg, namespace=self.salt or None, listener=self.mirror, model_id=d["model_id"], share_host=True
        )
        # The disk blocks a restarted service re-adopted are news to every engine: the mirror
        # (no network, nothing to wait for) holds them now, so each engine's subscribe sends them.
        self.kv.announce_adopted()
        self.index = index
        self.sessions: dict[int, Any] = {}
        self.created = time.monotonic()

    def describe(self) -> dict[str, Any]:
        return {**describe_key(self.key), "engines": len(self.sessions), "blocks": self.mirror.blocks}
