"""The self-made model directory loads in transformers the way Dynamo's frontend loads it."""

import json

import pytest

from dynamo_flexkv.integrations.dynamo_worker.model_dir import SPECIALS, write_hf_cache_entry, write_model_dir
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

transformers = pytest.importorskip("transformers", reason="installed with ai-dynamo's requirements by make test")


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_tokenizer_round_trips_and_fits_the_vocab(tmp_path, preset):
    cfg = EngineModelConfig.preset(preset)
    d = write_model_dir(cfg, tmp_path / preset)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    text = "KV cache offload: Héllo, wörld! 你好 \n\t end"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < cfg.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert max(chat) < cfg.vocab_size and tok.decode(chat).endswith("<|user|>hi<|assistant|>")
    conf = json.loads((d / "config.json").read_text())
    assert EngineModelConfig.from_hf_dir(d, block_size=cfg.block_size).kv_spec() == cfg.kv_spec()
    assert conf["eos_token_id"] == tok.eos_token_id


def test_vocab_too_small(tmp_path):
    cfg = EngineModelConfig.from_dict({**EngineModelConfig.preset("tiny").__dict__, "vocab_size": 100})
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        write_model_dir(cfg, tmp_path)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_every_id_decodes_to_text_and_encoding_stays_byte_level(tmp_path, preset):
    """A model emits any id below vocab_size: each decodes to non-empty text (so a streaming
    frontend has a delta to send for it), the fillers past the specials are distinct, and encoding
    still gives one byte token per byte (ids below 256) plus the specials, never a filler."""
    cfg = EngineModelConfig.preset(preset)
    tok = transformers.AutoTokenizer.from_pretrained(str(write_model_dir(cfg, tmp_path / preset)))
    assert len(tok) == cfg.vocab_size
    texts = tok.batch_decode([[i] for i in range(cfg.vocab_size)])
    assert [i for i, t in enumerate(texts) if not t] == []
    assert [tok.convert_ids_to_tokens(i) for i in range(256, 261)] == SPECIALS
    fillers = texts[256 + len(SPECIALS) :]
    assert len(set(fillers)) == len(fillers) and all(t.startswith(" ") and t[1:].isalpha() for t in fillers)
    text = "".join(fillers[:50]) + " Héllo 你好 \x00\n" + SPECIALS[2] + "ba be"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(i < 256 for i in ids if i != tok.convert_tokens_to_ids(SPECIALS[2]))
    assert len(ids) == len(text.replace(SPECIALS[2], "").encode()) + 1


def test_a_hub_cache_entry_loads_by_repo_id_offline(tmp_path):
    """What aiperf does with --tokenizer flexkv/tiny and HF_HUB_CACHE: a repo id, offline."""
    cfg = EngineModelConfig.preset("tiny")
    d = write_model_dir(cfg, tmp_path / "model")
    snapshot = write_hf_cache_entry(d, tmp_path / "hub", "flexkv/tiny")
    assert snapshot == write_hf_cache_entry(d, tmp_path / "hub", "flexkv/tiny")  # same files: same revision
    repo = tmp_path / "hub" / "models--flexkv--tiny"
    assert (repo / "refs" / "main").read_text() == snapshot.name and snapshot.parent == repo / "snapshots"
    tok = transformers.AutoTokenizer.from_pretrained(
        "flexkv/tiny", cache_dir=str(tmp_path / "hub"), local_files_only=True
    )
    assert tok.decode([300, 301]) == " mu na" and tok.eos_token_id == 257
    with pytest.raises(ValueError, match="expected ORG/NAME"):
        write_hf_cache_entry(d, tmp_path / "hub", "tiny")


def test_a_seeded_preset_writes_the_reference_engines_weights_as_a_checkpoint(tmp_path):
    """vLLM serving the directory computes the reference engine's model: the weight file holds
    exactly ``LlamaModel``'s seeded weights under Hugging Face Llama names, in the preset's dtype."""
    import torch

    from dynamo_flexkv.integrations.reference_engine.model import LlamaModel

    cfg = EngineModelConfig.preset("tiny")
    assert cfg.weights == "seeded"
    d = write_model_dir(cfg, tmp_path / "m", weights=True)
    loaded, ours = LlamaModel.from_pretrained(d), LlamaModel(cfg, seed=0)
    assert loaded.w.keys() == ours.w.keys()
    assert all(torch.equal(loaded.w[k], ours.w[k]) for k in ours.w)
    assert not (write_model_dir(cfg, tmp_path / "no-weights") / "model.safetensors").exists()
    snapshot = write_hf_cache_entry(d, tmp_path / "hub", "flexkv/tiny")  # binary files copy too
    assert (snapshot / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()


def test_a_dummy_preset_writes_no_weights_and_unknown_kinds_are_refused(tmp_path):
    cfg = EngineModelConfig.preset("llama-3.1-8b")  # far too large to write: vLLM's dummy weights
    assert cfg.weights == "dummy"
    with pytest.raises(ValueError, match="weights='random': use one of"):
        EngineModelConfig.from_dict({**EngineModelConfig.preset("tiny").__dict__, "weights": "random"})
