"""EngineOffload: the engine-facing contract of dynamo_flexkv (docs/ENGINE_CONTRACT.md).

An engine's KV connector talks to the offload tiers only through this class, never through
KVManager internals. Its two clients are the reference engine (integrations/reference_engine/llm.py) and the vLLM
connector (vllm_connector/). The calls follow one request's life:

* ``register(tensors, layout)`` once, with the engine's paged KV tensors;
* ``cached_tokens(tokens)``: the prefix the tiers hold that the load policy would load (the
  decision is counted, nothing else changes);
* ``load(tokens, block_table, skip_blocks, prompt_tokens=...)`` starts copying blocks
  ``[skip_blocks, ...)`` into the request's device blocks (with ``prompt_tokens``, only as far as
  the load policy decides: ``planned_tokens`` says how far); ``wait_layer(task, i)`` before layer i's attention (layerwise), then
  ``finish(task)``; a failed load raises ``TaskFailed`` from ``wait_layer`` (recompute instead);
* ``store(tokens, block_table, key)`` copies the computed full blocks out; the engine keeps the
  device blocks until ``finished_holds()`` hands them back (with ``key``), so it may reuse them
  while the slower tier writes continue in the background;
* ``prefetch(tokens)`` warms host memory from disk for a request that still waits;
* ``observe_prefill(tokens, prompt_tokens, seconds)`` after each step that only prefilled: the
  cost-aware load policy compares loads with this measured prefill time (core/cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from dynamo_flexkv.core.layout import KVLayoutType
from dynamo_flexkv.core.manager import KVManager
from dynamo_flexkv.core.tasks import TaskResult, TaskStatus


@dataclass(frozen=True)
class Hold:
    """Device blocks an offload copy no longer touches: the engine may release or reuse them."""
    key: Any  # what the engine passed to store() / cancel_load(), e.g. its request id
    blocks: List[int]


class EngineOffload:
    def __init__(self, kv: KVManager, layerwise: bool = True) -> None:
        self.kv = kv
        self.layerwise = layerwise
        self.bs = kv.tokens_per_block
        # Task -> (key, device blocks it still touches): a put reads them until its device copy is
        # done, a cancelled load may still write them until its copies in flight drained.
        self._holds: Dict[int, Hold] = {}
        self._prefetches: List[int] = []
        self.failed_loads = 0

    def register(self, layers, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        self.kv.register_device_cache(layers, layout)

    def cached_tokens(self, tokens: Sequence[int], *, lora_name: Optional[str] = None,
                      cache_salt: Optional[str] = None, prompt_tokens: Optional[int] = None,
                      skip_blocks: int = 0) -> int:
        """End of the cached prefix of ``tokens`` a load would bring back (whole blocks): what the
        tiers hold, as far as the load policy loads it (``tokens``: a prompt's full blocks;
        ``prompt_tokens``: the whole prompt's length, default one more than ``tokens``;
        ``skip_blocks``: blocks the engine holds already, the decision is about the rest)."""
        return self.kv.loadable_tokens(tokens, layerwise=self.layerwise, lora_name=lora_name, cache_salt=cache_salt,
                                       prompt_tokens=prompt_tokens, skip_blocks=skip_blocks)

    def block_hashes(self, tokens: Sequence[int], *, lora_name: Optional[str] = None,
                     cache_salt: Optional[str] = None) -> List[int]:
        """The sequence hash of each full block of ``tokens``: how the tiers (and their events) name
        the blocks."""
        return [int(h) for h in self.kv.hashes(tokens, lora_name=lora_name, cache_salt=cache_salt).sequence]

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        return self.cached_tokens(tokens) // self.bs

    def load(self, tokens: Sequence[int], block_table: Sequence[int], skip_blocks: int, *,
             lora_name: Optional[str] = None, cache_salt: Optional[str] = None,
             prompt_tokens: Optional[int] = None) -> Optional[int]:
        """Starts loading blocks [skip_blocks, ...) of ``tokens`` (full blocks only). Returns the
        task, or None when nothing beyond skip_blocks is cached or worth loading. With
        ``prompt_tokens`` (the whole prompt's length) the load policy decides how far to load;
        without, everything cached is (an engine that asked cached_tokens first)."""
        tid = self.kv.get_async(list(tokens), list(block_table), skip_blocks=skip_blocks, layerwise=self.layerwise,
                                lora_name=lora_name, cache_salt=cache_salt, prompt_tokens=prompt_tokens)
        if self.kv.planned_tokens(tid) == 0:
            self.kv.wait([tid])
            return None
        return tid

    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens of prompts up to ``prompt_tokens`` long in
        ``seconds`` (time blocked on loads excluded): the cost-aware load policy's measure of
        recompute."""
        self.kv.observe_prefill(tokens, prompt_tokens, seconds)

    def planned_tokens(self, tid: int) -> int:
        """Tokens the load brings if it succeeds (beyond skip_blocks), known when it starts."""
        return self.kv.planned_tokens(tid)

    def planned_tokens_by_tier(self, tid: int) -> Dict[str, int]:
        return self.kv.planned_tokens_by_tier(tid)

    def wait_layer(self, tid: int, layer: int, timeout: Optional[float] = None) -> bool:
        """Waits for layer ``layer`` of a load; False after ``timeout`` seconds. Raises TaskFailed
        when the load failed (the step recomputes what it would have loaded)."""
        return self.kv.wait_for_layer(tid, layer, timeout)

    def cancel_load(self, tid: int, blocks: Sequence[int], key: Any = None) -> None:
        """Cancels a load; ``blocks`` come back from finished_holds() once no copy writes them."""
        self.kv.cancel([tid])
        self._holds[tid] = Hold(key, list(blocks))

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

    def store(self, tokens: Sequence[int], block_table: Sequence[int], key: Any = None, *,
              lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
        """Stores the full blocks of ``tokens`` from ``block_table``; the blocks are held until
        finished_holds() returns them with ``key``."""
        n = len(tokens) // self.bs
        tid = self.kv.put_async(list(tokens[: n * self.bs]), list(block_table[:n]),
                                lora_name=lora_name, cache_salt=cache_salt)
        self._holds[tid] = Hold(key, list(block_table[:n]))
        return tid

    @property
    def tasks_pending(self) -> int:
        """Tasks whose results the connector still has to collect."""
        return len(self._holds) + len(self._prefetches)

    def finished_holds(self) -> List[Hold]:
        """Holds of puts whose device copy is done and of cancelled loads that drained. Also
        collects finished prefetches, whose results nobody waits for."""
        if self._prefetches:
            done = self.kv.try_wait(self._prefetches)
            self._prefetches = [t for t in self._prefetches if t not in done]
        if not self._holds:
            return []
        done = self.kv.try_wait(list(self._holds))
        return [self._holds.pop(t) for t in done]

    def drain_holds(self) -> List[Hold]:
        self.kv.wait(self._prefetches)
        self._prefetches = []
        done = self.kv.wait(list(self._holds))
        return [self._holds.pop(t) for t in done]
