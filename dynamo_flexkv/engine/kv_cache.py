"""The engine's own KV memory: paged per-layer tensors and the device block pool with its prefix
cache (the "GPU" tier). Blocks of finished prefixes stay cached until memory runs short; then the
least recently used unreferenced ones are evicted, which is exactly when offload pays."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from dynamo_flexkv.engine.config import EngineModelConfig
from dynamo_flexkv.storage.device import TORCH_DTYPES


class PagedKVCache:
    """One LAYERBLOCK tensor per layer: [num_blocks, 2 (K, V), block_size, kv_heads, head_dim]."""

    def __init__(self, cfg: EngineModelConfig, num_blocks: int, device: Union[str, torch.device] = "cpu") -> None:
        self.cfg, self.num_blocks = cfg, num_blocks
        shape = (num_blocks, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [torch.zeros(shape, dtype=TORCH_DTYPES[cfg.dtype], device=device) for _ in range(cfg.num_layers)]

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


class NoFreeBlocks(RuntimeError):
    pass


class DeviceBlockPool:
    """Block ids with reference counts and a prefix cache keyed by sequence hash.

    A block holding a full, computed block of some prefix is *cached* under that prefix's hash;
    when its last user releases it, it stays cached but becomes evictable (LRU). ``on_stored`` and
    ``on_removed`` report the device tier's changes (the router plugin publishes them).
    """

    def __init__(self, num_blocks: int,
                 on_stored: Optional[Callable[[List[int], Optional[int], List[int]], None]] = None,
                 on_removed: Optional[Callable[[List[int]], None]] = None) -> None:
        self.num_blocks = num_blocks
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.by_hash: Dict[int, int] = {}
        self.hash_of: Dict[int, int] = {}
        self._evictable: "OrderedDict[int, None]" = OrderedDict()  # block ids, LRU first
        self.on_stored, self.on_removed = on_stored, on_removed
        self.evictions = 0

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def match(self, hashes: Sequence[int]) -> List[int]:
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

    def allocate(self, n: int) -> List[int]:
        if n > self.num_available:
            raise NoFreeBlocks(f"need {n} device blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, seq_hash: int, parent: Optional[int], tokens: List[int]) -> None:
        """Marks a referenced block as holding the computed KV of the prefix ``seq_hash``."""
        seq_hash = int(seq_hash)
        if seq_hash in self.by_hash or block in self.hash_of:
            return  # another request computed the same prefix first; keep one copy
        self.by_hash[seq_hash] = block
        self.hash_of[block] = seq_hash
        if self.on_stored is not None:
            self.on_stored([seq_hash], parent, tokens)

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"device block {b} released more often than referenced")
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def ref(self, blocks: Sequence[int]) -> None:
        """One more user of each block (a reader such as an offload copy in flight)."""
        for b in blocks:
            if self.refs[b] == 0:
                self._evictable.pop(b, None)
            self.refs[b] += 1

    def _uncache(self, b: int) -> None:
        h = self.hash_of.pop(b)
        del self.by_hash[h]
        if self.on_removed is not None:
            self.on_removed([h])
