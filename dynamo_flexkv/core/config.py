"""Cache configuration: defaults < YAML file (FLEXKV_CONFIG_PATH) < environment < a command's --set.

Keys keep FlexKV's names so its users can move over; Dynamo KVBM's DYN_KVBM_* variables are
accepted as aliases. Every bad value or contradiction raises ConfigError naming the key, where its
value came from (the file, the environment variable, the --set) and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dynamo_flexkv.core.durations import is_duration
from dynamo_flexkv.core.enums import EvictionPolicy, LoadPolicy
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.remote.config import DEFAULT_PASSWORD_ENV

if TYPE_CHECKING:
    from dynamo_flexkv.core.remote.config import RemoteConfig

log = logging.getLogger(__name__)

GiB = 1 << 30

# Environment variable -> config key. FLEXKV_<KEY> works for every key; these are the extras.
ENV_ALIASES: dict[str, str] = {
    "DYN_KVBM_CPU_CACHE_GB": "cpu_cache_gb",
    "DYN_KVBM_DISK_CACHE_GB": "ssd_cache_gb",
    "DYN_KVBM_DISK_CACHE_DIR": "ssd_cache_dir",
}
CONFIG_PATH_ENV = "FLEXKV_CONFIG_PATH"
# The FLEXKV_* variables read elsewhere than as a config key (where): not misspellings.
# tests/unit/test_config.py checks that every FLEXKV_* name the package reads is a key's or here.
OTHER_ENV: dict[str, str] = {
    CONFIG_PATH_ENV: "the cache config file",
    DEFAULT_PASSWORD_ENV: "the remote tier's password (remote_password_env)",
    "FLEXKV_RUN_DIR": "the vLLM connector's run directory",
    "FLEXKV_HANDOVER_SECRET": "the disaggregated handover's shared secret",
    "FLEXKV_NIXL_PROGRESS_DELAY_US": "NIXL's progress thread delay",
}
TEST_ENV_PREFIX = "FLEXKV_TEST_"  # the test suite's own seams
MODES = ("embedded", "node")


class ConfigError(ValueError, FlexKVError):
    """A configuration value that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_block: int = 16
    cpu_cache_gb: float = 4.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: tuple[str, ...] = ()  # blocks are striped across these directories
    # host<->disk through NIXL's GDS_MT backend, not POSIX (needs enable_nixl, CUDA, cuFile); still
    # staged in host, never disk<->device
    enable_gds: bool = False
    enable_nixl: bool = False  # host<->disk through NIXL instead of our io_uring mover
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    evict_start_threshold: float = 1.0  # fraction of a tier in use that starts proactive eviction
    evict_ratio: float = 0.05  # fraction of a tier freed per proactive eviction step
    hit_reward_seconds: float = 0.0  # LRU: each hit counts as this much extra recency
    slru_protected_hits: int = 2  # SLRU: hits that move a block from probation to protected
    disk_admission_hits: int = 0  # hits a block needs before it is written to disk; 0 = always
    io_queue_depth: int = 512  # io_uring submission depth for the disk tier
    use_huge_pages: bool = False
    task_result_ttl_seconds: float = 600.0  # a finished result nobody collected is dropped after this
    max_tasks_in_flight: int = 4096  # running tasks (background disk writes included) before new ones are refused
    # Remote tier (Redis / Valkey / Redis Cluster, shared by every worker of a model; docs/REMOTE.md).
    enable_remote: bool = False
    remote_cache_url: str = dataclasses.field(
        default="", repr=False
    )  # may carry a password: never in a repr; redis://, rediss://, redis+cluster://h:p,h:p; serve starts one if empty
    remote_password_env: str = DEFAULT_PASSWORD_ENV  # read when the URL carries no password
    remote_timeout_s: float = 2.0  # bound on every remote socket wait
    remote_connect_timeout_s: float = 1.0
    remote_ttl_s: float = 0.0  # expire remote blocks after this long; 0 = leave it to maxmemory eviction
    remote_key_prefix: str = "flexkv:"
    remote_admission_hits: int = 0  # host hits a block needs before it is written to remote; 0 = every put
    remote_required: bool = True  # an unreachable server at start is an error (false: start without it)
    # GB of remote blocks the tenant remote_tenant may hold, accounted in Redis and shared by every
    # worker that names the tenant; over it, that tenant's oldest blocks go (docs/REMOTE.md). 0: no quota.
    remote_quota_gb: float = 0.0
    remote_tenant: str = ""
    tp_rank: int = 0  # this worker's tensor-parallel rank: its KV shard's bytes are its own (keys the remote tier)
    tp_size: int = 1  # tensor-parallel ranks of one model instance
    # How much of a cached prefix a get loads (core/cost.py): cost_aware (what is measured faster than
    # recomputing it; before any measurement everything, as always), always, never.
    load_policy: LoadPolicy = LoadPolicy.COST_AWARE
    # Who owns the tiers (core/offload.py open_offload): embedded, this engine process (each engine and
    # rank its own); node, the node's cache service (dynamo-flexkv cache-server) at node_socket, shared
    # by every engine on the node and outliving them (docs/NODE_CACHE.md).
    mode: str = "embedded"
    node_socket: str = ""  # the service's Unix socket; default $XDG_RUNTIME_DIR/flexkv-node.sock

    def __post_init__(self) -> None:
        # The constructor converts like the loader: "a;b" is two directories, "lfu" a policy.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(f.name, f.default, value, "CacheConfig()"))
        self._validate()

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], source: str = "config", origins: Mapping[str, str] | None = None
    ) -> CacheConfig:
        """``data``'s values, from ``source``; ``origins`` names where single keys came from when
        that differs (a --set over a file): an error names the origin of each value it concerns."""
        return _build(cls, data, source, origins or {})

    @classmethod
    def load(
        cls,
        path: str | None = None,
        env: Mapping[str, str] | None = None,
        sets: Sequence[str] = (),
        path_flag: str = "",
        warn_unknown_env: bool = True,
    ) -> CacheConfig:
        """Defaults, then the YAML file (``path``, else $FLEXKV_CONFIG_PATH), then the environment
        (FLEXKV_<KEY> and the KVBM aliases), then ``sets`` (a command's ``--set KEY=VALUE`` items).
        Only the value that wins is parsed (a bad variable a --set replaces is not an error), and
        every error names where its value came from: the file (``path_flag``: the option that
        named it, e.g. ``-f``), the variable or the --set. A FLEXKV_* variable nothing reads (a
        misspelling) is logged as a warning naming the closest one, unless ``warn_unknown_env`` is
        False (doctor reports it as a check)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        if not path and env.get(CONFIG_PATH_ENV):
            path, path_flag = env[CONFIG_PATH_ENV], CONFIG_PATH_ENV
        if path:
            shown = f"{path} ({path_flag})" if path_flag else path
            fix = f"; fix or unset {CONFIG_PATH_ENV}" if path_flag == CONFIG_PATH_ENV else ""
            for key, value in read_yaml_mapping(path, fix, "keys to values", shown=shown).items():
                values[key], origins[key] = value, shown
        for key, (var, value) in _env_values(env).items():
            values[key], origins[key] = value, env_origin(var)
        for key, (item, value) in parse_sets(sets).items():
            values[key], origins[key] = value, f"--set {item}"
        config = _build(cls, values, "config", origins)
        if warn_unknown_env:
            _warn_unknown_env(env, config.remote_password_env)
        return config

    def replace(self, **changes: Any) -> CacheConfig:
        return dataclasses.replace(self, **_coerce_all(changes, "replace()"))

    # ---- derived ---------------------------------------------------------------------------
    def layout(self, model: ModelSpec, num_blocks: int, type: KVLayoutType = KVLayoutType.BLOCKFIRST) -> KVLayout:
        """Layout of ``num_blocks`` blocks; host and disk tiers are always BLOCKFIRST (a block is
        one span: one disk I/O, one checksum)."""
        return KVLayout(type, model, self.tokens_per_block, num_blocks)

    def tier_blocks(self, model: ModelSpec) -> dict[str, int]:
        """Capacities in blocks of ``model``; a tier configured > 0 GB that holds no block errs."""
        block_bytes = self.layout(model, 1).block_bytes
        out: dict[str, int] = {}
        for tier, key in (("host", "cpu_cache_gb"), ("disk", "ssd_cache_gb")):
            gb = getattr(self, key)
            blocks = int(gb * GiB) // block_bytes
            if gb > 0 and blocks == 0:
                need = block_bytes / GiB
                raise ConfigError(
                    f"{key}={gb} holds no block of {block_bytes} bytes "
                    f"({self.tokens_per_block} tokens of this model): set {key} >= {need:.6f} "
                    "or lower tokens_per_block"
                )
            out[tier] = blocks
        if out["host"] == 0:
            self.require_host_tier()
        return out

    def require_host_tier(self, origin: str = "") -> None:
        """ConfigError unless cpu_cache_gb > 0: the host tier stages every transfer. ``origin``
        (e.g. "--set cpu_cache_gb=0") says where the value came from."""
        if self.cpu_cache_gb <= 0:
            where = f" ({origin})" if origin else ""
            raise ConfigError(
                f"cpu_cache_gb={self.cpu_cache_gb:g}{where}: the host tier stages every transfer, so it needs "
                "room: set cpu_cache_gb > 0"
            )

    def remote_config(self) -> RemoteConfig:
        """The remote tier's settings; ConfigError naming the key and the fix when they cannot work."""
        from dynamo_flexkv.core.remote.config import RemoteConfig, RemoteConfigError

        if not self.remote_cache_url:
            raise ConfigError(
                "enable_remote=true needs remote_cache_url (redis://host:port, "
                "redis+cluster://h:p,h:p,...): set it, or let `serve` start a local redis-server "
                "(it sets the URL for its workers), or set enable_remote=false"
            )
        if self.remote_ttl_s < 0:
            raise ConfigError(f"remote_ttl_s={self.remote_ttl_s} must be >= 0 (0 = no expiry)")
        try:
            return RemoteConfig(
                url=self.remote_cache_url,
                password_env=self.remote_password_env,
                timeout_s=self.remote_timeout_s,
                connect_timeout_s=self.remote_connect_timeout_s,
                ttl_s=self.remote_ttl_s or None,
                key_prefix=self.remote_key_prefix,
                quota_bytes=int(self.remote_quota_gb * GiB),
                tenant=self.remote_tenant,
            )
        except RemoteConfigError as e:
            raise ConfigError(str(e)) from None

    # ---- checks ----------------------------------------------------------------------------
    def _validate(self) -> None:
        tpb = self.tokens_per_block
        if tpb <= 0 or tpb & (tpb - 1):
            raise ConfigError(f"tokens_per_block={tpb} must be a power of two (e.g. 16, 32, 64)")
        for key in ("cpu_cache_gb", "ssd_cache_gb", "hit_reward_seconds"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0")
        if not is_duration(self.task_result_ttl_seconds):
            raise ConfigError(
                f"task_result_ttl_seconds={self.task_result_ttl_seconds} must be > 0: the time a "
                "finished task's result waits for wait() before it is dropped"
            )
        for key in ("evict_start_threshold", "evict_ratio"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"{key}={value} must be in (0, 1], a fraction of the tier")
        for key in ("slru_protected_hits", "disk_admission_hits"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0")
        if self.max_tasks_in_flight < 1:
            raise ConfigError(f"max_tasks_in_flight={self.max_tasks_in_flight} must be >= 1")
        if not 1 <= self.io_queue_depth <= 32768:
            raise ConfigError(f"io_queue_depth={self.io_queue_depth} must be in [1, 32768]")
        if self.ssd_cache_gb > 0:
            if not self.ssd_cache_dir:
                raise ConfigError(
                    f"ssd_cache_gb={self.ssd_cache_gb} needs ssd_cache_dir: set it "
                    "(';'-separated for several disks) or set ssd_cache_gb=0"
                )
            if self.ssd_cache_gb < self.cpu_cache_gb:
                raise ConfigError(
                    f"ssd_cache_gb={self.ssd_cache_gb} is smaller than cpu_cache_gb="
                    f"{self.cpu_cache_gb}: the disk tier would hold less than host memory; "
                    "raise ssd_cache_gb or set it to 0 to disable the disk tier"
                )
            seen: dict[str, str] = {}
            for d in self.ssd_cache_dir:
                real = os.path.realpath(d)
                if real in seen:  # two stripes in one directory would share (and fight over) its files
                    raise ConfigError(
                        f"ssd_cache_dir lists {real!r} twice ({seen[real]!r} and {d!r}): name each directory once"
                    )
                seen[real] = d
                _check_writable_dir(d)
        if self.remote_quota_gb < 0:
            raise ConfigError(f"remote_quota_gb={self.remote_quota_gb} must be >= 0 (0 = no quota)")
        if self.remote_quota_gb > 0 and not self.enable_remote:
            raise ConfigError(
                f"remote_quota_gb={self.remote_quota_gb} bounds the remote tier, which is off: "
                "set enable_remote=true, or remote_quota_gb=0"
            )
        if self.enable_remote:
            self.remote_config()  # a bad URL or setting fails here, naming remote_<key>
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"tp_rank={self.tp_rank} with tp_size={self.tp_size}: tp_size must be >= 1 and "
                "tp_rank in [0, tp_size) (set both to the engine's tensor-parallel rank and size)"
            )
        if self.mode not in MODES:
            raise ConfigError(
                f"mode={self.mode!r}: use one of {list(MODES)} (embedded: this engine's own tiers; "
                "node: the node's cache service at node_socket)"
            )
        if self.remote_admission_hits < 0:
            raise ConfigError(f"remote_admission_hits={self.remote_admission_hits} must be >= 0")
        if self.enable_gds and self.ssd_cache_gb <= 0:
            raise ConfigError("enable_gds=true needs a disk tier: set ssd_cache_gb and ssd_cache_dir")
        if self.enable_gds and not self.enable_nixl:
            raise ConfigError(
                "enable_gds=true moves disk blocks through NIXL's GDS_MT backend: set "
                "enable_nixl=true as well, or enable_gds=false"
            )


def read_yaml_mapping(
    path: str, fix: str = "", holds: str = "keys to values", shown: str | None = None
) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; any other case is a ConfigError naming the file
    (as ``shown``, e.g. with the option or variable that named it)."""
    shown = shown or path
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {shown}: {e.strerror}{fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {shown} is not UTF-8 text (byte {e.start}): save it as UTF-8{fix}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: e.g. a date like 2024-13-45
        raise ConfigError(f"config file {shown} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {shown} must hold a mapping of {holds}")
    return data


def env_origin(var: str) -> str:
    """How an error names a value that came from environment variable ``var``."""
    return f"environment variable {var}"


def parse_sets(items: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A command's ``--set KEY=VALUE`` items: key -> (the item, its value); a later one wins."""
    out: dict[str, tuple[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set cpu_cache_gb=8")
        out[key.strip()] = (item, value)
    return out


def cite_origins(message: str, origins: Mapping[str, str]) -> str:
    """``message`` with where each key it names came from, e.g. "... (ssd_cache_gb from environment
    variable FLEXKV_SSD_CACHE_GB)": a check of several keys cannot know which one the user typed."""
    named = []  # (where the message first names the key, key): cited in the message's order
    for key in origins:
        found = re.search(rf"\b{re.escape(key)}\b", message)
        if found:
            named.append((found.start(), key))
    by_origin: dict[str, list] = {}
    for _, key in sorted(named):
        by_origin.setdefault(origins[key], []).append(key)
    if not by_origin:
        return message
    cited = "; ".join(f"{', '.join(keys)} from {origin}" for origin, keys in by_origin.items())
    return f"{message} ({cited})"


def _build(cls: Any, data: Mapping[str, Any], source: str, origins: Mapping[str, str]) -> CacheConfig:
    """A CacheConfig of ``data``: each value parsed and named by its origin (``origins``, else
    ``source``); a check across keys that fails cites the origins of the keys it names."""
    values = _coerce_all(data, source, origins)
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(cite_origins(str(e), origins)) from None


def env_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that CacheConfig.load applies over the file: variable -> the
    config key it sets (values are left out: one may hold a password)."""
    names = {f"FLEXKV_{f.name.upper()}": f.name for f in dataclasses.fields(CacheConfig)}
    names.update(ENV_ALIASES)
    return {var: names[var] for var in sorted(names) if var in env}


def unknown_env(env: Mapping[str, str], password_env: str = DEFAULT_PASSWORD_ENV) -> dict[str, str | None]:
    """The FLEXKV_* variables of ``env`` that nothing reads, each a misspelling until shown otherwise
    (e.g. FLEXKV_CPU_CACHE_G): variable -> the closest name that is read, or None.
    ``password_env``: the variable a config's remote_password_env names (read too)."""
    known = [f"FLEXKV_{f.name.upper()}" for f in dataclasses.fields(CacheConfig)] + [*OTHER_ENV, password_env]
    out: dict[str, str | None] = {}
    for var in sorted(env):
        if var.startswith("FLEXKV_") and var not in known and not var.startswith(TEST_ENV_PREFIX):
            # Compared without the prefix all share: FLEXKV_FOO is nothing's misspelling
            # and case aside (FLEXKV_cpu_cache_gb means FLEXKV_CPU_CACHE_GB)
            near = difflib.get_close_matches(var[7:].upper(), [k[7:] for k in known if k.startswith("FLEXKV_")], n=1)
            out[var] = f"FLEXKV_{near[0]}" if near else None
    return out


def unknown_env_message(var: str, near: str | None) -> str:
    hint = f"did you mean {near}?" if near else "docs/CONFIGURATION.md lists the variables"
    return f"environment variable {var} is not one dynamo-flexkv reads ({hint}): it has no effect; rename or unset it"


_warned_env: set = set()  # each unknown variable is warned about once per process


def _warn_unknown_env(env: Mapping[str, str], password_env: str) -> None:
    for var, near in unknown_env(env, password_env).items():
        if var not in _warned_env:
            _warned_env.add(var)
            log.warning("%s", unknown_env_message(var, near))


def _env_values(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Collects FLEXKV_<KEY> and the KVBM aliases: key -> (variable, value); two names for one key
    must agree."""
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    found: dict[str, tuple[str, str]] = {}
    names = {f"FLEXKV_{k.upper()}": k for k in fields}
    names.update(ENV_ALIASES)
    for var, key in names.items():
        if var not in env:
            continue
        # Compare parsed values: "2" and "2.0" agree.
        if key in found and _coerce(key, fields[key].default, found[key][1], env_origin(found[key][0])) != _coerce(
            key, fields[key].default, env[var], env_origin(var)
        ):
            other = found[key][0]
            raise ConfigError(f"{other}={found[key][1]!r} and {var}={env[var]!r} both set {key}: unset one")
        found[key] = (var, env[var])
    return found


def _coerce_all(data: Mapping[str, Any], source: str, origins: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Each value of ``data`` parsed for its key; errors name the key's origin (``origins``, else
    ``source``)."""
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        origin = (origins or {}).get(key, source)
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key {key!r} in {origin}{hint}")
        out[key] = _coerce(key, fields[key].default, value, origin)
    return out


def _coerce(key: str, default: Any, value: Any, source: str) -> Any:
    try:
        if isinstance(default, bool):
            return _parse_bool(value)
        if isinstance(default, EvictionPolicy):
            return EvictionPolicy.parse(value)
        if isinstance(default, LoadPolicy):
            return LoadPolicy.parse(value)
        if isinstance(default, tuple):
            if isinstance(value, (str, os.PathLike)):
                value = os.fspath(value).split(";")
            elif not isinstance(value, (list, tuple)):
                raise TypeError(f"expected a ';'-separated string or a list of directories, got {type(value).__name__}")
            return tuple(str(Path(os.fspath(p).strip()).expanduser()) for p in value if str(os.fspath(p)).strip())
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError("expected a number")
            value = float(value)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError("expected a finite number")
            return value
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{key}={value!r} in {source} is invalid: {e}") from None
    return value


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true/false")


def _check_writable_dir(directory: str) -> None:
    """That the disk tier could use ``directory``: written to where it exists, else its nearest
    existing parent (reading a config creates nothing; the disk tier makes it when it starts)."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".flexkv-probe-"):
            pass
    except OSError as e:
        where = "" if probe == os.path.abspath(directory) else f" (its nearest existing parent {probe!r})"
        raise ConfigError(
            f"ssd_cache_dir {directory!r}{where} is not writable ({e.strerror}): point ssd_cache_dir at a "
            "directory this user can write, or set ssd_cache_gb=0"
        ) from None
