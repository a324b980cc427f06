"""The model's KV cache groups, as vLLM's hybrid KV cache manager forms them, and what the
connector does with each.

vLLM gives each group of layers with one KV cache spec a block table of its own. A model of one
attention type has one group; a hybrid one (Gemma 3, gpt-oss: sliding-window layers beside full
attention) has a group per window position and one or more full-attention groups, their layers
packed into the same tensors (a block id belongs to one group at a time). The connector offloads:

* full attention and MLA: every block of a prefix (MLA's latent is one "head", K and V together);
* sliding window: only the window a hit needs, ``window_blocks`` blocks before the hit point
  (vLLM's own prefix cache needs exactly those: single_type_kv_cache_manager.py);

and refuses, at start and naming the layers, what it cannot offload correctly: Mamba and linear
attention state, chunked local attention, encoder-decoder cross attention, and anything else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FULL = ("full_attention", "mla_attention")
WINDOW = ("sliding_window",)


@dataclass(frozen=True)
class KVGroup:
    index: int  # vLLM's group index (KV events' group_idx)
    kind: str  # vLLM's KVCacheSpecKind value
    block_size: int
    window: int  # sliding window in tokens; 0 for full attention
    layer_names: tuple[str, ...]

    @property
    def sliding(self) -> bool:
        return self.kind in WINDOW

    @property
    def window_blocks(self) -> int:
        """Blocks before a hit point that a hit needs: all of them for full attention (0 here), the
        ``ceil((window - 1) / block_size)`` that hold the tokens the next position attends to for a
        sliding window."""
        return -(-(self.window - 1) // self.block_size) if self.sliding else 0


def read_groups(kv_cache_config: Any) -> list[KVGroup]:
    """vLLM's KV cache groups (vllm.v1.kv_cache_interface.KVCacheConfig); a clear error for a
    group the connector cannot offload. No config (vLLM's scheduler before 0.11): one full group."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec) or 0
        out.append(KVGroup(i, kind, int(spec.block_size), int(window), tuple(g.layer_names)))
    check_groups(out)
    return out


def check_groups(groups: Sequence[KVGroup]) -> None:
    refused = [g for g in groups if g.kind not in FULL + WINDOW]
    if refused:
        what = "; ".join(
            f"group {g.index} ({g.kind}): {', '.join(g.layer_names[:4])}{' ...' if len(g.layer_names) > 4 else ''}"
            for g in refused
        )
        raise ValueError(
            f"FlexKVConnector: this model has KV cache layers the connector cannot offload: {what}. "
            "It offloads full attention, MLA and sliding-window attention; Mamba or linear-attention "
            "state, chunked local attention and encoder-decoder caches are not offloaded. Serve "
            "this model without FlexKVConnector (offload: false)"
        )
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ValueError(
            f"FlexKVConnector: the KV cache groups have different block sizes {sorted(sizes)}; the "
            "connector needs one (set --block-size so vLLM uses it for every group)"
        )


def latent(groups: Sequence[KVGroup]) -> bool:
    """MLA: one latent per token and layer, the same on every tensor-parallel rank."""
    return bool(groups) and all(g.kind == "mla_attention" for g in groups)


def is_hybrid(groups: Sequence[KVGroup]) -> bool:
    """More than one group, or a sliding window: the connector's group tiers (hybrid.py)."""
    return len(groups) > 1 or any(g.sliding for g in groups)


def aux_share(groups: Sequence[KVGroup], block_size: int, max_model_len: int) -> float:
    """The share of the host and disk budget for the groups beside the main one (hybrid.py): their
    blocks per stored request against every group's, for a request half the context long (a
    window's blocks are few: Gemma-3-like, 2 of 3 groups windows of 4 blocks, 128-block context:
    12%); at most 90%, the main group's tiers need room even when it has no group of its own."""
    n = max(1, max_model_len // block_size // 2)
    full = sum(1 for g in groups if g.kind in FULL)
    main = 1 if full else 0
    aux = (full - main) * n + sum(min(g.window_blocks, n) for g in groups if g.sliding)
    total = main * n + aux
    return min(0.9, aux / total) if total else 0.0
