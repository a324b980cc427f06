"""The configurations the replay compares, the engines it serves them on, and serving one of them:
a fresh graph through the launcher (fresh caches, fresh SSD directories), the replay against it,
and each worker's request, prompt-token and cached-token totals before and after, read from its
/metrics through the engine's metric mapping (``Engine.metrics``: flexkv_* counters for the
reference engine, vllm:* counters for vLLM workers)."""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.core.http_client import scrape, sums_by, total
from dynamo_flexkv.replay.client import TIERS, Replayer, RequestRecord
from dynamo_flexkv.replay.events import KvEvent
from dynamo_flexkv.workload import Turn

if TYPE_CHECKING:
    from dynamo_flexkv.replay.accounting import RowAccount
    from dynamo_flexkv.serve.launcher import Launcher


@dataclass(frozen=True)
class Configuration:
    name: str
    description: str
    overrides: tuple[str, ...]  # --set style, on top of the graph's config; {worker}: the worker section
    offload: bool = True
    node: bool = False  # the workers' tiers become one node cache they share (node_cache_config)
    peer: str | None = None  # another offload system in the workers instead of ours (replay/peers.py)
    hints: bool = False  # Dynamo's router hints on (docs/HINTS.md): their counters are read per row

    @property
    def vllm_only(self) -> bool:
        """A configuration only vLLM workers serve: a peer's connector, or router hints."""
        return self.peer is not None or self.hints

    def overrides_for(self, worker: str) -> list[str]:
        """The overrides with ``{worker}`` replaced by the engine's worker section (FlexKVWorker, VllmWorker)."""
        return [o.replace("{worker}", worker) for o in self.overrides]


@dataclass(frozen=True)
class Counter:
    """A counter on a worker's /metrics: the sum of the samples named ``name`` whose labels include
    ``labels`` (a vLLM worker labels each sample with its model and engine index)."""

    name: str  # the sample name, e.g. flexkv_requests_total
    labels: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.name + ("{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}" if self.labels else "")


@dataclass(frozen=True)
class MetricMapping:
    """Where a worker's /metrics says how many requests it finished, how many prompt tokens they had,
    and how many of those came from each tier (TIERS); a tier the engine has no counter for: 0."""

    requests: Counter
    prompt_tokens: Counter
    cached: dict[str, Counter]


def _flexkv_tier(tier: str) -> Counter:
    return Counter("flexkv_prompt_tokens_cached_total", (("tier", tier),))


def _vllm_tier(tier: str) -> Counter:
    return Counter("vllm:flexkv_prompt_tokens_cached_total", (("tier", tier),))


def peer_mapping(mapping: MetricMapping) -> MetricMapping:
    """A vLLM worker on a peer's connector: vLLM counts what the peer loaded as external prefix-cache
    hits, one number for all of its tiers, shown as host."""
    return MetricMapping(
        mapping.requests,
        mapping.prompt_tokens,
        {"device": mapping.cached["device"], "host": Counter("vllm:external_prefix_cache_hits_total")},
    )


@dataclass(frozen=True)
class Engine:
    """What serves the configurations: the graph and config it starts, the config section of its
    workers, and how its workers' /metrics map onto the replay's accounting."""

    name: str
    graph: str  # under graphs/ (or a path)
    config: str  # under configs/ (or a path)
    worker: str  # the workers' config section
    metrics: MetricMapping
    description: str
    ready_timeout_s: float  # how long a freshly served graph may take to answer (--ready-timeout)


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            "vllm",
            "agg_router_vllm",
            "agg_router_vllm",
            "VllmWorker",
            MetricMapping(
                # vLLM counts finished requests by finish reason (summed), prompt tokens per request, its own
                # prefix-cache hits (the device tier) at admission; FlexKVConnector the tokens it loaded per tier
                requests=Counter("vllm:request_success_total"),
                prompt_tokens=Counter("vllm:prompt_tokens_total"),
                cached={"device": Counter("vllm:prefix_cache_hits_total"), **{t: _vllm_tier(t) for t in TIERS[1:]}},
            ),
            # vLLM's start (imports, engine core, model, KV cache) took 3-6 min per graph on 2 busy cores
            "python -m dynamo.vllm workers (vLLM, FlexKVConnector for the host/SSD tiers)",
            900,
        ),
        Engine(
            "reference",
            "agg_router",
            "agg_router",
            "FlexKVWorker",
            MetricMapping(
                requests=Counter("flexkv_requests_total"),
                prompt_tokens=Counter("flexkv_prompt_tokens_total"),
                cached={t: _flexkv_tier(t) for t in TIERS},
            ),
            "dynamo_flexkv's reference-engine workers (FlexKVWorker)",
            300,
        ),
    )
}


DEVICE_ONLY = ("Frontend.router-host-cache-hit-weight=0", "Frontend.router-disk-cache-hit-weight=0")
CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("no-offload", "device prefix cache only, KV routing", ("{worker}.offload=false",), offload=False),
        Configuration("host", "host tier, KV routing over device+host", ("{worker}.cache.ssd_cache_gb=0",)),
        Configuration("host+ssd", "host + SSD tiers, KV routing over every tier (the default)", ()),
        Configuration(
            "hints",
            "host + SSD tiers per worker, KV routing over every tier, router hints on: a worker the router "
            "books a request on pulls the prefix another worker's host tier holds (docs/HINTS.md)",
            ("{worker}.router-hints=true",),
            hints=True,
        ),
        Configuration("round-robin", "host + SSD tiers, round-robin routing", ("Frontend.router-mode=round-robin",)),
        Configuration(
            "kv-device-only", "host + SSD tiers, KV routing counting the device only (host/disk weights 0)", DEVICE_ONLY
        ),
        Configuration(
            "node",
            "host + SSD tiers of one node cache both workers share (the same memory and disk in "
            "all as host+ssd), KV routing over every tier",
            (),
            node=True,
        ),
        Configuration(
            "lmcache",
            "LMCache 0.5.6 (multi-process) in each vLLM worker instead of ours: one LMCache server "
            "for the node, its CPU tier the workers' host tiers together, a disk tier; KV routing on device "
            "events (LMCache publishes none)",
            (),
            offload=False,
            peer="lmcache",
        ),
    )
}
# Remote (peer) tiers do not exist yet; the comparison gains "host+ssd+remote" when they do.


def parse_configs(text: str) -> list[Configuration]:
    out = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name not in CONFIGURATIONS:
            raise ValueError(f"unknown configuration {name!r}: use a comma-separated list of {list(CONFIGURATIONS)}")
        out.append(CONFIGURATIONS[name])
    if not out:
        raise ValueError("--configs is empty: name at least one of " + ", ".join(CONFIGURATIONS))
    return out


@dataclass
class WorkerTotals:
    """A worker's request counters (cumulative since it started), read through its engine's mapping."""

    requests: int = 0
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})

    def minus(self, other: WorkerTotals) -> WorkerTotals:
        return WorkerTotals(
            self.requests - other.requests,
            self.prompt_tokens - other.prompt_tokens,
            {t: self.cached[t] - other.cached[t] for t in TIERS},
        )


def worker_totals(metrics_text: str, mapping: MetricMapping | None = None) -> WorkerTotals:
    """The totals ``mapping`` (default: the reference engine's flexkv_* counters) reads from a
    worker's /metrics text; each counter is the sum of its matching samples (0 when absent)."""
    mapping = mapping or ENGINES["reference"].metrics
    out = WorkerTotals()
    wanted = [
        ("requests", mapping.requests),
        ("prompt_tokens", mapping.prompt_tokens),
        *((t, c) for t, c in mapping.cached.items()),
    ]
    sums = {key: total(metrics_text, counter.name, **dict(counter.labels)) for key, counter in wanted}
    out.requests, out.prompt_tokens = int(sums.pop("requests")), int(sums.pop("prompt_tokens"))
    for tier, value in sums.items():
        out.cached[tier] = int(value)
    return out


# Router hints' counters on a vLLM worker's /metrics (docs/HINTS.md), vllm:flexkv_<key>_total: the
# receiver's (seen, used, skipped, what it pulled) and the source's (pins it granted, pins that
# ended with their lease); and the two families by reason, keyed "<family>/<reason>".
HINT_COUNTERS = (
    "hints_seen",
    "hints_used",
    "hints_skipped",
    "hint_pulled_tokens",
    "hint_pulled_bytes",
    "hint_pull_seconds",
    "peer_pins",
    "peer_pins_expired",
)
HINT_FAMILIES = ("hints_failed", "peer_refused")


def hint_totals(metrics_text: str) -> dict[str, float]:
    """A worker's router-hint counters (HINT_COUNTERS, and HINT_FAMILIES by reason), each the sum
    of its samples (0 when absent: hints off, or nothing counted yet)."""
    out = {key: total(metrics_text, f"vllm:flexkv_{key}_total") for key in HINT_COUNTERS}
    for family in HINT_FAMILIES:
        for (reason,), n in sorted(sums_by(metrics_text, f"vllm:flexkv_{family}_total", "reason").items()):
            out[f"{family}/{reason}"] = out.get(f"{family}/{reason}", 0.0) + n
    return out


def hint_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The counters' change across a replay; a reason that did not move is left out."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v or "/" not in k}


def worker_id(metrics_text: str) -> int:
    """The worker's Dynamo instance id (what the frontend reports as nvext.worker_id)."""
    m = re.search(r'^dynamo_component_\w+\{[^}]*worker_id="([0-9a-f]+)"', metrics_text, re.M)
    if m is None:
        raise RuntimeError("the worker's /metrics reports no worker_id label yet")
    return int(m.group(1), 16)


@dataclass
class ConfigRun:
    """One configuration served and replayed."""

    config: Configuration
    device_blocks: int
    records: list[RequestRecord]
    wall_s: float
    workers: dict[str, WorkerTotals]  # worker name -> its counters' change across the replay
    worker_names: dict[int, str]  # instance id -> worker name
    engine: str = "reference"  # ENGINES key: whose metric mapping ``workers`` was read with
    client: str = "ours"  # who sent and timed the requests: ours (Replayer) or aiperf
    # For the accounting (accounting.py): the prompts sent (by record index), the replay's start
    # (unix s: record times are relative to it), the tokens of a KV block, the workers' KV events
    # (None: not collected) and frames lost, and each worker's connector request_log (None: none).
    turns: Sequence[Turn] = ()
    started_unix: float = 0.0
    block_size: int = 0
    events: list[KvEvent] | None = None
    lost_frames: int = 0
    connector_logs: dict[str, list[dict[str, Any]]] | None = None
    time_scale: float = 0.0  # trace seconds per replay second this run was sent at
    repeat: int = 1  # which repetition of its row (--repeat)
    account: RowAccount | None = None  # its accounting, once report.accounted computed it
    hints: dict[str, dict[str, float]] | None = None  # worker -> its hint counters' change (hint_delta)

    @property
    def label(self) -> str:
        return f"{self.config.name} @{self.device_blocks}"


@dataclass(frozen=True)
class ReplaySettings:
    """What every run of one replay shares: its turns, sent at ``time_scale`` with at most
    ``concurrency`` in flight by ``client`` (ours: Replayer; or aiperf), each request given
    ``request_timeout_s``; and ``engine`` (an ENGINES key), whose workers serve them and whose
    metric mapping reads their /metrics."""

    turns: Sequence[Turn]
    time_scale: float
    concurrency: int
    request_timeout_s: float = 120
    engine: str = "reference"
    client: str = "ours"
    block_size: int = 0  # tokens of a KV block (the accounting's unit; 0: the plan's workers say)


@dataclass(frozen=True)
class ServeSettings:
    """How serve_and_replay serves each configuration: the graph and config files, overrides for
    every configuration (--set style, before the configuration's own), the components' logs on
    stderr or not, and how long a fresh graph may take to answer (None: the engine's
    ``ready_timeout_s``)."""

    graph: str
    config_file: str
    extra_overrides: Sequence[str] = ()
    logs: bool = False
    ready_timeout_s: float | None = None


@dataclass(frozen=True)
class ReplayTarget:
    """A served graph a replay measures: its frontend's URL and served model name, its workers'
    system ports by name (their /metrics; may be empty), a check that names a component that died
    mid-replay, and the model's directory (the tokenizer aiperf loads; None with our client)."""

    url: str
    model: str
    ports: dict[str, int]
    check_alive: Callable[[], None] = lambda: None
    model_dir: Path | None = None
    event_endpoints: dict[str, str] = field(default_factory=dict)  # worker name -> its KV event socket
    request_logs: dict[str, Path] = field(default_factory=dict)  # worker name -> its connector's request_log


def serve_and_replay(
    config: Configuration,
    device_blocks: int,
    replay: ReplaySettings,
    serve: ServeSettings,
    on_done: Callable[[RequestRecord], None],
    on_ready: Callable[[], None] = lambda: None,
) -> tuple[ConfigRun, Launcher]:
    """Serves ``config`` on a fresh graph of ``replay.engine``'s workers and replays
    ``replay.turns`` against it. The graph is returned still running: the caller stops it
    (``Launcher.shutdown``), e.g. while the next one starts."""
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
    from dynamo_flexkv.serve.sources import ConfigSource

    engine = replay.engine
    worker = ENGINES[engine].worker
    if config.vllm_only and engine != "vllm":
        raise ValueError(f"the {config.name} configuration runs vLLM workers: use --engine vllm")
    run_dir = Path(tempfile.mkdtemp(prefix=f"dynamo-flexkv-replay-{config.name.replace('+', '-')}-"))
    overrides = [
        "Frontend.http-port=0",  # any free port: never collides with a running graph
        f"{worker}.cache.ssd_cache_dir={run_dir}/ssd{{replica}}",  # a fresh disk tier per run
        f"{worker}.num-device-blocks={device_blocks}",
        *serve.extra_overrides,
        *config.overrides_for(worker),
    ]
    logged = engine == "vllm" and config.offload and not config.peer
    if logged:  # each lookup's decision and each load's tiers, for the accounting
        overrides.append(f"{worker}.connector.request_log=true")
    file_cfg = load_config(serve.config_file)
    cfg = apply_overrides(file_cfg, overrides)
    if config.node:
        cfg = node_cache_config(cfg, worker, run_dir)
    server = None
    if config.peer == "lmcache":
        from dynamo_flexkv.replay.peers import lmcache_config

        cfg, server = lmcache_config(cfg, worker, run_dir)
    source = ConfigSource(serve.config_file, file_cfg, overrides)  # errors name the file or the --set
    plan = build_plan(load_graph(serve.graph), cfg, run_dir=run_dir, source=source)
    if server is not None:
        from dynamo_flexkv.replay.peers import add_lmcache_server

        add_lmcache_server(plan, server)
    sys.stderr.write(
        f"{config.name} @{device_blocks} device blocks: starting {plan.graph.name} "
        f"({len(plan.workers)} workers), logs in {run_dir}/logs\n"
    )
    launcher = Launcher(plan, sys.stderr if serve.logs else None)
    launcher.start()  # stops what it started if it fails
    try:
        launcher.wait_ready(serve.ready_timeout_s or ENGINES[engine].ready_timeout_s)
        on_ready()
        model_dir = plan.run_dir / "model" if plan.write_model else Path(plan.model)
        from dynamo_flexkv.integrations.request_log import FILE
        from dynamo_flexkv.replay.events import worker_endpoints

        target = ReplayTarget(
            plan.base_url,
            plan.served_model_name,
            {p.name: p.port for p in plan.workers if p.port is not None},
            launcher.check_alive,
            model_dir,
            worker_endpoints(plan.workers),
            {p.name: plan.run_dir / p.name / FILE for p in plan.workers} if logged else {},
        )
        if not replay.block_size:
            replay = replace(replay, block_size=max((p.block_size for p in plan.workers), default=0))
        run = _measure(config, device_blocks, target, replay, on_done, run_dir / "aiperf")
    except BaseException:
        launcher.shutdown()
        raise
    return run, launcher


def node_cache_config(cfg: dict[str, Any], worker: str, run_dir: Path) -> dict[str, Any]:
    """The same graph with its workers' tiers pooled into one node cache (docs/NODE_CACHE.md): the
    node cache gets the workers' cache keys with their host and disk sizes added up (the same memory
    and disk as every worker's own tiers together), a fresh disk directory, and each worker only
    ``mode: node``."""
    common, section = cfg.get("Common") or {}, dict(cfg.get(worker) or {})
    replicas = int(section.get("replicas", common.get("replicas", 1)))
    tiers = {k: v for k, v in (section.get("cache") or {}).items() if k not in ("mode", "node_socket")}
    for key in ("cpu_cache_gb", "ssd_cache_gb"):
        if key in tiers:
            tiers[key] = float(tiers[key]) * replicas
    tiers["ssd_cache_dir"] = str(run_dir / "node-ssd")
    node = dict(cfg.get("NodeCache") or {})
    node["cache"] = {**(node.get("cache") or {}), **tiers}
    return {**cfg, worker: {**section, "cache": {"mode": "node"}}, "NodeCache": node}


def replay_url(
    url: str,
    model: str,
    replay: ReplaySettings,
    *,
    ports: Sequence[int],
    on_done: Callable[[RequestRecord], None],
    model_dir: Path | None = None,
) -> ConfigRun:
    """The replay against a graph served elsewhere; ``ports``: its workers' system ports (may be
    empty), read with ``replay.engine``'s metric mapping; ``model_dir``: the tokenizer aiperf loads
    (``replay.client="aiperf"``)."""
    config = Configuration("served", f"the graph at {url}", ())
    target = ReplayTarget(url, model, {f"worker@{p}": p for p in ports}, model_dir=model_dir)
    return _measure(config, 0, target, replay, on_done, Path(tempfile.mkdtemp(prefix="dynamo-flexkv-aiperf-")))


def _measure(
    config: Configuration,
    device_blocks: int,
    target: ReplayTarget,
    replay: ReplaySettings,
    on_done: Callable[[RequestRecord], None],
    workdir: Path | None = None,
) -> ConfigRun:
    from dynamo_flexkv.replay.events import EventTap

    engine = ENGINES[replay.engine]
    mapping = peer_mapping(engine.metrics) if config.peer else engine.metrics
    texts = {name: scrape(port) for name, port in target.ports.items()}
    names = {worker_id(text): name for name, text in texts.items()}
    before = {name: worker_totals(text, mapping) for name, text in texts.items()}
    hints_before = {name: hint_totals(text) for name, text in texts.items()} if config.hints else {}
    logs_before = {name: _line_count(path) for name, path in target.request_logs.items()}
    tap = EventTap(target.event_endpoints) if target.event_endpoints and replay.client == "ours" else None
    started_unix = time.time()
    events: list[KvEvent] | None = None
    t0 = time.perf_counter()
    wall: float | None = None
    if replay.client == "aiperf":
        from dynamo_flexkv.replay.aiperf import run_aiperf

        if target.model_dir is None or workdir is None:
            raise ValueError("--client aiperf needs the served model's directory (its tokenizer) and a work folder")
        records, wall = run_aiperf(
            target.url,
            target.model,
            target.model_dir,
            replay.turns,
            time_scale=replay.time_scale,
            concurrency=replay.concurrency,
            workdir=workdir,
            request_timeout_s=replay.request_timeout_s,
        )
        for r in records:
            on_done(r)
    elif replay.client == "ours":
        replayer = Replayer(
            target.url, target.model, concurrency=replay.concurrency, request_timeout_s=replay.request_timeout_s
        )
        try:
            records = replayer.run(replay.turns, replay.time_scale, on_done)
        finally:
            events = tap.stop() if tap is not None else None
        started_unix = replayer.started_unix
    else:
        raise ValueError(f"unknown client {replay.client!r}: ours or aiperf")
    wall = wall or time.perf_counter() - t0
    target.check_alive()  # a component that died mid-replay is named, with its log tail
    texts = {name: scrape(port) for name, port in target.ports.items()}
    after = {name: worker_totals(text, mapping) for name, text in texts.items()}
    hints = {n: hint_delta(hint_totals(texts[n]), hints_before[n]) for n in hints_before} if config.hints else None
    for r in records:  # workers not scraped are still told apart
        if r.worker_id is not None and r.worker_id not in names:
            names[r.worker_id] = f"worker-{r.worker_id:x}"
    workers = {n: after[n].minus(before[n]) for n in target.ports}
    return ConfigRun(
        config,
        device_blocks,
        records,
        wall,
        workers,
        names,
        replay.engine,
        replay.client,
        turns=replay.turns,
        started_unix=started_unix,
        block_size=replay.block_size,
        events=events,
        lost_frames=tap.lost if tap is not None else 0,
        connector_logs={n: _read_lines(p, logs_before[n]) for n, p in target.request_logs.items()} or None,
        time_scale=replay.time_scale,
        hints=hints,
    )


def _line_count(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _read_lines(path: Path, skip: int) -> list[dict[str, Any]]:
    """A request_log's records after its first ``skip`` lines (those of the graph's warm-up);
    a line still being written when the replay ended is left out."""
    import json

    out = []
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                if i >= skip and line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def attribute_workers(run: ConfigRun) -> dict[str, list[RequestRecord]]:
    """Successful records by the worker that served them."""
    out: dict[str, list[RequestRecord]] = {name: [] for name in run.workers}
    for r in run.records:
        if r.error is None:
            name = run.worker_names.get(r.worker_id) if r.worker_id is not None else None
            out.setdefault(name or f"unknown-{r.worker_id}", []).append(r)
    return out


def device_block_list(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--device-blocks {text!r}: expected comma-separated block counts, e.g. 64,256") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--device-blocks {text!r}: each size must be >= 1 block")
    return sizes
