"""Soak (``-m slow``): a flood of get/put/prefetch requests, a share of them never collected, with
the router-event relay attached and no subscriber. Task tables, transfer queues and memory must level
off: results nobody collects expire after task_result_ttl_seconds, and nothing else accumulates."""

import os
import threading
import time

import numpy as np
import pytest
from kv_helpers import MODEL, TPB, config, device_tensors, fill, prompts

from dynamo_flexkv import KVLayoutType, KVManager
from dynamo_flexkv.integrations.events import KvEventRelay, OffloadEvents

SECONDS, THREADS, SLICE, TTL = 60.0, 4, 16, 0.5


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest.mark.slow
def test_request_flood_levels_off(tmp_path):
    relay = KvEventRelay(TPB)
    cfg = config(tmp_path, host_blocks=32, disk_blocks=128, task_result_ttl_seconds=TTL)
    with KVManager(MODEL, cfg, listener=OffloadEvents(relay)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, THREADS * SLICE)
        kv.register_device_cache(dev)
        pool = prompts(np.random.default_rng(5), 400, max_blocks=8)
        stop = threading.Event()
        issued = [0] * THREADS
        errors = []

        def flood(w):
            rng = np.random.default_rng(w)
            mine = np.arange(w * SLICE, (w + 1) * SLICE)
            try:
                while not stop.is_set():
                    p = pool[int(rng.integers(len(pool)))]
                    h = kv.hashes(p).sequence
                    ids = rng.choice(mine, size=len(h), replace=False)
                    r = rng.random()
                    if r < 0.5:
                        for b, s in zip(ids, h):
                            fill(dev, KVLayoutType.LAYERBLOCK, int(b), int(s))
                        t = kv.put_async(p, ids)
                    elif r < 0.85:
                        t = kv.get_async(p, ids)
                    else:
                        t = kv.prefetch_async(p)
                    issued[w] += 1
                    if rng.random() < 0.7:  # the rest are never collected: they must expire
                        kv.wait([t], timeout=30)
                    else:  # the device blocks may be reused only once the copy is done
                        while not kv.done(t):
                            time.sleep(0.001)
            except Exception as e:  # noqa: BLE001 - a worker thread's failure, reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=flood, args=(w,), daemon=True) for w in range(THREADS)]
        for t in threads:
            t.start()
        samples = []
        start = time.monotonic()
        while time.monotonic() - start < SECONDS:
            time.sleep(SECONDS / 30)
            st = kv.stats()
            samples.append(
                (
                    time.monotonic() - start,
                    _rss_mib(),
                    len(os.listdir("/proc/self/fd")),
                    st.tasks.in_flight,
                    st.tasks.queued_ops,
                    st.tasks.expired_results,
                )
            )
        stop.set()
        for t in threads:
            t.join(60)
        assert errors == []
        assert kv.drain(60)
        for s in samples:
            print("t={:5.1f}s rss={:7.1f} MiB fds={:3d} tasks={:4d} queued_ops={:3d} expired={:d}".format(*s))
        half = len(samples) // 2
        first, second = samples[:half], samples[half:]
        rate = sum(issued) / SECONDS
        assert samples[-1][5] > 0, "no uncollected result ever expired"
        # Task records: at most what a TTL (plus one sampling period) of uncollected results can hold.
        assert max(s[3] for s in second) <= rate * (TTL + SECONDS / 30) + 4 * THREADS
        assert max(s[4] for s in second) <= 64 * THREADS  # queued copies stay near the threads' work
        assert max(s[2] for s in second) <= max(s[2] for s in first)  # descriptors
        assert max(s[1] for s in second) <= max(s[1] for s in first) * 1.05 + 16  # memory levels off
    relay.close()
