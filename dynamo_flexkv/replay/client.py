"""Replays timed turns against an OpenAI HTTP endpoint with real concurrency: each turn is sent
at its (time-scaled) trace arrival, never before the previous turn of its conversation answered
(a user reads the reply before asking again), with at most ``concurrency`` requests in flight.
Every request streams, so TTFT and inter-token latency are measured at the client; the worker
that served it and its cached prompt tokens come from the response itself.

Timing is by token, not by text: each request asks the frontend for ``nvext.completion_token_ids``,
so every chunk says which tokens it carries. TTFT is the arrival of the first chunk that carries a
token (its text may still be empty: a byte of a multi-byte UTF-8 character), and an inter-token gap
is measured between token-carrying chunks (tokens that arrive in one chunk: gaps of 0). A server
that sends no token ids: every chunk with a choice counts as one token."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from dynamo_flexkv.workload import Turn

TIERS = ("device", "host", "disk", "remote")  # the order the manager looks them up


@dataclass
class RequestRecord:
    index: int  # position in the replay (arrival order)
    conversation: int
    turn: int
    arrival_s: float  # scheduled arrival, from the replay's start
    sent_s: float = 0.0  # when it went out (later than arrival when a slot or its previous turn held it)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None  # from sending to the first token
    itl_ms: list[float] = field(default_factory=list)  # gaps between streamed tokens
    e2e_ms: float | None = None
    worker_id: int | None = None  # the frontend's nvext.worker_id.decode_worker_id
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (all tiers)
    cached_by_tier: dict[str, int] | None = None  # per tier, when the response reports it
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = [round(x, 2) for x in self.itl_ms]
        return d


def tier_split(nvext: dict[str, Any]) -> dict[str, int] | None:
    """Cached prompt tokens per tier from a chunk's ``nvext``: the worker puts them in its final
    chunk's engine_data (``{"flexkv": {"cached_tokens": {tier: n}}}``), which the frontend returns as
    ``nvext.engine_data`` when the request lists "engine_data" in ``nvext.extra_fields``."""
    by = ((nvext.get("engine_data") or {}).get("flexkv") or {}).get("cached_tokens")
    if not isinstance(by, dict):
        return None
    return {t: int(by.get(t) or 0) for t in TIERS}


def chunk_tokens(chunk: dict[str, Any], nvext: dict[str, Any]) -> int:
    """How many generated tokens a stream chunk carries: ``nvext.completion_token_ids`` when the
    frontend sends it (Dynamo does when the request lists it in ``nvext.extra_fields``), else one
    per chunk with a choice (the usage-only last chunk has none)."""
    ids = nvext.get("completion_token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if chunk.get("choices") else 0


def arrival_times(turns: Sequence[Turn], time_scale: float) -> list[float]:
    """Seconds from the replay's start: trace time divided by ``time_scale``."""
    if time_scale <= 0:
        raise ValueError(f"time-scale={time_scale} must be > 0 (trace seconds per replay second)")
    t0 = min(t.timestamp_ms for t in turns)
    return [(t.timestamp_ms - t0) / 1000.0 / time_scale for t in turns]


class Replayer:
    def __init__(self, base_url: str, model: str, *, concurrency: int, request_timeout_s: float = 120) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} must be >= 1")
        if request_timeout_s <= 0:
            raise ValueError(f"request-timeout={request_timeout_s} must be > 0 seconds")
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model, self.concurrency, self.timeout = model, concurrency, request_timeout_s
        self.started_unix = 0.0  # the replay's start, unix s (records' times are relative to it)

    def run(
        self, turns: Sequence[Turn], time_scale: float, on_done: Callable[[RequestRecord], None] = lambda r: None
    ) -> list[RequestRecord]:
        return asyncio.run(self.replay(turns, time_scale, on_done))

    async def replay(
        self, turns: Sequence[Turn], time_scale: float, on_done: Callable[[RequestRecord], None]
    ) -> list[RequestRecord]:
        arrivals = arrival_times(turns, time_scale)
        records = [RequestRecord(i, t.conversation, t.turn, a) for i, (t, a) in enumerate(zip(turns, arrivals))]
        slots = asyncio.Semaphore(self.concurrency)
        answered: dict[tuple, asyncio.Event] = {(t.conversation, t.turn): asyncio.Event() for t in turns}
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.started_unix = time.time()
        connector = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout)) as s:

            async def one(turn: Turn, rec: RequestRecord) -> None:
                try:
                    await asyncio.sleep(max(0.0, start + rec.arrival_s - loop.time()))
                    previous = answered.get((turn.conversation, turn.turn - 1))
                    if previous is not None:
                        await previous.wait()
                    async with slots:
                        rec.sent_s = loop.time() - start
                        await self._send(s, turn, rec)
                finally:
                    answered[(turn.conversation, turn.turn)].set()  # an error still lets the next turn go
                    on_done(rec)

            await asyncio.gather(*(one(t, r) for t, r in zip(turns, records)))
        return records

    async def _send(self, session: aiohttp.ClientSession, turn: Turn, rec: RequestRecord) -> None:
        body = {
            "model": self.model,
            "prompt": turn.tokens,
            "max_tokens": turn.output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id", "engine_data", "completion_token_ids"]},
        }
        rec.prompt_tokens = len(turn.tokens)
        t0 = time.perf_counter()
        last: float | None = None
        try:
            async with session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        rec.error = f"stream error: {str(chunk['error'])[:300]}"
                        return
                    now = time.perf_counter()
                    nvext = chunk.get("nvext") or {}
                    tokens = chunk_tokens(chunk, nvext)
                    if tokens:
                        if last is None:
                            rec.ttft_ms = (now - t0) * 1000
                        else:
                            rec.itl_ms.append((now - last) * 1000)
                        rec.itl_ms.extend([0.0] * (tokens - 1))  # arrived together
                        last = now
                    wid = (nvext.get("worker_id") or {}).get("decode_worker_id")
                    if wid is not None:
                        rec.worker_id = int(wid)
                    rec.cached_by_tier = tier_split(nvext) or rec.cached_by_tier
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
            return
        rec.e2e_ms = (time.perf_counter() - t0) * 1000
        if rec.ttft_ms is None:
            rec.error = "the stream ended without a token"
        elif rec.worker_id is None:
            rec.error = "the response named no worker (nvext.worker_id)"
