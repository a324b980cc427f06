"""What the node's tiers hold, as KV events for every attached engine.

The service's index tells this listener (IndexListener) each commit and removal, under the index's
lock, so they arrive in order. Each becomes an Event sent to every attached engine that publishes
(each of them can load every block of the node's tiers, so each announces them as its own), and a
record of the blocks held, so an engine that attaches later receives the current set first
(``subscribe``), parents before children: nothing announced that it cannot load, nothing missing.

Blocks are named for the router as the engine that stored them names its device blocks (vLLM's
block hashes: sha256 with vLLM's fixed seed by default, the same in every process), sent with each
store (``name``); blocks nobody named (a disk tier re-adopted at a restart) keep the tiers' own
sequence hash."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo_flexkv.core.contract import Tier, TierRun
from dynamo_flexkv.core.node.protocol import Event, pack_tokens

SNAPSHOT_EVENTS_PER_FRAME = 4096
MAX_PENDING_NAMES = 1 << 20

BlockName = int | bytes  # the engine's name of a block (vLLM's block hash: an int or bytes)


@dataclass
class _Block:
    parent: int | None
    tokens: bytes
    name: BlockName | None
    tiers: set[str] = field(default_factory=set)


Subscriber = Callable[[list[Event], bool], None]  # (events, resync) -> queued for one engine


class EventMirror:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self._names: collections.OrderedDict[int, BlockName] = collections.OrderedDict()  # named, not stored yet
        self._subscribers: dict[int, Subscriber] = {}
        self.dropped_subscribers = 0

    # ---- from the engines -------------------------------------------------------------------------
    def name(self, hashes: list[int], names: list[BlockName] | None) -> None:
        """The storing engine's name for each of these blocks; kept for the first Stored of each."""
        if not names or len(names) != len(hashes):
            return
        with self._lock:
            for h, n in zip(hashes, names):
                if h not in self._blocks:
                    self._names[h] = n
                    self._names.move_to_end(h)
            while len(self._names) > MAX_PENDING_NAMES:  # names of stores that never committed
                self._names.popitem(last=False)

    def subscribe(self, key: int, send: Subscriber) -> int:
        """Sends ``send`` every block held now (a resync: the engine forgets what it announced
        before), then every change. Returns the blocks sent."""
        with self._lock:
            events = []
            for h, b in self._blocks.items():
                for tier in sorted(b.tiers):
                    events.append(Event(True, tier, [h], b.parent, b.tokens, None if b.name is None else [b.name]))
            self._subscribers[key] = send
            for i in range(0, max(len(events), 1), SNAPSHOT_EVENTS_PER_FRAME):
                send(events[i : i + SNAPSHOT_EVENTS_PER_FRAME], i == 0)
            return len(events)

    def unsubscribe(self, key: int) -> None:
        with self._lock:
            self._subscribers.pop(key, None)

    @property
    def blocks(self) -> int:
        with self._lock:
            return len(self._blocks)

    def held(self, tier: str) -> list[int]:
        """The sequence hashes this tier holds (tests compare it with the router's view)."""
        with self._lock:
            return [h for h, b in self._blocks.items() if tier in b.tiers]

    # ---- IndexListener --------------------------------------------------------------------------------
    def on_stored(self, tier: Tier, run: TierRun) -> None:
        if run.token_ids is None:
            return  # a re-adopted block journaled without tokens: it cannot be named
        b = self.tokens_per_block
        with self._lock:
            names: list[BlockName | None] = []
            for i, h in enumerate(run.hashes):
                h = int(h)
                blk = self._blocks.get(h)
                if blk is None:
                    parent = run.parent if i == 0 else int(run.hashes[i - 1])
                    blk = self._blocks[h] = _Block(
                        None if parent is None else int(parent),
                        pack_tokens(run.token_ids[i * b : (i + 1) * b]),
                        self._names.pop(h, None),
                    )
                blk.tiers.add(tier.value)
                names.append(blk.name)
            event = Event(
                True,
                tier.value,
                [int(h) for h in run.hashes],
                None if run.parent is None else int(run.parent),
                pack_tokens(run.token_ids),
                names if any(n is not None for n in names) else None,
            )
            self._fan_out([event])

    def on_removed(self, tier: Tier, hashes: list[int]) -> None:
        with self._lock:
            for h in hashes:
                blk = self._blocks.get(int(h))
                if blk is not None:
                    blk.tiers.discard(tier.value)
                    if not blk.tiers:
                        del self._blocks[int(h)]
            self._fan_out([Event(False, tier.value, [int(h) for h in hashes])])

    def _fan_out(self, events: list[Event]) -> None:  # lock held: events leave in commit order
        for key, send in list(self._subscribers.items()):
            try:
                send(events, False)
            except ConnectionError:
                self._subscribers.pop(key, None)  # its session closes and cleans up
                self.dropped_subscribers += 1
