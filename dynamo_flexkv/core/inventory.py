"""What is cached and clearing it: the typed answers of ``dynamo-flexkv cache`` (docs/SERVING.md,
"See and clear what is cached"), the same from an embedded engine's KVManager and from the node
cache's namespaces.

One request type (CacheRequest) and one answer type (CacheReport) cross every boundary: the
worker's HTTP route, the node cache's socket (protocol.Admin) and its HTTP port. They are msgspec
Structs, so a JSON body or a msgpack frame is checked field by field on the way in.

A clear removes what is free, never what a task uses: every block it takes is a ready, unlocked
leaf at that moment (the policy's own eviction path, under the cache engine's lock), so no load
reads a block that a clear took, and a tier stays prefix-closed. What stays is counted by why
(KeptReason). Removals carry RemovalReason.CLEARED: the removed_blocks metrics say so and the
router hears a BlockRemoved for each block."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from dynamo_flexkv.core.errors import FlexKVError

# The tiers a request may name, fastest first. "device" is an engine's own KV memory (its prefix
# cache): only a worker answers for it; "remote" is listed and probed, never cleared (below).
TIERS = ("device", "host", "disk", "remote")
OPS = ("contents", "prefix", "clear")
# The HTTP route of every target: a worker's system port (Dynamo's engine control "flexkv_cache")
# and a cache server's --metrics-port. POST a CacheRequest as JSON; GET is op contents.
CONTROL = "flexkv_cache"
HTTP_ROUTE = f"/engine/control/{CONTROL}"
DEFAULT_WAIT_S = 5.0  # a clear first waits this long for the tier writes in flight (then clears what is free)
MAX_WAIT_S = 600.0  # the longest wait a clear may ask for
REMOTE_NOT_CLEARED = (
    "the remote tier is not cleared: its blocks are shared with every worker and node that uses the same "
    "store; delete them in Redis, or give the weights a new model_id"
)

NO_TOKENIZER = (
    "the cache server has no tokenizer: send token ids (dynamo-flexkv cache prefix --tokens ...), or tokenize "
    "the text on your side (--text with --tokenizer MODEL_DIR)"
)


class BadCacheRequest(ValueError, FlexKVError):
    """A cache request that names an unknown op or tier, or lacks what its op needs."""


class KeptReason(str, enum.Enum):
    """Why a clear left a block in its tier."""

    IN_USE = "in_use"  # a load or a tier write reads it now
    FILLING = "filling"  # its bytes are still landing (a store or a disk read in flight)
    PARENT = "parent"  # a prefix of a kept block: a tier stays prefix-closed


class TierContents(msgspec.Struct, frozen=True):
    """One tier of one namespace, now."""

    tier: str
    blocks: int  # held: ready and filling
    ready: int  # landed: what a load can find
    filling: int  # a copy into it is in flight
    in_use: int  # ready and read by a load or a tier write now (a clear keeps them)
    block_bytes: int
    capacity_blocks: int
    oldest_s: float | None = None  # seconds since the least recently used ready block was used
    newest_s: float | None = None  # seconds since the most recently used one was

    @property
    def bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes


class Contents(msgspec.Struct, frozen=True):
    """The tiers of one namespace: an embedded engine's, or one model of one tenant on a node."""

    model_id: str
    tenant: str
    tiers: list[TierContents]
    remote: str | None = None  # the remote tier's URL (no password): shared, so not counted here
    engines: int | None = None  # node: engines attached to this namespace now
    shard: str = ""  # node: the tensor-parallel shard ("rank/ranks"), "" for one rank

    def tier(self, name: str) -> TierContents | None:
        return next((t for t in self.tiers if t.tier == name), None)


class PrefixBlocks(msgspec.Struct, frozen=True):
    """Which of a prompt's full blocks each tier holds (ready). Each tier is prefix-closed, so it
    holds a leading run of the prompt's blocks: ``held[tier]`` of them."""

    model_id: str
    tenant: str
    tokens: int  # the prompt's length
    tokens_per_block: int
    hashes: list[int]  # each full block's sequence hash (the key every tier uses for it)
    held: dict[str, int]  # tier -> leading blocks held, ready
    note: str | None = None  # e.g. the remote tier could not be asked
    shard: str = ""

    def tiers_of(self, block: int) -> list[str]:
        return [t for t in TIERS if self.held.get(t, 0) > block]

    def runs(self) -> list[tuple[int, int, list[str]]]:
        """[start, end) block ranges whose blocks the same tiers hold, in order."""
        out: list[tuple[int, int, list[str]]] = []
        for i in range(len(self.hashes)):
            where = self.tiers_of(i)
            if out and out[-1][2] == where:
                out[-1] = (out[-1][0], i + 1, where)
            else:
                out.append((i, i + 1, where))
        return out


class TierCleared(msgspec.Struct, frozen=True):
    tier: str
    cleared: int
    kept: dict[str, int] = {}  # KeptReason value -> blocks left in the tier


class Cleared(msgspec.Struct, frozen=True):
    """What one clear did to one namespace's tiers."""

    model_id: str
    tenant: str
    tiers: list[TierCleared]
    note: str | None = None
    shard: str = ""


class CacheRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``op``: contents (every tier's counts), prefix (which tiers hold which of ``tokens``'
    blocks; ``text`` where the answering side has the model's tokenizer) or clear (``tiers``, all
    by default). ``tenant`` and ``model`` select the namespaces on a node cache (default all)."""

    op: str = "contents"
    tiers: list[str] | None = None
    tenant: str | None = None
    model: str | None = None
    tokens: list[int] | None = None
    text: str | None = None
    lora: str | None = None
    salt: str | None = None
    wait_s: float = DEFAULT_WAIT_S

    def check(self, have: Sequence[str]) -> CacheRequest:
        """Raises BadCacheRequest naming the fix; ``have``: the tiers the answering side holds."""
        if self.op not in OPS:
            raise BadCacheRequest(f"op {self.op!r} is not one of {', '.join(OPS)}")
        for t in self.tiers or ():
            if t not in TIERS:
                raise BadCacheRequest(f"tier {t!r} is not a tier: name one of {', '.join(TIERS)}")
            if t not in have:
                raise BadCacheRequest(f"tier {t!r}: this target has no {t} tier (its tiers: {', '.join(have)})")
        if self.op == "prefix" and self.tokens is None and self.text is None:
            raise BadCacheRequest("op prefix needs the prompt: tokens (a list of token ids) or text")
        if self.tokens is not None and any(not 0 <= t < 1 << 32 for t in self.tokens):
            raise BadCacheRequest("tokens must be token ids in [0, 2**32)")
        if not 0 <= self.wait_s <= MAX_WAIT_S:
            raise BadCacheRequest(f"wait_s={self.wait_s}: wait 0 to {MAX_WAIT_S:g} seconds for the writes in flight")
        return self

    def wants(self, tier: str) -> bool:
        return self.tiers is None or tier in self.tiers


class CacheReport(msgspec.Struct):
    """The answer to one CacheRequest, from one target (a worker or a node cache)."""

    target: str  # what answered: "worker (embedded)", "worker (node)", "cache server pid 123"
    op: str
    contents: list[Contents] = []
    prefixes: list[PrefixBlocks] = []
    cleared: list[Cleared] = []


class Inventoried(Protocol):
    """What answers for one namespace's tiers (KVManager)."""

    namespace: str | None
    model_id: str

    def contents(self) -> Contents: ...

    def prefix_blocks(
        self, token_ids: Any, *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> PrefixBlocks: ...

    def clear(self, tiers: Sequence[str] | None = None, wait_s: float = 0.0) -> Cleared: ...


def answer(
    kv: Inventoried,
    req: CacheRequest,
    report: CacheReport,
    *,
    tenant: str | None = None,
    shard: str = "",
    engines: int | None = None,
) -> None:
    """Adds one namespace's answer to ``req`` (checked already) to ``report``: the tiers the request
    names (all by default) of ``kv``; "device" is the caller's (an engine's own memory). A request
    that selects another tenant or model than this namespace's is refused, naming what it holds."""
    own_tenant, own_model = _or(tenant, kv.namespace or ""), kv.model_id
    if (req.tenant is not None and req.tenant != own_tenant) or (req.model is not None and req.model != own_model):
        raise BadCacheRequest(
            f"this target holds no namespace of {describe_selection(req.tenant, req.model)}; it holds "
            f"model {own_model!r} tenant {own_tenant!r}"
        )
    if req.op == "contents":
        c = kv.contents()
        tiers = [t for t in c.tiers if req.wants(t.tier)]
        report.contents.append(
            msgspec.structs.replace(c, tiers=tiers, shard=shard, engines=engines, tenant=_or(tenant, c.tenant))
        )
    elif req.op == "prefix":
        p = kv.prefix_blocks(req.tokens or [], lora_name=req.lora, cache_salt=req.salt)
        held = {t: n for t, n in p.held.items() if req.wants(t)}
        report.prefixes.append(msgspec.structs.replace(p, held=held, shard=shard, tenant=_or(tenant, p.tenant)))
    else:
        names = None if req.tiers is None else [t for t in req.tiers if t != "device"]
        if names == []:
            return  # the device tier alone: the engine's, not these tiers'
        done = kv.clear(names, wait_s=req.wait_s)
        report.cleared.append(msgspec.structs.replace(done, shard=shard, tenant=_or(tenant, done.tenant)))


def describe_selection(tenant: str | None, model: str | None) -> str:
    parts = [f"tenant {tenant!r}" if tenant is not None else "", f"model {model!r}" if model is not None else ""]
    return " and ".join(p for p in parts if p)


def _or(value: str | None, default: str) -> str:
    return default if value is None else value


def parse_request(body: Any) -> CacheRequest:
    """A CacheRequest from a JSON object (an HTTP body); BadCacheRequest names what is wrong."""
    try:
        return msgspec.convert(body if body else {}, CacheRequest)
    except msgspec.ValidationError as e:
        raise BadCacheRequest(f"not a cache request: {e}") from None


def to_builtins(report: CacheReport) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(report)
    return out


def parse_report(data: Any) -> CacheReport:
    return msgspec.convert(data, CacheReport)


def tokenize(model_dir: str, text: str) -> list[int]:
    """``text`` as the model's tokenizer (MODEL_DIR/tokenizer.json) encodes a completion's prompt."""
    import os

    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise BadCacheRequest(f"no tokenizer.json in {model_dir}: name the model directory the workers serve")
    ids: list[int] = Tokenizer.from_file(path).encode(text, add_special_tokens=True).ids
    return ids
