"""KVManager: the API an engine calls. It hashes requests, asks the control plane what to move,
builds a transfer graph for the data plane, and commits index changes only after bytes landed.

    with KVManager(model, config) as kv:
        kv.register_device_cache(layer_tensors, KVLayoutType.LAYERBLOCK)
        tid = kv.get_async(prompt, device_block_ids, skip_blocks=blocks_already_on_device)
        kv.wait_for_layer(tid, 0)            # before layer 0's attention (layerwise=True)
        result = kv.wait([tid])[tid]         # status, num_tokens loaded
        kv.put_async(prompt, device_block_ids)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, NoReturn, Optional, Sequence, Union

import numpy as np
import torch

from dynamo_flexkv.core.config import CacheConfig, ConfigError, GiB
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.index import CacheEngine, Tier
from dynamo_flexkv.core.index.cache_engine import IndexListener, TierRun
from dynamo_flexkv.core.layout import KVLayoutType, ModelSpec
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import DiskEntry, SsdStore
from dynamo_flexkv.core.task_graphs import GraphBuilder
from dynamo_flexkv.core.tasks import ManagerClosed, Task, TaskFailed, TaskKind, TaskResult, TaskStatus, TooManyTasks
from dynamo_flexkv.core.transfer.runner import TransferRunner

if TYPE_CHECKING:
    from dynamo_flexkv.core.remote import RemoteStore
from dynamo_flexkv.core.transfer.graph import OpKind, TransferGraph
from dynamo_flexkv.core.transfer.movers import DiskMover, HostDeviceMover
from dynamo_flexkv.core.transfer.remote_mover import RemoteMover



# Longest a put waits for host room held by running tasks before it stores what fits.
MAX_PUT_DEFER_S = 10.0


class KVManager:
    def __init__(
        self,
        model: ModelSpec,
        config: Optional[CacheConfig] = None,
        *,
        namespace: Optional[str] = None,
        listener: Optional[IndexListener] = None,
        workers: int = 4,
        model_id: str = "",
    ) -> None:
        self.model = model
        self.config = config or CacheConfig.load()
        self.namespace = namespace or None
        self.model_id = model_id  # names the weights in the disk and remote fingerprints: same shape != same bytes
        self.tokens_per_block = self.config.tokens_per_block
        caps = self.config.tier_blocks(model)
        host_layout = self.config.layout(model, caps["host"], KVLayoutType.BLOCKFIRST)
        try:
            self.host = HostPool(host_layout, use_huge_pages=self.config.use_huge_pages)
        except OSError as e:  # ENOMEM: more than the machine (or its limits) allows
            raise ConfigError(f"cpu_cache_gb={self.config.cpu_cache_gb}: cannot allocate the host tier's "
                              f"{host_layout.total_bytes / GiB:.2f} GiB ({e.strerror or e}): set cpu_cache_gb "
                              "(FLEXKV_CPU_CACHE_GB) to what this machine can hold") from None
        self.ssd: Optional[SsdStore] = None
        self.remote: Optional["RemoteStore"] = None
        movers: Dict[OpKind, Any] = {}
        try:
            if self.config.enable_remote:
                self.remote = self._open_remote()
                movers[OpKind.REMOTE2H] = movers[OpKind.H2REMOTE] = RemoteMover(self.host, self.remote)
            if caps["disk"]:
                try:
                    # The model's identity too, where the engine names it: the same KV shape of other
                    # weights is other bytes (a new fine-tune on a node that keeps its SSD cache).
                    self.ssd = SsdStore(self.config.ssd_cache_dir, caps["disk"], self.host.layout.block_bytes,
                                        dict(self.host.layout.fingerprint(), namespace=self.namespace or "",
                                             **({"model": self.model_id} if self.model_id else {})))
                except OSError as e:  # EFBIG / ENOSPC / EACCES: the files cannot be that large, or there
                    size = caps["disk"] * self.host.layout.block_bytes / GiB
                    raise ConfigError(f"ssd_cache_gb={self.config.ssd_cache_gb} in ssd_cache_dir "
                                      f"{';'.join(self.config.ssd_cache_dir)}: cannot create the disk tier's "
                                      f"{size:.2f} GiB of files ({e.strerror or e}{': ' + e.filename if e.filename else ''}): "
                                      "set ssd_cache_gb (FLEXKV_SSD_CACHE_GB) to what the file system holds, or "
                                      "point ssd_cache_dir at a writable directory") from None
                disk_mover = self._make_disk_mover()
                movers[OpKind.DISK2H] = movers[OpKind.H2DISK] = movers[OpKind.VERIFY] = disk_mover
            self.cache = CacheEngine(self.config, {Tier.HOST: caps["host"], Tier.DISK: caps["disk"]},
                                     listener=listener, on_slots_freed=self._slots_freed)
            if self.ssd is not None:
                self._adopt_disk(movers[OpKind.DISK2H])
        except BaseException:
            self._close_storage()
            raise
        self.transfer = TransferRunner(movers, workers)
        self.graphs = GraphBuilder(self.cache, self.ssd, self.host.layout.layer_block_bytes,
                                   self.tokens_per_block, model.num_layers)
        self.device: Optional[DeviceCache] = None
        self._tasks: Dict[int, Task] = {}
        self._next_id = 1  # ids are issued in order: an id below it that is not in _tasks has finished
        self._waiters: Dict[int, int] = {}  # task id -> wait()/wait_for_layer() calls blocked on it
        self._lock = threading.Lock()
        self._closed = False
        self._live_graphs = 0  # submitted graphs whose finish callback has not run yet
        self._idle = threading.Condition()
        # Puts waiting for host room: the host tier was full of blocks that running tasks lock
        # (disk writes in flight). Retried, oldest first, each time a graph finishes.
        self._deferred: "collections.deque[_DeferredPut]" = collections.deque()
        self._retrying = self._retry_again = False
        self.put_refused_blocks = 0  # blocks puts could not store: longer than the host tier
        # Finished results nobody has collected yet, oldest first: id -> finish time (for expiry).
        self._uncollected: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        self.expired_results = 0

    # ---- setup ---------------------------------------------------------------------------------
    def register_device_cache(self, tensors: Union[torch.Tensor, Sequence[torch.Tensor]],
                              layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        """Registers the engine's KV tensors (one per layer, or one for all layers)."""
        self._check_open("register_device_cache")
        self.device = DeviceCache.register(tensors, self.model, layout, self.tokens_per_block)
        mover = HostDeviceMover(self.host, self.device)
        self.transfer.movers[OpKind.D2H] = self.transfer.movers[OpKind.H2D] = mover

    def _open_remote(self) -> "RemoteStore":
        """Opens the remote tier: an unreachable server or a wrong password raises (naming the fix)
        unless remote_required=false, which starts with the tier off and retries it periodically."""
        from dynamo_flexkv.core.remote import RemoteStore, fingerprint_of
        parts = dict(self.host.layout.fingerprint(), namespace=self.namespace or "", model=self.model_id,
                     tp_rank=self.config.tp_rank, tp_size=self.config.tp_size)  # each rank holds another shard
        return RemoteStore(self.config.remote_config(), fingerprint_of(parts), strict=self.config.remote_required)

    def _remote_probe(self, hashes: List[int], start: int) -> Optional[tuple]:
        """(lo, hi): blocks [lo, hi) beyond the local prefix that the remote tier holds now (one
        batched existence check per exists_chunk keys); None without a remote tier or a remote hit."""
        if self.remote is None:
            return None
        # From the local prefix, also below ``start``: host stays prefix-closed, so blocks the
        # caller already holds on its device are read into host too when remote has them.
        lo = self.cache.match(hashes).num_blocks
        if lo >= len(hashes) or len(hashes) <= start:
            return None
        n = self.remote.exists_prefix(hashes[lo:])
        return (lo, lo + n) if n else None

    def _make_disk_mover(self):
        if self.config.enable_nixl:
            from dynamo_flexkv.core.transfer.nixl_mover import NixlDiskMover
            return NixlDiskMover(self.host, self.ssd, gds=self.config.enable_gds)
        return DiskMover(self.host, self.ssd, self.config.io_queue_depth)

    def _adopt_disk(self, mover: DiskMover) -> None:
        """Restart: verify what the journal says is on disk, using host slots as scratch."""
        scratch = self.host.num_blocks

        def read(entries: List[DiskEntry]) -> np.ndarray:
            out = []
            for i in range(0, len(entries), scratch):
                part = entries[i:i + scratch]
                disk_ids = np.array([e.block_id for e in part], dtype=np.int64)
                out.append(mover.read_for_adoption(disk_ids, np.arange(len(part), dtype=np.int64)))
            return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)

        report = self.ssd.adopt(read)
        self.cache.tiers[Tier.DISK].adopt([(e.seq_hash, e.parent, e.block_id) for e in report.adopted])
        self.adopt_report = report

    def announce_adopted(self) -> int:
        """Sends the index listener (the router's events) a Stored event for every disk block
        re-adopted at start that is still held: the old process's announcements died with it. Call
        once, when the event subscriber is connected. Returns the blocks announced; blocks
        journaled without token ids (and their descendants) cannot be named and are skipped."""
        self._check_open("announce_adopted")
        report = getattr(self, "adopt_report", None)
        if report is None or not report.adopted:
            return 0
        self.adopt_report = dataclasses.replace(report, adopted=[])  # once only
        return self.cache.announce(_adopted_chains(report.adopted, self.tokens_per_block))

    # ---- queries -------------------------------------------------------------------------------
    def hashes(self, token_ids, *, lora_name: Optional[str] = None, cache_salt: Optional[str] = None):
        self._check_open("hashes")
        salt = "/".join(s for s in (self.namespace, cache_salt) if s) or None
        return block_hashes(token_ids, self.tokens_per_block, lora_name=lora_name, cache_salt=salt)

    def match(self, token_ids, *, lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> Dict[str, int]:
        """Cached prefix in tokens per tier (no side effects)."""
        self._check_open("match")
        seq = self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt).sequence
        m = self.cache.match(seq)
        out = {t.value: n * self.tokens_per_block for t, n in m.per_tier.items()}
        if self.remote is not None:  # beyond the local prefix: what a get would read from remote
            probe = self._remote_probe(_int_list(seq), 0)
            out["remote"] = (probe[1] if probe else 0) * self.tokens_per_block
        return out

    # ---- tasks ---------------------------------------------------------------------------------
    def get_async(self, token_ids, device_block_ids, *, skip_blocks: int = 0, layerwise: bool = False,
                  lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
        """Loads the cached prefix beyond the first ``skip_blocks`` blocks (which the engine already
        holds) into ``device_block_ids[i]`` for block i."""
        self._need_device("get_async")
        if isinstance(skip_blocks, bool) or not isinstance(skip_blocks, (int, np.integer)):
            raise TypeError(f"skip_blocks must be an int (the number of leading blocks the engine already "
                            f"holds), got {type(skip_blocks).__name__} {skip_blocks!r}")
        h = self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        blocks = -(-len(token_ids) // self.tokens_per_block)
        if skip_blocks < 0:
            raise ValueError(f"skip_blocks={skip_blocks} must be >= 0: the number of leading blocks the engine "
                             "already holds")
        if skip_blocks > blocks:
            raise ValueError(f"skip_blocks={skip_blocks} is past this {len(token_ids)}-token prompt's {blocks} "
                             "blocks: pass the number of its leading blocks the engine already holds")
        dev_ids = self._device_ids(token_ids, device_block_ids)
        with self._issue(TaskKind.GET) as task:
            seq = _int_list(h.sequence)
            start = min(int(skip_blocks), len(h))
            plan = self.cache.plan_get(task.id, seq, start, self._remote_probe(seq, start))
            if plan.num_blocks == 0:
                self.cache.abort_task(task.id)
                task.finish(TaskResult(task.id, TaskKind.GET, TaskStatus.NOT_FOUND))
                return task.id
            self._plan_tokens(task, plan)
            self._attach_tokens(token_ids, plan.staged, plan.remote_staged)
            self._submit(task, self.graphs.get(task, plan, dev_ids, layerwise))
        return task.id

    def prefetch_async(self, token_ids, *, lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
        """Brings the disk part of a cached prefix into host memory (no device copy)."""
        self._check_open("prefetch_async")
        h = self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        with self._issue(TaskKind.PREFETCH) as task:
            seq = _int_list(h.sequence)
            plan = self.cache.plan_get(task.id, seq, 0, self._remote_probe(seq, 0))
            if plan.host_fill is None:
                self.cache.abort_task(task.id)
                status = TaskStatus.SUCCESS if plan.num_blocks else TaskStatus.NOT_FOUND
                task.finish(TaskResult(task.id, TaskKind.PREFETCH, status))
                return task.id
            self._plan_tokens(task, plan)
            self._attach_tokens(token_ids, plan.staged, plan.remote_staged)
            self._submit(task, self.graphs.get(task, plan, None, False))
        return task.id

    def put_async(self, token_ids, device_block_ids, *, lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
        """Stores the full blocks not held yet. The task finishes once the device copy is done (the
        engine may reuse its blocks); the disk write continues in the background."""
        self._need_device("put_async")
        h = self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        dev_ids = self._device_ids(token_ids, device_block_ids)
        with self._issue(TaskKind.PUT) as task:
            after = None
            if self.device.device.type == "cuda":  # the copy waits for the engine's writes
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device.device))
            self._put_now(_DeferredPut(task, _int_list(h.sequence), token_ids, dev_ids, after))
        return task.id

    def _put_now(self, put: "_DeferredPut") -> bool:
        """Plans and submits the put; False when it was deferred instead: some blocks found no host
        room while running tasks lock it, so it waits for them (a task finishing retries it). What
        still does not fit (nothing runs any more, the prompt is longer than the host tier, or it
        waited MAX_PUT_DEFER_S) is counted in stats()["tasks"]["put_refused_blocks"]; the put
        stores the rest."""
        task, seq = put.task, put.seq
        plan = self.cache.plan_put(task.id, seq, remote=self.remote is not None)
        short = len(seq) - plan.held - (len(plan.host) if plan.host is not None else 0)
        # Wait only for room that can come: the put fits the host tier, and not past the bound
        # (the engine cannot reuse its device blocks before the put finishes).
        if short > 0 and len(seq) - plan.held <= self.cache.tiers[Tier.HOST].capacity \
                and time.monotonic() - put.since < MAX_PUT_DEFER_S:
            self.cache.abort_task(task.id, replan=True)  # nothing planned stays behind while it waits
            with self._idle:
                if self._live_graphs:
                    self._deferred.append(put)
                    return False
            plan = self.cache.plan_put(task.id, seq, remote=self.remote is not None)
            short = len(seq) - plan.held - (len(plan.host) if plan.host is not None else 0)
        if short > 0:
            with self._idle:
                self.put_refused_blocks += short
        self._attach_tokens(put.token_ids, plan.host)
        self._attach_tokens(put.token_ids, plan.disk, always=True)  # the journal keeps them for restarts
        self._submit(task, self.graphs.put(task, plan, put.dev_ids, put.after if plan.host is not None else None))
        return True

    def _retry_deferred(self) -> None:
        """Retries deferred puts, oldest first, until one has to wait again. One thread at a time;
        a call meanwhile makes that thread look again, so no wake-up is lost."""
        with self._idle:
            if self._retrying:
                self._retry_again = True
                return
            self._retrying = True
        while True:
            with self._idle:
                put = self._deferred.popleft() if self._deferred else None
                if put is None:
                    if self._retry_again:
                        self._retry_again = False
                        continue
                    self._retrying = False
                    self._idle.notify_all()
                    return
                self._retry_again = False
            try:
                if self._closed:
                    raise ManagerClosed("shut down")
                waiting = not self._put_now(put)
            except BaseException as e:  # noqa: BLE001 - the put fails, the retry loop goes on
                self.cache.abort_task(put.task.id)
                status = TaskStatus.CANCELLED if isinstance(e, ManagerClosed) else TaskStatus.FAILED
                put.task.finish(TaskResult(put.task.id, TaskKind.PUT, status,
                                           error=None if status is TaskStatus.CANCELLED else f"{type(e).__name__}: {e}"))
                waiting = False
            if waiting:  # _put_now queued it last: back to the front, the rest wait behind it
                with self._idle:
                    if put in self._deferred:  # cancel() may have taken it meanwhile
                        self._deferred.remove(put)
                        self._deferred.appendleft(put)
                    if not self._retry_again:
                        self._retrying = False
                        return
                    self._retry_again = False

    def wait(self, task_ids: Iterable[int], timeout: Optional[float] = None) -> Dict[int, TaskResult]:
        """Results of the tasks; unfinished ones after ``timeout`` seconds report TIMEOUT and can be
        waited on again. A finished result is handed out once; results a wait() is blocked on never
        expire. ``timeout``: seconds (None or inf: no limit)."""
        deadline = _deadline(timeout, "wait")
        with self._awaited(list(task_ids), "wait") as tasks:
            out: Dict[int, TaskResult] = {}
            finished = []
            for task in tasks:
                if task.done.wait(_left(deadline)):
                    out[task.id] = task.result
                    finished.append(task)
                else:
                    out[task.id] = TaskResult(task.id, task.kind, TaskStatus.TIMEOUT)
            with self._lock:  # claimed all at once: two threads waiting on one task get it once, lose nothing else
                taken = [t.id for t in finished if self._tasks.get(t.id) is not t]
                if taken:
                    raise KeyError(f"task(s) {taken}: the result was already collected by another wait(); "
                                   "wait on a task from one thread only")
                for t in finished:
                    self._tasks.pop(t.id, None)  # an id listed twice in one call is handed out once
                    self._uncollected.pop(t.id, None)
        return out

    def try_wait(self, task_ids: Iterable[int]) -> Dict[int, TaskResult]:
        """Results of the tasks that already finished; the others are left running."""
        finished = [t for t in task_ids if self._task(t, "try_wait").done.is_set()]
        return self.wait(finished, 0)

    def cancel(self, task_ids: Iterable[int]) -> None:
        """Cancels the tasks (their results report CANCELLED unless they finished first). An id whose
        task already finished, its result collected or expired, is skipped: cancel may race wait().
        An id never issued raises KeyError, and then nothing is cancelled."""
        self._check_open("cancel")
        with self._lock:  # all ids checked before any task is touched
            tasks = [self._lookup(t, finished_ok=True) for t in list(task_ids)]
        for task in tasks:
            if task is None:
                continue
            if task.graph is not None:
                self.transfer.cancel(task.graph)
            elif self._drop_deferred(lambda put: put.task is task):
                task.finish(TaskResult(task.id, task.kind, TaskStatus.CANCELLED))

    def _drop_deferred(self, which) -> List["_DeferredPut"]:
        """Takes the deferred puts ``which(put)`` selects out of the queue (they were never planned)."""
        with self._idle:
            out = [p for p in self._deferred if which(p)]
            for p in out:
                self._deferred.remove(p)
            self._idle.notify_all()
        return out

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Waits until every task has finished, the background disk writes of puts included.
        False if some still run after ``timeout`` seconds (None or inf: no limit)."""
        self._check_open("drain")
        deadline = _deadline(timeout, "drain")
        with self._idle:
            while self._live_graphs or self._deferred or self._retrying:
                left = _left(deadline)
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def planned_tokens(self, task_id: int) -> int:
        """Tokens a get will have loaded if it succeeds (known at submission: the engine can plan
        its compute while the load runs)."""
        return self._task(task_id, "planned_tokens").planned_tokens

    def planned_tokens_by_tier(self, task_id: int) -> Dict[str, int]:
        """planned_tokens split by the tier each block is read from: ``{"host": n, "disk": m}``, plus
        ``"remote"`` with a remote tier (they sum to planned_tokens)."""
        task = self._task(task_id, "planned_tokens_by_tier")
        local = task.planned_tokens - task.planned_disk_tokens - task.planned_remote_tokens
        out = {"host": local, "disk": task.planned_disk_tokens}
        if self.remote is not None:
            out["remote"] = task.planned_remote_tokens
        return out

    def wait_for_layer(self, task_id: int, layer: int, timeout: Optional[float] = None) -> bool:
        """Blocks until layer ``layer`` of a get is on the device. False on timeout; raises
        TaskFailed when the task failed, was cancelled or found nothing (recompute instead).
        ``timeout``: seconds (None or inf: no limit)."""
        deadline = _deadline(timeout, "wait_for_layer")
        with self._awaited([task_id], "wait_for_layer") as (task,):
            if not 0 <= layer < task.num_layers:
                raise ValueError(f"layer {layer} outside [0, {task.num_layers})")
            if not task.layer_ready[layer].wait(_left(deadline)):
                return False
        if task.result is not None and not task.result.ok:
            raise TaskFailed(f"task {task_id}: {task.result.status.value}: {task.result.reason}")
        return True

    # ---- admin ---------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        self._check_open("stats")
        self._expire_results()
        out: Dict[str, Any] = dict(self.cache.stats())
        t = self.transfer
        out["links"] = {k.value: {"bytes": t.link_bytes[k], "seconds": t.link_seconds[k], "ops": t.link_ops[k]}
                        for k in OpKind if t.link_ops[k]}
        if self.remote is not None:
            out["remote"] = dict(self.remote.stats_dict(), url=self.remote.config.redacted_url,
                                 planned_blocks=out["requests"]["remote_hit_blocks"],
                                 short_reads=self.graphs.remote_short_reads,
                                 write_failures=self.graphs.remote_write_failures)
        with self._lock:  # finished results waiting for wait() are not in flight
            uncollected = len(self._uncollected)
            in_flight = len(self._tasks) - uncollected
        out["tasks"] = {"in_flight": in_flight, "uncollected_results": uncollected,
                        "queued_ops": t.queue_depth, "failed_ops": t.failed_ops,
                        "deferred_puts": len(self._deferred), "put_refused_blocks": self.put_refused_blocks,
                        "disk_write_failures": self.graphs.disk_write_failures,
                        "expired_results": self.expired_results}
        return out

    def evict(self, tier: str, count: Optional[int] = None) -> int:
        """Evicts up to ``count`` (default: all) ready, unpinned blocks of the ``"host"`` or
        ``"disk"`` tier, the policy's victims first; the tiers below keep their copies. Returns
        how many went (removal events are published as for any eviction)."""
        names = {"host": Tier.HOST, "disk": Tier.DISK}
        if tier not in names:
            raise ValueError(f"evict(tier={tier!r}): the tiers this manager evicts are 'host' and 'disk'")
        if count is not None and count < 0:
            raise ValueError(f"evict(count={count}): pass a number of blocks >= 0, or None for all")
        with self._lock:
            self._check_open("evict")
            idx = self.cache.tiers.get(names[tier])
            if idx is None:
                return 0
            return len(self.cache.evict(names[tier], len(idx) if count is None else count))

    def reset(self) -> None:
        """Drops every cached block (host and disk); refuses while tasks are in flight."""
        with self._lock:  # shutdown() waits: a closing manager never touches its files again
            self._check_open("reset")
            busy = self.cache.task_ids()
            if busy:
                raise RuntimeError(f"reset() with {len(busy)} tasks in flight: call drain() (or cancel them) first")
            self.cache.reset()

    def shutdown(self) -> None:
        """Cancels what is in flight, waits for running copies to drain, frees memory and files.
        Every later call but shutdown() raises ManagerClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.transfer.shutdown()
        for put in self._drop_deferred(lambda put: True):
            put.task.finish(TaskResult(put.task.id, TaskKind.PUT, TaskStatus.CANCELLED))
        self._close_storage()

    def __enter__(self) -> "KVManager":
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ManagerClosed(f"{call}(): this KVManager was shut down, its memory and cache directories are "
                                "released: create a new KVManager (it re-adopts the disk tier)")

    def _need_device(self, call: str) -> None:
        self._check_open(call)
        if self.device is None:
            raise RuntimeError(f"{call} before register_device_cache(): register the engine's KV tensors first")

    @contextlib.contextmanager
    def _issue(self, kind: TaskKind) -> Iterator[Task]:
        """A new task; if issuing it fails, it leaves nothing behind (no record, no index state)."""
        with self._lock:
            self._check_open(f"{kind.value}_async")
            limit = self.config.max_tasks_in_flight
            busy = self._live_graphs + len(self._deferred)
            if busy >= limit:  # bounded work under a flood: refuse rather than queue forever
                raise TooManyTasks(f"{kind.value}_async refused: {busy} tasks in flight "
                                   f"(max_tasks_in_flight={limit}); wait for some, or raise max_tasks_in_flight")
            task = Task(self._next_id, kind, self.model.num_layers, on_finish=self._result_ready)
            self._next_id += 1
            self._tasks[task.id] = task
        self._expire_results()
        try:
            yield task
        except BaseException as e:
            self.cache.abort_task(task.id)
            with self._lock:
                self._tasks.pop(task.id, None)
            task.finish(TaskResult(task.id, kind, TaskStatus.FAILED, error=f"refused: {e}"))  # wakes no one
            raise

    def _plan_tokens(self, task: Task, plan) -> None:
        tpb = self.tokens_per_block
        task.planned_tokens = plan.num_blocks * tpb
        if plan.disk_reads is not None:  # blocks the caller skips are not read
            task.planned_disk_tokens = max(0, plan.disk_reads.end - max(plan.disk_reads.start, plan.start)) * tpb
        if plan.remote_staged is not None:
            r = plan.remote_staged
            task.planned_remote_tokens = max(0, r.end - max(r.start, plan.start)) * tpb

    def _result_ready(self, task: Task) -> None:
        with self._lock:
            if task.id in self._tasks:
                self._uncollected[task.id] = task.finished_at

    def _expire_results(self) -> None:
        """Drops results nobody collected within task_result_ttl_seconds (oldest first); results a
        blocked wait() is waiting for stay."""
        cutoff = time.monotonic() - self.config.task_result_ttl_seconds
        with self._lock:
            expired = []
            for task_id, finished_at in self._uncollected.items():
                if finished_at > cutoff:
                    break
                if task_id not in self._waiters:
                    expired.append(task_id)
            for task_id in expired:
                del self._uncollected[task_id]
                if self._tasks.pop(task_id, None) is not None:
                    self.expired_results += 1

    def _submit(self, task: Task, graph: TransferGraph) -> None:
        task.graph = graph
        inner = graph.on_finish

        def finished(g: TransferGraph) -> None:
            try:
                if inner is not None:
                    inner(g)
            finally:
                self._graph_done()
        graph.on_finish = finished
        with self._idle:
            self._live_graphs += 1
        try:
            self.transfer.submit(graph)
        except BaseException as e:
            self._graph_done()
            if self._closed:  # shutdown() stopped the engine meanwhile: the task is cancelled, not failed
                raise ManagerClosed("shut down while the task was being submitted") from e
            raise

    def _graph_done(self) -> None:
        with self._idle:
            self._live_graphs -= 1
            self._idle.notify_all()
        if self._deferred:  # what it held may be the room a deferred put waits for
            self._retry_deferred()

    def _task(self, task_id: int, call: str) -> Task:
        self._check_open(call)
        self._expire_results()
        with self._lock:
            return self._lookup(task_id)

    def _lookup(self, task_id: Any, finished_ok: bool = False) -> Optional[Task]:
        """The task of ``task_id`` (under self._lock). One issued but gone (its result collected or
        expired) is None with ``finished_ok``, else KeyError; one never issued is a KeyError."""
        issued = isinstance(task_id, (int, np.integer)) and not isinstance(task_id, bool) \
            and 0 < task_id < self._next_id
        task = self._tasks.get(task_id) if issued else None
        if task is not None or (issued and finished_ok):
            return task
        if issued:
            raise KeyError(f"task id {task_id!r} has finished and its result is gone: already taken by wait(), "
                           "or nobody collected it within task_result_ttl_seconds")
        raise KeyError(f"unknown task id {task_id!r}: never issued (task ids are the ints the *_async calls "
                       "return)")

    @contextlib.contextmanager
    def _awaited(self, task_ids: List[Any], call: str) -> Iterator[List[Task]]:
        """The tasks, marked as waited for while the block runs: their results do not expire."""
        self._check_open(call)
        self._expire_results()
        with self._lock:
            tasks = [self._lookup(t) for t in task_ids]
            for t in tasks:
                self._waiters[t.id] = self._waiters.get(t.id, 0) + 1
        try:
            yield tasks
        finally:
            with self._lock:
                for t in tasks:
                    left = self._waiters.pop(t.id) - 1
                    if left:
                        self._waiters[t.id] = left

    def _device_ids(self, token_ids, device_block_ids) -> np.ndarray:
        """The ids of the full blocks, as int64; refuses non-integers and repeated ids (one device
        block cannot hold two blocks: a put would store its bytes under both hashes, a get would
        scatter both blocks into it)."""
        n_tokens = len(token_ids)
        full, covering = n_tokens // self.tokens_per_block, -(-n_tokens // self.tokens_per_block)
        ids = _integer_array(device_block_ids, self.device.num_blocks)
        if ids.size not in (full, covering):
            raise ValueError(f"{ids.size} device block ids for {n_tokens} tokens: pass one id per block "
                             f"({full} full blocks, or {covering} with the partial one)")
        ids = ids[:full]
        values, counts = np.unique(ids, return_counts=True)
        if values.size < ids.size:
            dup = int(values[counts > 1][0])
            raise ValueError(f"device_block_ids repeats block {dup} (at positions "
                             f"{np.flatnonzero(ids == dup).tolist()}): pass a distinct device block per block")
        return ids

    def _attach_tokens(self, token_ids, *runs, always: bool = False) -> None:
        """New runs carry their tokens so the events they cause can name them."""
        if self.cache.listener is None and not always:
            return
        b = self.tokens_per_block
        for run in runs:
            if run is not None:
                run.token_ids = [int(t) for t in token_ids[run.start * b:run.end * b]]

    def _slots_freed(self, tier: Tier, slots: List[int]) -> None:
        if tier is Tier.DISK and self.ssd is not None:
            self.ssd.record_removed(slots)

    def _close_storage(self) -> None:
        if getattr(self, "remote", None) is not None:
            self.remote.close()
        if getattr(self, "ssd", None) is not None:
            self.ssd.close()
        if getattr(self, "host", None) is not None:
            self.host.close()


@dataclasses.dataclass(eq=False)
class _DeferredPut:
    """What a put needs to be planned later (its task is issued, its device blocks are the caller's)."""

    task: Task
    seq: List[int]
    token_ids: Any
    dev_ids: np.ndarray
    after: Any  # the CUDA event recorded at put_async: the copy waits for the engine's writes
    since: float = dataclasses.field(default_factory=time.monotonic)


def _integer_array(device_block_ids, num_blocks: int) -> np.ndarray:
    """device_block_ids (list, tuple, numpy array or tensor of integers, each in [0, num_blocks))
    as a flat int64 array."""
    if isinstance(device_block_ids, torch.Tensor):
        device_block_ids = device_block_ids.detach().cpu().numpy()
    ids = None if device_block_ids is None or isinstance(device_block_ids, (str, bytes)) \
        else np.asarray(device_block_ids)
    if ids is not None and ids.dtype.kind in "fO" and ids.ndim == 1:
        # Python ints past int64 turn a list into float64 or object: name the id, not the dtype.
        for pos, v in enumerate(device_block_ids):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and not 0 <= v < num_blocks:
                _out_of_range(int(v), pos, num_blocks)
    if ids is None or ids.dtype == object or ids.ndim == 0:
        raise TypeError(f"device_block_ids must be a sequence of integers, got {type(device_block_ids).__name__}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":  # floats would be truncated, bools read as blocks 0 and 1
        raise TypeError(f"device_block_ids must be integers, got dtype {ids.dtype}")
    ids = ids.reshape(-1)
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))  # in the ids' own dtype: uint64 does not wrap
    if bad.size:
        _out_of_range(int(ids[bad[0]]), int(bad[0]), num_blocks)
    return ids.astype(np.int64, copy=False)


def _out_of_range(block_id: int, pos: int, num_blocks: int) -> NoReturn:
    raise IndexError(f"device block id out of range [0, {num_blocks}): got {block_id} (position {pos}); pass "
                     "ids of blocks of the registered device cache")


def _deadline(timeout: Any, call: str) -> Optional[float]:
    """time.monotonic() deadline of a public call's ``timeout`` seconds; None (no limit) for None,
    inf, or past what threads can wait. A negative timeout polls once."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{call}(timeout={timeout!r}): timeout must be a number of seconds or None (no limit), "
                        f"got {type(timeout).__name__}")
    if math.isnan(timeout):
        raise ValueError(f"{call}(timeout=nan): pass a number of seconds, or None (or inf) to wait without limit")
    if timeout >= threading.TIMEOUT_MAX:
        return None
    return time.monotonic() + float(timeout)


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _int_list(hashes) -> List[int]:
    return hashes.tolist() if isinstance(hashes, np.ndarray) else [int(x) for x in hashes]


def _adopted_chains(entries: List[DiskEntry], tokens_per_block: int) -> List[TierRun]:
    """Adopted entries (parents first) as chains, depth first: one event per chain, not per block."""
    children: Dict[Optional[int], List[DiskEntry]] = {}
    for e in entries:
        children.setdefault(e.parent, []).append(e)
    runs: List[TierRun] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        e, chain = stack.pop(), []
        parent = e.parent
        while e is not None and e.tokens is not None and len(e.tokens) == 4 * tokens_per_block:
            chain.append(e)
            kids = children.get(e.seq_hash, [])
            stack.extend(reversed(kids[1:]))
            e = kids[0] if kids else None
        if chain:
            runs.append(TierRun(Tier.DISK, 0, [c.seq_hash for c in chain], [c.block_id for c in chain], parent,
                                new=False, token_ids=np.frombuffer(b"".join(c.tokens for c in chain),
                                                                   dtype="<u4").tolist()))
    return runs
