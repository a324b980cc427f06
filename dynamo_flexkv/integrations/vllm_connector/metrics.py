"""The connector's metrics, through vLLM's connector-stats path.

Each worker step returns a FlexKVStats (counter deltas since the last step, tier gauges at most
once a second); vLLM sums them across workers and steps and hands them to the Prometheus logger
of the API process, where FlexKVPromMetrics records them. Dynamo 1.6.1's vLLM worker forwards
only engine metrics whose names start with ``vllm:`` (or ``lmcache:``) to its /metrics, so the
families are ``vllm:flexkv_*`` (docs/VLLM.md lists them). vLLM's own
``vllm:external_prefix_cache_{queries,hits}`` count the tokens asked of / found by the connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

TIERS = ("host", "disk", "remote")
# data keys: counters are "<name>" or "<name>/<tier>" deltas; gauges start with "gauge:".
COUNTERS = {
    "loaded_tokens": ("Tokens loaded from an offload tier into vLLM's KV cache", True),
    "recomputed_tokens": ("Tokens a lookup promised that were recomputed instead (evicted, failed or corrupt)", False),
    "failed_loads": ("Loads that failed or timed out (their blocks were recomputed)", False),
    "tier_faults": ("Lookups, loads, stores and prefetches a tier fault turned into a miss (computed)", False),
    "stored_tokens": ("Tokens of finished requests copied into the host tier", False),
    "evicted_blocks": ("Blocks evicted from an offload tier", True),
    "disk_write_failures": ("Background disk writes that failed (the blocks stayed on host)", False),
    "handover_tokens": (
        "Prompt tokens read from a prefill worker (FlexKVConnector handover), not computed here",
        False,
    ),
    "handover_bytes": ("Bytes read from prefill workers by the handover", False),
    "handover_seconds": ("Seconds spent reading and verifying handovers", False),
    "handover_failures": (
        "Handovers refused, failed, past their lease or corrupt (their tokens were recomputed)",
        False,
    ),
    "handover_corrupt": ("Handovers whose bytes did not match the prefill worker's digests (recomputed)", False),
    "hints_seen": ("Requests that came with a Dynamo router kv.fetch hint (docs/HINTS.md)", False),
    "hints_used": ("Router hints whose pull from the named worker made blocks visible here", False),
    "hints_skipped": ("Router hints not pulled: the load policy predicted recomputing faster", False),
    "hint_pulled_tokens": ("Prompt tokens pulled from peer workers on router hints", False),
    "hint_pulled_bytes": ("Bytes pulled from peer workers on router hints", False),
    "hint_pull_seconds": ("Seconds spent pulling and verifying hinted blocks", False),
    "peer_pins": ("Pulls of peers this worker answered by pinning host blocks", False),
    "peer_pins_expired": ("Pins of this worker's host blocks that ended with their lease (no release)", False),
}
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


GAUGES = {
    "used_blocks": "Blocks held in an offload tier",
    "capacity_blocks": "Capacity of an offload tier in blocks",
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
        self._children: dict[str, dict[int, Any]] = {}
        for name, (doc, by_tier) in COUNTERS.items():
            self._family(name, self._counter_cls, f"vllm:flexkv_{name}", doc, by_tier)
        for name, doc in GAUGES.items():
            self._family("gauge:" + name, self._gauge_cls, f"vllm:flexkv_{name}", doc, True)
        self._prefix = self._counter_cls(
            name=f"vllm:flexkv_{PREFIX_TOKENS}",
            labelnames=list(self._labelnames) + ["decision", "tier", "reason"],
            documentation="Prompt tokens the load policy loaded or had recomputed, by tier and reason "
            "(faster/slower than recomputing, cold_start, probe, always, never; tier none: not_cached)",
        )
        self._reasons = {
            key: self._counter_cls(
                name=f"vllm:flexkv_{key}", labelnames=list(self._labelnames) + ["reason"], documentation=doc
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
            False,
        )
        self._removed = self._counter_cls(
            name=f"vllm:flexkv_{REMOVED}",
            labelnames=list(self._labelnames) + ["tier", "reason"],
            documentation="Blocks that left an offload tier, by why: evicted, demoted (still on disk), "
            "invalidated (the weights changed), cleared (a reset), failed (bad bytes)",
        )

    def _family(self, key: str, cls: type, metric: str, doc: str, by_tier: bool) -> None:
        names = list(self._labelnames) + (["tier"] if by_tier else [])
        m = cls(name=metric, documentation=doc, labelnames=names)
        for tier in TIERS if by_tier else (None,):
            k = f"{key}/{tier}" if tier else key
            self._children[k] = {
                idx: m.labels(*values, *([tier] if tier else [])) for idx, values in self.per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k.startswith(PREFIX_TOKENS + "/") and v and engine_idx in self.per_engine_labelvalues:
                decision, tier, reason = k.split("/")[1:4]
                labels = self._prefix.labels(*self.per_engine_labelvalues[engine_idx], decision, tier, reason)
                labels.inc(v)  # type: ignore[union-attr]  # vLLM types _counter_cls as any PromMetric; it is a Counter
                continue
            family = k.partition("/")[0]
            if family in self._reasons and "/" in k and v and engine_idx in self.per_engine_labelvalues:
                by_reason = self._reasons[family].labels(*self.per_engine_labelvalues[engine_idx], k.split("/")[1])
                by_reason.inc(v)  # type: ignore[union-attr]  # as above
                continue
            if k.startswith(REMOVED + "/") and v and engine_idx in self.per_engine_labelvalues:
                tier, reason = k.split("/")[1:3]
                removed = self._removed.labels(*self.per_engine_labelvalues[engine_idx], tier, reason)
                removed.inc(v)  # type: ignore[union-attr]  # as above
                continue
            child = self._children.get(k, {}).get(engine_idx)
            if child is None:
                continue
            if k.startswith("gauge:"):
                child.set(v)
            elif v:
                child.inc(v)
