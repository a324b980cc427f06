"""Disk adoption at start: the journal's blocks verified into the disk tier, and announced as
router events once the event subscriber is connected (the old process's announcements died with it)."""

from __future__ import annotations

import numpy as np

from dynamo_flexkv.core.contract import TierRun
from dynamo_flexkv.core.index import CacheEngine, Tier
from dynamo_flexkv.core.storage.ssd import AdoptReport, DiskEntry, SsdStore
from dynamo_flexkv.core.transfer.movers import DiskMover


def adopt_disk(ssd: SsdStore, cache: CacheEngine, mover: DiskMover, scratch_blocks: int) -> AdoptReport:
    """Verifies what the journal says is on disk, reading through ``scratch_blocks`` host slots
    at a time (the host tier is empty at start), and indexes what verified."""

    def read(entries: list[DiskEntry]) -> np.ndarray:
        out = []
        for i in range(0, len(entries), scratch_blocks):
            part = entries[i : i + scratch_blocks]
            disk_ids = np.array([e.block_id for e in part], dtype=np.int64)
            out.append(mover.read_for_adoption(disk_ids, np.arange(len(part), dtype=np.int64)))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)

    report = ssd.adopt(read)
    cache.tiers[Tier.DISK].adopt([(e.seq_hash, e.parent, e.block_id) for e in report.adopted])
    return report


def adopted_chains(entries: list[DiskEntry], tokens_per_block: int) -> list[TierRun]:
    """Adopted entries (parents first) as chains, depth first: one event per chain, not per block."""
    children: dict[int | None, list[DiskEntry]] = {}
    for entry in entries:
        children.setdefault(entry.parent, []).append(entry)
    runs: list[TierRun] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        top = stack.pop()
        parent = top.parent
        e: DiskEntry | None = top
        chain: list[DiskEntry] = []
        tokens: list[bytes] = []  # the chain's token ids, collected where ``e.tokens`` is known set
        while e is not None and e.tokens is not None and len(e.tokens) == 4 * tokens_per_block:
            chain.append(e)
            tokens.append(e.tokens)
            kids = children.get(e.seq_hash, [])
            stack.extend(reversed(kids[1:]))
            e = kids[0] if kids else None
        if chain:
            runs.append(
                TierRun(
                    Tier.DISK,
                    0,
                    [c.seq_hash for c in chain],
                    [c.block_id for c in chain],
                    parent,
                    new=False,
                    token_ids=np.frombuffer(b"".join(tokens), dtype="<u4").tolist(),
                )
            )
    return runs
