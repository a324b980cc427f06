"""The control plane: which prefix is cached where, and what a get or put must move.

CacheEngine owns one TierIndex per offload tier and turns requests into *runs*: contiguous blocks
of one request in one tier, either locked ready blocks to read or new unready blocks to fill.
The data plane executes the runs' copies and then calls ``complete`` (commit/unlock) or
``abort`` (roll back/unlock). A task's runs are tracked, so ``abort_task`` frees everything
the task still holds: no lock or pool block can leak through a failed or cancelled transfer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.contract import IndexListener, Tier, TierRun
from dynamo_flexkv.core.index.tier_index import Hashes, IndexInvariantError, TierIndex
from dynamo_flexkv.core.stats import RemovalReason

log = logging.getLogger(__name__)


# Per-call paths use these: reading an Enum member off its class costs about as much as a
# native index call does.
_HOST, _DISK = Tier.HOST, Tier.DISK


@dataclass(frozen=True)
class MatchResult:
    """Ready prefix length (in blocks) per tier; no locks were taken."""

    per_tier: dict[Tier, int]

    @property
    def num_blocks(self) -> int:
        return max(self.per_tier.values(), default=0)

    def sources(self) -> list[tuple[Tier, int, int]]:
        """Which tier serves which blocks, fastest first: [(tier, start, end), ...]."""
        out, covered = [], 0
        for tier in Tier:
            end = self.per_tier.get(tier, 0)
            if end > covered:
                out.append((tier, covered, end))
                covered = end
        return out


@dataclass
class GetPlan:
    task_id: Hashable
    start: int  # first block the caller wants (it holds [0, start) already)
    host_reads: TierRun | None  # host blocks [start, end) copied to the device (incl. staged)
    disk_reads: TierRun | None  # ready disk blocks read into `staged`
    staged: TierRun | None  # new host blocks that receive disk_reads before the device copy
    remote_staged: TierRun | None = None  # new host blocks that receive remote blocks (after staged)

    @property
    def end(self) -> int:
        return self.host_reads.end if self.host_reads is not None else self.start

    @property
    def host_fill(self) -> TierRun | None:
        """Host blocks this get fills (disk and remote parts); None when it only reads host."""
        return self.remote_staged if self.remote_staged is not None else self.staged

    @property
    def num_blocks(self) -> int:
        return max(0, self.end - self.start)

    @property
    def runs(self) -> list[TierRun]:
        return [r for r in (self.staged, self.disk_reads, self.remote_staged, self.host_reads) if r is not None]


@dataclass
class PutPlan:
    task_id: Hashable
    host: TierRun | None  # new host blocks filled from the device
    host_sources: TierRun | None  # host blocks (held, or filled by `host`) feeding `disk`,
    #                                  locked until the disk write finished; aligned with `disk`
    disk: TierRun | None  # new disk blocks written from host
    held: int  # blocks of the request already on host before this put
    remote_sources: TierRun | None = None  # host blocks [0, end) written behind to remote, locked meanwhile

    @property
    def runs(self) -> list[TierRun]:
        return [r for r in (self.host, self.host_sources, self.disk, self.remote_sources) if r is not None]


@dataclass
class TierCounters:
    hit_blocks: int = 0
    stored_blocks: int = 0
    rolled_back_blocks: int = 0
    removed: dict[str, int] = field(default_factory=dict)  # blocks that left the tier, by RemovalReason
    forced: int = 0  # of the index's evictions, those not the policy's (a clear, a weight change)


class CacheEngine:
    def __init__(
        self,
        config: CacheConfig,
        capacities: dict[Tier, int],
        *,
        listener: IndexListener | None = None,
        on_slots_freed: Callable[[Tier, list[int]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.listener = listener
        self.on_slots_freed = on_slots_freed  # storage hook: a ready block's slot left the index
        self._lock = threading.RLock()
        self.tiers: dict[Tier, TierIndex] = {}
        for tier, capacity in capacities.items():
            if capacity <= 0:
                continue
            self.tiers[tier] = TierIndex(
                tier.value,
                capacity,
                config.eviction_policy,
                hit_reward_seconds=config.hit_reward_seconds,
                slru_protected_hits=config.slru_protected_hits,
                evict_start_threshold=config.evict_start_threshold,
                evict_ratio=config.evict_ratio,
                clock=clock,
                on_removed=self._removed,
            )
        if Tier.HOST not in self.tiers:
            raise ValueError("the host tier needs capacity: every transfer is staged through it")
        self.counters: dict[Tier, TierCounters] = {t: TierCounters() for t in self.tiers}
        self.miss_blocks = 0
        self.remote_hit_blocks = 0  # blocks planned from the remote tier (a read may verify fewer)
        self._tasks: dict[Hashable, list[TierRun]] = {}
        self._reason: RemovalReason | None = None  # what removes blocks now, when not the policy
        # Bumped when the blocks' identity changes (the weights did: KVManager.weights_changed). A
        # task hashed under an older generation plans nothing and commits nothing: old KV never
        # lands after the change, whatever thread raced it.
        self.generation = 0
        self._task_gen: dict[Hashable, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    def match(self, hashes: Hashes) -> MatchResult:
        with self._lock:
            return MatchResult({t: idx.match_length(hashes) for t, idx in self.tiers.items()})

    def task_ids(self) -> list[Hashable]:
        with self._lock:
            return list(self._tasks)

    # ---- planning --------------------------------------------------------------------------------
    def bump_generation(self) -> int:
        with self._lock:
            self.generation += 1
            return self.generation

    def plan_get(
        self,
        task_id: Hashable,
        hashes: Sequence[int],
        start: int = 0,
        remote: tuple[int, int] | None = None,
        generation: int | None = None,
    ) -> GetPlan:
        """Locks what the get reads and stages disk blocks into new host blocks. The plan covers
        blocks [start, plan.end); it may be empty. ``remote=(lo, hi)``: the remote tier held
        blocks [lo, hi) when probed; those past the local prefix are staged into new host blocks
        too (the remote tier is not indexed here: its hits are advisory, the read verifies them)."""
        hashes = _as_ints(hashes)
        if not 0 <= start <= len(hashes):
            raise ValueError(f"get start={start} must be within the request's {len(hashes)} full blocks")
        with self._lock:
            if not self._new_task(task_id, generation):
                return GetPlan(task_id, start, None, None, None)  # hashed before the identity changed
            host, disk = self.tiers[Tier.HOST], self.tiers.get(Tier.DISK)
            h = host.match_length(hashes)
            d = disk.match_length(hashes) if disk is not None else 0
            disk_reads = staged = None
            # Stage from the host frontier h so host stays prefix-closed, unless another task is
            # writing those host blocks right now (then serve what host has).
            if d > max(h, start) and host.match_length(hashes, ready_only=False) == h:
                parent = hashes[h - 1] if h else None
                ids = host.insert(hashes[h:d], parent, task_id)
                k = len(ids)
                if h + k > start:
                    staged = self._track(task_id, TierRun(Tier.HOST, h, hashes[h : h + k], ids, parent, new=True))
                    disk_reads = self._lock_run(task_id, Tier.DISK, hashes, h, h + k)
                elif k:
                    host.rollback(hashes[h : h + k], task_id)
            end = max(h, staged.end if staged is not None else 0)
            remote_staged = None
            if remote is not None and remote[0] <= end < remote[1] and remote[1] > start:
                parent = hashes[end - 1] if end else None
                if host.match_length(hashes, ready_only=False) == end and host.can_extend(parent, task_id):
                    ids = host.insert(hashes[end : remote[1]], parent, task_id)
                    if ids and end + len(ids) > start:
                        remote_staged = self._track(
                            task_id, TierRun(Tier.HOST, end, hashes[end : end + len(ids)], ids, parent, new=True)
                        )
                        self.remote_hit_blocks += len(ids) - max(0, start - end)
                        end = remote_staged.end
                    elif ids:
                        host.rollback(hashes[end : end + len(ids)], task_id)
            # Everything the device will read stays locked until the H2D copy finished,
            # staged blocks included (once committed they would otherwise be evictable).
            host_reads = self._lock_run(task_id, Tier.HOST, hashes, start, end) if end > start else None
            self.counters[Tier.HOST].hit_blocks += max(0, h - start)
            if disk_reads is not None:
                self.counters[Tier.DISK].hit_blocks += max(0, disk_reads.end - max(h, start))
            self.miss_blocks += len(hashes) - max(end, start)
            return GetPlan(task_id, start, host_reads, disk_reads, staged, remote_staged)

    def pin_host(self, task_id: Hashable, hashes: Sequence[int], start: int, limit: int) -> TierRun | None:
        """Locks the ready host blocks [start, end) of ``hashes`` (end: host's ready prefix, at most
        ``start + limit``) as a read run of ``task_id`` (a peer's pull, core/peer/): a locked block is
        neither evicted nor reused until ``abort_task(task_id)`` releases it. None (and no task)
        when host holds nothing past ``start``."""
        hashes = _as_ints(hashes)
        with self._lock:
            end = min(self.tiers[_HOST].match_length(hashes), start + max(0, limit))
            if end <= start:
                return None
            self._new_task(task_id)
            return self._lock_run(task_id, _HOST, hashes, start, end, hit=False)

    def stage_host(
        self, task_id: Hashable, hashes: Sequence[int], end: int, generation: int | None = None
    ) -> TierRun | None:
        """New unready host blocks for [h, end) of ``hashes`` (h: host's ready prefix), which a
        peer's bytes fill (core/peer/): invisible until ``complete_prefix`` commits what verified;
        ``abort_task`` rolls back the rest. None (and no task) when there is nothing to stage: host
        holds the prefix, another task is filling it, or the tier has no room."""
        hashes = _as_ints(hashes)
        with self._lock:
            host = self.tiers[_HOST]
            h = host.match_length(hashes)
            parent = hashes[h - 1] if h else None
            if end <= h or host.match_length(hashes, ready_only=False) != h:
                return None
            if not self._new_task(task_id, generation):
                return None
            if not host.can_extend(parent, task_id):
                self._tasks.pop(task_id, None)
                self._task_gen.pop(task_id, None)
                return None
            ids = host.insert(hashes[h:end], parent, task_id)
            if not ids:
                self._tasks.pop(task_id, None)
                self._task_gen.pop(task_id, None)
                return None
            return self._track(task_id, TierRun(Tier.HOST, h, hashes[h : h + len(ids)], ids, parent, new=True))

    def plan_put(
        self, task_id: Hashable, hashes: Hashes, remote: bool = False, generation: int | None = None
    ) -> PutPlan:
        """Inserts the blocks host and disk do not hold yet (disk subject to the admission filter)
        as unready blocks of ``task_id``, and locks the host blocks that feed disk writes."""
        # An array (its buffer is read) or a list goes to the native index as it is: it checks
        # every hash, and the blocks this put inserts come back as Python ints for the run.
        seq = hashes if isinstance(hashes, (np.ndarray, list)) else _as_ints(hashes)
        with self._lock:
            if not self._new_task(task_id, generation):
                return PutPlan(task_id, None, None, None, 0)  # hashed before the identity changed
            # match (present), touch held, extend: one native call
            held, ids, inserted, parent = self.tiers[_HOST].put(seq, task_id)
            host_run = None
            if ids:
                host_run = TierRun(_HOST, held, inserted, ids, parent, True)
                self._tasks[task_id].append(host_run)
            disk = self.tiers.get(_DISK)
            if disk is None and not remote:
                return PutPlan(task_id, host_run, None, None, held)
            hashes = _as_ints(seq)
            sources = disk_run = None
            if disk is not None:
                d0 = disk.match_length(hashes, ready_only=False)
                d_end = self._admitted_end(hashes, d0, held, host_run)
                d_parent = hashes[d0 - 1] if d0 else None
                if d_end > d0 and disk.can_extend(d_parent, task_id):
                    ids = disk.insert(hashes[d0:d_end], d_parent, task_id)
                    k = len(ids)
                    if k:
                        disk_run = self._track(
                            task_id, TierRun(Tier.DISK, d0, hashes[d0 : d0 + k], ids, d_parent, new=True)
                        )
                        sources = self._lock_run(task_id, Tier.HOST, hashes, d0, d0 + k, hit=False)
            remote_sources = None
            if remote:
                r_end = self._remote_admitted_end(hashes, held, host_run)
                if r_end:
                    remote_sources = self._lock_run(task_id, Tier.HOST, hashes, 0, r_end, hit=False)
            return PutPlan(task_id, host_run, sources, disk_run, held, remote_sources)

    def _remote_admitted_end(self, hashes: list[int], held: int, host_run: TierRun | None) -> int:
        """End of the prefix [0, end) written behind to remote. With remote_admission_hits = 0:
        the whole host prefix, when this put brought new blocks (an earlier put wrote the held
        ones; the write skips what remote already has). With N > 0: the held blocks with N hits."""
        need = self.config.remote_admission_hits
        host = self.tiers[Tier.HOST]
        if need == 0:
            if host_run is None:
                return 0
            ready = host.match_length(hashes)  # held blocks another put still fills are not readable yet
            return host_run.end if ready >= held else ready
        j = 0
        while j < held:
            info = host.info(hashes[j])
            if info is None or not info.ready or info.hits < need:
                break
            j += 1
        return j

    def _admitted_end(self, hashes: list[int], d0: int, held: int, host_run: TierRun | None) -> int:
        """End of the run [d0, end) that may go to disk: each block needs a ready host copy (or
        one this put is filling) and, with disk_admission_hits = N > 0, at least N hits on host.
        Hits only fall along a chain, so admitted blocks form a prefix."""
        need = self.config.disk_admission_hits
        host = self.tiers[Tier.HOST]
        j = d0
        while j < held:
            info = host.info(hashes[j])
            if info is None or not info.ready or info.hits < need:
                return j
            j += 1
        # Write-through: the blocks this put fills on host go to disk too, also when disk already
        # held more of the prefix than host did (after a restart, or once host evicted it).
        if host_run is not None and need == 0 and host_run.start <= j < host_run.end:
            return host_run.end
        return j

    def announce(self, runs: Iterable[TierRun]) -> int:
        """Tells the listener again about ready blocks it has not heard of from this process (disk
        blocks re-adopted at a restart). Under the index lock, so no Removed of a block can overtake
        its Stored; a run stops at its first block that is no longer ready. Returns blocks announced."""
        sent = 0
        with self._lock:
            if self.listener is None:
                return 0
            for run in runs:
                idx = self.tiers[run.tier]
                n = 0
                while n < len(run.hashes) and idx.is_ready(run.hashes[n]):
                    n += 1
                if n:
                    if run.token_ids is None:
                        raise ValueError("announce: a run needs its token_ids (the router events carry them)")
                    b = len(run.token_ids) // len(run.hashes)
                    self.listener.on_stored(
                        run.tier,
                        dataclasses.replace(
                            run, hashes=run.hashes[:n], block_ids=run.block_ids[:n], token_ids=run.token_ids[: n * b]
                        ),
                    )
                    sent += n
        return sent

    # ---- completion ------------------------------------------------------------------------------
    def complete(self, run: TierRun, task_id: Hashable) -> None:
        """The run's copy finished: commit new blocks (now readable) or release read locks."""
        with self._lock:
            self._check_open(run, task_id)
            idx = self.tiers[run.tier]
            if run.new and self._task_gen.get(task_id) != self.generation:
                self._abort_run(run, task_id)  # planned before the identity changed: never visible
                return
            if run.new:
                idx.commit_slots(run.block_ids, run.hashes, task_id)
                self.counters[run.tier].stored_blocks += len(run.hashes)
                if self.listener is not None:
                    self.listener.on_stored(run.tier, run)
            else:
                if run.hit:
                    idx.touch(run.hashes, hit=True)
                idx.unlock(run.hashes)
            run.done = True

    def complete_prefix(self, run: TierRun, task_id: Hashable, count: int) -> None:
        """Commits the first ``count`` blocks of a new run (their bytes landed and were verified);
        the rest stays open in the task, so abort_task rolls it back."""
        with self._lock:
            self._check_open(run, task_id)
            if not run.new:
                raise IndexInvariantError("complete_prefix applies to new blocks only")
            if self._task_gen.get(task_id) != self.generation:
                self._abort_run(run, task_id)  # planned before the identity changed: never visible
                return
            if count >= len(run):
                self.complete(run, task_id)
                return
            if count <= 0:
                return
            head = dataclasses.replace(run, hashes=run.hashes[:count], block_ids=run.block_ids[:count], token_ids=None)
            if run.token_ids is not None:
                b = len(run.token_ids) // len(run.hashes)
                head.token_ids, run.token_ids = run.token_ids[: count * b], run.token_ids[count * b :]
            self.tiers[run.tier].commit(head.hashes, task_id)
            self.counters[run.tier].stored_blocks += count
            run.parent, run.start = run.hashes[count - 1], run.start + count
            run.hashes, run.block_ids = run.hashes[count:], run.block_ids[count:]
            if self.listener is not None:
                self.listener.on_stored(run.tier, head)

    def abort(self, run: TierRun, task_id: Hashable) -> None:
        """The run's copy failed or was cancelled: roll back new blocks, release read locks."""
        with self._lock:
            self._check_open(run, task_id)
            self._abort_run(run, task_id)

    def finish_task(self, task_id: Hashable) -> None:
        """Forgets a task whose runs are all complete or aborted."""
        with self._lock:
            runs = self._tasks.pop(task_id, None)
            if runs is None:
                raise KeyError(f"unknown task {task_id!r}")
            open_runs = [r for r in runs if not r.done]
            if open_runs:
                self._tasks[task_id] = runs
                raise IndexInvariantError(f"task {task_id!r} still has {len(open_runs)} open runs")
            self._task_gen.pop(task_id, None)

    def abort_task(self, task_id: Hashable, *, replan: bool = False) -> None:
        """Aborts every open run of the task (newest first) and forgets it. ``replan``: the task
        will be planned again (a deferred put), so its new blocks do not count as rolled back."""
        with self._lock:
            self._task_gen.pop(task_id, None)
            for run in reversed(self._tasks.pop(task_id, [])):
                if not run.done:
                    self._abort_run(run, task_id, counted=not replan)

    def discard(self, tier: Tier, block_ids: Sequence[int]) -> list[int]:
        """Drops blocks whose bytes proved bad (and their descendants) from ``tier``."""
        with self._removing(RemovalReason.FAILED):
            return self.tiers[tier].discard_slots(block_ids)

    def evict(self, tier: Tier, count: int, reason: RemovalReason | None = None) -> list[int]:
        """Evicts up to ``count`` ready, unlocked blocks of ``tier`` by its policy (leaves first,
        so the tier stays prefix-closed); returns their hashes. ``reason``: why, when not to make
        room (then the policy's: evicted or demoted)."""
        if reason is None:
            with self._lock:
                return self.tiers[tier].evict(count)
        with self._removing(reason):
            gone = self.tiers[tier].evict(count)
            self.counters[tier].forced += len(gone)  # removed_blocks says why; evicted_blocks stays the policy's
            return gone

    def reset(self, reason: RemovalReason = RemovalReason.CLEARED) -> None:
        """Drops every cached block; refuses while tasks are in flight."""
        with self._removing(reason):
            if self._tasks:
                raise IndexInvariantError(f"reset with {len(self._tasks)} tasks in flight: wait or cancel them")
            for idx in self.tiers.values():
                idx.clear()

    @contextlib.contextmanager
    def _removing(self, reason: RemovalReason) -> Iterator[None]:
        with self._lock:
            before, self._reason = self._reason, reason
            try:
                yield
            finally:
                self._reason = before

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for tier, idx in self.tiers.items():
                c = self.counters[tier]
                out[tier.value] = {
                    "capacity_blocks": idx.capacity,
                    "used_blocks": idx.pool.num_used,
                    "ready_blocks": idx.num_ready,
                    "evicted_blocks": idx.evictions - c.forced,
                    "hit_blocks": c.hit_blocks,
                    "stored_blocks": c.stored_blocks,
                    "rolled_back_blocks": c.rolled_back_blocks,
                    "removed_blocks": dict(c.removed),
                }
            out["requests"] = {
                "miss_blocks": self.miss_blocks,
                "remote_hit_blocks": self.remote_hit_blocks,
                "tasks_in_flight": len(self._tasks),
            }
            return out

    # ---- internals ---------------------------------------------------------------------------------
    def _new_task(self, task_id: Hashable, generation: int | None = None) -> bool:
        """Registers the task; False (and nothing registered) when it was hashed under an older
        generation than now."""
        if task_id in self._tasks:
            raise IndexInvariantError(f"task id {task_id!r} is already in flight: task ids must be unique")
        if generation is not None and generation != self.generation:
            return False
        self._tasks[task_id] = []
        self._task_gen[task_id] = self.generation
        return True

    def _track(self, task_id: Hashable, run: TierRun) -> TierRun:
        self._tasks[task_id].append(run)
        return run

    def _lock_run(
        self, task_id: Hashable, tier: Tier, hashes: list[int], start: int, end: int, hit: bool = True
    ) -> TierRun:
        idx = self.tiers[tier]
        part = hashes[start:end]
        idx.lock(part)
        parent = hashes[start - 1] if start else None
        return self._track(task_id, TierRun(tier, start, part, idx.block_ids(part), parent, new=False, hit=hit))

    def _check_open(self, run: TierRun, task_id: Hashable) -> None:
        if run.done:
            raise IndexInvariantError(
                f"run {run.tier.value}[{run.start}:{run.end}] of task {task_id!r} already finished"
            )
        if run not in self._tasks.get(task_id, ()):
            raise IndexInvariantError(
                f"run {run.tier.value}[{run.start}:{run.end}] does not belong to task {task_id!r}"
            )

    def _abort_run(self, run: TierRun, task_id: Hashable, counted: bool = True) -> None:
        idx = self.tiers[run.tier]
        if run.new:
            idx.rollback(run.hashes, task_id)
            self.counters[run.tier].rolled_back_blocks += len(run) if counted else 0
        else:
            idx.unlock(run.hashes)
        run.done = True

    def _removed(self, tier_name: str, hashes: list[int], slots: list[int]) -> None:
        tier = Tier(tier_name)
        removed = self.counters[tier].removed
        if self._reason is not None:
            removed[self._reason.value] = removed.get(self._reason.value, 0) + len(hashes)
            if self._reason is not RemovalReason.FAILED:
                log.info("%d %s blocks %s", len(hashes), tier_name, self._reason.value)
        else:  # the policy: demoted where the disk tier still holds the block
            below = self.tiers.get(Tier.DISK) if tier is Tier.HOST else None
            demoted = sum(1 for h in hashes if h in below) if below is not None else 0
            for reason, n in ((RemovalReason.DEMOTED, demoted), (RemovalReason.EVICTED, len(hashes) - demoted)):
                if n:
                    removed[reason.value] = removed.get(reason.value, 0) + n
        if self.on_slots_freed is not None:
            self.on_slots_freed(Tier(tier_name), slots)
        if self.listener is not None:
            self.listener.on_removed(Tier(tier_name), hashes)


def _as_ints(hashes: Hashes) -> list[int]:
    """Python ints: dict lookups with numpy scalars cost several times more."""
    return hashes.tolist() if isinstance(hashes, np.ndarray) else [int(h) for h in hashes]
