"""Shared pieces for data-plane tests: a small model, device tensors, content keyed by block."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from dynamo_flexkv import CacheConfig, KVLayoutType, KVManager, ModelSpec

# 16 tokens x 2 heads x 64 dims x fp16 = 4 KiB per chunk: blocks stay O_DIRECT-aligned.
MODEL = ModelSpec(num_layers=3, num_kv_heads=2, head_size=64, dtype="float16")
TPB = 16
BLOCK_BYTES = MODEL.token_bytes() * TPB  # 24 KiB


def config(tmp_path, host_blocks=24, disk_blocks=64, **kw) -> CacheConfig:
    gb = BLOCK_BYTES / (1 << 30)
    values = dict(tokens_per_block=TPB, cpu_cache_gb=host_blocks * gb)
    if disk_blocks:
        values.update(ssd_cache_gb=disk_blocks * gb, ssd_cache_dir=f"{tmp_path}/ssd0;{tmp_path}/ssd1")
    values.update(kw)
    return CacheConfig.from_dict(values)


def device_tensors(layout: KVLayoutType, num_blocks: int, device: str = "cpu"):
    """Engine KV in one of the three layouts (one tensor per layer where the layout allows)."""
    m = MODEL
    kw = dict(dtype=torch.float16, device=device)
    if layout is KVLayoutType.LAYERBLOCK:
        return [torch.zeros(num_blocks, 2, TPB, m.num_kv_heads, m.head_size, **kw) for _ in range(m.num_layers)]
    if layout is KVLayoutType.LAYERFIRST:
        return torch.zeros(m.num_layers, 2, num_blocks, TPB, m.num_kv_heads, m.head_size, **kw)
    return torch.zeros(num_blocks, m.num_layers, 2, TPB, m.num_kv_heads, m.head_size, **kw)


def block_view(tensors, layout: KVLayoutType, block: int, layer: int) -> torch.Tensor:
    if layout is KVLayoutType.LAYERBLOCK:
        return tensors[layer][block]
    if layout is KVLayoutType.LAYERFIRST:
        return tensors[layer, :, block]
    return tensors[block, layer]


def content(seq_hash: int, layer: int) -> torch.Tensor:
    """The bytes a block 'computed' for a prefix: a pure function of its sequence hash."""
    g = torch.Generator().manual_seed((int(seq_hash) ^ (layer * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1))
    return torch.randint(
        -30000, 30000, (2, TPB, MODEL.num_kv_heads, MODEL.head_size), generator=g, dtype=torch.int16
    ).view(torch.float16)


def fill(tensors, layout, block: int, seq_hash: int) -> None:
    for layer in range(MODEL.num_layers):
        block_view(tensors, layout, block, layer).copy_(content(seq_hash, layer))


def holds(tensors, layout, block: int, seq_hash: int) -> bool:
    return all(
        torch.equal(
            block_view(tensors, layout, block, layer).cpu().view(torch.int16),
            content(seq_hash, layer).view(torch.int16),
        )
        for layer in range(MODEL.num_layers)
    )


def assert_no_leaks(kv: KVManager) -> None:
    assert kv.cache.task_ids() == []
    for tier, idx in kv.cache.tiers.items():
        assert idx.pool.num_used == len(idx), f"{tier}: pool slots leaked"
        for h in idx.hashes():
            info = idx.info(h)
            assert info.ready and info.locks == 0, f"{tier}: block {h:#x} left locked or unready"


class Delivered:
    """An ``on_done`` receiver for get_async / put_async / prefetch_async: every result handed to
    it, by task id. How a test sees the results of tasks a shutdown() ended (wait() raises
    ManagerClosed after it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict = {}
        self._twice: list = []  # task ids delivered more than once (the callback must not raise)

    def __call__(self, result) -> None:
        with self._lock:
            if result.task_id in self._results:
                self._twice.append(result.task_id)
            self._results[result.task_id] = result

    def of(self, task_ids) -> list:
        """Each task's result: None for a task left without one (a hang)."""
        with self._lock:
            assert not self._twice, f"results delivered twice: tasks {self._twice}"
            return [self._results.get(t) for t in task_ids]


def open_fds(settle_to: int = -1, timeout: float = 5.0) -> int:
    """Open descriptors of this process. With ``settle_to``, waits (bounded) for the count to fall
    to it: a joined worker thread closes its cached io_uring ring in its native thread-exit
    handlers, which can run just after Python's join() returned."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        n = len(os.listdir("/proc/self/fd"))
        if n <= settle_to or settle_to < 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def fd_targets() -> list:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def prompts(rng: np.random.Generator, count: int, max_blocks: int, vocab: int = 50000):
    """Prompts sharing prefixes, each 1..max_blocks blocks plus a partial tail."""
    out = []
    for _ in range(count):
        if out and rng.random() < 0.6:
            base = out[int(rng.integers(len(out)))]
            keep = int(rng.integers(0, len(base) // TPB + 1)) * TPB
            p = base[:keep]
        else:
            p = []
        extra = int(rng.integers(1, max_blocks + 1)) * TPB + int(rng.integers(0, TPB))
        p = p + rng.integers(0, vocab, extra).tolist()
        out.append(p[: max_blocks * TPB + TPB - 1])
    return out


def store_and_drain(kv: KVManager, dev, tokens, ids, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
    """Device blocks ``ids`` get content keyed by the prefix hashes, then a put, waited for with
    its disk writes."""
    from dynamo_flexkv import TaskStatus

    hashes = kv.hashes(tokens).sequence
    for i, b in enumerate(ids):
        fill(dev, layout, b, hashes[i])
    r = kv.wait([kv.put_async(tokens, ids)], timeout=20)
    assert next(iter(r.values())).status is TaskStatus.SUCCESS
    assert kv.drain(timeout=20)


class HungDisk:
    """Disk writes (H2DISK) that block until ``answers`` is set, as a stalled disk's O_DIRECT
    writes do; each op is appended to ``seen`` when it starts. KVManager(mover_hook=hung_disk(...)).
    ``answers``: anything with threading.Event's ``wait(timeout) -> bool``; a write still hung after
    ``max_s`` fails (a broken test never hangs for good)."""

    def __init__(self, inner, answers, seen: list | None = None, max_s: float = 60) -> None:
        self.inner, self.answers, self.seen, self.max_s = inner, answers, seen, max_s

    def run(self, op):
        if self.seen is not None:
            self.seen.append(op)
        assert self.answers.wait(self.max_s), f"the disk hung for more than {self.max_s} s"
        return self.inner.run(op)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def hung_disk(answers, seen: list | None = None):
    """A mover_hook whose disk writes hang until ``answers`` (a threading.Event) is set."""
    from dynamo_flexkv.core.transfer.graph import OpKind

    def hook(kind, mover):
        return HungDisk(mover, answers, seen) if kind is OpKind.H2DISK else mover

    return hook
