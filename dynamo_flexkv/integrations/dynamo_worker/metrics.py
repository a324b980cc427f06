"""The worker's offload metrics on Dynamo's ``/metrics`` (Prometheus, prefix ``flexkv_``, every
sample labelled ``source="reference"``: core/metric_schema.py) and the load snapshot the router reads.

Counters are read at scrape time from what already counts them (KVManager.stats(), the device
pool, the per-request tallies below): nothing is double-booked and an idle worker costs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from dynamo_flexkv.core.metric_schema import Source, with_source
from dynamo_flexkv.core.stats import ManagerStats, RemoteTierStats, RemovalReason

if TYPE_CHECKING:  # the disagg roles import NIXL's agent lazily; the metrics only read their counters
    from dynamo_flexkv.integrations.disagg.leases import LeaseTable
    from dynamo_flexkv.integrations.disagg.roles import DecodeStats

PREFIX = "flexkv_"
REQUEST_TIERS = ("device", "host", "disk", "remote")


@dataclass
class RequestTally:
    """Per finished request: its prompt tokens and where each one came from (engine thread writes,
    the scrape reads)."""

    requests: int = 0
    prompt_tokens: int = 0
    aborted: int = 0  # requests stopped by a disconnect, a cancel or shutdown (not in the counts above)
    cached_tokens: dict[str, int] = field(default_factory=lambda: {t: 0 for t in REQUEST_TIERS})
    # Decode: prompt tokens pulled from the prefill worker. Neither cached here (the prefill worker
    # computed them, its own counters say from where) nor computed here.
    handover_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, prompt_tokens: int, cached: dict[str, int], handover_tokens: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            for tier, n in cached.items():
                self.cached_tokens[tier] = self.cached_tokens.get(tier, 0) + n
            self.handover_tokens += handover_tokens

    def add_aborted(self) -> None:
        with self._lock:
            self.aborted += 1

    def snapshot(self) -> RequestTally:
        with self._lock:
            return RequestTally(
                self.requests, self.prompt_tokens, self.aborted, dict(self.cached_tokens), self.handover_tokens
            )

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this worker prefilled: neither cached nor handed over."""
        return self.prompt_tokens - sum(self.cached_tokens.values()) - self.handover_tokens

    @property
    def hit_rate(self) -> float | None:
        """Share of prompt tokens served from any cache; None before the first request."""
        return sum(self.cached_tokens.values()) / self.prompt_tokens if self.prompt_tokens else None


class OffloadCollector(Collector):
    """Turns the worker's counters into Prometheus families at each scrape."""

    def __init__(
        self,
        tally: RequestTally,
        device_blocks: Callable[[], tuple],
        offload_stats: Callable[[], ManagerStats | None],
        engine_stats: Callable[[], dict[str, float]] = dict,
        handover_stats: Callable[[], DecodeStats | None] = lambda: None,
        lease_stats: Callable[[], LeaseTable | None] = lambda: None,
    ) -> None:
        self.tally, self.device_blocks, self.offload_stats = tally, device_blocks, offload_stats
        self.engine_stats = engine_stats
        self.handover_stats = handover_stats  # decode workers' pulls (None elsewhere: zeros)
        self.lease_stats = lease_stats  # prefill workers' leases (None elsewhere: zeros)

    def collect(self) -> Iterator[Metric]:
        return with_source(self._families(), Source.REFERENCE)

    def _families(self) -> Iterator[Metric]:
        t = self.tally.snapshot()
        yield _counter("requests", "Requests finished by this worker", t.requests)
        yield _counter("prompt_tokens", "Prompt tokens of finished requests", t.prompt_tokens)
        yield _counter("requests_aborted", "Requests aborted (client disconnect, cancel, shutdown)", t.aborted)
        cached = CounterMetricFamily(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens not recomputed, by the tier they came from (device: the engine's prefix cache)",
            labels=["tier"],
        )
        for tier in REQUEST_TIERS:
            cached.add_metric([tier], t.cached_tokens.get(tier, 0))
        yield cached
        yield _counter(
            "prompt_tokens_computed", "Prompt tokens prefilled (cache misses, not handed over)", t.computed_tokens
        )
        yield _counter(
            "handover_tokens",
            "Prompt tokens a decode worker pulled from its prefill worker (neither cached nor computed here)",
            t.handover_tokens,
        )
        yield from _handover_families(self.handover_stats())
        yield from _lease_families(self.lease_stats())
        used, total = self.device_blocks()
        dev = GaugeMetricFamily(PREFIX + "device_blocks", "Engine KV blocks", labels=["state"])
        dev.add_metric(["total"], total)
        dev.add_metric(["used"], used)
        yield dev
        e = self.engine_stats()
        if e:
            yield _counter("engine_steps", "Engine steps that computed a batch", e["steps"])
            yield _counter(
                "engine_step_requests",
                "Requests batched, summed over steps (divide by engine_steps for the mean batch)",
                e["step_requests"],
            )
            yield _counter("engine_step_seconds", "Seconds the engine spent in steps", e["step_seconds"])
            yield _counter(
                "engine_load_stall_seconds", "Seconds steps waited for offload loads", e["load_stall_seconds"]
            )
            yield _counter(
                "tier_faults",
                "Lookups, loads, stores and prefetches a tier fault turned into a miss (the engine computed)",
                e.get("tier_faults", 0),
            )
            # The frontend's dynamo_component_kv_cache_events_applied (by status) counts the same
            # events as its router applied them: equal sums mean every published event arrived.
            yield _counter(
                "kv_events_published",
                "KV events (device, host, disk) published to the router",
                e.get("kv_events_published", 0),
            )
            yield _counter(
                "kv_events_skipped",
                "KV events not sent: a Stored whose parent or a Removed whose block the router was never told about",
                e.get("kv_events_skipped", 0),
            )
        stats = self.offload_stats()
        if stats is not None:
            yield from _offload_families(stats)


def _handover_families(h: DecodeStats | None) -> Iterator[Metric]:
    """Decode's KV handovers (zeros on other workers, so every worker exports the same families)."""
    results = CounterMetricFamily(
        PREFIX + "handovers",
        "KV handovers a decode worker took: ok (pulled), "
        "local (its own tiers had every block), failed (refused, failed or "
        "corrupt: recomputed)",
        labels=["result"],
    )
    for result in ("ok", "local", "failed"):
        results.add_metric([result], 0 if h is None else getattr(h, result))
    yield results
    yield _counter("handover_bytes", "KV bytes pulled from prefill workers", 0 if h is None else h.bytes)
    yield _counter(
        "handover_seconds",
        "Seconds decode spent pulling KV from prefill workers (reads)",
        0 if h is None else h.seconds,
    )
    yield _counter(
        "handover_checksum_seconds",
        "Seconds decode spent verifying the xxh3 checksums of what it pulled",
        0 if h is None else h.verify_seconds,
    )
    yield _counter(
        "handover_corrupt",
        "Handovers whose pulled blocks failed their checksum (part of handovers{result=failed}: recomputed)",
        0 if h is None else h.corrupt,
    )


def _lease_families(leases: LeaseTable | None) -> Iterator[Metric]:
    """Prefill's handover leases (zeros on other workers)."""
    yield _gauge(
        "handover_leases",
        "Handover leases a prefill worker holds (their blocks stay referenced)",
        0 if leases is None else len(leases),
    )
    ended = CounterMetricFamily(
        PREFIX + "handover_leases_ended",
        "Handover leases ended: released by the decode "
        "worker, expired after its renewals stopped, or unclaimed (no decode worker took "
        "the request)",
        labels=["how"],
    )
    released, expired, unclaimed = (
        (0, 0, 0)
        if leases is None
        else (leases.released, leases.expired_count - leases.unclaimed_count, leases.unclaimed_count)
    )
    for how, n in (("released", released), ("expired", expired), ("unclaimed", unclaimed)):
        ended.add_metric([how], n)
    yield ended


def _offload_families(stats: ManagerStats) -> Iterator[Metric]:
    tiers = stats.tiers
    per_tier = {
        "hit_blocks": ("Blocks found in the tier by a get", "hit_blocks"),
        "stored_blocks": ("Blocks that landed in the tier", "stored_blocks"),
        "evicted_blocks": ("Blocks evicted from the tier", "evicted_blocks"),
        "rolled_back_blocks": ("Blocks whose copy into the tier failed or was cancelled", "rolled_back_blocks"),
    }
    for name, (doc, key) in per_tier.items():
        fam = CounterMetricFamily(PREFIX + name, doc, labels=["tier"])
        for tier, s in tiers.items():
            fam.add_metric([tier], getattr(s, key))
        yield fam
    removed = CounterMetricFamily(
        PREFIX + "removed_blocks",
        "Blocks that left the tier, by why: evicted, demoted (still on disk), invalidated (the weights "
        "changed), cleared (a reset), failed (bad bytes)",
        labels=["tier", "reason"],
    )
    for tier, s in tiers.items():  # every reason, zero too: one dashboard query finds them all
        for reason in RemovalReason:
            removed.add_metric([tier, reason.value], s.removed_blocks.get(reason.value, 0))
    yield removed
    pool = GaugeMetricFamily(PREFIX + "pool_blocks", "Offload tier slots", labels=["tier", "state"])
    for tier, s in tiers.items():
        for state in ("capacity", "used", "ready"):
            pool.add_metric([tier, state], getattr(s, f"{state}_blocks"))
    yield pool
    yield _counter("miss_blocks", "Blocks of gets found in no offload tier", stats.requests.miss_blocks)
    link_bytes = CounterMetricFamily(PREFIX + "link_bytes", "Bytes moved per link", labels=["link"])
    link_secs = CounterMetricFamily(
        PREFIX + "link_seconds",
        "Seconds spent in copies per link (divide by link_ops for mean latency)",
        labels=["link"],
    )
    link_ops = CounterMetricFamily(PREFIX + "link_ops", "Copies finished per link", labels=["link"])
    for link, moved in stats.links.items():
        link_bytes.add_metric([link], moved.bytes)
        link_secs.add_metric([link], moved.seconds)
        link_ops.add_metric([link], moved.ops)
    yield from (link_bytes, link_secs, link_ops)
    yield from _load_decision_families(stats)
    tasks = stats.tasks
    yield _gauge("tasks_in_flight", "Offload tasks not yet finished", tasks.in_flight)
    yield _gauge("transfer_queue_depth", "Ready copies waiting for a transfer thread", tasks.queued_ops)
    yield _counter("failed_ops", "Copies that failed (their task rolled back)", tasks.failed_ops)
    yield _counter("disk_write_failures", "Puts whose disk write failed (kept on host only)", tasks.disk_write_failures)
    yield _counter(
        "put_refused_blocks",
        "Blocks of finished requests not stored: the host tier had no room (its blocks locked by disk "
        "writes in flight for longer than a put waits, or the prompt is longer than the tier)",
        tasks.put_refused_blocks,
    )
    if stats.remote is not None:
        yield from _remote_families(stats.remote)


def _load_decision_families(stats: ManagerStats) -> Iterator[Metric]:
    """Cost-aware loading (core/cost.py): what the load policy did with each get's prefix, and the
    tier costs it measured."""
    prefix = CounterMetricFamily(
        PREFIX + "prefix_tokens",
        "Prompt tokens of gets by the load policy's decision: "
        "loaded from a tier or recomputed, and why (faster/slower than recomputing, "
        "cold_start, probe, always, never; tier none: not_cached)",
        labels=["decision", "tier", "reason"],
    )
    for key, n in stats.prefix_tokens.items():
        prefix.add_metric(key.split("/"), n)
    yield prefix
    latency = GaugeMetricFamily(
        PREFIX + "tier_read_latency_seconds",
        "Measured fixed cost of a read from the tier (seconds = latency + bytes / bandwidth)",
        labels=["tier"],
    )
    bandwidth = GaugeMetricFamily(
        PREFIX + "tier_read_bandwidth_bytes",
        "Measured read bandwidth of the tier "
        "in bytes per second (a tier whose reads showed no size dependence is left out)",
        labels=["tier"],
    )
    for tier, c in stats.tier_costs.items():
        latency.add_metric([tier], c.latency_s)
        if c.bandwidth_bytes_per_s != float("inf"):
            bandwidth.add_metric([tier], c.bandwidth_bytes_per_s)
    yield from (latency, bandwidth)


def _remote_families(r: RemoteTierStats) -> Iterator[Metric]:
    """The remote tier (Redis): what gets read and verified, what puts wrote, failures, breaker."""
    yield _counter("remote_hit_blocks", "Remote blocks read and verified by gets", r.hits)
    yield _counter(
        "remote_miss_blocks", "Remote reads that ended at a missing value (evicted after the lookup)", r.misses
    )
    bad = CounterMetricFamily(
        PREFIX + "remote_bad_values",
        "Remote values refused by verification (the get recomputes from there)",
        labels=["reason"],
    )
    for reason in ("truncated", "foreign", "corrupt"):
        bad.add_metric([reason], getattr(r, reason))
    yield bad
    yield _counter("remote_short_reads", "Gets whose remote part verified fewer blocks than planned", r.short_reads)
    yield _counter("remote_stored_blocks", "Blocks written to remote by puts", r.puts)
    yield _counter("remote_put_refused", "Remote writes refused by the server (full with noeviction)", r.put_refused)
    data = CounterMetricFamily(PREFIX + "remote_bytes", "Block bytes moved to and from remote", labels=["direction"])
    data.add_metric(["read"], r.bytes_read)
    data.add_metric(["written"], r.bytes_written)
    yield data
    secs = CounterMetricFamily(PREFIX + "remote_seconds", "Seconds spent in remote operations", labels=["op"])
    for op in ("get", "put", "exists"):
        secs.add_metric([op], getattr(r, f"{op}_seconds"))
    yield secs
    yield _counter("remote_op_errors", "Remote operations cut short by a failure or timeout", r.op_errors)
    yield _counter(
        "remote_put_failed",
        "Blocks a remote write could not store (no answer, or the breaker was open); they stay on the local tiers",
        r.put_failed,
    )
    yield _counter(
        "remote_breaker_refused", "Remote operations skipped while the circuit breaker was open", r.breaker_refused
    )
    yield _counter("remote_breaker_opened", "Times the remote circuit breaker opened", r.breaker_opened)
    yield _gauge(
        "remote_breaker_open",
        "1 while the remote circuit breaker is open or half-open",
        0 if r.breaker_state == "closed" else 1,
    )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def offload_registry(collector: OffloadCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
