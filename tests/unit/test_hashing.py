"""Hashing must equal Dynamo's router hashes bit for bit (docs/WIRE_FORMATS.md)."""

import random

import numpy as np
import pytest
import torch
import xxhash

from dynamo_flexkv.core.hashing import block_hashes, chain_hashes

dynamo_core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is installed by make test")


def _chain_reference(tokens_hashes):
    out = []
    for i, t in enumerate(tokens_hashes):
        if i == 0:
            out.append(t)
        else:
            out.append(xxhash.xxh3_64_intdigest(out[-1].to_bytes(8, "little") + t.to_bytes(8, "little")))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_tokens_hashes_equal_dynamo_randomized(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16, 32, 64, 128])
    n = rng.randrange(0, 40 * block_size)
    vocab = rng.choice([2, 32000, 128256, 2**32])
    tokens = [rng.randrange(vocab) for _ in range(n)]
    lora = rng.choice([None, "", "adapter-a", "ünïcode-lora"])
    salt = rng.choice([None, "", "tenant-1", "salt with spaces"])
    ours = block_hashes(tokens, block_size, lora_name=lora, cache_salt=salt)
    theirs = dynamo_core.compute_block_hash_for_seq(tokens, block_size, lora_name=lora, cache_namespace=salt)
    assert ours.tokens.tolist() == theirs
    assert len(ours) == n // block_size
    assert ours.sequence.tolist() == _chain_reference(theirs)


def test_inputs_in_every_form_hash_alike():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 2**31, size=16 * 50 + 7, dtype=np.int64)
    ref = block_hashes(arr.tolist(), 16)
    for form in (
        arr,
        arr.astype(np.uint32),
        arr.astype(np.uint64),
        torch.from_numpy(arr),
        tuple(arr.tolist()),
        arr[::-1].copy()[::-1],
    ):
        got = block_hashes(form, 16)
        assert np.array_equal(got.tokens, ref.tokens)
        assert np.array_equal(got.sequence, ref.sequence)


def test_partial_block_is_not_hashed_and_prefixes_agree():
    tokens = list(range(100))
    full = block_hashes(tokens, 16)
    assert len(full) == 6 and full.num_tokens == 96
    head = block_hashes(tokens[:48], 16)
    assert full.sequence[:3].tolist() == head.sequence.tolist()


def test_sequence_hash_depends_on_whole_prefix_but_tokens_hash_does_not():
    a = block_hashes([1] * 16 + [7] * 16, 16)
    b = block_hashes([2] * 16 + [7] * 16, 16)
    assert a.tokens[1] == b.tokens[1]
    assert a.sequence[1] != b.sequence[1]


def test_lora_and_salt_isolate():
    tokens = list(range(64))
    plain = block_hashes(tokens, 16).sequence.tolist()
    assert block_hashes(tokens, 16, lora_name="x").sequence.tolist() != plain
    assert block_hashes(tokens, 16, cache_salt="t").sequence.tolist() != plain
    assert block_hashes(tokens, 16, lora_name="", cache_salt="").sequence.tolist() == plain


def test_chain_continues_after_parent():
    full = block_hashes(list(range(160)), 16)
    tail = chain_hashes(full.tokens[4:], parent=int(full.sequence[3]))
    assert tail.tolist() == full.sequence[4:].tolist()


@pytest.mark.parametrize(
    "bad, exc, words",
    [
        ([1, 2, -1, 4], ValueError, "token_ids[2] = -1 is out of range"),
        ([1, 2**32], ValueError, "token_ids[1] = 4294967296 is out of range"),
        ([1, 2.0], TypeError, "token_ids[1] is float"),
        (np.array([1, -5]), ValueError, "token_ids[1] = -5"),
        (np.array([1.0, 2.0]), TypeError, "integer dtype"),
        (np.array([True, False]), TypeError, "integer dtype"),
        (np.zeros((2, 2), dtype=np.int64), ValueError, "1-D"),
        (torch.tensor([0.5]), TypeError, "integer dtype"),
        ("1234", TypeError, "list or tuple"),
    ],
)
def test_bad_token_ids_are_rejected_clearly(bad, exc, words):
    with pytest.raises(exc) as info:
        block_hashes(bad, 2)
    assert words in str(info.value)


@pytest.mark.parametrize("bs", [0, -16, 1.5, True])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], bs)
