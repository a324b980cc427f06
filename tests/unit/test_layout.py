"""Byte math of the three layouts checked against real arrays of those shapes."""

import itertools

import numpy as np
import pytest

from dynamo_flexkv.core.layout import KVLayout, KVLayoutType, ModelSpec


@pytest.mark.parametrize("kind", list(KVLayoutType))
@pytest.mark.parametrize("kv_dim", [1, 2])
def test_chunk_offsets_address_the_right_elements(kind, kv_dim):
    model = ModelSpec(num_layers=3, num_kv_heads=2, head_size=4, dtype="float32", kv_dim=kv_dim)
    layout = KVLayout(kind, model, tokens_per_block=4, num_blocks=5)
    arr = np.arange(np.prod(layout.shape()), dtype=np.float32).reshape(layout.shape())
    flat = arr.reshape(-1).view(np.uint8)
    assert flat.nbytes == layout.total_bytes == 5 * layout.block_bytes
    for block, layer, kv in itertools.product(range(5), range(3), range(kv_dim)):
        if kind is KVLayoutType.LAYERFIRST:
            chunk = arr[layer, kv, block]
        elif kind is KVLayoutType.BLOCKFIRST:
            chunk = arr[block, layer, kv]
        else:
            chunk = arr[layer, block, kv]
        off = int(layout.chunk_offsets(np.array([block]), layer, kv)[0])
        got = flat[off : off + layout.chunk_bytes].view(np.float32).reshape(chunk.shape)
        assert np.array_equal(got, chunk)


def test_mla_and_sizes():
    mla = ModelSpec(num_layers=61, num_kv_heads=1, head_size=576, dtype="bfloat16", kv_dim=1)
    layout = KVLayout(KVLayoutType.BLOCKFIRST, mla, 64, 10)
    assert layout.block_bytes == 61 * 64 * 576 * 2
    assert mla.token_bytes() * 64 == layout.block_bytes


def test_layer_shape():
    m = ModelSpec(num_layers=2, num_kv_heads=2, head_size=8)
    assert KVLayout(KVLayoutType.LAYERBLOCK, m, 16, 7).layer_shape() == (7, 2, 16, 2, 8)
    with pytest.raises(ValueError, match="BLOCKFIRST has no per-layer tensors"):
        KVLayout(KVLayoutType.BLOCKFIRST, m, 16, 7).layer_shape()


@pytest.mark.parametrize("kind", list(KVLayoutType))
def test_strides_agree_with_offsets(kind):
    model = ModelSpec(num_layers=3, num_kv_heads=2, head_size=4, dtype="float16")
    layout = KVLayout(kind, model, tokens_per_block=4, num_blocks=5)
    sb, sl, sk = layout.strides()
    ids = np.arange(5)
    for layer in range(3):
        for kv in range(2):
            assert np.array_equal(layout.chunk_offsets(ids, layer, kv), ids * sb + layer * sl + kv * sk)
