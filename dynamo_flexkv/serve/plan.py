"""A graph plus its config file, checked and turned into the processes to start.

Everything that can be wrong is found here, before any process starts: an unknown component or
option, a model that is neither a preset nor a directory, a port already in use, an SSD directory
this user cannot write, a missing etcd/NATS binary. Each error names the section, the key and the
fix.

Config file: a ``Common`` section whose options apply to every component that has them, then one
section per component of the graph (its options override Common's). Worker option ``cache`` holds
CacheConfig keys (dynamo_flexkv.config); ``{replica}`` in a value becomes the replica's number.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import yaml

from dynamo_flexkv.config import CacheConfig, ConfigError, read_yaml_mapping
from dynamo_flexkv.disagg.leases import handover_seconds_problem
from dynamo_flexkv.disagg.params import SECRET_ENV as HANDOVER_SECRET_ENV
from dynamo_flexkv.dynamo import LOOPBACK_ENV
from dynamo_flexkv.durations import is_duration
from dynamo_flexkv.remote.config import DEFAULT_PASSWORD_ENV, split_password
from dynamo_flexkv.remote.server import local_redis_settings, redis_conf
from dynamo_flexkv.storage.ssd import SsdInUseError, check_dir_free
from dynamo_flexkv.serve import vllm_worker as _vllm
from dynamo_flexkv.serve.graph import Graph, GraphError, Kind
from dynamo_flexkv.sysutil import find_binary, free_port, port_is_free

LOOPBACK = "127.0.0.1"
# Dynamo's frontend answers a stream 200 before the worker's first event unless told to wait for
# it: a stream the worker refuses (request limits, unsupported options) then gets 200 and an SSE
# error event. Holding the headers up to this long turns that refusal into a 400 with the
# worker's message; an accepted stream's first token is not delayed (its headers go with it).
PRE_COMMIT_PEEK_ENV = "DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS"
PRE_COMMIT_PEEK_MS = "500"
SYSTEM_PORT_MAX = 32767  # Dynamo reads DYN_SYSTEM_PORT as an i16: a worker's system port must stay below 32768
SYSTEM_PORT_RANGE = (21000, 32000)  # where serve picks system ports for workers without system-port


def _str(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ValueError("expected a string")
    return str(v)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected an integer")
    return v


def _float(v: Any) -> float:
    # YAML 1.1 reads 1e3 (no dot, no sign in the exponent) as a string: a number to the user.
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("expected a number")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("expected true or false")
    return v


def _args(v: Any) -> List[str]:
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise ValueError("expected a list of strings")
    return list(v)


def _mapping(v: Any) -> Dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("expected a mapping of CacheConfig keys")
    return dict(v)


ROUTER_MODES = ("round-robin", "random", "power-of-two", "kv", "least-loaded")
OPTIONS: Dict[Kind, Dict[str, Callable[[Any], Any]]] = {
    Kind.FRONTEND: {
        "namespace": _str, "http-port": _int, "router-mode": _str, "migration-limit": _int,
        "router-host-cache-hit-weight": _float, "router-disk-cache-hit-weight": _float, "extra-args": _args,
        "kv-cache-block-size": _int,  # the router's block size; serve sets it from vLLM workers' block-size
    },
    Kind.WORKER: {
        "model": _str, "served-model-name": _str, "namespace": _str, "replicas": _int,
        "num-device-blocks": _int, "offload": _bool, "bulk-load": _bool, "device-prefix-cache": _bool,
        "system-port": _int, "cache": _mapping, "extra-args": _args,
        "on-death": _str, "max-restarts": _int, "restart-window-s": _float, "restart-backoff-s": _float,
        "liveness-timeout-s": _float, "disaggregation-mode": _str, "handover-lease-s": _float, "handover-timeout-s": _float,
    },
}
DISAGG_MODES = ("agg", "prefill", "decode")
DEFAULTS: Dict[Kind, Dict[str, Any]] = {
    # migration-limit: how often the frontend may move an in-flight request to another worker when
    # its worker dies (Dynamo's default, 0, fails those requests with a 503).
    Kind.FRONTEND: {"namespace": "dynamo", "http-port": 8000, "router-mode": "kv", "migration-limit": 3,
                    "extra-args": []},
    Kind.WORKER: {"model": "small", "namespace": "dynamo", "replicas": 1, "num-device-blocks": 256,
                  "offload": True, "bulk-load": False, "device-prefix-cache": True, "cache": {},
                  "extra-args": [], "on-death": "restart", "max-restarts": 3, "restart-window-s": 300.0,
                  "restart-backoff-s": 1.0, "liveness-timeout-s": 30.0, "disaggregation-mode": "agg", "handover-lease-s": 30.0,
                  "handover-timeout-s": 10.0},
}


# Worker options in seconds: (lowest, highest or None, whether the lowest itself is allowed, whether
# 0 turns the option off). One check for all of them, so each refuses NaN, inf and out-of-range
# values with a message naming the option.
SECONDS_OPTIONS: Dict[str, tuple] = {
    "restart-window-s": (0.0, None, False, False),
    "restart-backoff-s": (0.0, 30.0, True, False),
    "liveness-timeout-s": (5.0, 3600.0, True, True),
}


def seconds_problem(value: float, low: float, high: Optional[float], low_ok: bool, zero_off: bool) -> Optional[str]:
    """Why ``value`` cannot be this option's number of seconds; None if it can."""
    if zero_off and value == 0:
        return None
    if is_duration(value, low, high, low_ok):
        return None
    if high is None:
        want = f"> {low:g} seconds"
    else:
        want = f"between {low:g} and {high:g} seconds"
    return f"{value} must be {'0 (off) or ' if zero_off else ''}{want} (a finite number)"


class OnDeath(Enum):
    RESTART = "restart"  # start it again, same replica, ports and SSD directory, within its budget
    STOP = "stop"  # stop the whole graph, exit 1


@dataclass(frozen=True)
class RestartPolicy:
    """What the launcher does when a worker exits on its own. A worker that dies more than
    ``max_restarts`` times within ``window_s`` seconds stops the graph (exit 1). The n-th restart
    within the window waits ``backoff_s * 2**(n-1)`` seconds (at most 30)."""
    on_death: OnDeath = OnDeath.RESTART
    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    liveness_s: float = 30.0  # a ready worker whose /health fails this long is SIGKILLed as hung; 0: off

    def delay(self, deaths_in_window: int) -> float:
        return min(30.0, self.backoff_s * 2 ** max(0, deaths_in_window - 1))


@dataclass
class Process:
    name: str  # what its log lines are prefixed with
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict, repr=False)  # on top of the launcher's environment; secrets: kept out of repr
    kind: Optional[Kind] = None  # None: infrastructure (etcd, NATS)
    port: Optional[int] = None  # frontend: HTTP; worker: system port (/health, /metrics); infra: client
    cache: Optional[CacheConfig] = None  # workers with offload
    files: Dict[str, str] = field(default_factory=dict)  # path -> text, written before it starts
    restart: RestartPolicy = RestartPolicy(OnDeath.STOP)  # frontend and infrastructure: always stop
    engine: str = "flexkv"  # workers: "flexkv" (dynamo_flexkv.worker) or "vllm" (dynamo.vllm)
    block_size: int = 0  # workers: tokens per KV block (what the router hashes)
    dirs: List[str] = field(default_factory=list)  # made before it starts (e.g. its HOME)
    # Stopping a ready one: SIGINT to its whole process group, or (False) to the process alone, which
    # stops its own children in order (dynamo.vllm: its EngineCore, which stops its Worker).
    stop_group: bool = True

    @property
    def metrics_url(self) -> Optional[str]:
        """Frontend: on its HTTP port; worker: on its Dynamo system port; infrastructure: none."""
        return None if self.kind is None else f"http://{LOOPBACK}:{self.port}/metrics"


@dataclass
class LaunchPlan:
    graph: Graph
    run_dir: Path
    model: str
    served_model_name: str
    http_port: int
    discovery_backend: str
    event_plane: str
    infra: List[Process]
    processes: List[Process]  # frontend first, then the workers
    write_model: bool = True  # the launcher writes run_dir/model from the preset ``model`` (a vLLM worker
                              # on its own Hugging Face directory needs none)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def workers(self) -> List[Process]:
        return [p for p in self.processes if p.kind is Kind.WORKER]


def load_config(path: Optional[str]) -> Dict[str, Any]:
    if path is None:
        return {}
    try:
        return read_yaml_mapping(path, holds="sections (Common, then one per component)")
    except ConfigError as e:
        raise GraphError(str(e)) from None


def apply_overrides(config: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """``Section.key=value`` (value parsed as YAML; ``Section.cache.key=value`` reaches into cache)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for item in overrides:
        path, sep, value = item.partition("=")
        parts = path.split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise GraphError(f"--set {item!r}: expected Section.key=value (e.g. FlexKVWorker.replicas=3)")
        node = out.setdefault(parts[0], {})
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return out


def build_plan(graph: Graph, config: Mapping[str, Any], *, run_dir: Path, discovery_backend: str = "file",
               event_plane: str = "zmq", source: str = "config", local: bool = True) -> LaunchPlan:
    """``local=False`` (rendering for elsewhere): ports and SSD directories are not probed on this
    machine and no etcd/NATS is planned."""
    sections = dict(config)
    common = sections.pop("Common", None) or {}
    if not isinstance(common, dict):
        raise GraphError(f"{source}: Common must be a mapping of options")
    known = [c.name for c in graph.components]
    for name in sections:
        if name not in known:
            raise GraphError(f"{source}: unknown component {name!r}: graph {graph.name} has {known} "
                             "(plus Common); rename or remove that section")
    all_keys = set().union(*(OPTIONS[k] for k in Kind), _vllm.options(OPTIONS[Kind.WORKER]))
    for key in common:
        if key not in all_keys:
            raise GraphError(f"{source}: Common.{key} is not an option of any component; known: {sorted(all_keys)}")
    if discovery_backend not in ("file", "etcd"):
        raise GraphError(f"--discovery-backend {discovery_backend!r}: use file (default) or etcd")
    if event_plane not in ("zmq", "nats"):
        raise GraphError(f"--event-plane {event_plane!r}: use zmq (default) or nats")

    ports = _PortBook(probe=local)
    run_dir = Path(run_dir)
    infra, env = _infra(run_dir, discovery_backend, event_plane, ports) if local else ([], {})
    redis: Dict[str, Any] = {}  # the graph's own redis-server, when a worker enables remote without a URL
    processes: List[Process] = []
    model = served = None
    http_port = 0
    front_opts: Dict[str, Any] = {}
    write_model = False
    ssd_dirs: Dict[str, str] = {}  # every worker's SSD directories: no two may share one
    if local and any(c.engine == _vllm.ENGINE for c in graph.components):
        _vllm.check_installed(source)
    for comp in graph.components:
        own = sections.get(comp.name) or {}
        if not isinstance(own, dict):
            raise GraphError(f"{source}: section {comp.name} must be a mapping of options")
        allowed = _allowed(comp.kind, comp.engine)
        opts = _options(comp.kind, comp.name, {**comp.defaults, **{k: v for k, v in common.items()
                                                                  if k in allowed}, **own}, source, comp.engine)
        if comp.kind is Kind.FRONTEND:
            front_opts = opts
            http_port = ports.take(opts["http-port"], f"{comp.name}.http-port", source, any_port=True)
            processes.insert(0, _frontend(comp.name, opts, http_port, discovery_backend, event_plane, env))
        elif comp.engine == _vllm.ENGINE:
            model, served = opts["model"], opts.get("served-model-name") or f"vllm-{Path(opts['model']).name}"
            procs = _vllm.workers(comp.name, opts, served, run_dir, discovery_backend, event_plane, env,
                                  ports, source, local, redis, ssd_dirs)
            write_model = write_model or procs[0].argv[procs[0].argv.index("--model") + 1] == str(run_dir / "model")
            processes += procs
        else:
            model, served = opts["model"], opts.get("served-model-name") or f"flexkv-{opts['model']}"
            processes += _workers(comp.name, opts, served, run_dir, discovery_backend, event_plane, env,
                                  ports, source, local, redis, ssd_dirs)
            write_model = True
    if local:  # one secret per graph: prefill workers sign handovers, decode workers check them
        secret = secrets.token_hex(32)
        for proc in processes:
            if proc.kind is Kind.WORKER and proc.engine == "flexkv":
                proc.env[HANDOVER_SECRET_ENV] = secret
        _vllm.pin_cpus(processes)
    _check_roles(processes, source)
    _check_block_size(processes, front_opts, graph, source)
    if redis:
        infra.append(_redis_process(run_dir, redis))
    return LaunchPlan(graph, run_dir, model, served, http_port, discovery_backend, event_plane, infra, processes,
                      write_model)


def _allowed(kind: Kind, engine: str) -> Dict[str, Callable[[Any], Any]]:
    if kind is Kind.WORKER and engine == _vllm.ENGINE:
        return _vllm.options(OPTIONS[Kind.WORKER])
    return OPTIONS[kind]


def _check_block_size(processes: List[Process], front: Dict[str, Any], graph: Graph, source: str) -> None:
    """Dynamo's KV router hashes prompts in blocks of one size; every worker's KV events count in
    blocks of its own: they must agree. A vLLM worker's model card does not carry its block size,
    so the frontend is told (--kv-cache-block-size) whenever the graph has one."""
    workers = [p for p in processes if p.kind is Kind.WORKER]
    sizes = {p.block_size for p in workers}
    if len(sizes) > 1:
        each = ", ".join(f"{p.name}: {p.block_size}" for p in workers)
        raise GraphError(f"{source}: the workers' KV block sizes differ ({each}): "
                         "the router hashes one block size; set the same block-size (vLLM) / model preset "
                         "block_size (FlexKVWorker) on every worker")
    size = sizes.pop()
    frontend = processes[0]
    name = next(c.name for c in graph.components if c.kind is Kind.FRONTEND)
    given = front.get("kv-cache-block-size")
    vllm = [p for p in workers if p.engine == _vllm.ENGINE]
    if given is not None and given != size:
        raise GraphError(f"{source}: {name}.kv-cache-block-size={given} but the workers' KV blocks hold {size} tokens "
                         f"({workers[0].name}): the router would hash other blocks than the workers report; set it "
                         f"to {size}, or leave it out (serve sets it from the workers)")
    if given is not None or vllm:
        at = frontend.argv.index("--migration-limit") + 2
        frontend.argv[at:at] = ["--kv-cache-block-size", str(size)]


def _check_roles(processes: List[Process], source: str) -> None:
    """Dynamo's frontend routes to prefill workers only in front of decode workers of the same
    model; either role alone would serve nothing (prefill) or fail every request (decode)."""
    modes = {p.argv[p.argv.index("--disaggregation-mode") + 1] if "--disaggregation-mode" in p.argv else "agg"
             for p in processes if p.kind is Kind.WORKER}
    if "agg" in modes and len(modes) > 1:
        raise GraphError(f"{source}: aggregated and disaggregated workers of one model in one graph: the "
                         "frontend would send some requests past the prefill router; use one kind")
    if ("prefill" in modes) != ("decode" in modes):
        have, need = ("prefill", "decode") if "prefill" in modes else ("decode", "prefill")
        raise GraphError(f"{source}: the graph has {have} workers but no {need} worker: set "
                         f"disaggregation-mode: {need} on another worker component (see graphs/disagg.py)")


def _options(kind: Kind, name: str, raw: Mapping[str, Any], source: str, engine: str = "flexkv") -> Dict[str, Any]:
    vllm = kind is Kind.WORKER and engine == _vllm.ENGINE
    allowed = _allowed(kind, engine)
    out = _vllm.defaults(DEFAULTS[kind]) if vllm else dict(DEFAULTS[kind])
    for key, value in raw.items():
        if key not in allowed:
            raise GraphError(f"{source}: {name}.{key} is not an option of a {kind.value}; known: {sorted(allowed)}")
        try:
            out[key] = allowed[key](value)
        except ValueError as e:
            raise GraphError(f"{source}: {name}.{key}={value!r}: {e}") from None
    if kind is Kind.FRONTEND:
        if out["router-mode"] not in ROUTER_MODES:
            raise GraphError(f"{source}: {name}.router-mode={out['router-mode']!r}: use one of {list(ROUTER_MODES)}")
        if out["migration-limit"] < 0:
            raise GraphError(f"{source}: {name}.migration-limit={out['migration-limit']} must be >= 0 "
                             "(0 turns migration off: a dead worker's requests fail with a 503)")
        for flag in ("--migration-limit", "--kv-cache-block-size"):
            if any(a.split("=", 1)[0] == flag for a in out["extra-args"]):
                raise GraphError(f"{source}: {name}.extra-args sets {flag}: use {name}.{flag[2:]}")
    if kind is Kind.WORKER:
        if out["replicas"] < 1:
            raise GraphError(f"{source}: {name}.replicas={out['replicas']} must be >= 1")
        if not vllm and out["num-device-blocks"] < 1:
            raise GraphError(f"{source}: {name}.num-device-blocks must be >= 1")
        if out["on-death"] not in {d.value for d in OnDeath}:
            raise GraphError(f"{source}: {name}.on-death={out['on-death']!r}: use restart (start the worker "
                             "again) or stop (stop the whole graph)")
        if out["max-restarts"] < 0:
            raise GraphError(f"{source}: {name}.max-restarts={out['max-restarts']} must be >= 0")
        for key, bounds in SECONDS_OPTIONS.items():
            problem = seconds_problem(out[key], *bounds)
            if problem is not None:
                raise GraphError(f"{source}: {name}.{key}={problem}")
        if vllm:
            _vllm.check(name, out, source)
            return out
        if out["disaggregation-mode"] not in DISAGG_MODES:
            raise GraphError(f"{source}: {name}.disaggregation-mode={out['disaggregation-mode']!r}: use one of "
                             f"{list(DISAGG_MODES)}")
        for key in ("handover-lease-s", "handover-timeout-s"):
            problem = handover_seconds_problem(out[key])
            if problem is not None:
                raise GraphError(f"{source}: {name}.{key}={problem}")
        if out["disaggregation-mode"] == "prefill" and not out["device-prefix-cache"]:
            raise GraphError(f"{source}: {name}: a prefill worker hands its device prefix cache over; set "
                             "device-prefix-cache: true")
    return out


def _frontend(name: str, o: Dict[str, Any], port: int, discovery: str, event_plane: str,
              env: Dict[str, str]) -> Process:
    argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(port),
            "--router-mode", o["router-mode"], "--namespace", o["namespace"],
            "--discovery-backend", discovery, "--event-plane", event_plane,
            "--migration-limit", str(o["migration-limit"])]
    for key in ("router-host-cache-hit-weight", "router-disk-cache-hit-weight"):
        if key in o:
            argv += [f"--{key}", str(o[key])]
    fenv = dict(env)
    if PRE_COMMIT_PEEK_ENV not in os.environ:  # an operator's own setting wins
        fenv[PRE_COMMIT_PEEK_ENV] = PRE_COMMIT_PEEK_MS
    return Process(name, argv + o["extra-args"], fenv, Kind.FRONTEND, port)


def _workers(name: str, o: Dict[str, Any], served: str, run_dir: Path, discovery: str, event_plane: str,
             env: Dict[str, str], ports: "_PortBook", source: str, local: bool,
             redis: Optional[Dict[str, Any]] = None, dirs: Optional[Dict[str, str]] = None) -> List[Process]:
    # The worker's option schema and model presets only: rendering and planning load no runtime.
    from dynamo_flexkv.dynamo.worker_args import build_parser
    from dynamo_flexkv.engine.config import EngineModelConfig

    try:
        model_cfg = EngineModelConfig.load(o["model"])
    except (ValueError, OSError, KeyError) as e:
        raise GraphError(f"{source}: {name}.model={o['model']!r}: {e}") from None
    argv = [sys.executable, "-m", "dynamo_flexkv.worker", "--model", o["model"], "--served-model-name", served,
            "--model-dir", str(run_dir / "model"), "--namespace", o["namespace"],
            "--discovery-backend", discovery, "--event-plane", event_plane,
            "--num-device-blocks", str(o["num-device-blocks"]),
            "--disaggregation-mode", o["disaggregation-mode"], "--handover-lease-s", str(o["handover-lease-s"]),
            "--handover-timeout-s", str(o["handover-timeout-s"])]
    if o["disaggregation-mode"] == "prefill":
        argv += ["--component", "prefill"]  # Dynamo's convention; decode and agg keep the default
    argv += ["--no-offload"] * (not o["offload"]) + ["--bulk-load"] * o["bulk-load"]
    argv += ["--no-device-prefix-cache"] * (not o["device-prefix-cache"]) + o["extra-args"]
    try:
        build_parser().parse_args(argv[3:])
    except SystemExit:
        raise GraphError(f"{source}: {name}.extra-args {o['extra-args']} are not worker options "
                         "(see python -m dynamo_flexkv.worker --help)") from None
    restart = restart_policy(o)
    out, dirs = [], ({} if dirs is None else dirs)
    for i in range(o["replicas"]):
        pname = f"{name}-{i}" if o["replicas"] > 1 else name
        penv = dict(env)
        cache, files = _replica_cache(name, pname, i, o, model_cfg.kv_spec(), model_cfg.block_size, run_dir, penv,
                                      ports, source, local, redis, dirs) if o["offload"] else (None, {})
        port = system_port(name, o, i, ports, source)
        penv["DYN_SYSTEM_PORT"] = str(port)
        out.append(Process(pname, list(argv), penv, Kind.WORKER, port, cache, files, restart,
                           block_size=model_cfg.block_size))
    return out


def restart_policy(o: Mapping[str, Any]) -> RestartPolicy:
    return RestartPolicy(OnDeath(o["on-death"]), o["max-restarts"], o["restart-window-s"],
                         o["restart-backoff-s"], o["liveness-timeout-s"])


def system_port(name: str, o: Mapping[str, Any], replica: int, ports: "_PortBook", source: str) -> int:
    """Replica ``replica``'s Dynamo system port (/health, /metrics): system-port + replica, or a free
    one (system-port unset or 0). Every replica's must be below 32768: Dynamo reads DYN_SYSTEM_PORT
    as an i16 and refuses the worker otherwise."""
    first = o.get("system-port") or 0
    if first:
        count = o.get("replicas", 1)
        last = first + count - 1
        if not 0 < first or last > SYSTEM_PORT_MAX:
            gives = f" with replicas={count} gives replica {count - 1} port {last}, which" \
                if count > 1 and 0 < first <= SYSTEM_PORT_MAX else ""
            raise GraphError(
                f"{source}: {name}.system-port={first}{gives} is out of range: Dynamo reads DYN_SYSTEM_PORT "
                f"as a 16-bit signed number, so each worker's system port must be below 32768 (1..{SYSTEM_PORT_MAX}); "
                f"set {name}.system-port to a port from 1 to {SYSTEM_PORT_MAX - count + 1}"
                + (f" ({count} replicas take {count} consecutive ports)" if count > 1 else "")
                + f", or leave it out and serve picks free ones in {SYSTEM_PORT_RANGE[0]}..{SYSTEM_PORT_RANGE[1]}")
    return ports.take(first + replica if first else 0, f"{name}.system-port", source, any_port=False)


def _replica_cache(name: str, pname: str, i: int, o: Mapping[str, Any], spec: Optional[Any], block_size: int,
                   run_dir: Path, penv: Dict[str, str], ports: "_PortBook", source: str, local: bool,
                   redis: Optional[Dict[str, Any]], dirs: Dict[str, str]):
    """One replica's tiers from the worker's ``cache`` section: checked (sizes against ``spec``, the
    KV shape, unless None; SSD directories free and not shared; a given Redis reachable), written to
    ``run_dir/<pname>.cache.yaml``, which FLEXKV_CONFIG_PATH names (CacheConfig.load reads it).
    A password in remote_cache_url stays out of that file: the worker gets it in the variable
    remote_password_env names (as the handover secret and the local redis's password reach it).
    Returns (CacheConfig, {path: text})."""
    values = {k: _per_replica(v, i) for k, v in o["cache"].items()}
    values["tokens_per_block"] = block_size
    given_url = bool(values.get("remote_cache_url"))
    if _parse_flag(values.get("enable_remote")) and not given_url and local and redis is not None:
        _local_redis(redis, ports, values, penv)
    try:
        checked = values if local else dict(values, ssd_cache_dir=tempfile.gettempdir())  # not our disks
        if not local and not given_url:  # Kubernetes: the URL comes from a Secret (render --k8s)
            checked["remote_cache_url"] = "redis://redis-from-secret:6379"
        cache = CacheConfig.from_dict(checked, f"{source}: {name}.cache")
        if spec is not None:
            cache.tier_blocks(spec)
    except ConfigError as e:
        raise GraphError(f"{source}: {name}.cache: {e}") from None
    if local and cache.enable_remote and given_url:
        _check_remote_reachable(cache, f"{source}: {name}.cache")
    for d in _dirs(values.get("ssd_cache_dir")) if cache.ssd_cache_gb > 0 else ():
        if local:
            try:
                check_dir_free(d)
            except SsdInUseError as e:
                raise GraphError(f"{source}: {name}.cache: {e}") from None
        if os.path.realpath(d) in dirs:
            raise GraphError(f"{source}: {name}.cache.ssd_cache_dir {d} is shared by {dirs[os.path.realpath(d)]} "
                             f"and {pname}: each worker needs its own; put {{replica}} in the path")
        dirs[os.path.realpath(d)] = pname
    url = values.get("remote_cache_url")
    url, password = split_password(url) if isinstance(url, str) else (url, None)
    if password is not None:  # the file names the server; its password goes by environment, like the local redis's
        values["remote_cache_url"] = url
        penv[cache.remote_password_env] = password
    cfg_path = str(run_dir / f"{pname}.cache.yaml")
    penv["FLEXKV_CONFIG_PATH"] = cfg_path
    return cache, {cfg_path: yaml.safe_dump(values, sort_keys=True)}


def _parse_flag(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "on")


def _local_redis(redis: Dict[str, Any], ports: "_PortBook", values: Dict[str, Any], penv: Dict[str, str]) -> None:
    """Points a worker at the graph's own redis-server (one for every worker: they share remote
    blocks). Its password is generated and reaches workers by environment only, never a file
    they log or a command line."""
    if not redis:
        redis.update(port=ports.take(0, "redis", "", any_port=True), password=secrets.token_hex(16))
    values["remote_cache_url"] = f"redis://{LOOPBACK}:{redis['port']}"
    env_var = values.get("remote_password_env") or DEFAULT_PASSWORD_ENV
    penv[env_var] = redis["password"]


def _redis_process(run_dir: Path, redis: Dict[str, Any], maxmemory: str = "1gb") -> Process:
    """redis-server for the graph: loopback, no persistence, allkeys-lru within maxmemory; the
    password sits in a 0600 config file (not on the command line, where ps would show it)."""
    exe = _need("redis-server", "redis-server")
    conf = run_dir / "redis" / "redis.conf"
    text = redis_conf(local_redis_settings(redis["port"], str(run_dir / "redis"), maxmemory,
                                           password=redis["password"]))
    return Process("redis", [exe, str(conf)], {}, None, redis["port"], files={str(conf): text})


def _check_remote_reachable(cache: CacheConfig, where: str) -> None:
    """serve refuses to start workers against a Redis it cannot reach or log in to."""
    from dynamo_flexkv.remote import RemoteError, RemoteStore
    try:
        RemoteStore(cache.remote_config(), 0, strict=True).close()
    except RemoteError as e:
        raise GraphError(f"{where}: {e}") from None


def _infra(run_dir: Path, discovery: str, event_plane: str, ports: "_PortBook"):
    """etcd and NATS for the non-default planes, on loopback, unless the environment names servers."""
    env = dict(LOOPBACK_ENV, HF_HUB_OFFLINE="1")  # the model directory is local; never download
    if discovery == "file":
        env["DYN_FILE_KV"] = str(run_dir / "discovery")
    procs = []
    if discovery == "etcd" and not os.environ.get("ETCD_ENDPOINTS"):
        exe = _need("etcd", "etcd-server")
        client, peer = ports.take(0, "etcd", "", any_port=True), ports.take(0, "etcd peer", "", any_port=True)
        url, purl = f"http://{LOOPBACK}:{client}", f"http://{LOOPBACK}:{peer}"
        procs.append(Process("etcd", [exe, "--name", "flexkv", "--data-dir", str(run_dir / "etcd"),
                                      "--listen-client-urls", url, "--advertise-client-urls", url,
                                      "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
                                      "--initial-cluster", f"flexkv={purl}"], {}, None, client))
        env["ETCD_ENDPOINTS"] = url
    if event_plane == "zmq" and not os.environ.get("DYN_ZMQ_BROKER_URL"):
        xsub, xpub = (f"tcp://{LOOPBACK}:{ports.take(0, 'zmq broker', '', any_port=True)}" for _ in range(2))
        procs.append(Process("zmq-broker", [sys.executable, "-m", "dynamo_flexkv.serve.zmq_broker", xsub, xpub],
                             {}, None, int(xpub.rsplit(":", 1)[1])))
        env["DYN_ZMQ_BROKER_URL"] = f"xsub={xsub} , xpub={xpub}"
    if event_plane == "nats" and not os.environ.get("NATS_SERVER"):
        exe = _need("nats-server", "nats-server")
        port = ports.take(0, "nats", "", any_port=True)
        procs.append(Process("nats", [exe, "-a", LOOPBACK, "-p", str(port), "-js", "-sd", str(run_dir / "nats")],
                             {}, None, port))
        env["NATS_SERVER"] = f"nats://{LOOPBACK}:{port}"
    return procs, env


def _need(exe: str, package: str) -> str:
    path = find_binary(exe)
    if path is None:
        raise GraphError(f"{exe} is not installed: `apt-get install {package}` (scripts/install.sh does), "
                         f"or point {'ETCD_ENDPOINTS' if exe == 'etcd' else 'NATS_SERVER'} at a running server")
    return path


class _PortBook:
    """Ports for this launch: asked-for ones must be free; 0 picks a free one (system ports from a
    range Dynamo accepts). Binding is the only honest check that a port is free."""

    def __init__(self, probe: bool = True) -> None:
        self.probe = probe
        self.taken: Dict[int, str] = {}
        self._next_system = SYSTEM_PORT_RANGE[0] + os.getpid() % 2000

    def take(self, port: int, what: str, source: str, any_port: bool) -> int:
        if port:
            if not 0 < port < (65536 if any_port else SYSTEM_PORT_MAX + 1):
                raise GraphError(f"{source}: {what}={port} is out of range"
                                 + ("" if any_port else f" (Dynamo's system port must be below {SYSTEM_PORT_MAX + 1})"))
            if port in self.taken or (self.probe and not _free(port)):
                holder = self.taken.get(port, "another process")
                raise GraphError(f"{source}: {what}={port} is in use by {holder} on {LOOPBACK}: stop it or "
                                 f"pick another port (e.g. --set {what}={port + 1})")
            self.taken[port] = what
            return port
        if any_port:
            while True:
                port = free_port(LOOPBACK)
                if port not in self.taken:
                    self.taken[port] = what
                    return port
        for _ in range(SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0]):
            port = self._next_system
            self._next_system = SYSTEM_PORT_RANGE[0] + (port + 1 - SYSTEM_PORT_RANGE[0]) % (
                SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0])
            if port not in self.taken and _free(port):
                self.taken[port] = what
                return port
        raise GraphError(f"no free port for {what} in {SYSTEM_PORT_RANGE}")

    def take_range(self, count: int, what: str, band: tuple) -> int:
        """The first of ``count`` consecutive free ports in ``band`` (for a process that scans upward
        from a base port, like vLLM from VLLM_PORT), all booked for ``what``."""
        span = band[1] - band[0] - count
        start = band[0] + (os.getpid() * count) % span
        for k in range(span // count):
            base = band[0] + (start - band[0] + k * count) % span
            block = range(base, base + count)
            if any(p in self.taken for p in block) or (self.probe and not all(_free(p) for p in block)):
                continue
            for p in block:
                self.taken[p] = what
            return base
        raise GraphError(f"no {count} consecutive free ports for {what} in {band}")


def _per_replica(value: Any, replica: int) -> Any:
    if isinstance(value, str):
        return value.replace("{replica}", str(replica))
    if isinstance(value, list):
        return [_per_replica(v, replica) for v in value]
    return value


def _dirs(value: Any) -> List[str]:
    """ssd_cache_dir as CacheConfig reads it: a list, or one string with ';' between directories."""
    if value is None:
        return []
    return [d for d in value.split(";") if d] if isinstance(value, str) else [str(d) for d in value]


def _free(port: int) -> bool:
    return port_is_free(port, LOOPBACK)
