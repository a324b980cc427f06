"""Reads vLLM's paged KV tensors as they are, and describes them to KVManager.

vLLM hands the connector one tensor per attention layer. The byte order inside a block differs
by backend (CPU: ``[blocks, kv_heads, block_size, 2*head_size]``; FlashAttention on CUDA:
``[2, blocks, block_size, kv_heads, head_size]``, possibly with permuted strides). The offload
tiers only need each (layer, block) -- or each (layer, K|V, block) -- to be one contiguous span,
so the layout is read from the tensor's memory order instead of being assumed: the physical
block axis must be the outermost (LAYERBLOCK, one span per layer and block) or come right after a
K/V axis of size 2 (LAYERFIRST per layer, one span per layer, K|V and block). Stored blocks keep
vLLM's own byte order, which is part of the tier fingerprint (``layout_tag``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from dynamo_flexkv.core.layout import KVLayoutType, ModelSpec

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class VllmKV:
    model: ModelSpec
    layout: KVLayoutType
    tensors: list[torch.Tensor]  # views in the layout KVManager expects, one per layer, in layer order
    layer_names: list[str]  # vLLM's layer name of each
    layout_tag: str  # what makes these bytes incompatible with another engine's (fingerprint)

    def layer_index(self, kv_caches: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
        """vLLM's layer name -> the index of its tensor here (every layer sharing a tensor: its index)."""
        out = {name: i for i, name in enumerate(self.layer_names)}
        if kv_caches:
            ptrs = {kv_caches[name].data_ptr(): i for i, name in enumerate(self.layer_names)}
            out.update({name: ptrs[t.data_ptr()] for name, t in kv_caches.items() if t.data_ptr() in ptrs})
        return out


def _layer_order(names: list[str]) -> list[str]:
    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.findall(name)
        return (int(m[0]) if m else 1 << 30, name)

    return sorted(names, key=key)


def _unique_storage(kv_caches: dict[str, torch.Tensor], names: list[str]) -> list[str]:
    """The first layer of each tensor: a hybrid model's KV cache groups pack one layer of each
    group into the same tensor (a block id belongs to one group at a time), so copying a block of
    each distinct tensor moves a block of any group."""
    seen, out = set(), []
    for name in names:
        t = kv_caches[name]
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def describe(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int, latent: bool = False) -> VllmKV:
    """Checks vLLM's tensors and returns them as KVManager views; the errors name what differs.
    ``latent``: MLA, one latent vector per token (K and V together), not two halves."""
    if not kv_caches:
        raise ValueError("FlexKVConnector: vLLM registered no KV cache tensors (no attention layers?)")
    names = _unique_storage(kv_caches, _layer_order(list(kv_caches)))
    first = kv_caches[names[0]]
    if first.dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"FlexKVConnector: KV cache dtype {first.dtype} is not supported; use one of "
            f"{sorted(_DTYPE_NAMES.values())}"
        )
    views, layout, per_block = [], None, None
    for name in names:
        t = kv_caches[name]
        if t.dtype != first.dtype or t.shape != first.shape or t.device != first.device:
            raise ValueError(
                f"FlexKVConnector: layer {name} has {t.dtype} {tuple(t.shape)} on {t.device}, layer "
                f"{names[0]} {first.dtype} {tuple(first.shape)} on {first.device}: layers of different "
                "shapes (hybrid or sliding-window models) are not supported"
            )
        # Memory order: dims sorted by stride, outermost first (a permuted view is read as laid out).
        strides = t.stride()
        order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
        phys = t.permute(order)
        if not phys.is_contiguous():
            raise ValueError(
                f"FlexKVConnector: layer {name}'s KV tensor (shape {tuple(t.shape)}, strides "
                f"{t.stride()}) is not dense in memory"
            )
        shape = tuple(phys.shape)
        if shape[0] == num_blocks:
            this, tail = KVLayoutType.LAYERBLOCK, shape[1:]
        elif len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
            this, tail = KVLayoutType.LAYERFIRST, shape[2:]
        else:
            raise ValueError(
                f"FlexKVConnector: cannot find the block axis ({num_blocks} blocks) of layer {name}'s "
                f"KV tensor, laid out as {shape}: it must be outermost, or follow a K/V axis of 2"
            )
        elems = math.prod(tail)
        if layout not in (None, this) or per_block not in (None, elems):
            raise ValueError(f"FlexKVConnector: layer {name} is laid out unlike layer {names[0]}")
        layout, per_block = this, elems
        views.append(phys)
    assert layout is not None and per_block is not None  # names is not empty: the loop set both
    if per_block % block_size:
        raise ValueError(f"FlexKVConnector: a block of {per_block} elements is not {block_size} tokens")
    if layout is KVLayoutType.LAYERFIRST:  # K|V is the outer axis: each span is one of them
        kv_dim, width = 2, per_block // block_size
    else:  # one span holds K and V: two halves, or one latent (MLA)
        kv_dim = 1 if latent or per_block % (2 * block_size) else 2
        width = per_block // (kv_dim * block_size)
    model = ModelSpec(
        num_layers=len(names), num_kv_heads=1, head_size=width, dtype=_DTYPE_NAMES[first.dtype], kv_dim=kv_dim
    )
    # The views KVManager's LAYERBLOCK / LAYERFIRST per-layer shapes expect (same memory).
    lead = (num_blocks, kv_dim) if layout is KVLayoutType.LAYERBLOCK else (kv_dim, num_blocks)
    tensors = [v.reshape(*lead, block_size, 1, width) for v in views]
    if any(v.data_ptr() != t.data_ptr() for v, t in zip(tensors, views)):
        raise RuntimeError("FlexKVConnector: could not view vLLM's KV tensors without a copy")
    tag = f"vllm:{layout.value}:{'x'.join(map(str, views[0].shape[1 if layout is KVLayoutType.LAYERBLOCK else 2 :]))}"
    return VllmKV(model, layout, tensors, names, tag)
