"""One metric schema for the three things that export FlexKV metrics: a reference worker
(integrations/dynamo_worker/metrics.py), a vLLM worker's FlexKVConnector
(integrations/vllm_connector/metrics.py) and the node cache service (cache_server.py).

A quantity has one name, ``flexkv_<quantity>``, and the same labels wherever it is exported; every
sample carries ``source="reference|vllm|node"`` saying which exported it. A vLLM worker's names
start with ``vllm:`` (Dynamo 1.6.1's vLLM worker forwards only engine metrics named ``vllm:*`` to
its /metrics); configs/prometheus.yml strips that prefix at scrape, so Prometheus and the Grafana
dashboard see one name. Scrapers reading /metrics text directly use :func:`exported_name`.

docs/SERVING.md ("Metrics") lists the schema; tests/integration/test_metric_schema.py checks that the three
sources export :data:`SHARED` under the same names and labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

SOURCE_LABEL = "source"
VLLM_PREFIX = "vllm:"  # Dynamo 1.6.1's vLLM worker forwards engine metrics with this prefix only


class Source(str, Enum):
    REFERENCE = "reference"
    VLLM = "vllm"
    NODE = "node"


_ALL: frozenset[Source] = frozenset(Source)
_ENGINES: frozenset[Source] = frozenset({Source.REFERENCE, Source.VLLM})

# The quantities more than one source exports: sample name (a counter's with _total) -> the
# sources that export it and the labels each gives it (beside ``source`` and whatever the host
# process adds: Dynamo's hierarchy labels, vLLM's model_name and engine, the node's model).
SHARED: dict[str, tuple[frozenset[Source], tuple[str, ...]]] = {
    "flexkv_pool_blocks": (_ALL, ("tier", "state")),
    "flexkv_hit_blocks_total": (_ALL, ("tier",)),
    "flexkv_removed_blocks_total": (_ALL, ("tier", "reason")),
    "flexkv_tasks_in_flight": (_ALL, ()),
    "flexkv_prompt_tokens_total": (_ENGINES, ()),
    "flexkv_prompt_tokens_cached_total": (_ENGINES, ("tier",)),
    "flexkv_stored_blocks_total": (_ENGINES, ("tier",)),
    "flexkv_evicted_blocks_total": (_ENGINES, ("tier",)),
    "flexkv_prefix_tokens_total": (_ENGINES, ("decision", "tier", "reason")),
    "flexkv_tier_faults_total": (_ENGINES, ()),
    "flexkv_disk_write_failures_total": (_ENGINES, ()),
    "flexkv_put_refused_blocks_total": (_ENGINES, ()),
    "flexkv_handovers_total": (_ENGINES, ("result",)),
    "flexkv_handover_tokens_total": (_ENGINES, ()),
    "flexkv_handover_bytes_total": (_ENGINES, ()),
    "flexkv_handover_seconds_total": (_ENGINES, ()),
    "flexkv_handover_corrupt_total": (_ENGINES, ()),
}

# Names before the one schema, still exported beside the new ones for one release (removed in the
# next), in their old shape (no ``source`` label): old sample name -> new sample name.
ALIASES: dict[str, str] = {
    "vllm:flexkv_loaded_tokens_total": "vllm:flexkv_prompt_tokens_cached_total",
    "vllm:flexkv_used_blocks": 'vllm:flexkv_pool_blocks{state="used"}',
    "vllm:flexkv_capacity_blocks": 'vllm:flexkv_pool_blocks{state="capacity"}',
    "vllm:flexkv_handover_failures_total": 'vllm:flexkv_handovers_total{result="failed"}',
    "flexkv_node_tier_used_blocks": 'flexkv_pool_blocks{state="used"}',
    "flexkv_node_tier_capacity_blocks": 'flexkv_pool_blocks{state="capacity"}',
    "flexkv_node_tier_hit_blocks_total": "flexkv_hit_blocks_total",
    "flexkv_node_removed_blocks_total": "flexkv_removed_blocks_total",
    "flexkv_node_engine_tasks": "flexkv_tasks_in_flight",
}


def exported_name(name: str, source: Source) -> str:
    """The name ``source`` puts on /metrics for the schema's ``name``."""
    return VLLM_PREFIX + name if source is Source.VLLM else name


def schema_name(exported: str) -> str:
    """The schema's name of a sample name as found on /metrics (what Prometheus stores with
    configs/prometheus.yml)."""
    return exported[len(VLLM_PREFIX) :] if exported.startswith(VLLM_PREFIX + "flexkv_") else exported


def with_source(families: Iterable[Metric], source: Source) -> Iterator[Metric]:
    """Each family with ``source`` added to every sample's labels (for collectors that build
    prometheus_client families at scrape time)."""
    for fam in families:
        fam.samples = [s._replace(labels={**s.labels, SOURCE_LABEL: source.value}) for s in fam.samples]
        yield fam
