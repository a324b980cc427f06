"""The relay's wire format (what Dynamo's relay-mode KvEventPublisher parses) and its batching:
many events per frame, chains and removal passes merged, order kept, frames and queue bounded."""

import threading

import msgspec
import pytest
import zmq

from dynamo_flexkv.core.index import Tier
from dynamo_flexkv.integrations.events import KvEventRelay
from dynamo_flexkv.integrations.events import signed_hash as _signed


class Subscriber:
    def __init__(self, relay: KvEventRelay) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(relay.endpoint)
        assert relay.wait_for_subscriber(10)

    def frames(self, timeout_ms: int = 300) -> list[list]:
        """Every frame that arrives until none came for ``timeout_ms``."""
        out = []
        while self.sock.poll(timeout_ms):
            out.append(self.sock.recv_multipart())
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def relay_and_sub(request):
    kw = getattr(request, "param", {})
    relay = KvEventRelay(block_size=4, **kw)
    sub = Subscriber(relay)
    yield relay, sub
    sub.close()
    relay.close()


def events_of(frames) -> list[dict]:
    return [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]


def test_frames_carry_tier_and_signed_hashes(relay_and_sub):
    relay, sub = relay_and_sub
    big = (1 << 64) - 5
    relay.stored(Tier.HOST, [big, 7], None, list(range(8)))
    relay.stored(Tier.DISK, [big, 7], None, list(range(8)))
    relay.removed(Tier.DISK, [7])
    relay.stored(None, [9], None, [1, 2, 3, 4])
    relay.flush()
    frames = sub.frames()
    assert relay.endpoint.startswith("tcp://127.0.0.1:")
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(len(frames))) and all(f[0] == b"" for f in frames)
    ts, _, dp = msgspec.msgpack.decode(frames[0][2])
    assert dp == 0 and isinstance(ts, float)
    assert events_of(frames) == [
        {
            "type": "BlockStored",
            "block_hashes": [-5, 7],
            "parent_block_hash": None,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_name": None,
            "medium": "CPU_PINNED",
        },
        {
            "type": "BlockStored",
            "block_hashes": [-5, 7],
            "parent_block_hash": None,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_name": None,
            "medium": "DISK",
        },
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "DISK"},
        {
            "type": "BlockStored",
            "block_hashes": [9],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "lora_name": None,
        },  # device events carry no medium
    ]
    assert relay.known_blocks(Tier.HOST) == 2 and relay.known_blocks(Tier.DISK) == 1 and relay.known_blocks(None) == 1


@pytest.mark.parametrize("relay_and_sub", [{"flush_interval": 30.0}], indirect=True)
def test_a_burst_is_one_frame_with_chains_and_passes_merged(relay_and_sub):
    """One engine step's caching pass (block by block) and eviction pass leave as one frame:
    the chain as one BlockStored, the pass's removals as one BlockRemoved per tier, in order."""
    relay, sub = relay_and_sub
    relay.stored(None, [100], None, [0] * 4)
    assert len(sub.frames()) == 1  # the first event after a quiet spell leaves at once
    for i in range(1, 120):  # a 120-block prompt cached block by block
        relay.stored(None, [i], i - 1 if i > 1 else None, [i] * 4)
    relay.stored(Tier.HOST, [1, 2], None, [0] * 8)
    for i in range(119, 60, -1):  # an eviction pass, tail first
        relay.removed(None, [i])
    relay.removed(Tier.HOST, [2])
    relay.removed(None, [60])
    relay.flush()  # within flush_interval of the last frame: left to the flusher, not sent now
    assert sub.frames(100) == []
    relay.close()  # sends what is queued
    frames = sub.frames()
    assert len(frames) == 1
    events = events_of(frames)
    assert [(e["type"], e.get("medium")) for e in events] == [
        ("BlockStored", None),
        ("BlockStored", "CPU_PINNED"),
        ("BlockRemoved", None),
        ("BlockRemoved", "CPU_PINNED"),
        ("BlockRemoved", None),
    ]
    assert events[0]["block_hashes"] == list(range(1, 120)) and events[0]["parent_block_hash"] is None
    assert events[0]["token_ids"] == [i for i in range(1, 120) for _ in range(4)]
    assert events[2]["block_hashes"] == list(range(119, 60, -1)) and events[4]["block_hashes"] == [60]
    assert relay.sent == 2 and relay.events_sent == 6


def test_flush_sends_at_once_after_a_quiet_spell(relay_and_sub):
    relay, sub = relay_and_sub
    relay.stored(None, [1, 2], None, [0] * 8)
    relay.flush()
    frames = sub.frames()
    assert len(frames) == 1 and events_of(frames)[0]["block_hashes"] == [1, 2]


@pytest.mark.parametrize("relay_and_sub", [{"flush_interval": 30.0, "max_pending_blocks": 100}], indirect=True)
def test_queue_is_bounded_by_blocks(relay_and_sub):
    """A subscriber-independent bound: past max_pending_blocks the queue leaves as one frame."""
    relay, sub = relay_and_sub
    for i in range(1, 1001):
        relay.stored(None, [i], None, [0] * 4)  # 1000 separate one-block prompts: nothing merges
        assert relay.pending_blocks < 100
    relay.close()
    frames = sub.frames()
    assert 10 <= len(frames) <= 12  # at most one timed frame, then one per 100 blocks
    assert [e["block_hashes"][0] for e in events_of(frames)] == list(range(1, 1001))


def test_events_the_router_cannot_apply_are_not_sent(relay_and_sub):
    relay, sub = relay_and_sub
    relay.stored(None, [5], 4, [0] * 4)  # parent 4 was never announced: the router would drop it
    relay.removed(None, [5])  # and then warn about this removal
    relay.removed(Tier.HOST, [1])  # never stored in that tier
    relay.stored(Tier.HOST, [1], None, [0] * 4)
    relay.removed(None, [1])  # stored on host, not on the device
    relay.removed(Tier.HOST, [1])
    relay.removed(Tier.HOST, [1])  # twice
    relay.flush()
    events = events_of(sub.frames())
    assert [(e["type"], e["block_hashes"]) for e in events] == [("BlockStored", [1]), ("BlockRemoved", [1])]
    assert relay.skipped == 5


def test_cleared_forgets_every_tier(relay_and_sub):
    relay, sub = relay_and_sub
    relay.stored(None, [1], None, [0] * 4)
    relay.stored(Tier.DISK, [1], None, [0] * 4)
    relay.cleared()
    relay.removed(Tier.DISK, [1])  # the router already forgot it
    relay.stored(Tier.DISK, [1], None, [0] * 4)
    relay.flush()
    assert [e["type"] for e in events_of(sub.frames())] == [
        "BlockStored",
        "BlockStored",
        "AllBlocksCleared",
        "BlockStored",
    ]
    assert relay.known_blocks(None) == 0 and relay.known_blocks(Tier.DISK) == 1


def test_threads_keep_their_order(relay_and_sub):
    """Engine and transfer threads publish at once: every chain arrives whole and in order."""
    relay, sub = relay_and_sub
    chains = {t: [(t << 32) + i for i in range(400)] for t in range(4)}

    def publish(t: int) -> None:
        prev: int | None = None
        for h in chains[t]:
            relay.stored(Tier.HOST if t % 2 else None, [h], prev, [t] * 4)
            prev = h

    threads = [threading.Thread(target=publish, args=(t,)) for t in chains]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    relay.flush()
    seen: dict[str | None, list[int]] = {}
    known = set()
    for e in events_of(sub.frames(1000)):
        assert e["parent_block_hash"] is None or e["parent_block_hash"] in known
        known.update(e["block_hashes"])
        seen.setdefault(e.get("medium"), []).extend(e["block_hashes"])
    got = sorted(seen[None]) + sorted(seen["CPU_PINNED"])
    assert got == sorted(_signed(h) for t in (0, 2) for h in chains[t]) + sorted(h for t in (1, 3) for h in chains[t])
    assert relay.skipped == 0


def test_bad_use():
    with pytest.raises(ValueError, match="must be loopback"):
        KvEventRelay(4, endpoint="tcp://10.0.0.1:5555")
    with pytest.raises(ValueError, match="flush_interval=0 must be > 0"):
        KvEventRelay(4, flush_interval=0)
    relay = KvEventRelay(4)
    try:
        with pytest.raises(ValueError, match="2 blocks need 8 token ids, got 5"):
            relay.stored(Tier.HOST, [1, 2], None, [0] * 5)
    finally:
        relay.close()
    with pytest.raises(RuntimeError, match="closed"):
        relay.stored(None, [1], None, [0] * 4)
    relay.close()  # twice is fine


def test_blocks_sent_before_any_subscriber_are_not_counted_as_told():
    """ZMQ drops a frame nobody subscribed to: those blocks are not the router's, so a child of
    them is not sent either, and they are sent again once someone listens."""
    relay = KvEventRelay(block_size=4)
    try:
        relay.stored(Tier.DISK, [1, 2], None, list(range(8)))
        relay.flush(force=True)
        assert relay.known_blocks(Tier.DISK) == 0 and relay.unheard == 1
        relay.stored(Tier.DISK, [3], 2, list(range(4)))  # its parent never reached anyone
        assert relay.skipped == 1
        sub = Subscriber(relay)
        try:
            relay.stored(Tier.DISK, [1, 2], None, list(range(8)))
            relay.stored(Tier.DISK, [3], 2, list(range(4)))
            relay.flush(force=True)
            got = events_of(sub.frames())
            assert [e["block_hashes"] for e in got] == [[1, 2, 3]] and relay.known_blocks(Tier.DISK) == 3
        finally:
            sub.close()
    finally:
        relay.close()
