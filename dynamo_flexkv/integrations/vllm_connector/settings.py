"""The connector's settings: vLLM's config plus ``kv_connector_extra_config`` (tier sizes and
policies come from FLEXKV_* / FLEXKV_CONFIG_PATH, as for the reference worker)."""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamo_flexkv.integrations.vllm_connector.groups import KVGroup, read_groups
from dynamo_flexkv.integrations.vllm_connector.hints import HintTier, parse_secondary_tiers

MAX_LEASE_S = 3600.0  # handover_lease_s's ceiling (serve's handover-lease-s too)
# handover_orphan_s's default: how long a prefill keeps what a request left without a hold (a
# release notice that came before a hold that never came, the digests of a request never held:
# aborted). Far above any lease, so a hold that comes late still finds both.
DEFAULT_HANDOVER_ORPHAN_S = 600.0
RUN_DIR_ENV = "FLEXKV_RUN_DIR"


def run_dir_or_default(run_dir: str | None) -> str:
    """Where the connector's sockets and files live: the run_dir setting, else $FLEXKV_RUN_DIR,
    else the temp directory."""
    return run_dir or os.environ.get(RUN_DIR_ENV) or tempfile.gettempdir()


# kv_connector_extra_config keys -> (field, type, default, what it does)
EXTRA_KEYS: dict[str, tuple] = {
    "layerwise": (bool, True, "load layer by layer, each attention layer waits only for its own layer"),
    "load": (bool, True, "load cached prefixes from the tiers"),
    "store": (bool, True, "store finished requests' computed blocks in the tiers"),
    "lookup_wait_ms": (float, 5.0, "longest the scheduler waits for a lookup answer before it asks again next step"),
    "lookup_give_up_s": (float, 2.0, "a lookup unanswered this long is a miss (the prompt is computed)"),
    "load_timeout_s": (float, 30.0, "a layer not loaded after this long is cancelled and recomputed"),
    "drain_timeout_s": (float, 20.0, "longest shutdown waits for stores still writing"),
    "handover": (
        bool,
        False,
        "disaggregated workers: carry the prefill->decode handover (NIXL READ of the prefill's "
        "blocks, verified by digest) instead of the next connector (docs/VLLM.md)",
    ),
    "handover_lease_s": (float, 30.0, "prefill side: how long a finished request's blocks wait for decode's read"),
    "handover_orphan_s": (
        float,
        DEFAULT_HANDOVER_ORPHAN_S,
        "prefill side: how long a release notice whose hold never came, and the digests of a request "
        "never held (aborted), are kept before they are dropped",
    ),
    "handover_verify": (
        str,
        "owner",
        "what decode checks before using handed-over blocks: owner (each block still "
        "held this prompt's prefix when read; trusts the transport and memory for the "
        "bytes) or bytes (also the xxh3 of every byte, all layers: a second pass over "
        "them on both roles); the same on both roles",
    ),
    "run_dir": (str, None, "directory of the lookup socket (default $FLEXKV_RUN_DIR or the temp dir)"),
    "request_log": (
        bool,
        False,
        "write each lookup's and load's decision to <run_dir>/flexkv-requests.jsonl (the replay's "
        "per-request accounting reads it)",
    ),
    "mover_hook": (
        str,
        None,
        "module:function called as function(link, mover) for each of this worker's copy links; "
        "returns the mover to use instead (fault injection and tracing, e.g. tests' "
        "wrong_kv:one_wrong_block; the module must be importable in vLLM's worker)",
    ),
    "secondary_tiers": (
        list,
        None,
        "Dynamo router hints (docs/HINTS.md): one entry with router_capabilities ['router_hint'], "
        "control_ports (one per local DP rank) and control_advertise_host; this worker then serves "
        "its host tier to peers there and pulls the prefixes the router's kv.fetch hints name",
    ),
    "model_id": (
        str,
        None,
        "names the weights in the disk and remote tiers' fingerprints (default: the model path "
        "or hub id with its revision, the load format, and for a local directory the names, "
        "sizes and modification times of its weight files)",
    ),
}


@dataclass(frozen=True)
class ConnectorSettings:
    block_size: int
    num_blocks: int
    engine_id: str
    layerwise: bool = EXTRA_KEYS["layerwise"][1]
    load: bool = EXTRA_KEYS["load"][1]
    store: bool = EXTRA_KEYS["store"][1]
    lookup_wait_ms: float = EXTRA_KEYS["lookup_wait_ms"][1]
    lookup_give_up_s: float = EXTRA_KEYS["lookup_give_up_s"][1]
    load_timeout_s: float = EXTRA_KEYS["load_timeout_s"][1]
    drain_timeout_s: float = EXTRA_KEYS["drain_timeout_s"][1]
    handover: bool = EXTRA_KEYS["handover"][1]
    handover_lease_s: float = EXTRA_KEYS["handover_lease_s"][1]
    handover_orphan_s: float = EXTRA_KEYS["handover_orphan_s"][1]
    handover_verify: str = EXTRA_KEYS["handover_verify"][1]
    run_dir: str | None = EXTRA_KEYS["run_dir"][1]
    request_log: bool = EXTRA_KEYS["request_log"][1]
    model_id: str = ""
    mover_hook: str | None = EXTRA_KEYS["mover_hook"][1]
    tp_size: int = 1  # tensor-parallel ranks: each has its own worker, tiers (or node shard) and lookup socket
    groups: tuple[KVGroup, ...] = ()  # vLLM's KV cache groups (groups.py); () when vLLM gave no config
    dp_rank: int | None = None  # this engine's data-parallel rank, when it is one of several
    max_model_len: int = 0
    secondary_tiers: HintTier | None = None  # router hints on (hints.py), else None
    dp_rank_local: int = 0  # this engine's data-parallel rank on its node (its control port's index)

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> ConnectorSettings:
        pc = vllm_config.parallel_config
        refuse_pipeline_parallel(int(pc.pipeline_parallel_size))
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        values = checked_extra_config(extra)
        values.setdefault("model_id", default_model_id(vllm_config))
        run_dir = values.get("run_dir") or os.environ.get(RUN_DIR_ENV)
        if run_dir and not (os.path.isdir(run_dir) and os.access(run_dir, os.W_OK)):
            where = "kv_connector_extra_config run_dir" if values.get("run_dir") else RUN_DIR_ENV
            raise ValueError(
                f"FlexKVConnector: {where}={run_dir!r} is not a writable directory (the lookup socket "
                "lives there): create it, or point it at one"
            )
        num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        groups = tuple(read_groups(kv_cache_config)) if kv_cache_config is not None else ()
        block_size = groups[0].block_size if groups else int(vllm_config.cache_config.block_size)
        # vLLM names each data-parallel engine <engine_id>_dp<rank> (v1/engine/core.py)
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        dp_rank = dp if str(kt.engine_id).endswith(f"_dp{dp}") else None
        return cls(
            block_size=block_size,
            num_blocks=num_blocks,
            engine_id=str(kt.engine_id),
            tp_size=int(pc.tensor_parallel_size),
            groups=groups,
            dp_rank=dp_rank,
            max_model_len=int(getattr(vllm_config.model_config, "max_model_len", 0) or 0),
            dp_rank_local=int(getattr(pc, "data_parallel_rank_local", 0) or 0),
            **values,
        )


PIPELINE_PARALLEL_UNSUPPORTED = (
    "FlexKVConnector does not support pipeline parallelism: the tiers' block keys, disk "
    "subdirectories, node-cache lookup socket, remote fingerprint and layout tag carry no pipeline "
    "stage, so two stages of equal layer counts would load each other's layers under valid checksums"
)


def refuse_pipeline_parallel(size: int) -> None:
    """Raises on a pipeline-parallel engine, at connector start (serve refuses the flag in a
    VllmWorker's extra-args for the same reason: serve/option_checks.py)."""
    if size > 1:
        raise ValueError(
            f"{PIPELINE_PARALLEL_UNSUPPORTED}; this engine has pipeline_parallel_size={size}: run "
            "with --pipeline-parallel-size 1 (tensor parallelism or more engines scale it instead)"
        )


def checked_extra_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The kv_connector_extra_config values, each checked (the one check: the connector at start,
    serve before it starts a worker); the defaults for keys left out, None ones dropped. Raises
    ValueError naming the key and what it must be."""
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(
            f"FlexKVConnector: unknown kv_connector_extra_config key(s) {unknown}; known: "
            + ", ".join(f"{k} ({v[2]})" for k, v in EXTRA_KEYS.items())
        )
    values: dict[str, Any] = {}
    for key, (typ, default, _) in EXTRA_KEYS.items():
        value = extra.get(key, default)
        if value is None:
            continue
        if typ is bool and not isinstance(value, bool):
            raise ValueError(f"FlexKVConnector: kv_connector_extra_config {key}={value!r} must be true or false")
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"FlexKVConnector: kv_connector_extra_config {key}={value!r} must be a finite positive number"
                )
            value = float(value)
        if key == "secondary_tiers":
            values[key] = parse_secondary_tiers(value)
            continue
        if typ is str and not isinstance(value, str):
            raise ValueError(f"FlexKVConnector: kv_connector_extra_config {key}={value!r} must be a string")
        if key == "handover_lease_s" and value > MAX_LEASE_S:
            raise ValueError(
                f"FlexKVConnector: kv_connector_extra_config handover_lease_s={value!r} is over "
                f"{MAX_LEASE_S:.0f} s, the longest a prefill holds blocks for decode: lower it"
            )
        if key == "model_id" and not value.strip():
            raise ValueError(
                "FlexKVConnector: kv_connector_extra_config model_id='' names no weights (tiers "
                "would share KV across models): name them, or leave the key out for the default"
            )
        if key == "mover_hook" and not _is_entry_point(value):
            raise ValueError(
                f"FlexKVConnector: kv_connector_extra_config mover_hook={value!r} must name a "
                "function as module:function, e.g. mypackage.faults:wrap"
            )
        if key == "handover_verify" and value not in ("bytes", "owner"):
            raise ValueError(
                f"FlexKVConnector: kv_connector_extra_config handover_verify={value!r} must be 'bytes' or 'owner'"
            )
        values[key] = value
    return values


def _is_entry_point(value: str) -> bool:
    module, _, attr = value.partition(":")
    return all(part.isidentifier() for part in module.split(".")) and attr.isidentifier()


def load_mover_hook(entry: str) -> Any:
    """The function ``module:function`` names (the mover_hook setting); a clear error if it is not there."""
    import importlib

    module, _, attr = entry.partition(":")
    try:
        hook = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"FlexKVConnector: kv_connector_extra_config mover_hook={entry!r} cannot be loaded in this "
            f"worker ({e}): put its module on the worker's PYTHONPATH"
        ) from None
    if not callable(hook):
        raise ValueError(f"FlexKVConnector: kv_connector_extra_config mover_hook={entry!r} is not a function")
    return hook


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# A LoRA adapter's: its weights, and its config (rank and alpha scale the weights' effect)
# What vLLM 0.31 reads of a LoRA adapter's directory (lora_model.py, peft_helper.py): these files
# at its top, nothing below (a trainer's output_dir keeps its checkpoints there).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def files_digest(directory: str, endings: tuple[str, ...] = WEIGHT_FILES) -> str | None:
    """16 hex digits naming the files under ``directory`` whose names end with one of ``endings``:
    their relative names, sizes and modification times (not their bytes: cheap enough to take per
    request, ~20 us for an adapter's two files). New files written over old ones at the same path
    give a new digest; a file that vanishes while it is read counts as absent. None where
    ``directory`` is not a directory (a hub id)."""
    digest = hashlib.sha256()
    found = False
    for root, _, names in sorted(os.walk(directory)):
        found = True
        below = root[len(directory) :].lstrip(os.sep)  # os.path.relpath's answer, at a tenth of its cost
        for name in sorted(names):
            if not name.endswith(endings):
                continue
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            digest.update(f"{os.path.join(below, name)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16] if found else None


def default_model_id(vllm_config: Any) -> str:
    """What tells two deployments' weights apart, so cached KV is shared only between the same
    weights: the model path or hub id, its revision, the load format, and for a local directory the
    names, sizes and modification times of its weight files (a new fine-tune written over the old
    one at the same path gets a new id; a copy of the same files does too, which only costs hits)."""
    mc = vllm_config.model_config
    parts = [str(mc.model)]
    if getattr(mc, "revision", None):
        parts.append(f"revision={mc.revision}")
    load_format = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    if load_format is not None and str(load_format) not in ("auto", "LoadFormat.AUTO"):
        parts.append(f"load={load_format}")
    digest = files_digest(str(mc.model))
    if digest is not None:
        parts.append(f"weights={digest}")
    return "|".join(parts)


def adapter_files_digest(path: str) -> str | None:
    """16 hex digits naming the adapter files vLLM reads at the top of ``path`` (ADAPTER_FILES):
    size, modification and change times and inode of each, so files written over the old ones (even
    with their sizes and modification times restored, as ``cp -p`` does) give another digest; a few
    stat calls, no walk. None where ``path`` is not a directory (a hub id)."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        return None
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()[:16]


def adapter_id(lora_name: str, lora_path: str) -> str:
    """What tells two LoRA adapters apart in the tiers' keys (their blocks' hashes take it as the
    adapter's name), as ``default_model_id`` does for the weights: the name, the path, and for a
    local directory the digest of its weights and config. vLLM's own prefix cache keys by name and
    path; the files' digest is what tells an adapter written over the old one at the same path
    (a hot-swap from the same ``file://`` URI) from the old one. A hub id gives name and path."""
    digest = adapter_files_digest(lora_path)
    return f"{lora_name}|{lora_path}" if digest is None else f"{lora_name}|{lora_path}|files={digest}"
