"""Block hashing that matches Dynamo's KV router (formats: docs/WIRE_FORMATS.md).

* tokens hash of a full block: xxh3_64 of its token ids as little-endian uint32, seed 1337
  (+ xxh3_64(lora_name, seed 0), + xxh3_64(cache_salt, seed 1); empty strings count as absent).
  These are exactly what ``dynamo._core.compute_block_hash_for_seq`` returns.
* sequence hash: ``seq[0] = tok[0]``, ``seq[i] = xxh3_64(LE u64 seq[i-1] || LE u64 tok[i])``;
  unique per prefix, so it keys the offload index and is the router's opaque block hash.

A trailing partial block is never hashed. The hot loop runs in ``dynamo_flexkv.core._native`` with
the GIL released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import xxhash

from dynamo_flexkv.core import native as _native

TOKENS_HASH_SEED: int = _native.TOKENS_HASH_SEED
_U64 = (1 << 64) - 1
_MAX_TOKEN = (1 << 32) - 1

TokenIds = Sequence[int] | np.ndarray | Any  # Any: a torch tensor (torch is optional here)


@dataclass(frozen=True)
class BlockHashes:
    """Hashes of the full blocks of one prompt: ``tokens[i]`` and ``sequence[i]`` are u64."""

    tokens: np.ndarray
    sequence: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return int(self.sequence.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the hashed (full) blocks."""
        return len(self) * self.block_size


@lru_cache(maxsize=1024)
def tokens_hash_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of the tokens hash for an adapter and a tenant salt, as Dynamo computes it."""
    seed = TOKENS_HASH_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)) & _U64
    if cache_salt:
        seed = (seed + xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8"), seed=1)) & _U64
    return seed


def block_hashes(
    token_ids: TokenIds,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> BlockHashes:
    """Tokens and sequence hashes of every full block of ``token_ids``.

    ``token_ids`` may be a list or tuple of ints, a 1-D numpy integer array or a 1-D torch tensor.
    Ids must lie in ``[0, 2**32)``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    seed = tokens_hash_seed(lora_name or None, cache_salt or None)
    tokens, sequence = _native.block_hashes(_as_native_tokens(token_ids), int(block_size), seed)
    return BlockHashes(tokens=tokens, sequence=sequence, block_size=int(block_size))


def namespaced_hashes(
    token_ids: TokenIds,
    block_size: int,
    namespace: str | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> BlockHashes:
    """block_hashes of a namespace's tiers: the namespace (a KVManager's, the node cache's tenant)
    salts every hash together with the request's own cache_salt."""
    salt = "/".join(s for s in (namespace, cache_salt) if s) or None
    return block_hashes(token_ids, block_size, lora_name=lora_name, cache_salt=salt)


def chain_hashes(tokens_hashes: np.ndarray, parent: int | None = None) -> np.ndarray:
    """Sequence hashes for tokens hashes, continuing the chain after ``parent`` when given."""
    arr = np.ascontiguousarray(tokens_hashes, dtype=np.uint64)
    return _native.chain_hashes(arr, parent)


def _as_native_tokens(token_ids: TokenIds) -> list | tuple | np.ndarray:
    """Lists and tuples go to native code as they are (it checks each item); arrays and tensors
    are range-checked here, vectorized, and passed as a contiguous uint32 buffer."""
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if type(token_ids).__module__.startswith("torch"):
        tensor: Any = token_ids  # torch is optional here: no import for its type
        token_ids = tensor.detach().cpu().numpy()
    if not isinstance(token_ids, np.ndarray):
        raise TypeError(
            f"token_ids must be a list or tuple of ints, a numpy array or a torch tensor, "
            f"got {type(token_ids).__name__}"
        )
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
    if token_ids.dtype.kind not in "iu":
        raise TypeError(
            f"token_ids must have an integer dtype, got {token_ids.dtype}: "
            "convert with .astype(np.int64) only if the values really are token ids"
        )
    if token_ids.dtype == np.uint32:
        return np.ascontiguousarray(token_ids)
    if token_ids.size:
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi > _MAX_TOKEN:
            bad = int(np.flatnonzero((token_ids < 0) | (token_ids > _MAX_TOKEN))[0])
            raise ValueError(
                f"token_ids[{bad}] = {int(token_ids[bad])} is out of range: token ids must be in [0, 2**32)"
            )
    return np.ascontiguousarray(token_ids, dtype=np.uint32)
