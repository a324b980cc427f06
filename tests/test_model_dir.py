"""The self-made model directory loads in transformers the way Dynamo's frontend loads it."""

import json

import pytest

from dynamo_flexkv.dynamo.model_dir import write_model_dir
from dynamo_flexkv.engine import EngineModelConfig

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
