"""A worker's two halves of peer pulls over its own host tier, as the engine contract hands them
out (EngineOffload.open_peer_link): the source that serves its host blocks on the control endpoint
and the receiver that pulls into them, sharing one NIXL agent. The engine sees only this object:
``pull`` with a source's endpoint and a request's tokens, the source's counters, ``close``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynamo_flexkv.core.peer.receiver import PeerReceiver, PullResult, host_agent
from dynamo_flexkv.core.peer.source import PeerSource, SourceLimits, SourceStats


class PeerLink:
    """``kv``'s host tier served on ``host:port`` (port 0: any free port) to peers that prove
    membership with ``secret``, and pulled into from theirs. Closing releases the pins it holds,
    the endpoint and the agent, in that order."""

    def __init__(self, kv: Any, secret: bytes | None, host: str, port: int, limits: SourceLimits) -> None:
        if not secret:  # checked before the agent exists: nothing to unwind
            raise ValueError(
                "peer pulls need the deployment's shared secret (FLEXKV_HANDOVER_SECRET) on every worker: "
                "a pull proves membership with it"
            )
        self._agent = host_agent(kv)
        try:
            self._source = PeerSource(kv, self._agent, secret, host, port, limits)
        except BaseException:
            self._agent.close()
            raise
        self._receiver = PeerReceiver(kv, self._agent, secret)

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` the source listens on."""
        return self._source.endpoint

    @property
    def source_stats(self) -> SourceStats:
        return self._source.stats

    def pull(
        self,
        endpoint: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        blocks: int | None = None,
        timeout: float = 5.0,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> PullResult:
        """PeerReceiver.pull: never raises for the source's sake; a failure is a result with ``why``."""
        return self._receiver.pull(
            endpoint,
            token_ids,
            lora_name=lora_name,
            cache_salt=cache_salt,
            blocks=blocks,
            timeout=timeout,
            prompt_tokens=prompt_tokens,
            skip_blocks=skip_blocks,
        )

    def close(self) -> None:
        self._receiver.close()
        self._source.close()
        self._agent.close()
