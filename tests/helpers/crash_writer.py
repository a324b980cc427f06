"""The writer a crash test kills: puts prompts through a KVManager with an SSD tier as fast as it
can (disk writes run in the background), forever. Block contents are a pure function of each
block's sequence hash (kv_helpers.content), so whoever re-adopts the blocks can check every byte."""

from __future__ import annotations

import numpy as np
from kv_helpers import MODEL, TPB, device_tensors, fill

from dynamo_flexkv import KVLayoutType, KVManager

FAMILIES, MAX_BLOCKS, DEVICE_BLOCKS = 40, 8, 32


def family_prompt(family: int, blocks: int) -> list:
    """Prompts of one family share their prefixes: prefix-closed chains with forks on disk."""
    return np.random.default_rng(family).integers(0, 50000, MAX_BLOCKS * TPB)[: blocks * TPB].tolist()


def write_forever(cfg, seed: int, ready) -> None:
    layout = KVLayoutType.LAYERBLOCK
    with KVManager(MODEL, cfg) as kv:
        dev = device_tensors(layout, DEVICE_BLOCKS)
        kv.register_device_cache(dev, layout)
        rng = np.random.default_rng(seed)
        for i in range(1 << 30):
            prompt = family_prompt(int(rng.integers(FAMILIES)), int(rng.integers(1, MAX_BLOCKS + 1)))
            ids = rng.choice(DEVICE_BLOCKS, size=len(prompt) // TPB, replace=False)
            for b, s in zip(ids, kv.hashes(prompt).sequence):
                fill(dev, layout, int(b), int(s))
            t = kv.put_async(prompt, ids)
            kv.wait([t])  # the device copy; disk writes keep running behind it
            if i == 4:
                ready.set()
