"""The engine contract of dynamo_flexkv (docs/ENGINE_CONTRACT.md): ``EngineOffload`` (defined in
core/contract.py, re-exported here with ``Hold``) and its embedded implementation.

An engine's KV connector reaches the offload tiers only through that class. ``open_offload`` picks
the implementation from the config's ``mode``: ``EmbeddedOffload`` (the engine process owns its
tiers, a KVManager) or ``NodeOffload`` (core/node/client.py: the node's cache service owns them and
every engine and rank on the node shares them). Its clients are the reference engine
(integrations/reference_engine/llm.py) and the vLLM connector (integrations/vllm_connector/). The
calls follow one request's life:

* ``register(tensors, layout)`` once, with the engine's paged KV tensors;
* ``cached_tokens(tokens)``: the prefix the tiers hold that the load policy would load (the
  decision is counted, nothing else changes);
* ``load(tokens, block_table, skip_blocks, prompt_tokens=...)`` starts copying blocks
  ``[skip_blocks, ...)`` into the request's device blocks (with ``prompt_tokens``, only as far as
  the load policy decides: ``planned_tokens`` says how far); ``wait_layer(task, i)`` before layer
  i's attention (layerwise), then ``finish(task)``; a failed load raises ``TaskFailed`` from
  ``wait_layer`` (recompute instead);
* ``store(tokens, block_table, key)`` copies the computed full blocks out; the engine keeps the
  device blocks until ``finished_holds()`` hands them back (with ``key``), so it may reuse them
  while the slower tier writes continue in the background;
* ``prefetch(tokens)`` warms host memory from disk for a request that still waits;
* ``observe_prefill(tokens, prompt_tokens, seconds)`` after each step that only prefilled: the
  cost-aware load policy compares loads with this measured prefill time (core/cost.py);
* ``open_peer_link(secret, host, port, lease_s)``: router hints' pulls between engines (embedded);
* administration: ``stats``, ``drain``, ``evict_host``, ``reset_tiers``, ``cache_admin``, ``describe``,
  ``tier_files``, ``announce_adopted``, ``shutdown``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.contract import (
    EngineOffload,
    Hold,
    IndexListener,
    miss_explained_on_tier_fault,
    miss_lookup_on_tier_fault,
    no_task_on_tier_fault,
)
from dynamo_flexkv.core.inventory import CacheReport, CacheRequest, answer
from dynamo_flexkv.core.layout import KVLayoutType, ModelSpec
from dynamo_flexkv.core.manager import KVManager
from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.core.tasks import TaskResult, TaskStatus
from dynamo_flexkv.core.transfer.runner import MoverHook

if TYPE_CHECKING:
    from dynamo_flexkv.core.peer.link import PeerLink

__all__ = ["EngineOffload", "Hold", "EmbeddedOffload", "open_offload"]


class EmbeddedOffload(EngineOffload):
    """The tiers in this process: a KVManager of this engine's own."""

    def __init__(self, kv: KVManager, layerwise: bool = True) -> None:
        self.kv = kv
        self.layerwise = layerwise
        self.bs = kv.tokens_per_block
        self.num_layers = kv.model.num_layers
        # Task -> (key, device blocks it still touches): a put reads them until its device copy is
        # done, a cancelled load may still write them until its copies in flight drained.
        self._holds: dict[int, Hold] = {}
        self._prefetches: list[int] = []
        self.failed_loads = 0

    def register(self, layers: Any, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        self.kv.register_device_cache(layers, layout)

    @miss_lookup_on_tier_fault
    def cached_tokens(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> int:
        return self.kv.loadable_tokens(
            tokens,
            layerwise=self.layerwise,
            lora_name=lora_name,
            cache_salt=cache_salt,
            prompt_tokens=prompt_tokens,
            skip_blocks=skip_blocks,
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
        d = self.kv.lookup_decision(
            tokens,
            layerwise=self.layerwise,
            lora_name=lora_name,
            cache_salt=cache_salt,
            prompt_tokens=prompt_tokens,
            skip_blocks=skip_blocks,
        )
        return d.end * self.bs, d.explain(self.bs)

    def block_hashes(
        self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        return [int(h) for h in self.kv.hashes(tokens, lora_name=lora_name, cache_salt=cache_salt).sequence]

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
        tid = self.kv.get_async(
            list(tokens),
            list(block_table),
            skip_blocks=skip_blocks,
            layerwise=self.layerwise,
            lora_name=lora_name,
            cache_salt=cache_salt,
            prompt_tokens=prompt_tokens,
        )
        if self.kv.planned_tokens(tid) == 0:
            self.kv.wait([tid])
            return None
        return tid

    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        self.kv.observe_prefill(tokens, prompt_tokens, seconds)

    def planned_tokens(self, tid: int) -> int:
        return self.kv.planned_tokens(tid)

    def planned_tokens_by_tier(self, tid: int) -> dict[str, int]:
        return self.kv.planned_tokens_by_tier(tid)

    def wait_layer(self, tid: int, layer: int, timeout: float | None = None) -> bool:
        return self.kv.wait_for_layer(tid, layer, timeout)

    def cancel_load(self, tid: int, blocks: Sequence[int], key: Any = None) -> None:
        self.kv.cancel([tid])
        if blocks:
            self._holds[tid] = Hold(key, list(blocks))

    def load_done(self, tid: int) -> bool:
        return self.kv.done(tid)

    def finish(self, tid: int) -> TaskResult:
        r = self.kv.wait([tid])[tid]
        if r.status is not TaskStatus.SUCCESS:
            self.failed_loads += 1
        return r

    @no_task_on_tier_fault
    def prefetch(self, tokens: Sequence[int]) -> int | None:
        tid = self.kv.prefetch_async(list(tokens))
        self._prefetches.append(tid)
        return tid

    def cancel_prefetch(self, tid: int) -> None:
        if tid in self._prefetches:  # not collected yet (a finished one needs no cancel)
            self.kv.cancel([tid])

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
        tid = self.kv.put_async(
            list(tokens[: n * self.bs]), list(block_table[:n]), lora_name=lora_name, cache_salt=cache_salt
        )
        self._holds[tid] = Hold(key, list(block_table[:n]))
        return tid

    @property
    def tasks_pending(self) -> int:
        return len(self._holds) + len(self._prefetches)

    def finished_holds(self) -> list[Hold]:
        if self._prefetches:
            done = self.kv.try_wait(self._prefetches)
            self._prefetches = [t for t in self._prefetches if t not in done]
        if not self._holds:
            return []
        done = self.kv.try_wait(list(self._holds))
        return [self._holds.pop(t) for t in done]

    def drain_holds(self) -> list[Hold]:
        self.kv.wait(self._prefetches)
        self._prefetches = []
        done = self.kv.wait(list(self._holds))
        return [self._holds.pop(t) for t in done]

    def stats(self) -> ManagerStats | None:
        return self.kv.stats()

    def drain(self, timeout: float | None = None) -> bool:
        return self.kv.drain(timeout)

    def _idle(self, what: str, timeout: float | None) -> KVManager:
        if not self.kv.drain(timeout):
            raise RuntimeError(
                f"{what}: tier writes still running after {timeout} s; call it again when the engine is idle"
            )
        return self.kv

    def evict_host(self, timeout: float | None = None) -> int:
        return self._idle("evict_host", timeout).evict("host")

    def reset_tiers(self, timeout: float | None = None) -> bool:
        self._idle("reset_tiers", timeout).reset()
        return self.kv.remote is None

    def weights_changed(self, version: str) -> int:
        return self.kv.weights_changed(version)

    def cache_admin(self, req: CacheRequest) -> CacheReport:
        report = CacheReport("embedded", req.op)
        answer(self.kv, req, report)
        return report

    def describe(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "mode": "embedded",
            "host_block_bytes": kv.host.layout.block_bytes,
            "tiers": kv.config.tier_blocks(kv.model),
            "ssd_dirs": list(kv.ssd.dirs) if kv.ssd else [],
            "remote": kv.remote.config.redacted_url if kv.remote else None,
        }

    def tier_files(self) -> list[str]:
        import os

        from dynamo_flexkv.core.storage.ssd import DATA

        return [os.path.join(d, DATA) for d in self.kv.ssd.dirs] if self.kv.ssd else []

    def announce_adopted(self, repeat: bool = False) -> int:
        return self.kv.announce_adopted(repeat)

    def open_peer_link(self, secret: bytes | None, host: str, port: int, lease_s: float) -> PeerLink:
        from dynamo_flexkv.core.peer import PeerLink, SourceLimits  # NIXL: only a worker with hints loads it

        return PeerLink(self.kv, secret, host, port, SourceLimits(lease_s=lease_s))

    def shutdown(self) -> None:
        self.kv.shutdown()


def open_offload(
    model: ModelSpec,
    config: CacheConfig,
    *,
    layerwise: bool = True,
    listener: IndexListener | None = None,
    model_id: str = "",
    engine: str = "",
    namespace: str | None = None,
    rank: int = 0,
    ranks: int = 1,
    replicated: bool = False,
    mover_hook: MoverHook | None = None,
) -> EngineOffload:
    """The engine's offload, as the config's ``mode`` says: ``embedded``, tiers of this process
    (``model_id`` keys its disk and remote tiers, ``mover_hook`` wraps its copy links); ``node``,
    the node's cache service at ``node_socket``, shared with the other engines that present the
    same ``model_id``, KV shape and ``namespace`` (the tenant), ``engine`` naming this one, each of
    ``ranks`` tensor-parallel ranks its own shard (``replicated``: every rank the same bytes, one
    namespace for all of them)."""
    if config.mode == "node":  # ``mover_hook`` wraps the device copies, the links this engine drives
        from dynamo_flexkv.core.node.client import NodeOffload

        return NodeOffload(
            model,
            config,
            layerwise=layerwise,
            listener=listener,
            model_id=model_id,
            engine=engine,
            tenant=namespace or "",
            rank=rank,
            ranks=ranks,
            replicated=replicated,
            mover_hook=mover_hook,
        )
    kv = KVManager(model, config, namespace=namespace, listener=listener, model_id=model_id, mover_hook=mover_hook)
    return EmbeddedOffload(kv, layerwise=layerwise)
