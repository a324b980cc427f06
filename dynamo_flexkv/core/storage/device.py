"""The engine's KV tensors as registered with the manager (the device tier, owned by the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dynamo_flexkv.core.layout import DTYPE_BYTES, KVLayout, KVLayoutType, ModelSpec

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}  # each a torch dtype's own name


@dataclass
class DeviceCache:
    layout: KVLayout
    tensors: list[torch.Tensor]  # one per layer, or a single tensor holding every layer

    @classmethod
    def register(
        cls,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        model: ModelSpec,
        layout_type: KVLayoutType,
        tokens_per_block: int,
    ) -> DeviceCache:
        """Validates the engine's tensors against the model and layout; errors say what differs."""
        layout_type = KVLayoutType.parse(layout_type)
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not ts:
            raise ValueError("register_device_cache: no tensors given")
        per_layer = len(ts) > 1 or (model.num_layers == 1 and ts[0].dim() == 5)
        if per_layer and len(ts) != model.num_layers:
            raise ValueError(
                f"register_device_cache: {len(ts)} tensors for {model.num_layers} layers: "
                "pass one tensor per layer or one tensor for all layers"
            )
        if per_layer and layout_type is KVLayoutType.BLOCKFIRST:
            raise ValueError("register_device_cache: BLOCKFIRST keeps all layers in one tensor; pass one tensor")
        want_dtype = TORCH_DTYPES[model.dtype]
        devices = {t.device for t in ts}
        if len(devices) != 1:
            raise ValueError(f"register_device_cache: tensors on several devices {sorted(map(str, devices))}")
        device = next(iter(devices))
        if device.type not in ("cpu", "cuda"):  # the copies read and write their memory directly
            raise ValueError(
                f"register_device_cache: tensors on {device.type!r}; the KV caches must live in CPU or CUDA memory"
            )
        for i, t in enumerate(ts):
            if t.dtype != want_dtype:
                raise ValueError(f"register_device_cache: tensor {i} has dtype {t.dtype}, the model says {want_dtype}")
            if not t.is_contiguous():
                raise ValueError(f"register_device_cache: tensor {i} is not contiguous")
        # Infer the block count from the first tensor, then require the exact shape.
        block_axis = {KVLayoutType.LAYERFIRST: 2, KVLayoutType.BLOCKFIRST: 0, KVLayoutType.LAYERBLOCK: 1}[layout_type]
        if per_layer:
            block_axis -= 1
        if ts[0].dim() <= block_axis:
            raise ValueError(
                f"register_device_cache: tensor of shape {tuple(ts[0].shape)} does not fit {layout_type.value}"
            )
        layout = KVLayout(layout_type, model, tokens_per_block, int(ts[0].shape[block_axis]))
        want = layout.layer_shape() if per_layer else layout.shape()
        for i, t in enumerate(ts):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"register_device_cache: tensor {i} has shape {tuple(t.shape)}, {layout_type.value} "
                    f"with this model and {tokens_per_block} tokens per block needs {want}"
                )
        return cls(layout, ts)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def per_layer(self) -> bool:
        return len(self.tensors) > 1 or self.tensors[0].dim() == 5

    def check_ids(self, block_ids: np.ndarray) -> None:
        ids = np.asarray(block_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError(f"device block id out of range [0, {self.num_blocks}): got {ids.min()}..{ids.max()}")

    def chunk_grid(self, lo: int, hi: int) -> tuple[np.ndarray, int, int]:
        """Where the chunks of layers [lo, hi) lie: (each layer's base address, block stride, kv
        stride); chunk (layer l, block b, kv k) is at ``base[l - lo] + b * block + k * kv``."""
        sb, sl, sk = self.layout.strides()
        if self.per_layer:
            base = np.array([self.tensors[i].data_ptr() for i in range(lo, hi)], dtype=np.uint64)
        else:
            base = np.uint64(self.tensors[0].data_ptr()) + np.arange(lo, hi, dtype=np.uint64) * np.uint64(sl)
        return base, int(sb), int(sk)

    def block_tensor(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as [block][kv][token][head][dim] (a view) — for torch gathers on CUDA."""
        if self.per_layer:
            t = self.tensors[layer]
            return t if self.layout.type is KVLayoutType.LAYERBLOCK else t.transpose(0, 1)
        t = self.tensors[0]
        if self.layout.type is KVLayoutType.BLOCKFIRST:
            return t[:, layer]
        if self.layout.type is KVLayoutType.LAYERBLOCK:
            return t[layer]
        return t[layer].transpose(0, 1)  # LAYERFIRST [kv][block] -> [block][kv]
