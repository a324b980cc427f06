"""NodeOffload: the engine contract (core/contract.py) through the node's cache service, the
contract adapter over the engine's connection to it (core/node/connection.py: the socket, the
protocol, the device copies the service asks for).

The engine keeps what must stay local: its device blocks and the copies between them and the
host tier, which is the service's shared segment mapped here. So a load's layer waits are local
events, set by this process's own copy of that layer; the service plans what moves (which host
slots, which disk reads first) and commits what landed, as one KVManager would.

This adapter keeps the engine's tasks (their layers, fences and results), the holds it hands back
and what its listener was told. If the service goes away, every task in flight fails (the engine
recomputes: exact tokens), the tier blocks this engine announced are removed from its router view,
and the connection attaches again in the background; until then lookups miss and loads, stores
and prefetches start nothing (the contract's ``miss_on_tier_fault``: the engine computes), without
waiting."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.contract import (
    EngineOffload,
    Hold,
    IndexListener,
    Tier,
    TierRun,
    miss_explained_on_tier_fault,
    miss_lookup_on_tier_fault,
    no_task_on_tier_fault,
)
from dynamo_flexkv.core.hashing import namespaced_hashes
from dynamo_flexkv.core.inventory import CacheReport, CacheRequest, parse_report
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.node.connection import (
    CALL_TIMEOUT_S,
    NodeConnection,
    NodeRequestFailed,
    NodeTimeout,
    NodeUnavailable,
)
from dynamo_flexkv.core.node.protocol import (
    VERSION,
    Admin,
    Attach,
    Attached,
    Call,
    Cancel,
    Events,
    Load,
    Lookup,
    Observe,
    Prefetch,
    Store,
    TaskDone,
    pack_ids,
    pack_tokens,
    unpack_tokens,
)
from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.tasks import TaskFailed, TaskKind, TaskResult, TaskStatus
from dynamo_flexkv.core.transfer.fence import DeviceFence
from dynamo_flexkv.core.transfer.runner import MoverHook

log = logging.getLogger(__name__)

__all__ = ["NodeOffload", "NodeRequestFailed", "NodeTimeout", "NodeUnavailable"]


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


class NodeOffload(EngineOffload):
    """The contract adapter: tasks, holds and the listener's events of this engine, over its
    NodeConnection (core/node/connection.py: the socket, the attach, the device copies)."""

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
        self.socket_path = socket_path or config.node_socket or default_socket_path()
        self.link = NodeConnection(self.socket_path, engine, self, mover_hook)
        self.failed_loads = 0
        self.weights_version = ""  # weights_changed(): part of the attach key from then on
        self.device: DeviceCache | None = None
        self._lock = threading.Lock()
        self._tasks: dict[int, _Task] = {}
        self._holds: dict[int, Hold] = {}
        # Cancelled loads collected before the service finished them: a late copy finds their
        # closed fence here (and writes nothing) until their TaskDone comes.
        self._collected: dict[int, _Task] = {}
        self._prefetches: list[int] = []
        self._announced: dict[str, dict[int, None]] = {"host": {}, "disk": {}}  # what the listener was told
        self.namespace = ""
        # The node's blocks go to the listener once its publisher can deliver them (announce_adopted:
        # a PUB socket drops what it sends before a subscriber joins); re-attaches send them at once.
        self._publishing = False

    @property
    def attaches(self) -> int:
        return self.link.attaches

    # ---- setup ----------------------------------------------------------------------------------------
    def register(self, layers: Any, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        self.device = DeviceCache.register(layers, self.model, layout, self.bs)
        self.link.start(self.device)  # a service not up yet is not an error: the engine attaches later

    # ---- what the connection asks (connection.OffloadSide) ------------------------------------------
    def attach_message(self, device_blocks: int) -> Attach:
        return Attach(
            version=VERSION,
            engine=self.engine,
            model_id=self.model_id + (f"|weights={self.weights_version}" if self.weights_version else ""),
            num_layers=self.model.num_layers,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_size,
            dtype=self.model.dtype,
            kv_dim=self.model.kv_dim,
            tokens_per_block=self.bs,
            device_blocks=device_blocks,
            tenant=self.tenant,
            rank=self.rank,
            ranks=self.ranks,
            replicated=self.replicated,
            events=self.listener is not None and self._publishing,
        )

    def host_layout(self, host_blocks: int) -> KVLayout:
        return self.config.layout(self.model, host_blocks, KVLayoutType.BLOCKFIRST)

    def attached(self, msg: Attached) -> None:
        self.namespace = msg.namespace

    def copy_target(self, tid: int) -> _Task:
        return self._task(tid)

    def connection_lost(self, why: str) -> None:
        with self._lock:
            tasks = [t for t in self._tasks.values() if t.result is None]
        for t in tasks:
            t.finish(
                TaskResult(
                    t.id, t.kind or TaskKind.GET, TaskStatus.FAILED, error=f"the node cache service went away: {why}"
                )
            )
        self._forget_announced()
        with self._lock:
            self._collected.clear()  # no copy or result of that service comes any more

    def task_done(self, tid: int, msg: TaskDone) -> None:
        with self._lock:
            if self._collected.pop(tid, None) is not None:
                return  # its result was taken when its writes were fenced
            t = self._tasks.get(tid)
            if t is None:
                t = self._tasks[tid] = _Task(tid, self.num_layers)
            t.service_done = True
        t.finish(TaskResult(tid, t.kind or TaskKind.GET, TaskStatus(msg.status), msg.num_tokens, msg.error))

    def events(self, msg: Events) -> None:
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

    def _task(self, tid: int) -> _Task:
        with self._lock:
            t = self._tasks.get(tid) or self._collected.get(tid)
            if t is None:
                t = self._tasks[tid] = _Task(tid, self.num_layers)
            return t

    def _request_task(self, make: Any) -> tuple[_Task, Any]:
        tid, value = self.link.request_task(make)
        return self._task(tid), value

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
            self.link.request(
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
        value = self.link.request(
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
        self.link.send_task_quietly(Cancel, tid)
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
        self.link.send_quietly(Observe(tokens=int(tokens), prompt_tokens=int(prompt_tokens), seconds=float(seconds)))

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
            self.link.send_task_quietly(Cancel, tid)

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
            return ManagerStats.from_dict(self.link.request(lambda rid: Call(id=rid, name="stats"))["tiers"])
        except NodeUnavailable:
            return None

    def service_stats(self) -> dict[str, Any]:
        return self.link.request(lambda rid: Call(id=rid, name="stats"))

    def drain(self, timeout: float | None = None) -> bool:
        wait = CALL_TIMEOUT_S if timeout is None else timeout + 5
        try:
            return bool(self.link.request(lambda rid: Call(id=rid, name="drain", timeout=timeout), wait))
        except NodeUnavailable:
            return True  # nothing of this engine's is being written anywhere

    def evict_host(self, timeout: float | None = None) -> int:
        return int(self.link.request(lambda rid: Call(id=rid, name="evict_host", timeout=timeout)))

    def reset_tiers(self, timeout: float | None = None) -> bool:
        return bool(self.link.request(lambda rid: Call(id=rid, name="reset", timeout=timeout)))

    def cache_admin(self, req: CacheRequest) -> CacheReport:
        """The service answers for this engine's namespace (Admin on the engine's connection)."""
        value = self.link.request(
            lambda rid: Admin.of(rid, req),
            timeout=req.wait_s + CALL_TIMEOUT_S,
        )
        return parse_report(value)

    def describe(self) -> dict[str, Any]:
        try:
            out = dict(self.link.request(lambda rid: Call(id=rid, name="describe")))
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
            announced = sum(len(seen) for seen in self._announced.values())
        self.link.reattach("the engine's weights changed")
        log.info("node cache: weights changed to %r: left the namespace of the weights before", version)
        return announced

    def announce_adopted(self, repeat: bool = False) -> int:
        """The listener can publish now: the service sends it the node's blocks (what it re-adopted
        included), then every change; after a re-attach it does so at once. Returns the blocks sent."""
        if self.listener is None or self._publishing or repeat:
            return 0
        self._publishing = True
        try:
            return int(self.link.request(lambda rid: Call(id=rid, name="subscribe")))
        except NodeUnavailable:
            return 0  # the next attach subscribes

    def shutdown(self) -> None:
        self.link.close("this engine shut down")

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
