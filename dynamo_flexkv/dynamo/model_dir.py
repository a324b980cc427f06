"""A local Hugging Face-style model directory for the reference engine, made here because nothing
can be downloaded: config.json (Llama architecture and shape of a preset), a byte-level
tokenizer.json (every byte one token, so any text round-trips), tokenizer_config.json with a chat
template. Dynamo's register_model and frontend read exactly these files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

from dynamo_flexkv.engine.config import EngineModelConfig

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_model_dir(cfg: EngineModelConfig, path: Union[str, Path], name: str = "flexkv-reference",
                    context_length: int = 131072) -> Path:
    """Writes (or rewrites) the directory; the token ids stay below ``cfg.vocab_size``, and the
    context window the worker serves is what config.json and the tokenizer declare."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if len(alphabet) + len(SPECIALS) > cfg.vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is too small for a byte-level tokenizer "
                         f"({len(alphabet) + len(SPECIALS)} tokens)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    _replace(path / "tokenizer.json", tok.to_str())
    bos, eos = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])
    _replace(path / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
        "model_max_length": context_length, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=2))
    _replace(path / "config.json", json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": context_length, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": cfg.dtype, "tie_word_embeddings": False,
    }, indent=2))
    _replace(path / "generation_config.json", json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return path


def _replace(target: Path, text: str) -> None:
    """Atomic rewrite: several workers may write one directory while the frontend reads it."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
