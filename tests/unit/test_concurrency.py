"""Thousands of interleaved get/put/prefetch/cancel tasks from several threads."""

import threading

import numpy as np
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds, prompts

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

THREADS, OPS, SLICE = 4, 500, 16  # each thread owns device blocks [t*SLICE, (t+1)*SLICE)


def test_threads_interleave_tasks(tmp_path):
    layout = KVLayoutType.LAYERBLOCK
    with KVManager(MODEL, config(tmp_path, host_blocks=20, disk_blocks=60), workers=4) as kv:
        dev = device_tensors(layout, THREADS * SLICE)
        kv.register_device_cache(dev, layout)
        shared = prompts(np.random.default_rng(99), 40, max_blocks=8)
        errors, counts = [], {s: 0 for s in TaskStatus}
        lock = threading.Lock()

        def worker(w):
            rng = np.random.default_rng(w)
            mine = np.arange(w * SLICE, (w + 1) * SLICE)
            try:
                for _i in range(OPS):
                    p = shared[int(rng.integers(len(shared)))]
                    h = kv.hashes(p).sequence
                    ids = rng.choice(mine, size=len(h), replace=False)
                    op = rng.random()
                    if op < 0.4:
                        for b, s in zip(ids, h):
                            fill(dev, layout, int(b), int(s))
                        t = kv.put_async(p, ids)
                    elif op < 0.8:
                        t = kv.get_async(p, ids, layerwise=bool(rng.random() < 0.3))
                    else:
                        t = kv.prefetch_async(p)
                    if rng.random() < 0.1:
                        kv.cancel([t])
                    r = kv.wait([t], timeout=60)[t]
                    with lock:
                        counts[r.status] += 1
                    assert r.status is not TaskStatus.FAILED, r
                    if op >= 0.4 and op < 0.8 and r.status is TaskStatus.SUCCESS:
                        for j in range(r.num_tokens // TPB):
                            assert holds(dev, layout, int(ids[j]), int(h[j])), "wrong bytes restored"
            except Exception as e:  # noqa: BLE001 - a worker thread's failure, reported with the thread id below
                errors.append((w, repr(e)))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert kv.drain(timeout=30)
        assert_no_leaks(kv)
        assert sum(counts.values()) == THREADS * OPS
        assert counts[TaskStatus.SUCCESS] > THREADS * OPS // 3
