"""The engine contract of dynamo_flexkv (docs/ENGINE_CONTRACT.md): ``EngineOffload``, the one
class an engine's KV connector reaches the offload tiers through, ``Hold``, and the types of its
events (``Tier``, ``TierRun``, ``IndexListener``; the control plane, core/index/, uses the same). Its
implementations: ``EmbeddedOffload`` (core/offload.py, the engine process owns its tiers) and
``NodeOffload`` (core/node/client.py, the node's cache service owns them); ``open_offload``
(core/offload.py) picks one. What each call means, in a request's order: core/offload.py."""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.inventory import CacheReport, CacheRequest
from dynamo_flexkv.core.layout import KVLayoutType
from dynamo_flexkv.core.stats import ManagerStats
from dynamo_flexkv.core.tasks import TaskResult

if TYPE_CHECKING:  # NIXL behind it: imported only where an engine opens a link
    from dynamo_flexkv.core.peer.link import PeerLink

log = logging.getLogger(__name__)

# What a tier may raise when a per-request call starts: the node service gone or refusing
# (NodeUnavailable), too many tasks, a remote or disk error. Every error this package defines, and
# I/O errors: the engine serves on, recomputing (a caller's TypeError or KeyError still raises).
TIER_FAULTS: tuple[type[BaseException], ...] = (FlexKVError, OSError)
FAULT_LOG_EVERY_S = 10.0  # a tier that stays down logs its faults at most this often

F = TypeVar("F", bound=Callable[..., Any])


def miss_on_tier_fault(miss: Callable[..., Any]) -> Callable[[F], F]:
    """Wraps a per-request call of an implementation: a tier fault becomes ``miss(self, *args, **kw)``
    (no task, nothing held), counted in ``tier_faults`` and logged (at most every
    FAULT_LOG_EVERY_S per offload). This is how the contract keeps its promise that a tier fault
    never reaches the engine as an exception, the same for every implementation."""

    def wrap(call: F) -> F:
        @functools.wraps(call)
        def guarded(self: EngineOffload, *args: Any, **kwargs: Any) -> Any:
            try:
                return call(self, *args, **kwargs)
            except TIER_FAULTS as e:
                self.tier_faults += 1
                now = time.monotonic()
                if now - self._fault_logged_at >= FAULT_LOG_EVERY_S:
                    self._fault_logged_at = now
                    log.warning(
                        "offload %s failed (%s: %s): a miss, the engine recomputes (%d tier faults so far)",
                        call.__name__,
                        type(e).__name__,
                        e,
                        self.tier_faults,
                    )
                return miss(self, *args, **kwargs)

        return cast(F, guarded)

    return wrap


def _no_task(self: EngineOffload, *args: Any, **kwargs: Any) -> None:
    return None


def _held_tokens(self: EngineOffload, tokens: Sequence[int], *args: Any, skip_blocks: int = 0, **kw: Any) -> int:
    return skip_blocks * self.bs  # nothing beyond what the engine holds


def _held_unexplained(self: EngineOffload, *args: Any, **kw: Any) -> tuple[int, None]:
    return _held_tokens(self, *args, **kw), None


# load / store / prefetch: no task (nothing held, the engine computes); cached_tokens: a miss.
no_task_on_tier_fault = miss_on_tier_fault(_no_task)
miss_lookup_on_tier_fault = miss_on_tier_fault(_held_tokens)
miss_explained_on_tier_fault = miss_on_tier_fault(_held_unexplained)


class Tier(str, Enum):
    """The offload tiers the cache engine (core/index/) indexes, fastest first. The remote tier is not one of
    them: ``plan_get(remote=(lo, hi))`` takes the prefix the remote store reported and plans it
    into new host blocks."""

    HOST = "host"
    DISK = "disk"


@dataclass
class TierRun:
    """Blocks ``[start, start + len(hashes))`` of one request in one tier."""

    tier: Tier
    start: int
    hashes: list[int]
    block_ids: list[int]
    parent: int | None  # sequence hash before hashes[0]; None at the root
    new: bool  # True: unready blocks this task fills; False: locked blocks this task reads
    hit: bool = True  # a completed read counts as reuse (get), not as a copy source (put)
    done: bool = False
    token_ids: list[int] | None = None  # the blocks' tokens, for router events (set by KVManager)

    @property
    def end(self) -> int:
        return self.start + len(self.hashes)

    def __len__(self) -> int:
        return len(self.hashes)


class IndexListener(Protocol):
    """What an engine passes as ``listener``: every commit and removal of the offload tiers, in
    commit order (its KV events for the router)."""

    def on_stored(self, tier: Tier, run: TierRun) -> None: ...
    def on_removed(self, tier: Tier, hashes: list[int]) -> None: ...


@dataclass(frozen=True)
class Hold:
    """Device blocks an offload copy no longer touches: the engine may release or reuse them."""

    key: Any  # what the engine passed to store() / cancel_load(), e.g. its request id
    blocks: list[int]


class EngineOffload(ABC):
    """What an engine may call. ``bs``: tokens per block; ``num_layers``: the model's layers."""

    layerwise: bool
    bs: int
    num_layers: int
    failed_loads: int
    tier_faults: int = 0  # per-request calls a tier fault turned into a miss (miss_on_tier_fault)
    _fault_logged_at: float = float("-inf")

    # ---- setup ------------------------------------------------------------------------------------
    @abstractmethod
    def register(self, layers: Any, layout: KVLayoutType = KVLayoutType.LAYERBLOCK) -> None:
        """The engine's KV tensors (validated: dtype, shape and contiguity, naming what differs)."""

    # ---- per request -------------------------------------------------------------------------------
    @abstractmethod
    def cached_tokens(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> int:
        """End of the cached prefix of ``tokens`` a load would bring back (whole blocks): what the
        tiers hold, as far as the load policy loads it (``tokens``: a prompt's full blocks;
        ``prompt_tokens``: the whole prompt's length, default one more than ``tokens``;
        ``skip_blocks``: blocks the engine holds already, the decision is about the rest). May be
        called from another thread than the engine's."""

    def explain_lookup(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> tuple[int, dict[str, Any] | None]:
        """cached_tokens' answer and the load policy's decision behind it (LoadDecision.explain:
        what each tier holds, how far it loads and why, its predictions), or None where this
        offload cannot say. Counts as one lookup: call it instead of cached_tokens, not beside it."""
        return (
            self.cached_tokens(
                tokens, lora_name=lora_name, cache_salt=cache_salt, prompt_tokens=prompt_tokens, skip_blocks=skip_blocks
            ),
            None,
        )

    @abstractmethod
    def block_hashes(
        self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """The sequence hash of each full block of ``tokens``: how the tiers (and their events) name
        the blocks, in this engine's namespace."""

    @abstractmethod
    def load(
        self,
        tokens: Sequence[int],
        block_table: Sequence[int],
        skip_blocks: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_tokens: int | None = None,
    ) -> int | None:
        """Starts loading blocks [skip_blocks, ...) of ``tokens`` (full blocks only). Returns the
        task, or None when nothing beyond skip_blocks is cached or worth loading, or a tier fault
        kept the load from starting (never raises for one: the engine computes). With
        ``prompt_tokens`` (the whole prompt's length) the load policy decides how far to load;
        without, everything cached is (an engine that asked cached_tokens first)."""

    @abstractmethod
    def planned_tokens(self, tid: int) -> int:
        """Tokens the load brings if it succeeds (beyond skip_blocks), known when it starts."""

    @abstractmethod
    def planned_tokens_by_tier(self, tid: int) -> dict[str, int]:
        """planned_tokens by the tier each block is read from."""

    @abstractmethod
    def wait_layer(self, tid: int, layer: int, timeout: float | None = None) -> bool:
        """Waits for layer ``layer`` of a load; False after ``timeout`` seconds. Raises TaskFailed
        when the load failed (the step recomputes what it would have loaded)."""

    @abstractmethod
    def cancel_load(self, tid: int, blocks: Sequence[int], key: Any = None) -> None:
        """Cancels a load; ``blocks`` come back from finished_holds() once no copy writes them (none
        given: the engine keeps them and collects the load with finish())."""

    @abstractmethod
    def finish(self, tid: int) -> TaskResult:
        """The load's result; after it no copy of this task touches the device blocks."""

    @abstractmethod
    def load_done(self, tid: int) -> bool:
        """Whether finish() would return at once: for an engine that loads ahead of the step that
        needs the blocks and polls."""

    @abstractmethod
    def observe_prefill(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` prompt tokens of prompts up to ``prompt_tokens`` long in
        ``seconds`` (time blocked on loads excluded): the cost-aware load policy's measure of
        recompute."""

    @abstractmethod
    def store(
        self,
        tokens: Sequence[int],
        block_table: Sequence[int],
        key: Any = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        names: Sequence[int] | None = None,
    ) -> int | None:
        """Stores the full blocks of ``tokens`` from ``block_table``; the blocks are held until
        finished_holds() returns them with ``key``. None: a tier fault kept the store from starting,
        nothing is held (the blocks are the engine's at once). ``names``: the engine's own name of each block
        (vLLM's block hashes), for the KV events of engines that share the tiers."""

    @abstractmethod
    def prefetch(self, tokens: Sequence[int]) -> int | None:
        """Warms host memory from disk for a request that waits; collected by finished_holds().
        None: not started (a tier fault)."""

    @abstractmethod
    def cancel_prefetch(self, tid: int) -> None: ...

    @property
    @abstractmethod
    def tasks_pending(self) -> int:
        """Tasks whose results the connector still has to collect."""

    @abstractmethod
    def finished_holds(self) -> list[Hold]:
        """Holds of stores whose device copy is done and of cancelled loads that drained
        (non-blocking). Also collects finished prefetches, whose results nobody waits for."""

    @abstractmethod
    def drain_holds(self) -> list[Hold]:
        """Every hold, once its copies are done (blocking: at shutdown)."""

    # ---- administration -------------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> ManagerStats | None:
        """The tiers' snapshot (None where it cannot be read now)."""

    @abstractmethod
    def drain(self, timeout: float | None = None) -> bool:
        """Waits for background tier writes; False if some still run after ``timeout``."""

    @abstractmethod
    def evict_host(self, timeout: float | None = None) -> int:
        """Evicts every host block once the writes below finished (disk and remote keep theirs)."""

    @abstractmethod
    def reset_tiers(self, timeout: float | None = None) -> bool:
        """Drops every host and disk block once the writes finished; False when a remote tier
        (shared with other workers) keeps its copies."""

    @abstractmethod
    def weights_changed(self, version: str) -> int:
        """The engine's weights changed (a reload, an RL update, another adapter under the same
        name), now named ``version``: no block computed before is ever returned again, on any tier;
        the ones this engine announced leave the router's view at once. Returns the blocks dropped."""

    @abstractmethod
    def cache_admin(self, req: CacheRequest) -> CacheReport:
        """An operator's request over these tiers (dynamo-flexkv cache, core/inventory.py): their
        contents, which of them hold a prompt's blocks, or a clear of what no task uses. Node: the
        service answers for this engine's namespace (shared with the engines of the same model)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Where the tiers are and how large (for logs and operators)."""

    @abstractmethod
    def tier_files(self) -> list[str]:
        """The disk tier's data files this process owns (none in node mode: the service's)."""

    @abstractmethod
    def announce_adopted(self, repeat: bool = False) -> int:
        """The listener's events can reach the router now: call once, when the event subscriber is
        connected. Embedded: announces the disk blocks re-adopted at a restart. Node: the service
        sends the node's blocks, then every change (before it, the listener hears nothing).
        ``repeat``: the same again for a subscriber that may have dropped the first (embedded: the
        re-adopted blocks still held; node: nothing, each attach sends the node's blocks)."""

    def open_peer_link(self, secret: bytes | None, host: str, port: int, lease_s: float) -> PeerLink:
        """Router hints (core/peer/, docs/HINTS.md): serves this engine's host tier to peers that
        prove membership with ``secret`` on ``host:port`` (0: any free port; pins held at most
        ``lease_s``) and pulls their blocks into it. Close the link before ``shutdown``. Embedded
        tiers only: the node cache's host tier belongs to the service."""
        raise FlexKVError(
            f"peer pulls need embedded tiers: this engine's tiers are {type(self).__name__}'s "
            "(set mode: embedded, or turn router hints off)"
        )

    @abstractmethod
    def shutdown(self) -> None:
        """Waits for background writes (embedded: up to the caller's drain), then releases memory,
        files and the connection; later calls raise or do nothing."""
