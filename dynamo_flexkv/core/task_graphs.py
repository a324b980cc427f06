"""From control-plane plans to data-plane graphs: which ops a get, prefetch or put runs, in what
order, and what the index commits when each op has landed (never before)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dynamo_flexkv.core.index import CacheEngine, GetPlan, PutPlan, Tier
from dynamo_flexkv.core.storage.ssd import DiskEntry, SsdStore
from dynamo_flexkv.core.tasks import Task, TaskKind, TaskResult, TaskStatus
from dynamo_flexkv.core.transfer.graph import GraphState, OpKind, OpState, TransferGraph, TransferOp
from dynamo_flexkv.core.transfer.movers import ChecksumError
from dynamo_flexkv.core.transfer.remote_mover import RemoteShortRead

log = logging.getLogger(__name__)


def _as_ids(block_ids: Sequence[int]) -> np.ndarray:
    """A run's block ids as a TransferOp holds them (its __post_init__ converts them the same way)."""
    return np.asarray(block_ids, dtype=np.int64)


class GraphBuilder:
    def __init__(
        self,
        cache: CacheEngine,
        ssd: SsdStore | None,
        layer_block_bytes: int,
        tokens_per_block: int,
        num_layers: int,
    ) -> None:
        self.cache, self.ssd = cache, ssd
        self.layer_block_bytes = layer_block_bytes
        self.tokens_per_block, self.num_layers = tokens_per_block, num_layers
        self.disk_write_failures = 0
        self.remote_write_failures = 0  # write-behind ops that raised (stats() of the store counts refusals)
        self.remote_short_reads = 0  # gets whose remote part verified fewer blocks than planned
        # (tier, bytes, seconds) of each finished get's and prefetch's reads: the cost model's input
        self.observe_link: Callable[[str, int, float], None] | None = None

    def get(
        self, task: Task, plan: GetPlan, dev_ids: np.ndarray | None, layerwise: bool, device: Any = None
    ) -> TransferGraph:
        """A get (``dev_ids`` given) or a prefetch (None): DISK2H into staged host blocks, then
        H2D per layer or at once. Staged blocks commit after their bytes are verified. ``device``:
        the attached engine that copies its own device blocks (None: the registered device)."""
        load_device = dev_ids is not None
        tid, ops = task.id, []
        layers = [(i, i + 1) for i in range(self.num_layers)] if layerwise else [(0, self.num_layers)]
        # Disk reads feed each layer's device copy. Layerwise with disk: read layer by layer too
        # (when a layer's span keeps O_DIRECT alignment), so layer 0 computes while later layers
        # are still on their way; one VERIFY then checks whole blocks before anything commits.
        disk_for: dict[tuple, TransferOp] = {}
        staged_op: TransferOp | None = None  # the op that commits the disk-staged blocks
        if plan.staged is not None:
            staged, disk_reads = plan.staged, plan.disk_reads
            if disk_reads is None:  # plan_get stages host blocks only together with the disk reads filling them
                raise ValueError("get plan: staged host blocks without the disk reads that fill them")

            def staged_landed(op: TransferOp) -> None:
                self.cache.complete(disk_reads, tid)
                self.cache.complete(staged, tid)

            src, dst_host = _as_ids(disk_reads.block_ids), _as_ids(staged.block_ids)
            split = layerwise and load_device and self.layer_block_bytes % 4096 == 0
            if split:
                # Chained, so each layer's read gets the whole disk in turn: layer 0 lands after
                # 1/L of the read time instead of all layers landing together at the end.
                reads: list[TransferOp] = []
                for span in layers:
                    reads.append(
                        TransferOp(OpKind.DISK2H, src, dst_host, layers=span, deps=(reads[-1],) if reads else ())
                    )
                ops += reads
                staged_op = TransferOp(OpKind.VERIFY, src, dst_host, deps=tuple(reads), on_done=staged_landed)
                ops.append(staged_op)
                disk_for = dict(zip(layers, reads))
            else:
                whole = staged_op = TransferOp(OpKind.DISK2H, src, dst_host, on_done=staged_landed)
                ops.append(whole)
                disk_for = {span: whole for span in layers}
        if plan.remote_staged is not None:
            # Remote blocks land after the disk part (their parent), verified by the store. A
            # shorter verified prefix commits what landed and fails the rest (recomputed).
            # Layerwise: one chained read per layer span (RemoteMover), the last verifying and
            # committing whole blocks, so layer 0 computes while later layers are on their way.
            run = plan.remote_staged
            spans: list[tuple[int, int] | None] = list(layers) if layerwise and load_device else [None]
            reads = []
            for remote_span in spans:
                dep = reads[-1] if reads else staged_op
                reads.append(
                    TransferOp(
                        OpKind.REMOTE2H,
                        _as_ids(run.block_ids),
                        _as_ids(run.block_ids),
                        deps=(dep,) if dep else (),
                        layers=remote_span,
                        seq_hashes=list(run.hashes),
                        parent=run.parent,
                    )
                )
            reads[-1].on_done = lambda op: self.cache.complete(run, tid)
            ops += reads
            disk_for = dict(zip(layers, reads)) if len(reads) == len(layers) else {span: reads[0] for span in layers}
        if dev_ids is not None:  # load_device
            reads_h = plan.host_reads
            if reads_h is None:  # the manager builds no graph for a get with nothing to load
                raise ValueError("get plan: no host blocks to copy to the device")
            dst = dev_ids[reads_h.start : reads_h.end]
            for lo, hi in layers:

                def layer_landed(op: TransferOp, lo: int = lo, hi: int = hi) -> None:
                    for i in range(lo, hi):
                        task.layer_ready[i].set()

                dep = disk_for.get((lo, hi))
                ops.append(
                    TransferOp(
                        OpKind.H2D,
                        _as_ids(reads_h.block_ids),
                        dst,
                        deps=(dep,) if dep else (),
                        layers=(lo, hi),
                        on_done=layer_landed,
                        device=device,
                        fence=task.fence,
                    )
                )
        loaded = plan.num_blocks if load_device else sum(len(r) for r in (plan.staged, plan.remote_staged) if r)

        def finished(graph: TransferGraph) -> None:
            if graph.state is GraphState.DONE:
                if self.observe_link is not None:
                    observe_reads(graph, self.observe_link)
                if plan.host_reads is not None:
                    self.cache.complete(plan.host_reads, tid)
                self.cache.finish_task(tid)
                task.finish(TaskResult(tid, task.kind, TaskStatus.SUCCESS, loaded * self.tokens_per_block))
                return
            if isinstance(graph.error, RemoteShortRead):
                self.remote_short_reads += 1
                staged_ok = plan.staged is None or plan.staged.done
                remote_run = plan.remote_staged  # set: only its reads raise RemoteShortRead
                if staged_ok and remote_run is not None and not remote_run.done:  # keep the verified blocks on host
                    self.cache.complete_prefix(remote_run, tid, graph.error.verified)
            self.cache.abort_task(tid)
            if isinstance(graph.error, ChecksumError):
                self._drop_corrupt(graph.error.disk_ids)
            task.finish(self._failure(task, graph))

        for op in ops:
            op.task_id = tid
        return TransferGraph(ops, on_finish=finished)

    def put(
        self, task: Task, plan: PutPlan, dev_ids: np.ndarray, after: Any = None, device: Any = None
    ) -> TransferGraph:
        """D2H into new host blocks (the task succeeds for its caller right then: the engine may
        reuse its blocks), then H2DISK in the background, journaled before it commits."""
        tid, ops = task.id, []
        host_run = plan.host
        stored = len(host_run) if host_run is not None else 0
        d2h = None
        if host_run is not None:

            def host_landed(op: TransferOp) -> None:
                self.cache.complete(host_run, tid)
                task.finish(TaskResult(tid, TaskKind.PUT, TaskStatus.SUCCESS, stored * self.tokens_per_block))

            d2h = TransferOp(
                OpKind.D2H,
                dev_ids[host_run.start : host_run.end],
                _as_ids(host_run.block_ids),
                after=after,
                on_done=host_landed,
                device=device,
            )
            ops.append(d2h)
        else:
            task.finish(TaskResult(tid, TaskKind.PUT, TaskStatus.SUCCESS, 0))
        # One checksum per block for all its writes (disk journal, Redis header), taken after the
        # D2H landed (the put has already succeeded for the engine); known ones are reused.
        sources = [
            r.block_ids
            for r in (plan.host_sources if plan.disk is not None else None, plan.remote_sources)
            if r is not None
        ]
        feed = d2h  # what the writes wait for
        if sources:
            ids = np.unique(np.concatenate([np.asarray(b, dtype=np.int64) for b in sources]))
            feed = TransferOp(OpKind.HASH, ids, ids, deps=(d2h,) if d2h else ())
            ops.append(feed)
        if plan.disk is not None:
            disk_run, disk_sources = plan.disk, plan.host_sources
            if disk_sources is None:  # plan_put locks the host blocks feeding every disk write it plans
                raise ValueError("put plan: disk blocks without the host blocks that feed them")

            def disk_landed(op: TransferOp) -> None:
                run, tpb, ssd = disk_run, self.tokens_per_block, self.ssd
                if ssd is None:  # never: a disk tier exists only with its store (KVManager)
                    raise RuntimeError("a disk write landed without a disk store to journal it")
                tokens = np.asarray(run.token_ids, dtype="<u4").tobytes() if run.token_ids is not None else None
                ssd.record_stored(
                    DiskEntry(b, h, p, int(c), tokens and tokens[4 * tpb * i : 4 * tpb * (i + 1)])
                    for i, (b, h, p, c) in enumerate(
                        zip(run.block_ids, run.hashes, [run.parent, *run.hashes[:-1]], op.result)
                    )
                )
                self.cache.complete(disk_run, tid)
                self.cache.complete(disk_sources, tid)

            ops.append(
                TransferOp(
                    OpKind.H2DISK,
                    _as_ids(disk_sources.block_ids),
                    _as_ids(disk_run.block_ids),
                    deps=(feed,) if feed else (),
                    on_done=disk_landed,
                )
            )

        if plan.remote_sources is not None:
            src = plan.remote_sources
            ops.append(
                TransferOp(
                    OpKind.H2REMOTE,
                    _as_ids(src.block_ids),
                    _as_ids(src.block_ids),
                    deps=(feed,) if feed else (),
                    seq_hashes=list(src.hashes),
                    parent=src.parent,
                    on_done=lambda op: self.cache.complete(src, tid),
                )
            )

        def finished(graph: TransferGraph) -> None:
            if graph.state is GraphState.DONE:
                self.cache.finish_task(tid)
                return
            if d2h is not None and d2h.state is OpState.DONE and graph.state is GraphState.FAILED:
                failed = [op.kind.value for op in graph.ops if op.state is OpState.FAILED]
                if OpKind.H2DISK.value in failed:
                    self.disk_write_failures += 1
                if OpKind.H2REMOTE.value in failed:
                    self.remote_write_failures += 1
                log.warning("put %d: %s write failed (%s); the blocks stay on host", tid, "/".join(failed), graph.error)
            self.cache.abort_task(tid)
            task.finish(self._failure(task, graph))

        for op in ops:
            op.task_id = tid
        return TransferGraph(ops, on_finish=finished)

    def _failure(self, task: Task, graph: TransferGraph) -> TaskResult:
        if graph.state is GraphState.CANCELLED:
            return TaskResult(task.id, task.kind, TaskStatus.CANCELLED)
        return TaskResult(task.id, task.kind, TaskStatus.FAILED, error=f"{type(graph.error).__name__}: {graph.error}")

    def _drop_corrupt(self, disk_ids: list[int]) -> None:
        log.error("disk blocks %s failed their checksum; dropping them", disk_ids[:8])
        self.cache.discard(Tier.DISK, disk_ids)


# Which tier an op of a get reads (VERIFY: the disk read's check, part of its time, not its bytes).
_READ_TIER = {OpKind.H2D: "host", OpKind.DISK2H: "disk", OpKind.VERIFY: "disk", OpKind.REMOTE2H: "remote"}


def observe_reads(graph: TransferGraph, observe: Callable[[str, int, float], None]) -> None:
    """Reports each tier a finished get read: its bytes and the wall time from its first op's start
    to its last op's end. Host->device only for gets that read host alone (behind a disk or remote
    read its copies wait for those)."""
    spans: dict[str, list[float]] = {}
    for op in graph.ops:
        tier = _READ_TIER.get(op.kind)
        if tier is None or op.state is not OpState.DONE:
            continue
        span = spans.setdefault(tier, [op.started, op.started + op.seconds, 0])
        span[0], span[1] = min(span[0], op.started), max(span[1], op.started + op.seconds)
        if op.kind is not OpKind.VERIFY:
            span[2] += op.nbytes
    if len(spans) > 1:
        spans.pop("host", None)
    for tier, (lo, hi, nbytes) in spans.items():
        if nbytes > 0:
            observe(tier, int(nbytes), hi - lo)
