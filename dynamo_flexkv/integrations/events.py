"""Tier-tagged KV events for Dynamo's KV router (frame format: docs/WIRE_FORMATS.md).

The router keeps one index per storage tier, but Dynamo's direct-publish API carries no tier; its
relay mode does. So a worker binds a ZMQ PUB socket on loopback, hands its address to
``dynamo._core.KvEventPublisher(endpoint, kv_block_size=B, zmq_endpoint=..., enable_local_indexer=True)``,
and publishes here: frames ``[topic, 8-byte big-endian sequence, msgpack([ts, [events...], dp_rank])]``
with ``medium`` omitted for the device tier, ``CPU_PINNED`` for host, ``DISK``, ``EXTERNAL``.

An event is sent when a copy *completed* into a tier (Stored) or left it (Removed). Device and
offload events share one queue and one socket, so their order holds.

Batching: Dynamo 1.6.1's router keeps at most 64 frames per worker in its brokered-ZMQ lane and
drops the newest when full ("Brokered-ZMQ publisher lane is full; dropping the newest batch"), so
a burst of one frame per block loses events. Events therefore queue here and leave as one frame
carrying many, at most one frame per ``flush_interval`` (a flusher thread sends what is queued;
the engine may ``flush()`` at the end of a step), with a chain's consecutive blocks merged into one
BlockStored and consecutive removals of a tier into one BlockRemoved. The queue is bounded: past
``max_pending_blocks`` queued blocks it is sent at once, as one frame.

The relay also remembers which blocks it told the router about, per tier: a Stored whose parent
the router does not know would be dropped there, and a Removed of a block it does not know is
logged as "Failed to find block to remove"; neither is sent (``skipped`` counts them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from dynamo_flexkv.core.contract import Tier, TierRun

log = logging.getLogger(__name__)

# The remote store is not one of the cache engine's tiers (see Tier); a publisher that announces
# its blocks passes REMOTE as the tier (bench events simulates such workers).
REMOTE = "remote"
MEDIUM: dict[object | None, str | None] = {
    None: None,  # the engine's own (device) cache
    Tier.HOST: "CPU_PINNED",
    Tier.DISK: "DISK",
    REMOTE: "EXTERNAL",
}


def signed_hash(h: int) -> int:
    """Dynamo's relay reads block hashes as i64; ours are u64."""
    return h - (1 << 64) if h >= (1 << 63) else h


class KvEventRelay:
    """Publishes BlockStored / BlockRemoved / AllBlocksCleared events, batched into frames, on a
    loopback PUB socket."""

    def __init__(
        self,
        block_size: int,
        endpoint: str = "tcp://127.0.0.1:*",
        dp_rank: int = 0,
        topic: str = "",
        flush_interval: float = 0.005,
        max_pending_blocks: int = 16384,
    ) -> None:
        if not endpoint.startswith("tcp://127.0.0.1:") and not endpoint.startswith("ipc://"):
            raise ValueError(f"KV event endpoint {endpoint!r} must be loopback (tcp://127.0.0.1:PORT) or ipc://")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval={flush_interval} must be > 0 seconds: it bounds the frame rate")
        if max_pending_blocks < 1:
            raise ValueError(f"max_pending_blocks={max_pending_blocks} must be >= 1")
        self.block_size, self.dp_rank, self.topic = block_size, dp_rank, topic.encode()
        self.flush_interval, self.max_pending_blocks = flush_interval, max_pending_blocks
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)  # a PUB that also tells us when someone subscribed
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        # One lock for queue, socket and the router's view: events come from the engine thread
        # and from transfer threads (under the CacheEngine's lock), and leave in that order.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[dict[str, Any]] = []
        self._pending_blocks = 0
        self._last_frame_at = 0.0
        self._known: dict[str | None, set[int]] = {}  # medium -> blocks the router was told about
        self._closed = False
        self.sent = 0  # frames
        self.events_sent = 0
        self.events_published = 0  # queued for the router; sent within about one flush_interval
        self.skipped = 0  # events the router could not have applied (see the module docstring)
        self.subscribed = False
        self.unheard = 0  # events queued before any subscriber joined: dropped, not counted as told
        self._flusher = threading.Thread(target=self._flush_loop, name="kv-event-relay", daemon=True)
        self._flusher.start()

    def wait_for_subscriber(self, timeout: float) -> bool:
        """True once a subscriber's subscription arrived (events sent before that are lost: ZMQ
        drops them); False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                try:
                    if self._poll_subscribed():
                        return True
                except zmq.ZMQError:  # closed while we waited
                    return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _poll_subscribed(self) -> bool:  # lock held
        """Reads the XPUB's subscription messages that arrived (never blocks)."""
        while not self.subscribed:
            try:
                if self._sock.recv(zmq.NOBLOCK)[:1] == b"\x01":
                    self.subscribed = True
            except zmq.Again:
                break
        return self.subscribed

    def stored(self, tier: Tier | None, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """Blocks ``hashes`` (a chain after ``parent``) landed in ``tier`` (None: device)."""
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(
                f"{len(hashes)} blocks need {len(hashes) * self.block_size} token ids, got {len(token_ids)}"
            )
        if not hashes:
            return
        medium = MEDIUM[tier]
        signed = [signed_hash(int(h)) for h in hashes]
        parent_signed = None if parent is None else signed_hash(int(parent))
        tokens = [int(t) for t in token_ids]
        with self._lock:
            self._check_open()
            known = self._known.setdefault(medium, set())
            if parent_signed is not None and parent_signed not in known:
                self._skip(f"BlockStored after parent {parent_signed} the router does not know ({medium or 'device'})")
                return
            known.update(signed)
            last = self._pending[-1] if self._pending else None
            if (
                last is not None
                and last["type"] == "BlockStored"
                and last.get("medium") == medium
                and parent_signed is not None
                and last["block_hashes"][-1] == parent_signed
            ):
                last["block_hashes"] += signed  # the same chain, continued: one event
                last["token_ids"] += tokens
            else:
                event: dict[str, Any] = {
                    "type": "BlockStored",
                    "block_hashes": signed,
                    "parent_block_hash": parent_signed,
                    "token_ids": tokens,
                    "block_size": self.block_size,
                    "lora_name": None,
                }
                self._enqueue(event, medium)
            self._grew(len(signed))

    def removed(self, tier: Tier | None, hashes: Sequence[int]) -> None:
        """Blocks ``hashes`` left ``tier``; callers remove leaves first (a chain's tail before its
        head), as the router's tree applies removals."""
        medium = MEDIUM[tier]
        with self._lock:
            self._check_open()
            known = self._known.setdefault(medium, set())
            signed = []
            for h in hashes:
                s = signed_hash(int(h))
                if s in known:
                    known.discard(s)
                    signed.append(s)
            if len(signed) < len(hashes):
                self._skip(
                    f"BlockRemoved of {len(hashes) - len(signed)} blocks the router does not know "
                    f"({medium or 'device'})"
                )
            if not signed:
                return
            last = self._pending[-1] if self._pending else None
            if last is not None and last["type"] == "BlockRemoved" and last.get("medium") == medium:
                last["block_hashes"] += signed
            else:
                self._enqueue({"type": "BlockRemoved", "block_hashes": signed}, medium)
            self._grew(len(signed))

    def cleared(self) -> None:
        """The worker dropped every block of every tier (the router forgets them all)."""
        with self._lock:
            self._check_open()
            self._known.clear()
            self._enqueue({"type": "AllBlocksCleared"}, None)
            self._grew(1)

    def known_blocks(self, tier: Tier | None) -> int:
        """Blocks of ``tier`` the router was told about and not told to remove."""
        with self._lock:
            return len(self._known.get(MEDIUM[tier], ()))

    @property
    def pending_blocks(self) -> int:
        """Blocks queued for the next frame (it leaves at once when they reach ``max_pending_blocks``)."""
        with self._lock:
            return self._pending_blocks

    def flush(self, force: bool = False) -> None:
        """Sends what is queued now, as one frame, unless a frame left less than
        ``flush_interval`` ago (then the flusher thread sends it when the interval is over) and
        ``force`` is off. Call at the end of an engine step: the step's events leave together."""
        with self._lock:
            if self._pending and (force or time.monotonic() - self._last_frame_at >= self.flush_interval):
                self._send_pending()

    def close(self) -> None:
        """Sends what is still queued, stops the flusher, closes the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._flusher.join()
        with self._lock:
            self._send_pending()
            self._sock.close()

    # ---- internals (called with the lock held) -------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KvEventRelay is closed: publish KV events before close()")

    def _enqueue(self, event: dict[str, Any], medium: str | None) -> None:
        if medium is not None:
            event["medium"] = medium
        self._pending.append(event)
        self.events_published += 1

    def _grew(self, blocks: int) -> None:
        was_empty = self._pending_blocks == 0
        self._pending_blocks += blocks
        if self._pending_blocks >= self.max_pending_blocks:
            self._send_pending()  # bounded queue: one big frame now rather than unbounded memory
        elif was_empty:
            self._wake.notify()  # the flusher sleeps while nothing is queued

    def _skip(self, what: str) -> None:
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 1000 == 0:
            log.warning("not publishing %s (%d such events so far)", what, self.skipped)

    def _send_pending(self) -> None:
        if not self._pending:
            return
        events, self._pending, self._pending_blocks = self._pending, [], 0
        if not self._poll_subscribed():
            # Nobody listens yet: ZMQ drops the frame, so the router never hears of these blocks
            # and the relay must not count them as told (a child or a removal would be sent for
            # blocks the router does not know).
            for ev in events:
                if ev["type"] == "BlockStored":
                    self._known.get(ev.get("medium"), set()).difference_update(ev["block_hashes"])
            self.unheard += len(events)
            return
        payload = msgspec.msgpack.encode([time.time(), events, self.dp_rank])
        self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1
        self.sent += 1
        self.events_sent += len(events)
        self._last_frame_at = time.monotonic()

    def _flush_loop(self) -> None:
        """Sends queued events at most once per ``flush_interval``: a burst becomes a few large
        frames, and an event waits at most about one interval."""
        with self._lock:
            while not self._closed:
                if not self._pending:
                    self._wake.wait()
                    continue
                wait = self._last_frame_at + self.flush_interval - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                self._send_pending()


class OffloadEvents:
    """IndexListener that turns the control plane's commits and removals into relay events.
    Runs carry their token ids (KVManager attaches them when it plans)."""

    def __init__(self, relay: KvEventRelay) -> None:
        self.relay = relay

    def on_stored(self, tier: Tier, run: TierRun) -> None:
        if run.token_ids is None:
            return  # e.g. re-adopted disk blocks: their tokens are not known here
        self.relay.stored(tier, run.hashes, run.parent, run.token_ids)

    def on_removed(self, tier: Tier, hashes: list[int]) -> None:
        self.relay.removed(tier, hashes)
