"""Requests and sampling of the reference engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from dynamo_flexkv.core.hashing import BlockHashes


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # seeded sampling is reproducible per request
    stop_token_ids: Sequence[int] = ()
    record_logits: bool = False  # keep each step's logits (exactness tests)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")


class RequestState(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    hashes: BlockHashes
    arrival: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the device cache (or being loaded into it)
    cached_blocks: int = 0  # prompt blocks already entered in the device prefix cache
    device_hit_tokens: int = 0
    offload_hit_tokens: int = 0
    disk_hit_tokens: int = 0  # the part of offload_hit_tokens read from the disk tier
    remote_hit_tokens: int = 0  # the part of offload_hit_tokens read from the remote tier (Redis)
    load_task: int | None = None
    prefetch_task: int | None = None
    prefetch_tried: bool = False
    overtaken: int = 0  # later requests admitted while this one waited for free blocks
    first_token_at: float | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def cached_tokens(self) -> dict[str, int]:
        """Prompt tokens not computed, by the tier they came from (device: the prefix cache);
        ``remote`` only for a request that loaded from the remote tier."""
        out = {
            "device": self.device_hit_tokens,
            "host": self.offload_hit_tokens - self.disk_hit_tokens - self.remote_hit_tokens,
            "disk": self.disk_hit_tokens,
        }
        if self.remote_hit_tokens:
            out["remote"] = self.remote_hit_tokens
        return out

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token: int | None
    output: list[int]
    finished: bool
    finish_reason: str | None
    ttft: float | None
    cached_tokens: dict[str, int]


def sample(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if p.temperature == 0:
        return int(torch.argmax(logits))
    if req.generator is None:
        req.generator = torch.Generator().manual_seed(p.seed if p.seed is not None else 0)
    probs = torch.softmax(logits.float().cpu() / p.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=req.generator))
