"""Quotas per tenant on the node cache service (docs/NODE_CACHE.md, "Quotas per tenant").

With quotas on, the service's ``cpu_cache_gb`` and ``ssd_cache_gb`` are the node's budget, not
the size of every namespace: each tenant gets a quota of host, disk (and remote) bytes, named on
the command line (``--tenant-quota acme=8:64``) or given to every other tenant
(``--default-quota 2:16``). A quota is reserved for its tenant: the explicit quotas and those of
the default-quota tenants attached so far never sum past the budget, so a tenant that floods the
node has only its own tiers to evict from (each namespace's KVManager holds its own pools: its LRU
victims are its own blocks), and every other tenant keeps its blocks up to its quota."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynamo_flexkv.core.config import CacheConfig, ConfigError

QUOTA_FORMAT = "HOST_GB[:DISK_GB[:REMOTE_GB]]"
TENANT_FORMAT = f"TENANT={QUOTA_FORMAT}"
# A tenant name as engines send it (protocol.Attach.tenant, at most 256 characters): anything but
# '=' and whitespace, so a flag's TENANT=... splits one way.
_TENANT = re.compile(r"[^=\s]{1,256}\Z")


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold: GB of host memory, of disk (0: no disk tier) and of the remote tier
    (0: no quota there; Redis's maxmemory decides, as without quotas)."""

    host_gb: float
    disk_gb: float = 0.0
    remote_gb: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str) -> Quota:
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.strip() for p in parts):
            raise ConfigError(f"{flag} {text!r}: expected {QUOTA_FORMAT} in GB, e.g. 4:32 (4 GB host, 32 GB disk)")
        values = []
        for name, part in zip(("HOST_GB", "DISK_GB", "REMOTE_GB"), parts):
            try:
                value = float(part)
            except ValueError:
                raise ConfigError(f"{flag} {text!r}: {name} {part.strip()!r} is not a number of GB") from None
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{flag} {text!r}: {name}={part.strip()} must be a finite number >= 0")
            values.append(value)
        quota = cls(*values)
        if quota.host_gb <= 0:
            raise ConfigError(
                f"{flag} {text!r}: HOST_GB must be > 0 (the host tier stages every transfer of the tenant)"
            )
        if 0 < quota.disk_gb < quota.host_gb:
            raise ConfigError(
                f"{flag} {text!r}: DISK_GB={quota.disk_gb:g} is smaller than HOST_GB={quota.host_gb:g}: "
                "the tenant's disk tier would hold less than its host memory; raise DISK_GB or set it to 0"
            )
        return quota

    def bytes(self) -> dict[str, int]:
        return {tier: int(gb * (1 << 30)) for tier, gb in self._tiers().items()}

    def _tiers(self) -> dict[str, float]:
        return {"host": self.host_gb, "disk": self.disk_gb, "remote": self.remote_gb}

    def __str__(self) -> str:
        return ":".join(f"{gb:.12g}" for gb in (self.host_gb, self.disk_gb, self.remote_gb))


@dataclass(frozen=True)
class TenantQuotas:
    """The quotas a service enforces: ``tenants`` by name, ``default`` for every other tenant
    (engines that send no tenant included); without a default, an unnamed tenant is refused."""

    tenants: dict[str, Quota] = field(default_factory=dict)
    default: Quota | None = None

    @classmethod
    def parse(cls, default: str | None, tenants: Sequence[str]) -> TenantQuotas | None:
        """From ``--default-quota`` and the ``--tenant-quota`` flags; None when neither is given
        (quotas off: every namespace gets tiers of the configured sizes, as before)."""
        if default is None and not tenants:
            return None
        named: dict[str, Quota] = {}
        for item in tenants:
            name, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--tenant-quota {item!r}: expected {TENANT_FORMAT}, e.g. acme=4:32")
            name = name.strip()
            if not _TENANT.match(name):
                raise ConfigError(
                    f"--tenant-quota {item!r}: the tenant name must be 1 to 256 characters without '=' or "
                    "spaces (engines without a tenant get --default-quota)"
                )
            if name in named:
                raise ConfigError(f"--tenant-quota names tenant {name!r} twice: give each tenant one quota")
            named[name] = Quota.parse(value.strip(), f"--tenant-quota {name}=")
        return cls(named, None if default is None else Quota.parse(default.strip(), "--default-quota"))

    @classmethod
    def from_mapping(cls, data: object) -> TenantQuotas | None:
        """From a serve graph's ``NodeCache.quotas``: ``{default: QUOTA, tenants: {NAME: QUOTA}}``,
        each QUOTA a mapping ``{host_gb: 4, disk_gb: 32, remote_gb: 0}`` (a mapping, not "4:32":
        YAML reads 4:32 unquoted as the base-60 number 272)."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ConfigError("expected a mapping: {default: {host_gb: ...}, tenants: {NAME: {host_gb: ...}}}")
        unknown = sorted(set(data) - {"default", "tenants"})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}: use default and tenants")
        tenants = data.get("tenants") or {}
        if not isinstance(tenants, dict):
            raise ConfigError("tenants must map each tenant to {host_gb: ..., disk_gb: ..., remote_gb: ...}")
        default = data.get("default")
        return cls.parse(
            None if default is None else _quota_text(default, "default"),
            [f"{name}={_quota_text(value, f'tenants.{name}')}" for name, value in tenants.items()],
        )

    def argv(self) -> list:
        """The cache-server flags that give these quotas."""
        out = [] if self.default is None else ["--default-quota", str(self.default)]
        for name, quota in sorted(self.tenants.items()):
            out += ["--tenant-quota", f"{name}={quota}"]
        return out

    def check(self, config: CacheConfig) -> None:
        """Each quota and the explicit ones together fit the node's budget (``cpu_cache_gb``,
        ``ssd_cache_gb``); a disk quota needs a disk tier, a remote quota the remote tier."""
        budget = {"host": ("cpu_cache_gb", config.cpu_cache_gb), "disk": ("ssd_cache_gb", config.ssd_cache_gb)}
        every = dict(self.tenants)
        if self.default is not None:
            every["(default)"] = self.default
        for name, quota in every.items():
            flag = "--default-quota " if name == "(default)" else f"--tenant-quota {name}="
            if quota.disk_gb > 0 and config.ssd_cache_gb <= 0:
                raise ConfigError(
                    f"{flag}{quota}: DISK_GB={quota.disk_gb:g} but the server has no disk tier "
                    "(ssd_cache_gb=0): set DISK_GB to 0, or give the server ssd_cache_gb and ssd_cache_dir"
                )
            if quota.remote_gb > 0 and not config.enable_remote:
                raise ConfigError(
                    f"{flag}{quota}: REMOTE_GB={quota.remote_gb:g} but the remote tier is off "
                    "(enable_remote=false): set REMOTE_GB to 0, or enable the remote tier"
                )
            for tier, (key, total) in budget.items():
                gb = quota.host_gb if tier == "host" else quota.disk_gb
                if gb > total:
                    raise ConfigError(
                        f"{flag}{quota}: {tier} {gb:g} GB is more than the node's {tier} budget "
                        f"{key}={total:g}: lower the quota or raise {key}"
                    )
        for tier, (key, total) in budget.items():
            summed = sum(q.host_gb if tier == "host" else q.disk_gb for q in self.tenants.values())
            if summed > total + 1e-9:
                raise ConfigError(
                    f"the --tenant-quota {tier} quotas sum to {summed:g} GB, more than the node's {tier} "
                    f"budget {key}={total:g} (each quota is reserved for its tenant): lower them or raise {key}"
                )

    def quota_for(self, tenant: str) -> Quota:
        quota = self.tenants.get(tenant, self.default)
        if quota is None:
            who = f"tenant {tenant!r}" if tenant else "an engine without a tenant"
            raise ConfigError(
                f"{who} has no quota on this cache server: give it one with --tenant-quota "
                f"{tenant or 'TENANT'}={QUOTA_FORMAT} (the engine's namespace), or set --default-quota"
            )
        return quota

    def reserved(self, default_tenants: Iterable[str]) -> dict[str, float]:
        """GB of each tier promised: every explicit quota, and the default quota of each tenant in
        ``default_tenants`` (unnamed tenants that hold a namespace)."""
        quotas = list(self.tenants.values()) + [self.default for _ in default_tenants if self.default]
        return {"host": sum(q.host_gb for q in quotas), "disk": sum(q.disk_gb for q in quotas)}


def _quota_text(value: object, where: str) -> str:
    """A quota mapping as the flags write it (HOST:DISK:REMOTE), checked by Quota.parse after."""
    keys = ("host_gb", "disk_gb", "remote_gb")
    if not isinstance(value, dict) or "host_gb" not in value:
        raise ConfigError(f"{where}={value!r}: write a mapping, e.g. {{host_gb: 4, disk_gb: 32, remote_gb: 0}}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {unknown}: use {', '.join(keys)}")
    parts = []
    for key in keys:
        v = value.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}.{key}={v!r} must be a number of GB")
        parts.append(repr(float(v)))
    return ":".join(parts)
