"""The offload tiers' KV events, as vLLM KV events.

The worker's KVManager reports each commit and removal (IndexListener); they queue here and
leave with the step's output (``get_kv_connector_kv_cache_events``), and the scheduler half
hands them to vLLM's own publisher (``take_events``), which Dynamo's vLLM worker relays to the
router. So vLLM's device events and ours travel one socket, in order. Media are the ones
Dynamo's router counts per tier (docs/WIRE_FORMATS.md): ``CPU_PINNED`` host, ``DISK`` disk.
Like the reference worker's relay, a Stored whose parent the router was never told about and a
Removed of a block it does not know are not sent (``skipped``)."""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents, KVEventAggregator

from dynamo_flexkv.core.contract import Tier, TierRun
from dynamo_flexkv.integrations.events import MEDIUM, signed_hash


class FlexKVEvents(KVConnectorKVEvents):
    """One step's events of one worker (vLLM merges the workers' ones)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)
        if events:
            self._agg.add_events(events)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> FlexKVEvents:
        return self  # only rank 0 publishes: every event counts once

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()


class TierEventQueue:
    """IndexListener: queues the tiers' commits and removals as vLLM events (thread-safe: the
    transfer threads commit)."""

    def __init__(self, block_size: int, group_idx: int | None = None, kind: str | None = None) -> None:
        self.block_size = block_size
        # A hybrid model's events are its main group's (hybrid.py): named so, as vLLM names its own,
        # for Dynamo's router, which reads the main attention group only.
        self.group_idx, self.kind = group_idx, kind
        self._lock = threading.Lock()
        self._events: list[KVCacheEvent] = []
        self._known: dict[str | None, set[Any]] = {}  # medium (MEDIUM's) -> blocks announced and not removed
        # Our sequence hash -> vLLM's external hash of the same block (alias()): the router must see
        # one name per block across tiers. Blocks without one (re-adopted after a restart) keep ours.
        self._alias: dict[int, Any] = {}
        self.skipped = 0

    def alias(self, ours: list[int], vllm_hashes: list[Any]) -> None:
        """Names blocks ``ours`` (our sequence hashes) by vLLM's hashes in later events."""
        if len(ours) != len(vllm_hashes):
            return
        with self._lock:
            for o, v in zip(ours, vllm_hashes):
                self._alias[int(o)] = v

    def _name(self, h: int) -> Any:
        return self._alias.get(h, signed_hash(h))

    def _forget(self, h: int, name: Any) -> None:
        if not any(name in known for known in self._known.values()):
            self._alias.pop(h, None)

    def on_stored(self, tier: Tier, run: TierRun) -> None:
        if run.token_ids is None:
            return  # e.g. re-adopted disk blocks journaled without tokens: they cannot be named
        medium = MEDIUM[tier]
        with self._lock:
            hashes = [self._name(int(h)) for h in run.hashes]
            parent = None if run.parent is None else self._name(int(run.parent))
            known = self._known.setdefault(medium, set())
            if parent is not None and parent not in known:
                self.skipped += 1
                return
            known.update(hashes)
            self._events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=[int(t) for t in run.token_ids],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=self.group_idx,
                    kv_cache_spec_kind=self.kind,
                )
            )

    def on_removed(self, tier: Tier, hashes: list[int]) -> None:
        medium = MEDIUM[tier]
        with self._lock:
            known = self._known.setdefault(medium, set())
            named = [(int(h), self._name(int(h))) for h in hashes]
            gone = [name for _, name in named if name in known]
            self.skipped += len(hashes) - len(gone)
            known.difference_update(gone)
            for h, name in named:
                self._forget(h, name)
            if gone:
                self._events.append(BlockRemoved(block_hashes=gone, medium=medium, group_idx=self.group_idx))

    @property
    def named_blocks(self) -> int:
        """Blocks whose events carry vLLM's hash (alias()) and that some tier still holds."""
        with self._lock:
            return len(self._alias)

    def known_blocks(self, tier: Tier) -> int:
        with self._lock:
            return len(self._known.get(MEDIUM[tier], ()))

    def take(self) -> FlexKVEvents | None:
        with self._lock:
            events, self._events = self._events, []
        return FlexKVEvents(events) if events else None
