"""What ``KVManager.stats()`` returns: one typed snapshot of the tiers, links, tasks and remote.

Counters are totals since the manager opened; gauges (``used_blocks``, ``in_flight``, ...) are
the moment of the call. ``as_dict()`` gives the same numbers as plain dicts for JSON reports and
for crossing a process boundary (vLLM's collective_rpc).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from dynamo_flexkv.core.cost import LinkCost
from dynamo_flexkv.core.remote.stats import RemoteStats


class RemovalReason(str, enum.Enum):
    """Why blocks left a tier. Counted per tier (TierStats.removed_blocks, the removed_blocks
    metrics) and logged; Dynamo 1.6.1's BlockRemoved event has no field for it."""

    EVICTED = "evicted"  # the policy made room, and no copy stays below
    DEMOTED = "demoted"  # the policy made room on host; the block stays on disk
    INVALIDATED = "invalidated"  # computed with weights the engine no longer runs (weights_changed)
    CLEARED = "cleared"  # a reset (reset_prefix_cache with the connector, an operator's clear)
    FAILED = "failed"  # its bytes proved bad (a checksum) after it was ready


@dataclass(frozen=True)
class TierStats:
    """One local tier (host or disk), in blocks."""

    capacity_blocks: int
    used_blocks: int  # slots held: ready blocks and blocks whose copy is in flight
    ready_blocks: int  # landed and verified: what a get can find
    evicted_blocks: int
    hit_blocks: int  # blocks gets found here
    stored_blocks: int  # blocks that landed here
    rolled_back_blocks: int  # blocks whose copy into the tier failed or was cancelled
    # Blocks that left the tier, by why (RemovalReason above): evicted,
    # demoted (still on disk), invalidated (weights changed), cleared (reset), failed (bad bytes).
    removed_blocks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestStats:
    miss_blocks: int  # blocks of gets found in no tier
    remote_hit_blocks: int  # blocks gets planned to read from the remote tier
    tasks_in_flight: int  # tasks holding index state (runs not yet committed or rolled back)


@dataclass(frozen=True)
class LinkStats:
    """Copies finished on one link (``d2h``, ``h2disk``, ...): divide for GB/s and mean latency."""

    bytes: int
    seconds: float
    ops: int


@dataclass(frozen=True)
class TaskStats:
    in_flight: int  # issued and not finished
    uncollected_results: int  # finished, waiting for wait()/try_wait()
    queued_ops: int  # ready copies waiting for a transfer thread
    failed_ops: int  # copies that failed (their task rolled back)
    deferred_puts: int  # puts waiting for host room that running tasks hold
    put_refused_blocks: int  # blocks puts could not store: longer than the host tier
    disk_write_failures: int  # puts whose disk write failed (kept on host only)
    expired_results: int  # results nobody collected within task_result_ttl_seconds
    # What max_tasks_in_flight counts: tasks' transfer graphs still running, the background disk
    # and remote writes of puts that already reported success included, and deferred puts.
    transfers_running: int = 0


@dataclass
class RemoteTierStats(RemoteStats):
    """The remote store's counters (see RemoteStats) and what the manager planned of it."""

    url: str = ""  # redacted: no password
    planned_blocks: int = 0  # = RequestStats.remote_hit_blocks
    short_reads: int = 0  # gets whose remote part verified fewer blocks than planned
    write_failures: int = 0  # write-behind ops that raised (Redis failures count in RemoteStats)


@dataclass(frozen=True)
class ManagerStats:
    host: TierStats
    requests: RequestStats
    tasks: TaskStats
    disk: TierStats | None = None  # None without a disk tier
    remote: RemoteTierStats | None = None  # None without a remote tier
    links: dict[str, LinkStats] = field(default_factory=dict)  # only links that moved something
    # Cost-aware loading (core/cost.py): prompt tokens by "decision/tier/reason" (loaded/disk/faster,
    # recomputed/remote/slower, recomputed/none/not_cached, ...), and each measured tier's read cost.
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    tier_costs: dict[str, LinkCost] = field(default_factory=dict)

    @property
    def tiers(self) -> dict[str, TierStats]:
        """The local tiers this manager has, by name: ``{"host": ..., "disk": ...}``."""
        return {name: s for name, s in (("host", self.host), ("disk", self.disk)) if s is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ManagerStats:
        """The inverse of ``dataclasses.asdict`` of a ManagerStats (a snapshot that crossed a process
        boundary: the node cache's stats)."""

        def tier(x: dict[str, Any] | None) -> TierStats | None:
            return TierStats(**x) if x is not None else None

        return cls(
            host=TierStats(**d["host"]),  # every manager has a host tier
            requests=RequestStats(**d["requests"]),
            tasks=TaskStats(**d["tasks"]),
            disk=tier(d.get("disk")),
            remote=RemoteTierStats(**d["remote"]) if d.get("remote") else None,
            links={k: LinkStats(**v) for k, v in (d.get("links") or {}).items()},
            prefix_tokens=dict(d.get("prefix_tokens") or {}),
            tier_costs={k: LinkCost(**v) for k, v in (d.get("tier_costs") or {}).items()},
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dicts (tiers by name, then requests, links, tasks, remote where present)."""
        out: dict[str, Any] = {name: dataclasses.asdict(s) for name, s in self.tiers.items()}
        out["requests"] = dataclasses.asdict(self.requests)
        out["links"] = {name: dataclasses.asdict(s) for name, s in self.links.items()}
        out["tasks"] = dataclasses.asdict(self.tasks)
        if self.remote is not None:
            out["remote"] = dataclasses.asdict(self.remote)
        out["prefix_tokens"] = dict(self.prefix_tokens)
        out["tier_costs"] = {name: dataclasses.asdict(c) for name, c in self.tier_costs.items()}
        return out
