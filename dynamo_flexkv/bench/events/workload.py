"""The simulated workload: trace prompts as chains of KV blocks, probe and hello blocks, and a
worker's tiers as LRU sets that publish every tier's Stored/Removed events."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 64  # one trace block (512 tokens) -> one 64-token KV block, workload.Scale's x1/8
MAX_BLOCKS = 64  # prompts cut at 64 blocks (4,096 scaled tokens)
# Per-worker LRU capacity in blocks: small, so every tier evicts (steady state) within the warm-up.
CAPACITY = {"device": 32, "host": 48, "disk": 64, "remote": 96}
PREROLL = 8  # requests per worker during the warm-up (spread over it): every tier full and evicting
OURS_TIERS = ("device", "host", "disk", "remote")
DEVICE_TIERS = ("device",)
PROBE_INTERVAL = 0.05  # a probe block published every this many seconds (the lag measurement)
TRACE_RATE_NOTE = (
    "Mooncake conversation trace: 12,031 requests in 3,537 s (3.40 req/s), 24.0 blocks of 512 tokens each on average"
)
MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def chain(hash_ids: Sequence[int]) -> list[int]:
    """Sequence hashes of a trace prompt's blocks: unique per prefix, the same in every process."""
    out, prev = [], 0
    for h in hash_ids:
        prev = splitmix(prev ^ splitmix(h + 1))
        out.append(prev)
    return out


def block_tokens(hash_ids: Sequence[int]) -> list[int]:
    """BLOCK_TOKENS token ids per trace block, distinct per hash_id."""
    return [h * BLOCK_TOKENS + j for h in hash_ids for j in range(BLOCK_TOKENS)]


def probe_tokens(k: int) -> list[int]:
    return [(1 << 30) + k * BLOCK_TOKENS + j for j in range(BLOCK_TOKENS)]


def probe_hash(k: int) -> int:
    return splitmix((1 << 62) + k)


# Every worker stores this one block until the run starts: the router lists, per worker, whether
# it arrived, so the run starts once every worker's event path is live (early frames of a new
# ZMQ subscription are dropped by ZMQ itself, before Dynamo sees them).
HELLO_TOKENS = [(1 << 29) + j for j in range(BLOCK_TOKENS)]
HELLO_HASH = splitmix(1 << 61)


def load_prompts() -> list[tuple[int, ...]]:
    from dynamo_flexkv.workload import load_trace

    return [tuple(r.hash_ids[:MAX_BLOCKS]) for r in load_trace()]


class SimWorker:
    """One worker's tiers as LRU sets of blocks; a request stores its missing tail in each tier
    and evicts leaves first (blocks are touched leaf to root, so a chain's tail is older)."""

    def __init__(self, relay, tiers: Sequence[str]) -> None:
        from dynamo_flexkv.core.contract import Tier
        from dynamo_flexkv.integrations.events import REMOTE

        self.relay = relay
        # (name, the tier its events name: None for the device, its LRU of sequence hashes, capacity)
        self.tiers: list[tuple[str, Tier | str | None, OrderedDict[int, None], int]] = [
            (t, {"device": None, "host": Tier.HOST, "disk": Tier.DISK, "remote": REMOTE}[t], OrderedDict(), CAPACITY[t])
            for t in tiers
        ]
        self.blocks = {t: [0, 0] for t in tiers}  # tier -> [stored, removed]

    def serve(self, hash_ids: Sequence[int], seqs: Sequence[int]) -> None:
        n = len(seqs)
        for name, tier, lru, cap in self.tiers:
            k = 0
            while k < n and seqs[k] in lru:
                k += 1
            if k < n:
                self.relay.stored(tier, seqs[k:], seqs[k - 1] if k else None, block_tokens(hash_ids[k:]))
                for s in seqs[k:]:
                    lru[s] = None
                self.blocks[name][0] += n - k
            for s in reversed(seqs):
                lru.move_to_end(s)
            victims = []
            while len(lru) > cap:
                victims.append(lru.popitem(last=False)[0])
            if victims:
                self.relay.removed(tier, victims)
                self.blocks[name][1] += len(victims)
