"""Tier-tagged KV events for Dynamo's KV router (DESIGN section 7).

The router keeps one index per storage tier, but Dynamo's direct-publish API carries no tier; its
relay mode does. So a worker binds a ZMQ PUB socket on loopback, hands its address to
``dynamo._core.KvEventPublisher(endpoint, kv_block_size=B, zmq_endpoint=..., enable_local_indexer=True)``,
and publishes here: frames ``[topic, 8-byte big-endian sequence, msgpack([ts, [event], dp_rank])]``
with ``medium`` omitted for the device tier, ``CPU_PINNED`` for host, ``DISK``, ``EXTERNAL``.

An event is sent when a copy *completed* into a tier (Stored) or left it (Removed). Device and
offload events share the socket, so their order holds.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import msgspec
import zmq

from dynamo_flexkv.index.cache_engine import Tier, TierRun

MEDIUM: Dict[Optional[Tier], Optional[str]] = {
    None: None,  # the engine's own (device) cache
    Tier.HOST: "CPU_PINNED",
    Tier.DISK: "DISK",
}


def _signed(h: int) -> int:
    """Dynamo's relay reads block hashes as i64; ours are u64."""
    return h - (1 << 64) if h >= (1 << 63) else h


class KvEventRelay:
    """Publishes BlockStored / BlockRemoved / AllBlocksCleared frames on a loopback PUB socket."""

    def __init__(self, block_size: int, endpoint: str = "tcp://127.0.0.1:*", dp_rank: int = 0,
                 topic: str = "") -> None:
        if not endpoint.startswith("tcp://127.0.0.1:") and not endpoint.startswith("ipc://"):
            raise ValueError(f"KV event endpoint {endpoint!r} must be loopback (tcp://127.0.0.1:PORT) or ipc://")
        self.block_size, self.dp_rank, self.topic = block_size, dp_rank, topic.encode()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)  # a PUB that also tells us when someone subscribed
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._lock = threading.Lock()  # events come from engine and transfer threads
        self.sent = 0
        self.subscribed = False

    def wait_for_subscriber(self, timeout: float) -> bool:
        """True once a subscriber's subscription arrived (events sent before that are lost: ZMQ
        drops them); False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.subscribed:
            with self._lock:
                try:
                    if self._sock.recv(zmq.NOBLOCK)[:1] == b"\x01":
                        self.subscribed = True
                        continue
                except zmq.Again:
                    pass
                except zmq.ZMQError:  # closed while we waited
                    return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stored(self, tier: Optional[Tier], hashes: Sequence[int], parent: Optional[int],
               token_ids: Sequence[int]) -> None:
        """Blocks ``hashes`` (a chain after ``parent``) landed in ``tier`` (None: device)."""
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(f"{len(hashes)} blocks need {len(hashes) * self.block_size} token ids, "
                             f"got {len(token_ids)}")
        event: Dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [_signed(int(h)) for h in hashes],
            "parent_block_hash": None if parent is None else _signed(int(parent)),
            "token_ids": [int(t) for t in token_ids],
            "block_size": self.block_size,
            "lora_name": None,
        }
        self._medium(event, tier)
        self._send(event)

    def removed(self, tier: Optional[Tier], hashes: Sequence[int]) -> None:
        event: Dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [_signed(int(h)) for h in hashes]}
        self._medium(event, tier)
        self._send(event)

    def cleared(self) -> None:
        self._send({"type": "AllBlocksCleared"})

    def close(self) -> None:
        self._sock.close()

    @staticmethod
    def _medium(event: Dict[str, Any], tier: Optional[Tier]) -> None:
        medium = MEDIUM[tier]
        if medium is not None:
            event["medium"] = medium

    def _send(self, event: Dict[str, Any]) -> None:
        payload = msgspec.msgpack.encode([time.time(), [event], self.dp_rank])
        with self._lock:
            self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
            self._seq += 1
            self.sent += 1


class OffloadEvents:
    """IndexListener that turns the control plane's commits and removals into relay events.
    Runs carry their token ids (KVManager attaches them when it plans)."""

    def __init__(self, relay: KvEventRelay) -> None:
        self.relay = relay

    def on_stored(self, tier: Tier, run: TierRun) -> None:
        if run.token_ids is None:
            return  # e.g. re-adopted disk blocks: their tokens are not known here
        self.relay.stored(tier, run.hashes, run.parent, run.token_ids)

    def on_removed(self, tier: Tier, hashes: List[int]) -> None:
        self.relay.removed(tier, hashes)
