"""The engine's own KV memory: paged per-layer tensors and the device block pool with its prefix
cache (the "GPU" tier). Blocks of finished prefixes stay cached until memory runs short; then the
least recently used unreferenced leaves are evicted (a prompt's tail before its head), which is
exactly when offload pays."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.layout import DTYPE_BYTES
from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model config's dtype name: one of the names the offload tiers store
    (layout.DTYPE_BYTES, each a torch dtype's own name)."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"model dtype {name!r} is not supported: use one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, name)


class PagedKVCache:
    """One LAYERBLOCK tensor per layer: [num_blocks, 2 (K, V), block_size, kv_heads, head_dim]."""

    def __init__(self, cfg: EngineModelConfig, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.cfg, self.num_blocks = cfg, num_blocks
        shape = (num_blocks, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [torch.zeros(shape, dtype=torch_dtype(cfg.dtype), device=device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        t, bs = self.layers[layer], self.cfg.block_size
        blocks, offs = slots // bs, slots % bs
        t[blocks, 0, offs] = k
        t[blocks, 1, offs] = v

    def gather(self, layer: int, block_table: Sequence[int], length: int):
        """K and V of positions [0, length) of a sequence: [length, kv_heads, head_dim] each."""
        bs = self.cfg.block_size
        n = -(-length // bs)
        x = self.layers[layer][torch.as_tensor(list(block_table[:n]), device=self.layers[layer].device)]
        k = x[:, 0].reshape(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[:length]
        v = x[:, 1].reshape(-1, self.cfg.num_kv_heads, self.cfg.head_dim)[:length]
        return k, v


class NoFreeBlocks(RuntimeError, FlexKVError):
    pass


class DeviceBlockPool:
    """Block ids with reference counts and a prefix cache keyed by sequence hash.

    A block holding a full, computed block of some prefix is *cached* under that prefix's hash;
    when its last user releases it, it stays cached but becomes evictable. ``on_stored`` and
    ``on_removed`` report the device tier's changes (the router plugin publishes them).

    The cache is prefix-closed, like the router's radix tree: a block is cached only under a
    cached parent, and eviction takes only *leaves* (no cached child), least recently released
    first. So a prompt's tail goes before its head, the blocks left behind still form a usable
    prefix, and every removal names a leaf the router knows (Dynamo drops the rest of a chain
    when a block in its middle is removed, then warns "Failed to find block to remove" for each
    later removal of that rest).

    Invariant: every cached ancestor of a referenced cached block is referenced too (a request
    holds its whole block table; a duplicate block pins the cached copy it stands for, see
    ``cache``). Hence an unreferenced cached block has no referenced descendant, all of them can
    be evicted leaves first, and ``num_available`` is exact.
    """

    def __init__(
        self,
        num_blocks: int,
        on_stored: Callable[[list[int], int | None, list[int]], None] | None = None,
        on_removed: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self._parent: dict[int, int | None] = {}  # cached block -> its parent's block
        self._children = [0] * num_blocks  # cached children of each cached block
        self._pins: dict[int, int] = {}  # uncached duplicate block -> the cached block it pins
        self._released_at = [0] * num_blocks  # tick of the release that made a block unreferenced
        self._tick = 0
        self._leaves: list[tuple[int, int]] = []  # heap of (released_at, block); stale entries skipped
        self._num_evictable = 0  # unreferenced cached blocks
        self.on_stored, self.on_removed = on_stored, on_removed
        self.evictions = 0

    @property
    def num_available(self) -> int:
        return len(self._free) + self._num_evictable

    def match(self, hashes: Sequence[int] | np.ndarray) -> list[int]:
        """Cached blocks of the longest cached prefix, each now referenced by the caller."""
        out = []
        for h in hashes:
            b = self.by_hash.get(int(h))
            if b is None:
                break
            out.append(b)
        self.ref(out)
        return out

    def peek(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if int(h) not in self.by_hash:
                break
            n += 1
        return n

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each referenced once; evicts cached leaves when the free list runs out
        and reports all of this call's evictions as one removal, leaves first."""
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} device blocks, {self.num_available} available")
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            b = self._free.pop() if self._free else self._evict_leaf(evicted)
            self.refs[b] = 1
            out.append(b)
        if evicted:
            self.evictions += len(evicted)
            if self.on_removed is not None:
                self.on_removed(evicted)
        return out

    def cache(self, block: int, seq_hash: int, parent: int | None, tokens: list[int]) -> None:
        """Marks a referenced block as holding the computed KV of the prefix ``seq_hash``
        (``parent``: the previous block's hash, None for a prompt's first block)."""
        seq_hash = int(seq_hash)
        if block in self.hash_of or block in self._pins:
            return  # already cached (a prefix hit) or already standing for a cached copy
        if self.refs[block] <= 0:
            raise RuntimeError(f"device block {block} cached while nobody references it")
        twin = self.by_hash.get(seq_hash)
        if twin is not None:
            # Another request computed the same prefix first: keep one copy, and pin it for as
            # long as this block lives, because this request's later blocks name it as parent.
            self._ref_one(twin)
            self._pins[block] = twin
            return
        parent_block = None
        if parent is not None:
            parent_block = self.by_hash.get(int(parent))
            if parent_block is None:
                return  # parent not cached: caching this block would break prefix closure
        self.by_hash[seq_hash] = block
        self.hash_of[block] = seq_hash
        self._parent[block] = parent_block
        if parent_block is not None:
            self._children[parent_block] += 1
        if self.on_stored is not None:
            self.on_stored([seq_hash], parent, tokens)

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"device block {b} released more often than referenced")
            self._release_one(b)

    def ref(self, blocks: Sequence[int]) -> None:
        """One more user of each block (a reader such as an offload copy in flight)."""
        for b in blocks:
            self._ref_one(b)

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix (referenced or not)."""
        return len(self.hash_of)

    @property
    def num_cached_in_use(self) -> int:
        """Cached blocks a request or an offload copy references now."""
        return len(self.hash_of) - self._num_evictable

    def clear(self) -> int:
        """Uncaches every cached block nobody references (leaves first, so every removal names a
        leaf the router knows) and frees it; returns how many. Referenced ones stay: by the
        invariant above, no unreferenced block is an ancestor of one."""
        evicted: list[int] = []
        while self._num_evictable and self._leaves:
            self._free.append(self._evict_leaf(evicted))
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        return len(evicted)

    # ---- internals ---------------------------------------------------------------------------
    def _ref_one(self, b: int) -> None:
        if self.refs[b] == 0 and b in self.hash_of:
            self._num_evictable -= 1  # its heap entry, if any, is now stale
        self.refs[b] += 1

    def _release_one(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b]:
            return
        if b in self.hash_of:
            self._num_evictable += 1
            self._tick += 1
            self._released_at[b] = self._tick
            if self._children[b] == 0:
                self._push_leaf(b)
            return
        self._free.append(b)
        twin = self._pins.pop(b, None)
        if twin is not None:
            self._release_one(twin)

    def _push_leaf(self, b: int) -> None:
        heapq.heappush(self._leaves, (self._released_at[b], b))
        if len(self._leaves) > 2 * self.num_blocks + 64:  # drop stale entries now and then
            self._leaves = [e for e in self._leaves if self._is_leaf_entry(*e)]
            heapq.heapify(self._leaves)

    def _is_leaf_entry(self, released_at: int, b: int) -> bool:
        return (
            self.refs[b] == 0 and b in self.hash_of and self._children[b] == 0 and self._released_at[b] == released_at
        )

    def _evict_leaf(self, evicted: list[int]) -> int:
        """Uncaches the least recently released unreferenced leaf and returns its block; its
        parent becomes a candidate once it has no cached child left."""
        while True:
            released_at, b = heapq.heappop(self._leaves)
            if self._is_leaf_entry(released_at, b):
                break
        h = self.hash_of.pop(b)
        del self.by_hash[h]
        self._num_evictable -= 1
        parent = self._parent.pop(b)
        if parent is not None:
            self._children[parent] -= 1
            if self._children[parent] == 0 and self.refs[parent] == 0:
                self._push_leaf(parent)
        evicted.append(h)
        return b
