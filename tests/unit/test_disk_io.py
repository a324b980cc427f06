"""Native batch I/O with checksums taken as each op completes (DiskMover's read and write path):
the sums are xxh3_64 of the bytes that landed, on io_uring and on the pread/pwrite pool, and a
block changed on disk behind the store's back is refused."""

import os

import numpy as np
import pytest
import xxhash

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import DiskEntry, SsdStore
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.core.transfer.movers import ChecksumError, DiskMover

ENGINES = [pytest.param(True, id="io_uring"), pytest.param(False, id="pread-pool")]


def _engine(use_uring: bool) -> None:
    if use_uring and not _native.uring_available():
        pytest.skip(
            "io_uring is not available here (kernel or seccomp refuses it); the pread-pool case runs "
            "instead, and this one runs wherever io_uring works"
        )


@pytest.mark.parametrize("use_uring", ENGINES)
def test_file_io_checksums_are_xxh3_of_the_bytes_moved(tmp_path, use_uring):
    _engine(use_uring)
    rng = np.random.default_rng(0)
    # Odd lengths too: short inputs take other xxh3 code paths than the AVX2 bulk loop.
    lens = np.array([0, 1, 17, 240, 241, 4096, 100_003, 1 << 20, 3 << 20], dtype=np.uint64)
    src = rng.integers(0, 256, int(lens.sum()), dtype=np.uint8)
    dst = np.zeros_like(src)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
    fd = os.open(tmp_path / "blocks", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        file_offsets = np.uint64(src.size) - starts - lens  # mirrored: not the buffer's order
        args = (np.full(lens.size, fd, np.int32), file_offsets)
        wrote = _native.file_io(*args, np.uint64(src.ctypes.data) + starts, lens, True, 4, use_uring, 3, True)
        read = _native.file_io(*args, np.uint64(dst.ctypes.data) + starts, lens, False, 4, use_uring, 3, True)
        assert _native.file_io(*args, np.uint64(dst.ctypes.data) + starts, lens, False, 4, use_uring, 3) is None
    finally:
        os.close(fd)
    assert np.array_equal(src, dst)
    want = [xxhash.xxh3_64_intdigest(src[int(s) : int(s + n)].tobytes()) for s, n in zip(starts, lens)]
    assert wrote.tolist() == want and read.tolist() == want
    assert _native.checksums(src.ctypes.data, starts[lens == lens[-1]], int(lens[-1])).tolist() == want[-1:]


@pytest.mark.parametrize("use_uring", ENGINES)
def test_read_past_end_of_file_raises(tmp_path, use_uring):
    _engine(use_uring)
    buf = np.zeros(8192, dtype=np.uint8)
    fd = os.open(tmp_path / "short", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        with pytest.raises(OSError, match="failed on op 1"):
            _native.file_io(
                np.full(2, fd, np.int32),
                np.array([0, 4096], np.uint64),
                np.array([buf.ctypes.data, buf.ctypes.data + 4096], np.uint64),
                np.full(2, 4096, np.uint64),
                False,
                2,
                use_uring,
                2,
                True,
            )
    finally:
        os.close(fd)


@pytest.fixture
def disk(tmp_path):
    model = ModelSpec(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16")  # 16 KiB blocks
    host = HostPool(KVLayout(KVLayoutType.BLOCKFIRST, model, 16, 8), pin=False)
    ssd = SsdStore([str(tmp_path / "ssd")], 8, host.layout.block_bytes, {"test": "disk_io"})
    yield host, ssd
    ssd.close()
    host.close()


@pytest.mark.parametrize("use_uring", ENGINES)
def test_disk_mover_round_trip_and_corrupt_block_refused(disk, tmp_path, use_uring):
    _engine(use_uring)
    host, ssd = disk
    mover = DiskMover(host, ssd, depth=4, use_uring=use_uring, threads=2)
    host.array[:] = np.random.default_rng(1).integers(0, 256, host.nbytes, dtype=np.uint8)
    kept = host.array.copy()
    src, dst = np.arange(4), np.array([5, 2, 7, 0])
    op = TransferOp(OpKind.H2DISK, src, dst)
    mover.run(op)
    bb = host.layout.block_bytes
    assert op.result.tolist() == [xxhash.xxh3_64_intdigest(kept[b * bb : (b + 1) * bb].tobytes()) for b in src]
    ssd.record_stored(DiskEntry(d, d, None, c) for d, c in zip(dst.tolist(), op.result.tolist()))
    host.array[:] = 0
    mover.run(TransferOp(OpKind.DISK2H, dst, np.array([7, 6, 5, 4])))
    blocks = host.array.reshape(8, bb)
    assert all(np.array_equal(blocks[7 - b], kept[b * bb : (b + 1) * bb]) for b in src)
    assert np.array_equal(mover.read_for_adoption(dst, np.arange(4)), op.result)
    # Flip bytes of disk block 2 in its file: that block, and only it, is refused.
    _, offsets = ssd.locate(np.array([2]))
    path = next(p for p in (tmp_path / "ssd").iterdir() if p.name.endswith(".kv"))
    with open(path, "r+b") as f:
        f.seek(int(offsets[0]) + 100)
        f.write(b"\xff" * 64)
    with pytest.raises(ChecksumError) as err:
        mover.run(TransferOp(OpKind.DISK2H, dst, np.array([7, 6, 5, 4])))
    assert err.value.disk_ids == [2]


def test_disk_writes_move_whole_blocks(disk):
    host, ssd = disk
    with pytest.raises(ValueError, match="op.layers must be None"):
        DiskMover(host, ssd).run(TransferOp(OpKind.H2DISK, np.arange(2), np.arange(2), layers=(0, 1)))
