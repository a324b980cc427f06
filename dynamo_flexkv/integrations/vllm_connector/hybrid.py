"""A hybrid model's KV cache groups in the tiers (groups.py says what vLLM gives).

Two offloads share the engine's KV tensors (every group's blocks live in them, groups.py):

* ``main`` holds the main group, the first full-attention one: every block of a prefix, keyed
  and named in KV events as a model of one group is (Dynamo's router reads that group only);
* ``aux`` (no events) holds the others: an extra full-attention group as a chain of every block
  of its own (the cache salt tells it apart), a sliding-window group as *windows*: at a hit point P
  (in blocks), the ``window_blocks`` blocks before P, keyed by a salt that names the prefix they
  end (the main chain's hash of block P-1), so a window serves that prefix only.

A request stores its windows when it finishes, at the end of its full blocks, where vLLM still
holds them (it frees a window's blocks once the request moved past it). A prefix is then cached up
to P when every full group holds blocks [0, P) and every window group the window ending at P: a
returning conversation finds its previous turn's end; an earlier P only where this worker stored
a window since it started (``_ends``), checked newest prefix first."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from dynamo_flexkv.core.offload import EngineOffload
from dynamo_flexkv.integrations.vllm_connector.groups import FULL, KVGroup

log = logging.getLogger(__name__)

MAX_ENDS = 1 << 16  # hit points remembered for the scan below the main group's prefix


class GroupTiers:
    def __init__(self, groups: Sequence[KVGroup], main: EngineOffload, aux: EngineOffload, block_size: int) -> None:
        self.main, self.aux, self.bs = main, aux, block_size
        full = [g for g in groups if g.kind in FULL]
        self.main_group: KVGroup | None = full[0] if full else None
        self.chains = full[1:]  # extra full-attention groups: chains of their own in aux
        self.windows = [g for g in groups if g.sliding]
        self._ends: collections.OrderedDict[int, None] = collections.OrderedDict()  # anchors of stored windows
        self.windows_skipped = 0  # finished requests whose window vLLM no longer held whole

    # ---- names ---------------------------------------------------------------------------------------
    @staticmethod
    def _salt(salt: str | None, group: KVGroup, anchor: int | None = None) -> str:
        base = f"{salt or ''}|g{group.index}"
        return base if anchor is None else f"{base}|w{anchor & 0xFFFFFFFFFFFFFFFF:016x}"

    def anchors(self, tokens: Sequence[int], lora: str | None, salt: str | None) -> list[int]:
        """The chain hash of each full block of ``tokens``: what names the prefix a window ends."""
        return (self.main if self.main_group is not None else self.aux).block_hashes(
            tokens, lora_name=lora, cache_salt=salt
        )

    def _window(self, p: int, g: KVGroup) -> range:
        return range(max(0, p - g.window_blocks), p)

    # ---- lookup --------------------------------------------------------------------------------------
    def cached_tokens(
        self, tokens: Sequence[int], lora: str | None, salt: str | None, prompt_tokens: int, local_blocks: int
    ) -> int:
        """End of the prefix every group can load, in tokens (0: nothing beyond vLLM's own blocks)."""
        bs = self.bs
        end = len(tokens) // bs
        if self.main_group is not None:
            end = (
                self.main.cached_tokens(
                    tokens, lora_name=lora, cache_salt=salt, prompt_tokens=prompt_tokens, skip_blocks=local_blocks
                )
                // bs
            )
        for g in self.chains:
            if end <= local_blocks:
                return 0
            end = min(
                end,
                self.aux.cached_tokens(
                    tokens[: end * bs], lora_name=lora, cache_salt=self._salt(salt, g), skip_blocks=local_blocks
                )
                // bs,
            )
        if end <= local_blocks:
            return 0
        if not self.windows:
            return end * bs
        anchors = self.anchors(tokens[: end * bs], lora, salt)
        for p in range(end, local_blocks, -1):
            if p != end and anchors[p - 1] not in self._ends:
                continue
            if all(self._window_cached(tokens, anchors[p - 1], p, g, lora, salt) for g in self.windows):
                return p * bs
        return 0

    def _window_cached(
        self, tokens: Sequence[int], anchor: int, p: int, g: KVGroup, lora: str | None, salt: str | None
    ) -> bool:
        w = self._window(p, g)
        part = tokens[w.start * self.bs : p * self.bs]
        return self.aux.cached_tokens(part, lora_name=lora, cache_salt=self._salt(salt, g, anchor)) == len(part)

    # ---- store ---------------------------------------------------------------------------------------
    def store(
        self,
        tokens: Sequence[int],
        groups: dict[int, list[int]],
        key: str,
        lora: str | None,
        salt: str | None,
        names: Sequence[int] | None,
    ) -> int:
        """Stores a finished request's full blocks (``tokens``: whole blocks); returns the stores
        started (each hands ``key`` back from finished_holds). A part that a tier fault kept from
        starting (e.g. TooManyTasks) holds nothing and is not counted; the parts started are."""
        n, bs, started = len(tokens) // self.bs, self.bs, 0
        if self.main_group is not None:
            tid = self.main.store(
                tokens, groups[self.main_group.index][:n], key=key, lora_name=lora, cache_salt=salt, names=names
            )
            started += tid is not None  # None: a tier fault, nothing held
        parts = [(tokens, groups[g.index][:n], self._salt(salt, g)) for g in self.chains]
        anchor = self.anchors(tokens, lora, salt)[n - 1] if self.windows and n else None
        windows = 0
        for g in self.windows if anchor is not None else ():
            w = self._window(n, g)
            ids = groups[g.index][w.start : n]
            if len(ids) < len(w) or not all(ids):  # a block of it was freed already: no window here
                continue
            parts.append((tokens[w.start * bs : n * bs], ids, self._salt(salt, g, anchor)))
            windows += 1
        for toks, ids, s in parts:
            if self.aux.store(toks, ids, key=key, lora_name=lora, cache_salt=s) is None:
                windows = -1  # a tier fault (logged by the contract): that prefix will not hit
                continue
            started += 1
        if anchor is not None:
            if windows == len(self.windows):
                self._remember(anchor)
            else:
                self.windows_skipped += 1
        return started

    def _remember(self, anchor: int) -> None:
        self._ends[anchor] = None
        self._ends.move_to_end(anchor)
        while len(self._ends) > MAX_ENDS:
            self._ends.popitem(last=False)

    # ---- load ----------------------------------------------------------------------------------------
    def load(
        self,
        tokens: Sequence[int],
        groups: dict[int, list[int]],
        local_blocks: int,
        lora: str | None,
        salt: str | None,
    ) -> list[tuple] | None:
        """Starts loading blocks [local_blocks, P) of every group, P = len(tokens) // block size:
        (offload, task) per load started; None when a group's part is not there whole (then
        nothing is loaded: the request is computed)."""
        p, bs = len(tokens) // self.bs, self.bs
        parts = []  # (offload, tokens, block ids, skip, salt)
        if self.main_group is not None:
            parts.append((self.main, tokens, groups[self.main_group.index][:p], local_blocks, salt))
        for g in self.chains:
            parts.append((self.aux, tokens, groups[g.index][:p], local_blocks, self._salt(salt, g)))
        anchor = self.anchors(tokens, lora, salt)[p - 1] if self.windows else 0
        for g in self.windows:
            w = self._window(p, g)
            skip = max(0, local_blocks - w.start)
            ids = groups[g.index][w.start : p]
            if skip >= len(ids):
                continue  # vLLM holds the whole window already
            if not all(ids[skip:]):
                log.warning("FlexKVConnector: group %d has no block for part of the window before block %d", g.index, p)
                return None
            parts.append((self.aux, tokens[w.start * bs : p * bs], ids, skip, self._salt(salt, g, anchor)))
        started: list[tuple] = []

        def cancel() -> None:
            for o, t in started:
                o.cancel_load(t, ())
                o.finish(t)

        for off, toks, ids, skip, s in parts:
            try:
                tid = off.load(toks, ids, skip, lora_name=lora, cache_salt=s)
            except BaseException:  # e.g. TooManyTasks: no part may go on writing blocks given up
                cancel()
                raise
            if tid is None or off.planned_tokens(tid) < (len(ids) - skip) * bs:  # evicted since the lookup
                if tid is not None:
                    started.append((off, tid))
                cancel()
                return None
            started.append((off, tid))
        return started
