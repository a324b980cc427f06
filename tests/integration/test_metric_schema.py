"""One metric schema (core/metric_schema.py): a reference worker, a vLLM worker's FlexKVConnector and
the node cache service export the quantities they share under one name with the same labels, every
sample says which of them exported it, the 0.1 names follow for one release, and every flexkv_
metric the Grafana dashboard queries is one that one of the three really exports (no Grafana here to
render it: this checks its queries instead)."""

from __future__ import annotations

import dataclasses
import io

import pytest
from dashboard_queries import VLLM_ONLY, load_dashboard, queried_metrics
from node_helpers import BS, Engine, node_server, prompt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamo_flexkv.cache_cli import run
from dynamo_flexkv.cli import build_parser
from dynamo_flexkv.core.metric_schema import ALIASES, SHARED, SOURCE_LABEL, Source, exported_name, schema_name

Exported = dict[str, set[str]]  # sample name -> label names seen on it


def _samples(families) -> Exported:
    out: Exported = {}
    for fam in families:
        names = {fam.name + "_total"} if fam.type == "counter" else {fam.name}
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.setdefault(s.name, set()).update(s.labels)
        for n in names:  # a family with no sample yet still names itself
            out.setdefault(n, set())
    return out


def _sources(families) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in families:  # (the text parser makes a counter's _created samples a family of their own)
        for s in f.samples:
            out.setdefault(f.name.removesuffix("_created"), set()).add(s.labels.get(SOURCE_LABEL, ""))
    return out


@pytest.fixture(scope="module")
def reference():
    from dynamo_flexkv import CacheConfig, KVManager, ModelSpec
    from dynamo_flexkv.integrations.dynamo_worker.metrics import OffloadCollector, RequestTally

    with KVManager(
        ModelSpec(num_layers=2, num_kv_heads=2, head_size=8), CacheConfig.from_dict({"cpu_cache_gb": 0.01})
    ) as kv:
        # a decision of the load policy, so its family has a sample (the remote tier's families are
        # the reference worker's alone: REMOTE.md)
        stats = dataclasses.replace(kv.stats(), prefix_tokens={"loaded/host/faster": 16})
    engine = {"steps": 0, "step_requests": 0, "step_seconds": 0, "load_stall_seconds": 0}
    collector = OffloadCollector(RequestTally(), lambda: (0, 8), lambda: stats, engine_stats=lambda: engine)
    return list(collector.collect())


@pytest.fixture(scope="module")
def vllm():
    """FlexKVPromMetrics as vLLM's Prometheus logger builds it, after one step's stats with every
    labelled family in them (families by reason show only the reasons that happened)."""
    pytest.importorskip("vllm")
    from dynamo_flexkv.integrations.vllm_connector.metrics import FlexKVPromMetrics

    reg = CollectorRegistry()
    types = {
        cls: type(
            cls.__name__, (cls,), {"__init__": lambda self, *a, _c=cls, **k: _c.__init__(self, *a, registry=reg, **k)}
        )
        for cls in (Counter, Gauge, Histogram)
    }

    class Config:
        kv_transfer_config = None

    prom = FlexKVPromMetrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(
        {
            "prefix_tokens/loaded/host/faster": 16,
            "removed_blocks/host/evicted": 1,
            "hints_failed/busy": 1,
            "peer_refused/busy": 1,
        },
        0,
    )
    return list(text_string_to_metric_families(generate_latest(reg).decode()))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from dynamo_flexkv.cache_server import _Collector

    tmp = tmp_path_factory.mktemp("node")
    with node_server(tmp, host_gb=0.02, ssd_gb=0.05) as server:
        engine = Engine(server.options.socket_path, "A", model_id="m1", tenant="acme")
        try:
            engine.store(prompt(3, 5 * BS + 2), list(range(5)))
            assert engine.offload.drain(30)
            clear = build_parser().parse_args(["cache", "clear", "--socket", server.options.socket_path, "--wait", "0"])
            assert run(clear, io.StringIO()) == 0  # removed_blocks samples (reason cleared)
            yield list(_Collector(server).collect())
        finally:
            engine.offload.shutdown()


def _by_source(reference, vllm, node) -> dict[Source, list]:
    return {Source.REFERENCE: reference, Source.VLLM: vllm, Source.NODE: node}


def test_the_sources_export_the_shared_quantities_under_one_name_and_labels(reference, vllm, node):
    for source, families in _by_source(reference, vllm, node).items():
        exported = _samples(families)
        for name, (sources, labels) in SHARED.items():
            if source not in sources:
                continue
            have = exported.get(exported_name(name, source))
            assert have is not None, f"{source.value} does not export {exported_name(name, source)}"
            assert {*labels, SOURCE_LABEL} <= have, f"{source.value} {name}: labels {sorted(have)}"


def test_the_schema_names_the_same_set_for_each_source(reference, vllm, node):
    """What a reader of the dashboard sees: the schema names each source exports (vLLM's without
    vllm:, as configs/prometheus.yml stores them) include every shared one of that source."""
    for source, families in _by_source(reference, vllm, node).items():
        names = {schema_name(n) for n in _samples(families)}
        shared = {n for n, (sources, _) in SHARED.items() if source in sources}
        assert shared <= names, f"{source.value} misses {sorted(shared - names)}"
    common = {n for n, (sources, _) in SHARED.items() if sources == frozenset(Source)}
    assert common == {
        "flexkv_pool_blocks",
        "flexkv_hit_blocks_total",
        "flexkv_removed_blocks_total",
        "flexkv_tasks_in_flight",
    }


def test_every_flexkv_sample_says_which_source_exported_it(reference, vllm, node):
    for source, families in _by_source(reference, vllm, node).items():
        aliases = {a.removesuffix("_total") for a in ALIASES}
        for name, seen in _sources(families).items():
            if schema_name(name) != name or name.startswith("flexkv_"):
                if name in aliases:
                    assert seen == {""}, f"alias {name} changed shape"
                else:
                    assert seen == {source.value}, f"{name}: source {seen}"


def test_the_old_names_follow_for_one_release(reference, vllm, node):
    exported = set(_samples(vllm)) | set(_samples(node))
    assert set(ALIASES) <= exported, sorted(set(ALIASES) - exported)
    node_samples = {s.name: s for f in node for s in f.samples}
    assert node_samples["flexkv_node_engine_tasks"].value == node_samples["flexkv_tasks_in_flight"].value


def test_serving_md_names_the_node_services_own_families(node):
    from doc_lists import documented_metrics, section
    from repo_paths import ROOT

    documented = {n for n in documented_metrics(section(ROOT / "docs" / "SERVING.md", "## Metrics"))}
    exported = {n for n in _samples(node) if n.startswith("flexkv_node_") and n not in ALIASES}
    assert exported == {n for n in documented if n.startswith("flexkv_node_") and n not in ALIASES}


def test_every_dashboard_query_names_a_metric_a_source_exports(reference, vllm, node):
    exported: set[str] = set()
    for families in (reference, vllm, node):
        exported |= {schema_name(n) for n in _samples(families)}
    queried = {m: panels for m, panels in queried_metrics(load_dashboard()).items() if m.startswith("flexkv_")}
    assert {m: p for m, p in queried.items() if m not in exported} == {}
    # and the other way: every family of a reference worker and of the node service is on a panel,
    # and of a vLLM worker's the shared ones and its own loads (its router-hint and peer families,
    # docs/HINTS.md, are not), aliases aside
    shown = {schema_name(n) for n in _samples(reference)} | {schema_name(n) for n in _samples(node)}
    assert {exported_name(n, Source.VLLM) for n in VLLM_ONLY} <= set(_samples(vllm))
    assert not VLLM_ONLY & {schema_name(n) for n in _samples(reference)}
    shown |= set(SHARED) | VLLM_ONLY
    unshown = {n for n in shown - {schema_name(a) for a in ALIASES} if n not in queried}
    assert sorted(unshown) == [], "exported, on no dashboard panel"


def test_refused_puts_are_one_quantity_of_both_engines_and_on_the_dashboard(tmp_path, vllm):
    """Blocks a put could not store for want of host room (a prompt longer than the host tier, or
    the tier full of blocks hung disk writes lock): the same KVManager counts them under either
    engine, so a reference worker exports them as a vLLM worker does, and the dashboard shows
    them. (Only vLLM's did, on no panel.)"""
    from kv_helpers import MODEL, TPB, config, device_tensors

    from dynamo_flexkv import KVLayoutType, KVManager
    from dynamo_flexkv.integrations.dynamo_worker.metrics import OffloadCollector, RequestTally

    name = "flexkv_put_refused_blocks_total"
    with KVManager(MODEL, config(tmp_path, host_blocks=4, disk_blocks=0)) as kv:
        kv.register_device_cache(device_tensors(KVLayoutType.LAYERBLOCK, 8), KVLayoutType.LAYERBLOCK)
        put = kv.put_async(list(range(6 * TPB)), list(range(6)))
        assert kv.wait([put], timeout=30)[put].num_tokens == 4 * TPB
        stats = kv.stats()
    assert stats.tasks.put_refused_blocks == 2
    engine = {"steps": 0, "step_requests": 0, "step_seconds": 0, "load_stall_seconds": 0}
    collector = OffloadCollector(RequestTally(), lambda: (0, 8), lambda: stats, engine_stats=lambda: engine)
    values = {s.name: s.value for f in collector.collect() for s in f.samples}
    assert values.get(name) == 2
    assert exported_name(name, Source.VLLM) in _samples(vllm)
    assert SHARED.get(name) == (frozenset({Source.REFERENCE, Source.VLLM}), ())
    assert name in queried_metrics(load_dashboard())
