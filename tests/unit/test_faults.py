"""Bad input and failures: each gives a clear status or error, nothing becomes visible, and no
lock, pool slot or file descriptor leaks."""

import contextlib
import os
import threading

import numpy as np
import pytest
import torch
from kv_helpers import MODEL, TPB, Delivered, assert_no_leaks, config, device_tensors, fill, holds

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.core.index import Tier
from dynamo_flexkv.core.tasks import TaskFailed
from dynamo_flexkv.core.transfer.graph import OpKind

DEV = 32


@contextlib.contextmanager
def opened(tmp_path, **kw):
    with KVManager(MODEL, config(tmp_path, host_blocks=16, disk_blocks=48), **kw) as m:
        m.dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
        m.register_device_cache(m.dev)
        yield m


@pytest.fixture
def kv(tmp_path):
    with opened(tmp_path) as m:
        yield m


class _Wrapped:
    """A link's mover behind KVManager(mover_hook=...): ``before(op)`` runs first (it may raise or
    wait), then the real mover."""

    def __init__(self, mover, before) -> None:
        self.mover, self.before = mover, before

    def run(self, op) -> int:
        self.before(op)
        return self.mover.run(op)


def wrap(links, before):
    """A mover_hook that puts ``before`` in front of the movers of ``links``."""
    return lambda link, mover: _Wrapped(mover, before) if link in links else mover


def store(kv, prompt, ids):
    for b, s in zip(ids, kv.hashes(prompt).sequence):
        fill(kv.dev, KVLayoutType.LAYERBLOCK, int(b), int(s))
    t = kv.put_async(prompt, ids)
    assert kv.wait([t])[t].status is TaskStatus.SUCCESS
    idle(kv)


def idle(kv, timeout=30.0):
    assert kv.drain(timeout), "tasks still running"


def test_bad_block_ids(kv):
    prompt = list(range(3 * TPB + 5))
    with pytest.raises(
        ValueError, match=r"2 device block ids for 53 tokens: pass one id per block \(3 full blocks, or 4"
    ):
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
        (
            lambda: [torch.zeros(8, 2, 64, TPB, 2, dtype=torch.float16).transpose(2, 4) for _ in range(3)],
            "not contiguous",
        ),
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
    kv.cancel([t])  # issued and collected: a no-op (cancel may race wait)


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
        assert kv.stats().tasks.disk_write_failures == 1
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
    r = kv.wait([t])[t]
    assert r.status is TaskStatus.FAILED and "ChecksumError" in r.error
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
    delivered = Delivered()
    ids = [kv.put_async([i] * (4 * TPB), [0, 1, 2, 3], on_done=delivered) for i in range(20)]
    kv.shutdown()  # cancels and drains: every task has its final result
    assert all(r is not None and r.status in (TaskStatus.SUCCESS, TaskStatus.CANCELLED) for r in delivered.of(ids))
    assert kv.cache.task_ids() == []
    kv.shutdown()  # twice is fine (ManagerClosed after it: tests/unit/test_manager.py)


# ---- a full or failing SSD: writes fail cleanly and are counted, host keeps serving ----------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 320 KiB tmpfs: room for about a dozen 24 KiB blocks, then ENOSPC (a real one)."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=320k,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): needs root with "
            "CAP_SYS_ADMIN; the injected-EIO test covers the error path"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _put_all(kv, dev, prompts_):
    for i, p in enumerate(prompts_):
        ids = list(range((i % 4) * 8, (i % 4) * 8 + len(p) // TPB))
        for b, s in zip(ids, kv.hashes(p).sequence):
            fill(dev, KVLayoutType.LAYERBLOCK, int(b), int(s))
        t = kv.put_async(p, ids)
        assert kv.wait([t])[t].status is TaskStatus.SUCCESS  # the device side never fails
    assert kv.drain(30)


def _assert_serves(kv, dev, prompt, tier_key):
    """The cached prefix in ``tier_key`` loads with exact bytes."""
    n = kv.match(prompt)[tier_key] // TPB
    ids = list(range(24, 24 + len(prompt) // TPB))
    t = kv.get_async(prompt, ids)
    r = kv.wait([t])[t]
    assert r.status is TaskStatus.SUCCESS and r.num_tokens >= n * TPB, r
    for j, s in enumerate(kv.hashes(prompt).sequence[:n]):
        assert holds(dev, KVLayoutType.LAYERBLOCK, ids[j], int(s)), f"block {j} served with wrong bytes"


@pytest.mark.integration
def test_enospc_on_a_full_ssd(tmp_path, small_tmpfs):
    """Real ENOSPC: the block file is sparse, so writes into it fail once the tmpfs is full."""
    cfg = config(tmp_path, host_blocks=16, disk_blocks=48, ssd_cache_dir=str(small_tmpfs))
    prompts_ = [[1000 * i + j for j in range(4 * TPB)] for i in range(12)]
    with KVManager(MODEL, cfg) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
        kv.register_device_cache(dev)
        _put_all(kv, dev, prompts_[:6])
        failures = kv.stats().tasks.disk_write_failures
        fds = len(os.listdir("/proc/self/fd"))  # after the transfer threads opened their io_uring rings
        _put_all(kv, dev, prompts_[6:])
        st = kv.stats()
        assert st.tasks.disk_write_failures > failures, "the tmpfs never filled up"
        assert st.tasks.in_flight == 0 and kv.cache.task_ids() == []
        assert_no_leaks(kv)
        # A transfer thread opens its io_uring ring on its first disk op, which may come only now:
        # allow one per thread; a leak per failed write would pass that.
        assert st.tasks.disk_write_failures - failures > kv.transfer.num_threads
        assert len(os.listdir("/proc/self/fd")) <= fds + kv.transfer.num_threads, "a failed write leaked a descriptor"
        # Host keeps serving what it holds, with exact bytes; disk serves what landed.
        assert kv.match(prompts_[-1])["host"] == 4 * TPB
        _assert_serves(kv, dev, prompts_[-1], "host")
        on_disk = [p for p in prompts_ if kv.match(p)["disk"]]
        assert on_disk and len(on_disk) < len(prompts_)
        host = kv.cache.tiers[Tier.HOST]
        host.evict(len(host))
        for p in on_disk:
            _assert_serves(kv, dev, p, "disk")
        assert kv.drain(30)
        assert_no_leaks(kv)
        disk_held = {p[0] for p in on_disk if kv.match(p)["disk"]}
    # A restart on the full directory re-adopts exactly what was journaled, nothing torn.
    with KVManager(MODEL, cfg) as kv:
        assert kv.adopt_report.torn == 0
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
        kv.register_device_cache(dev)
        assert {p[0] for p in prompts_ if kv.match(p)["disk"]} == disk_held
        for p in prompts_:
            if kv.match(p)["disk"]:
                _assert_serves(kv, dev, p, "disk")


def test_eio_injected_in_the_disk_mover(tmp_path):
    """EIO cannot be produced on demand without a device-mapper target, so the disk mover raises it
    (reads, then writes) through KVManager's mover_hook; everything above the mover is the real code
    path."""
    import errno

    failing = threading.Event()

    def eio(op):
        if failing.is_set():
            raise OSError(errno.EIO, "Input/output error (injected)")

    with opened(tmp_path, mover_hook=wrap((OpKind.DISK2H, OpKind.H2DISK), eio)) as kv:
        prompt = list(range(4 * TPB))
        store(kv, prompt, [0, 1, 2, 3])
        host = kv.cache.tiers[Tier.HOST]
        host.evict(len(host))
        failing.set()
        try:
            t = kv.get_async(prompt, [4, 5, 6, 7])
            r = kv.wait([t])[t]
            assert r.status is TaskStatus.FAILED and "Input/output error" in r.error
            idle(kv)
            assert_no_leaks(kv)
            assert kv.match(prompt) == {"host": 0, "disk": 4 * TPB}  # a read error does not drop the block
            other = [7] * (4 * TPB)
            store(kv, other, [8, 9, 10, 11])  # the write to disk fails: host has it, disk not
            assert kv.stats().tasks.disk_write_failures == 1
            assert kv.match(other) == {"host": 4 * TPB, "disk": 0}
            t = kv.get_async(other, [12, 13, 14, 15])
            assert kv.wait([t])[t].num_tokens == 4 * TPB  # host keeps serving
            assert all(
                holds(kv.dev, KVLayoutType.LAYERBLOCK, 12 + j, int(s)) for j, s in enumerate(kv.hashes(other).sequence)
            )
            idle(kv)
            assert_no_leaks(kv)
        finally:
            failing.clear()
        t = kv.get_async(prompt, [4, 5, 6, 7])  # the disk recovered: its blocks load again
        assert kv.wait([t])[t].num_tokens == 4 * TPB
        assert all(
            holds(kv.dev, KVLayoutType.LAYERBLOCK, 4 + j, int(s)) for j, s in enumerate(kv.hashes(prompt).sequence)
        )
        idle(kv)
        assert_no_leaks(kv)


def test_a_flood_is_refused_past_max_tasks_in_flight(tmp_path):
    """Work in flight is bounded: with disk writes stuck, new tasks are refused with a clear error
    (nothing planned, no record) instead of queueing without bound; they run again once it drains."""
    from dynamo_flexkv.core.tasks import TooManyTasks

    gate = threading.Event()
    hook = wrap((OpKind.H2DISK,), lambda op: gate.wait(30))  # disk writes wait for the gate
    with KVManager(
        MODEL, config(tmp_path, host_blocks=16, disk_blocks=48, max_tasks_in_flight=3), mover_hook=hook
    ) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEV)
        kv.register_device_cache(dev)
        try:
            ids = [kv.put_async([i] * TPB, [i]) for i in range(3)]
            assert all(r.ok for r in kv.wait(ids, timeout=30).values())  # device copies done, disk writes held
            before = kv.stats()
            assert before.tasks.transfers_running == 3  # what the limit counts: the held disk writes
            with pytest.raises(TooManyTasks, match=r"put_async refused: 3 tasks in flight \(max_tasks_in_flight=3; "):
                kv.put_async([9] * TPB, [9])
            with pytest.raises(TooManyTasks, match="get_async refused"):
                kv.get_async([0] * TPB, [10])
            after = kv.stats()
            assert after.tasks.in_flight == before.tasks.in_flight
            assert after.host.used_blocks == before.host.used_blocks
        finally:
            gate.set()
        idle(kv)
        assert_no_leaks(kv)
        t = kv.get_async([0] * TPB, [10])
        assert kv.wait([t])[t].num_tokens == TPB
