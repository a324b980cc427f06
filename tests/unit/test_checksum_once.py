"""Checksum once: a host block's xxh3_64 is taken when its bytes land (a put's HASH op right after
its D2H; disk and remote reads record what they verified) and reused by its disk and remote writes.
The danger is a stale checksum: a slot reused for other bytes must never hand the old block's
checksum to a write. These tests try every way of rewriting a slot and check that what the journal
and the Redis header get is always the xxh3 of the bytes actually written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from redis_fixtures import needs_redis, redis_server  # noqa: F401 (fixture)

from dynamo_flexkv.core import native as _native  # the access point the code calls through
from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
from dynamo_flexkv.core.remote import RemoteStore, fingerprint_of
from dynamo_flexkv.core.remote.codec import HEADER
from dynamo_flexkv.core.remote.resp import RespConnection
from dynamo_flexkv.core.storage.device import DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import DiskEntry, SsdStore
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.core.transfer.movers import ChecksumError, DiskMover, HostDeviceMover, HostHasher
from dynamo_flexkv.core.transfer.remote_mover import RemoteMover, RemoteShortRead

MODEL = ModelSpec(num_layers=4, num_kv_heads=2, head_size=64, dtype="bfloat16")  # 32 KiB blocks
TPB = 16
HOST_BLOCKS = 8
DEV_BLOCKS = 16


def xxh(buf) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(buf).tobytes())


class Rig:
    """A host pool between CPU "device" tensors, a disk store and (optionally) Redis."""

    def __init__(self, tmp_path, url=None, use_uring=None) -> None:
        self.host = HostPool(KVLayout(KVLayoutType.BLOCKFIRST, MODEL, TPB, HOST_BLOCKS), pin=False)
        self.layers = [
            torch.zeros(DEV_BLOCKS, 2, TPB, MODEL.num_kv_heads, MODEL.head_size, dtype=torch.bfloat16)
            for _ in range(MODEL.num_layers)
        ]
        self.device = DeviceCache.register(self.layers, MODEL, KVLayoutType.LAYERBLOCK, TPB)
        self.d2h = HostDeviceMover(self.host, self.device, threads=2)
        self.hasher = HostHasher(self.host)
        self.ssd = SsdStore([str(tmp_path / "ssd")], 16, self.host.layout.block_bytes, {"test": "checksum_once"})
        self.disk = DiskMover(self.host, self.ssd, depth=4, use_uring=use_uring, threads=2)
        self.store = self.remote = None
        if url is not None:
            self.store = RemoteStore.open(url, fingerprint_of({"test": "checksum_once"}), timeout_s=5)
            self.remote = RemoteMover(self.host, self.store)
        self.rng = np.random.default_rng(0)

    def fill_device(self, dev_id: int) -> None:
        """New random bytes in every layer of device block ``dev_id``."""
        for layer in self.layers:
            layer[dev_id] = torch.from_numpy(self.rng.standard_normal(layer[dev_id].shape, dtype=np.float32))

    def host_bytes(self, host_id: int) -> np.ndarray:
        bb = self.host.layout.block_bytes
        return self.host.array[host_id * bb : (host_id + 1) * bb]

    def put(self, dev_ids, host_ids, layers=None) -> None:
        """A put's D2H, then (whole blocks) its HASH op, as GraphBuilder.put chains them."""
        self.d2h.run(TransferOp(OpKind.D2H, np.asarray(dev_ids), np.asarray(host_ids), layers=layers))
        if layers is None:
            self.hasher.run(TransferOp(OpKind.HASH, np.asarray(host_ids), np.asarray(host_ids)))

    def write_disk(self, host_ids, disk_ids) -> np.ndarray:
        op = TransferOp(OpKind.H2DISK, np.asarray(host_ids), np.asarray(disk_ids))
        self.disk.run(op)
        self.ssd.record_stored(DiskEntry(d, 1000 + d, None, int(c)) for d, c in zip(disk_ids, op.result))
        return op.result

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.ssd.close()
        self.host.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_put_records_the_checksum_of_the_bytes_it_copied(rig):
    for d in range(DEV_BLOCKS):
        rig.fill_device(d)
    dev, host = np.array([9, 2, 14, 5, 0, 11]), np.array([3, 7, 0, 1, 6, 4])
    rig.put(dev, host)
    sums, known = rig.host.known_checksums(host)
    assert known.all()
    assert sums.tolist() == [xxh(rig.host_bytes(h)) for h in host]
    for d, h in zip(dev, host):
        want = torch.stack([layer[int(d)] for layer in rig.layers]).view(torch.uint8).numpy().ravel()
        assert np.array_equal(rig.host_bytes(int(h)), want)
    # A D2H alone (no HASH yet) leaves them unknown: its bytes are new.
    rig.d2h.run(TransferOp(OpKind.D2H, dev[:2], host[:2]))
    assert not rig.host.known_checksums(host[:2])[1].any()


def test_disk_write_reuses_the_recorded_checksum_without_hashing(rig, monkeypatch):
    rig.fill_device(1)
    rig.put([1], [5])
    calls = []
    real = _native.file_io
    monkeypatch.setattr(_native, "file_io", lambda *a: calls.append(a[-1]) or real(*a))
    sums = rig.write_disk([5], [3])
    assert calls == [False], "a block whose checksum the host pool knows was hashed again"
    assert sums.tolist() == [xxh(rig.host_bytes(5))]


def test_a_reused_slot_never_carries_the_old_blocks_checksum(rig, monkeypatch):
    """Slot 2 holds block A (checksum recorded), then gets other bytes by every path that writes
    slots; each time the next disk write must journal the xxh3 of what is there now."""
    rig.fill_device(0)
    rig.put([0], [2])
    a = xxh(rig.host_bytes(2))
    assert rig.host.known_checksums([2])[1].all()

    # 1. A partial (layer range) D2H rewrites some layers: no whole-block hash, the old one is dropped.
    rig.fill_device(1)
    rig.put([1], [2], layers=(0, 2))
    assert not rig.host.known_checksums([2])[1].any()
    now = xxh(rig.host_bytes(2))
    assert now != a
    assert rig.write_disk([2], [0]).tolist() == [now]

    # 2. A D2H that fails half way (some bytes landed, then an error) leaves the slot's checksum
    #    unknown, not stale.
    rig.fill_device(3)
    rig.put([3], [2])
    assert rig.host.known_checksums([2])[1].all()

    real_copy = _native.copy_kv_grid

    def torn_copy(dst_base, dst_ids, dsb, dsk, src_base, src_ids, *rest, **kw):
        real_copy(dst_base[:1], dst_ids, dsb, dsk, src_base[:1], src_ids, *rest, **kw)  # layer 0 lands, then it fails
        raise OSError("copy failed half way")

    rig.fill_device(5)
    with monkeypatch.context() as m:
        m.setattr(_native, "copy_kv_grid", torn_copy)
        with pytest.raises(OSError):
            rig.put([5], [2])
    assert not rig.host.known_checksums([2])[1].any()
    assert rig.write_disk([2], [5]).tolist() == [xxh(rig.host_bytes(2))]
    # An id out of range is refused before any byte moves: bytes and checksum stay as they were.
    rig.put([3], [2])
    with pytest.raises(IndexError):
        rig.put([DEV_BLOCKS + 5], [2])
    assert rig.host.known_checksums([2])[0].tolist() == [xxh(rig.host_bytes(2))]

    # 3. A disk read into the slot, verified: the recorded checksum is the block read.
    rig.fill_device(4)
    rig.put([4], [6])
    b = rig.write_disk([6], [1])[0]
    rig.disk.run(TransferOp(OpKind.DISK2H, np.array([1]), np.array([2])))
    assert rig.host.known_checksums([2])[0].tolist() == [b] == [xxh(rig.host_bytes(2))]

    # 4. A disk read that fails verification (torn block on disk): the slot holds unverified
    #    bytes and no checksum; a later write hashes what is there.
    rig.ssd.record_stored([DiskEntry(0, 1000, None, 12345)])  # journal disagrees with the bytes
    with pytest.raises(ChecksumError):
        rig.disk.run(TransferOp(OpKind.DISK2H, np.array([0]), np.array([2])))
    assert not rig.host.known_checksums([2])[1].any()
    assert rig.write_disk([2], [4]).tolist() == [xxh(rig.host_bytes(2))]

    # 5. Layer-by-layer disk reads forget at the first span and record only at the VERIFY.
    rig.disk.run(TransferOp(OpKind.DISK2H, np.array([1]), np.array([2]), layers=(0, 2)))
    assert not rig.host.known_checksums([2])[1].any()
    rig.disk.run(TransferOp(OpKind.DISK2H, np.array([1]), np.array([2]), layers=(2, 4)))
    rig.disk.run(TransferOp(OpKind.VERIFY, np.array([1]), np.array([2])))
    assert rig.host.known_checksums([2])[0].tolist() == [b]

    # 6. Adoption reads (restart) into scratch slots: nothing is recorded for them.
    rig.disk.read_for_adoption(np.array([1]), np.array([2]))
    assert not rig.host.known_checksums([2])[1].any()


def test_every_slot_rewritten_in_random_order_keeps_checksums_true(rig):
    """Random interleaving of whole and partial D2H, disk reads and disk writes over a few slots:
    after every step, every checksum the pool calls known is the xxh3 of the slot's bytes, and
    every journaled checksum is the xxh3 of the disk block's bytes (read back and compared)."""
    rng = np.random.default_rng(7)
    journal = {}
    for step in range(120):
        slot = int(rng.integers(HOST_BLOCKS))
        what = rng.integers(4)
        if what == 0:
            d = int(rng.integers(DEV_BLOCKS))
            rig.fill_device(d)
            rig.put([d], [slot])
        elif what == 1:
            d = int(rng.integers(DEV_BLOCKS))
            rig.fill_device(d)
            lo = int(rng.integers(MODEL.num_layers))
            rig.put([d], [slot], layers=(lo, lo + 1))
        elif what == 2 and journal:
            disk_id = int(rng.choice(list(journal)))
            rig.disk.run(TransferOp(OpKind.DISK2H, np.array([disk_id]), np.array([slot])))
        else:
            disk_id = int(rng.integers(16))
            journal[disk_id] = int(rig.write_disk([slot], [disk_id])[0])
            assert journal[disk_id] == xxh(rig.host_bytes(slot)), f"step {step}: stale checksum journaled"
        sums, known = rig.host.known_checksums(np.arange(HOST_BLOCKS))
        for h in np.flatnonzero(known):
            assert int(sums[h]) == xxh(rig.host_bytes(int(h))), f"step {step}: slot {h}'s checksum is stale"


@needs_redis
@pytest.mark.integration
def test_remote_puts_reuse_it_and_remote_reads_record_it(tmp_path, redis_server, monkeypatch):
    rig = Rig(tmp_path, redis_server.url)
    try:
        for d in range(4):
            rig.fill_device(d)
        rig.put([0, 1, 2], [0, 1, 2])
        want = [xxh(rig.host_bytes(h)) for h in range(3)]
        hashed = []
        real = _native.checksums
        monkeypatch.setattr(_native, "checksums", lambda *a: hashed.append(a) or real(*a))
        seq = [11, 12, 13]
        op = TransferOp(OpKind.H2REMOTE, np.array([0, 1, 2]), np.array([0, 1, 2]), seq_hashes=seq)
        rig.remote.run(op)
        assert op.result == 3 and hashed == [], "the remote write hashed blocks the pool already knew"
        key = rig.store.key(seq[0])
        conn = RespConnection("127.0.0.1", redis_server.port, timeout_s=5, connect_timeout_s=5)
        try:
            raw = conn.call(b"GET", key)
        finally:
            conn.close()
        assert HEADER.unpack(raw[: HEADER.size])[-1] == want[0]

        # The slots get other bytes (partial D2H), then a remote read of the same blocks into them:
        # the checksums recorded are the verified ones, equal to the bytes that landed.
        rig.fill_device(3)
        rig.put([3, 3, 3], [5, 6, 7], layers=(0, 1))
        assert not rig.host.known_checksums([5, 6, 7])[1].any()
        rig.remote.run(TransferOp(OpKind.REMOTE2H, np.array([5, 6, 7]), np.array([5, 6, 7]), seq_hashes=seq))
        assert rig.host.known_checksums([5, 6, 7])[0].tolist() == want
        assert [xxh(rig.host_bytes(h)) for h in (5, 6, 7)] == want

        # A short remote read (block 13 missing) records only the verified prefix.
        rig.store.delete([13])
        rig.put([3, 3, 3], [5, 6, 7], layers=(0, 1))
        with pytest.raises(RemoteShortRead):
            rig.remote.run(TransferOp(OpKind.REMOTE2H, np.array([5, 6, 7]), np.array([5, 6, 7]), seq_hashes=seq))
        sums, known = rig.host.known_checksums([5, 6, 7])
        assert known.tolist() == [True, True, False] and sums[:2].tolist() == want[:2]

        # Layer-by-layer remote reads record whole verified blocks at the last span only.
        rig.put([3, 3], [5, 6], layers=(0, 1))
        first = TransferOp(OpKind.REMOTE2H, np.array([5, 6]), np.array([5, 6]), seq_hashes=seq[:2], layers=(0, 2))
        rig.remote.run(first)
        assert not rig.host.known_checksums([5, 6])[1].any()
        rig.remote.run(
            TransferOp(
                OpKind.REMOTE2H, np.array([5, 6]), np.array([5, 6]), seq_hashes=seq[:2], layers=(2, 4), deps=(first,)
            )
        )
        assert rig.host.known_checksums([5, 6])[0].tolist() == want[:2]
    finally:
        rig.close()


@needs_redis
@pytest.mark.integration
def test_a_wrong_checksum_handed_to_put_is_refused_by_every_read(redis_server):
    """The guarantee does not rest on the reused checksum being right: a reader verifies every
    payload, so a wrong one costs a miss (recompute), never wrong bytes."""
    fp = fingerprint_of({"test": "checksum_once"})
    block = np.arange(4096, dtype=np.uint8)
    with RemoteStore.open(redis_server.url, fp, timeout_s=5) as store:
        assert store.put([21, 22], [block, block], checksums=[xxh(block) ^ 1, xxh(block)]) == 2
        dest = [np.zeros_like(block), np.zeros_like(block)]
        assert store.get_into([21, 22], dest) == 0
        assert store.get_into([22], dest[1:], parents=[21]) == 1 and np.array_equal(dest[1], block)


def test_a_freed_host_slot_forgets_its_checksum(tmp_path):
    """The manager's free hook: a host block evicted or removed from the index drops its slot's
    checksum, whatever writes the slot next."""
    from kv_helpers import MODEL as KMODEL
    from kv_helpers import config, device_tensors, fill

    from dynamo_flexkv import KVLayoutType, KVManager

    with KVManager(KMODEL, config(tmp_path, host_blocks=4, disk_blocks=8)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, 8)
        kv.register_device_cache(dev, KVLayoutType.LAYERBLOCK)
        prompts = [list(range(1000 * i, 1000 * i + 2 * kv.tokens_per_block)) for i in range(4)]
        for i, p in enumerate(prompts):
            for j, s in enumerate(kv.hashes(p).sequence):
                fill(dev, KVLayoutType.LAYERBLOCK, 2 * (i % 4) + j, int(s))
            t = kv.put_async(p, np.array([2 * (i % 4), 2 * (i % 4) + 1]))
            assert kv.wait([t], timeout=30)[t].ok
            assert kv.drain(30)
            # Every slot the pool calls known holds bytes with that checksum, evictions or not.
            sums, known = kv.host.known_checksums(np.arange(kv.host.num_blocks))
            bb = kv.host.layout.block_bytes
            for h in np.flatnonzero(known):
                assert int(sums[h]) == xxh(kv.host.array[h * bb : (h + 1) * bb]), f"prompt {i}: slot {h} stale"
        known = np.flatnonzero(kv.host.known_checksums(np.arange(kv.host.num_blocks))[1])
        assert known.size
        assert kv.evict("host") == len(known)  # every host block goes (disk keeps its copy), freeing its slot
        assert not kv.host.known_checksums(known)[1].any()
