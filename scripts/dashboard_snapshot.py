"""Renders configs/grafana/flexkv.json from a real Prometheus scraping a reference worker, a vLLM
worker and the node cache service, into docs/img/dashboard.png (with docs/img/dashboard.md: the
query each panel ran and the series each source gave it).

    .venv/bin/python scripts/dashboard_snapshot.py [--out docs/img] [--keep DIR]

Grafana is not installable on the machine this was written on (no Debian, PyPI or npm package, no
docker), so the drawing is ours; everything else is real: two graphs served as a user serves them
(``dynamo-flexkv serve``, through the test helpers tests/helpers/served.py and tests/helpers/vllm_graph.py): the
agg_router graph with one tiny reference worker with its own tiers, and the agg_router_vllm graph
with one vLLM worker on a node cache service (configs/agg_router_vllm_node.yaml); Prometheus (``apt-
get install prometheus``) bound to 127.0.0.1 with configs/prometheus.yml's rules and a 1 s scrape
interval; requests that load a prefix from the host tier on both workers (the vLLM worker's through
the node service); then every panel's PromQL over the run through Prometheus's HTTP API
(query_range), ``$source`` set to each source in turn as Grafana substitutes a single value,
``$instance`` to All, ``$__rate_interval`` as Grafana computes it. A script, not a CLI subcommand:
it needs Prometheus, matplotlib, vLLM and the test helpers, none of which a user of the package has.
Exits 1 when a panel lacks data from a source that exports its metrics, or when a vLLM worker's
counter differs from vLLM's own for the same prompts (VLLM_PAIRS; each listed). Every process it
started is stopped, on failure too.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the served-graph helpers: one implementation, the tests'

from dashboard_queries import PROMETHEUS, VLLM_ONLY, all_panels, load_dashboard  # noqa: E402

from dynamo_flexkv.core.http_client import http_json  # noqa: E402
from dynamo_flexkv.core.metric_schema import SHARED, Source  # noqa: E402
from dynamo_flexkv.core.sysutil import LOOPBACK, free_port, sigterm_interrupts  # noqa: E402

SCRAPE_S = 1
FRONTEND = "frontend"  # the Dynamo row's panels: the frontends' and routers' own metrics, no source label
COLORS = {
    Source.REFERENCE.value: "#5794f2",
    Source.VLLM.value: "#ff9830",
    Source.NODE.value: "#73bf69",
    FRONTEND: "#b877d9",
}
METRIC = re.compile(r"\b((?:flexkv|dynamo)_[a-z0-9_]+)\b")


def exporters(metric: str) -> set[str]:
    """The sources that export ``metric`` (the schema's name), as tests/helpers/dashboard_queries.py and
    core/metric_schema.py say."""
    if metric.startswith("dynamo_"):
        return {FRONTEND}
    for name, (sources, _) in SHARED.items():
        if metric in (name, name.removesuffix("_total")):
            return {s.value for s in sources}
    if metric.startswith("flexkv_node_"):
        return {Source.NODE.value}
    if metric in VLLM_ONLY:
        return {Source.VLLM.value}
    return {Source.REFERENCE.value}


# ---- the sources -------------------------------------------------------------------------------------------


@dataclass
class Sources:
    """Where each source's /metrics lives (host:port), and the graphs' frontends."""

    targets: dict[str, list[str]] = field(default_factory=dict)
    reference_url: str = ""
    vllm_url: str = ""


def _hostport(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


@contextlib.contextmanager
def served_sources(tmp: Path) -> Iterator[Sources]:
    """The two graphs, started as the tests start them and stopped (serve's own Ctrl-C) on the way out."""
    from served import TINY, Serve
    from vllm_graph import VllmServe

    with contextlib.ExitStack() as stack:
        ref = Serve(
            tmp,
            "reference",
            graph="agg_router",
            base=[
                *TINY,
                "Common.namespace=dashref",
                "FlexKVWorker.replicas=1",
                f"FlexKVWorker.cache.ssd_cache_dir={tmp}/ssd",
            ],
        )
        stack.callback(ref.close)
        vllm = VllmServe(
            tmp,
            "vllm",
            graph="agg_router_vllm",
            config="agg_router_vllm_node",
            base=[
                "Frontend.http-port=0",
                "Common.namespace=dashvllm",
                "VllmWorker.replicas=1",
                "VllmWorker.num-device-blocks=40",
                "VllmWorker.max-model-len=2048",
                f"NodeCache.cache={{cpu_cache_gb: 0.05, ssd_cache_gb: 0.1, ssd_cache_dir: {tmp}/node-ssd}}",
            ],
        )
        stack.callback(vllm.close)
        targets: dict[str, list[str]] = {s: [] for s in [*(x.value for x in Source), FRONTEND]}
        for serve, worker in ((ref, Source.REFERENCE), (vllm, Source.VLLM)):
            for name, url in serve.metrics.items():
                kind = Source.NODE.value if name == "NodeCache" else FRONTEND if name == "Frontend" else worker.value
                targets[kind].append(_hostport(url))
            if not any(n == "Frontend" for n in serve.metrics):
                targets[FRONTEND].append(_hostport(serve.base_url))
        yield Sources(targets, ref.base_url, vllm.base_url)


def drive(sources: Sources, scraped: Callable[[], None]) -> dict[str, Any]:
    """Requests that load a prefix from the host tier on each worker: a long prompt, others that push
    it out of the small device pool, the long prompt again. ``scraped`` returns once Prometheus has
    scraped every target since it was called. Returns what each repeat reported cached."""
    import vllm_graph as vg
    from served import post

    out: dict[str, Any] = {}
    # the reference worker (tiny model, 16-token blocks, 64 device blocks): token-id prompts
    # twice, with other prompts: a family a copy creates (the links') appears with its first
    # value, so rate() shows the second round's copies only, once a scrape has seen the first
    # (a round takes well under the scrape interval: without the wait both fell in one scrape)
    for seed in (7, 13):
        if seed != 7:
            scraped()
        long = [(seed * i) % 500 + 10 for i in range(30 * 16 + 5)]
        first = post(sources.reference_url, {"prompt": long, "max_tokens": 2})
        for j in range(3):
            fill = [(11 * i + j + seed) % 500 + 10 for i in range(40 * 16)]
            post(sources.reference_url, {"prompt": fill, "max_tokens": 2})
        status, again = post(sources.reference_url, {"prompt": long, "max_tokens": 2})
        assert first[0] == 200 and status == 200, (first, again)
    out["reference"] = again.get("usage", {})
    # the vLLM worker (64-token blocks, 40 device blocks): the same shape
    vlong = vg.tokens(1, 1000)
    vg.complete(sources.vllm_url, vlong, max_tokens=2)
    for j in range(3):
        vg.complete(sources.vllm_url, vg.tokens(10 + j, 1000), max_tokens=2)
    out["vllm"] = {"cached": vg.complete(sources.vllm_url, vlong, max_tokens=2)["cached"]}
    return out


# ---- Prometheus --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, list[str]]) -> Iterator[str]:
    """A Prometheus on a loopback port with configs/prometheus.yml's jobs and rules, pointed at
    ``targets`` and scraping every SCRAPE_S; its base URL. Stopped on the way out."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not on PATH: apt-get install prometheus (Debian ships 2.42)")
    shipped = yaml.safe_load(PROMETHEUS.read_text())
    by_job = {
        "dynamo-frontend": targets[FRONTEND],
        "flexkv-workers": targets[Source.REFERENCE.value] + targets[Source.VLLM.value],
        "flexkv-node": targets[Source.NODE.value],
    }
    jobs = []
    for job in shipped["scrape_configs"]:
        if job["job_name"] not in by_job:
            raise SystemExit(f"{PROMETHEUS} has job {job['job_name']!r}, which this script does not know: teach it")
        jobs.append({**job, "static_configs": [{"targets": by_job[job["job_name"]]}]})
    config = tmp / "prometheus.yml"
    interval = f"{SCRAPE_S}s"
    config.write_text(
        yaml.safe_dump(
            {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}
        )
    )
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'prometheus-data'}",
            f"--web.listen-address={LOOPBACK}:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://{LOOPBACK}:{port}"
    try:
        _wait(
            "Prometheus to answer",
            lambda: proc.poll() is None and _get(url + "/api/v1/status/buildinfo") is not None,
            60,
            proc,
            tmp,
        )
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _get(url: str) -> Any:
    try:
        return http_json(url, timeout=10)
    except (OSError, ValueError):
        return None


def _wait(what: str, cond: Any, timeout: float, proc: subprocess.Popen | None = None, tmp: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None and tmp is not None:
            raise SystemExit(
                f"prometheus exited with {proc.returncode}:\n{(tmp / 'prometheus.log').read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def _seconds(rfc3339: str) -> float:
    """Prometheus's lastScrape (nanoseconds, Z) as a Unix time."""
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", rfc3339)
    if m is None:
        return 0.0
    base = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
    tz = m.group(3)
    offset = 0 if tz == "Z" else (1 if tz[0] == "+" else -1) * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return base - offset + float("0." + (m.group(2) or "0"))


def scraped_since(url: str, mark: float, want: int) -> bool:
    """Whether Prometheus has ``want`` targets up, each scraped after Unix time ``mark``."""
    doc = _get(url + "/api/v1/targets?state=active")
    if not doc:
        return False
    active = doc["data"]["activeTargets"]
    return len(active) == want and all(t["health"] == "up" and _seconds(t["lastScrape"]) > mark for t in active)


# ---- the dashboard's queries -------------------------------------------------------------------------------


@dataclass
class Query:
    panel: str
    legend: str
    expr: str  # as the dashboard has it
    source: str  # the $source value (FRONTEND: a query without $source, run once)
    promql: str  # as sent
    series: list[dict] = field(default_factory=list)  # Prometheus's matrix, series with a finite point only


def substitute(expr: str, source: str, rate_interval: int) -> str:
    """``expr`` with the template variables as Grafana fills them: one value of $source (a custom
    variable: the value itself), $instance All (its allValue ``.*``), $__rate_interval."""
    values = {"source": source, "instance": ".*", "__rate_interval": f"{rate_interval}s"}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


def evaluate(url: str, start: float, end: float) -> tuple[list[Query], int]:
    """Every target of every panel over [start, end], once per source (or once, the Dynamo row's);
    and the step."""
    step = max(SCRAPE_S, math.ceil((end - start) / 300))
    rate_interval = max(step + SCRAPE_S, 4 * SCRAPE_S)  # Grafana's $__rate_interval
    out = []
    for panel in all_panels(load_dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            sources = [s.value for s in Source] if "$source" in expr else [FRONTEND]
            for source in sources:
                promql = substitute(expr, source, rate_interval)
                q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step})
                doc = http_json(f"{url}/api/v1/query_range?{q}", timeout=30)
                assert doc["status"] == "success", doc
                series = [s for s in doc["data"]["result"] if any(math.isfinite(float(v)) for _, v in s["values"])]
                out.append(Query(panel["title"], target.get("legendFormat", ""), expr, source, promql, series))
    return out, step


# The vLLM worker's counters next to vLLM's own for the same prompts: (ours, vLLM's, when they may
# differ). docs/VLLM.md says how each is counted.
VLLM_PAIRS = (
    (
        "flexkv_prompt_tokens_total",
        "vllm:prompt_tokens_total",
        "a request aborted before its first token: in ours only (we count at first scheduling)",
    ),
    (
        "flexkv_prompt_tokens_cached_total",
        "vllm:external_prefix_cache_hits_total",
        "a load that failed: in vLLM's only (it counts what the lookup promised)",
    ),
)


@dataclass
class Pair:
    ours: str
    theirs: str
    differ_when: str
    ours_value: float
    theirs_value: float


def vllm_pairs(url: str, at: float) -> list[Pair]:
    """VLLM_PAIRS' values at ``at``, summed over their labels (ours: source="vllm")."""

    def value(promql: str) -> float:
        q = urllib.parse.urlencode({"query": f"sum({promql})", "time": at})
        result = http_json(f"{url}/api/v1/query?{q}", timeout=30)["data"]["result"]
        return float(result[0]["value"][1]) if result else math.nan

    return [Pair(o, t, why, value(f'{o}{{source="vllm"}}'), value(t)) for o, t, why in VLLM_PAIRS]


# ---- what each panel shows ---------------------------------------------------------------------------------


def panel_metrics(panel: dict) -> set[str]:
    return {m for t in panel.get("targets", []) for m in METRIC.findall(t["expr"])}


def coverage(queries: list[Query]) -> dict[str, dict[str, int]]:
    """Panel title -> source -> series it contributed (over all the panel's targets)."""
    out: dict[str, dict[str, int]] = {}
    for q in queries:
        out.setdefault(q.panel, {}).setdefault(q.source, 0)
        out[q.panel][q.source] += len(q.series)
    return out


def findings(queries: list[Query]) -> list[str]:
    """A panel without data from a source that exports one of its metrics; and, less grave, a
    target without data from a source that exports its metrics while the panel has other data."""
    out = []
    covered = coverage(queries)
    for panel in all_panels(load_dashboard()["panels"]):
        if not panel.get("targets"):
            continue
        want = set().union(*(exporters(m) for m in panel_metrics(panel)))
        for source in sorted(want):
            if not covered[panel["title"]].get(source):
                out.append(f"panel {panel['title']!r}: no series from {source}")
    for q in queries:
        want = set().union(*(exporters(m) for m in METRIC.findall(q.expr)))
        if q.source in want and not q.series and covered[q.panel].get(q.source):
            out.append(f"  (query {q.legend!r} of {q.panel!r}: none from {q.source}; the panel has others)")
    return out


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def right_axis_unit(panel: dict, name: str) -> str | None:
    """The unit of the series ``name`` (its legend) when the panel's overrides put it on a right-hand
    axis (Grafana's byName / byRegexp matchers, unit and custom.axisPlacement), else None."""
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        matcher = override["matcher"]
        hit = name == matcher["options"] if matcher["id"] == "byName" else re.search(matcher["options"], name)
        props = {prop["id"]: prop["value"] for prop in override["properties"]}
        if matcher["id"] in ("byName", "byRegexp") and hit and props.get("custom.axisPlacement") == "right":
            return str(props.get("unit", "short"))
    return None


def draw(queries: list[Query], start: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, PercentFormatter

    dashboard = load_dashboard()
    panels = list(all_panels(dashboard["panels"]))
    head = 2  # grid rows above the panels for the dashboard's title and the key
    rows = head + max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_px, dpi = 30, 100
    fig = plt.figure(figsize=(1920 / dpi, rows * unit_px / dpi), dpi=dpi, facecolor="#111217")
    text = "#ccccdc"
    fig.text(
        0.01,
        1 - 0.9 / rows,
        f"{dashboard['title']}   (configs/grafana/flexkv.json, $source = each)",
        color=text,
        fontsize=15,
        va="center",
    )
    for i, (name, color) in enumerate(COLORS.items()):
        fig.text(0.55 + 0.1 * i, 1 - 0.9 / rows, f"\u2014 {name}", color=color, fontsize=13, va="center")
    formats = {
        "percentunit": PercentFormatter(xmax=1),
        "s": EngFormatter(unit="s"),
        "Bps": EngFormatter(unit="B/s"),
        "bytes": EngFormatter(unit="B"),
        "reqps": EngFormatter(unit=" req/s"),
        "ops": EngFormatter(unit=" ops/s"),
    }
    counts = coverage(queries)
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        top = 1 - (head + g["y"]) / rows
        height = g["h"] / rows
        if p["type"] == "row":
            fig.text(left + 0.005, top - height / 2, p["title"], color=text, fontsize=12, weight="bold", va="center")
            continue
        box = fig.add_axes((left + 0.003, top - height + 0.003 * 24 / rows, width - 0.006, height - 0.006 * 24 / rows))
        box.set_facecolor("#181b1f")
        box.set_xticks([])
        box.set_yticks([])
        for spine in box.spines.values():
            spine.set_color("#2c3235")
        have = counts[p["title"]]
        said = ", ".join(f"{s} {n}" for s, n in have.items())
        # inside the panel, as Grafana draws it: above it, the title ran into the row's or the panel's above
        box.text(
            0.005, 0.97, f"{p['title']}   [series: {said}]", color=text, fontsize=9, va="top", transform=box.transAxes
        )
        ax = fig.add_axes(
            (left + 0.035, top - height + 0.02 * 24 / rows * 2, width - 0.05, height - 0.075 * 24 / rows * 2)
        )
        ax.set_facecolor("#181b1f")
        ax.tick_params(colors=text, labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        ax.yaxis.set_major_formatter(formats.get(unit, EngFormatter(unit="")))
        styles = ["-", "--", ":", "-."]
        lines = 0
        targets = [t["expr"] for t in p["targets"]]
        right = None  # the axis the panel's overrides put on the right (another unit), once a series is drawn there
        for q in queries:
            if q.panel != p["title"]:
                continue
            for s in q.series:
                xs = [float(t) - start for t, v in s["values"]]
                ys = [float(v) if math.isfinite(float(v)) else math.nan for _, v in s["values"]]
                style = styles[targets.index(q.expr) % len(styles)]
                name = legend(q.legend, s["metric"])
                label = f"{q.source}: {name}" if lines < 8 else None
                on = ax
                if (other := right_axis_unit(p, name)) is not None:
                    if right is None:
                        right = ax.twinx()
                        right.tick_params(colors=text, labelsize=7)
                        for spine in right.spines.values():
                            spine.set_color("#2c3235")
                        box_ = ax.get_position()  # room for the right axis's labels inside the panel
                        for a in (ax, right):
                            a.set_position((box_.x0, box_.y0, box_.width - 0.02, box_.height))
                        right.yaxis.set_major_formatter(formats.get(other, EngFormatter(unit="")))
                    on = right
                on.plot(xs, ys, style, color=COLORS[q.source], linewidth=1.2, label=label)
                lines += 1
        if lines:
            handles = [h for a in (ax, right) if a is not None for h in a.get_legend_handles_labels()[0]]
            (right or ax).legend(
                handles=handles,
                fontsize=6,
                loc="best",  # where it hides fewest points: the upper left hid the reference's (early) series
                facecolor="#181b1f",
                edgecolor="#2c3235",
                labelcolor=text,
                title=None if lines <= 8 else f"(+{lines - 8} more)",
                title_fontsize=6,
            ).get_title().set_color(text)
        else:
            ax.text(0.5, 0.5, "No data", color=text, ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("seconds into the run", color=text, fontsize=7, labelpad=1)
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)


def write_report(queries: list[Query], pairs: list[Pair], found: list[str], step: int, drove: dict, path: Path) -> None:
    lines = [
        "# The dashboard's queries, as rendered into dashboard.png",
        "",
        'Written by `scripts/dashboard_snapshot.py` (docs/SERVING.md, "Metrics"): each query of',
        f"configs/grafana/flexkv.json as sent to Prometheus (query_range, step {step} s) for each value",
        "of `$source`, and the series it returned (those with a point; `frontend`: the Dynamo row's",
        "queries, which have no `$source`). What the requests reported cached on their repeat:",
        f"`{json.dumps(drove)}`.",
        "",
        "| panel | legend | source | series | query |",
        "|---|---|---|---|---|",
    ]
    for q in queries:
        promql = q.promql.replace("|", "\\|")
        lines.append(f"| {q.panel} | {q.legend} | {q.source} | {len(q.series)} | `{promql}` |")
    lines += [
        "",
        "## The vLLM worker's counters and vLLM's own, at the end of the run",
        "",
        "| ours (source=vllm) | vLLM's | ours | vLLM's | they may differ on |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{p.ours}` | `{p.theirs}` | {p.ours_value:g} | {p.theirs_value:g} | {p.differ_when} |" for p in pairs]
    lines += ["", "## Findings", ""] + (
        [f"- {f}" for f in found] or ["None: every panel has data from every source that exports its metrics."]
    )
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    with sigterm_interrupts():  # a SIGTERM (kill, timeout) stops the graphs and Prometheus as Ctrl-C does
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "img", help="where dashboard.png and dashboard.md go"
    )
    parser.add_argument("--keep", type=Path, help="keep the run's files (graph logs, Prometheus's config and log) here")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dashboard-", dir=args.keep))
    try:
        with served_sources(tmp) as sources:
            want = sum(len(v) for v in sources.targets.values())
            print(f"sources: {json.dumps(sources.targets)}", flush=True)
            with prometheus(tmp, sources.targets) as url:
                up = time.time()
                # a few samples before the first request: its counters' first increase is inside a rate window
                _wait("Prometheus to scrape every target", lambda: scraped_since(url, up + 3 * SCRAPE_S, want), 120)
                start = up

                def scraped() -> None:
                    mark = time.time()
                    _wait("Prometheus to scrape between the rounds", lambda: scraped_since(url, mark, want), 60)

                drove = drive(sources, scraped)
                print(f"requests done: {drove}", flush=True)
                done = time.time()
                # two scrapes after the last request: its counters' increase is inside every rate window
                _wait("Prometheus to scrape after the requests", lambda: scraped_since(url, done + SCRAPE_S, want), 60)
                end = time.time()
                queries, step = evaluate(url, start, end)
                pairs = vllm_pairs(url, end)
        found = findings(queries) + [
            f"{p.ours} (source=vllm) is {p.ours_value:g}, {p.theirs} {p.theirs_value:g}"
            for p in pairs
            if p.ours_value != p.theirs_value
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        draw(queries, start, args.out / "dashboard.png")
        write_report(queries, pairs, found, step, drove, args.out / "dashboard.md")
        for title, have in coverage(queries).items():
            print(f"{title}: {have}")
        for p in pairs:
            print(f"{p.ours}{{source=vllm}} {p.ours_value:g}, {p.theirs} {p.theirs_value:g}")
        print("\n".join(found) or "every panel has data from every source that exports its metrics")
        return 1 if any(not f.startswith("  ") for f in found) else 0
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
