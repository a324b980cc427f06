"""How the reference engine talks to KVManager, the way an engine's KV connector does.

Admission: after the engine's own prefix cache, ask the offload tiers for the rest of the prompt
and load it into the request's new device blocks (layerwise: each layer's attention waits only
for that layer). A waiting request prefetches its disk part into host memory. Computed prompt
blocks are put back once the prefill finished; the blocks stay referenced until the device copy
is done.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from dynamo_flexkv.layout import KVLayoutType
from dynamo_flexkv.manager import KVManager
from dynamo_flexkv.tasks import TaskResult, TaskStatus


class OffloadConnector:
    def __init__(self, kv: KVManager, layerwise: bool = True) -> None:
        self.kv = kv
        self.layerwise = layerwise
        self.bs = kv.tokens_per_block
        # Task -> device blocks it still touches: a put reads them until its device copy is done,
        # a cancelled load may still write them until its copies in flight drained.
        self._holds: Dict[int, List[int]] = {}
        self._prefetches: List[int] = []
        self.failed_loads = 0

    def register(self, layers) -> None:
        self.kv.register_device_cache(layers, KVLayoutType.LAYERBLOCK)

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        return max(self.kv.match(tokens).values(), default=0) // self.bs

    def load(self, tokens: Sequence[int], block_table: Sequence[int], skip_blocks: int) -> Optional[int]:
        """Starts loading blocks [skip_blocks, ...) of ``tokens`` (full blocks only). Returns the
        task and the tokens it will load, or None when nothing beyond skip_blocks is cached."""
        tid = self.kv.get_async(list(tokens), list(block_table), skip_blocks=skip_blocks, layerwise=self.layerwise)
        if self.kv.planned_tokens(tid) == 0:
            self.kv.wait([tid])
            return None
        return tid

    def planned_tokens_by_tier(self, tid: int) -> Dict[str, int]:
        return self.kv.planned_tokens_by_tier(tid)

    def wait_layer(self, tid: int, layer: int) -> None:
        self.kv.wait_for_layer(tid, layer)  # raises TaskFailed: the step recomputes

    def cancel_load(self, tid: int, blocks: Sequence[int]) -> None:
        """Cancels a load; ``blocks`` come back from finished_holds() once no copy writes them."""
        self.kv.cancel([tid])
        self._holds[tid] = list(blocks)

    def finish(self, tid: int) -> TaskResult:
        r = self.kv.wait([tid])[tid]
        if r.status is not TaskStatus.SUCCESS:
            self.failed_loads += 1
        return r

    def prefetch(self, tokens: Sequence[int]) -> int:
        tid = self.kv.prefetch_async(list(tokens))
        self._prefetches.append(tid)
        return tid

    def cancel_prefetch(self, tid: int) -> None:
        if tid in self._prefetches:  # not collected yet (a finished one needs no cancel)
            self.kv.cancel([tid])

    def store(self, tokens: Sequence[int], block_table: Sequence[int]) -> int:
        n = len(tokens) // self.bs
        tid = self.kv.put_async(list(tokens[: n * self.bs]), list(block_table[:n]))
        self._holds[tid] = list(block_table[:n])
        return tid

    @property
    def tasks_pending(self) -> int:
        """Tasks whose results the connector still has to collect."""
        return len(self._holds) + len(self._prefetches)

    def finished_holds(self) -> List[List[int]]:
        """Device blocks of puts whose device copy is done and of cancelled loads that drained (the
        engine may release them). Also collects finished prefetches, whose results nobody waits for."""
        if self._prefetches:
            done = self.kv.try_wait(self._prefetches)
            self._prefetches = [t for t in self._prefetches if t not in done]
        if not self._holds:
            return []
        done = self.kv.try_wait(list(self._holds))
        return [self._holds.pop(t) for t in done]

    def drain_holds(self) -> List[List[int]]:
        self.kv.wait(self._prefetches)
        self._prefetches = []
        done = self.kv.wait(list(self._holds))
        return [self._holds.pop(t) for t in done]
