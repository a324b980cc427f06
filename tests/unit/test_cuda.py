"""The CUDA device<->host path: the same round trips with the engine's tensors on a GPU.

Runs where torch sees a GPU (scripts/device_check.sh on a lent GPU machine); skipped elsewhere.
"""

import numpy as np
import pytest
import torch
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA; runs on GPU machines via scripts/device_check.sh"
)


@pytest.mark.parametrize("layout", list(KVLayoutType))
@pytest.mark.parametrize("layerwise", [False, True])
def test_cuda_round_trip(tmp_path, layout, layerwise):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=16, disk_blocks=48)) as kv:
        assert kv.host.pinned
        dev = device_tensors(layout, 32, device="cuda")
        kv.register_device_cache(dev, layout)
        prompt = rng.integers(0, 50000, 7 * TPB + 3).tolist()
        h = kv.hashes(prompt).sequence
        src = rng.choice(32, size=len(h), replace=False)
        for b, s in zip(src, h):
            fill(dev, layout, int(b), int(s))
        t = kv.put_async(prompt, src)
        assert kv.wait([t])[t].status is TaskStatus.SUCCESS
        dst = rng.choice(32, size=len(h), replace=False)
        g = kv.get_async(prompt, dst, layerwise=layerwise)
        if layerwise:
            for layer in range(MODEL.num_layers):
                assert kv.wait_for_layer(g, layer, timeout=30)
        r = kv.wait([g])[g]
        assert r.status is TaskStatus.SUCCESS and r.num_tokens == len(h) * TPB
        for b, s in zip(dst, h):
            assert holds(dev, layout, int(b), int(s))
        assert kv.drain(30)
        assert_no_leaks(kv)
