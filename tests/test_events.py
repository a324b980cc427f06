"""The relay's wire format (what Dynamo's relay-mode KvEventPublisher parses)."""

import time

import msgspec
import pytest
import zmq

from dynamo_flexkv.events import KvEventRelay
from dynamo_flexkv.index import Tier


def test_frames_carry_tier_and_signed_hashes():
    relay = KvEventRelay(block_size=4)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(relay.endpoint)
    try:
        time.sleep(0.2)  # PUB/SUB: let the subscription reach the publisher
        big = (1 << 64) - 5
        relay.stored(Tier.HOST, [big, 7], None, list(range(8)))
        relay.removed(Tier.DISK, [7])
        relay.stored(None, [9], 7, [1, 2, 3, 4])
        frames = [sub.recv_multipart() for _ in range(3)]
    finally:
        sub.close()
        relay.close()
    assert relay.endpoint.startswith("tcp://127.0.0.1:")
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == [0, 1, 2] and all(f[0] == b"" for f in frames)
    batches = [msgspec.msgpack.decode(f[2]) for f in frames]
    (ts, events, dp) = batches[0]
    assert dp == 0 and isinstance(ts, float)
    assert events == [{"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": None,
                       "token_ids": list(range(8)), "block_size": 4, "lora_name": None, "medium": "CPU_PINNED"}]
    assert batches[1][1] == [{"type": "BlockRemoved", "block_hashes": [7], "medium": "DISK"}]
    assert "medium" not in batches[2][1][0]  # device events carry no medium


def test_bad_use():
    with pytest.raises(ValueError, match="must be loopback"):
        KvEventRelay(4, endpoint="tcp://10.0.0.1:5555")
    relay = KvEventRelay(4)
    try:
        with pytest.raises(ValueError, match="2 blocks need 8 token ids, got 5"):
            relay.stored(Tier.HOST, [1, 2], None, [0] * 5)
    finally:
        relay.close()
