"""TransferRunner: runs the ready ops of every submitted graph on worker threads.

An op runs once all its deps are done. A failing op fails its graph: no further op of that graph
starts, the ones already running drain, and only then does the graph finish (so buffers are never
freed under a copy in flight). Cancel works the same way, without an error; ops of a cancelled
graph still waiting in the queue are skipped, not run, and a load's device copy that reaches its
fence after the cancel (fence.py: CopyFenced) counts as skipped too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dynamo_flexkv.core.transfer.fence import CopyFenced
from dynamo_flexkv.core.transfer.graph import GraphState, OpKind, OpState, TransferGraph, TransferOp

log = logging.getLogger(__name__)


class Mover(Protocol):
    """Moves the bytes of one op; returns the bytes moved; raises on failure."""

    def run(self, op: TransferOp) -> int: ...


# Wraps the mover of one link (fault injection, throttling, tracing): given the link and the mover
# KVManager built for it, returns the mover the runner uses instead (KVManager(mover_hook=...)).
MoverHook = Callable[[OpKind, Mover], Mover]


class AsyncMover(Protocol):
    """Moves one op's bytes elsewhere (an attached engine copies them, core/node/engines.py):
    ``start`` returns at once, and ``done(error, nbytes)`` is called once, from any thread, when
    the op landed (error None) or failed. No transfer thread waits for it meanwhile."""

    def start(self, op: TransferOp, done: Callable[[BaseException | None, int], None]) -> None: ...


# Writes behind a put (to disk or remote) that nothing waits for: they run on threads of their own,
# so a stalled disk never holds up a load's copy (an engine's forward waits on it) or a store's
# device copy (the engine's blocks wait on it). Measured: one shared queue froze both workers of
# a served demo while a virtual disk stalled (test_manager_misuse_and_restarts, hung disk writes).
BACKGROUND = frozenset({OpKind.H2DISK, OpKind.H2REMOTE})


class TransferRunner:
    def __init__(self, movers: dict[OpKind, Mover], workers: int = 4, background_workers: int = 2) -> None:
        self.num_threads = workers
        self.movers = dict(movers)
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._background: queue.Queue[tuple | None] = queue.Queue()
        self._lock = threading.Lock()
        self._running: dict[int, int] = {}  # id(graph) -> ops in flight
        self._graphs: dict[int, TransferGraph] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(self._queue,), name=f"flexkv-transfer-{i}", daemon=True)
            for i in range(workers)
        ] + [
            threading.Thread(target=self._work, args=(self._background,), name=f"flexkv-write-{i}", daemon=True)
            for i in range(max(1, background_workers))
        ]
        for t in self._threads:
            t.start()
        self.link_bytes: dict[OpKind, int] = {k: 0 for k in OpKind}
        self.link_seconds: dict[OpKind, float] = {k: 0.0 for k in OpKind}
        self.link_ops: dict[OpKind, int] = {k: 0 for k in OpKind}
        self.failed_ops = 0

    def submit(self, graph: TransferGraph) -> TransferGraph:
        for op in graph.ops:
            if op.device is None and op.kind not in self.movers:
                raise ValueError(f"no mover for {op.kind.value}: this manager was built without that tier")
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer runner is shut down")
            self._graphs[id(graph)] = graph
            self._running[id(graph)] = 0
            self._dispatch(graph)
            finished = self._maybe_finish(graph)  # a graph without ops is done at once
        if finished:
            self._finish(graph)
        return graph

    def cancel(self, graph: TransferGraph) -> None:
        with self._lock:
            finished = False
            if graph.state is GraphState.RUNNING:
                graph.cancel_requested = True
                finished = self._maybe_finish(graph)
        if finished:
            self._finish(graph)

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancels every graph, lets running ops drain, stops the workers."""
        with self._lock:
            self._closed = True
            graphs = list(self._graphs.values())
        for g in graphs:
            self.cancel(g)
        for g in graphs:
            g.finished.wait(timeout)
        for t in self._threads:
            (self._background if t.name.startswith("flexkv-write") else self._queue).put(None)
        for t in self._threads:
            t.join(timeout)

    # ---- internals (self._lock held where noted) --------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Ready copies waiting for a worker thread."""
        return self._queue.qsize() + self._background.qsize()

    def _dispatch(self, graph: TransferGraph) -> None:  # lock held
        if graph.error is not None or graph.cancel_requested:
            return
        for op in graph.ops:
            if op.state is OpState.PENDING and all(d.state is OpState.DONE for d in op.deps):
                op.state = OpState.RUNNING
                self._running[id(graph)] += 1
                (self._background if op.kind in BACKGROUND else self._queue).put((graph, op))

    def _work(self, ops: queue.Queue[tuple | None]) -> None:
        while True:
            item = ops.get()
            if item is None:
                return
            graph, op = item
            op.started = time.perf_counter()
            if graph.cancel_requested or graph.error is not None:  # stopped while it queued: never run
                self._settle(graph, op, CopyFenced("its graph stopped before it ran"), 0)
                continue
            mover = op.device if op.device is not None else self.movers[op.kind]
            start = getattr(mover, "start", None)
            if start is not None:  # an engine copies it: settled by its answer, on whatever thread
                try:
                    start(op, lambda error, nbytes, graph=graph, op=op: self._settle(graph, op, error, nbytes))
                except BaseException as e:  # noqa: BLE001 - it could not even be sent: the op failed
                    self._settle(graph, op, e, 0)
                continue
            try:
                nbytes = int(mover.run(op))
                error = None
            except BaseException as e:  # noqa: BLE001 - any failure of a copy fails its graph, never the worker
                nbytes, error = 0, e
            self._settle(graph, op, error, nbytes)

    def _settle(self, graph: TransferGraph, op: TransferOp, error: BaseException | None, nbytes: int) -> None:
        """An op landed (error None) or failed: commit it, dispatch what it unblocked, or fail the graph."""
        # An engine's copy is timed to its own end: the answer's way back to this process is not
        # what the engine's forward waited for (cost-aware loading fits the link on these times).
        now = time.perf_counter()
        op.seconds = (op.ended if op.started <= op.ended <= now else now) - op.started
        ok = error is None
        if ok:
            op.nbytes = int(nbytes)
            try:
                if op.on_done is not None:
                    op.on_done(op)
            except BaseException as e:  # noqa: BLE001 - a failed commit fails the graph like a failed copy
                error, ok = e, False
        # Wrote nothing because its graph stopped (cancelled or failed first): not a failure of its own.
        skipped = isinstance(error, CopyFenced) and (graph.cancel_requested or graph.error is not None)
        if not ok and not skipped:
            op.error = error
        with self._lock:
            self._running[id(graph)] -= 1
            finished = False
            if skipped:
                op.state = OpState.SKIPPED
            elif ok:
                op.state = OpState.DONE
                self.link_bytes[op.kind] += op.nbytes
                self.link_seconds[op.kind] += op.seconds
                self.link_ops[op.kind] += 1
                self._dispatch(graph)
            else:
                op.state = OpState.FAILED
                self.failed_ops += 1
                if graph.error is None:
                    graph.error = op.error
            finished = self._maybe_finish(graph)
        if finished:
            self._finish(graph)

    def _maybe_finish(self, graph: TransferGraph) -> bool:  # lock held
        """Settles the graph once nothing of it runs; the caller then runs _finish unlocked
        (the finish callback takes the control plane's lock)."""
        if graph.state is not GraphState.RUNNING or self._running.get(id(graph), 0):
            return False
        stopped = graph.error is not None or graph.cancel_requested
        if not stopped and any(op.state is not OpState.DONE for op in graph.ops):
            return False
        for op in graph.ops:
            if op.state is OpState.PENDING:
                op.state = OpState.SKIPPED
        graph.state = (
            GraphState.FAILED
            if graph.error is not None
            else GraphState.CANCELLED
            if graph.cancel_requested
            else GraphState.DONE
        )
        self._graphs.pop(id(graph), None)
        self._running.pop(id(graph), None)
        return True

    def _finish(self, graph: TransferGraph) -> None:
        try:
            if graph.on_finish is not None:
                graph.on_finish(graph)
        except BaseException:  # a callback bug must not hang waiters
            log.exception("transfer graph finish callback failed")
        finally:
            graph.finished.set()
