"""A local Hugging Face-style model directory for the reference engine, made here because nothing
can be downloaded: config.json (Llama architecture and shape of a preset), a byte-level
tokenizer.json (every byte one token, so any text round-trips), tokenizer_config.json with a chat
template. Dynamo's register_model and frontend read exactly these files.

Token ids: 0-255 the byte tokens, 256-260 the special tokens (``SPECIALS``), and every id from 261
up to the model's ``vocab_size`` a filler word (" ba", " be", ... " bebaka"): an entry of the BPE
vocabulary with no merge that builds it, so encoding never produces one, while decoding one gives
a short distinct piece of text. A model with random weights emits ids all over its vocabulary;
without the fillers most of them decoded to nothing and the frontend streamed no chunk for them.

``write_hf_cache_entry`` lays a written directory out as a Hugging Face hub cache entry, for tools
that take a repo id and read the hub cache offline (aiperf's ``--tokenizer ORG/NAME``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dynamo_flexkv.integrations.reference_engine.config import EngineModelConfig
from dynamo_flexkv.resources import hf_preset

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]
FILLER_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75 two-letter syllables
CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_model_dir(
    cfg: EngineModelConfig,
    path: str | Path,
    name: str = "flexkv-reference",
    context_length: int = 131072,
    weights: bool = False,
) -> Path:
    """Writes (or rewrites) the directory; the token ids stay below ``cfg.vocab_size``, and the
    context window the worker serves is what config.json and the tokenizer declare. With
    ``weights`` and a preset of ``weights: seeded``, also model.safetensors: the reference engine's
    seeded weights, which vLLM then loads (without it, vLLM needs ``--load-format dummy``)."""
    path = Path(path)
    bos, eos = _write_tokenizer(path, cfg.vocab_size, context_length)
    _replace(
        path / "config.json",
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "_name_or_path": name,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "intermediate_size": cfg.intermediate_size,
                "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_norm_eps,
                "max_position_embeddings": context_length,
                "bos_token_id": bos,
                "eos_token_id": eos,
                "torch_dtype": cfg.dtype,
                "tie_word_embeddings": False,
            },
            indent=2,
        ),
    )
    _replace(path / "generation_config.json", json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    if weights and cfg.weights == "seeded":
        write_seeded_weights(cfg, path)
    return path


def _write_tokenizer(path: Path, vocab_size: int, context_length: int) -> tuple[int, int]:
    """tokenizer.json and tokenizer_config.json for ``vocab_size`` ids; returns (bos, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if len(alphabet) + len(SPECIALS) > vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer ({len(alphabet) + len(SPECIALS)} tokens)"
        )
    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(alphabet)}  # the byte tokens (ByteLevel's printable stand-ins)
    vocab.update((t, len(alphabet) + i) for i, t in enumerate(SPECIALS))  # specials: ids 256-260, as before
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    space = byte_level.pre_tokenize_str(" ")[0][0]  # "Ġ": how ByteLevel writes the space byte
    for i in range(vocab_size - len(vocab)):
        vocab[space + filler_word(i)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=False))  # no merges: only bytes encode
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # already in the vocabulary: they keep their ids
    _replace(path / "tokenizer.json", tok.to_str())
    _replace(
        path / "tokenizer_config.json",
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIALS[0],
                "eos_token": SPECIALS[1],
                "model_max_length": context_length,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        ),
    )
    bos, eos = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])
    if bos is None or eos is None:
        raise RuntimeError(f"the tokenizer written to {path} lacks its special tokens {SPECIALS[:2]}")
    return bos, eos


def write_preset(model: str, path: str | Path, context_length: int = 131072, weights: bool = False) -> Path:
    """The model directory of preset ``model``: a reference-engine preset (configs/models/<model>.yaml,
    write_model_dir) or a Hugging Face architecture's (configs/models/<model>/config.json): that
    config, the byte-level tokenizer and, with ``weights``, seeded weights (seeded_hf_weights)."""
    preset = hf_preset(model)
    if preset is None:
        return write_model_dir(EngineModelConfig.load(model), path, context_length=context_length, weights=weights)
    path = Path(path)
    cfg = json.loads((preset / "config.json").read_text())
    bos, eos = _write_tokenizer(path, int(cfg["vocab_size"]), context_length)
    cfg.update(
        _name_or_path=model,
        bos_token_id=bos,
        eos_token_id=eos,
        max_position_embeddings=max(int(cfg.get("max_position_embeddings", 0)), context_length),
    )
    _replace(path / "config.json", json.dumps(cfg, indent=2))
    _replace(path / "generation_config.json", json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    if weights:
        from safetensors.torch import save_file

        target = path / "model.safetensors"
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        save_file(seeded_hf_weights(cfg), str(tmp), metadata={"format": "pt", "flexkv_seed": "0"})
        os.replace(tmp, target)
    return path


def seeded_hf_weights(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Deterministic random weights for any Hugging Face causal-LM architecture ``config`` names,
    at a trained model's scale as the reference engine's (reference_engine/model.py): matrices
    N(0, 1/fan_in) (MoE experts and routers too), embeddings N(0, 1) (N(0, 1/hidden) when tied to
    the output: else every greedy token has probability 1), norms near their identity
    (1 + 0.1 N, or 0.1 N for Gemma's zero-centered ones), biases 0.02 N. Names and shapes come
    from transformers' model class built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    dtype = getattr(torch, str(config.get("torch_dtype", "float32")))
    zero_centered = str(config.get("model_type", "")).startswith("gemma")
    g = torch.Generator().manual_seed(seed)
    out = {}
    tied = bool(config.get("tie_word_embeddings"))
    for name, p in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        shape = tuple(p.shape)
        if "embed" in name:  # tied: it is the output matrix too, at its scale (logits ~ N(0, 1))
            w = torch.randn(shape, generator=g) / (shape[-1] ** 0.5 if tied else 1.0)
        elif len(shape) >= 2:
            w = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        elif "norm" in name:
            w = 0.1 * torch.randn(shape, generator=g) + (0.0 if zero_centered else 1.0)
        elif "correction_bias" in name:
            w = torch.zeros(shape)
        else:
            w = 0.02 * torch.randn(shape, generator=g)
        out[name] = w.to(dtype).contiguous()
    return out


def write_seeded_weights(cfg: EngineModelConfig, path: str | Path, seed: int = 0) -> Path:
    """model.safetensors in ``path``: the reference engine's seeded weights for ``cfg`` (float32
    for the small presets: ~80 MB for ``small``), written atomically."""
    from safetensors.torch import save_file

    from dynamo_flexkv.integrations.reference_engine.model import seeded_checkpoint

    target = Path(path) / "model.safetensors"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    save_file(seeded_checkpoint(cfg, seed), str(tmp), metadata={"format": "pt", "flexkv_seed": str(seed)})
    os.replace(tmp, target)
    return target


def write_hf_cache_entry(model_dir: str | Path, hub_cache: str | Path, repo_id: str) -> Path:
    """Copies ``model_dir``'s files into a Hugging Face hub cache as the repo ``repo_id`` ("ORG/NAME"):
    ``hub_cache/models--ORG--NAME/snapshots/<revision>/`` and ``refs/main`` naming that revision (a
    hash of the files, so rewriting the same directory is a no-op). With ``HF_HUB_CACHE=hub_cache``
    and ``HF_HUB_OFFLINE=1``, ``AutoTokenizer.from_pretrained(repo_id)`` loads it, which is how aiperf
    (whose workers force offline mode and take a path as a repo id) reads our tokenizer:
    ``aiperf profile --tokenizer ORG/NAME`` with ``HF_HUB_CACHE`` set. Returns the snapshot folder."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(c in repo_id for c in " \\") or ".." in repo_id:
        raise ValueError(f"repo id {repo_id!r}: expected ORG/NAME, e.g. flexkv/small")
    files = sorted(f for f in Path(model_dir).iterdir() if f.is_file() and not f.name.startswith("."))
    if not any(f.name == "tokenizer.json" for f in files):
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json: write it with write_model_dir first")
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    revision = digest.hexdigest()
    repo = Path(hub_cache) / f"models--{parts[0]}--{parts[1]}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        _replace(snapshot / f.name, f.read_bytes())
    (repo / "refs").mkdir(exist_ok=True)
    _replace(repo / "refs" / "main", revision)
    return snapshot


def filler_word(n: int) -> str:
    """The n-th filler word: n written in base 75 with a syllable per digit (distinct for each n)."""
    word = ""
    while True:
        n, d = divmod(n, len(FILLER_SYLLABLES))
        word = FILLER_SYLLABLES[d] + word
        if not n:
            return word


def _replace(target: Path, content: str | bytes) -> None:
    """Atomic rewrite: several workers may write one directory while the frontend reads it."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    if isinstance(content, bytes):
        tmp.write_bytes(content)
    else:
        tmp.write_text(content)
    os.replace(tmp, target)
