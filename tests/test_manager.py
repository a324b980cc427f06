"""KVManager round trips: loaded bytes always equal stored bytes, across tiers and restarts."""

import numpy as np
import pytest

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from kv_helpers import (MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds, open_fds,
                        prompts)

DEVICE_BLOCKS = 64


def put(kv, dev, layout, prompt, rng):
    """Engine side of a put: 'compute' each full block into random device blocks, then offload."""
    h = kv.hashes(prompt).sequence
    ids = rng.choice(DEVICE_BLOCKS, size=len(h), replace=False)
    for b, s in zip(ids, h):
        fill(dev, layout, int(b), int(s))
    return kv.put_async(prompt, ids), h


def get_and_check(kv, dev, layout, prompt, rng, skip=0, layerwise=False):
    h = kv.hashes(prompt).sequence
    ids = rng.choice(DEVICE_BLOCKS, size=len(h), replace=False)
    m = kv.match(prompt)
    cached, on_host = max(m.values()) // TPB, m["host"] // TPB
    t = kv.get_async(prompt, ids, skip_blocks=skip, layerwise=layerwise)
    if layerwise:
        for layer in range(MODEL.num_layers):
            try:
                kv.wait_for_layer(t, layer, timeout=30)
            except Exception:
                break
    r = kv.wait([t], timeout=30)[t]
    if cached <= skip:
        assert r.status is TaskStatus.NOT_FOUND
        return 0
    if r.status is TaskStatus.NOT_FOUND:
        # Only possible when host had nothing past `skip` and no free slot to stage disk blocks
        # into (background disk writes hold host blocks until they finish).
        assert on_host <= skip
        return 0
    assert r.status is TaskStatus.SUCCESS, r
    n = r.num_tokens // TPB
    # The host prefix is always served; the disk part needs free host slots to stage into, which
    # background disk writes (holding host blocks) can take for a moment.
    assert max(0, on_host - skip) <= n <= cached - skip
    for i in range(skip, skip + n):
        assert holds(dev, layout, int(ids[i]), int(h[i])), f"block {i} restored with the wrong bytes"
    return n


@pytest.mark.parametrize("layout", list(KVLayoutType))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("nixl", [False, True], ids=["native-io", "nixl-posix"])
def test_round_trip_with_eviction_and_restart(tmp_path, layout, seed, nixl):
    if nixl:
        pytest.importorskip("nixl._api", reason="NIXL is installed by make test; GPU images may lack it")
    rng = np.random.default_rng(seed)
    cfg = config(tmp_path, host_blocks=12, disk_blocks=40, eviction_policy=["lru", "lfu", "fifo"][seed],
                 enable_nixl=nixl)
    ps = prompts(rng, 30, max_blocks=6)
    fds = None
    loaded = 0
    for life in range(3):  # restart in between: the disk tier is re-adopted
        if life == 2:
            # After a restart has read the disk on this thread, it keeps its cached io_uring ring
            # (one per thread, by design); from here on a lifetime must not add descriptors.
            fds = open_fds()
        with KVManager(MODEL, cfg) as kv:
            dev = device_tensors(layout, DEVICE_BLOCKS)
            kv.register_device_cache(dev, layout)
            if life:
                assert len(kv.adopt_report.adopted) > 0 and kv.adopt_report.torn == 0
            for _ in range(40):
                p = ps[int(rng.integers(len(ps)))]
                if rng.random() < 0.5:
                    t, _ = put(kv, dev, layout, p, rng)
                    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
                else:
                    loaded += get_and_check(kv, dev, layout, p, rng, skip=int(rng.integers(0, 2)),
                                            layerwise=bool(rng.random() < 0.5))
            kv.transfer.shutdown()  # let background disk writes finish before checking
            assert_no_leaks(kv)
    assert loaded > 0
    assert open_fds(settle_to=fds) <= fds, "a manager lifetime leaked file descriptors"


def test_get_from_disk_after_host_eviction(tmp_path):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=64)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        first = list(range(6 * TPB))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, first, rng)
        kv.wait([t])
        _wait_idle(kv)
        for i in range(3):  # push `first` out of host memory
            t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, [100000 + i] * (6 * TPB), rng)
            kv.wait([t])
            _wait_idle(kv)  # its disk write releases the host blocks it reads
        m = kv.match(first)
        assert m["disk"] == 6 * TPB and m["host"] < 6 * TPB
        assert get_and_check(kv, dev, KVLayoutType.LAYERBLOCK, first, rng) == 6
        assert kv.match(first)["host"] == 6 * TPB  # staged into host on the way
        p = kv.prefetch_async(first)
        assert kv.wait([p])[p].status is TaskStatus.SUCCESS
        _wait_idle(kv)
        assert_no_leaks(kv)


def test_namespaces_isolate(tmp_path):
    rng = np.random.default_rng(0)
    cfg = config(tmp_path, disk_blocks=0)
    with KVManager(MODEL, cfg, namespace="tenant-a") as a:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        a.register_device_cache(dev)
        prompt = list(range(4 * TPB))
        t, _ = put(a, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        a.wait([t])
        assert a.match(prompt)["host"] == 4 * TPB
        assert a.match(prompt, cache_salt="other")["host"] == 0
        ids = np.arange(4)
        t = a.get_async(prompt, ids, cache_salt="other")
        assert a.wait([t])[t].status is TaskStatus.NOT_FOUND


def test_put_stores_only_new_blocks(tmp_path):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, disk_blocks=0)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        prompt = list(range(6 * TPB + 3))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt[: 4 * TPB], rng)
        assert kv.wait([t])[t].num_tokens == 4 * TPB
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        assert kv.wait([t])[t].num_tokens == 2 * TPB
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        assert kv.wait([t])[t].num_tokens == 0


def _wait_idle(kv, timeout=30.0):
    import time
    deadline = time.monotonic() + timeout
    while kv.cache.task_ids() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert kv.cache.task_ids() == []
