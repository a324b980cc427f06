"""Dynamo's router hints for FlexKVConnector: the capability a worker advertises, the ``kv.fetch``
hint a request brings, and the worker's peer pulls (core/peer/) that act on it.

Advertising: ``kv_connector_extra_config.secondary_tiers`` holds exactly one entry with
``router_capabilities: ["router_hint"]``, ``control_ports`` (one per local data-parallel rank) and
``control_advertise_host``; dynamo.vllm publishes them (dynamo/vllm/kv_hints.py) and the router
sends hints naming ``tcp://<control_advertise_host>:<port>``. This engine serves its host tier there
(PeerSource), bound to ``control_bind_host`` (default: the advertised host).

Receiving: vLLM hands the router's envelope to the request as ``Request.kv_hints``
(vllm/v1/kv_hints/protocol.py). ``fetch_hint`` reads the one ``kv.fetch`` action of version 1.0:
the source's endpoint and the hashes the source published for the request's blocks (vLLM's
block hashes, low 64 bits, root-aligned). Only the leading blocks whose hashes equal this
request's own count: a hint for another prompt names nothing here. The pull itself names our
namespaced block hashes (model, tenant and weights in each), computed from the request's tokens."""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_flexkv.core.contract import EngineOffload
from dynamo_flexkv.core.errors import FlexKVError

if TYPE_CHECKING:
    from dynamo_flexkv.core.peer import PullResult

log = logging.getLogger(__name__)

CAPABILITY = "router_hint"  # dynamo.common.constants.KV_HINT_TRANSFER_CAPABILITY_KEY
PROTOCOL_VERSION = "0.1"
FETCH = "kv.fetch"
FETCH_VERSION = "1.0"
MAX_HINT_BLOCKS = 1 << 16  # a hint naming more blocks than any prompt we serve is refused as oversized


class HintRefused(ValueError, FlexKVError):
    """A hint this worker cannot use (``reason``): the request is served from its own tiers."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class HintTier:
    """The ``secondary_tiers`` entry that turns router hints on, checked."""

    control_ports: tuple[int, ...]
    advertise_host: str
    bind_host: str
    lease_s: float = 2.0
    pull_timeout_s: float = 2.0

    def port(self, local_dp_rank: int) -> int:
        if not 0 <= local_dp_rank < len(self.control_ports):
            raise ValueError(
                f"FlexKVConnector: secondary_tiers control_ports has {len(self.control_ports)} entries; this "
                f"engine is local data-parallel rank {local_dp_rank}: give one port per local DP rank"
            )
        return self.control_ports[local_dp_rank]


_TIER_KEYS = {
    "router_capabilities",
    "control_ports",
    "control_advertise_host",
    "control_bind_host",
    "lease_s",
    "pull_timeout_s",
}


def parse_secondary_tiers(value: Any) -> HintTier | None:
    """``kv_connector_extra_config.secondary_tiers`` checked: None for an empty list, else the
    one router-hint tier; ValueError naming what is wrong otherwise."""
    where = "FlexKVConnector: kv_connector_extra_config secondary_tiers"
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of one mapping, got {type(value).__name__}")
    if not value:
        return None
    if len(value) != 1 or not isinstance(value[0], Mapping):
        raise ValueError(f"{where} must hold exactly one mapping (the router-hint tier), got {value!r}")
    tier = value[0]
    unknown = sorted(set(tier) - _TIER_KEYS)
    if unknown:
        raise ValueError(f"{where}[0]: unknown key(s) {unknown}; known: {sorted(_TIER_KEYS)}")
    caps = tier.get("router_capabilities")
    if caps != [CAPABILITY]:
        raise ValueError(f"{where}[0].router_capabilities={caps!r}: the only capability served is [{CAPABILITY!r}]")
    ports = tier.get("control_ports")
    if (
        not isinstance(ports, list)
        or not ports
        or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
    ):
        raise ValueError(f"{where}[0].control_ports={ports!r} must be a list of TCP ports, one per local DP rank")
    host = tier.get("control_advertise_host")
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"{where}[0].control_advertise_host must name the address peers reach this worker at")
    if _unspecified(host):
        raise ValueError(
            f"{where}[0].control_advertise_host={host!r} is not an address a peer can reach: name this "
            "worker's address (dynamo.vllm refuses it too)"
        )
    bind = tier.get("control_bind_host", host)
    if not isinstance(bind, str) or not bind.strip():
        raise ValueError(f"{where}[0].control_bind_host={bind!r} must be an address to bind")
    times = {}
    for key, default, most in (("lease_s", 2.0, 60.0), ("pull_timeout_s", 2.0, 60.0)):
        v = tier.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= most:
            raise ValueError(f"{where}[0].{key}={v!r} must be seconds in (0, {most:.0f}]")
        times[key] = float(v)
    return HintTier(tuple(ports), host, bind, **times)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name
        return False


@dataclass(frozen=True)
class FetchHint:
    endpoint: str  # the source's control endpoint, tcp://host:port
    blocks: int  # leading blocks of the request the source holds (its hashes equal ours)


def router_hash(block_hash: Any) -> int:
    """A vLLM block hash as Dynamo's router names it: the low 64 bits (big-endian bytes, as
    vllm.v1.core.kv_cache_utils.maybe_convert_block_hash)."""
    if isinstance(block_hash, int):
        return block_hash & ((1 << 64) - 1)
    return int.from_bytes(bytes(block_hash), "big") & ((1 << 64) - 1)


def fetch_hint(kv_hints: Any, request_hashes: Sequence[Any]) -> FetchHint | None:
    """The ``kv.fetch`` hint of a request (vLLM's KvHintsEnvelope, or its JSON form), checked
    against the request's own vLLM block hashes; None when the request carries no hint.
    HintRefused (version, malformed, oversized, foreign) for one it cannot use."""
    if kv_hints is None:
        return None
    get = (lambda o, k: o.get(k)) if isinstance(kv_hints, Mapping) else (lambda o, k: getattr(o, k, None))
    version = get(kv_hints, "protocol_version")
    if version != PROTOCOL_VERSION:
        raise HintRefused("version", f"hint protocol_version {version!r}, this worker reads {PROTOCOL_VERSION!r}")
    actions = get(kv_hints, "actions")
    if not isinstance(actions, (list, tuple)):
        raise HintRefused("malformed", "the hint's actions are not a list")
    fetches = []
    for a in actions:
        act = (lambda k: a.get(k)) if isinstance(a, Mapping) else (lambda k: getattr(a, k, None))
        if act("action_type") != FETCH:
            continue
        if act("action_version") != FETCH_VERSION:
            raise HintRefused("version", f"{FETCH} action_version {act('action_version')!r}, expected {FETCH_VERSION}")
        fetches.append(act("payload"))
    if not fetches:
        return None
    if len(fetches) > 1:
        raise HintRefused("malformed", f"{len(fetches)} {FETCH} actions; one source per hint")
    payload = fetches[0]
    if not isinstance(payload, Mapping):
        raise HintRefused("malformed", f"the {FETCH} payload is not a mapping")
    endpoint, hashes = payload.get("source_control_endpoint"), payload.get("block_hashes")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise HintRefused("malformed", f"source_control_endpoint {endpoint!r} is not tcp://host:port")
    if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
        raise HintRefused("malformed", "block_hashes must be a list of integers")
    if len(hashes) > MAX_HINT_BLOCKS:
        raise HintRefused("oversized", f"{len(hashes)} block hashes, at most {MAX_HINT_BLOCKS}")
    n = 0
    for theirs, ours in zip(hashes, request_hashes):
        if (theirs & ((1 << 64) - 1)) != router_hash(ours):
            break
        n += 1
    if hashes and n == 0:
        raise HintRefused("foreign", "the hint's first block is not this request's")
    return FetchHint(endpoint, n)


@dataclass
class HintCounters:
    seen: int = 0  # requests that came with a kv.fetch hint
    used: int = 0  # hints whose pull made blocks visible
    skipped: int = 0  # hints the load policy left unpulled (recompute predicted faster)
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    failed: dict[str, int] = field(default_factory=dict)  # reason -> hints that ended in a recompute

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1


class WorkerHints:
    """A worker's half of router hints over its offload's peer link (EngineOffload.open_peer_link):
    its host tier served on the advertised control port, and its pulls from the hinted sources."""

    def __init__(self, offload: EngineOffload, tier: HintTier, port: int, secret: bytes | None) -> None:
        if not secret:
            raise ValueError(
                "FlexKVConnector: secondary_tiers router_hint needs the deployment's shared secret in "
                "FLEXKV_HANDOVER_SECRET on every worker (the pulls prove membership with it)"
            )
        self.tier = tier
        self.counters = HintCounters()
        self._lock = threading.Lock()
        self.link = offload.open_peer_link(secret, tier.bind_host, port, tier.lease_s)

    def pull(
        self,
        hint: FetchHint,
        token_ids: Sequence[int],
        lora: str | None,
        salt: str | None,
        bs: int,
        prompt_tokens: int | None = None,
        local_blocks: int = 0,
    ) -> PullResult:
        """Pulls the hinted blocks this worker lacks, unless the load policy predicts recomputing
        them faster (``prompt_tokens``: the whole prompt; ``local_blocks``: what the engine holds);
        returns the pull's outcome: ``blocks`` that became visible from block ``start`` on (a
        failure counts, with ``why``, and makes none visible: the tiers serve what they hold, the
        rest is recomputed)."""
        from dynamo_flexkv.core.peer import PullResult

        if hint.blocks <= 0:
            with self._lock:
                self.counters.fail("foreign")
            return PullResult(False, why="foreign")
        r = self.link.pull(
            hint.endpoint,
            token_ids,
            lora_name=lora,
            cache_salt=salt,
            blocks=hint.blocks,
            timeout=self.tier.pull_timeout_s,
            prompt_tokens=prompt_tokens,
            skip_blocks=local_blocks,
        )
        with self._lock:
            if r.decision == "slower":
                self.counters.skipped += 1
            if r.blocks:
                self.counters.used += 1
                self.counters.pulled_tokens += r.blocks * bs
                self.counters.pulled_bytes += r.nbytes
                self.counters.pull_seconds += r.seconds
            if r.why:
                self.counters.fail(r.why)
        return r

    def totals(self) -> dict[str, float]:
        """Running totals as the worker's step-stats keys (metrics.py)."""
        c, s = self.counters, self.link.source_stats
        out: dict[str, float] = {
            "hints_seen": c.seen,
            "hints_used": c.used,
            "hints_skipped": c.skipped,
            "hint_pulled_tokens": c.pulled_tokens,
            "hint_pulled_bytes": c.pulled_bytes,
            "hint_pull_seconds": c.pull_seconds,
            "peer_pins": s.pins,
            "peer_pins_expired": s.expired,
        }
        out.update({f"hints_failed/{why}": n for why, n in c.failed.items()})
        out.update({f"peer_refused/{why}": n for why, n in s.refused.items()})
        return out

    def gauges(self) -> dict[str, float]:
        return {"gauge:peer_pinned_blocks": self.link.source_stats.pinned_blocks}

    def close(self) -> None:
        self.link.close()
