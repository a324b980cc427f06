"""The Grafana dashboard (configs/grafana/flexkv.json) and the Prometheus scrape config load: the
dashboard has the fields Grafana's dashboard schema (kinds/dashboard, classic model) requires of a
dashboard and of each panel, a unique id per panel, a grid position inside the 24-column grid, and
a PromQL query per target. That every metric it queries exists on a running worker's (or the
frontend's) /metrics is checked against a served graph in tests/unit/test_replay.py."""

import json
import re

import yaml
from dashboard_queries import METRIC, PROMETHEUS, all_panels, load_dashboard


def schema_problems(d: dict) -> list[str]:
    """What Grafana's classic dashboard schema requires, and what an import needs to work."""
    problems = []
    for key, kind in (
        ("title", str),
        ("uid", str),
        ("schemaVersion", int),
        ("editable", bool),
        ("graphTooltip", int),
        ("panels", list),
        ("templating", dict),
        ("time", dict),
    ):
        if not isinstance(d.get(key), kind):
            problems.append(f"dashboard.{key} missing or not a {kind.__name__}")
    if d.get("graphTooltip") not in (0, 1, 2):
        problems.append("graphTooltip must be 0, 1 or 2")
    if not 8 <= len(d.get("uid", "")) <= 40:
        problems.append("uid must have 8-40 characters")
    variables = {v["name"] for v in d.get("templating", {}).get("list", [])}
    for v in d.get("templating", {}).get("list", []):
        for key in ("type", "name", "hide"):
            if key not in v:
                problems.append(f"variable {v.get('name')}: {key} missing")
    ids = [p.get("id") for p in all_panels(d.get("panels", []))]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids must be present and unique: {ids}")
    for p in all_panels(d.get("panels", [])):
        where = f"panel {p.get('id')} {p.get('title')!r}"
        if not isinstance(p.get("type"), str) or not p["type"]:
            problems.append(f"{where}: type missing")
        g = p.get("gridPos", {})
        if not (
            g.get("h", 0) > 0
            and 0 < g.get("w", 0) <= 24
            and 0 <= g.get("x", -1) < 24
            and g.get("y", -1) >= 0
            and g["x"] + g["w"] <= 24
        ):
            problems.append(f"{where}: gridPos {g} outside the 24-column grid")
        if p.get("type") == "row":
            if not isinstance(p.get("collapsed"), bool) or not isinstance(p.get("panels"), list):
                problems.append(f"{where}: a row needs collapsed and panels")
            continue
        for key, kind in (
            ("options", dict),
            ("fieldConfig", dict),
            ("transformations", list),
            ("targets", list),
            ("title", str),
        ):
            if not isinstance(p.get(key), kind):
                problems.append(f"{where}: {key} missing or not a {kind.__name__}")
        fc = p.get("fieldConfig", {})
        if not isinstance(fc.get("defaults"), dict) or not isinstance(fc.get("overrides"), list):
            problems.append(f"{where}: fieldConfig needs defaults and overrides")
        refs = [t.get("refId") for t in p.get("targets", [])]
        if not refs or len(refs) != len(set(refs)) or None in refs:
            problems.append(f"{where}: each target needs a unique refId")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            if not METRIC.search(expr):
                problems.append(f"{where}: target {t.get('refId')} queries no flexkv_/dynamo_ metric")
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                problems.append(f"{where}: unbalanced brackets in {expr!r}")
            for var in re.findall(r"\$(\w+)", expr):
                if var not in variables and not var.startswith("__"):
                    problems.append(f"{where}: ${var} is not a dashboard variable")
    return problems


def test_dashboard_has_the_fields_grafana_requires():
    d = load_dashboard()
    assert schema_problems(d) == []
    # every panel has a datasource that resolves through the dashboard's datasource variable
    for p in all_panels(d["panels"]):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


def test_schema_check_catches_broken_dashboards():
    """The check above can fail: each of these breakages is reported."""
    d = load_dashboard()
    panel = next(p for p in d["panels"] if p["type"] != "row")
    broken = [
        lambda d: d.pop("title"),
        lambda d: d.update(graphTooltip=7),
        lambda d: d["panels"].append(dict(panel)),  # duplicate id
        lambda d: d["panels"][1]["gridPos"].update(x=20, w=12),
        lambda d: d["panels"][1]["targets"][0].update(expr="sum(rate(flexkv_requests_total[1m])"),
        lambda d: d["panels"][1]["targets"][0].update(expr="up{job=$job}"),
        lambda d: d["panels"][1].pop("fieldConfig"),
    ]
    for breakage in broken:
        copy = json.loads(json.dumps(d))
        breakage(copy)
        assert schema_problems(copy), breakage


def test_prometheus_config_scrapes_frontend_and_workers():
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"dynamo-frontend", "flexkv-workers", "flexkv-node"}
    for job in jobs.values():
        for sc in job["static_configs"]:
            assert sc["targets"] and all(re.fullmatch(r"127\.0\.0\.1:\d+", t) for t in sc["targets"])
    assert re.fullmatch(r"\d+s", cfg["global"]["scrape_interval"])
    # a vLLM worker's vllm:flexkv_* families are stored under the schema's flexkv_* names
    (rule,) = jobs["flexkv-workers"]["metric_relabel_configs"]
    assert rule["source_labels"] == ["__name__"] and rule["target_label"] == "__name__"
    m = re.fullmatch(rule["regex"], "vllm:flexkv_pool_blocks")
    assert m and m.expand(rule["replacement"].replace("$1", "\\1")) == "flexkv_pool_blocks"
    assert not re.fullmatch(rule["regex"], "vllm:prompt_tokens_total")
