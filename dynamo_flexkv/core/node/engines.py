"""An attached engine's device, as the service's transfer runner sees it: the engine's own blocks,
copied by the engine itself.

The service plans a task as usual (core/task_graphs.py); its device copies (H2D, D2H) carry this
device, and the runner hands each to ``start``, which sends it to the engine (RunOp) and returns
at once: no transfer thread waits on an engine. The engine copies between its device blocks and
the shared host segment and answers (OpDone), which finishes the op and lets the graph go on
(commit after the bytes landed, as in one process).

Fencing: an engine that goes away with copies in flight leaves them failed, so nothing commits;
but a device-to-host copy of a process that is still alive (a dropped connection, not a death)
could still write into host slots the service is about to reuse. Those ops fail only once the
process has exited (its pidfd), so their slots stay owned, unready, until nothing can write them."""

from __future__ import annotations

import itertools
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.node.protocol import RunOp, pack_ids
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp

log = logging.getLogger(__name__)

Done = Callable[[BaseException | None, int], None]


class EngineGone(ConnectionError, FlexKVError):
    """The engine that was to copy these blocks detached or died."""


class ExitFence(Protocol):
    """Runs ``callback`` once process ``pid`` has exited (Fence), or at once where nothing needs fencing."""

    def after_exit(self, pid: int, callback: Callable[[], None]) -> None: ...


class EngineDevice:
    """One attached engine's device blocks (``num_blocks``), copied by that engine."""

    _op_ids = itertools.count(1)

    def __init__(
        self,
        name: str,
        num_blocks: int,
        send: Callable[[RunOp], None],
        pid: int,
        forget_host_checksums: Callable[[np.ndarray], None],
    ) -> None:
        self.name, self.num_blocks, self.pid = name, num_blocks, pid
        self.is_cuda = False  # the engine orders its own copies after its writes
        self._send = send
        self._forget = forget_host_checksums
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[TransferOp, Done]] = {}
        self._gone: str | None = None
        self.ops_sent = 0
        self.fenced = 0  # device-to-host copies failed only after their engine's process exited

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self, op: TransferOp, done: Done) -> None:
        if op.kind not in (OpKind.H2D, OpKind.D2H):
            raise ValueError(f"{op.kind.value} is not a device copy")
        if op.kind is OpKind.D2H:
            self._forget(op.dst)  # new bytes: a put's HASH op records their checksum
        lo, hi = op.layers or (0, -1)
        op_id = next(self._op_ids)
        with self._lock:
            if self._gone is not None:
                gone = self._gone
            else:
                gone = None
                self._pending[op_id] = (op, done)
                self.ops_sent += 1
        if gone is not None:
            done(EngineGone(f"engine {self.name}: {gone}"), 0)
            return
        msg = RunOp(
            op=op_id, task=op.task_id or 0, kind=op.kind.value, src=pack_ids(op.src), dst=pack_ids(op.dst), lo=lo, hi=hi
        )
        try:
            self._send(msg)
        except ConnectionError as e:
            self.finish(op_id, 0, f"cannot reach the engine: {e}")

    def finish(self, op_id: int, nbytes: int, error: str | None, ended: float = 0.0) -> bool:
        """The engine's answer for one op (``ended``: when its copy ended, on the engine's
        time.perf_counter(), the same clock here); False for an op it was never sent (a bad answer)."""
        with self._lock:
            entry = self._pending.pop(op_id, None)
        if entry is None:
            return False
        op, done = entry
        op.ended = ended
        done(None if error is None else EngineGone(f"engine {self.name}: {error}"), nbytes)
        return True

    def detach(self, why: str, fence: ExitFence) -> None:
        """The engine is gone: its host-to-device copies fail now (they only read shared memory),
        its device-to-host ones once its process cannot write any more."""
        with self._lock:
            self._gone = why
            pending, self._pending = list(self._pending.values()), {}
        writes: list[tuple[TransferOp, Done]] = []
        for op, done in pending:
            if op.kind is OpKind.D2H:
                writes.append((op, done))
            else:
                done(EngineGone(f"engine {self.name}: {why}"), 0)
        if writes:
            self.fenced += len(writes)

            def fail_writes() -> None:
                for _, done in writes:
                    done(EngineGone(f"engine {self.name}: {why}"), 0)

            fence.after_exit(self.pid, fail_writes)


class Fence:
    """Runs a callback once a process has exited (pidfd), on a thread of its own; at once for a
    process that is gone already."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Callable[[], None]]] = {}  # pidfd -> callbacks
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="flexkv-node-fence", daemon=True)
        self._thread.start()

    def after_exit(self, pid: int, callback: Callable[[], None]) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            callback()
            return
        except OSError as e:  # no pidfd (old kernel): the process may live on; never reuse its slots early
            log.error("node cache: cannot watch process %d (%s): its unfinished host writes stay fenced", pid, e)
            return
        with self._lock:
            self._waiting.setdefault(fd, []).append(callback)
        os.write(self._wake_w, b"x")

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._waiting.values())

    def _loop(self) -> None:
        while True:
            with self._lock:
                fds = list(self._waiting)
            ready, _, _ = select.select([self._wake_r, *fds], [], [])
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                if self._closed:
                    return
            for fd in ready:
                if fd == self._wake_r:
                    continue
                with self._lock:
                    callbacks = self._waiting.pop(fd, [])
                os.close(fd)
                for cb in callbacks:
                    try:
                        cb()
                    except Exception:  # a callback bug must not stop the fence
                        log.exception("node cache: fence callback failed")

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
