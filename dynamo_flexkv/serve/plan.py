"""A graph plus its config file, checked and turned into the processes to start.

Everything that can be wrong is found here, before any process starts: an unknown component or
option, a model that is neither a preset nor a directory, a port already in use, an SSD directory
this user cannot write, a missing etcd/NATS binary. Each error names the section, the key and the
fix.

Config file: a ``Common`` section whose options apply to every component that has them, then one
section per component of the graph (its options override Common's). Worker option ``cache`` holds
CacheConfig keys (dynamo_flexkv.core.config); ``{replica}`` in a value becomes the replica's number.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dynamo_flexkv.core.config import ConfigError, env_settings, read_yaml_mapping, unknown_env, unknown_env_message
from dynamo_flexkv.integrations.disagg.params import SECRET_ENV as HANDOVER_SECRET_ENV
from dynamo_flexkv.serve import node_cache as _node_cache
from dynamo_flexkv.serve import vllm_worker as _vllm
from dynamo_flexkv.serve.graph import Graph, GraphError, Kind
from dynamo_flexkv.serve.infra import infra_processes, redis_process
from dynamo_flexkv.serve.nodes import Nodes, place
from dynamo_flexkv.serve.option_checks import allowed_options, check_options
from dynamo_flexkv.serve.options import OPTIONS, OnDeath, RestartPolicy, restart_policy
from dynamo_flexkv.serve.ports import LOOPBACK, PortBook, system_port
from dynamo_flexkv.serve.process import Process
from dynamo_flexkv.serve.replica_cache import PlanContext, per_replica, replica_cache
from dynamo_flexkv.serve.sources import origin_of

__all__ = [
    "LOOPBACK",
    "LaunchPlan",
    "OnDeath",
    "PRE_COMMIT_PEEK_ENV",
    "Process",
    "RestartPolicy",
    "apply_overrides",
    "build_plan",
    "load_config",
    "per_replica",
    "replica_cache",
]

# Dynamo's frontend answers a stream 200 before the worker's first event unless told to wait for
# it: a stream the worker refuses (request limits, unsupported options) then gets 200 and an SSE
# error event. Holding the headers up to this long turns that refusal into a 400 with the
# worker's message; an accepted stream's first token is not delayed (its headers go with it).
PRE_COMMIT_PEEK_ENV = "DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS"
PRE_COMMIT_PEEK_MS = "500"


@dataclass
class LaunchPlan:
    graph: Graph
    run_dir: Path
    model: str
    served_model_name: str
    http_port: int
    discovery_backend: str
    event_plane: str
    infra: list[Process]
    processes: list[Process]  # frontend first, then the workers
    write_model: bool = True  # the launcher writes run_dir/model from the preset ``model`` (a vLLM worker
    # on its own Hugging Face directory needs none)
    model_weights: bool = False  # ... with the preset's seeded weights (a vLLM worker loads them)
    node_options: dict[str, str] = field(default_factory=dict)  # component -> its ``node`` option (serve --nodes)
    notes: list[str] = field(default_factory=list)  # what serve prints before it starts (e.g. keys it ignores)

    @property
    def base_url(self) -> str:
        return f"http://{self.processes[0].host}:{self.http_port}"

    @property
    def workers(self) -> list[Process]:
        return [p for p in self.processes if p.kind is Kind.WORKER]


def load_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        config = read_yaml_mapping(path, holds="sections (Common, then one per component)")
    except ConfigError as e:
        raise GraphError(str(e)) from None
    if not config:  # most likely the wrong file; running on the defaults would hide that
        raise GraphError(
            f"config file {path} is empty (nothing but comments or blank lines): it sets nothing. Give a "
            "config with Common and a section per component (e.g. configs/agg_router.yaml), or leave -f "
            "out to run the graph on its defaults"
        )
    return config


def apply_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``Section.key=value`` (value parsed as YAML; ``Section.cache.key=value`` reaches into cache)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for item in overrides:
        path, sep, value = item.partition("=")
        parts = path.split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise GraphError(f"--set {item!r}: expected Section.key=value (e.g. FlexKVWorker.replicas=3)")
        node = out
        for depth, p in enumerate(parts[:-1]):
            child = node.get(p, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise GraphError(
                    f"--set {item!r}: {where} is {child!r}, not a section: set {where}=<value> itself, "
                    "or name a key of a section"
                )
            node[p] = node = dict(child)  # copied: the caller's config stays as it was
        node[parts[-1]] = yaml.safe_load(value)
    return out


def build_plan(
    graph: Graph,
    config: Mapping[str, Any],
    *,
    run_dir: Path,
    discovery_backend: str = "file",
    event_plane: str = "zmq",
    source: str = "config",
    local: bool = True,
    nodes: Nodes | None = None,
) -> LaunchPlan:
    """``local=False`` (rendering for elsewhere): ports and SSD directories are not probed on this
    machine and no etcd/NATS is planned. ``nodes``: components with a ``node`` option run there
    (dynamo_flexkv.serve.nodes)."""
    if local:
        _refuse_stray_cache_env(os.environ)
        _refuse_operator_namespace_env(os.environ)
    sections = dict(config)
    common = sections.pop("Common", None) or {}
    if not isinstance(common, dict):
        raise GraphError(f"{origin_of(source, 'Common')}: Common must be a mapping of options")
    node_cache = _node_cache.options(sections.pop(_node_cache.SECTION, None), source)
    known = [c.name for c in graph.components]
    for name in sections:
        if name not in known:
            raise GraphError(
                f"{origin_of(source, name)}: unknown component {name!r}: graph {graph.name} has {known} "
                f"(plus Common and {_node_cache.SECTION}); rename or remove that section"
            )
    all_keys = set().union(*OPTIONS.values(), _vllm.options(OPTIONS[Kind.WORKER]))
    for key in common:
        if key not in all_keys:
            raise GraphError(
                f"{origin_of(source, 'Common', key)}: Common.{key} is not an option of any component; "
                f"known: {sorted(all_keys)}"
            )
    if discovery_backend not in ("file", "etcd"):
        raise GraphError(f"--discovery-backend {discovery_backend!r}: use file (default) or etcd")
    if event_plane not in ("zmq", "nats"):
        raise GraphError(f"--event-plane {event_plane!r}: use zmq (default) or nats")

    if nodes is not None and (discovery_backend, event_plane) != ("etcd", "nats"):
        raise GraphError(
            "--nodes needs --discovery-backend etcd --event-plane nats: file discovery and the "
            "ZMQ broker are on one machine only"
        )
    ports = PortBook(probe=local)
    run_dir = Path(run_dir)
    infra, env = infra_processes(run_dir, discovery_backend, event_plane, ports) if local else ([], {})
    # redis: the graph's own redis-server, when a worker enables remote without a URL;
    # dirs: every worker's SSD directories (no two may share one)
    ctx = PlanContext(run_dir, discovery_backend, event_plane, env, ports, source, local, redis={}, dirs={})
    processes: list[Process] = []
    model = served = None
    http_port = 0
    front_opts: dict[str, Any] = {}
    write_model = model_weights = False
    node_of: dict[str, str] = {}  # process name -> the node its component names
    node_options: dict[str, str] = {}
    caches: dict[str | None, Process] = {}  # node (None: this machine) -> its node cache server
    # A misspelled FLEXKV_* variable reaches every process and does nothing: said before serve starts
    notes: list[str] = [unknown_env_message(v, near) for v, near in unknown_env(os.environ).items()] if local else []
    if local and any(c.engine == _vllm.ENGINE for c in graph.components):
        _vllm.check_installed(source)
    for comp in graph.components:
        planned = {p.name for p in processes}
        own = sections.get(comp.name) or {}
        if not isinstance(own, dict):
            raise GraphError(f"{origin_of(source, comp.name)}: section {comp.name} must be a mapping of options")
        allowed = allowed_options(comp.kind, comp.engine)
        opts = check_options(
            comp.kind,
            comp.name,
            {**comp.defaults, **{k: v for k, v in common.items() if k in allowed}, **own},
            source,
            comp.engine,
        )
        if comp.kind is Kind.WORKER and _node_cache.in_node_mode(comp.name, opts, source):
            opts = _attach_to_node_cache(ctx, comp, opts, node_cache, caches, processes, node_of, notes)
        if comp.kind is Kind.FRONTEND:
            front_opts = opts
            http_port = ports.take(
                opts["http-port"], f"{comp.name}.http-port", origin_of(source, comp.name, "http-port"), any_port=True
            )
            processes.insert(0, _frontend(ctx, comp.name, opts, http_port))
        elif comp.engine == _vllm.ENGINE:
            model, served = opts["model"], opts.get("served-model-name") or f"vllm-{Path(opts['model']).name}"
            procs = _vllm.workers(ctx, comp.name, opts, served)
            on_preset = procs[0].argv[procs[0].argv.index("--model") + 1] == str(run_dir / "model")
            write_model = write_model or on_preset
            model_weights = model_weights or (on_preset and not _vllm.loads_dummy(procs[0].argv))
            processes += procs
        else:
            model, served = opts["model"], opts.get("served-model-name") or f"flexkv-{opts['model']}"
            processes += _workers(ctx, comp.name, opts, served)
            write_model = True
        if opts.get("node"):
            node = opts["node"]
            node_options[comp.name] = f"[{', '.join(node)}]" if isinstance(node, list) else str(node)
        if opts.get("node") and local:  # a manifest for elsewhere places nothing here
            if nodes is None:
                raise GraphError(
                    f"{origin_of(source, comp.name, 'node')}: "
                    f"{comp.name}.node={node_options[comp.name] if isinstance(node, list) else repr(node)} "
                    "needs serve --nodes FILE "
                    "(written by `dynamo-flexkv nodes up`); or remove the option"
                )
            node_of.update(_replica_nodes(comp.name, opts, [p for p in processes if p.name not in planned], source))
    if local:  # one secret per graph: prefill workers sign handovers, decode workers check them; hinted pulls too
        secret = secrets.token_hex(32)
        for proc in processes:
            if proc.kind is Kind.WORKER and (proc.engine == "flexkv" or _vllm.has_hints(proc)):
                proc.env[HANDOVER_SECRET_ENV] = secret
        _vllm.pin_cpus(processes)
    _check_roles(processes, source)
    _vllm.check_handovers(processes, source)
    _check_block_size(processes, front_opts, graph, source)
    if model is None or served is None:  # Graph() refuses a graph without a worker
        raise GraphError(f"{source}: the graph has no worker component")
    if ctx.redis:
        if nodes is not None:
            raise GraphError(
                f"{source}: with --nodes, give the workers a remote_cache_url every node reaches "
                "(the graph's own redis-server listens on one node's loopback)"
            )
        infra.append(redis_process(run_dir, ctx.redis))
    if nodes is not None:
        place(processes, infra, nodes, node_of, source)
    return LaunchPlan(
        graph,
        run_dir,
        model,
        served,
        http_port,
        discovery_backend,
        event_plane,
        infra,
        processes,
        write_model,
        model_weights,
        node_options,
        notes,
    )


def _refuse_stray_cache_env(env: Mapping[str, str]) -> None:
    """Every process serve starts inherits its environment, and a worker's cache config applies
    FLEXKV_* variables over the file serve checked and wrote (defaults < file < environment): one
    left in the shell would silently replace what serve checked, for every replica. Refused."""
    stray = env_settings(env)
    if stray:
        what = ", ".join(f"{var} ({key})" for var, key in stray.items())
        raise GraphError(  # the variables are the origin, not the config file
            f"environment variable{'s' if len(stray) > 1 else ''} {what} in serve's environment: "
            "every worker and cache server it starts would "
            "apply it over the cache config serve checked (the environment wins over the file, "
            "docs/CONFIGURATION.md). Unset it, and put the key in the worker's cache section "
            "(NodeCache.cache for workers on a node cache) or pass it with --set <Worker>.cache.<key>=..."
        )


# The Dynamo operator's namespace variables for pods of a DynamoGraphDeployment: Dynamo's workers
# (and the reference worker) append the suffix even to a --namespace flag, and the frontend looks by
# the prefix instead of its --namespace; left in serve's shell, the workers would register where
# serve's frontend does not look.
OPERATOR_NAMESPACE_ENV = ("DYN_NAMESPACE_WORKER_SUFFIX", "DYN_NAMESPACE_PREFIX")


def _refuse_operator_namespace_env(env: Mapping[str, str]) -> None:
    stray = [f"{var}={env[var]!r}" for var in OPERATOR_NAMESPACE_ENV if env.get(var)]
    if stray:
        raise GraphError(
            f"environment variable{'s' if len(stray) > 1 else ''} {', '.join(stray)} in serve's environment: "
            "the Dynamo operator's variables "
            "for pods (workers register in NAMESPACE-SUFFIX, the frontend looks by the prefix), so "
            "serve's frontend would not find its workers. Unset them; the namespace is the "
            "components' namespace option"
        )


def _replica_nodes(name: str, opts: dict[str, Any], procs: list[Process], source: str) -> dict[str, str]:
    """Process name -> node of a component's new processes: ``node`` one name for all of them, or a
    list of one name per replica (replica i on the i-th node)."""
    node = opts["node"]
    if not isinstance(node, list):
        return {p.name: node for p in procs}
    if len(node) != len(procs):
        raise GraphError(
            f"{origin_of(source, name, 'node')}: {name}.node lists {len(node)} nodes for "
            f"{len(procs)} replicas: give one node per replica (e.g. [{', '.join(['A'] * len(procs))}]), "
            "or one node for all of them"
        )
    return {p.name: n for p, n in zip(procs, node)}


def _attach_to_node_cache(
    ctx: PlanContext,
    comp: Any,
    opts: dict[str, Any],
    node_cache: dict[str, Any],
    caches: dict[str | None, Process],
    processes: list[Process],
    node_of: dict[str, str],
    notes: list[str],
) -> dict[str, Any]:
    """A worker in node mode: the worker's cache names the socket of the cache server it attaches
    to, the one the user gave (``cache.node_socket``: serve starts none) or its node's, which is
    planned here (once per node, before the workers)."""
    source = ctx.source
    given = opts["cache"].get("node_socket")
    tiers = f"the cache server's at {given}" if given else f"{_node_cache.SECTION}.cache, which serve starts"
    cache, note = _node_cache.node_worker_cache(comp.name, opts["cache"], tiers)
    if note:
        notes.append(note)
    if given:
        if not ctx.local:
            raise GraphError(
                f"{origin_of(source, comp.name, 'cache', 'node_socket')}: "
                f"{comp.name}.cache.node_socket={given!r}: a rendered graph runs its node cache as a "
                f"DaemonSet whose socket the worker pods mount ({_node_cache.RENDER_SOCKET_DIR}): remove "
                f"node_socket (the {_node_cache.SECTION} section sets its tiers)"
            )
        sock = _node_cache.external_socket(comp.name, str(given), int(opts.get("replicas", 1)), source)
        notes.append(
            f"{comp.name}: attaches to the cache server at {sock} ({comp.name}.cache.node_socket); "
            "serve starts none for it"
        )
        return dict(opts, cache=dict(cache, mode="node", node_socket=sock))
    node = opts.get("node") or None
    if isinstance(node, list):
        raise GraphError(
            f"{origin_of(source, comp.name, 'node')}: {comp.name}.node lists a node per replica, which "
            "cache.mode: node does not take yet (one node cache serves one node's workers): give one "
            "node, or a worker section per node"
        )
    spec, block_size = _kv_shape(comp, opts, ctx.run_dir, source, ctx.local)
    sock = _node_cache.socket_path(ctx.run_dir, node, ctx.local)
    if node not in caches:
        proc = _node_cache.process(ctx, node_cache, node, sock, spec, block_size)
        caches[node] = proc
        processes.append(proc)
        if node is not None:
            node_of[proc.name] = node
    elif caches[node].block_size != block_size:
        raise GraphError(
            f"{origin_of(source, comp.name, 'block-size')}: "
            f"{comp.name}.block-size {block_size} differs from the other node-mode workers' "
            f"{caches[node].block_size}: one node cache holds one block size"
        )
    return dict(opts, cache=dict(cache, mode="node", node_socket=sock))


def _kv_shape(comp: Any, opts: dict[str, Any], run_dir: Path, source: str, local: bool) -> tuple[Any, int]:
    """(KV shape for checking tier sizes or None, tokens per block) of a worker component's model."""
    if comp.engine == _vllm.ENGINE:
        return _vllm.resolve_model(comp.name, opts, run_dir, source, local)[2], opts["block-size"]
    from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig

    try:
        cfg = EngineModelConfig.load(opts["model"])
    except (ValueError, OSError, KeyError) as e:
        raise GraphError(f"{origin_of(source, comp.name, 'model')}: {comp.name}.model={opts['model']!r}: {e}") from None
    return cfg.kv_spec(), cfg.block_size


def _check_block_size(processes: list[Process], front: dict[str, Any], graph: Graph, source: str) -> None:
    """Dynamo's KV router hashes prompts in blocks of one size; every worker's KV events count in
    blocks of its own: they must agree. A vLLM worker's model card does not carry its block size,
    so the frontend is told (--kv-cache-block-size) whenever the graph has one."""
    workers = [p for p in processes if p.kind is Kind.WORKER]
    sizes = {p.block_size for p in workers}
    if len(sizes) > 1:
        each = ", ".join(f"{p.name}: {p.block_size}" for p in workers)
        raise GraphError(
            f"{source}: the workers' KV block sizes differ ({each}): "
            "the router hashes one block size; set the same block-size (vLLM) / model preset "
            "block_size (FlexKVWorker) on every worker"
        )
    size = sizes.pop()
    frontend = processes[0]
    name = next(c.name for c in graph.components if c.kind is Kind.FRONTEND)
    given = front.get("kv-cache-block-size")
    vllm = [p for p in workers if p.engine == _vllm.ENGINE]
    if given is not None and given != size:
        raise GraphError(
            f"{origin_of(source, name, 'kv-cache-block-size')}: "
            f"{name}.kv-cache-block-size={given} but the workers' KV blocks hold {size} tokens "
            f"({workers[0].name}): the router would hash other blocks than the workers report; set it "
            f"to {size}, or leave it out (serve sets it from the workers)"
        )
    if given is not None or vllm:
        at = frontend.argv.index("--migration-limit") + 2
        frontend.argv[at:at] = ["--kv-cache-block-size", str(size)]


def _check_roles(processes: list[Process], source: str) -> None:
    """Dynamo's frontend routes to prefill workers only in front of decode workers of the same
    model; either role alone would serve nothing (prefill) or fail every request (decode)."""
    modes = {
        p.argv[p.argv.index("--disaggregation-mode") + 1] if "--disaggregation-mode" in p.argv else "agg"
        for p in processes
        if p.kind is Kind.WORKER
    }
    if "agg" in modes and len(modes) > 1:
        raise GraphError(
            f"{source}: aggregated and disaggregated workers of one model in one graph: the "
            "frontend would send some requests past the prefill router; use one kind"
        )
    if ("prefill" in modes) != ("decode" in modes):
        have, need = ("prefill", "decode") if "prefill" in modes else ("decode", "prefill")
        raise GraphError(
            f"{source}: the graph has {have} workers but no {need} worker: set "
            f"disaggregation-mode: {need} on another worker component (see graphs/disagg.py)"
        )


def _frontend(ctx: PlanContext, name: str, o: dict[str, Any], port: int) -> Process:
    argv = [
        sys.executable,
        "-m",
        "dynamo.frontend",
        "--http-host",
        LOOPBACK,
        "--http-port",
        str(port),
        "--router-mode",
        o["router-mode"],
        "--namespace",
        o["namespace"],
        "--discovery-backend",
        ctx.discovery,
        "--event-plane",
        ctx.event_plane,
        "--migration-limit",
        str(o["migration-limit"]),
    ]
    for key in ("router-host-cache-hit-weight", "router-disk-cache-hit-weight"):
        if key in o:
            argv += [f"--{key}", str(o[key])]
    fenv = dict(ctx.env)
    if PRE_COMMIT_PEEK_ENV not in os.environ:  # an operator's own setting wins
        fenv[PRE_COMMIT_PEEK_ENV] = PRE_COMMIT_PEEK_MS
    return Process(name, argv + o["extra-args"], fenv, Kind.FRONTEND, port)


def _workers(ctx: PlanContext, name: str, o: dict[str, Any], served: str) -> list[Process]:
    # The worker's option schema and model presets only: rendering and planning load no runtime.
    from dynamo_flexkv.integrations.dynamo_worker.args import build_parser
    from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig

    source = ctx.source
    try:
        model_cfg = EngineModelConfig.load(o["model"])
    except (ValueError, OSError, KeyError) as e:
        raise GraphError(f"{origin_of(source, name, 'model')}: {name}.model={o['model']!r}: {e}") from None
    argv = [
        sys.executable,
        "-m",
        "dynamo_flexkv.integrations.dynamo_worker",
        "--model",
        o["model"],
        "--served-model-name",
        served,
        "--model-dir",
        str(ctx.run_dir / "model"),
        "--namespace",
        o["namespace"],
        "--discovery-backend",
        ctx.discovery,
        "--event-plane",
        ctx.event_plane,
        "--num-device-blocks",
        str(o["num-device-blocks"]),
        "--disaggregation-mode",
        o["disaggregation-mode"],
        "--handover-lease-s",
        str(o["handover-lease-s"]),
        "--handover-timeout-s",
        str(o["handover-timeout-s"]),
        "--handover-renew-s",
        str(o["handover-renew-s"]),
    ]
    if o["disaggregation-mode"] == "prefill":
        argv += ["--component", "prefill"]  # Dynamo's convention; decode and agg keep the default
    argv += ["--no-offload"] * (not o["offload"]) + ["--bulk-load"] * o["bulk-load"]
    argv += ["--no-device-prefix-cache"] * (not o["device-prefix-cache"]) + o["extra-args"]
    try:
        build_parser().parse_args(argv[3:])
    except SystemExit:
        raise GraphError(
            f"{origin_of(source, name, 'extra-args')}: {name}.extra-args {o['extra-args']} are not worker options "
            "(see python -m dynamo_flexkv.integrations.dynamo_worker --help)"
        ) from None
    restart = restart_policy(o)
    out = []
    for i in range(o["replicas"]):
        pname = f"{name}-{i}" if o["replicas"] > 1 else name
        penv = dict(ctx.env)
        cache, files = (
            replica_cache(ctx, name, pname, i, o, model_cfg.kv_spec(), model_cfg.block_size, penv)
            if o["offload"]
            else (None, {})
        )
        port = system_port(name, o, i, ctx.ports, source)
        penv["DYN_SYSTEM_PORT"] = str(port)
        out.append(
            Process(pname, list(argv), penv, Kind.WORKER, port, cache, files, restart, block_size=model_cfg.block_size)
        )
    return out
