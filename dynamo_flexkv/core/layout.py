"""KV-cache layouts and their byte math.

A *block* is ``tokens_per_block`` tokens of every layer, K and V (or one latent for MLA,
``kv_dim=1``). A *chunk* is one (block, layer, kv) slice: ``tokens_per_block * heads * head_size``
elements, always contiguous. Layouts differ in how chunks are ordered:

* LAYERFIRST  ``[layer][kv][block][token][head][dim]``  (FlexKV's GPU layout)
* BLOCKFIRST  ``[block][layer][kv][token][head][dim]``  (a block is one contiguous span: host/disk)
* LAYERBLOCK  ``[layer][block][kv][token][head][dim]``  (one tensor per layer, as vLLM keeps it)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class KVLayoutType(str, Enum):
    LAYERFIRST = "LAYERFIRST"
    BLOCKFIRST = "BLOCKFIRST"
    LAYERBLOCK = "LAYERBLOCK"

    @classmethod
    def parse(cls, value: Any) -> KVLayoutType:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown KV layout {value!r}: use one of {names}") from None


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache of a model looks like, per worker (after tensor parallel split)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kv_dim: int = 2  # 2: separate K and V; 1: one latent per token (MLA)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {name} must be a positive int, got {value!r}")
        if self.kv_dim not in (1, 2):
            raise ValueError(f"model kv_dim must be 2 (K and V) or 1 (MLA latent), got {self.kv_dim!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPE_BYTES)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model key(s) {unknown}: known keys are {sorted(known)}")
        return cls(**dict(data))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return self.num_layers * self.kv_dim * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class KVLayout:
    """Shape and byte offsets of ``num_blocks`` blocks of ``model`` in one layout."""

    type: KVLayoutType
    model: ModelSpec
    tokens_per_block: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.num_blocks <= 0:
            raise ValueError(
                f"layout needs positive tokens_per_block and num_blocks, got "
                f"{self.tokens_per_block} and {self.num_blocks}"
            )

    @property
    def chunk_elems(self) -> int:
        return self.tokens_per_block * self.model.num_kv_heads * self.model.head_size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (block, layer, kv) slice: the unit every layout keeps contiguous."""
        return self.chunk_elems * self.model.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.model.num_layers * self.model.kv_dim * self.chunk_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return self.model.kv_dim * self.chunk_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def shape(self) -> tuple[int, ...]:
        m, t = self.model, self.tokens_per_block
        tail = (t, m.num_kv_heads, m.head_size)
        if self.type is KVLayoutType.LAYERFIRST:
            return (m.num_layers, m.kv_dim, self.num_blocks, *tail)
        if self.type is KVLayoutType.BLOCKFIRST:
            return (self.num_blocks, m.num_layers, m.kv_dim, *tail)
        return (m.num_layers, self.num_blocks, m.kv_dim, *tail)

    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's tensor when the engine keeps one tensor per layer."""
        if self.type is KVLayoutType.BLOCKFIRST:
            raise ValueError("BLOCKFIRST has no per-layer tensors: register one tensor instead")
        return self.shape()[1:]

    def strides(self) -> tuple[int, int, int]:
        """Byte strides (block, layer, kv) of chunks: every layout is affine in the three, so
        offset = block * sb + layer * sl + kv * sk."""
        m, c, n = self.model, self.chunk_bytes, self.num_blocks
        if self.type is KVLayoutType.LAYERFIRST:
            return c, m.kv_dim * n * c, n * c
        if self.type is KVLayoutType.BLOCKFIRST:
            return m.num_layers * m.kv_dim * c, m.kv_dim * c, c
        return m.kv_dim * c, n * m.kv_dim * c, c

    def chunk_offsets(self, block_ids: np.ndarray, layer: int, kv: int) -> np.ndarray:
        """Byte offsets of chunk (block, layer, kv) for each block id, from the start of the whole
        (single-tensor) cache. Vectorized: the data plane gathers with these."""
        m, c = self.model, self.chunk_bytes
        blocks = np.asarray(block_ids, dtype=np.int64)
        if self.type is KVLayoutType.LAYERFIRST:
            return ((layer * m.kv_dim + kv) * self.num_blocks + blocks) * c
        if self.type is KVLayoutType.BLOCKFIRST:
            return ((blocks * m.num_layers + layer) * m.kv_dim + kv) * c
        return ((layer * self.num_blocks + blocks) * m.kv_dim + kv) * c

    def fingerprint(self) -> dict[str, Any]:
        """What must match for stored blocks to be readable by another process."""
        m = self.model
        return {
            "layout": self.type.value,
            "num_layers": m.num_layers,
            "num_kv_heads": m.num_kv_heads,
            "head_size": m.head_size,
            "dtype": m.dtype,
            "kv_dim": m.kv_dim,
            "tokens_per_block": self.tokens_per_block,
        }
