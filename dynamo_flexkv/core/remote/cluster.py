"""Redis Cluster routing: key -> hash slot -> node, from CLUSTER SLOTS.

Keys are not hash-tagged (one tag per fingerprint would put a whole model on one node); each
batch is split per node and pipelined to each node instead.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence

NUM_SLOTS = 16384
Node = tuple[str, int]


def key_slot(key: bytes) -> int:
    """Redis Cluster hash slot: CRC16-XMODEM (binascii.crc_hqx) of the key or of its {hash tag}."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % NUM_SLOTS


class SlotMap:
    """Which node serves each of the 16384 slots (masters only)."""

    def __init__(self, slots_reply: Sequence, default_host: str) -> None:
        self.owner: list[int] = [-1] * NUM_SLOTS
        self.nodes: list[Node] = []
        index: dict[Node, int] = {}
        for entry in slots_reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            node = (host or default_host, int(master[1]))  # an empty host means "the one you asked"
            if node not in index:
                index[node] = len(self.nodes)
                self.nodes.append(node)
            self.owner[start : end + 1] = [index[node]] * (end - start + 1)
        missing = self.owner.count(-1)
        if missing:
            raise ValueError(
                f"redis cluster covers only {NUM_SLOTS - missing} of {NUM_SLOTS} slots: "
                f"fix the cluster (redis-cli --cluster fix HOST:PORT)"
            )

    def group(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of ``keys`` per node index, each list in key order."""
        out: dict[int, list[int]] = {}
        owner = self.owner
        for i, k in enumerate(keys):
            out.setdefault(owner[key_slot(k)], []).append(i)
        return out
