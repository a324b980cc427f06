"""The native gather/scatter copier (``_native.copy_chunks``) behind every host<->device copy on
the CPU: whatever the chunk sizes, alignments, orders and thread counts, each destination byte
is its source byte and no byte outside the chunks changes. Small moves take the memcpy path,
8 MiB and more the streaming path with its prefetch of the next short run."""

import numpy as np
import pytest

from dynamo_flexkv.core import native as _native


@pytest.mark.parametrize("seed", range(6))
def test_random_chunks_land_exactly_and_touch_nothing_else(seed):
    rng = np.random.default_rng(seed)
    big = seed % 2 == 0  # the streaming path (>= 8 MiB) or the memcpy path
    n = int(rng.integers(600, 1500)) if big else int(rng.integers(5, 200))
    # Lengths from 1 byte to 70 KiB: below 64 B, below the 4 KiB streaming floor, around the
    # 16 KiB prefetch window and the 64 KiB short-run bound.
    lens = rng.choice([1, 63, 64, 4095, 4097, 16 << 10, (16 << 10) + 5, 40000, 64 << 10, 70000], size=n)
    lens = lens.astype(np.uint64)
    gap = rng.integers(0, 3, size=n).astype(np.uint64) * 4096 + rng.integers(0, 64, size=n).astype(np.uint64)
    src_off = np.concatenate([[0], np.cumsum(lens + gap)[:-1]]).astype(np.uint64) + 7
    src = rng.integers(0, 256, int(src_off[-1] + lens[-1]) + 64, dtype=np.uint8)
    # Destinations: the same chunks in a random order, some adjacent (they merge), unaligned.
    order = rng.permutation(n)
    dgap = (rng.integers(0, 2, size=n) * rng.integers(1, 200, size=n)).astype(np.uint64)
    dst_off = np.empty(n, dtype=np.uint64)
    pos = np.uint64(3)
    for i in order:
        dst_off[i] = pos
        pos += lens[i] + dgap[i]
    dst = np.full(int(pos) + 64, 0xA5, dtype=np.uint8)
    want = dst.copy()
    for s, d, k in zip(src_off.tolist(), dst_off.tolist(), lens.tolist()):
        want[d : d + k] = src[s : s + k]
    if big:
        assert int(lens.sum()) >= 8 << 20  # else this case would not reach the streaming path
    threads = int(rng.integers(1, 5))
    _native.copy_chunks(dst.ctypes.data + dst_off, src.ctypes.data + src_off, lens, threads)
    assert np.array_equal(dst, want)


def test_one_contiguous_streaming_copy_is_exact():
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, (24 << 20) + 13, dtype=np.uint8)
    dst = np.zeros(src.size + 32, dtype=np.uint8)
    one = lambda a: np.array([a], dtype=np.uint64)  # noqa: E731
    _native.copy_chunks(one(dst.ctypes.data + 5), one(src.ctypes.data), one(src.size), 4)
    assert np.array_equal(dst[5 : 5 + src.size], src) and not dst[:5].any() and not dst[5 + src.size :].any()


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_kv_grid_copy_moves_each_chunk_to_its_place(seed, block_major):
    """copy_kv_grid (every CPU host<->device copy): chunk (layer, block, kv) goes from its address
    on one side to its address on the other, for any strides, ids and order; bytes outside the
    chunks stay as they were. Big enough grids take the streaming path."""
    rng = np.random.default_rng(seed)
    layers, kv = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    chunk = int(rng.choice([64, 4096, 8192 + 16, 16 << 10]))
    nblocks = int(rng.integers(1, 300)) if seed else 700
    # src: per-layer tensors [block][kv][chunk] with a padded block; dst: blockfirst [block][layer][kv].
    s_sk, s_sb = chunk, kv * chunk + int(rng.integers(0, 2)) * 64
    d_sk, d_sl = chunk, kv * chunk
    d_sb = layers * d_sl
    src_blocks = nblocks * 2
    src = [rng.integers(0, 256, src_blocks * s_sb, dtype=np.uint8) for _ in range(layers)]
    dst = np.full(nblocks * d_sb + 128, 0x5A, dtype=np.uint8)
    src_ids = rng.choice(src_blocks, size=nblocks, replace=False).astype(np.uint64)
    dst_ids = rng.permutation(nblocks).astype(np.uint64)
    want = dst.copy()
    for layer in range(layers):
        for b in range(nblocks):
            for k in range(kv):
                s0 = int(src_ids[b]) * s_sb + k * s_sk
                d0 = 64 + int(dst_ids[b]) * d_sb + layer * d_sl + k * d_sk
                want[d0 : d0 + chunk] = src[layer][s0 : s0 + chunk]
    src_base = np.array([a.ctypes.data for a in src], dtype=np.uint64)
    dst_base = np.uint64(dst.ctypes.data + 64) + np.arange(layers, dtype=np.uint64) * np.uint64(d_sl)
    _native.copy_kv_grid(
        dst_base,
        dst_ids,
        d_sb,
        d_sk,
        src_base,
        src_ids,
        s_sb,
        s_sk,
        kv,
        chunk,
        block_major=block_major,
        threads=int(rng.integers(1, 5)),
    )
    assert np.array_equal(dst, want)


def test_the_kv_grid_copy_refuses_mismatched_sides():
    ids = np.arange(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="one base per layer"):
        _native.copy_kv_grid(
            np.zeros(2, np.uint64), ids, 0, 0, np.zeros(3, np.uint64), ids, 0, 0, 1, 64, block_major=False
        )


@pytest.mark.parametrize("bad", [np.array([-1], dtype=np.int64), np.array([4.7]), np.array([4], dtype=np.int32)])
def test_the_copies_take_only_unsigned_64_bit_arrays(bad):
    """A signed or float array is refused, not cast: -1 would wrap to 2**64 - 1 bytes (or an id
    before the buffer) and 4.7 would silently copy 4 bytes."""
    buf = np.zeros(64, dtype=np.uint8)
    addr = np.array([buf.ctypes.data], dtype=np.uint64)
    with pytest.raises(TypeError):
        _native.copy_chunks(addr, addr + np.uint64(32), bad, 1)
    with pytest.raises(TypeError):
        _native.copy_kv_grid(addr, bad, 0, 0, addr, np.zeros(1, np.uint64), 0, 0, 1, 8, block_major=False)


@pytest.mark.parametrize("heads", [1, 8])  # 2 KiB (device order both ways) and 64 KiB (host order for H2D) runs
def test_the_cpu_mover_round_trips_random_blocks_in_either_copy_order(heads):
    import torch

    from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec
    from dynamo_flexkv.core.storage.device import DeviceCache
    from dynamo_flexkv.core.storage.host import HostPool
    from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
    from dynamo_flexkv.core.transfer.movers import SHORT_RUN_BYTES, HostDeviceMover

    model = ModelSpec(num_layers=3, num_kv_heads=heads, head_size=128, dtype="bfloat16")
    host = HostPool(KVLayout(KVLayoutType.BLOCKFIRST, model, 16, 40), pin=False)
    assert (host.layout.model.kv_dim * host.layout.chunk_bytes < SHORT_RUN_BYTES) == (heads == 1)
    layers = [
        torch.randint(-(2**15), 2**15, (80, 2, 16, heads, 128), dtype=torch.int16).view(torch.bfloat16)
        for _ in range(3)
    ]
    mover = HostDeviceMover(host, DeviceCache.register(layers, model, KVLayoutType.LAYERBLOCK, 16), threads=3)
    rng = np.random.default_rng(heads)
    dev_ids, host_ids = rng.choice(80, 40, replace=False), rng.permutation(40)
    want = [layer.view(torch.int16).clone() for layer in layers]
    mover.run(TransferOp(OpKind.D2H, dev_ids, host_ids))
    back = rng.choice(80, 40, replace=False)  # other device blocks, layers 1-2 only
    mover.run(TransferOp(OpKind.H2D, host_ids, back, layers=(1, 3)))
    for i, (layer, before) in enumerate(zip(layers, want)):
        got = layer.view(torch.int16)
        expect = before.clone()
        if i >= 1:
            expect[torch.as_tensor(back)] = before[torch.as_tensor(dev_ids)]
        assert torch.equal(got, expect), f"layer {i}"
    host.close()
