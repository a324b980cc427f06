"""FlexKVConnector: vLLM's KVConnectorBase_V1 over dynamo_flexkv's tiers.

One class for both roles (vLLM builds it once in the scheduler process and once per worker);
each hook hands over to the half of its role: scheduler.py decides what to move, worker.py
moves it through the engine contract (dynamo_flexkv.core.offload.EngineOffload)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.integrations.vllm_connector.protocol import FlexKVMetadata
from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings
from dynamo_flexkv.integrations.vllm_connector.vllm_api import check as check_vllm_api

if TYPE_CHECKING:  # vLLM's types at the boundary (vllm_api.check verifies the fields read)
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide
    from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

log = logging.getLogger(__name__)


class FlexKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        # vLLM's base annotates kv_cache_config as required but only stores it; our settings read None as unknown.
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # vLLM: not Optional there
        check_vllm_api()  # the scheduler API this connector reads is the pinned vLLM's
        transfer = vllm_config.kv_transfer_config
        if transfer is None:  # KVConnectorBase_V1.__init__ has refused this already
            raise ValueError("FlexKVConnector needs a --kv-transfer-config")
        policy = transfer.kv_load_failure_policy
        if policy != "recompute":
            raise ValueError(
                f'FlexKVConnector needs kv_load_failure_policy="recompute" in --kv-transfer-config '
                f"(it is {policy!r}): a block that fails to load or verify is then recomputed "
                "instead of failing the request"
            )
        settings = ConnectorSettings.from_vllm(vllm_config, kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from dynamo_flexkv.integrations.vllm_connector.scheduler import SchedulerSide

            self._sched = SchedulerSide(settings)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from dynamo_flexkv.core.transfer.nixl_agents import quiet_progress_threads
            from dynamo_flexkv.integrations.vllm_connector.worker import WorkerSide

            # Before NixlConnector (after us in a MultiConnector) creates its agent: every NIXL
            # agent of this worker gets a progress thread that sleeps when idle (nixl_agents.py).
            quiet_progress_threads()
            tp = int(vllm_config.parallel_config.tensor_parallel_size)
            rank = get_tensor_model_parallel_rank() if tp > 1 else 0
            self._on_cpu = vllm_config.device_config.device_type == "cpu"
            with self._cpu_binding():
                self._worker = WorkerSide(settings, rank, tp)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a later miss, never a wrong token

    def _worker_side(self) -> WorkerSide:
        """The worker half: vLLM calls the worker hooks on a worker's connector only."""
        if self._worker is None:
            raise RuntimeError("FlexKVConnector: a worker hook called on the scheduler's connector")
        return self._worker

    def _sched_side(self) -> SchedulerSide:
        """The scheduler half: vLLM calls the scheduler hooks on the scheduler's connector only."""
        if self._sched is None:
            raise RuntimeError("FlexKVConnector: a scheduler hook called on a worker's connector")
        return self._sched

    # ---- worker side -------------------------------------------------------------------------------
    @property
    def transfer_log(self):
        """This worker's recent finished loads and stores (``worker.TransferRecord``), newest last."""
        return self._worker.transfer_log if self._worker is not None else ()

    def tier_files(self) -> list:
        """This worker's disk tier data files."""
        return self._worker_side().tier_files()

    def drain(self, timeout: float | None = None) -> bool:
        """Waits for this worker's background tier writes; False if some still run after ``timeout``."""
        return self._worker_side().drain(timeout)

    def tier_stats(self) -> ManagerStats | None:
        """This worker's KVManager stats (tiers, requests, links, tasks); None before vLLM
        registered the KV caches."""
        return self._worker_side().stats()

    def evict_host(self, timeout: float | None = None) -> int:
        """Evicts this worker's host blocks once its tier writes finished (disk and remote copies
        stay): the next loads read the tiers below. Returns how many blocks went."""
        return self._worker_side().evict_host(timeout)

    def reset_tiers(self, timeout: float | None = None) -> None:
        """Drops this worker's host and disk blocks once its tier writes finished; the shared
        remote tier keeps its copies."""
        self._worker_side().reset_tiers(timeout)

    def _cpu_binding(self) -> AbstractContextManager[None]:
        """On a CPU platform, the threads started inside share the worker's bind cores and this
        thread, the model's, ends on its own core (cpu_affinity.py): once when created
        (NixlConnector before us) and once when the caches arrive (NixlConnector after us)."""
        if not self._on_cpu:
            return contextlib.nullcontext()
        from dynamo_flexkv.integrations.vllm_connector.cpu_affinity import helpers_on_bind_cores

        return helpers_on_bind_cores()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with self._cpu_binding():
            self._worker_side().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # before the forward, whether loads start before it or after
            self._worker.begin_step()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, FlexKVMetadata):
            self._worker_side().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores happen once a request finished (request_finished), from whole blocks

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self._worker_side().end_step(meta if isinstance(meta, FlexKVMetadata) else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Stores whose blocks vLLM may free; a hybrid model's loads that ran ahead, and those that
        failed (vLLM computes them from their first token)."""
        loaded, failed = self._worker_side().finished_loads()
        return KVConnectorTransferResults(
            finished_sending=self._worker_side().finished_saves(set(finished_req_ids)),
            finished_recving=loaded,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._worker_side().take_events()

    def get_kv_connector_stats(self) -> Any:
        from dynamo_flexkv.integrations.vllm_connector.metrics import FlexKVStats

        if self._worker is None:  # the scheduler asks too: its numbers are vLLM's own
            return None
        data = self._worker.step_stats()
        return FlexKVStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from dynamo_flexkv.integrations.vllm_connector.metrics import FlexKVStats

        return FlexKVStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list, per_engine_labelvalues: dict[int, list]
    ) -> Any:
        from dynamo_flexkv.integrations.vllm_connector.metrics import FlexKVPromMetrics

        return FlexKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched_side().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched_side().add_events(connector_output.kv_cache_events)
        self._sched_side().loads_ended(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list) -> tuple[bool, dict[str, Any] | None]:
        return self._sched_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list, ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched_side().request_finished_all(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self._sched_side().take_events()

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache(reset_connector=True): the tiers drop what they hold (see
        SchedulerSide.reset); False when they could not, so no stale KV is served unnoticed."""
        if self._sched is None:
            return None
        return self._sched.reset()

    # ---- both --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.close()
