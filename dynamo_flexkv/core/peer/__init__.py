"""Peer pulls: a worker reads another worker's host blocks over NIXL when Dynamo's router hints
that the other one holds a longer prefix (a ``kv.fetch`` hint).

link.py is what the engine contract hands an engine (EngineOffload.open_peer_link);
protocol.py is the control plane (the source's TCP endpoint: pull requests with a proof, pins
under leases, releases); source.py pins and serves, receiver.py reads into its own host tier,
verifies and commits. The hint itself (vLLM's Request.kv_hints) is parsed by the vLLM connector
(integrations/vllm_connector/hints.py)."""

from dynamo_flexkv.core.peer.link import PeerLink
from dynamo_flexkv.core.peer.protocol import PeerRefused, Refusal
from dynamo_flexkv.core.peer.receiver import PeerReceiver, PullResult, host_agent, parse_endpoint
from dynamo_flexkv.core.peer.source import PeerSource, SourceLimits, SourceStats

__all__ = [
    "PeerLink",
    "PeerReceiver",
    "PeerRefused",
    "PeerSource",
    "PullResult",
    "Refusal",
    "SourceLimits",
    "SourceStats",
    "host_agent",
    "parse_endpoint",
]
