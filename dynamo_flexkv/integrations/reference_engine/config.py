"""Model description of the reference engine: a preset (configs/models/*.yaml, shipped in the wheel
too; see dynamo_flexkv.resources), or a local HF directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from dynamo_flexkv.core.layout import ModelSpec
from dynamo_flexkv.resources import presets_dir

WEIGHTS = ("seeded", "dummy")


@dataclass(frozen=True)
class EngineModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"
    block_size: int = 16
    kv_dim: int = 2
    # What a vLLM worker serving this preset loads (the reference engine always computes the seeded
    # weights): "seeded", the reference engine's seeded weights written as model.safetensors, so
    # the output depends on the whole prompt and wrong KV shows in tokens and logprobs; "dummy",
    # vLLM's --load-format dummy (no weight file: for shapes too large to write, where only speed
    # or bytes matter; greedy tokens then follow the last prompt token only).
    weights: str = "dummy"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(
                f"weights={self.weights!r}: use one of {list(WEIGHTS)} (seeded: a weight file with the "
                "reference engine's seeded weights; dummy: vLLM's --load-format dummy)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def preset(cls, name: str) -> EngineModelConfig:
        presets = presets_dir()
        path = presets / f"{name}.yaml"
        if not path.is_file():
            have = sorted(p.stem for p in presets.glob("*.yaml"))
            raise ValueError(
                f"unknown model preset {name!r} (presets in {presets}): use one of {have} "
                "or a model directory holding a config.json"
            )
        return cls.from_dict(yaml.safe_load(path.read_text()))

    @classmethod
    def from_hf_dir(cls, path: str | Path, block_size: int = 16) -> EngineModelConfig:
        """Reads a Llama-style config.json (the architecture the reference engine computes)."""
        cfg = json.loads((Path(path) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            dtype={"bfloat16": "bfloat16", "float16": "float16"}.get(cfg.get("torch_dtype", ""), "float32"),
            block_size=block_size,
        )

    @classmethod
    def load(cls, name_or_path: str) -> EngineModelConfig:
        p = Path(name_or_path)
        return cls.from_hf_dir(p) if (p / "config.json").is_file() else cls.preset(name_or_path)

    def kv_spec(self) -> ModelSpec:
        """The KV shape the offload tiers store."""
        return ModelSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
            kv_dim=self.kv_dim,
        )
