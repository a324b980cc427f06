"""The worker's disaggregation role (``--disaggregation-mode agg|prefill|decode``) between Dynamo's
request and the engine thread.

prefill: registers as a prefill target (Dynamo's WorkerConfig), answers with one token and
``disaggregated_params`` naming its leased blocks (dynamo_flexkv.integrations.disagg). decode: takes
``prefill_result.disaggregated_params`` and pulls what its own tiers lack; a health probe or the
router's ``x-bypass-remote-prefill`` annotation (conditional disaggregation) prefills locally, and
a handover it cannot use is recomputed. agg: unchanged."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from dynamo.common.backend.disagg import enforce_prefill_max_tokens, require_prefill_result
from dynamo.common.backend.engine import GenerateRequest
from dynamo.common.backend.health_check import is_probe
from dynamo.common.constants import DisaggregationMode
from dynamo.llm.exceptions import InvalidArgument

from dynamo_flexkv.integrations.disagg.params import HandoverParams, HandoverRefused, handover_secret
from dynamo_flexkv.integrations.reference_engine import LLMEngine

if TYPE_CHECKING:
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
    from dynamo_flexkv.integrations.disagg.roles import DecodeSide, PrefillSide

log = logging.getLogger(__name__)
BYPASS_REMOTE_PREFILL = "x-bypass-remote-prefill"
MODES = {
    "agg": DisaggregationMode.AGGREGATED,
    "prefill": DisaggregationMode.PREFILL,
    "decode": DisaggregationMode.DECODE,
}


class Role:
    def __init__(self, args: argparse.Namespace) -> None:
        self.mode = MODES[args.disaggregation_mode]
        self.args = args
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.agent: KVAgent | None = None

    @property
    def dynamo_mode(self) -> DisaggregationMode:
        return self.mode

    def start(self, engine: LLMEngine) -> None:
        """After the engine exists: one NIXL agent over its KV tensors (prefill and decode only)."""
        if self.mode is DisaggregationMode.AGGREGATED:
            return
        from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
        from dynamo_flexkv.integrations.disagg.roles import DecodeSide, PrefillSide

        self.agent = agent = KVAgent(engine.kv_cache.layers)
        if self.mode is DisaggregationMode.PREFILL:
            if not engine.device_prefix_cache:
                raise InvalidArgument(
                    "a prefill worker hands over its device prefix cache: drop --no-device-prefix-cache"
                )
            self.prefill = PrefillSide(
                engine, agent, self.args.handover_lease_s, handover_secret(), renew_s=self.args.handover_renew_s
            )
        else:
            self.decode = decode = DecodeSide(engine, agent, self.args.handover_timeout_s, handover_secret())
            engine.remote_fill = decode.fill
        log.info(
            "%s worker: NIXL agent %s over %d KV layers",
            self.args.disaggregation_mode,
            agent.name,
            len(engine.kv_cache.layers),
        )

    # ---- event loop side ---------------------------------------------------------------------------
    def prepare(self, request: GenerateRequest) -> HandoverParams | None:
        """Before the request's limits are checked: prefill clamps max_tokens to 1; decode returns
        the handover to pull (None: prefill locally)."""
        if self.mode is DisaggregationMode.PREFILL:
            enforce_prefill_max_tokens(request)
            return None
        if self.mode is not DisaggregationMode.DECODE or is_probe(request):
            return None
        annotations = request.get("annotations")
        if isinstance(annotations, (list, tuple)) and BYPASS_REMOTE_PREFILL in annotations:
            return None
        try:
            result = require_prefill_result(request, self.mode)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        try:
            return HandoverParams.from_dict(result.get("disaggregated_params"))
        except HandoverRefused as e:
            log.warning("unusable handover, prefilling locally: %s", e)
            return None

    # ---- engine thread side ------------------------------------------------------------------------
    def added(self, request_id: str, handover: HandoverParams | None) -> None:
        if self.decode is not None:
            self.decode.expect(request_id, handover)

    def finished(self, request_id: str, prompt: list[int]) -> dict[str, Any] | None:
        """What the final chunk carries besides the token. Prefill: the ``disaggregated_params`` of
        the prompt just computed ({} is valid: nothing held). Decode: the prompt tokens it pulled
        (``handover_tokens`` in engine_data), for requests that came with a handover."""
        if self.prefill is not None:
            return {"disaggregated_params": self.prefill.hand_over(prompt)}
        if self.decode is not None and request_id in self.decode.pulled:
            return {"handover_tokens": self.decode.pulled.pop(request_id)}
        return None

    def refused(self, handover: HandoverParams | None) -> None:
        """A request refused before the engine took it: it will not pull, so its lease goes back
        to the prefill worker now rather than at expiry (engine thread)."""
        if self.decode is not None and handover is not None:
            self.decode.refuse(handover)

    def aborted(self, request_id: str) -> None:
        if self.decode is not None:
            self.decode.forget(request_id)

    def service(self) -> None:
        if self.prefill is not None:
            self.prefill.service()
        if self.decode is not None:
            self.decode.service()  # renews the leases of requests still waiting here

    def is_quiescent(self) -> bool | None:
        return None if self.prefill is None else len(self.prefill.leases) == 0

    def close(self) -> None:
        """Engine thread stopped: release every lease, then the agent."""
        if self.prefill is not None:
            self.prefill.close()
        if self.agent is not None:
            self.agent.close()
