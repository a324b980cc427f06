"""Bad input and failures: each gives a clear status or error, nothing becomes visible, and no
lock, pool slot or file descriptor leaks."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.index import Tier
from dynamo_flexkv.tasks import TaskFailed
from dynamo_flexkv.transfer.graph import OpKind, OpState
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds

DEV = 32


@pytest.fixture
def kv(tmp_path):
    with KVManager(MODEL, config(tmp_path, host_blocks=16, disk_blocks=48)) as m:
        m.dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
        m.register_device_cache(m.dev)
        yield m


def store(kv, prompt, ids):
    for b, s in zip(ids, kv.hashes(prompt).sequence):
        fill(kv.dev, KVLayoutType.LAYERBLOCK, int(b), int(s))
    t = kv.put_async(prompt, ids)
    assert kv.wait([t])[t].status is TaskStatus.SUCCESS
    idle(kv)


def idle(kv, timeout=30.0):
    deadline = time.monotonic() + timeout
    while kv.cache.task_ids() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_bad_block_ids(kv):
    prompt = list(range(3 * TPB + 5))
    with pytest.raises(ValueError, match=r"2 device block ids for 53 tokens: pass one id per block \(3 full blocks, or 4"):
        kv.put_async(prompt, [0, 1])
    with pytest.raises(IndexError, match=r"device block id out of range \[0, 32\)"):
        kv.get_async(prompt, [0, 1, 99])
    with pytest.raises(IndexError, match="out of range"):
        kv.put_async(prompt, [-1, 0, 1, 2])
    assert_no_leaks(kv)


@pytest.mark.parametrize(
    "tensors, words",
    [
        (lambda: [torch.zeros(8, 2, TPB, 2, 64, dtype=torch.float32) for _ in range(3)], "dtype torch.float32"),
        (lambda: [torch.zeros(8, 2, TPB, 4, 64, dtype=torch.float16) for _ in range(3)], "needs (8, 2, 16, 2, 64)"),
        (lambda: [torch.zeros(8, 2, TPB, 2, 64, dtype=torch.float16) for _ in range(2)], "2 tensors for 3 layers"),
        (lambda: [torch.zeros(8, 2, 64, TPB, 2, dtype=torch.float16).transpose(2, 4) for _ in range(3)], "not contiguous"),
    ],
)
def test_device_tensor_contradicting_layout(kv, tensors, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        kv.register_device_cache(tensors(), KVLayoutType.LAYERBLOCK)


def test_unknown_task_and_waiting_twice(kv):
    with pytest.raises(KeyError, match="unknown task id 12345"):
        kv.wait([12345])
    t = kv.get_async(list(range(2 * TPB)), [0, 1])
    assert kv.wait([t])[t].status is TaskStatus.NOT_FOUND
    with pytest.raises(KeyError, match="already taken"):
        kv.wait([t])
    with pytest.raises(KeyError):
        kv.cancel([t])


def test_disk_write_failure_keeps_host_and_leaks_nothing(kv, tmp_path):
    # A data file that refuses writes (opened read-only): every H2DISK fails with EBADF.
    bad = os.open(os.path.join(str(tmp_path), "ssd1", "flexkv-blocks.kv"), os.O_RDONLY)
    good = kv.ssd.fds[1]
    kv.ssd.fds[1] = bad
    try:
        prompt = list(range(4 * TPB))
        t = kv.put_async(prompt, [0, 1, 2, 3])
        assert kv.wait([t])[t].status is TaskStatus.SUCCESS  # the device side is done
        idle(kv)
        assert kv.stats()["tasks"]["disk_write_failures"] == 1
        m = kv.match(prompt)
        assert m["host"] == 4 * TPB and m["disk"] == 0  # no disk block became visible
        assert_no_leaks(kv)
    finally:
        kv.ssd.fds[1] = good
        os.close(bad)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-blocks", "per-layer-reads"])
def test_checksum_mismatch_fails_get_and_drops_block(kv, tmp_path, layerwise):
    prompt = list(range(6 * TPB))
    store(kv, prompt, [0, 1, 2, 3, 4, 5])
    kv.cache.tiers[Tier.HOST].evict(100)  # only the disk copy is left
    assert kv.match(prompt) == {"host": 0, "disk": 6 * TPB}
    # Corrupt block 2's bytes on disk behind the manager's back.
    disk_id = kv.cache.tiers[Tier.DISK].info(int(kv.hashes(prompt).sequence[2])).block_id
    fd_arr, off = kv.ssd.locate(np.array([disk_id]))
    path = os.path.join(str(tmp_path), f"ssd{disk_id % 2}", "flexkv-blocks.kv")
    with open(path, "r+b") as f:
        f.seek(int(off[0]) + 100)
        f.write(b"\xff" * 64)
    t = kv.get_async(prompt, list(range(10, 16)), layerwise=layerwise)
    graph = kv._task(t).graph
    r = kv.wait([t])[t]
    assert r.status is TaskStatus.FAILED and "ChecksumError" in r.error
    failed = [op.kind for op in graph.ops if op.state is OpState.FAILED]
    assert failed == ([OpKind.VERIFY] if layerwise else [OpKind.DISK2H])
    idle(kv)
    # The torn block and everything after it left the disk tier; its prefix stays usable.
    assert kv.match(prompt) == {"host": 0, "disk": 2 * TPB}
    assert_no_leaks(kv)
    t = kv.get_async(prompt, list(range(10, 16)))
    assert kv.wait([t])[t].num_tokens == 2 * TPB
    assert holds(kv.dev, KVLayoutType.LAYERBLOCK, 11, int(kv.hashes(prompt).sequence[1]))


def test_cancel_and_layer_wait_after_failure(kv):
    prompt = list(range(4 * TPB))
    store(kv, prompt, [0, 1, 2, 3])
    gate = threading.Event()
    mover = kv.transfer.movers[kv_h2d()]
    orig = mover.run

    def slow(op):
        gate.wait(10)
        return orig(op)

    mover.run = slow
    try:
        t = kv.get_async(prompt, [4, 5, 6, 7], layerwise=True)
        assert kv.wait([t], timeout=0.05)[t].status is TaskStatus.TIMEOUT
        kv.cancel([t])
        gate.set()
        assert kv.wait([t], timeout=10)[t].status is TaskStatus.CANCELLED
    finally:
        mover.run = orig
    idle(kv)
    assert_no_leaks(kv)
    assert kv.match(prompt)["host"] == 4 * TPB

    def boom(op):
        raise OSError(5, "simulated device copy failure")

    mover.run = boom
    try:
        t = kv.get_async(prompt, [4, 5, 6, 7], layerwise=True)
        with pytest.raises(TaskFailed, match="simulated device copy failure"):
            kv.wait_for_layer(t, 0, timeout=10)
        assert kv.wait([t])[t].status is TaskStatus.FAILED
    finally:
        mover.run = orig
    idle(kv)
    assert_no_leaks(kv)


def kv_h2d():
    return OpKind.H2D


def test_shutdown_with_tasks_in_flight(tmp_path):
    kv = KVManager(MODEL, config(tmp_path, host_blocks=16, disk_blocks=48))
    dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
    kv.register_device_cache(dev)
    ids = [kv.put_async([i] * (4 * TPB), [0, 1, 2, 3]) for i in range(20)]
    kv.shutdown()
    results = kv.wait(ids, timeout=10)
    assert all(r.status in (TaskStatus.SUCCESS, TaskStatus.CANCELLED) for r in results.values())
    assert kv.cache.task_ids() == []
    with pytest.raises(RuntimeError, match="shut down"):
        kv.put_async([1] * TPB, [0])
    kv.shutdown()  # twice is fine
