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

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dynamo_flexkv.core import arguments
from dynamo_flexkv.core.arguments import BlockIds
from dynamo_flexkv.core.arguments import deadline as _deadline
from dynamo_flexkv.core.arguments import int_list as _int_list
from dynamo_flexkv.core.arguments import left as _left
from dynamo_flexkv.core.config import CacheConfig, ConfigError, GiB
from dynamo_flexkv.core.contract import IndexListener, TierRun
from dynamo_flexkv.core.cost import CostModel, LoadDecision, Segment
from dynamo_flexkv.core.deferred_puts import DeferredPut, DeferredPuts
from dynamo_flexkv.core.disk_adoption import adopt_disk, adopted_chains
from dynamo_flexkv.core.hashing import BlockHashes, TokenIds, namespaced_hashes
from dynamo_flexkv.core.index import CacheEngine, Tier
from dynamo_flexkv.core.index.cache_engine import GetPlan
from dynamo_flexkv.core.index.tier_index import IndexInvariantError
from dynamo_flexkv.core.inventory import (
    REMOTE_NOT_CLEARED,
    Cleared,
    Contents,
    KeptReason,
    PrefixBlocks,
    TierCleared,
    TierContents,
)
from dynamo_flexkv.core.layout import KVLayoutType, ModelSpec
from dynamo_flexkv.core.stats import (
    LinkStats,
    ManagerStats,
    RemoteTierStats,
    RemovalReason,
    RequestStats,
    TaskStats,
    TierStats,
)
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import SsdStore
from dynamo_flexkv.core.task_graphs import GraphBuilder
from dynamo_flexkv.core.task_table import TaskTable
from dynamo_flexkv.core.tasks import ManagerClosed, Task, TaskFailed, TaskKind, TaskResult, TaskStatus, TooManyTasks
from dynamo_flexkv.core.transfer.fence import DeviceFence
from dynamo_flexkv.core.transfer.graph import OpKind, TransferGraph
from dynamo_flexkv.core.transfer.movers import DiskMover, HostDeviceMover, HostHasher
from dynamo_flexkv.core.transfer.remote_mover import RemoteMover
from dynamo_flexkv.core.transfer.runner import MoverHook, TransferRunner

if TYPE_CHECKING:
    from dynamo_flexkv.core.remote import RemoteStore


log = logging.getLogger(__name__)

# Longest a put waits for host room held by running tasks before it stores what fits.
MAX_PUT_DEFER_S = 10.0


@dataclasses.dataclass(frozen=True)
class HostPin:
    """Host blocks pinned for a peer's read (KVManager.pin_host): blocks [start, start + len(slots))
    of the request, their host slots and the xxh3 of each slot's bytes."""

    start: int
    slots: list[int]
    checksums: np.ndarray


class EngineDevice(Protocol):
    """An engine's device blocks that the engine copies itself (an engine attached to the node
    cache, core/node/engines.py): its block count, and the copies started on it (AsyncMover)."""

    num_blocks: int

    def start(self, op: Any, done: Callable[[BaseException | None, int], None]) -> None: ...


def _refuse_node_mode(config: CacheConfig) -> None:
    """A KVManager is the tiers themselves (the node's cache service runs one per namespace): it
    cannot attach to a service. A config that asks for the node cache must not get a private tier
    of its own instead (silently: the user believes the node's cache is used); the engine contract's
    factory is what attaches."""
    if config.mode == "node":
        raise ConfigError(
            "mode='node' (the config's mode key, or FLEXKV_MODE): a KVManager owns its tiers in "
            "this process and does not attach to the node cache. Attach through the engine "
            "contract: open_offload(model, config, model_id=..., engine=...) from dynamo_flexkv "
            "returns an EngineOffload on the cache server at node_socket (docs/ENGINE_CONTRACT.md); "
            "or set mode=embedded for tiers of this process"
        )
    if config.node_socket:
        raise ConfigError(
            f"node_socket={config.node_socket!r} names a node cache server, but mode='embedded': "
            "set mode=node (FLEXKV_MODE=node) to attach to it through open_offload(...) from "
            "dynamo_flexkv, or unset node_socket (FLEXKV_NODE_SOCKET) for tiers of this process"
        )


class KVManager:
    def __init__(
        self,
        model: ModelSpec,
        config: CacheConfig | None = None,
        *,
        namespace: str | None = None,
        listener: IndexListener | None = None,
        workers: int = 4,
        model_id: str = "",
        mover_hook: MoverHook | None = None,
        share_host: bool = False,
        weights_version: str = "",
    ) -> None:
        """``mover_hook(link, mover)`` returns the mover each link's copies run on instead of the
        one built here (a public seam for fault injection and tracing; restart adoption reads
        the disk directly). ``share_host``: the host tier is a shared-memory segment (``host.fd``)
        that engines of other processes map (the node cache, core/node/). ``weights_version``: the
        version of the weights the engine runs, when it knows one (see weights_changed)."""
        self.model = model
        self._mover_hook = mover_hook
        self.config = config or CacheConfig.load()
        _refuse_node_mode(self.config)
        self.namespace = namespace or None
        self.model_id = model_id  # names the weights in the disk and remote fingerprints: same shape != same bytes
        self.weights_version = weights_version  # salts every block's identity (weights_changed)
        self.invalidated_blocks = 0  # host and disk blocks dropped because the weights changed
        self._adopted_runs: list[Any] = []  # what announce_adopted() sent: announce_adopted(repeat=True) again
        self.tokens_per_block = self.config.tokens_per_block
        caps = self.config.tier_blocks(model)
        host_layout = self.config.layout(model, caps["host"], KVLayoutType.BLOCKFIRST)
        try:
            self.host = HostPool(host_layout, use_huge_pages=self.config.use_huge_pages, share=share_host)
        except OSError as e:  # ENOMEM: more than the machine (or its limits) allows
            raise ConfigError(
                f"cpu_cache_gb={self.config.cpu_cache_gb}: cannot allocate the host tier's "
                f"{host_layout.total_bytes / GiB:.2f} GiB ({e.strerror or e}): set cpu_cache_gb "
                "(FLEXKV_CPU_CACHE_GB) to what this machine can hold"
            ) from None
        self.ssd: SsdStore | None = None
        self.remote: RemoteStore | None = None
        movers: dict[OpKind, Any] = {OpKind.HASH: HostHasher(self.host)}
        try:
            if self.config.enable_remote:
                self.remote = self._open_remote()
                movers[OpKind.REMOTE2H] = movers[OpKind.H2REMOTE] = RemoteMover(self.host, self.remote)
            if caps["disk"]:
                try:
                    # The model's identity too, where the engine names it: the same KV shape of other
                    # weights is other bytes (a new fine-tune on a node that keeps its SSD cache).
                    self.ssd = SsdStore(
                        self.config.ssd_cache_dir,
                        caps["disk"],
                        self.host.layout.block_bytes,
                        dict(self.host.layout.fingerprint(), namespace=self.namespace or ""),
                        lineage=self._lineage(),
                    )
                except OSError as e:  # EFBIG / ENOSPC / EACCES: the files cannot be that large, or there
                    size = caps["disk"] * self.host.layout.block_bytes / GiB
                    raise ConfigError(
                        f"ssd_cache_gb={self.config.ssd_cache_gb} in ssd_cache_dir "
                        f"{';'.join(self.config.ssd_cache_dir)}: cannot create the disk tier's "
                        f"{size:.2f} GiB of files ({e.strerror or e}{': ' + e.filename if e.filename else ''}): "
                        "set ssd_cache_gb (FLEXKV_SSD_CACHE_GB) to what the file system holds, or "
                        "point ssd_cache_dir at a writable directory"
                    ) from None
                disk_mover = self._make_disk_mover()
                movers[OpKind.DISK2H] = movers[OpKind.H2DISK] = movers[OpKind.VERIFY] = disk_mover
            self.cache = CacheEngine(
                self.config,
                {Tier.HOST: caps["host"], Tier.DISK: caps["disk"]},
                listener=listener,
                on_slots_freed=self._slots_freed,
            )
            if self.ssd is not None:
                # Restart: what the journal says is on disk, verified through host slots.
                self.adopt_report = adopt_disk(self.ssd, self.cache, movers[OpKind.DISK2H], self.host.num_blocks)
        except BaseException:
            self._close_storage()
            raise
        self.transfer = TransferRunner(self._hooked(movers), workers)
        self.graphs = GraphBuilder(
            self.cache, self.ssd, self.host.layout.layer_block_bytes, self.tokens_per_block, model.num_layers
        )
        # Cost-aware loading (core/cost.py): the gets' reads measure the tiers, the engine its prefill.
        self.cost = CostModel(
            self.config.load_policy, self.tokens_per_block, self.host.layout.block_bytes, model.num_layers
        )
        self.graphs.observe_link = self.cost.observe_link
        self.device: DeviceCache | None = None
        self._table = TaskTable(self.config.task_result_ttl_seconds)
        self._lock = self._table.lock  # also guards _closed: a call checks it and issues atomically
        self._closed = False
        self._live_graphs = 0  # submitted graphs whose finish callback has not run yet
        self._idle = threading.Condition()
        self._deferred = DeferredPuts(self._idle, self._retry_put, self._fail_put, MAX_PUT_DEFER_S)
        self.put_refused_blocks = 0  # blocks puts could not store: longer than the host tier

    # ---- setup ---------------------------------------------------------------------------------
    def register_device_cache(
        self, tensors: torch.Tensor | Sequence[torch.Tensor], layout: KVLayoutType = KVLayoutType.LAYERBLOCK
    ) -> None:
        """Registers the engine's KV tensors (one per layer, or one for all layers)."""
        self._check_open("register_device_cache")
        self.device = DeviceCache.register(tensors, self.model, layout, self.tokens_per_block)
        mover = HostDeviceMover(self.host, self.device)
        self.transfer.movers.update(self._hooked({OpKind.D2H: mover, OpKind.H2D: mover}))

    def _hooked(self, movers: dict[OpKind, Any]) -> dict[OpKind, Any]:
        if self._mover_hook is None:
            return movers
        return {kind: self._mover_hook(kind, mover) for kind, mover in movers.items()}

    def _open_remote(self) -> RemoteStore:
        """Opens the remote tier: an unreachable server or a wrong password raises (naming the fix)
        unless remote_required=false, which starts with the tier off and retries it periodically."""
        from dynamo_flexkv.core.remote import RemoteStore, fingerprint_of

        parts = dict(
            self.host.layout.fingerprint(),
            namespace=self.namespace or "",
            model=self.model_id,
            tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
        )  # each rank holds another shard
        return RemoteStore(self.config.remote_config(), fingerprint_of(parts), strict=self.config.remote_required)

    def _remote_probe(self, hashes: list[int], start: int) -> tuple | None:
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

    def _make_disk_mover(self) -> DiskMover:
        if self.ssd is None:
            raise RuntimeError("KVManager: a disk mover without a disk tier")
        if self.config.enable_nixl:
            from dynamo_flexkv.core.transfer.nixl_mover import NixlDiskMover

            return NixlDiskMover(self.host, self.ssd, gds=self.config.enable_gds)
        return DiskMover(self.host, self.ssd, self.config.io_queue_depth)

    def announce_adopted(self, repeat: bool = False) -> int:
        """Sends the index listener (the router's events) a Stored event for every disk block
        re-adopted at start that is still held: the old process's announcements died with it. Call
        once, when the event subscriber is connected; ``repeat``: the same blocks again (those
        still held), for a subscriber that may have dropped the first. Returns the blocks
        announced; blocks journaled without token ids (and their descendants) cannot be named and
        are skipped."""
        self._check_open("announce_adopted")
        if repeat:
            return self.cache.announce(self._adopted_runs)
        report = getattr(self, "adopt_report", None)
        if report is None or not report.adopted:
            return 0
        self.adopt_report = dataclasses.replace(report, adopted=[])  # once only
        self._adopted_runs = adopted_chains(report.adopted, self.tokens_per_block)
        return self.cache.announce(self._adopted_runs)

    # ---- queries -------------------------------------------------------------------------------
    def hashes(
        self, token_ids: TokenIds, *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> BlockHashes:
        self._check_open("hashes")
        return namespaced_hashes(token_ids, self.tokens_per_block, self._hash_namespace, lora_name, cache_salt)

    def _task_hashes(
        self, token_ids: TokenIds, lora_name: str | None, cache_salt: str | None
    ) -> tuple[int, BlockHashes]:
        """A task's hashes and the generation they belong to (the cache engine plans and commits
        nothing of a task whose generation is no longer current: weights_changed)."""
        self._check_open("hashes")
        with self._lock:
            generation, salt = self.cache.generation, self._hash_namespace
        return generation, namespaced_hashes(token_ids, self.tokens_per_block, salt, lora_name, cache_salt)

    @property
    def _hash_namespace(self) -> str | None:
        """What salts every block hash: the namespace, and the weights once they changed (as a JSON
        pair: no namespace string can spell a namespace with weights)."""
        if not self.weights_version:
            return self.namespace
        return json.dumps([self.namespace or "", self.weights_version])

    def _lineage(self) -> dict[str, str]:
        """The weights the blocks are computed with, as the disk journal records them."""
        return {k: v for k, v in (("model", self.model_id), ("weights", self.weights_version)) if v}

    def weights_changed(self, version: str, timeout: float | None = 60.0) -> int:
        """The engine runs other weights now, named ``version`` (a revision, a digest of the new
        weights, or the version an RL trainer gives them). From this call on every block's identity
        carries ``version`` (its hash is salted with it), so a block computed with the weights before
        never matches again on any tier, the remote one (shared with other workers) included. The
        tasks in flight are cancelled (their copies of old KV commit nothing), then every host and
        disk block is dropped (removal events: the router forgets them at once) and the disk
        journal records the new weights, so a restart with them adopts none of the old blocks.
        Returns the blocks dropped. The same ``version`` again changes nothing."""
        self._check_open("weights_changed")
        if not isinstance(version, str) or not version.strip():
            raise ValueError(f"weights_changed(version={version!r}): name the new weights with a non-empty string")
        with self._lock:
            if version == self.weights_version:
                return 0
            self.weights_version = version  # hashes of anything planned from here on carry it
            self.cache.bump_generation()  # a task hashed before plans and commits nothing
            busy = [t for t in self.cache.task_ids() if isinstance(t, int)]  # the manager's task ids
        if busy:
            self.cancel(busy)
        if not self.drain(timeout):
            log.warning("weights_changed: tasks still running after %s s; their blocks are dropped when seen", timeout)
        with self._lock:
            before = {t: len(idx) for t, idx in self.cache.tiers.items()}
            try:
                self.cache.reset(RemovalReason.INVALIDATED)
            except IndexInvariantError:  # an engine thread started a task meanwhile: drop what is not busy
                for tier, idx in self.cache.tiers.items():
                    self.cache.evict(tier, len(idx), RemovalReason.INVALIDATED)
            dropped = sum(before[t] - len(idx) for t, idx in self.cache.tiers.items())
            self.invalidated_blocks += dropped
            if self.ssd is not None:
                self.ssd.set_lineage(self._lineage())
        log.info("weights changed to %r: %d blocks of the weights before dropped from host and disk", version, dropped)
        return dropped

    def match(
        self, token_ids: TokenIds, *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> dict[str, int]:
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
    def get_async(
        self,
        token_ids: TokenIds,
        device_block_ids: BlockIds,
        *,
        skip_blocks: int = 0,
        layerwise: bool = False,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        device: EngineDevice | None = None,
        on_done: Callable[[TaskResult], None] | None = None,
    ) -> int:
        """Loads the cached prefix beyond the first ``skip_blocks`` blocks (which the engine already
        holds) into ``device_block_ids[i]`` for block i. With ``prompt_tokens`` (the whole prompt's
        length, ``token_ids`` may be a prefix of it) the config's load_policy decides how much of
        it to load (core/cost.py): planned_tokens() then says what the engine must compute.
        ``device``: an attached engine's device, which copies its blocks itself (the node cache);
        ``on_done``: receives the result instead of wait() (called once, from any thread)."""
        self._need_device("get_async", device)
        generation, h = self._task_hashes(token_ids, lora_name, cache_salt)
        skip_blocks = arguments.skip_blocks(skip_blocks, len(token_ids), self.tokens_per_block)
        dev_ids = self._device_ids(token_ids, device_block_ids, device)
        with self._issue(TaskKind.GET, on_done) as task:
            seq = _int_list(h.sequence)
            start = min(skip_blocks, len(h))
            probe = self._remote_probe(seq, start)
            if prompt_tokens is not None:
                decision = self._decide(seq, start, probe, max(int(prompt_tokens), len(token_ids)), layerwise)
                seq = seq[: max(decision.end, start)]  # the blocks past it are recomputed, not planned
                probe = (probe[0], min(probe[1], len(seq))) if probe and min(probe[1], len(seq)) > probe[0] else None
            plan = self.cache.plan_get(task.id, seq, start, probe, generation)
            if plan.num_blocks == 0:
                self.cache.abort_task(task.id)
                task.finish(TaskResult(task.id, TaskKind.GET, TaskStatus.NOT_FOUND))
                return task.id
            self._plan_tokens(task, plan)
            self._attach_tokens(token_ids, plan.staged, plan.remote_staged)
            if device is None:  # our own device: its writes are fenced (an attached engine fences its own)
                task.fence = DeviceFence()
            self._submit(task, self.graphs.get(task, plan, dev_ids, layerwise, device))
        return task.id

    def _decide(
        self, seq: list[int], start: int, probe: tuple | None, prompt_tokens: int, layerwise: bool
    ) -> LoadDecision:
        """The load policy's decision for blocks [start, ...) of ``seq``, counted in
        stats().prefix_tokens."""
        decision = self.cost.decide(start, self._segments(seq, start, probe), prompt_tokens, len(seq), layerwise)
        self.cost.record(decision)
        return decision

    def _segments(self, seq: list[int], start: int, probe: tuple | None) -> list[Segment]:
        """The cached prefix of ``seq`` past ``start`` by tier, fastest first."""
        per_tier = self.cache.match(seq).per_tier
        segments: list[Segment] = []
        end = start
        for tier, n in (
            (Tier.HOST, per_tier.get(Tier.HOST, 0)),
            (Tier.DISK, per_tier.get(Tier.DISK, 0)),
            (None, probe[1] if probe else 0),
        ):
            if n > end:
                segments.append(Segment(tier.value if tier is not None else "remote", end, n))
                end = n
        return segments

    def pull_decision(
        self,
        token_ids: TokenIds,
        peer_blocks: int,
        *,
        prompt_tokens: int,
        skip_blocks: int = 0,
        layerwise: bool = True,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LoadDecision:
        """Whether pulling a peer's blocks up to ``peer_blocks`` (a router hint) beats recomputing
        them, by the same cost model as a get (core/cost.py) with the pulls' measured link
        (``peer``) as the segment past what this worker's tiers hold: pull when the decision's
        ``end`` reaches ``peer_blocks``. Not counted in stats().prefix_tokens (the lookup after
        the pull counts what is loaded)."""
        self._check_open("pull_decision")
        seq = _int_list(self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt).sequence)
        start = min(arguments.skip_blocks(skip_blocks, len(token_ids), self.tokens_per_block), len(seq))
        segments = self._segments(seq, start, self._remote_probe(seq, start))
        own_end = segments[-1].end if segments else start
        end = min(int(peer_blocks), len(seq))
        if end > own_end:
            segments.append(Segment("peer", own_end, end))
        total = max(int(prompt_tokens), len(token_ids))
        return self.cost.decide(start, segments, total, len(seq), layerwise)

    def loadable_tokens(
        self,
        token_ids: TokenIds,
        *,
        prompt_tokens: int | None = None,
        layerwise: bool = True,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_blocks: int = 0,
    ) -> int:
        """End of the prefix of ``token_ids`` a get would have loaded under the load policy, in
        tokens (whole blocks; at least ``skip_blocks`` blocks, which the engine holds already and
        the decision weighs only what lies beyond; ``prompt_tokens``: the whole prompt's length,
        default one more than token_ids). The decision counts in stats().prefix_tokens: for an
        engine that asks first and loads what it was told, passing no prompt_tokens to get_async
        (vLLM's scheduler)."""
        self._check_open("loadable_tokens")
        return (
            self.lookup_decision(
                token_ids,
                prompt_tokens=prompt_tokens,
                layerwise=layerwise,
                lora_name=lora_name,
                cache_salt=cache_salt,
                skip_blocks=skip_blocks,
            ).end
            * self.tokens_per_block
        )

    def lookup_decision(
        self,
        token_ids: TokenIds,
        *,
        prompt_tokens: int | None = None,
        layerwise: bool = True,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_blocks: int = 0,
    ) -> LoadDecision:
        """loadable_tokens' decision itself (what each tier holds beyond ``skip_blocks``, how far
        the policy loads and why), counted the same way."""
        self._check_open("lookup_decision")
        seq = _int_list(self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt).sequence)
        start = arguments.skip_blocks(skip_blocks, len(token_ids), self.tokens_per_block)
        start = min(start, len(seq))
        total = len(token_ids) + 1 if prompt_tokens is None else max(int(prompt_tokens), len(token_ids))
        return self._decide(seq, start, self._remote_probe(seq, start), total, layerwise)

    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """The engine's measurement for cost-aware loading: a step computed ``tokens`` prompt tokens
        (of prompts up to ``prompt_tokens`` long) in ``seconds``, time blocked on loads excluded."""
        self._check_open("observe_prefill")
        self.cost.observe_prefill(int(tokens), int(prompt_tokens), float(seconds))

    def prefetch_async(
        self,
        token_ids: TokenIds,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        on_done: Callable[[TaskResult], None] | None = None,
    ) -> int:
        """Brings the disk part of a cached prefix into host memory (no device copy)."""
        self._check_open("prefetch_async")
        generation, h = self._task_hashes(token_ids, lora_name, cache_salt)
        with self._issue(TaskKind.PREFETCH, on_done) as task:
            seq = _int_list(h.sequence)
            plan = self.cache.plan_get(task.id, seq, 0, self._remote_probe(seq, 0), generation)
            if plan.host_fill is None:
                self.cache.abort_task(task.id)
                status = TaskStatus.SUCCESS if plan.num_blocks else TaskStatus.NOT_FOUND
                task.finish(TaskResult(task.id, TaskKind.PREFETCH, status))
                return task.id
            self._plan_tokens(task, plan)
            self._attach_tokens(token_ids, plan.staged, plan.remote_staged)
            self._submit(task, self.graphs.get(task, plan, None, False))
        return task.id

    def put_async(
        self,
        token_ids: TokenIds,
        device_block_ids: BlockIds,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        device: EngineDevice | None = None,
        on_done: Callable[[TaskResult], None] | None = None,
    ) -> int:
        """Stores the full blocks not held yet. The task finishes once the device copy is done (the
        engine may reuse its blocks); the disk write continues in the background. ``device`` and
        ``on_done`` as for get_async."""
        self._need_device("put_async", device)
        generation, h = self._task_hashes(token_ids, lora_name, cache_salt)
        dev_ids = self._device_ids(token_ids, device_block_ids, device)
        with self._issue(TaskKind.PUT, on_done) as task:
            after = None
            local = self._registered_device() if device is None else None
            if local is not None and local.device.type == "cuda":  # the copy waits for the engine's writes
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(local.device))
            self._put_now(DeferredPut(task, _int_list(h.sequence), token_ids, dev_ids, after, device, generation))
        return task.id

    def _put_now(self, put: DeferredPut) -> bool:
        """Plans and submits the put; False when it was deferred instead: some blocks found no host
        room while running tasks lock it, so it waits for them (a task finishing retries it). What
        still does not fit (nothing runs any more, the prompt is longer than the host tier, or it
        waited MAX_PUT_DEFER_S) is counted in stats().tasks.put_refused_blocks; the put
        stores the rest."""
        task, seq = put.task, put.seq
        plan = self.cache.plan_put(task.id, seq, remote=self.remote is not None, generation=put.generation)
        short = len(seq) - plan.held - (len(plan.host) if plan.host is not None else 0)
        # Wait only for room that can come: the put fits the host tier, and not past the bound
        # (the engine cannot reuse its device blocks before the put finishes).
        if (
            short > 0
            and len(seq) - plan.held <= self.cache.tiers[Tier.HOST].capacity
            and time.monotonic() - put.since < MAX_PUT_DEFER_S
        ):
            self.cache.abort_task(task.id, replan=True)  # nothing planned stays behind while it waits
            with self._idle:
                if self._live_graphs:
                    self._deferred.add(put)
                    return False
            plan = self.cache.plan_put(task.id, seq, remote=self.remote is not None, generation=put.generation)
            short = len(seq) - plan.held - (len(plan.host) if plan.host is not None else 0)
        if short > 0:
            with self._idle:
                self.put_refused_blocks += short
        self._attach_tokens(put.token_ids, plan.host)
        self._attach_tokens(put.token_ids, plan.disk, always=True)  # the journal keeps them for restarts
        self._submit(
            task, self.graphs.put(task, plan, put.dev_ids, put.after if plan.host is not None else None, put.device)
        )
        return True

    def _retry_put(self, put: DeferredPut) -> bool:
        if self._closed:
            raise ManagerClosed("shut down")
        return self._put_now(put)

    def _fail_put(self, put: DeferredPut, error: BaseException) -> None:
        """A deferred put whose retry raised: cancelled by shutdown, failed otherwise."""
        self.cache.abort_task(put.task.id)
        cancelled = isinstance(error, ManagerClosed)
        put.task.finish(
            TaskResult(
                put.task.id,
                TaskKind.PUT,
                TaskStatus.CANCELLED if cancelled else TaskStatus.FAILED,
                error=None if cancelled else f"{type(error).__name__}: {error}",
            )
        )

    def wait(self, task_ids: Iterable[int], timeout: float | None = None) -> dict[int, TaskResult]:
        """Results of the tasks; unfinished ones after ``timeout`` seconds report TIMEOUT and can be
        waited on again. A finished result is handed out once; results a wait() is blocked on never
        expire. ``timeout``: seconds (None or inf: no limit)."""
        deadline = _deadline(timeout, "wait")
        with self._awaited(arguments.task_id_list(task_ids, "wait"), "wait") as tasks:
            out: dict[int, TaskResult] = {}
            finished = []
            for task in tasks:
                if task.done.wait(_left(deadline)):
                    assert task.result is not None  # finish() sets the result before it sets done
                    out[task.id] = task.result
                    finished.append(task)
                else:
                    out[task.id] = TaskResult(task.id, task.kind, TaskStatus.TIMEOUT)
            self._table.collect(finished)
        return out

    def done(self, task_id: int) -> bool:
        """True once the task finished; its result stays until wait()/try_wait() collects it (or it
        expires). For an engine that polls a put's device copy and collects later."""
        return self._task(task_id, "done").done.is_set()

    def try_wait(self, task_ids: Iterable[int]) -> dict[int, TaskResult]:
        """Results of the tasks that already finished; the others are left running."""
        finished = [t for t in arguments.task_id_list(task_ids, "try_wait") if self._task(t, "try_wait").done.is_set()]
        return self.wait(finished, 0)

    def cancel(self, task_ids: Iterable[int]) -> None:
        """Cancels the tasks (their results report CANCELLED unless they finished first). An id whose
        task already finished, its result collected or expired, is skipped: cancel may race wait().
        An id never issued raises KeyError, and then nothing is cancelled.

        A load into the registered device finishes as soon as none of its device writes runs (at
        once, unless one is copying now: then when that one returns), not when every copy of it
        returned: a copy stalled before its write (disk, queue, a hook) wakes up to a closed fence
        and writes nothing (core/transfer/fence.py). Its host side drains on its own (drain())."""
        self._check_open("cancel")
        tasks = self._table.get_all(arguments.task_id_list(task_ids, "cancel"))  # all checked before any is touched
        for task in tasks:
            if task is None:
                continue
            if task.graph is not None:
                self.transfer.cancel(task.graph)
                if task.fence is not None:
                    task.fence.close(functools.partial(self._fenced, task))
            elif self._deferred.drop(lambda put: put.task is task):
                task.finish(TaskResult(task.id, task.kind, TaskStatus.CANCELLED))

    @staticmethod
    def _fenced(task: Task) -> None:
        """A cancelled load's device writes are over: the engine may reuse its blocks."""
        task.finish(TaskResult(task.id, task.kind, TaskStatus.CANCELLED))

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every task has finished, the background disk writes of puts included.
        False if some still run after ``timeout`` seconds (None or inf: no limit)."""
        self._check_open("drain")
        deadline = _deadline(timeout, "drain")
        with self._idle:
            while self._live_graphs or self._deferred.busy():
                left = _left(deadline)
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def planned_tokens(self, task_id: int) -> int:
        """Tokens a get will have loaded if it succeeds (known at submission: the engine can plan
        its compute while the load runs)."""
        return self._task(task_id, "planned_tokens").planned_tokens

    def planned_tokens_by_tier(self, task_id: int) -> dict[str, int]:
        """planned_tokens split by the tier each block is read from: ``{"host": n, "disk": m}``, plus
        ``"remote"`` with a remote tier (they sum to planned_tokens)."""
        task = self._task(task_id, "planned_tokens_by_tier")
        local = task.planned_tokens - task.planned_disk_tokens - task.planned_remote_tokens
        out = {"host": local, "disk": task.planned_disk_tokens}
        if self.remote is not None:
            out["remote"] = task.planned_remote_tokens
        return out

    def wait_for_layer(self, task_id: int, layer: int, timeout: float | None = None) -> bool:
        """Blocks until layer ``layer`` of a get is on the device. False on timeout; raises
        TaskFailed when the task failed, was cancelled or found nothing (recompute instead).
        ``timeout``: seconds (None or inf: no limit)."""
        deadline = _deadline(timeout, "wait_for_layer")
        with self._awaited([task_id], "wait_for_layer") as (task,):
            layer = arguments.layer_index(layer, task.num_layers)
            if not task.layer_ready[layer].wait(_left(deadline)):
                return False
        if task.result is not None and not task.result.ok:
            raise TaskFailed(f"task {task_id}: {task.result.status.value}: {task.result.reason}")
        return True

    # ---- admin ---------------------------------------------------------------------------------
    def stats(self) -> ManagerStats:
        """A snapshot of the tiers, requests, links, tasks and remote store (see core/stats.py)."""
        self._check_open("stats")
        self._table.expire()
        index = self.cache.stats()
        tiers = {name: TierStats(**index[name]) for name in ("host", "disk") if name in index}
        requests = RequestStats(**index["requests"])
        t = self.transfer
        links = {k.value: LinkStats(t.link_bytes[k], t.link_seconds[k], t.link_ops[k]) for k in OpKind if t.link_ops[k]}
        remote = None
        if self.remote is not None:
            remote = RemoteTierStats(
                **dataclasses.asdict(self.remote.stats()),
                url=self.remote.config.redacted_url,
                planned_blocks=requests.remote_hit_blocks,
                short_reads=self.graphs.remote_short_reads,
                write_failures=self.graphs.remote_write_failures,
            )
        in_flight, uncollected = self._table.counts()  # finished results waiting for wait() are not in flight
        tasks = TaskStats(
            in_flight=in_flight,
            uncollected_results=uncollected,
            queued_ops=t.queue_depth,
            failed_ops=t.failed_ops,
            deferred_puts=len(self._deferred),
            put_refused_blocks=self.put_refused_blocks,
            disk_write_failures=self.graphs.disk_write_failures,
            expired_results=self._table.expired_results,
            transfers_running=self._live_graphs + len(self._deferred),
        )
        prefix = {"/".join(k): n for k, n in sorted(self.cost.token_counts().items())}
        return ManagerStats(
            host=tiers["host"],
            disk=tiers.get("disk"),
            requests=requests,
            tasks=tasks,
            remote=remote,
            links=links,
            prefix_tokens=prefix,
            tier_costs=self.cost.link_costs(),
        )

    def evict(self, tier: str, count: int | None = None) -> int:
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

    # ---- what is cached (core/inventory.py; dynamo-flexkv cache) -------------------------------
    def contents(self) -> Contents:
        """Each tier's blocks by state, bytes and last use, now (no side effects)."""
        with self._lock:
            self._check_open("contents")
            block = self.host.layout.block_bytes
            tiers = []
            for tier, idx in self.cache.tiers.items():
                c = idx.census()
                tiers.append(
                    TierContents(
                        tier.value,
                        c.ready + c.filling,
                        c.ready,
                        c.filling,
                        c.in_use,
                        block,
                        idx.capacity,
                        c.oldest_s,
                        c.newest_s,
                    )
                )
        remote = self.remote.config.redacted_url if self.remote is not None else None
        return Contents(self.model_id, self.namespace or "", tiers, remote=remote)

    def prefix_blocks(
        self, token_ids: TokenIds, *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> PrefixBlocks:
        """Which tiers hold which of the prompt's full blocks (each tier a leading run of them; the
        remote tier as its store answers now). No side effects: nothing is touched or counted."""
        self._check_open("prefix_blocks")
        seq = _int_list(self.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt).sequence)
        with self._lock:
            held = {tier.value: idx.match_length(seq) for tier, idx in self.cache.tiers.items()}
        note = None
        if self.remote is not None:
            try:
                held["remote"] = self.remote.exists_prefix(seq) if seq else 0
            except Exception as e:  # noqa: BLE001 - a store that cannot answer is reported, not raised
                note = f"the remote tier did not answer: {type(e).__name__}: {e}"
        return PrefixBlocks(self.model_id, self.namespace or "", len(token_ids), self.tokens_per_block, seq, held, note)

    def clear(self, tiers: Sequence[str] | None = None, wait_s: float = 0.0) -> Cleared:
        """Removes every block of ``tiers`` ("host", "disk"; default both) that no task uses, as
        the policy's eviction would (ready, unlocked leaves, until none is left), with
        RemovalReason.CLEARED: metrics count them as cleared and the listener (the router) hears
        each removal. Blocks a load or a tier write uses, blocks still landing and their prefixes
        stay and are counted by why (KeptReason). ``wait_s``: first wait up to this long for the
        tier writes in flight, so what they hold can go too. The remote tier is never cleared."""
        self._check_open("clear")
        names = {"host": Tier.HOST, "disk": Tier.DISK}
        for t in tiers or ():
            if t not in names and t != "remote":
                raise ValueError(f"clear(tiers={list(tiers or ())}): this manager clears 'host' and 'disk'")
        if wait_s > 0:
            self.drain(wait_s)
        out = []
        with self._lock:
            self._check_open("clear")
            for name, tier in names.items():
                idx = self.cache.tiers.get(tier)
                if idx is None or (tiers is not None and name not in tiers):
                    continue
                gone = self.cache.evict(tier, len(idx), RemovalReason.CLEARED)
                c = idx.census()
                kept = {
                    KeptReason.IN_USE.value: c.in_use,
                    KeptReason.FILLING.value: c.filling,
                    KeptReason.PARENT.value: c.parents,
                }
                out.append(TierCleared(name, len(gone), {k: n for k, n in kept.items() if n}))
        asked_remote = self.remote is not None and (tiers is None or "remote" in tiers)
        note = REMOTE_NOT_CLEARED if asked_remote else None
        return Cleared(self.model_id, self.namespace or "", out, note)

    def shutdown(self) -> None:
        """Cancels what is in flight, waits for running copies to drain, frees memory and files.
        Every later call but shutdown() raises ManagerClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.transfer.shutdown()
        for put in self._deferred.drop(lambda put: True):
            put.task.finish(TaskResult(put.task.id, TaskKind.PUT, TaskStatus.CANCELLED))
        self._deferred.close()
        self._close_storage()

    def __enter__(self) -> KVManager:
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- peers (core/peer/: another worker pulls host blocks over NIXL) --------------------------------
    def pin_host(self, key: Any, hashes: Sequence[int], start: int, limit: int) -> HostPin | None:
        """Pins this tier's ready host blocks [start, end) of ``hashes`` (at most ``limit``) under
        ``key`` for a peer's read: they are neither evicted nor reused until ``unpin(key)``.
        Returns their slots and checksums (xxh3 of each slot, as host holds it), or None when host
        holds nothing past ``start``. ``key``: any hashable the caller does not reuse while pinned."""
        with self._lock:
            self._check_open("pin_host")
            run = self.cache.pin_host(key, hashes, start, limit)
            if run is None:
                return None
        try:
            sums = self.host.checksums(np.asarray(run.block_ids, dtype=np.int64))  # pinned: immutable
        except BaseException:
            self.unpin(key)
            raise
        return HostPin(run.start, list(run.block_ids), sums)

    def unpin(self, key: Any) -> None:
        """Releases what ``pin_host(key, ...)`` pinned (nothing if it holds nothing); after shutdown,
        ManagerClosed (shutdown released every pin)."""
        self._check_open("unpin")
        self.cache.abort_task(key)

    def stage_host(
        self, key: Any, token_ids: TokenIds, hashes: Sequence[int], end: int, generation: int
    ) -> TierRun | None:
        """New, invisible host blocks for [h, end) of ``hashes`` (h: host's ready prefix) that a
        peer's bytes fill; ``commit_staged`` makes the verified ones visible. None when nothing can
        be staged (host holds it, another task fills it, no room, or the weights changed since
        ``generation``, ``self.cache.generation`` when the hashes were taken)."""
        with self._lock:
            self._check_open("stage_host")
            run = self.cache.stage_host(key, hashes, end, generation)
        if run is None:
            return None
        self.host.forget_checksums(run.block_ids)  # their bytes are about to change
        self._attach_tokens(token_ids, run)
        return run

    def commit_staged(
        self, key: Any, run: TierRun, count: int, sums: np.ndarray | None = None, *, read: bool = True
    ) -> None:
        """The first ``count`` blocks of ``run`` (stage_host) hold verified bytes whose checksums
        are ``sums``: they become visible (a Stored event each); the rest is rolled back, counted
        in rolled_back_blocks unless no read into them started (``read`` False: the peer refused)."""
        self._check_open("commit_staged")
        if count > 0 and sums is not None:
            self.host.record_checksums(np.asarray(run.block_ids[:count], dtype=np.int64), sums[:count])
        try:
            if count > 0:
                self.cache.complete_prefix(run, key, count)
        finally:
            self.cache.abort_task(key, replan=not read)  # replan: released, not counted as rolled back

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ManagerClosed(
                f"{call}(): this KVManager was shut down, its memory and cache directories are "
                "released: create a new KVManager (it re-adopts the disk tier)"
            )

    def _need_device(self, call: str, device: EngineDevice | None = None) -> None:
        self._check_open(call)
        if self.device is None and device is None:
            raise RuntimeError(f"{call} before register_device_cache(): register the engine's KV tensors first")

    def _registered_device(self) -> DeviceCache:
        """The device cache register_device_cache() set (callers passed _need_device without an
        EngineDevice, so it is set)."""
        if self.device is None:
            raise RuntimeError("no device cache: call register_device_cache() with the engine's KV tensors first")
        return self.device

    @contextlib.contextmanager
    def _issue(self, kind: TaskKind, on_done: Callable[[TaskResult], None] | None = None) -> Iterator[Task]:
        """A new task; if issuing it fails, it leaves nothing behind (no record, no index state)."""
        with self._lock:
            self._check_open(f"{kind.value}_async")
            limit = self.config.max_tasks_in_flight
            busy = self._live_graphs + len(self._deferred)
            if busy >= limit:  # bounded work under a flood: refuse rather than queue forever
                raise TooManyTasks(
                    f"{kind.value}_async refused: {busy} tasks in flight (max_tasks_in_flight={limit}; "
                    "the background disk/remote writes of finished puts count: "
                    "stats().tasks.transfers_running); wait for some (drain()), or raise max_tasks_in_flight"
                )
            task = self._table.issue(kind, self.model.num_layers)
            task.deliver = on_done
        self._table.expire()
        try:
            yield task
        except BaseException as e:
            self.cache.abort_task(task.id)
            self._table.discard(task.id)
            task.finish(TaskResult(task.id, kind, TaskStatus.FAILED, error=f"refused: {e}"))  # wakes no one
            raise

    def _plan_tokens(self, task: Task, plan: GetPlan) -> None:
        tpb = self.tokens_per_block
        task.planned_tokens = plan.num_blocks * tpb
        if plan.disk_reads is not None:  # blocks the caller skips are not read
            task.planned_disk_tokens = max(0, plan.disk_reads.end - max(plan.disk_reads.start, plan.start)) * tpb
        if plan.remote_staged is not None:
            r = plan.remote_staged
            task.planned_remote_tokens = max(0, r.end - max(r.start, plan.start)) * tpb

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
        if len(self._deferred):  # what it held may be the room a deferred put waits for
            self._deferred.retry()

    def _task(self, task_id: int, call: str) -> Task:
        self._check_open(call)
        return self._table.get(task_id)

    @contextlib.contextmanager
    def _awaited(self, task_ids: list[Any], call: str) -> Iterator[list[Task]]:
        self._check_open(call)
        with self._table.awaited(task_ids) as tasks:
            yield tasks

    def _device_ids(
        self, token_ids: TokenIds, device_block_ids: BlockIds, device: EngineDevice | None = None
    ) -> np.ndarray:
        num_blocks = device.num_blocks if device is not None else self._registered_device().num_blocks
        return arguments.device_ids(token_ids, device_block_ids, self.tokens_per_block, num_blocks)

    def _attach_tokens(self, token_ids: TokenIds, *runs: TierRun | None, always: bool = False) -> None:
        """New runs carry their tokens so the events they cause can name them."""
        if self.cache.listener is None and not always:
            return
        b = self.tokens_per_block
        for run in runs:
            if run is not None:
                run.token_ids = [int(t) for t in token_ids[run.start * b : run.end * b]]

    def _slots_freed(self, tier: Tier, slots: list[int]) -> None:
        if tier is Tier.DISK and self.ssd is not None:
            self.ssd.record_removed(slots)
        elif tier is Tier.HOST:
            self.host.forget_checksums(slots)  # checksum once: a freed slot's checksum goes with it

    def _close_storage(self) -> None:
        # getattr: __init__ may fail before it set them.
        remote: RemoteStore | None = getattr(self, "remote", None)
        if remote is not None:
            remote.close()
        ssd: SsdStore | None = getattr(self, "ssd", None)
        if ssd is not None:
            ssd.close()
        if getattr(self, "host", None) is not None:
            self.host.close()
