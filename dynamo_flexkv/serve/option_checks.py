"""A component's options checked as a whole (serve/options.py holds each option's type, default
and bounds; a vLLM worker's own, serve/vllm_worker.py): the errors name the section, the key and
the fix."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dynamo_flexkv.integrations.disagg.leases import handover_seconds_problem
from dynamo_flexkv.integrations.vllm_connector.settings import PIPELINE_PARALLEL_UNSUPPORTED
from dynamo_flexkv.serve import vllm_worker as _vllm
from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.options import (
    DEFAULTS,
    DISAGG_MODES,
    OPTIONS,
    ROUTER_MODES,
    SECONDS_OPTIONS,
    OnDeath,
    parse_section,
    seconds_problem,
)
from dynamo_flexkv.serve.sources import origin_of


def allowed_options(kind: Kind, engine: str) -> dict[str, Callable[[Any], Any]]:
    if kind is Kind.WORKER and engine == _vllm.ENGINE:
        return _vllm.options(OPTIONS[Kind.WORKER])
    return OPTIONS[kind]


def check_options(kind: Kind, name: str, raw: Mapping[str, Any], source: str, engine: str = "flexkv") -> dict[str, Any]:
    vllm = kind is Kind.WORKER and engine == _vllm.ENGINE
    allowed = allowed_options(kind, engine)
    defaults = _vllm.defaults(DEFAULTS[kind]) if vllm else DEFAULTS[kind]
    out = parse_section(defaults, raw, allowed, source, name, f"a {kind.value}")
    if kind is Kind.FRONTEND:
        if out["router-mode"] not in ROUTER_MODES:
            raise GraphError(
                f"{origin_of(source, name, 'router-mode')}: "
                f"{name}.router-mode={out['router-mode']!r}: use one of {list(ROUTER_MODES)}"
            )
        if out["migration-limit"] < 0:
            raise GraphError(
                f"{origin_of(source, name, 'migration-limit')}: "
                f"{name}.migration-limit={out['migration-limit']} must be >= 0 "
                "(0 turns migration off: a dead worker's requests fail with a 503)"
            )
        for flag in ("--migration-limit", "--kv-cache-block-size"):
            if any(a.split("=", 1)[0] == flag for a in out["extra-args"]):
                raise GraphError(
                    f"{origin_of(source, name, 'extra-args')}: {name}.extra-args sets {flag}: use {name}.{flag[2:]}"
                )
    if kind is Kind.WORKER:
        if out["replicas"] < 1:
            raise GraphError(f"{origin_of(source, name, 'replicas')}: {name}.replicas={out['replicas']} must be >= 1")
        if not vllm and out["num-device-blocks"] < 1:
            raise GraphError(f"{origin_of(source, name, 'num-device-blocks')}: {name}.num-device-blocks must be >= 1")
        if out["on-death"] not in {d.value for d in OnDeath}:
            raise GraphError(
                f"{origin_of(source, name, 'on-death')}: "
                f"{name}.on-death={out['on-death']!r}: use restart (start the worker "
                "again) or stop (stop the whole graph)"
            )
        if out["max-restarts"] < 0:
            raise GraphError(
                f"{origin_of(source, name, 'max-restarts')}: {name}.max-restarts={out['max-restarts']} must be >= 0"
            )
        for key, bounds in SECONDS_OPTIONS.items():
            problem = seconds_problem(out[key], *bounds)
            if problem is not None:
                raise GraphError(f"{origin_of(source, name, key)}: {name}.{key}={problem}")
        if vllm:
            _vllm.check(name, out, source)
            if out["offload"]:
                _refuse_pipeline_parallel(name, out["extra-args"], source)
            return out
        if out["disaggregation-mode"] not in DISAGG_MODES:
            raise GraphError(
                f"{origin_of(source, name, 'disaggregation-mode')}: "
                f"{name}.disaggregation-mode={out['disaggregation-mode']!r}: use one of {list(DISAGG_MODES)}"
            )
        for key in ("handover-lease-s", "handover-timeout-s", "handover-renew-s"):
            problem = handover_seconds_problem(out[key])
            if problem is not None:
                raise GraphError(f"{origin_of(source, name, key)}: {name}.{key}={problem}")
        if out["handover-renew-s"] < 2:  # as the worker's --handover-renew-s refuses it
            raise GraphError(
                f"{origin_of(source, name, 'handover-renew-s')}: "
                f"{name}.handover-renew-s={out['handover-renew-s']} must be at least 2 seconds: "
                "the decode worker claims a lease with 1 s to spare"
            )
        if out["disaggregation-mode"] == "prefill" and not out["device-prefix-cache"]:
            raise GraphError(
                f"{origin_of(source, name, 'disaggregation-mode')}: {name}: a prefill worker hands its device "
                "prefix cache over; set device-prefix-cache: true"
            )
    return out


PIPELINE_FLAG = "--pipeline-parallel-size"


def pipeline_parallel_size(args: Sequence[Any]) -> str | None:
    """The pipeline-parallel size a vLLM command line's extra arguments set (None: not set), read
    as vLLM's argparse reads it: ``-pp``, underscores for dashes, ``=value`` or the next argument,
    an abbreviation; the last one wins."""
    size: str | None = None
    args = [str(a) for a in args]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        flag = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
        if flag == "-pp" or (len(flag) > 3 and PIPELINE_FLAG.startswith(flag)):
            size = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return size


def _refuse_pipeline_parallel(name: str, extra_args: Sequence[Any], source: str) -> None:
    size = pipeline_parallel_size(extra_args)
    if size is not None and size.strip() != "1":
        raise GraphError(
            f"{origin_of(source, name, 'extra-args')}: "
            f"{name}.extra-args sets {PIPELINE_FLAG} {size}, but {PIPELINE_PARALLEL_UNSUPPORTED}: "
            f"remove it (or set offload: false to run vLLM without FlexKVConnector); scale with "
            f"{name}.tensor-parallel-size or {name}.replicas instead"
        )
