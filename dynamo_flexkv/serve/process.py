"""One process of a launch plan: what to run, with which environment, files and ports, and what
the launcher does when it dies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.options import OnDeath, RestartPolicy
from dynamo_flexkv.serve.ports import LOOPBACK


@dataclass
class Process:
    name: str  # what its log lines are prefixed with
    argv: List[str]
    env: Dict[str, str] = field(
        default_factory=dict, repr=False
    )  # on top of the launcher's environment; secrets: kept out of repr
    kind: Optional[Kind] = None  # None: infrastructure (etcd, NATS)
    port: Optional[int] = None  # frontend: HTTP; worker: system port (/health, /metrics); infra: client
    cache: Optional[CacheConfig] = None  # workers with offload
    files: Dict[str, str] = field(default_factory=dict)  # path -> text, written before it starts
    restart: RestartPolicy = RestartPolicy(OnDeath.STOP)  # frontend and infrastructure: always stop
    engine: str = "flexkv"  # workers: "flexkv" (dynamo_flexkv.integrations.dynamo_worker) or "vllm" (dynamo.vllm)
    block_size: int = 0  # workers: tokens per KV block (what the router hashes)
    dirs: List[str] = field(default_factory=list)  # made before it starts (e.g. its HOME)
    # Stopping a ready one: SIGINT to its whole process group, or (False) to the process alone, which
    # stops its own children in order (dynamo.vllm: its EngineCore, which stops its Worker).
    stop_group: bool = True
    host: str = LOOPBACK  # the address it binds and others reach it at (its node's, when placed on one)

    @property
    def metrics_url(self) -> Optional[str]:
        """Frontend: on its HTTP port; worker: on its Dynamo system port; infrastructure: none."""
        return None if self.kind is None else f"http://{self.host}:{self.port}/metrics"
