"""A small Llama-style decoder over a paged KV cache: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP. Deterministic random weights from a seed, or real weights from a local
Hugging Face directory (config.json + *.safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig
from dynamo_flexkv.integrations.reference_engine.kv_cache import PagedKVCache, torch_dtype

# Our weight names -> Hugging Face Llama's (the per-layer ones with "{i}.").
_HF_LAYER = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
}


def hf_names(num_layers: int) -> dict[str, str]:
    """Each weight's name here -> its name in a Hugging Face Llama checkpoint."""
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    for i in range(num_layers):
        names.update({f"{i}.{short}": f"model.layers.{i}.{hf}.weight" for short, hf in _HF_LAYER.items()})
    return names


def seeded_weights(cfg: EngineModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights at a trained model's scale (projections N(0, 1/fan_in), norms
    near 1), float32: attention is peaked enough that the output depends on the whole prompt (with
    vLLM's ``--load-format dummy``, uniform weights of +-1e-3, greedy tokens follow the last prompt
    token only)."""
    c, g = cfg, torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    w = {
        "embed": torch.randn(c.vocab_size, c.hidden_size, generator=g),
        "norm": 1.0 + 0.1 * torch.randn(c.hidden_size, generator=g),
        "lm_head": lin(c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        w[f"{i}.q"] = lin(c.num_heads * c.head_dim, c.hidden_size)
        w[f"{i}.k"] = lin(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[f"{i}.v"] = lin(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[f"{i}.o"] = lin(c.hidden_size, c.num_heads * c.head_dim)
        w[f"{i}.gate"] = lin(c.intermediate_size, c.hidden_size)
        w[f"{i}.up"] = lin(c.intermediate_size, c.hidden_size)
        w[f"{i}.down"] = lin(c.hidden_size, c.intermediate_size)
        w[f"{i}.ln1"] = 1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)
        w[f"{i}.ln2"] = 1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)
    return w


def seeded_checkpoint(cfg: EngineModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """``seeded_weights`` named as a Hugging Face Llama checkpoint, in the model's dtype: what
    vLLM (or ``LlamaModel.from_pretrained``) loads to compute this very model."""
    dtype = torch_dtype(cfg.dtype)
    names = hf_names(cfg.num_layers)
    return {names[k]: v.to(dtype).contiguous() for k, v in seeded_weights(cfg, seed).items()}


@dataclass
class SeqChunk:
    """New tokens of one sequence in a forward pass: positions [start, start + len(tokens))."""

    tokens: list[int]
    start: int
    block_table: list[int]
    want_logits: bool = True


class LlamaModel:
    def __init__(
        self,
        cfg: EngineModelConfig,
        device: str | torch.device = "cpu",
        seed: int = 0,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = torch_dtype(cfg.dtype)
        self.w = weights if weights is not None else self._random_weights(seed)
        self.w = {k: v.to(self.device, self.dtype) for k, v in self.w.items()}
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.inv_freq = inv.to(self.device, torch.float32)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> LlamaModel:
        from safetensors.torch import load_file

        cfg = EngineModelConfig.from_hf_dir(path)
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        raw: dict[str, torch.Tensor] = {}
        for f in files:
            raw.update(load_file(str(f)))
        raw.setdefault("lm_head.weight", raw["model.embed_tokens.weight"])  # tied embeddings
        return cls(cfg, device, weights={ours: raw[hf] for ours, hf in hf_names(cfg.num_layers).items()})

    def _random_weights(self, seed: int) -> dict[str, torch.Tensor]:
        return seeded_weights(self.cfg, seed)

    # ---- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, chunks: list[SeqChunk], kv: PagedKVCache, before_attention: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Computes the chunks' new tokens, writing their K/V into ``kv``; returns the logits of the
        last new token of each chunk with ``want_logits`` ([n, vocab], float32).
        ``before_attention(layer)`` runs before each layer reads cached K/V (layerwise loading)."""
        c, dev = self.cfg, self.device
        tokens = torch.tensor([t for ch in chunks for t in ch.tokens], device=dev)
        positions = torch.cat([torch.arange(ch.start, ch.start + len(ch.tokens), device=dev) for ch in chunks])
        slots = torch.cat([self._slots(ch) for ch in chunks])
        cos, sin = self._rope(positions)
        h = self.w["embed"][tokens]
        bounds = torch.tensor([0] + [len(ch.tokens) for ch in chunks]).cumsum(0).tolist()
        for layer in range(c.num_layers):
            x = _rms_norm(h, self.w[f"{layer}.ln1"], c.rms_norm_eps)
            q = (x @ self.w[f"{layer}.q"].T).view(-1, c.num_heads, c.head_dim)
            k = (x @ self.w[f"{layer}.k"].T).view(-1, c.num_kv_heads, c.head_dim)
            v = (x @ self.w[f"{layer}.v"].T).view(-1, c.num_kv_heads, c.head_dim)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            if before_attention is not None:
                before_attention(layer)
            kv.write(layer, slots, k, v)
            out = torch.empty_like(q)
            for i, ch in enumerate(chunks):
                lo, hi = bounds[i], bounds[i + 1]
                out[lo:hi] = self._attend(q[lo:hi], kv, layer, ch)
            h = h + out.reshape(-1, c.num_heads * c.head_dim) @ self.w[f"{layer}.o"].T
            x = _rms_norm(h, self.w[f"{layer}.ln2"], c.rms_norm_eps)
            h = h + (F.silu(x @ self.w[f"{layer}.gate"].T) * (x @ self.w[f"{layer}.up"].T)) @ self.w[f"{layer}.down"].T
        last = [bounds[i + 1] - 1 for i, ch in enumerate(chunks) if ch.want_logits]
        hl = _rms_norm(h[last], self.w["norm"], c.rms_norm_eps)
        return (hl @ self.w["lm_head"].T).float()

    def _slots(self, ch: SeqChunk) -> torch.Tensor:
        bs = self.cfg.block_size
        pos = torch.arange(ch.start, ch.start + len(ch.tokens))
        table = torch.tensor(ch.block_table, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def _attend(self, q: torch.Tensor, kv: PagedKVCache, layer: int, ch: SeqChunk) -> torch.Tensor:
        c = self.cfg
        end = ch.start + len(ch.tokens)
        k, v = kv.gather(layer, ch.block_table, end)  # [end, kvh, d]
        group = c.num_heads // c.num_kv_heads
        # [1, heads, tokens, dim] with K/V repeated per group: the fused (flash) CPU and CUDA
        # kernels take this form; enable_gqa falls back to a much slower path on CPU.
        qh = q.transpose(0, 1)[None]
        kh = k.transpose(0, 1).repeat_interleave(group, 0)[None]
        vh = v.transpose(0, 1).repeat_interleave(group, 0)[None]
        if ch.start == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        elif q.device.type == "cpu" and _CPU_FLASH is not None:
            o = _suffix_attention_cpu(qh, kh, vh, ch.start)
        else:
            rows = torch.arange(ch.start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return o[0].transpose(0, 1)

    def _rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _suffix_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of queries at positions [start, end) over keys [0, end): the cached prefix
    [0, start) is fully visible and the new part is plain causal, so run the fused kernel on each
    and merge by log-sum-exp. An explicit mask would make the CPU kernel visit every tile."""
    flash = _CPU_FLASH
    if flash is None:  # the caller checked: this torch has it
        raise RuntimeError("torch lacks aten._scaled_dot_product_flash_attention_for_cpu")
    o1, l1 = flash(q, k[:, :, :start], v[:, :, :start])
    o2, l2 = flash(q, k[:, :, start:], v[:, :, start:], is_causal=True)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
