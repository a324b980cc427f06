"""The Grafana dashboard as data: its panels and the metric names their PromQL queries."""

import json
import re
from collections.abc import Iterator

from repo_paths import ROOT

DASHBOARD = ROOT / "configs" / "grafana" / "flexkv.json"
PROMETHEUS = ROOT / "configs" / "prometheus.yml"
METRIC = re.compile(r"\b((?:flexkv|dynamo)_[a-z0-9_]+)\b")
# Panels of the other sources (tests/integration/test_metric_schema.py checks they export them): the node
# service's own families, and a vLLM worker's that a reference worker has no counterpart of.
VLLM_ONLY = frozenset({"flexkv_recomputed_tokens_total", "flexkv_failed_loads_total", "flexkv_stored_tokens_total"})


def reference_worker_metric(name: str) -> bool:
    """Whether a reference worker (or the frontend) is where the dashboard's ``name`` comes from."""
    return not name.startswith("flexkv_node_") and name not in VLLM_ONLY


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


def queried_metrics(dashboard: dict) -> dict[str, set[str]]:
    """Metric name -> titles of the panels that query it."""
    out: dict[str, set[str]] = {}
    for p in all_panels(dashboard["panels"]):
        for t in p.get("targets", []):
            for name in METRIC.findall(t["expr"]):
                out.setdefault(name, set()).add(p["title"])
    return out
