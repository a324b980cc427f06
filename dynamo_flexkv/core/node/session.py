"""One attached engine's connection to the node cache service, on a thread of its own.

Requests are answered in order (Reply with the request's id); task results (TaskDone), device
copies to run (RunOp, engines.py) and the namespace's KV events (Events) are pushed. A frame that
is not a message of the protocol, a request before Attach, or ids out of the engine's range end or
refuse that engine's request only; the service serves the others on. When the connection ends (a
Detach, a closed socket, a killed engine) the engine's copies in flight fail or are fenced
(engines.py), its tasks are cancelled, and nothing of it stays: the holds it lent are released
with them."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.inventory import CacheReport, CacheRequest, to_builtins
from dynamo_flexkv.core.layout import DTYPE_BYTES
from dynamo_flexkv.core.node.channel import Channel, ChannelClosed
from dynamo_flexkv.core.node.engines import EngineDevice, Fence
from dynamo_flexkv.core.node.namespace import Namespace, ServerOptions
from dynamo_flexkv.core.node.protocol import (
    ADMIN_VERSION,
    VERSION,
    Admin,
    Attach,
    Attached,
    Call,
    Cancel,
    Detach,
    Event,
    Events,
    Load,
    Lookup,
    Observe,
    OpDone,
    Prefetch,
    ProtocolError,
    Reply,
    Store,
    TaskDone,
    decode_to_service,
    unpack_ids,
    unpack_tokens,
)
from dynamo_flexkv.core.tasks import TaskResult

log = logging.getLogger(__name__)

SLOW_ANSWER_S = 0.1  # a request that took longer is logged

_PEERCRED = struct.Struct("3i")
MAX_TASKS_PER_ENGINE = 4096  # loads, stores and prefetches of one engine not finished yet
ATTACH_TIMEOUT_S = 10.0  # a connection must attach within this long
ADMIN_IDLE_S = 300.0  # an operator's connection that sends nothing this long is closed (it holds a max_clients place)


class RequestRefused(ValueError, FlexKVError):
    """A request this engine may not make (wrong order, another engine's task, ids out of range)."""


class SessionHost(Protocol):
    """What a session needs of the service that accepted it (server.NodeCacheServer)."""

    options: ServerOptions
    incarnation: str
    counters: dict[str, int]
    fence: Fence

    def namespace_for(self, attach: Attach, session: Session) -> Namespace: ...

    def leave(self, ns: Namespace, session: Session) -> None: ...

    def session_ended(self, session: Session) -> None: ...

    def admin(self, req: CacheRequest, only: Namespace | None = None) -> CacheReport: ...


class Session:
    def __init__(self, server: SessionHost, sid: int, conn: socket.socket) -> None:
        self.server, self.id = server, sid
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        self.pid, self.uid = pid, uid
        self.channel = Channel(conn, f"engine-{sid}-pid{pid}", server.options.max_queued_mb << 20)
        self.attach: Attach | None = None
        self.ns: Namespace | None = None
        self.device: EngineDevice | None = None
        self._tasks: set[int] = set()  # issued, not finished
        self._finished_early: set[int] = set()  # finished inside the call that issued them
        self._tasks_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"flexkv-node-engine-{sid}", daemon=True)
        self._closed = False
        self._subscribed = False  # this engine receives the namespace's KV events
        self.requests = 0
        self.admin = False  # an operator's tool (dynamo-flexkv cache): Admin requests only, never attaches

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def refuse(self, why: str) -> None:
        """Answers the first request with ``why`` and closes (the server is full)."""
        try:
            self.channel.send(Reply(id=0, error=why, kind="refused"))
        except ConnectionError:
            pass
        self.channel.close(why)
        self.channel.release()

    def describe(self) -> dict[str, Any]:
        a = self.attach
        return {
            "session": self.id,
            "pid": self.pid,
            "engine": a.engine if a else None,
            "rank": a.rank if a else None,
            "model_id": a.model_id if a else None,
            "tasks": len(self._tasks),
            "copies_in_flight": self.device.in_flight if self.device else 0,
        }

    # ---- the connection ----------------------------------------------------------------------------
    def _run(self) -> None:
        why = "the engine closed the connection"
        # A connection that never attaches would hold a place of max_clients forever.
        try:
            self.channel.sock.settimeout(ATTACH_TIMEOUT_S)
        except OSError:  # the server's close() closed this connection before this thread ran
            self.close("the cache server is shutting down")
            return
        try:
            for body, fds in self.channel.frames():
                for fd in fds:  # engines send none
                    _close_fd(fd)
                msg = decode_to_service(body)
                if isinstance(msg, Detach):
                    why = "the engine detached"
                    break
                self._handle(msg)
        except ProtocolError as e:
            self.server.counters["protocol_errors"] += 1
            why = f"protocol error: {e}"
            log.warning("node cache: engine pid %d: %s; closing its connection", self.pid, e)
            try:
                self.channel.send(Reply(id=0, error=str(e), kind="protocol"))
            except ConnectionError:
                pass
        except ChannelClosed as e:
            why = str(e)
        except Exception as e:  # a bug here must end this engine's session only
            why = f"service error: {type(e).__name__}: {e}"
            log.exception("node cache: engine pid %d: session failed", self.pid)
        self.close(why)

    def close(self, why: str, fence: bool = True) -> None:
        """Ends the session (idempotent): copies in flight fail or are fenced, tasks cancelled."""
        if self._closed:
            return
        self._closed = True
        self.channel.close(why, flush_s=1.0)  # a refusal's or protocol error's reason reaches the engine
        if self.device is not None:
            if fence:
                self.device.detach(why, self.server.fence)
            else:  # the service itself stops: its segment is never reused, nothing to fence
                self.device.detach(why, _NoFence())
        if self.ns is not None:
            self.ns.mirror.unsubscribe(self.id)
            with self._tasks_lock:
                tasks = list(self._tasks)
            try:
                if tasks:
                    self.ns.kv.cancel(tasks)
            except Exception:  # noqa: BLE001 - ManagerClosed at shutdown, or tasks already gone
                pass
            self.server.leave(self.ns, self)
        if self.attach is not None:
            log.info(
                "node cache: engine %s rank %d (pid %d) detached: %s",
                self.attach.engine,
                self.attach.rank,
                self.pid,
                why,
            )
        self.server.session_ended(self)
        threading.Thread(target=self.channel.release, daemon=True).start()

    # ---- requests --------------------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Admin):
            self._admin(msg)
            return
        if isinstance(msg, Attach):
            if self.admin:
                raise ProtocolError("Attach on an admin connection: an engine attaches on a connection of its own")
            self._attach(msg)
            return
        a, ns, device = self._attached(type(msg).__name__)
        if isinstance(msg, OpDone):
            if not device.finish(msg.op, msg.nbytes, msg.error, msg.ended):
                raise ProtocolError(f"OpDone for copy {msg.op}, which this engine was never asked to make")
            return
        if isinstance(msg, Cancel):
            with self._tasks_lock:
                mine = msg.task in self._tasks
            if mine:
                ns.kv.cancel([msg.task])
            return
        if isinstance(msg, Observe):
            ns.kv.observe_prefill(msg.tokens, msg.prompt_tokens, msg.seconds)
            return
        self.requests += 1
        self.server.counters["requests"] += 1
        t0 = time.monotonic()
        try:
            value = self._answer(msg)
            took = time.monotonic() - t0
            if took > SLOW_ANSWER_S:  # this engine's other messages waited behind it
                log.warning(
                    "node cache: engine %s: a %s took %.0f ms to answer",
                    a.engine,
                    type(msg).__name__,
                    took * 1e3,
                )
        except (ValueError, KeyError, TypeError, RuntimeError, FlexKVError) as e:
            self.server.counters["request_errors"] += 1
            kind = "closed" if "shut down" in str(e) else "refused"
            self.channel.send(Reply(id=msg.id, error=f"{type(e).__name__}: {e}", kind=kind))
            return
        self.channel.send(Reply(id=msg.id, value=value))

    def _attached(self, what: str) -> tuple[Attach, Namespace, EngineDevice]:
        """What _attach set (all three, together), for a request past Attach."""
        if self.attach is None or self.ns is None or self.device is None:
            raise ProtocolError(f"{what} before Attach: attach first")
        return self.attach, self.ns, self.device

    def _attach(self, a: Attach) -> None:
        if self.attach is not None:
            raise ProtocolError("Attach twice on one connection")
        problem = _check_attach(a)
        if problem:
            self.channel.send(Reply(id=0, error=problem, kind="refused"))
            raise ProtocolError(problem)
        try:
            ns = self.server.namespace_for(a, self)
        except (ConfigError, OSError) as e:
            self.server.counters["refused"] += 1
            self.channel.send(Reply(id=0, error=str(e), kind="refused"))
            raise ChannelClosed(f"refused: {e}") from None
        self.attach, self.ns = a, ns
        self.channel.sock.settimeout(None)  # attached: it may stay idle as long as it likes
        kv = ns.kv
        self.device = EngineDevice(
            f"{a.engine}/rank{a.rank}", a.device_blocks, self.channel.send, self.pid, kv.host.forget_checksums
        )
        self.server.counters["attached"] += 1
        if kv.host.fd is None:  # never: namespace.py opens every namespace's host tier with share_host=True
            raise RuntimeError("the namespace's host tier is not a shared segment: nothing to hand the engine")
        self.channel.send(
            Attached(
                version=VERSION,
                namespace=ns.salt,
                host_blocks=kv.host.num_blocks,
                host_bytes=kv.host.nbytes,
                service_pid=os.getpid(),
                incarnation=self.server.incarnation,
            ),
            fds=[kv.host.fd],
        )
        log.info(
            "node cache: engine %s rank %d/%d (pid %d) attached to model %s%s",
            a.engine,
            a.rank,
            a.ranks,
            self.pid,
            a.model_id,
            f" tenant {a.tenant}" if a.tenant else "",
        )
        if a.events:
            self._subscribed = True
            ns.mirror.subscribe(self.id, self._send_events)

    def _admin(self, msg: Admin) -> None:
        """An operator's request: on a connection that never attached, over every namespace it
        selects; from an attached engine, over its own namespace only. A clear runs on a thread of
        its own, so an engine's copies (OpDone on this thread) finish while it waits for them."""
        if self.attach is None and not self.admin:
            self.admin = True
            self.channel.sock.settimeout(ADMIN_IDLE_S)  # an operator may look again, not hold a place forever
        if msg.version != ADMIN_VERSION:
            self.channel.send(
                Reply(
                    id=msg.id,
                    error=f"admin protocol version {msg.version}; this cache server speaks {ADMIN_VERSION}: "
                    "run the same dynamo-flexkv version on both sides",
                    kind="refused",
                )
            )
            return
        try:
            req = CacheRequest(
                op=msg.op,
                tiers=msg.tiers,
                tenant=msg.tenant,
                model=msg.model,
                tokens=None if msg.tokens is None else unpack_tokens(msg.tokens).tolist(),
                lora=msg.lora,
                salt=msg.salt,
                wait_s=msg.wait_s,
            )
        except ProtocolError as e:
            self.channel.send(Reply(id=msg.id, error=str(e), kind="bad_request"))
            return
        if req.op == "clear" and self.attach is not None:
            threading.Thread(
                target=self._answer_admin, args=(msg.id, req), name="flexkv-node-clear", daemon=True
            ).start()
        else:
            self._answer_admin(msg.id, req)

    def _answer_admin(self, rid: int, req: CacheRequest) -> None:
        try:
            report = self.server.admin(req, only=self.ns)
        except (ValueError, RuntimeError, FlexKVError) as e:
            reply = Reply(id=rid, error=str(e), kind="bad_request")
        else:
            reply = Reply(id=rid, value=to_builtins(report))
        try:
            self.channel.send(reply)
        except ConnectionError:
            pass  # the tool went away

    def _send_events(self, events: list[Event], resync: bool) -> None:
        self.channel.send(Events(events=events, resync=resync))

    def _answer(self, msg: Any) -> Any:
        a, ns, device = self._attached(type(msg).__name__)
        kv = ns.kv
        if isinstance(msg, Lookup):
            d = kv.lookup_decision(
                unpack_tokens(msg.tokens),
                prompt_tokens=msg.prompt_tokens,
                layerwise=msg.layerwise,
                lora_name=msg.lora,
                cache_salt=msg.salt,
                skip_blocks=msg.skip_blocks,
            )
            end = d.end * kv.tokens_per_block
            return {"end": end, "decision": d.explain(kv.tokens_per_block)} if msg.explain else end
        if isinstance(msg, Load):
            self._room()
            tid = kv.get_async(
                unpack_tokens(msg.tokens),
                self._ids(msg.blocks, a.device_blocks),
                skip_blocks=msg.skip_blocks,
                layerwise=msg.layerwise,
                lora_name=msg.lora,
                cache_salt=msg.salt,
                prompt_tokens=msg.prompt_tokens,
                device=device,
                on_done=self._task_done,
            )
            if not self._track(tid):  # found nothing to load: finished (not_found) inside get_async
                return {"task": tid, "planned": 0, "by_tier": {}}
            return {"task": tid, "planned": kv.planned_tokens(tid), "by_tier": kv.planned_tokens_by_tier(tid)}
        if isinstance(msg, Store):
            self._room()
            tokens = unpack_tokens(msg.tokens)
            if msg.names:
                ns.mirror.name(kv.hashes(tokens, lora_name=msg.lora, cache_salt=msg.salt).sequence.tolist(), msg.names)
            tid = kv.put_async(
                tokens,
                self._ids(msg.blocks, a.device_blocks),
                lora_name=msg.lora,
                cache_salt=msg.salt,
                device=device,
                on_done=self._task_done,
            )
            self._track(tid)
            return {"task": tid}
        if isinstance(msg, Prefetch):
            self._room()
            tid = kv.prefetch_async(
                unpack_tokens(msg.tokens), lora_name=msg.lora, cache_salt=msg.salt, on_done=self._task_done
            )
            self._track(tid)
            return {"task": tid}
        if isinstance(msg, Call):
            return self._call(msg)
        raise ProtocolError(f"{type(msg).__name__} is not a request")

    def _call(self, msg: Call) -> Any:
        _, ns, _ = self._attached("Call")
        kv = ns.kv
        if msg.name == "stats":
            return {
                "tiers": dataclasses.asdict(kv.stats()),
                "namespace": ns.describe(),
                "service": {k: v for k, v in self.server.counters.items()},
            }
        if msg.name == "drain":
            return kv.drain(msg.timeout)
        if msg.name == "reset":
            if not kv.drain(msg.timeout):
                raise RuntimeError(f"tier writes still running after {msg.timeout} s; call reset again when idle")
            kv.reset()
            return kv.remote is None  # a remote tier keeps its blocks for every worker sharing it
        if msg.name == "evict_host":
            if not kv.drain(msg.timeout):
                raise RuntimeError(f"tier writes still running after {msg.timeout} s; call evict_host again when idle")
            return kv.evict("host")
        if msg.name == "subscribe":  # the engine's event publisher is connected now: the blocks, then changes
            if self._subscribed:
                return 0
            self._subscribed = True
            return ns.mirror.subscribe(self.id, self._send_events)
        if msg.name == "describe":
            return {
                "host_block_bytes": kv.host.layout.block_bytes,
                "tiers": kv.config.tier_blocks(kv.model),
                "ssd_dirs": list(kv.ssd.dirs) if kv.ssd else [],
                "remote": kv.remote.config.redacted_url if kv.remote else None,
            }
        raise RequestRefused(f"unknown call {msg.name!r}: stats, drain, reset, evict_host, subscribe or describe")

    # ---- task bookkeeping -----------------------------------------------------------------------------
    def _ids(self, data: bytes, device_blocks: int) -> np.ndarray:
        ids = unpack_ids(data)
        if ids.size and (ids.min() < 0 or ids.max() >= device_blocks):
            raise RequestRefused(
                f"device block ids {int(ids.min())}..{int(ids.max())} outside this engine's {device_blocks} blocks"
            )
        return ids

    def _room(self) -> None:
        with self._tasks_lock:
            if len(self._tasks) >= MAX_TASKS_PER_ENGINE:
                raise RequestRefused(
                    f"{len(self._tasks)} tasks of this engine unfinished (at most "
                    f"{MAX_TASKS_PER_ENGINE}): wait for some"
                )

    def _track(self, tid: int) -> bool:
        """Records a task this engine issued; False if it finished already (its result is sent)."""
        with self._tasks_lock:
            if tid in self._finished_early:
                self._finished_early.discard(tid)
                return False
            self._tasks.add(tid)
            return True

    def _task_done(self, result: TaskResult) -> None:
        with self._tasks_lock:
            if result.task_id in self._tasks:
                self._tasks.discard(result.task_id)
            else:  # finished inside get_async/put_async, before _track
                self._finished_early.add(result.task_id)
        try:
            self.channel.send(
                TaskDone(
                    task=result.task_id, status=result.status.value, num_tokens=result.num_tokens, error=result.error
                )
            )
        except ConnectionError:
            pass  # the engine is gone: nothing waits for it


def _check_attach(a: Attach) -> str | None:
    if a.version != VERSION:
        return f"protocol version {a.version}; this cache server speaks {VERSION}: upgrade the engine or the server"
    if a.dtype not in DTYPE_BYTES:
        return f"dtype {a.dtype!r} unknown: one of {sorted(DTYPE_BYTES)}"
    for name in ("num_layers", "num_kv_heads", "head_size", "tokens_per_block", "device_blocks", "ranks"):
        if getattr(a, name) < 1:
            return f"{name}={getattr(a, name)} must be >= 1"
    if a.kv_dim not in (1, 2):
        return f"kv_dim={a.kv_dim}: 2 (K and V) or 1 (an MLA latent)"
    if not 0 <= a.rank < a.ranks:
        return f"rank={a.rank} outside [0, {a.ranks})"
    if not a.model_id.strip():
        return "model_id is empty: name the weights, or engines of other models would share KV"
    if len(a.tenant) > 256 or len(a.engine) > 256 or len(a.model_id) > 4096:
        return "engine, tenant or model_id too long"
    return None


class _NoFence:
    def after_exit(self, pid: int, callback: Callable[[], None]) -> None:
        callback()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
