"""The connector's metrics, through vLLM's connector-stats path.

Each worker step returns a FlexKVStats (counter deltas since the last step, tier gauges at most
once a second); vLLM sums them across workers and steps and hands them to the Prometheus logger
of the API process, where FlexKVPromMetrics records them. Dynamo 1.6.1's vLLM worker forwards
only engine metrics whose names start with ``vllm:`` (or ``lmcache:``) to its /metrics, so the
families are ``vllm:flexkv_*`` (docs/VLLM.md lists them), named and labelled as the reference
worker's and the node service's are (core/metric_schema.py), each sample with source="vllm". vLLM's own
``vllm:external_prefix_cache_{queries,hits}`` count the tokens asked of / found by the connector."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from dynamo_flexkv.core.metric_schema import SOURCE_LABEL, Source

TIERS = ("host", "disk", "remote")
POOL_STATES = ("capacity", "used", "ready")
HANDOVER_RESULTS = ("ok", "failed")
Labels = tuple[tuple[str, tuple[str, ...]], ...]  # (label name, its values), in key order
BY_TIER: Labels = (("tier", TIERS),)
# data keys: counters are "<name>" or "<name>/<label value>/..." deltas (label values in the order
# the family lists its labels); gauges start with "gauge:". Names and labels follow the schema the
# reference worker and the node service share (core/metric_schema.py).
COUNTERS: dict[str, tuple[str, Labels]] = {
    "prompt_tokens": (
        "Prompt tokens of the requests scheduled, each request once (as vllm:prompt_tokens_total, counted "
        "when first scheduled): the hit rate's denominator",
        (),
    ),
    "prompt_tokens_cached": ("Prompt tokens not recomputed, by the offload tier they were loaded from", BY_TIER),
    "recomputed_tokens": ("Tokens a lookup promised that were recomputed instead (evicted, failed or corrupt)", ()),
    "failed_loads": ("Loads that failed or timed out (their blocks were recomputed)", ()),
    "tier_faults": ("Lookups, loads, stores and prefetches a tier fault turned into a miss (computed)", ()),
    "stored_tokens": ("Tokens of finished requests copied into the host tier", ()),
    "hit_blocks": ("Blocks found in the tier by a get", BY_TIER),
    "stored_blocks": ("Blocks that landed in the tier", BY_TIER),
    "evicted_blocks": ("Blocks evicted from an offload tier", BY_TIER),
    "disk_write_failures": ("Background disk writes that failed (the blocks stayed on host)", ()),
    "put_refused_blocks": (
        "Blocks of finished requests not stored: the host tier had no room (its blocks locked by disk "
        "writes in flight for longer than a put waits, or the prompt is longer than the tier)",
        (),
    ),
    "handover_tokens": (
        "Prompt tokens read from a prefill worker (FlexKVConnector handover), not computed here",
        (),
    ),
    "handover_bytes": ("Bytes read from prefill workers by the handover", ()),
    "handover_seconds": ("Seconds spent reading and verifying handovers", ()),
    "handovers": (
        "Handovers a decode worker took: ok (read and verified), failed (refused, failed, past their "
        "lease or corrupt: recomputed)",
        (("result", HANDOVER_RESULTS),),
    ),
    "handover_corrupt": ("Handovers whose bytes did not match the prefill worker's digests (recomputed)", ()),
    "hints_seen": ("Requests that came with a Dynamo router kv.fetch hint (docs/HINTS.md)", ()),
    "hints_used": ("Router hints whose pull from the named worker made blocks visible here", ()),
    "hints_skipped": ("Router hints not pulled: the load policy predicted recomputing faster", ()),
    "hint_pulled_tokens": ("Prompt tokens pulled from peer workers on router hints", ()),
    "hint_pulled_bytes": ("Bytes pulled from peer workers on router hints", ()),
    "hint_pull_seconds": ("Seconds spent pulling and verifying hinted blocks", ()),
    "peer_pins": ("Pulls of peers this worker answered by pinning host blocks", ()),
    "peer_pins_expired": ("Pins of this worker's host blocks that ended with their lease (no release)", ()),
}
# What every tensor-parallel rank measures for the same requests and blocks (each rank moves its
# shard of them): only rank 0 reports these, since vLLM sums the ranks' step stats
# (KVOutputAggregator). Bytes, seconds and faults are each rank's own and are summed.
PER_ENGINE = (
    "recomputed_tokens",
    "failed_loads",
    "stored_tokens",
    "prompt_tokens",
    "prompt_tokens_cached/",
    "hit_blocks/",
    "stored_blocks/",
    "put_refused_blocks",
    "evicted_blocks/",
    "removed_blocks/",
    "handover_tokens",
    "handovers/",
    "handover_corrupt",
    "prefix_tokens/",
)


def rank_reports(key: str, tp_rank: int) -> bool:
    """Whether ``tp_rank`` reports the step-stats key ``key`` (PER_ENGINE: rank 0 alone)."""
    return tp_rank == 0 or not any(key == k or (k.endswith("/") and key.startswith(k)) for k in PER_ENGINE)


# Router hints that ended in a recompute, by reason: "hints_failed/<reason>" (one family), and pulls
# of peers this worker refused, by reason: "peer_refused/<reason>" (core/peer/protocol.Refusal).
HINTS_FAILED = "hints_failed"
PEER_REFUSED = "peer_refused"
PINNED = "gauge:peer_pinned_blocks"  # host blocks pinned for peers' reads now
# Cost-aware loading (core/cost.py): "prefix_tokens/<decision>/<tier>/<reason>" counter deltas, one
# family labelled by decision, tier and reason (the lookup decides what vLLM loads: worker._lookup).
PREFIX_TOKENS = "prefix_tokens"
# Blocks that left a tier and why: "removed_blocks/<tier>/<reason>" counter deltas (one family).
REMOVED = "removed_blocks"


def prefix_token_totals(stats: Any) -> dict[str, int]:
    """A worker's running totals of the load policy's decisions (KVManager.stats().prefix_tokens)
    as step-stats keys; the worker reports their deltas like every other counter."""
    return {f"{PREFIX_TOKENS}/{key}": n for key, n in getattr(stats, "prefix_tokens", {}).items()}


GAUGES: dict[str, tuple[str, Labels]] = {
    "pool_blocks": ("Offload tier slots", (("tier", TIERS), ("state", POOL_STATES))),
    "tasks_in_flight": ("Offload tasks not yet finished", ()),
}
# The old names, exported beside the new ones for one release in their old shape (no source label;
# core/metric_schema.ALIASES): old family -> (gauge?, help, its label, {data key: label value}).
ALIASES: dict[str, tuple[bool, str, str | None, dict[str, str]]] = {
    "loaded_tokens": (
        False,
        "Deprecated: vllm:flexkv_prompt_tokens_cached_total",
        "tier",
        {f"prompt_tokens_cached/{t}": t for t in TIERS},
    ),
    "used_blocks": (
        True,
        "Deprecated: vllm:flexkv_pool_blocks{state=used}",
        "tier",
        {f"gauge:pool_blocks/{t}/used": t for t in TIERS},
    ),
    "capacity_blocks": (
        True,
        "Deprecated: vllm:flexkv_pool_blocks{state=capacity}",
        "tier",
        {f"gauge:pool_blocks/{t}/capacity": t for t in TIERS},
    ),
    "handover_failures": (
        False,
        "Deprecated: vllm:flexkv_handovers_total{result=failed}",
        None,
        {"handovers/failed": ""},
    ),
}


@dataclass
class FlexKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> FlexKVStats:
        for k, v in other.data.items():
            if k.startswith("gauge:"):
                self.data[k] = v  # the newest reading
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FlexKVPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, list[dict[int, Any]]] = {}  # data key -> its children (alias too)
        source = [SOURCE_LABEL]  # every family's samples say source="vllm" (core/metric_schema.py)
        self._sourced = {idx: [*values, Source.VLLM.value] for idx, values in self.per_engine_labelvalues.items()}
        for name, (doc, labels) in COUNTERS.items():
            self._family(name, self._counter_cls, f"vllm:flexkv_{name}", doc, labels)
        for name, (doc, labels) in GAUGES.items():
            self._family("gauge:" + name, self._gauge_cls, f"vllm:flexkv_{name}", doc, labels)
        for old, (gauge, doc, label, keys) in ALIASES.items():
            m = (self._gauge_cls if gauge else self._counter_cls)(
                name=f"vllm:flexkv_{old}",
                documentation=doc,
                labelnames=list(self._labelnames) + ([label] if label else []),
            )
            for key, value in keys.items():
                self._children.setdefault(key, []).append(
                    {
                        idx: m.labels(*vals, *([value] if label else []))
                        for idx, vals in self.per_engine_labelvalues.items()
                    }
                )
        self._prefix = self._counter_cls(
            name=f"vllm:flexkv_{PREFIX_TOKENS}",
            labelnames=list(self._labelnames) + source + ["decision", "tier", "reason"],
            documentation="Prompt tokens the load policy loaded or had recomputed, by tier and reason "
            "(faster/slower than recomputing, cold_start, probe, always, never; tier none: not_cached)",
        )
        self._reasons = {
            key: self._counter_cls(
                name=f"vllm:flexkv_{key}", labelnames=list(self._labelnames) + source + ["reason"], documentation=doc
            )
            for key, doc in (
                (
                    HINTS_FAILED,
                    "Router hints that ended in a recompute, by reason (version, malformed, foreign, "
                    "source_gone, busy, not_held, namespace, forged, timeout, failed, corrupt, no_room, ...)",
                ),
                (
                    PEER_REFUSED,
                    "Peers' pulls this worker refused, by reason (unsigned, forged, stale, namespace, "
                    "oversized, busy, not_held, malformed, version, closed)",
                ),
            )
        }
        self._family(
            PINNED,
            self._gauge_cls,
            "vllm:flexkv_peer_pinned_blocks",
            "Host blocks pinned now for peers' reads (router hints)",
            (),
        )
        self._removed = self._counter_cls(
            name=f"vllm:flexkv_{REMOVED}",
            labelnames=list(self._labelnames) + source + ["tier", "reason"],
            documentation="Blocks that left an offload tier, by why: evicted, demoted (still on disk), "
            "invalidated (the weights changed), cleared (a reset), failed (bad bytes)",
        )

    def _family(self, key: str, cls: type, metric: str, doc: str, labels: Labels) -> None:
        m = cls(
            name=metric, documentation=doc, labelnames=list(self._labelnames) + [SOURCE_LABEL] + [n for n, _ in labels]
        )
        for values in itertools.product(*(vals for _, vals in labels)):
            k = "/".join((key, *values))
            self._children.setdefault(k, []).append(
                {idx: m.labels(*sourced, *values) for idx, sourced in self._sourced.items()}
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k.startswith(PREFIX_TOKENS + "/") and v and engine_idx in self.per_engine_labelvalues:
                decision, tier, reason = k.split("/")[1:4]
                labels = self._prefix.labels(*self._sourced[engine_idx], decision, tier, reason)
                labels.inc(v)  # type: ignore[union-attr]  # vLLM types _counter_cls as any PromMetric; it is a Counter
                continue
            family = k.partition("/")[0]
            if family in self._reasons and "/" in k and v and engine_idx in self.per_engine_labelvalues:
                by_reason = self._reasons[family].labels(*self._sourced[engine_idx], k.split("/")[1])
                by_reason.inc(v)  # type: ignore[union-attr]  # as above
                continue
            if k.startswith(REMOVED + "/") and v and engine_idx in self.per_engine_labelvalues:
                tier, reason = k.split("/")[1:3]
                removed = self._removed.labels(*self._sourced[engine_idx], tier, reason)
                removed.inc(v)  # type: ignore[union-attr]  # as above
                continue
            for children in self._children.get(k, []):
                child = children.get(engine_idx)
                if child is None:
                    continue
                if k.startswith("gauge:"):
                    child.set(v)
                elif v:
                    child.inc(v)
