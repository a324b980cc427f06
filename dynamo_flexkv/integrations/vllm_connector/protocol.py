"""What travels between the connector's two halves: the scheduler's per-step plan (loads and
saves, inside vLLM's connector metadata) and the lookup messages (over a local ZMQ socket)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from dynamo_flexkv.integrations.vllm_connector.settings import run_dir_or_default


@dataclass
class LoadSpec:
    """Load blocks [skip_blocks, skip_blocks + num_blocks) of ``token_ids`` into ``block_ids``."""

    req_id: str
    token_ids: list[int]  # the prompt prefix, whole blocks, up to the last block to load
    block_ids: list[int]  # vLLM block of each of those blocks
    skip_blocks: int  # leading blocks vLLM already holds (its own prefix cache)
    # The LoRA adapter as the tiers key it (scheduler._lora: name, path, files); a handover's: its name
    lora_name: str | None = None
    cache_salt: str | None = None
    event_hashes: list[Any] = field(default_factory=list)  # as in SaveSpec
    handover: Any = None  # a handover.VllmHandover: read these blocks from the prefill worker, not the tiers
    # A hybrid model (groups.py): every KV cache group's blocks (vLLM's group index -> block id per
    # block of token_ids, 0 where vLLM holds none: outside a sliding window); loaded asynchronously,
    # before the request's first step (vLLM recomputes a multi-group request only as a whole).
    groups: dict[int, list[int]] = field(default_factory=dict)
    log_key: str | None = None  # request_log: the request's name there (request_log.prompt_key)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) - self.skip_blocks


@dataclass
class SaveSpec:
    """Store the full blocks of ``token_ids`` from ``block_ids`` (a finished request); vLLM keeps
    the blocks until the worker reports ``req_id`` as finished sending."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    lora_name: str | None = None  # as in LoadSpec
    cache_salt: str | None = None
    # vLLM's external hash of each block, as its own device events name it: our tier events name
    # the same blocks the same way (Dynamo's router cuts lower tiers to the device prefix otherwise).
    event_hashes: list[Any] = field(default_factory=list)
    groups: dict[int, list[int]] = field(default_factory=dict)  # as in LoadSpec
    after_load: bool = False  # nothing to store: release the blocks once this request's load ran ahead ended
    # The scheduler step that first scheduled the request (FlexKVMetadata.step; -1: unknown, as old
    # as any): a worker whose weights changed at a later step stores none of it (worker.py).
    first_step: int = -1


@dataclass
class FlexKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Handover, prefill side (handover.py): blocks to digest once this step's forward wrote them
    # (request, block ids, their sequence hashes), and finished requests whose blocks wait for
    # decode (request, lease end).
    digests: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    holds: list[tuple[str, float]] = field(default_factory=list)
    # (prompt tokens, longest prompt) when every request in the step is prefilling (no decode
    # token): the worker times such a step for the cost model (step_clock.py); else None.
    prefill: tuple[int, int] | None = None
    step: int = 0  # the scheduler's count of the plans it built: this one's
    # Prompt tokens of the requests first scheduled in this step (a preempted request's once): rank
    # 0's worker counts them as flexkv_prompt_tokens_total, the hit rate's denominator.
    prompt_tokens: int = 0


def lookup_endpoint(engine_id: str, run_dir: str | None = None, rank: int = 0) -> str:
    """The ipc:// address where rank ``rank``'s worker answers lookups for engine ``engine_id``
    (the scheduler and the workers of one engine share the engine id)."""
    base = run_dir_or_default(run_dir)
    suffix = f"-r{rank}" if rank else ""
    path = os.path.join(base, f"flexkv-lookup-{engine_id}{suffix}.ipc")
    if len(path) > 100:  # sun_path limit (108 bytes with the terminator)
        path = os.path.join(tempfile.gettempdir(), f"flexkv-lookup-{engine_id[:40]}{suffix}.ipc")
    return "ipc://" + path
