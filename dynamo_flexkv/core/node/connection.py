"""An engine's connection to the node's cache service: the socket and the protocol (engine side).

``NodeConnection`` attaches (Attach, the host segment's descriptor), maps the segment and keeps the
movers over it; one thread reads the connection (replies, task results, KV events), a few copy
the service's device ops in order (RunOp: H2D, D2H) and answer each. Requests wait for their
reply (``request``); one the service does not answer in time ends the connection. When the
service goes away every reply waited for fails, the copies in progress drain, the offload hears of
it (``OffloadSide.connection_lost``) and a thread attaches again in the background.

What the engine's calls mean (tasks, holds, events for its listener) is the contract adapter's,
core/node/client.py (NodeOffload), which this connection reaches only through ``OffloadSide``."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.layout import KVLayout
from dynamo_flexkv.core.node.channel import Channel, ChannelClosed
from dynamo_flexkv.core.node.protocol import (
    Attach,
    Attached,
    Detach,
    Events,
    OpDone,
    ProtocolError,
    Reply,
    RunOp,
    TaskDone,
    decode_to_engine,
    unpack_ids,
)
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.transfer.fence import DeviceFence
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.core.transfer.movers import HostDeviceMover
from dynamo_flexkv.core.transfer.runner import MoverHook

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a request the service does not answer in this long fails (it is gone or stuck)
RETRY_S = (0.5, 5.0)  # re-attach backoff: first and longest wait
SLOW_CALL_S = 0.25  # a request slower than this is logged: a step of the engine waited for it
TASK_ID_SPAN = 1 << 32  # a service's task ids; the engine's ids are attach * span + the service's id
COPIERS = 4  # threads copying the service's device ops (an embedded KVManager's transfer workers)


class NodeUnavailable(ConnectionError, FlexKVError):
    """The node's cache service is not reachable now: nothing was loaded or stored (recompute)."""


class NodeTimeout(NodeUnavailable):
    """The service did not answer a request in time (stopped, or stuck): it may still run it."""


class NodeRequestFailed(RuntimeError, FlexKVError):
    """The service answered a request with an error (e.g. it refused a request or ran out of
    tasks): that request did nothing (a lookup misses, a load or store does not start)."""


class CopyTarget(Protocol):
    """The task a device copy belongs to: its fence (a load's writes pass it) and its layers' events."""

    fence: DeviceFence
    layers: list[threading.Event]


class OffloadSide(Protocol):
    """What the connection asks of the offload it carries (NodeOffload)."""

    num_layers: int

    def attach_message(self, device_blocks: int) -> Attach:
        """The Attach to send now (the attach key may have changed: weights, events)."""

    def host_layout(self, host_blocks: int) -> KVLayout:
        """The layout of the service's host segment of ``host_blocks`` blocks."""

    def attached(self, msg: Attached) -> None: ...

    def copy_target(self, tid: int) -> CopyTarget:
        """The task (by the engine's id) a RunOp copies for; made if its reply has not come yet."""

    def task_done(self, tid: int, msg: TaskDone) -> None: ...

    def events(self, msg: Events) -> None: ...

    def connection_lost(self, why: str) -> None:
        """Every task in flight fails, the router forgets what this engine announced."""


class Attachment:
    """One attach: the channel, the mapped host segment and the movers over it (by link).

    A service numbers its tasks from 1 again after a restart, so the engine's task ids carry the
    attach they belong to (``gen``): a late result or copy of a task of a service that went away
    can never be taken for a task of its successor."""

    def __init__(
        self, channel: Channel, attached: Attached, host: HostPool, movers: dict[OpKind, Any], gen: int
    ) -> None:
        self.channel, self.attached, self.host, self.movers = channel, attached, host, movers
        self.gen = gen
        self.replies: dict[int, tuple[threading.Event, list[Reply]]] = {}
        self.lock = threading.Lock()
        self.gone = threading.Event()  # lost() finished cleaning up after it

    def task_id(self, service_task: int) -> int:
        """The engine's id of this service's task."""
        if not 0 <= service_task < TASK_ID_SPAN:
            raise ProtocolError(f"the node cache sent task id {service_task}, outside [0, 2**32)")
        return self.gen * TASK_ID_SPAN + service_task

    def service_task(self, tid: int) -> int | None:
        """The service's id of the engine's task ``tid``; None if it is a task of another attach."""
        gen, service_task = divmod(tid, TASK_ID_SPAN)
        return service_task if gen == self.gen else None


class NodeConnection:
    """The engine's connection to the service at ``socket_path`` (attached or retrying)."""

    def __init__(self, socket_path: str, engine: str, side: OffloadSide, mover_hook: MoverHook | None = None) -> None:
        self.socket_path, self.engine, self.side = socket_path, engine, side
        self._mover_hook = mover_hook  # wraps this engine's device copies (fault injection, tracing)
        self.device: DeviceCache | None = None
        self.current: Attachment | None = None
        self.attaches = 0
        self.closed = False
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ops: queue.Queue[tuple[Any, Any] | None] = queue.Queue()  # (attachment, RunOp) to copy
        # As many copier threads as an embedded KVManager has transfer workers: the service sends a
        # load's layers at once, and one thread copying them in turn took 1.7x the embedded load.
        self._drain_lock = threading.Lock()
        self._copiers = [
            threading.Thread(target=self._copy_loop, name=f"flexkv-node-copy-{i}", daemon=True) for i in range(COPIERS)
        ]
        self._retry: threading.Thread | None = None

    def start(self, device: DeviceCache) -> None:
        """Starts the copiers and attaches; a service not up yet is not an error: the engine
        serves, and attaches later."""
        self.device = device
        for t in self._copiers:
            t.start()
        self.connect()
        if self.current is None:
            self.retry_soon()

    def connect(self) -> bool:
        """Attaches to the service; False (and logs why) if it cannot now."""
        device = self.device
        if device is None:
            raise RuntimeError(f"node cache {self.socket_path}: register() the engine's KV tensors before attaching")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CALL_TIMEOUT_S)
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            log.warning("node cache %s: cannot connect (%s): serving without it, retrying", self.socket_path, e)
            return False
        channel = Channel(sock, f"node-cache-{self.engine}")
        try:
            channel.send(self.side.attach_message(device.num_blocks))
            frames = channel.frames()
            body, fds = next(frames)
            msg = decode_to_engine(body)
            if isinstance(msg, Reply):
                raise NodeUnavailable(f"the node cache refused this engine: {msg.error}")
            if not isinstance(msg, Attached) or len(fds) != 1:
                raise ProtocolError(f"expected Attached with the host segment, got {type(msg).__name__}")
            sock.settimeout(None)
            layout = self.side.host_layout(msg.host_blocks)
            host = HostPool(layout, shared_fd=fds[0])
            os.close(fds[0])  # the mapping keeps the segment
        except (OSError, StopIteration, ProtocolError) as e:
            channel.close(str(e))
            channel.release()
            log.warning("node cache %s: attach failed (%s): serving without it, retrying", self.socket_path, e)
            return False
        except NodeUnavailable:
            channel.close("refused")
            channel.release()
            raise
        mover = HostDeviceMover(host, device)
        hook = self._mover_hook or (lambda kind, m: m)
        movers = {kind: hook(kind, mover) for kind in (OpKind.H2D, OpKind.D2H)}
        conn = Attachment(channel, msg, host, movers, gen=self.attaches + 1)
        self.side.attached(msg)
        with self._lock:
            self.current = conn
        self.attaches += 1
        threading.Thread(target=self._read_loop, args=(conn, frames), name="flexkv-node-read", daemon=True).start()
        log.info(
            "node cache %s: attached (service pid %d, %d host blocks of %d bytes)",
            self.socket_path,
            msg.service_pid,
            msg.host_blocks,
            layout.block_bytes,
        )
        return True

    def retry_soon(self) -> None:
        with self._lock:
            if self.closed or (self._retry is not None and self._retry.is_alive()):
                return
            self._retry = threading.Thread(target=self._retry_loop, name="flexkv-node-attach", daemon=True)
            self._retry.start()

    def _retry_loop(self) -> None:
        wait = RETRY_S[0]
        while not self.closed and self.current is None:
            time.sleep(wait)
            try:
                if self.connect():
                    return
            except NodeUnavailable as e:  # refused (e.g. another model holds the server): keep trying, quietly
                log.warning("%s", e)
            wait = min(wait * 2, RETRY_S[1])

    def reattach(self, why: str) -> None:
        """Leaves the service (Detach) and attaches again at once, under a new attach key (the
        engine's weights changed); a refusal leaves the retry thread trying."""
        conn = self.current
        if conn is None:
            return
        try:
            conn.channel.send(Detach())
        except ChannelClosed:
            pass
        self.lost(conn, why)
        if not self.closed:
            try:
                self.connect()  # at once (the retry thread lost() started stops once we are attached)
            except NodeUnavailable as e:  # refused (its model budget is full): the retry thread tries again
                log.warning("%s", e)

    def close(self, why: str) -> None:
        """Detaches (its queued messages get a second to leave) and stops the copiers; once only."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            conn = self.current
        if conn is not None:
            try:
                conn.channel.send(Detach())
                conn.channel.close(why, flush_s=1.0)
            except ChannelClosed:
                pass
            self.lost(conn, why)
        for _ in self._copiers:
            self._ops.put(None)

    # ---- the connection's threads ---------------------------------------------------------------------
    def _read_loop(self, conn: Attachment, frames: Any) -> None:
        why = "the node cache service closed the connection"
        try:
            for body, fds in frames:
                for fd in fds:
                    os.close(fd)
                msg = decode_to_engine(body)
                if isinstance(msg, Reply):
                    self._reply(conn, msg)
                elif isinstance(msg, RunOp):
                    self._ops.put((conn, msg))
                elif isinstance(msg, TaskDone):
                    self.side.task_done(conn.task_id(msg.task), msg)
                elif isinstance(msg, Events):
                    self.side.events(msg)
        except (ProtocolError, ChannelClosed) as e:
            why = str(e)
        except Exception as e:  # whatever broke, the engine goes on without the service (logged below)
            why = f"{type(e).__name__}: {e}"
            log.exception("node cache: reading from the service failed")
        self.lost(conn, why)

    def _copy_loop(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            conn, msg = item
            if isinstance(msg, threading.Barrier):  # _drain_copies: every copier done with what came before
                try:
                    msg.wait(CALL_TIMEOUT_S)
                except threading.BrokenBarrierError:
                    pass
                continue
            if conn.channel.closed is not None:
                continue  # its service is gone: nobody waits for this copy
            error, nbytes = None, 0
            task = self.side.copy_target(conn.task_id(msg.task))
            try:
                op = TransferOp(
                    OpKind(msg.kind),
                    unpack_ids(msg.src),
                    unpack_ids(msg.dst),
                    layers=(msg.lo, msg.hi) if msg.hi >= 0 else None,
                    task_id=msg.task,
                    fence=task.fence if msg.kind == OpKind.H2D.value else None,
                )
                nbytes = conn.movers[op.kind].run(op)
            except Exception as e:  # noqa: BLE001 - reported to the service, which fails the task
                error = f"{type(e).__name__}: {e}"
            ended = time.perf_counter()
            if error is None and msg.kind == OpKind.H2D.value:
                for i in range(max(msg.lo, 0), msg.hi if msg.hi >= 0 else self.side.num_layers):
                    task.layers[i].set()
            try:
                conn.channel.send(OpDone(op=msg.op, nbytes=nbytes, error=error, ended=ended))
            except ChannelClosed:
                pass

    def lost(self, conn: Attachment, why: str) -> None:
        """The service went away: every reply waited for fails, the copies in progress drain, the
        offload fails its tasks; then a thread attaches again (unless closed)."""
        conn.channel.close(why)
        with self._lock:
            if self.current is not conn:  # another thread cleans up: wait for it to finish
                cleaning = True
            else:
                cleaning = False
                self.current = None
        if cleaning:
            conn.gone.wait(CALL_TIMEOUT_S)
            return
        for rid, (ev, box) in list(conn.replies.items()):
            box.append(Reply(id=rid, error=f"the node cache service went away: {why}", kind="closed"))
            ev.set()
        self._drain_copies()
        self.side.connection_lost(why)
        conn.host.close()
        conn.gone.set()
        conn.channel.release()
        if not self.closed:
            log.warning("node cache %s: %s; recomputing until it is back", self.socket_path, why)
            self.retry_soon()

    def _drain_copies(self) -> None:
        """Waits for the copies in progress (queued ones for a closed channel are skipped): each
        copier takes one place at a barrier once it finished the copy it had."""
        with self._drain_lock:  # two drains' places interleaved in the queue would each wait forever
            alive = [t for t in self._copiers if t.is_alive()]
            if not alive:
                return
            barrier = threading.Barrier(len(alive) + 1)
            for _ in alive:
                self._ops.put((None, barrier))
            try:
                barrier.wait(CALL_TIMEOUT_S)
            except threading.BrokenBarrierError:
                pass

    # ---- requests ---------------------------------------------------------------------------------------
    def _reply(self, conn: Attachment, msg: Reply) -> None:
        with conn.lock:
            waiter = conn.replies.pop(msg.id, None)
        if waiter is not None:
            waiter[1].append(msg)
            waiter[0].set()
        elif msg.error:
            log.warning("node cache: %s", msg.error)

    def request_task(self, make: Callable[[int], Any]) -> tuple[int, Any]:
        """A request that starts a task on the service: the task's engine id and the reply's value.
        One the service does not answer in time ends the connection: the service may still run it
        later, and its copies must then find no engine (the engine reuses the blocks it got back),
        so the late task fails there and commits nothing; the engine attaches again by itself."""
        conn = self.current
        try:
            value = self.request(make, conn=conn)
        except NodeTimeout as e:
            if conn is not None:
                self.lost(conn, str(e))
            raise
        assert conn is not None  # request() raised NodeUnavailable otherwise
        return conn.task_id(int(value["task"])), value

    def request(
        self, make: Callable[[int], Any], timeout: float = CALL_TIMEOUT_S, conn: Attachment | None = None
    ) -> Any:
        """Sends ``make(request id)`` and returns its reply's value; NodeUnavailable when not
        attached or the service went away, NodeTimeout, NodeRequestFailed when it answered an error."""
        conn = conn or self.current
        if conn is None:
            raise NodeUnavailable(f"the node cache at {self.socket_path} is not attached")
        rid = next(self._ids)
        ev = threading.Event()
        box: list[Reply] = []
        with conn.lock:
            conn.replies[rid] = (ev, box)
        t0 = time.monotonic()
        try:
            msg = make(rid)
            conn.channel.send(msg)
        except ChannelClosed as e:
            with conn.lock:
                conn.replies.pop(rid, None)
            raise NodeUnavailable(str(e)) from None
        if not ev.wait(timeout):
            with conn.lock:
                conn.replies.pop(rid, None)
            raise NodeTimeout(f"the node cache did not answer within {timeout} s")
        took = time.monotonic() - t0
        if took > SLOW_CALL_S:  # the engine's step (or the scheduler's lookup) waited this long
            log.warning("node cache: a %s took %.0f ms to answer", type(msg).__name__, took * 1e3)
        reply = box[0]
        if reply.error is not None:
            if reply.kind == "closed":
                raise NodeUnavailable(reply.error)
            raise NodeRequestFailed(f"node cache: {reply.error}")
        return reply.value

    def send_task_quietly(self, make: Callable[..., Any], tid: int) -> None:
        """A message about task ``tid`` to the service that runs it (none if that one is gone)."""
        conn = self.current
        service_task = None if conn is None else conn.service_task(tid)
        if service_task is not None:
            self.send_quietly(make(task=service_task))

    def send_quietly(self, msg: Any) -> None:
        conn = self.current
        if conn is not None:
            try:
                conn.channel.send(msg)
            except ChannelClosed:
                pass
