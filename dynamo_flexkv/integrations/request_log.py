"""A worker's per-request record of its offload decisions, one JSON line each, for the replay's
accounting (dynamo_flexkv/replay/accounting.py): what a lookup found per tier, how far the load
policy loaded and why (with its estimates), and what each load brought from which tier.

Written only when asked (the vLLM connector's ``request_log`` setting), to
``<run_dir>/flexkv-requests.jsonl``. Why a file and not the response: Dynamo's vLLM worker
returns no per-request data of a connector to the client, and the lookup happens in vLLM's
worker process, two processes away from the response; a file the replay reads after the run
costs the request path one small write. Requests are named by ``prompt_key`` of the tokens
looked up (a prompt's whole blocks but the last token), which the replay computes from the
prompts it sent: vLLM's request ids are Dynamo's, never seen by the client.

Lines:
    {"kind": "lookup", "t": unix s, "key", "tokens", "prompt_tokens", "device": tokens vLLM held,
     "answer": end of the prefix to load (tokens), "decision": LoadDecision.explain or null,
     "hint": a router hint's outcome (docs/HINTS.md), only on a lookup that came with one:
       {"hinted": tokens the hint named, "start": first token pulled, "pulled": tokens pulled
        into the host tier (from "start" on), "why": "" or why it failed, "skipped": the load
        policy left it unpulled}}
    {"kind": "load", "t", "key", "req", "device": tokens vLLM held, "planned": tokens planned,
     "loaded": {tier: tokens} (empty when it failed), "ok": bool}
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

FILE = "flexkv-requests.jsonl"


def prompt_key(tokens: Sequence[int]) -> str:
    """Names a token sequence (16 hex digits of blake2b over its uint32 values)."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<u4").tobytes(), digest_size=8).hexdigest()


def lookup_tokens(prompt_len: int, block_size: int) -> int:
    """How many of a prompt's tokens a lookup asks about: whole blocks, leaving at least one token
    to compute (the engine needs its logits)."""
    return max(0, prompt_len - 1) // block_size * block_size


class RequestLog:
    """Appends records to ``<run_dir>/flexkv-requests.jsonl``; thread-safe (lookups come from the
    lookup thread, loads from the engine's)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, FILE)
        self._lock = threading.Lock()
        # line-buffered: whole lines for a reader meanwhile; open as long as the log, closed in close()
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115

    def lookup(
        self,
        tokens: Sequence[int],
        prompt_tokens: int,
        device: int,
        answer: int,
        decision: dict[str, Any] | None,
        hint: dict[str, Any] | None = None,
    ) -> None:
        self._write(
            {
                "kind": "lookup",
                "key": prompt_key(tokens),
                "tokens": len(tokens),
                "prompt_tokens": int(prompt_tokens),
                "device": int(device),
                "answer": int(answer),
                "decision": decision,
                **({"hint": hint} if hint is not None else {}),
            }
        )

    def load(self, key: str, req: str, device: int, planned: int, loaded: dict[str, int], ok: bool) -> None:
        self._write(
            {
                "kind": "load",
                "key": key,
                "req": req,
                "device": int(device),
                "planned": int(planned),
                "loaded": {t: int(n) for t, n in loaded.items() if n} if ok else {},
                "ok": bool(ok),
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"t": round(time.time(), 6), **record}) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()
