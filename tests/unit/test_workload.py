"""Trace replay: conversations are recovered from shared hash_id prefixes, and the scaled token
streams share exactly the prefixes the trace says they share."""

import json

import pytest

from dynamo_flexkv.workload import Scale, conversation_ids, load_trace, trace_turns

RECORDS = [  # two conversations interleaved; both start with the shared system block 0
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 5, "input_length": 700, "output_length": 10, "hash_ids": [0, 7]},
    {"timestamp": 9, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 12, "input_length": 1100, "output_length": 10, "hash_ids": [0, 7, 8]},
    {"timestamp": 20, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 30, "input_length": 600, "output_length": 10, "hash_ids": [0, 9]},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_conversations_follow_extended_prefixes(trace):
    assert conversation_ids(load_trace(trace)) == [0, 1, 0, 1, 0, 2]


def test_turns_share_exactly_the_trace_prefix(trace):
    scale = Scale(conversations=2, min_turns=2, max_turns=3, tokens_per_hash_block=64, max_prompt_tokens=10_000)
    turns = trace_turns(scale, trace)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    first, second, third = [t for t in turns if t.conversation == 0]
    assert len(first.tokens) == 1000 * 64 // 512
    assert second.tokens[: len(first.tokens)] == first.tokens  # blocks 0 and 1 (the second one partial)
    assert third.tokens[: len(second.tokens)] == second.tokens  # the earlier prompt, cut mid-block
    other = [t for t in turns if t.conversation == 1][0]
    assert other.tokens[:64] == first.tokens[:64] and other.tokens[64:128] != first.tokens[64:128]
    assert all(0 <= x < scale.token_vocab for t in turns for x in t.tokens)


def test_bad_traces_are_named(tmp_path, trace):
    with pytest.raises(ValueError, match="only 2 conversations"):
        trace_turns(Scale(conversations=3, tokens_per_hash_block=64), trace)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a trace record"):
        load_trace(bad)


def test_the_trace_ships_inside_the_package():
    """A clone (or an installed wheel) alone has the trace, unchanged: the SHA-256 its README states."""
    import hashlib
    import lzma
    import re

    from dynamo_flexkv.workload import SHIPPED_TRACE

    readme = (SHIPPED_TRACE.parent / "README.md").read_text()
    assert "Apache License 2.0" in readme and "kvcache-ai/Mooncake" in readme
    stated = re.search(r"`([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256(lzma.open(SHIPPED_TRACE).read()).hexdigest() == stated
    trace = load_trace()  # the default is the shipped file
    assert len(trace) == 12031 and trace[0].hash_ids[:2] == (0, 1)
    assert conversation_ids(trace)[:3] == [0, 1, 2]


def test_xz_and_plain_traces_read_the_same(tmp_path, trace):
    import lzma

    packed = tmp_path / "trace.jsonl.xz"
    packed.write_bytes(lzma.compress(trace.read_bytes()))
    assert load_trace(packed) == load_trace(trace)
    with pytest.raises(FileNotFoundError, match="pass --trace PATH"):
        load_trace(tmp_path / "missing.jsonl")


def test_scale_rejects_nonsense():
    with pytest.raises(ValueError, match="min-turns=3 > max-turns=2"):
        Scale(min_turns=3, max_turns=2)
    with pytest.raises(ValueError, match="tokens-per-hash-block=0"):
        Scale(tokens_per_hash_block=0)
