"""The connector's worker half: this rank's offload (the engine contract, core/contract.py:
embedded tiers or the node's cache service, as the cache config's mode says) and its calls.

Per step (vLLM calls these in this order): ``start_load`` before the forward issues this step's
stores (finished requests, whose blocks vLLM keeps until we report them) and loads (layerwise:
each layer's copy is its own op); ``wait_layer`` before each attention layer waits for that
layer only; ``end_step`` after the forward collects the loads, so no copy into vLLM's blocks
outlives the step. ``begin_step`` (vLLM binding the step's metadata, before the forward) and
``end_step`` time the steps that only prefill: the cost model's measure of recompute. A load that
failed, or found less than the scheduler was told, reports its blocks through ``take_load_errors``
and vLLM recomputes them (kv_load_failure_policy=recompute).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.inventory import BadCacheRequest, parse_request, to_builtins
from dynamo_flexkv.core.offload import EngineOffload, open_offload
from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.core.tasks import TaskFailed
from dynamo_flexkv.integrations.request_log import RequestLog
from dynamo_flexkv.integrations.vllm_connector.events import FlexKVEvents, TierEventQueue
from dynamo_flexkv.integrations.vllm_connector.groups import FULL, aux_share, is_hybrid, latent
from dynamo_flexkv.integrations.vllm_connector.handover import Handover
from dynamo_flexkv.integrations.vllm_connector.hints import FetchHint, WorkerHints
from dynamo_flexkv.integrations.vllm_connector.hybrid import GroupTiers
from dynamo_flexkv.integrations.vllm_connector.kv_tensors import describe
from dynamo_flexkv.integrations.vllm_connector.lookup import LookupServer
from dynamo_flexkv.integrations.vllm_connector.metrics import prefix_token_totals, rank_reports
from dynamo_flexkv.integrations.vllm_connector.protocol import FlexKVMetadata, LoadSpec, lookup_endpoint
from dynamo_flexkv.integrations.vllm_connector.settings import (
    ConnectorSettings,
    default_model_id,
    load_mover_hook,
    run_dir_or_default,
)
from dynamo_flexkv.integrations.vllm_connector.step_clock import StepClock
from dynamo_flexkv.integrations.vllm_connector.weights import WeightWatch

log = logging.getLogger(__name__)


def _subdirs(dirs, *parts: str) -> tuple:
    """Each directory's subdirectory ``parts`` (made): one engine, rank or group's own disk tier."""
    out = tuple(os.path.join(d, *parts) for d in dirs)
    for d in out:
        os.makedirs(d, exist_ok=True)
    return out


@dataclass
class _Load:
    tid: int
    spec: LoadSpec
    planned_blocks: int
    by_tier: dict[str, int]
    failed: bool = False


@dataclass(frozen=True)
class TransferRecord:
    """One finished load or store of this worker (``transfer_log``): which of vLLM's blocks."""

    kind: str  # "load", "store" or "handover" (a read from a prefill worker)
    req_id: str
    block_ids: list[int]  # load/handover: the blocks it filled; store: the blocks it copied out
    ok: bool
    seconds: float = 0.0  # handover: read and verify
    nbytes: int = 0  # handover: bytes read
    verify_seconds: float = 0.0  # handover: of ``seconds``, hashing what landed
    # A hybrid model's load or store: each group's block ids by block position (from the request's
    # first block), 0 where it has none
    groups: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class LoadCounters:
    """Tokens this worker loaded, by tier, and tokens it had to hand back for recompute."""

    loaded: dict[str, int]
    recomputed: int = 0
    failed_loads: int = 0
    handover_tokens: int = 0  # read from a prefill worker (handover.py), not computed here
    handover_bytes: int = 0
    handover_seconds: float = 0.0
    handovers_ok: int = 0  # reads that landed and verified
    handover_failures: int = 0  # reads refused, failed, past their lease or corrupt: recomputed
    handover_corrupt: int = 0  # of those, read but not matching the prefill's digests


# A vLLM worker's device tier is vLLM's own prefix cache, not the connector's to list or clear.
VLLM_DEVICE = (
    "a vLLM worker's device tier is vLLM's own prefix cache: clear it with Dynamo's clear_kv_blocks (which "
    "resets FlexKV's tiers too, through the connector); ask this worker for host, disk or remote"
)


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, tp_rank: int, tp_size: int) -> None:
        self.settings, self.tp_rank, self.tp_size = settings, tp_rank, tp_size
        self.offload: EngineOffload | None = None
        self.events: TierEventQueue | None = None
        self.server: LookupServer | None = None
        self.handover: Handover | None = None
        self.hints: WorkerHints | None = None  # router hints (hints.py), when secondary_tiers turns them on
        self._digest_after: list[Any] = []  # (request, blocks) to digest once this step's forward ends
        self._layer: dict[str, int] = {}
        self._loads: dict[str, _Load] = {}
        self._errors: set[int] = set()
        self._saving: dict[str, int] = {}  # request -> store tasks still holding its blocks
        self._saved: set[str] = set()  # stores done, waiting for vLLM to list the request as finished
        self._finished_seen: set[str] = set()
        self.counters = LoadCounters(loaded={})
        self.transfer_log: collections.deque[TransferRecord] = collections.deque(maxlen=1024)  # newest last
        self.stored_tokens = 0
        self.prompt_tokens = 0  # rank 0: prompt tokens of the requests vLLM scheduled (FlexKVMetadata)
        self._reported: dict[str, float] = {}  # counter totals already sent as deltas
        self._gauges_at = 0.0
        self.clock: StepClock | None = None
        # request_log (rank 0): each lookup's decision and each load's outcome, for the replay
        self.request_log: RequestLog | None = None
        self._stores = True  # False on the ranks whose replicated KV another rank stores
        # A hybrid model's other KV cache groups (hybrid.py), and its loads, which run ahead of
        # the request's first step: request -> (spec, (offload, task) per part).
        self.aux: EngineOffload | None = None
        self.tiers: GroupTiers | None = None
        self._ahead: dict[str, tuple[LoadSpec, list[tuple[EngineOffload, int]], dict[str, int]]] = {}
        self._ahead_failed: set[str] = set()
        self._stored_groups: dict[str, dict[int, list[int]]] = {}  # for the store's TransferRecord
        self._release_after_load: set[str] = set()
        # The weights the tiers were told of (weights.py): "" is the weights the worker started with.
        self.weights = WeightWatch(default_model_id)
        self._weights_told = ""
        self._weights_lock = threading.Lock()
        # The weights of the last step and the first step that ran with them: a save of a request
        # first scheduled before that step holds KV (in part) of older weights (SaveSpec.first_step)
        self._step_weights = ""
        self._weights_since_step = 0  # 0: no change seen since the worker started
        self.stale_saves = 0  # saves dropped for it

    # ---- setup -----------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mla = latent(self.settings.groups)
        desc = describe(kv_caches, self.settings.num_blocks, self.settings.block_size, latent=mla)
        cache = CacheConfig.load().replace(
            tokens_per_block=self.settings.block_size, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
        # MLA's latent is the same on every rank: through the node cache the ranks share one copy,
        # which rank 0 stores and every rank loads (embedded, each rank keeps its own).
        replicated = mla and self.tp_size > 1
        self._stores = not (replicated and cache.mode == "node" and self.tp_rank > 0)
        parts = ([f"dp{self.settings.dp_rank}"] if self.settings.dp_rank is not None else []) + (
            [f"rank{self.tp_rank}"] if self.tp_size > 1 else []
        )
        if parts and cache.ssd_cache_dir:  # each engine and rank holds its own bytes on disk
            cache = cache.replace(ssd_cache_dir=_subdirs(cache.ssd_cache_dir, *parts))
        hybrid = is_hybrid(self.settings.groups)
        if hybrid:
            main = next((g for g in self.settings.groups if g.kind in FULL), self.settings.groups[0])
            self.events = TierEventQueue(self.settings.block_size, main.index, main.kind) if self.tp_rank == 0 else None
        else:
            self.events = TierEventQueue(self.settings.block_size) if self.tp_rank == 0 else None
        hook = load_mover_hook(self.settings.mover_hook) if self.settings.mover_hook else None
        model_id = f"{self.settings.model_id}|{desc.layout_tag}"
        share = (
            aux_share(self.settings.groups, self.settings.block_size, self.settings.max_model_len) if hybrid else 0.0
        )
        main_cache = (
            cache.replace(cpu_cache_gb=cache.cpu_cache_gb * (1 - share), ssd_cache_gb=cache.ssd_cache_gb * (1 - share))
            if hybrid
            else cache
        )
        self.offload = open_offload(
            desc.model,
            main_cache,
            layerwise=self.settings.layerwise,
            listener=self.events,
            model_id=model_id,
            engine=self.settings.engine_id,
            rank=self.tp_rank,
            ranks=self.tp_size,
            replicated=replicated,
            mover_hook=hook,
        )
        try:
            self.offload.register(desc.tensors, desc.layout)
            if hybrid:
                self._register_aux(desc, cache, share, model_id, replicated, hook)
            self._layer = desc.layer_index(kv_caches)
            self.clock = StepClock(cuda=desc.tensors[0].is_cuda)
            self._watch_weights()
            if self.settings.handover and not hybrid:
                self._start_handover(desc)
            if self.settings.secondary_tiers is not None:
                self._start_hints(hybrid)
            if self.settings.request_log and self.tp_rank == 0 and not hybrid:
                self.request_log = RequestLog(run_dir_or_default(self.settings.run_dir))
            # Every rank answers for its own shard; the scheduler takes the smallest answer.
            self.server = LookupServer(
                lookup_endpoint(self.settings.engine_id, self.settings.run_dir, self.tp_rank),
                self._lookup,
                self._reset_for_scheduler,
                self.cache_admin,
            )
            if self.tp_rank == 0:
                self.offload.announce_adopted()  # a restarted worker's disk blocks, for the router
        except BaseException:
            if self.hints is not None:
                self.hints.close()
                self.hints = None
            self._close_offloads()
            raise
        log.info(
            "FlexKVConnector worker rank %d: %d layers, %s; %stiers %s",
            self.tp_rank,
            len(desc.tensors),
            desc.layout_tag,
            f"{len(self.settings.groups)} KV cache groups; " if hybrid else "",
            self.offload.describe(),
        )

    def _register_aux(
        self, desc: Any, cache: CacheConfig, share: float, model_id: str, replicated: bool, hook: Any
    ) -> None:
        """A hybrid model's other groups (hybrid.py): their own tiers over the same tensors, a
        ``share`` of the host and disk budget, no events, every cached block loaded."""
        from dynamo_flexkv.core.enums import LoadPolicy

        if cache.mode == "node":  # its groups would be a second model there, with a budget of their own
            raise ValueError(
                "FlexKVConnector: a hybrid (sliding-window) model is not offloaded to the node cache "
                "yet (cache mode: node); use mode: embedded for this worker"
            )
        aux_cache = cache.replace(
            cpu_cache_gb=cache.cpu_cache_gb * share,
            ssd_cache_gb=cache.ssd_cache_gb * share,
            load_policy=LoadPolicy.ALWAYS,
            ssd_cache_dir=_subdirs(cache.ssd_cache_dir, "groups") if cache.ssd_cache_dir else (),
        )
        self.aux = open_offload(
            desc.model,
            aux_cache,
            layerwise=False,
            model_id=f"{model_id}|groups",
            engine=self.settings.engine_id,
            rank=self.tp_rank,
            ranks=self.tp_size,
            replicated=replicated,
            mover_hook=hook,
        )
        self.aux.register(desc.tensors, desc.layout)
        self.tiers = GroupTiers(self.settings.groups, self._registered("register"), self.aux, self.settings.block_size)

    def _close_offloads(self) -> None:
        for off in (self.aux, self.offload):
            if off is not None:
                off.shutdown()
        self.offload = self.aux = self.tiers = None

    def _start_handover(self, desc: Any) -> None:
        """This worker's NIXL agent for the P->D handover; without one (tensor parallelism, no NIXL)
        the scheduler finds no source file and the next connector hands requests over."""
        if self.tp_size > 1:
            log.warning(
                "FlexKVConnector: handover with tensor parallelism %d is not supported; the next connector "
                "hands requests over",
                self.tp_size,
            )
            return
        from dynamo_flexkv.core.layout import KVLayoutType

        layers = (
            desc.tensors if desc.layout is KVLayoutType.LAYERBLOCK else [t[k] for t in desc.tensors for k in (0, 1)]
        )
        try:
            self.handover = Handover(
                layers,
                self.settings.engine_id,
                self.settings.run_dir,
                self.settings.handover_verify,
                self.settings.handover_orphan_s,
            )
        except Exception as e:  # noqa: BLE001 - NIXL's own types; the graph still serves through NixlConnector
            log.warning("FlexKVConnector: no handover agent (%s); the next connector hands requests over", e)

    def _start_hints(self, hybrid: bool) -> None:
        """Router hints (hints.py): this worker's control endpoint and its pulls. Embedded tiers of
        a single-rank, single-group engine only; elsewhere the worker serves without them."""
        from dynamo_flexkv.core.offload import EmbeddedOffload
        from dynamo_flexkv.integrations.disagg.params import handover_secret

        tier = self.settings.secondary_tiers
        assert tier is not None
        if self.tp_size > 1 or hybrid or not isinstance(self.offload, EmbeddedOffload):
            log.warning(
                "FlexKVConnector: router hints need embedded tiers on one rank of a single-group model "
                "(tensor parallel %d, hybrid %s, %s); this worker neither serves nor pulls hinted blocks",
                self.tp_size,
                hybrid,
                type(self.offload).__name__,
            )
            return
        self.hints = WorkerHints(self.offload, tier, tier.port(self.settings.dp_rank_local), handover_secret())
        log.info("FlexKVConnector: router hints on; peers pull this worker's host tier at %s", self.hints.link.endpoint)

    def _lookup(
        self, tokens, lora: str | None, salt: str | None, prompt_tokens: int, local_blocks: int, hint=None
    ) -> int:
        if not self._weights_current():  # KV of other weights: a miss until the tiers heard of the change
            return 0
        bs = self.settings.block_size
        hinted: dict[str, Any] | None = None  # what the hint did, for the request_log
        if hint is not None and self.hints is not None:  # a router hint: pull what the tiers lack first
            endpoint, blocks, refused = hint
            self.hints.counters.seen += 1
            hinted = {"hinted": blocks * bs, "start": 0, "pulled": 0, "why": refused, "skipped": False}
            if refused:
                self.hints.counters.fail(refused)
            else:
                r = self.hints.pull(FetchHint(endpoint, blocks), tokens, lora, salt, bs, prompt_tokens, local_blocks)
                hinted.update(start=r.start * bs, pulled=r.blocks * bs, why=r.why, skipped=r.decision == "slower")
        if self.tiers is not None:
            return self.tiers.cached_tokens(tokens, lora, salt, prompt_tokens, local_blocks)
        offload = self._registered("lookup")
        if self.request_log is None:
            return offload.cached_tokens(
                tokens, lora_name=lora, cache_salt=salt, prompt_tokens=prompt_tokens, skip_blocks=local_blocks
            )
        answer, decision = offload.explain_lookup(
            tokens, lora_name=lora, cache_salt=salt, prompt_tokens=prompt_tokens, skip_blocks=local_blocks
        )
        self.request_log.lookup(tokens, prompt_tokens, local_blocks * bs, answer, decision, hinted)
        return answer

    def _log_load(self, spec: LoadSpec, planned_blocks: int, by_tier: dict[str, int], ok: bool) -> None:
        if self.request_log is not None and spec.log_key is not None:
            bs = self.settings.block_size
            self.request_log.load(spec.log_key, spec.req_id, spec.skip_blocks * bs, planned_blocks * bs, by_tier, ok)

    # ---- one step --------------------------------------------------------------------------------
    def start_load(self, meta: FlexKVMetadata) -> None:
        if self.tp_rank == 0:  # every rank gets the plan; vLLM sums the ranks' step stats
            self.prompt_tokens += meta.prompt_tokens
        offload = self.offload
        if offload is None:
            return
        # Handovers first: this step's forward waits for them, and the stores queued below would
        # share the CPU with the read (measured in bench disagg --vllm on one core per engine: the
        # previous request's store starting first added 10-20 ms to a 0.4 ms read).
        for spec in meta.loads:
            if spec.handover is not None:
                self._pull(spec)
        self._note_weights(meta.step)
        for save in meta.saves:
            if save.after_load and save.req_id in self._ahead:  # released once its load ended
                self._release_after_load.add(save.req_id)
                continue
            if save.block_ids and self._weights_since_step and save.first_step < self._weights_since_step:
                # Computed (in part) before the weights changed, perhaps stored under the new key (an
                # adapter's files written over before the hot-swap): only the blocks' release.
                self.stale_saves += 1
                self._saved.add(save.req_id)
                continue
            if not save.block_ids or not self._stores:  # nothing to store (dropped by a reset, or another
                # rank stores the shared copy): only the blocks' release
                self._saved.add(save.req_id)
                continue
            try:
                self._alias(save.token_ids, save.event_hashes, save.lora_name, save.cache_salt)
                if self.tiers is not None and save.groups:
                    self._stored_groups[save.req_id] = save.groups
                    started = self.tiers.store(
                        save.token_ids,
                        save.groups,
                        save.req_id,
                        save.lora_name,
                        save.cache_salt,
                        save.event_hashes or None,
                    )
                else:
                    tid = offload.store(
                        save.token_ids,
                        save.block_ids,
                        key=save.req_id,
                        lora_name=save.lora_name,
                        cache_salt=save.cache_salt,
                        names=save.event_hashes or None,
                    )
                    started = 0 if tid is None else 1  # None: a tier fault, nothing held
                if started:
                    self._saving[save.req_id] = self._saving.get(save.req_id, 0) + started
                else:
                    self._saved.add(save.req_id)
            except Exception:  # a store that cannot start frees its blocks at once
                log.exception("FlexKVConnector: storing request %s failed; its blocks are released", save.req_id)
                self._saved.add(save.req_id)
        if self.handover is not None:
            self._digest_after = list(meta.digests)
            for rid, expires in meta.holds:
                self.handover.hold(rid, expires)
                self._saving[rid] = self._saving.get(rid, 0) + 1
        for spec in meta.loads:
            if spec.groups and self.tiers is not None:
                self._start_ahead(spec, self.tiers)
            elif spec.handover is None:
                self._start(spec)
        if not self.settings.layerwise:
            for ld in self._loads.values():  # bulk: the whole load lands before the forward
                self._wait(ld, None)

    def _alias(self, tokens, event_hashes, lora: str | None, salt: str | None) -> None:
        """Our tier events name these blocks as vLLM's device events do."""
        if self.events is not None and event_hashes:
            hashes = self._registered("alias").block_hashes(tokens, lora_name=lora, cache_salt=salt)
            self.events.alias(hashes, event_hashes)

    def _start(self, spec: LoadSpec) -> None:
        offload = self._registered("load")
        if not self._weights_current():  # looked up before a weight update: recomputed
            self._fail(spec, 0)
            self._log_load(spec, 0, {}, False)
            return
        try:
            self._alias(spec.token_ids, spec.event_hashes, spec.lora_name, spec.cache_salt)
            tid = offload.load(
                spec.token_ids, spec.block_ids, spec.skip_blocks, lora_name=spec.lora_name, cache_salt=spec.cache_salt
            )
        except Exception as e:  # noqa: BLE001 - e.g. TooManyTasks: recompute instead
            log.warning("FlexKVConnector: load for request %s could not start (%s); recomputing", spec.req_id, e)
            tid = None
        if tid is None:
            self._fail(spec, 0)
            self._log_load(spec, 0, {}, False)
            return
        planned = offload.planned_tokens(tid) // self.settings.block_size
        if planned < spec.num_blocks:  # evicted since the lookup: the rest is recomputed
            self._fail(spec, planned)
        self._loads[spec.req_id] = _Load(tid, spec, planned, offload.planned_tokens_by_tier(tid))

    def _start_ahead(self, spec: LoadSpec, tiers: GroupTiers) -> None:
        """A hybrid model's load: every group's part, ahead of the request's first step (vLLM
        waits for finished_loads); a part that cannot start fails the whole request, which vLLM
        then computes."""
        if not self._weights_current():  # looked up before a weight update: computed
            self._ahead_failed.add(spec.req_id)
            self.counters.recomputed += spec.num_blocks * self.settings.block_size
            return
        self._alias(spec.token_ids, spec.event_hashes, spec.lora_name, spec.cache_salt)
        try:
            parts = tiers.load(spec.token_ids, spec.groups, spec.skip_blocks, spec.lora_name, spec.cache_salt)
        except Exception as e:  # noqa: BLE001 - e.g. TooManyTasks: computed instead
            log.warning("FlexKVConnector: load for request %s could not start (%s); recomputing", spec.req_id, e)
            parts = None
        if parts is None:
            self._ahead_failed.add(spec.req_id)
            self.counters.recomputed += spec.num_blocks * self.settings.block_size
            return
        off, tid = parts[0]  # the main group's (or the first part's) tiers say where the prefix came from
        self._ahead[spec.req_id] = (spec, parts, off.planned_tokens_by_tier(tid))

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Loads run ahead (hybrid models) that ended since the last call: (every part landed,
        some part failed). A failed one is computed from its first token by vLLM."""
        done, failed = set(), self._ahead_failed
        self._ahead_failed = set()
        for rid, (spec, parts, by_tier) in list(self._ahead.items()):
            if not all(off.load_done(tid) for off, tid in parts):
                continue
            del self._ahead[rid]
            ok = all([off.finish(tid).ok for off, tid in parts])
            if rid in self._release_after_load:  # the request ended meanwhile: vLLM frees its blocks now
                self._release_after_load.discard(rid)
                self._saved.add(rid)
            self.transfer_log.append(
                TransferRecord("load", rid, spec.block_ids[spec.skip_blocks :], ok, groups=spec.groups)
            )
            if ok:
                done.add(rid)
                for tier, n in by_tier.items():
                    self.counters.loaded[tier] = self.counters.loaded.get(tier, 0) + n
            else:
                failed.add(rid)
                self.counters.failed_loads += 1
                self.counters.recomputed += spec.num_blocks * self.settings.block_size
        return done | failed, failed

    def _pull(self, spec: LoadSpec) -> None:
        """A handed-over prompt: read from the prefill worker before this step's forward."""
        local = spec.block_ids[spec.skip_blocks :]
        if self.handover is None:
            self._fail(spec, 0)
            self.counters.handover_failures += 1
            return
        hashes = block_hashes(
            spec.token_ids, self.settings.block_size, lora_name=spec.lora_name, cache_salt=spec.cache_salt
        ).sequence
        r = self.handover.pull(spec.handover, spec.skip_blocks, local, self.settings.load_timeout_s, hashes)
        self.counters.handover_bytes += r.nbytes
        self.counters.handover_seconds += r.seconds
        if r.ok:
            self.counters.handovers_ok += 1
            self.counters.handover_tokens += len(local) * self.settings.block_size
        else:
            self.counters.handover_failures += 1
            self.counters.handover_corrupt += r.why == "corrupt"
            self._fail(spec, 0)
        self.transfer_log.append(
            TransferRecord("handover", spec.req_id, list(local), r.ok, r.seconds, r.nbytes, r.verify_seconds)
        )

    def _fail(self, spec: LoadSpec, from_block: int) -> None:
        """Blocks [skip + from_block, ...) of ``spec`` are not loaded: vLLM recomputes them."""
        bad = set(spec.block_ids[spec.skip_blocks + from_block :]) - self._errors
        self._errors |= bad
        self.counters.recomputed += len(bad) * self.settings.block_size

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layer.get(layer_name)
        if layer is None:
            return
        for ld in self._loads.values():
            self._wait(ld, layer)

    def _wait(self, ld: _Load, layer: int | None) -> None:
        """Waits for one layer of a load (None: every layer)."""
        if ld.failed:
            return
        offload = self._registered("wait_for_layer_load")
        try:
            for i in range(offload.num_layers) if layer is None else (layer,):
                if not offload.wait_layer(ld.tid, i, self.settings.load_timeout_s):
                    log.warning(
                        "FlexKVConnector: load for request %s still not on the device after %.0f s; "
                        "cancelling it and recomputing",
                        ld.spec.req_id,
                        self.settings.load_timeout_s,
                    )
                    offload.cancel_load(ld.tid, ())  # the request keeps its blocks; end_step collects it
                    raise TaskFailed("timed out")
        except TaskFailed:
            ld.failed = True
            self._fail(ld.spec, 0)

    def begin_step(self) -> None:
        if self.clock is not None:
            self.clock.begin()

    def end_step(self, meta: FlexKVMetadata | None = None) -> None:
        """Collects this step's loads: after this no copy writes vLLM's blocks. Digests the
        handover blocks whose last bytes this step's forward wrote. Times a step that only
        prefilled and loaded nothing, for the cost model."""
        if self.clock is not None:
            self.clock.end(meta.prefill if meta is not None and not meta.loads else None)
            for step in self.clock.take():
                self._registered("wait_for_save").observe_prefill(step.tokens, step.prompt_tokens, step.seconds)
        if self.handover is not None:  # start_load queues digests only for a worker with a handover agent
            for req_id, blocks, hashes in self._digest_after:
                self.handover.digest(req_id, blocks, hashes)
        self._digest_after = []
        if self.handover is not None:
            self.handover.send_releases()
        for ld in self._loads.values():
            result = self._registered("wait_for_save").finish(ld.tid)
            if not result.ok and not ld.failed:
                ld.failed = True
                self._fail(ld.spec, 0)
            spec = ld.spec
            self.transfer_log.append(
                TransferRecord(
                    "load", spec.req_id, spec.block_ids[spec.skip_blocks :][: ld.planned_blocks], not ld.failed
                )
            )
            if ld.failed:
                self.counters.failed_loads += 1
            else:
                for tier, n in ld.by_tier.items():
                    self.counters.loaded[tier] = self.counters.loaded.get(tier, 0) + n
            self._log_load(spec, ld.planned_blocks, ld.by_tier, not ld.failed)
        self._loads.clear()

    def take_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose stored blocks vLLM may free now. vLLM accepts only ids it already listed
        as finished, so a store that ends earlier waits for that."""
        if self.handover is not None:
            for rid in self.handover.finished():  # decode released the blocks, or their lease ended
                left = self._saving.get(rid, 0) - 1
                if left > 0:
                    self._saving[rid] = left
                else:
                    self._saving.pop(rid, None)
                    self._saved.add(rid)
        for off in self._offloads():
            main = off is self.offload
            for hold in off.finished_holds():
                if main:  # the main group's blocks are the request's (a hybrid model's others are extra)
                    self.transfer_log.append(
                        TransferRecord(
                            "store", hold.key, hold.blocks, True, groups=self._stored_groups.pop(hold.key, {})
                        )
                    )
                    self.stored_tokens += len(hold.blocks) * self.settings.block_size
                left = self._saving.get(hold.key, 0) - 1
                if left > 0:
                    self._saving[hold.key] = left
                else:
                    self._saving.pop(hold.key, None)
                    self._saved.add(hold.key)
        # Only ids with a store of ours: vLLM lists every finished request here.
        self._finished_seen |= finished_req_ids & (self._saved | set(self._saving) | self._release_after_load)
        done = self._saved & self._finished_seen
        self._saved -= done
        self._finished_seen -= done
        for rid in done:
            self._stored_groups.pop(rid, None)
        return done

    def _offloads(self) -> list[EngineOffload]:
        return [off for off in (self.offload, self.aux) if off is not None]

    def take_events(self) -> FlexKVEvents | None:
        return self.events.take() if self.events is not None else None

    def tier_files(self) -> list[str]:
        """The disk tier's data files this process owns (for operators and fault tests)."""
        return [f for off in self._offloads() for f in off.tier_files()]

    def drain(self, timeout: float | None = None) -> bool:
        """Waits for the stores' background writes (disk, remote); False if some still run."""
        return all([off.drain(timeout) for off in self._offloads()])

    def stats(self) -> ManagerStats | None:
        return self.offload.stats() if self.offload is not None else None

    def _registered(self, what: str) -> EngineOffload:
        if self.offload is None:
            raise RuntimeError(f"{what}: this worker registered no KV caches yet (vLLM calls register_kv_caches first)")
        return self.offload

    def evict_host(self, timeout: float | None = None) -> int:
        """Evicts every host block once the writes below finished (the disk and remote copies
        stay); returns how many went (a hybrid model's other groups' too)."""
        self._registered("evict_host")
        return sum(off.evict_host(timeout) for off in self._offloads())

    def reset_tiers(self, timeout: float | None = None) -> bool:
        """Drops every host and disk block once the writes finished; False when a remote tier,
        shared with other workers, keeps its copies."""
        self._registered("reset_tiers")
        return all([off.reset_tiers(timeout) for off in self._offloads()])

    def _reset_for_scheduler(self) -> bool:
        """The scheduler's reset_cache: host and disk dropped once the writes finished. False with
        a remote tier, which keeps the old blocks for every worker sharing it."""
        if not self.reset_tiers(self.settings.drain_timeout_s):
            log.warning(
                "FlexKVConnector: host and disk tiers reset; the remote tier %s keeps its blocks (shared "
                "with other workers): after a weight update give the new weights a new model_id",
                self._registered("reset_cache").describe().get("remote"),
            )
            return False
        log.info("FlexKVConnector: host and disk tiers reset (reset_prefix_cache)")
        return True

    def cache_admin(self, body: bytes) -> bytes:
        """An operator's request (dynamo-flexkv cache --vllm, core/inventory.py) over this rank's
        tiers (a hybrid model's other groups' too), as JSON. vLLM's own device cache is vLLM's:
        Dynamo's clear_kv_blocks clears it (and, through reset_cache, these tiers)."""
        try:
            req = parse_request(msgspec.json.decode(body or b"{}"))
            if req.tiers and "device" in req.tiers:
                raise BadCacheRequest(VLLM_DEVICE)
            if req.op == "prefix" and req.tokens is None:
                raise BadCacheRequest(
                    "a vLLM worker tokenizes no text here: send token ids, or tokenize the text on your side "
                    "(--text with --tokenizer MODEL_DIR)"
                )
            main = self._registered("cache")
            described = main.describe()
            have = [t for t, n in (described.get("tiers") or {}).items() if n]
            req.check(have + (["remote"] if described.get("remote") else []))
            mode = described.get("mode", "embedded")
            report = main.cache_admin(req)
            if self.aux is not None:  # a hybrid model's sliding-window groups: tiers of their own
                more = self.aux.cache_admin(req)
                report.contents += more.contents
                report.prefixes += more.prefixes
                report.cleared += more.cleared
            report.target = f"vLLM worker {self.settings.engine_id} rank {self.tp_rank} ({mode})"
            answer: dict[str, Any] = {"status": "ok", "report": to_builtins(report)}
        except (ValueError, RuntimeError, FlexKVError) as e:
            answer = {"status": "error", "message": str(e)}
        out: bytes = msgspec.json.encode(answer)
        return out

    # ---- weight updates (weights.py) ------------------------------------------------------------------
    def _watch_weights(self) -> None:
        """Notices the weight updates vLLM runs in this process and tells the tiers at once."""
        self.weights.on_change(self._tell_weights)
        self.weights.attach_from_caller()  # the runner calling register_kv_caches

    def _note_weights(self, step: int) -> None:
        """Weight updates run between steps (vLLM's collective calls) or in a step's preparation (a
        LoRA adapter loaded for it): the first step that sees new weights is where they start."""
        version = self.weights.version()
        if version != self._step_weights:
            self._step_weights, self._weights_since_step = version, step
            log.info("FlexKVConnector: weights %r from step %d: earlier requests' KV is not stored", version, step)

    def _weights_current(self) -> bool:
        """Whether the tiers were told of the weights loaded now (tells them where not yet); False
        where telling failed: nothing is looked up or loaded then, the next call tries again."""
        version = self.weights.version()
        if version == self._weights_told:
            return True
        try:
            return self._tell_weights(version)
        except Exception:  # a miss now, told at the next lookup or load
            log.exception("FlexKVConnector: telling the tiers of the weight change failed; treated as a miss")
            return False

    def _tell_weights(self, version: str) -> bool:
        with self._weights_lock:
            if version != self._weights_told:
                dropped = sum(off.weights_changed(version) for off in self._offloads())
                log.info("FlexKVConnector: tiers told of weights %r; %d old blocks dropped", version, dropped)
                self._weights_told = version
        return True

    def step_stats(self) -> dict[str, Any]:
        """Counter deltas since the last call, and the tiers' gauges at most once a second
        (vllm_connector/metrics.py names them)."""
        if self.offload is None:
            return {}
        c = self.counters
        totals: dict[str, float] = {
            "recomputed_tokens": c.recomputed,
            "failed_loads": c.failed_loads,
            "tier_faults": self.offload.tier_faults,
            "stored_tokens": self.stored_tokens,
            "prompt_tokens": self.prompt_tokens,
            "handover_tokens": c.handover_tokens,
            "handover_bytes": c.handover_bytes,
            "handover_seconds": c.handover_seconds,
            "handovers/ok": c.handovers_ok,
            "handovers/failed": c.handover_failures,
            "handover_corrupt": c.handover_corrupt,
        }
        totals.update({f"prompt_tokens_cached/{t}": n for t, n in self.counters.loaded.items()})
        out: dict[str, Any] = {}
        if self.hints is not None:
            totals.update(self.hints.totals())
            out.update(self.hints.gauges())
        now = time.monotonic()
        st = self.offload.stats() if now - self._gauges_at >= 1.0 else None
        if st is not None:  # node mode: None while the service is away
            self._gauges_at = now
            for tier, ts in st.tiers.items():
                for state in ("capacity", "used", "ready"):
                    out[f"gauge:pool_blocks/{tier}/{state}"] = getattr(ts, f"{state}_blocks")
                totals[f"hit_blocks/{tier}"] = ts.hit_blocks
                totals[f"stored_blocks/{tier}"] = ts.stored_blocks
                totals[f"evicted_blocks/{tier}"] = ts.evicted_blocks
                totals.update({f"removed_blocks/{tier}/{why}": n for why, n in ts.removed_blocks.items()})
            totals["disk_write_failures"] = st.tasks.disk_write_failures
            totals["put_refused_blocks"] = st.tasks.put_refused_blocks
            out["gauge:tasks_in_flight"] = st.tasks.in_flight
            totals.update(prefix_token_totals(st))  # the load policy's decisions (cost-aware loading)
        for k, total in totals.items():
            if not rank_reports(k, self.tp_rank):
                continue
            delta = total - self._reported.get(k, 0)
            if delta < 0:  # the totals started again (a restarted node service): all of it is new
                delta = total
            if delta:
                out[k] = delta
            self._reported[k] = total  # a restart seen at 0 too: what comes after it is new
        return out

    def shutdown(self) -> None:
        if self.server is not None:  # first: a hinted lookup's pull still running ends with it
            self.server.close()
            self.server = None
        if self.hints is not None:  # before the tiers: its pins and agent are over their host memory
            self.hints.close()
            self.hints = None
        if self.handover is not None:
            self.handover.close()
            self.handover = None
        if self.request_log is not None:
            self.request_log.close()
            self.request_log = None
        if self.offload is not None:
            if not self.drain(timeout=self.settings.drain_timeout_s):
                log.warning(
                    "FlexKVConnector: offload writes still running after %.0f s at shutdown; cancelled",
                    self.settings.drain_timeout_s,
                )
            for _, parts, _ in self._ahead.values():  # loads run ahead of requests that never ran
                for off, tid in parts:
                    off.cancel_load(tid, ())
            self._ahead.clear()
            self._close_offloads()
