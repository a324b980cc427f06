"""Multi-turn conversations from the Mooncake conversation trace (../shared/traces).

The trace gives each request's prompt as ``hash_ids``, one per 512-token block; two requests
sharing a prefix of hash_ids share that prefix of tokens. A request continues a conversation when
it extends an earlier request's hash_ids (all but possibly the earlier last, partial block). Each
hash_id becomes ``tokens_per_hash_block`` deterministic token ids, so prefix sharing, and with it
the reachable hit rate, is exactly the trace's at a smaller scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

TRACE_NAME = Path("shared") / "traces" / "mooncake_conversation_trace.jsonl"
# ../shared/traces beside the checkout (or beside the working directory)
TRACE_CANDIDATES = (Path(__file__).resolve().parents[2] / TRACE_NAME, Path.cwd().parent / TRACE_NAME)
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
    timestamp_ms: int
    tokens: List[int]
    output_tokens: int


@dataclass(frozen=True)
class Scale:
    """How the trace is scaled down for this machine (reported with every result)."""

    conversations: int = 24
    min_turns: int = 2
    max_turns: int = 4
    tokens_per_hash_block: int = 256  # 512 in the trace: prompts are half as long
    max_prompt_tokens: int = 8192  # turns beyond this are dropped (their conversation keeps earlier ones)
    max_output_tokens: int = 4  # decode is not what offload speeds up; keep runs short
    token_vocab: int = 256  # ids below this (byte tokens of the generated tokenizer)

    def describe(self) -> str:
        return (f"{self.conversations} conversations of {self.min_turns}-{self.max_turns} turns from the Mooncake "
                f"conversation trace; each 512-token trace block -> {self.tokens_per_hash_block} tokens "
                f"(prompts x{self.tokens_per_hash_block / TRACE_BLOCK:g}), prompts <= {self.max_prompt_tokens} "
                f"tokens, outputs <= {self.max_output_tokens} tokens, requests one at a time in trace order")


def load_trace(path: Optional[Path] = None) -> List[TraceRequest]:
    if path is None:
        path = next((p for p in TRACE_CANDIDATES if p.is_file()), TRACE_CANDIDATES[0])
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found: pass --trace PATH (a Mooncake-format .jsonl)")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                out.append(TraceRequest(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                                        tuple(int(h) for h in r["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e}): expected timestamp, input_length, "
                                 "output_length, hash_ids") from None
    return out


def conversation_ids(trace: Sequence[TraceRequest]) -> List[int]:
    """Conversation of each request: the one of the latest earlier request it extends, else new."""
    owner: Dict[tuple, int] = {}  # hash_ids prefix -> latest request holding it
    conv: List[int] = []
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


def trace_turns(scale: Scale = Scale(), path: Optional[Path] = None) -> List[Turn]:
    """The first ``scale.conversations`` conversations that have at least ``min_turns`` turns
    within the prompt cap, as turns in trace order (conversations interleave as they did)."""
    trace = load_trace(path)
    conv = conversation_ids(trace)
    ratio = scale.tokens_per_hash_block / TRACE_BLOCK
    members: Dict[int, List[int]] = {}
    for i, c in enumerate(conv):
        if int(trace[i].input_length * ratio) <= scale.max_prompt_tokens:
            members.setdefault(c, []).append(i)
    chosen = [m[:scale.max_turns] for m in members.values() if len(m) >= scale.min_turns][:scale.conversations]
    if len(chosen) < scale.conversations:
        raise ValueError(f"the trace has only {len(chosen)} conversations of >= {scale.min_turns} turns under "
                         f"{scale.max_prompt_tokens} tokens; lower --conversations or raise the prompt cap")
    block_cache: Dict[int, np.ndarray] = {}

    def block(h: int) -> np.ndarray:
        if h not in block_cache:
            block_cache[h] = np.random.default_rng(h).integers(0, scale.token_vocab, scale.tokens_per_hash_block)
        return block_cache[h]

    turns = []
    for rank, idxs in enumerate(chosen):
        for t, i in enumerate(idxs):
            r = trace[i]
            tokens = np.concatenate([block(h) for h in r.hash_ids])[: max(1, int(r.input_length * ratio))]
            turns.append(Turn(rank, t, r.timestamp_ms, tokens.tolist(),
                              max(1, min(r.output_length, scale.max_output_tokens))))
    turns.sort(key=lambda t: (t.timestamp_ms, t.conversation, t.turn))
    return turns
