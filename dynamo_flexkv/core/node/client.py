"""NodeOffload: the engine contract (core/offload.py) through the node's cache service.

The engine keeps what must stay local: its device blocks and the copies between them and the
host tier, which is the service's shared segment mapped here. So a load's layer waits are local
events, set by this process's own copy of that layer; the service plans what moves (which host
slots, which disk reads first) and commits what landed, as one KVManager would.

One thread reads the connection (replies, task results, KV events for the engine's listener),
one runs the service's copy requests in order (RunOp: H2D, D2H) and answers each. If the service
goes away, every task in flight fails (the engine recomputes: exact tokens), the tier blocks this
engine announced are removed from its router view, and a thread attaches again in the background;
until then lookups miss and loads, stores and prefetches start nothing (the contract's
``miss_on_tier_fault``: the engine computes), without waiting."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.contract import (
    EngineOffload,
    Hold,
    miss_explained_on_tier_fault,
    miss_lookup_on_tier_fault,
    no_task_on_tier_fault,
)
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.hashing import namespaced_hashes
from dynamo_flexkv.core.index.cache_engine import IndexListener, Tier, TierRun
from dynamo_flexkv.core.inventory import CacheReport, CacheRequest, parse_report
from dynamo_flexkv.core.layout import KVLayoutType, ModelSpec
from dynamo_flexkv.core.node.channel import Channel, ChannelClosed
from dynamo_flexkv.core.node.protocol import (
    VERSION,
    Admin,
    Attach,
    Attached,
    Call,
    Cancel,
    Detach,
    Events,
    Load,
    Lookup,
    Observe,
    OpDone,
    Prefetch,
    ProtocolError,
    Reply,
    RunOp,
    Store,
    TaskDone,
    decode_to_engine,
    pack_ids,
    pack_tokens,
    unpack_ids,
    unpack_tokens,
)
from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.tasks import TaskFailed, TaskKind, TaskResult, TaskStatus
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


@dataclass
class _Task:
    id: int
    num_layers: int
    kind: TaskKind | None = None
    planned: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    hold: Hold | None = None
    result: TaskResult | None = None
    done: threading.Event = field(default_factory=threading.Event)
    layers: list[threading.Event] = field(default_factory=list)
    # This engine's device writes for the task pass it: cancel_load finishes a load once none can
    # land (core/transfer/fence.py), without waiting for a stalled copy or the service's answer.
    fence: DeviceFence = field(default_factory=DeviceFence)
    service_done: bool = False  # the service's TaskDone came

    def __post_init__(self) -> None:
        self.layers = [threading.Event() for _ in range(self.num_layers)]

    def finish(self, result: TaskResult) -> None:
        if self.result is None:
            self.result = result
        for ev in self.layers:
            ev.set()
        self.done.set()


class _Connection:
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
        self.gone = threading.Event()  # _lost finished cleaning up after it

    def task_id(self, service_task: int) -> int:
        """The engine's id of this service's task."""
        if not 0 <= service_task < TASK_ID_SPAN:
            raise ProtocolError(f"the node cache sent task id {service_task}, outside [0, 2**32)")
        return self.gen * TASK_ID_SPAN + service_task

    def service_task(self, tid: int) -> int | None:
        """The service's id of the engine's task ``tid``; None if it is a task of another attach."""
        gen, service_task = divmod(tid, TASK_ID_SPAN)
        return service_task if gen == self.gen else None


class NodeOffload(EngineOffload):
    def __init__(
        self,
        model: ModelSpec,
        config: CacheConfig,
        *,
        layerwise: bool = True,
        listener: IndexListener | None = None,
        model_id: str,
        engine: str,
        tenant: str = "",
        rank: int = 0,
        ranks: int = 1,
        replicated: bool = False,
        socket_path: str | None = None,
        mover_hook: MoverHook | None = None,
    ) -> None:
        from dynamo_flexkv.core.node.server import default_socket_path

        self.model, self.config = model, config
        self.layerwise, self.bs, self.num_layers = layerwise, config.tokens_per_block, model.num_layers
        self.listener, self.model_id, self.engine, self.tenant = listener, model_id, engine, tenant
        self.rank, self.ranks, self.replicated = rank, ranks, replicated
        self._mover_hook = mover_hook  # wraps this engine's device copies (fault injection, tracing)
        self.socket_path = socket_path or config.node_socket or default_socket_path()
        self.failed_loads = 0
        self.weights_version = ""  # weights_changed(): part of the attach key from then on
        self.device: DeviceCache | None = None
        self._conn: _Connection | None = None
        self._lock = threading.Lock()
        self._tasks: dict[int, _Task] = {}
        self._holds: dict[int, Hold] = {}
        # Cancelled loads collected before the service finished them: a late copy finds their
        # closed fence here (and writes nothing) until their TaskDone comes.
        self._collected: dict[int, _Task] = {}
        self._prefetches: list[int] = []
        self._ids = itertools.count(1)
        self._ops: queue.Queue[tuple[Any, Any] | None] = queue.Queue()  # (connection, RunOp) to copy
        self._announced: dict[str, dict[int, None]] = {"host": {}, "disk": {}}  # what the listener was told
        self._closed = False
        # As many copier threads as an embedded KVManager has transfer workers: the service sends a
        # load's layers at once, and one thread copying them in turn took 1.7x the embedded load.
        self._drain_lock = threading.Lock()
        self._copiers = [
            threading.Thread(target=self._copy_loop, name=f"flexkv-node-copy-{i}", daemon=True) for i in range(COPIERS)
        ]
        self._retry: threading.Thread | None = None
        self.namespace = ""
        self.attaches = 0
        # The node's blocks go to the listener once its publisher can deliver them (announce_adopted:
        # a PUB socket drops what it sends before a subscriber joins); re-attaches send them at once.
        self._publishing = False

    # ---- setup ----------------------------------------------------------------------------------------
    def register(self, layers: Any, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        self.device = DeviceCache.register(layers, self.model, layout, self.bs)
        for t in self._copiers:
            t.start()
        self._connect()  # a service not up yet is not an error: the engine serves, and attaches later
        if self._conn is None:
            self._retry_soon()

    def _connect(self) -> bool:
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
            channel.send(
                Attach(
                    version=VERSION,
                    engine=self.engine,
                    model_id=self.model_id + (f"|weights={self.weights_version}" if self.weights_version else ""),
                    num_layers=self.model.num_layers,
                    num_kv_heads=self.model.num_kv_heads,
                    head_size=self.model.head_size,
                    dtype=self.model.dtype,
                    kv_dim=self.model.kv_dim,
                    tokens_per_block=self.bs,
                    device_blocks=device.num_blocks,
                    tenant=self.tenant,
                    rank=self.rank,
                    ranks=self.ranks,
                    replicated=self.replicated,
                    events=self.listener is not None and self._publishing,
                )
            )
            frames = channel.frames()
            body, fds = next(frames)
            msg = decode_to_engine(body)
            if isinstance(msg, Reply):
                raise NodeUnavailable(f"the node cache refused this engine: {msg.error}")
            if not isinstance(msg, Attached) or len(fds) != 1:
                raise ProtocolError(f"expected Attached with the host segment, got {type(msg).__name__}")
            sock.settimeout(None)
            layout = self.config.layout(self.model, msg.host_blocks, KVLayoutType.BLOCKFIRST)
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
        conn = _Connection(channel, msg, host, movers, gen=self.attaches + 1)
        self.namespace = msg.namespace
        with self._lock:
            self._conn = conn
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

    def _retry_soon(self) -> None:
        with self._lock:
            if self._closed or (self._retry is not None and self._retry.is_alive()):
                return
            self._retry = threading.Thread(target=self._retry_loop, name="flexkv-node-attach", daemon=True)
            self._retry.start()

    def _retry_loop(self) -> None:
        wait = RETRY_S[0]
        while not self._closed and self._conn is None:
            time.sleep(wait)
            try:
                if self._connect():
                    return
            except NodeUnavailable as e:  # refused (e.g. another model holds the server): keep trying, quietly
                log.warning("%s", e)
            wait = min(wait * 2, RETRY_S[1])

    # ---- the connection's threads ---------------------------------------------------------------------
    def _read_loop(self, conn: _Connection, frames: Any) -> None:
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
                    self._task_done(conn, msg)
                elif isinstance(msg, Events):
                    self._events(msg)
        except (ProtocolError, ChannelClosed) as e:
            why = str(e)
        except Exception as e:  # whatever broke, the engine goes on without the service
            why = f"{type(e).__name__}: {e}"
            log.exception("node cache: reading from the service failed")
        self._lost(conn, why)

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
            task = self._task(conn.task_id(msg.task))
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
            if error is None and msg.kind == OpKind.H2D.value:
                for i in range(max(msg.lo, 0), msg.hi if msg.hi >= 0 else self.num_layers):
                    task.layers[i].set()
            try:
                conn.channel.send(OpDone(op=msg.op, nbytes=nbytes, error=error))
            except ChannelClosed:
                pass

    def _lost(self, conn: _Connection, why: str) -> None:
        """The service went away: every task it had fails, the router forgets the node blocks."""
        conn.channel.close(why)
        with self._lock:
            if self._conn is not conn:  # another thread cleans up: wait for it to finish
                cleaning = True
            else:
                cleaning = False
                self._conn = None
        if cleaning:
            conn.gone.wait(CALL_TIMEOUT_S)
            return
        with self._lock:
            tasks = [t for t in self._tasks.values() if t.result is None]
        for rid, (ev, box) in list(conn.replies.items()):
            box.append(Reply(id=rid, error=f"the node cache service went away: {why}", kind="closed"))
            ev.set()
        self._drain_copies()
        for t in tasks:
            t.finish(
                TaskResult(
                    t.id, t.kind or TaskKind.GET, TaskStatus.FAILED, error=f"the node cache service went away: {why}"
                )
            )
        self._forget_announced()
        with self._lock:
            self._collected.clear()  # no copy or result of that service comes any more
        conn.host.close()
        conn.gone.set()
        conn.channel.release()
        if not self._closed:
            log.warning("node cache %s: %s; recomputing until it is back", self.socket_path, why)
            self._retry_soon()

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

    # ---- messages -----------------------------------------------------------------------------------
    def _reply(self, conn: _Connection, msg: Reply) -> None:
        with conn.lock:
            waiter = conn.replies.pop(msg.id, None)
        if waiter is not None:
            waiter[1].append(msg)
            waiter[0].set()
        elif msg.error:
            log.warning("node cache: %s", msg.error)

    def _task(self, tid: int) -> _Task:
        with self._lock:
            t = self._tasks.get(tid) or self._collected.get(tid)
            if t is None:
                t = self._tasks[tid] = _Task(tid, self.num_layers)
            return t

    def _task_done(self, conn: _Connection, msg: TaskDone) -> None:
        tid = conn.task_id(msg.task)
        with self._lock:
            if self._collected.pop(tid, None) is not None:
                return  # its result was taken when its writes were fenced
            t = self._tasks.get(tid)
            if t is None:
                t = self._tasks[tid] = _Task(tid, self.num_layers)
            t.service_done = True
        t.finish(TaskResult(tid, t.kind or TaskKind.GET, TaskStatus(msg.status), msg.num_tokens, msg.error))

    def _events(self, msg: Events) -> None:
        if self.listener is None:
            return
        if msg.resync:
            self._forget_announced()
        for ev in msg.events:
            tier = Tier(ev.tier)
            seen = self._announced[ev.tier]
            if ev.stored:
                if ev.names and hasattr(self.listener, "alias"):
                    named = [(h, n) for h, n in zip(ev.hashes, ev.names) if n is not None]
                    self.listener.alias([h for h, _ in named], [n for _, n in named])
                tokens = unpack_tokens(ev.tokens).tolist() if ev.tokens is not None else None
                self.listener.on_stored(tier, TierRun(tier, 0, list(ev.hashes), [], ev.parent, False, token_ids=tokens))
                seen.update(dict.fromkeys(ev.hashes))
            else:
                self.listener.on_removed(tier, list(ev.hashes))
                for h in ev.hashes:
                    seen.pop(h, None)

    def _forget_announced(self) -> None:
        """The router is told this engine no longer holds what it announced (newest first)."""
        if self.listener is None:
            return
        for name, seen in self._announced.items():
            if seen:
                self.listener.on_removed(Tier(name), list(reversed(list(seen))))
                seen.clear()

    # ---- requests ---------------------------------------------------------------------------------------
    def _request_task(self, make: Any) -> tuple[_Task, Any]:
        """A request that starts a task on the service: the task (under the engine's id) and the reply.
        One the service does not answer in time ends the connection: the service may still run it
        later, and its copies must then find no engine (the engine reuses the blocks it got back),
        so the late task fails there and commits nothing; the engine attaches again by itself."""
        conn = self._conn
        try:
            value = self._request(make, conn=conn)
        except NodeTimeout as e:
            if conn is not None:
                self._lost(conn, str(e))
            raise
        assert conn is not None  # _request raised NodeUnavailable otherwise
        return self._task(conn.task_id(int(value["task"]))), value

    def _request(self, make: Any, timeout: float = CALL_TIMEOUT_S, conn: _Connection | None = None) -> Any:
        conn = conn or self._conn
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

    # ---- the contract -------------------------------------------------------------------------------
    @miss_lookup_on_tier_fault  # no service: what the engine holds
    def cached_tokens(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> int:
        return int(
            self._request(
                lambda rid: Lookup(
                    id=rid,
                    tokens=pack_tokens(tokens),
                    lora=lora_name,
                    salt=cache_salt,
                    prompt_tokens=prompt_tokens,
                    skip_blocks=skip_blocks,
                    layerwise=self.layerwise,
                )
            )
        )

    @miss_explained_on_tier_fault
    def explain_lookup(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> tuple[int, dict[str, Any] | None]:
        value = self._request(
            lambda rid: Lookup(
                id=rid,
                tokens=pack_tokens(tokens),
                lora=lora_name,
                salt=cache_salt,
                prompt_tokens=prompt_tokens,
                skip_blocks=skip_blocks,
                layerwise=self.layerwise,
                explain=True,
            )
        )
        return int(value["end"]), dict(value["decision"])

    def block_hashes(
        self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        return [int(h) for h in namespaced_hashes(tokens, self.bs, self.namespace, lora_name, cache_salt).sequence]

    @no_task_on_tier_fault
    def load(
        self,
        tokens: Sequence[int],
        block_table: Sequence[int],
        skip_blocks: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
    ) -> int | None:
        t, value = self._request_task(
            lambda rid: Load(
                id=rid,
                tokens=pack_tokens(tokens),
                blocks=pack_ids(block_table),
                skip_blocks=skip_blocks,
                lora=lora_name,
                salt=cache_salt,
                prompt_tokens=prompt_tokens,
                layerwise=self.layerwise,
            )
        )
        t.kind, t.planned, t.by_tier = TaskKind.GET, int(value["planned"]), dict(value["by_tier"])
        if t.planned == 0:
            t.done.wait(CALL_TIMEOUT_S)
            self._forget(t.id)
            return None
        return t.id

    def planned_tokens(self, tid: int) -> int:
        return self._known(tid).planned

    def planned_tokens_by_tier(self, tid: int) -> dict[str, int]:
        return dict(self._known(tid).by_tier)

    def wait_layer(self, tid: int, layer: int, timeout: float | None = None) -> bool:
        t = self._known(tid)
        if not t.layers[layer].wait(timeout):
            return False
        if t.result is not None and not t.result.ok:
            raise TaskFailed(f"task {tid}: {t.result.status.value}: {t.result.reason}")
        return True

    def cancel_load(self, tid: int, blocks: Sequence[int], key: Any = None) -> None:
        t = self._known(tid)
        if blocks:
            t.hold = Hold(key, list(blocks))
            with self._lock:
                self._holds[tid] = t.hold
        self._send_task_quietly(Cancel, tid)
        t.fence.close(lambda: t.finish(TaskResult(tid, TaskKind.GET, TaskStatus.CANCELLED)))

    def load_done(self, tid: int) -> bool:
        return self._known(tid).done.is_set()

    def finish(self, tid: int) -> TaskResult:
        t = self._known(tid)
        t.done.wait()
        assert t.result is not None  # _Task.finish() sets the result before it sets done
        self._forget(tid)
        if not t.result.ok:
            self.failed_loads += 1
        return t.result

    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        self._send_quietly(Observe(tokens=int(tokens), prompt_tokens=int(prompt_tokens), seconds=float(seconds)))

    @no_task_on_tier_fault
    def store(
        self,
        tokens: Sequence[int],
        block_table: Sequence[int],
        key: Any = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        names: Sequence[int] | None = None,
    ) -> int | None:
        n = len(tokens) // self.bs
        blocks = list(block_table[:n])
        t, _ = self._request_task(
            lambda rid: Store(
                id=rid,
                tokens=pack_tokens(tokens[: n * self.bs]),
                blocks=pack_ids(blocks),
                lora=lora_name,
                salt=cache_salt,
                names=list(names[:n]) if names else None,
            )
        )
        t.kind, t.hold = TaskKind.PUT, Hold(key, blocks)
        with self._lock:
            self._holds[t.id] = t.hold
        return t.id

    @no_task_on_tier_fault
    def prefetch(self, tokens: Sequence[int]) -> int | None:
        t, _ = self._request_task(lambda rid: Prefetch(id=rid, tokens=pack_tokens(tokens)))
        t.kind = TaskKind.PREFETCH
        with self._lock:
            self._prefetches.append(t.id)
        return t.id

    def cancel_prefetch(self, tid: int) -> None:
        if tid in self._prefetches:
            self._send_task_quietly(Cancel, tid)

    @property
    def tasks_pending(self) -> int:
        with self._lock:
            return len(self._holds) + len(self._prefetches)

    def finished_holds(self) -> list[Hold]:
        """Holds of stores and cancelled loads whose task finished (the service answered every copy
        it asked of this engine first); finished prefetches are collected too."""
        with self._lock:
            finished = [p for p in self._prefetches if self._tasks[p].done.is_set()]
            self._prefetches = [p for p in self._prefetches if p not in finished]
            done = [tid for tid in self._holds if self._tasks[tid].done.is_set()]
            out = [self._holds.pop(tid) for tid in done]
            for tid in done + finished:
                self._forget_locked(tid)
        return out

    def drain_holds(self) -> list[Hold]:
        with self._lock:
            waits = [self._tasks[t] for t in list(self._holds) + self._prefetches]
        for t in waits:
            t.done.wait()
        return self.finished_holds()

    # ---- administration ----------------------------------------------------------------------------
    def stats(self) -> ManagerStats | None:
        try:
            return ManagerStats.from_dict(self._request(lambda rid: Call(id=rid, name="stats"))["tiers"])
        except NodeUnavailable:
            return None

    def service_stats(self) -> dict[str, Any]:
        return self._request(lambda rid: Call(id=rid, name="stats"))

    def drain(self, timeout: float | None = None) -> bool:
        wait = CALL_TIMEOUT_S if timeout is None else timeout + 5
        try:
            return bool(self._request(lambda rid: Call(id=rid, name="drain", timeout=timeout), wait))
        except NodeUnavailable:
            return True  # nothing of this engine's is being written anywhere

    def evict_host(self, timeout: float | None = None) -> int:
        return int(self._request(lambda rid: Call(id=rid, name="evict_host", timeout=timeout)))

    def reset_tiers(self, timeout: float | None = None) -> bool:
        return bool(self._request(lambda rid: Call(id=rid, name="reset", timeout=timeout)))

    def cache_admin(self, req: CacheRequest) -> CacheReport:
        """The service answers for this engine's namespace (Admin on the engine's connection)."""
        value = self._request(
            lambda rid: Admin.of(rid, req),
            timeout=req.wait_s + CALL_TIMEOUT_S,
        )
        return parse_report(value)

    def describe(self) -> dict[str, Any]:
        try:
            out = dict(self._request(lambda rid: Call(id=rid, name="describe")))
        except NodeUnavailable as e:
            out = {"unavailable": str(e)}
        return {"mode": "node", "socket": self.socket_path, **out}

    def tier_files(self) -> list[str]:
        return []  # the service's: not this engine's to touch

    def weights_changed(self, version: str) -> int:
        """The attach key carries the weights: this engine leaves the namespace of the weights
        before (its tasks there fail, the node blocks it announced leave its router view at once;
        the blocks stay for the engines that still run those weights) and attaches to the
        namespace of ``version``. Returns the blocks it had announced."""
        if not isinstance(version, str) or not version.strip():
            raise ValueError(f"weights_changed(version={version!r}): name the new weights with a non-empty string")
        with self._lock:
            if version == self.weights_version:
                return 0
            self.weights_version = version
            conn = self._conn
            announced = sum(len(seen) for seen in self._announced.values())
        if conn is not None:
            try:
                conn.channel.send(Detach())
            except ChannelClosed:
                pass
            self._lost(conn, "the engine's weights changed")
            if not self._closed:
                try:
                    self._connect()  # at once (the retry thread _lost started stops once we are attached)
                except NodeUnavailable as e:  # refused (its model budget is full): the retry thread tries again
                    log.warning("%s", e)
        log.info("node cache: weights changed to %r: left the namespace of the weights before", version)
        return announced

    def announce_adopted(self, repeat: bool = False) -> int:
        """The listener can publish now: the service sends it the node's blocks (what it re-adopted
        included), then every change; after a re-attach it does so at once. Returns the blocks sent."""
        if self.listener is None or self._publishing or repeat:
            return 0
        self._publishing = True
        try:
            return int(self._request(lambda rid: Call(id=rid, name="subscribe")))
        except NodeUnavailable:
            return 0  # the next attach subscribes

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn = self._conn
        if conn is not None:
            try:
                conn.channel.send(Detach())
                conn.channel.close("this engine shut down", flush_s=1.0)
            except ChannelClosed:
                pass
            self._lost(conn, "this engine shut down")
        for _ in self._copiers:
            self._ops.put(None)

    # ---- helpers -------------------------------------------------------------------------------------
    def _known(self, tid: int) -> _Task:
        with self._lock:
            t = self._tasks.get(tid)
        if t is None:
            raise KeyError(f"task {tid!r}: not a task of this engine, or its result was taken")
        return t

    def _forget(self, tid: int) -> None:
        with self._lock:
            self._forget_locked(tid)

    def _forget_locked(self, tid: int) -> None:
        t = self._tasks.pop(tid, None)
        if t is not None and t.fence.closed and not t.service_done:  # copies of it may still come
            self._collected[tid] = t

    def _send_task_quietly(self, make: Any, tid: int) -> None:
        """A message about task ``tid`` to the service that runs it (none if that one is gone)."""
        conn = self._conn
        service_task = None if conn is None else conn.service_task(tid)
        if service_task is not None:
            self._send_quietly(make(task=service_task))

    def _send_quietly(self, msg: Any) -> None:
        conn = self._conn
        if conn is not None:
            try:
                conn.channel.send(msg)
            except ChannelClosed:
                pass
