"""One process of a launch plan: what to run, with which environment, files and ports, and what
the launcher does when it dies."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.options import OnDeath, RestartPolicy
from dynamo_flexkv.serve.ports import LOOPBACK


@dataclass
class Process:
    name: str  # what its log lines are prefixed with
    argv: list[str]
    env: dict[str, str] = field(
        default_factory=dict, repr=False
    )  # on top of the launcher's environment; secrets: kept out of repr
    kind: Kind | None = None  # None: infrastructure (etcd, NATS)
    port: int | None = None  # frontend: HTTP; worker: system port (/health, /metrics); infra: client
    cache: CacheConfig | None = None  # workers with offload
    files: dict[str, str] = field(default_factory=dict)  # path -> text, written before it starts
    restart: RestartPolicy = RestartPolicy(OnDeath.STOP)  # frontend and infrastructure: always stop
    engine: str = "flexkv"  # workers: "flexkv" (dynamo_flexkv.integrations.dynamo_worker) or "vllm" (dynamo.vllm)
    block_size: int = 0  # workers: tokens per KV block (what the router hashes)
    dirs: list[str] = field(default_factory=list)  # made before it starts (e.g. its HOME)
    # Stopping a ready one: SIGINT to its whole process group, or (False) to the process alone, which
    # stops its own children in order (dynamo.vllm: its EngineCore, which stops its Worker).
    stop_group: bool = True
    host: str = LOOPBACK  # the address it binds and others reach it at (its node's, when placed on one)

    @property
    def metrics_url(self) -> str | None:
        """Frontend: on its HTTP port; worker: on its Dynamo system port; infrastructure: none."""
        return None if self.kind is None else f"http://{self.host}:{self.port}/metrics"
