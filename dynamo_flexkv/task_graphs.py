"""From control-plane plans to data-plane graphs: which ops a get, prefetch or put runs, in what
order, and what the index commits when each op has landed (never before)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import numpy as np

from dynamo_flexkv.index import CacheEngine, GetPlan, PutPlan, Tier
from dynamo_flexkv.storage.ssd import DiskEntry, SsdStore
from dynamo_flexkv.tasks import Task, TaskKind, TaskResult, TaskStatus
from dynamo_flexkv.transfer.graph import GraphState, OpKind, OpState, TransferGraph, TransferOp
from dynamo_flexkv.transfer.movers import ChecksumError

log = logging.getLogger(__name__)


class GraphBuilder:
    def __init__(self, cache: CacheEngine, ssd: Optional[SsdStore], layer_block_bytes: int,
                 tokens_per_block: int, num_layers: int) -> None:
        self.cache, self.ssd = cache, ssd
        self.layer_block_bytes = layer_block_bytes
        self.tokens_per_block, self.num_layers = tokens_per_block, num_layers
        self.disk_write_failures = 0

    def get(self, task: Task, plan: GetPlan, dev_ids: Optional[np.ndarray], layerwise: bool) -> TransferGraph:
        """A get (``dev_ids`` given) or a prefetch (None): DISK2H into staged host blocks, then
        H2D per layer or at once. Staged blocks commit after their bytes are verified."""
        load_device = dev_ids is not None
        tid, ops = task.id, []
        layers = [(i, i + 1) for i in range(self.num_layers)] if layerwise else [(0, self.num_layers)]
        # Disk reads feed each layer's device copy. Layerwise with disk: read layer by layer too
        # (when a layer's span keeps O_DIRECT alignment), so layer 0 computes while later layers
        # are still on their way; one VERIFY then checks whole blocks before anything commits.
        disk_for: Dict[tuple, TransferOp] = {}
        if plan.staged is not None:
            def staged_landed(op: TransferOp) -> None:
                self.cache.complete(plan.disk_reads, tid)
                self.cache.complete(plan.staged, tid)
            src, dst_host = plan.disk_reads.block_ids, plan.staged.block_ids
            split = layerwise and load_device and self.layer_block_bytes % 4096 == 0
            if split:
                # Chained, so each layer's read gets the whole disk in turn: layer 0 lands after
                # 1/L of the read time instead of all layers landing together at the end.
                reads: List[TransferOp] = []
                for span in layers:
                    reads.append(TransferOp(OpKind.DISK2H, src, dst_host, layers=span,
                                            deps=(reads[-1],) if reads else ()))
                ops += reads
                ops.append(TransferOp(OpKind.VERIFY, src, dst_host, deps=tuple(reads), on_done=staged_landed))
                disk_for = dict(zip(layers, reads))
            else:
                whole = TransferOp(OpKind.DISK2H, src, dst_host, on_done=staged_landed)
                ops.append(whole)
                disk_for = {span: whole for span in layers}
        if load_device:
            reads_h = plan.host_reads
            dst = dev_ids[reads_h.start:reads_h.end]
            for lo, hi in layers:
                def layer_landed(op: TransferOp, lo=lo, hi=hi) -> None:
                    for i in range(lo, hi):
                        task.layer_ready[i].set()
                dep = disk_for.get((lo, hi))
                ops.append(TransferOp(OpKind.H2D, reads_h.block_ids, dst, deps=(dep,) if dep else (),
                                      layers=(lo, hi), on_done=layer_landed))
        loaded = plan.num_blocks if load_device else (len(plan.staged) if plan.staged else 0)

        def finished(graph: TransferGraph) -> None:
            if graph.state is GraphState.DONE:
                if plan.host_reads is not None:
                    self.cache.complete(plan.host_reads, tid)
                self.cache.finish_task(tid)
                task.finish(TaskResult(tid, task.kind, TaskStatus.SUCCESS, loaded * self.tokens_per_block))
                return
            self.cache.abort_task(tid)
            if isinstance(graph.error, ChecksumError):
                self._drop_corrupt(graph.error.disk_ids)
            task.finish(self._failure(task, graph))
        return TransferGraph(ops, on_finish=finished)

    def put(self, task: Task, plan: PutPlan, dev_ids: np.ndarray, after: Any = None) -> TransferGraph:
        """D2H into new host blocks (the task succeeds for its caller right then: the engine may
        reuse its blocks), then H2DISK in the background, journaled before it commits."""
        tid, ops = task.id, []
        stored = len(plan.host) if plan.host is not None else 0
        d2h = None
        if plan.host is not None:
            def host_landed(op: TransferOp) -> None:
                self.cache.complete(plan.host, tid)
                task.finish(TaskResult(tid, TaskKind.PUT, TaskStatus.SUCCESS, stored * self.tokens_per_block))
            d2h = TransferOp(OpKind.D2H, dev_ids[plan.host.start:plan.host.end], plan.host.block_ids,
                             after=after, on_done=host_landed)
            ops.append(d2h)
        else:
            task.finish(TaskResult(tid, TaskKind.PUT, TaskStatus.SUCCESS, 0))
        if plan.disk is not None:
            def disk_landed(op: TransferOp) -> None:
                run, tpb = plan.disk, self.tokens_per_block
                tokens = (np.asarray(run.token_ids, dtype="<u4").tobytes() if run.token_ids is not None
                          else None)
                self.ssd.record_stored(
                    DiskEntry(b, h, p, int(c), tokens and tokens[4 * tpb * i:4 * tpb * (i + 1)])
                    for i, (b, h, p, c) in enumerate(zip(run.block_ids, run.hashes, [run.parent, *run.hashes[:-1]],
                                                         op.result)))
                self.cache.complete(plan.disk, tid)
                self.cache.complete(plan.host_sources, tid)
            ops.append(TransferOp(OpKind.H2DISK, plan.host_sources.block_ids, plan.disk.block_ids,
                                  deps=(d2h,) if d2h else (), on_done=disk_landed))

        def finished(graph: TransferGraph) -> None:
            if graph.state is GraphState.DONE:
                self.cache.finish_task(tid)
                return
            if d2h is not None and d2h.state is OpState.DONE and graph.state is GraphState.FAILED:
                self.disk_write_failures += 1
                log.warning("put %d: disk write failed (%s); the blocks stay on host only", tid, graph.error)
            self.cache.abort_task(tid)
            task.finish(self._failure(task, graph))
        return TransferGraph(ops, on_finish=finished)

    def _failure(self, task: Task, graph: TransferGraph) -> TaskResult:
        if graph.state is GraphState.CANCELLED:
            return TaskResult(task.id, task.kind, TaskStatus.CANCELLED)
        return TaskResult(task.id, task.kind, TaskStatus.FAILED, error=f"{type(graph.error).__name__}: {graph.error}")

    def _drop_corrupt(self, disk_ids: List[int]) -> None:
        log.error("disk blocks %s failed their checksum; dropping them", disk_ids[:8])
        self.cache.discard(Tier.DISK, disk_ids)

