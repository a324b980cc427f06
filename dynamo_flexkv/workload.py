"""Multi-turn conversations from the Mooncake conversation trace, as token ids with arrival times.

The trace (shipped in ``dynamo_flexkv/data/traces``, see its README for provenance and license)
gives each request's prompt as ``hash_ids``, one per 512-token block; two requests sharing a
prefix of hash_ids share that prefix of tokens. A request continues a conversation when it extends
an earlier request's hash_ids (all but possibly the earlier last, partial block). Each hash_id
becomes ``tokens_per_hash_block`` deterministic token ids, so prefix sharing, and with it the
reachable hit rate, is exactly the trace's at a smaller scale.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

# The Mooncake conversation trace, xz-compressed package data (an installed wheel carries it too).
SHIPPED_TRACE = Path(__file__).resolve().parent / "data" / "traces" / "mooncake_conversation_trace.jsonl.xz"
TRACE_BLOCK = 512  # tokens per hash_id in the trace


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple


@dataclass(frozen=True)
class Turn:
    conversation: int  # rank of the conversation in the selection
    turn: int  # 0 for its first request
    timestamp_ms: int  # arrival in the trace, from its start
    tokens: list[int]
    output_tokens: int


@dataclass(frozen=True)
class Scale:
    """How the trace is scaled down for this machine (reported with every result)."""

    conversations: int = 32
    min_turns: int = 2  # multi-turn conversations: where a prompt reuses an earlier one's KV
    max_turns: int = 6
    tokens_per_hash_block: int = 64  # 512 in the trace: prompts x1/8, one trace block = one `small` KV block
    max_prompt_tokens: int = 2048  # turns beyond this are dropped (their conversation keeps earlier ones)
    max_output_tokens: int = 8  # decode is not what offload speeds up; a few tokens give inter-token latency
    token_vocab: int = 256  # ids below this (byte tokens of the generated tokenizer)

    def __post_init__(self) -> None:
        for name in (
            "conversations",
            "min_turns",
            "max_turns",
            "tokens_per_hash_block",
            "max_prompt_tokens",
            "max_output_tokens",
            "token_vocab",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.min_turns > self.max_turns:
            raise ValueError(f"min-turns={self.min_turns} > max-turns={self.max_turns}: lower min-turns")

    def describe(self) -> str:
        return (
            f"the first {self.conversations} conversations of {self.min_turns}-{self.max_turns} turns of the "
            f"Mooncake conversation trace (later turns dropped); each 512-token trace block -> "
            f"{self.tokens_per_hash_block} tokens (prompts x{self.tokens_per_hash_block / TRACE_BLOCK:g}), "
            f"prompts <= {self.max_prompt_tokens} tokens, outputs <= {self.max_output_tokens} tokens"
        )


def _open(path: Path) -> IO[str]:
    return lzma.open(path, "rt") if path.suffix == ".xz" else open(path)


def load_trace(path: Path | None = None) -> list[TraceRequest]:
    """The trace at ``path`` (``.jsonl`` or ``.jsonl.xz``), by default the shipped one."""
    path = Path(path) if path is not None else SHIPPED_TRACE
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found: pass --trace PATH (a Mooncake-format .jsonl or .jsonl.xz)")
    out = []
    with _open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                out.append(
                    TraceRequest(
                        int(r["timestamp"]),
                        int(r["input_length"]),
                        int(r["output_length"]),
                        tuple(int(h) for h in r["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError, OverflowError) as e:
                raise ValueError(
                    f"{path}:{n}: not a trace record ({e}): expected timestamp, input_length, output_length, hash_ids"
                ) from None
    return out


def conversation_ids(trace: Sequence[TraceRequest]) -> list[int]:
    """Conversation of each request: the one of the latest earlier request it extends, else new."""
    owner: dict[tuple, int] = {}  # hash_ids prefix -> latest request holding it
    conv: list[int] = []
    count = 0
    for i, r in enumerate(trace):
        h, parent = r.hash_ids, None
        for k in range(len(h), 1, -1):
            j = owner.get(h[:k])
            if j is not None:
                if k >= len(trace[j].hash_ids) - 1:  # extends j (its last block may have been partial)
                    parent = j
                break
        if parent is None:
            count += 1
        conv.append(conv[parent] if parent is not None else count - 1)
        for k in range(1, len(h) + 1):
            owner[h[:k]] = i
    return conv


def trace_turns(scale: Scale = Scale(), path: Path | None = None) -> list[Turn]:
    """The first ``scale.conversations`` conversations that have at least ``min_turns`` turns
    within the prompt cap, as turns in arrival order (conversations interleave as they did)."""
    trace = load_trace(path)
    conv = conversation_ids(trace)
    ratio = scale.tokens_per_hash_block / TRACE_BLOCK
    members: dict[int, list[int]] = {}
    for i, c in enumerate(conv):
        if int(trace[i].input_length * ratio) <= scale.max_prompt_tokens:
            members.setdefault(c, []).append(i)
    chosen = [m[: scale.max_turns] for m in members.values() if len(m) >= scale.min_turns][: scale.conversations]
    if len(chosen) < scale.conversations:
        raise ValueError(
            f"the trace has only {len(chosen)} conversations of >= {scale.min_turns} turns under "
            f"{scale.max_prompt_tokens} tokens; lower --conversations or raise the prompt cap"
        )
    block_cache: dict[int, np.ndarray] = {}

    def block(h: int) -> np.ndarray:
        if h not in block_cache:
            block_cache[h] = np.random.default_rng(h).integers(0, scale.token_vocab, scale.tokens_per_hash_block)
        return block_cache[h]

    turns = []
    for rank, idxs in enumerate(chosen):
        for t, i in enumerate(idxs):
            r = trace[i]
            tokens = np.concatenate([block(h) for h in r.hash_ids])[: max(1, int(r.input_length * ratio))]
            turns.append(
                Turn(rank, t, r.timestamp_ms, tokens.tolist(), max(1, min(r.output_length, scale.max_output_tokens)))
            )
    turns.sort(key=lambda t: (t.timestamp_ms, t.conversation, t.turn))
    return turns
