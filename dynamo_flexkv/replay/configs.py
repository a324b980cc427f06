"""The configurations the replay compares, and serving one of them: a fresh graph through the
launcher (fresh caches, fresh SSD directories), the replay against it, and each worker's flexkv_*
totals before and after, read from its /metrics."""

from __future__ import annotations

import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

from prometheus_client.parser import text_string_to_metric_families

from dynamo_flexkv.replay.client import TIERS, Replayer, RequestRecord
from dynamo_flexkv.workload import Turn


@dataclass(frozen=True)
class Configuration:
    name: str
    description: str
    overrides: Tuple[str, ...]  # --set style, on top of the graph's config
    offload: bool = True


DEVICE_ONLY = ("Frontend.router-host-cache-hit-weight=0", "Frontend.router-disk-cache-hit-weight=0")
CONFIGURATIONS: Dict[str, Configuration] = {c.name: c for c in (
    Configuration("no-offload", "device prefix cache only, KV routing", ("FlexKVWorker.offload=false",), offload=False),
    Configuration("host", "host tier, KV routing over device+host", ("FlexKVWorker.cache.ssd_cache_gb=0",)),
    Configuration("host+ssd", "host + SSD tiers, KV routing over every tier (the default)", ()),
    Configuration("round-robin", "host + SSD tiers, round-robin routing", ("Frontend.router-mode=round-robin",)),
    Configuration("kv-device-only", "host + SSD tiers, KV routing counting the device only "
                  "(host/disk weights 0)", DEVICE_ONLY),
)}
# Remote (peer) tiers do not exist yet; the comparison gains "host+ssd+remote" when they do.


def parse_configs(text: str) -> List[Configuration]:
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
    """A worker's flexkv_* request counters (cumulative since it started)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached: Dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})

    def minus(self, other: "WorkerTotals") -> "WorkerTotals":
        return WorkerTotals(self.requests - other.requests, self.prompt_tokens - other.prompt_tokens,
                            {t: self.cached[t] - other.cached[t] for t in TIERS})


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError as e:
        raise RuntimeError(f"cannot read the worker metrics at http://127.0.0.1:{port}/metrics: {e}") from None


def worker_totals(metrics_text: str) -> WorkerTotals:
    out = WorkerTotals()
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "flexkv_requests_total":
                out.requests = int(s.value)
            elif s.name == "flexkv_prompt_tokens_total":
                out.prompt_tokens = int(s.value)
            elif s.name == "flexkv_prompt_tokens_cached_total" and s.labels.get("tier") in out.cached:
                out.cached[s.labels["tier"]] = int(s.value)
    return out


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
    records: List[RequestRecord]
    wall_s: float
    workers: Dict[str, WorkerTotals]  # worker name -> its counters' change across the replay
    worker_names: Dict[int, str]  # instance id -> worker name

    @property
    def label(self) -> str:
        return f"{self.config.name} @{self.device_blocks}"


def serve_and_replay(config: Configuration, device_blocks: int, turns: Sequence[Turn], *, graph: str,
                     config_file: str, extra_overrides: Sequence[str], time_scale: float, concurrency: int,
                     on_done: Callable[[RequestRecord], None], on_ready: Callable[[], None] = lambda: None,
                     logs: bool = False, request_timeout_s: float = 120) -> Tuple[ConfigRun, "Launcher"]:
    """Serves ``config`` on a fresh graph and replays ``turns`` against it. The graph is returned
    still running: the caller stops it (``Launcher.shutdown``), e.g. while the next one starts."""
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    run_dir = Path(tempfile.mkdtemp(prefix=f"dynamo-flexkv-replay-{config.name.replace('+', '-')}-"))
    overrides = ["Frontend.http-port=0",  # any free port: never collides with a running graph
                 f"FlexKVWorker.cache.ssd_cache_dir={run_dir}/ssd{{replica}}",  # a fresh disk tier per run
                 f"FlexKVWorker.num-device-blocks={device_blocks}", *extra_overrides, *config.overrides]
    plan = build_plan(load_graph(graph), apply_overrides(load_config(config_file), overrides),
                      run_dir=run_dir, source=config_file)
    sys.stderr.write(f"{config.name} @{device_blocks} device blocks: starting {plan.graph.name} "
                     f"({len(plan.workers)} workers), logs in {run_dir}/logs\n")
    launcher = Launcher(plan, sys.stderr if logs else None)
    launcher.start()  # stops what it started if it fails
    try:
        launcher.wait_ready(300)
        on_ready()
        run = _measure(config, device_blocks, plan.base_url, plan.served_model_name,
                       {p.name: p.port for p in plan.workers}, turns, time_scale, concurrency, on_done,
                       launcher.check_alive, request_timeout_s)
    except BaseException:
        launcher.shutdown()
        raise
    return run, launcher


def replay_url(url: str, model: str, turns: Sequence[Turn], *, ports: Sequence[int], time_scale: float,
               concurrency: int, on_done: Callable[[RequestRecord], None], request_timeout_s: float = 120) -> ConfigRun:
    """The replay against a graph served elsewhere; ``ports``: its workers' system ports (may be empty)."""
    config = Configuration("served", f"the graph at {url}", ())
    return _measure(config, 0, url, model, {f"worker@{p}": p for p in ports}, turns, time_scale, concurrency,
                    on_done, request_timeout_s=request_timeout_s)


def _measure(config: Configuration, device_blocks: int, url: str, model: str, ports: Dict[str, int],
             turns: Sequence[Turn], time_scale: float, concurrency: int,
             on_done: Callable[[RequestRecord], None], check_alive: Callable[[], None] = lambda: None,
             request_timeout_s: float = 120) -> ConfigRun:
    texts = {name: scrape(port) for name, port in ports.items()}
    names = {worker_id(text): name for name, text in texts.items()}
    before = {name: worker_totals(text) for name, text in texts.items()}
    t0 = time.perf_counter()
    records = Replayer(url, model, concurrency=concurrency, request_timeout_s=request_timeout_s).run(
        turns, time_scale, on_done)
    wall = time.perf_counter() - t0
    check_alive()  # a component that died mid-replay is named, with its log tail
    after = {name: worker_totals(scrape(port)) for name, port in ports.items()}
    for r in records:  # workers not scraped are still told apart
        if r.worker_id is not None and r.worker_id not in names:
            names[r.worker_id] = f"worker-{r.worker_id:x}"
    return ConfigRun(config, device_blocks, records, wall, {n: after[n].minus(before[n]) for n in ports}, names)


def attribute_workers(run: ConfigRun) -> Dict[str, List[RequestRecord]]:
    """Successful records by the worker that served them."""
    out: Dict[str, List[RequestRecord]] = {name: [] for name in run.workers}
    for r in run.records:
        if r.error is None:
            out.setdefault(run.worker_names.get(r.worker_id, f"unknown-{r.worker_id}"), []).append(r)
    return out


def device_block_list(text: str) -> List[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--device-blocks {text!r}: expected comma-separated block counts, e.g. 64,256") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--device-blocks {text!r}: each size must be >= 1 block")
    return sizes
