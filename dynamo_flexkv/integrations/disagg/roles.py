"""The two sides of a handover, driven from the engine thread (the engine is not thread-safe).

Prefill: when a request's prompt is computed, ``hand_over`` re-references the prompt's cached
device blocks (the ones just computed, or loaded from its own host/disk tiers), puts them under a
lease and describes them for ``disaggregated_params``. ``service`` (every engine-loop turn) ends
leases on the decode worker's release notice or on timeout.

Decode: ``expect`` files a request's handover; the engine calls ``fill`` when it allocates the
request, after matching its own device prefix cache and planning loads from its host/disk tiers:
only the blocks still missing are pulled. Whatever happens, the lease is released right after; a
failed pull returns 0 and the engine recomputes those blocks (exact tokens)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from dynamo_flexkv.integrations.disagg.leases import LeaseTable
from dynamo_flexkv.integrations.disagg.nixl_kv import HandoverCorrupt, HandoverFailed, KVAgent
from dynamo_flexkv.integrations.disagg.params import HandoverParams, HandoverRefused
from dynamo_flexkv.integrations.reference_engine.llm import LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import Request
from dynamo_flexkv.core.hashing import block_hashes

log = logging.getLogger(__name__)
RELEASE = b"flexkv-release:"
# A pull must end this long before the prefill worker's lease does (its blocks may be reused right
# after): covers clock skew between the two hosts and the release of an aborted read.
LEASE_MARGIN_S = 1.0


class PrefillSide:
    def __init__(self, engine: LLMEngine, agent: KVAgent, lease_ttl: float, secret: Optional[bytes] = None) -> None:
        self.engine, self.agent, self.secret = engine, agent, secret
        self.leases = LeaseTable(lease_ttl)

    def hand_over(self, prompt: List[int]) -> Dict[str, object]:
        """Right after the prompt's request finished, before the engine allocates again (so its
        released blocks are still cached). ``{}``: nothing to hand over (decode computes all)."""
        bs = self.engine.cfg.block_size
        cap = (len(prompt) - 1) // bs  # the decode worker computes the last token itself
        hashes = block_hashes(prompt, bs).sequence[:cap]
        blocks = self.engine.pool.match(hashes)  # referenced now: the lease owns these references
        if not blocks:
            return {}
        lease = self.leases.grant(blocks)
        p = self.agent.describe(lease.id, blocks, int(hashes[len(blocks) - 1]), lease.expires_unix)
        return p.signed(self.secret).to_dict()

    def service(self) -> None:
        for msg in self.agent.notifications():
            if msg.startswith(RELEASE):
                lease = self.leases.release(msg[len(RELEASE):].decode(errors="replace"))
                if lease is not None:
                    self.engine.pool.release(lease.blocks)
        for lease in self.leases.expire():
            log.warning("handover lease %s expired after %.0f s without a release from its decode worker; "
                        "its %d blocks are released", lease.id, self.leases.ttl, len(lease.blocks))
            self.engine.pool.release(lease.blocks)

    def close(self) -> None:
        for lease in self.leases.drain():
            self.engine.pool.release(lease.blocks)


@dataclass
class DecodeStats:
    """Engine thread writes, a metrics scrape reads (plain counters)."""

    handovers: int = 0  # requests that came with a handover and were allocated
    ok: int = 0  # handovers whose blocks were pulled
    local: int = 0  # handovers with nothing to pull: the decode worker's own tiers had every block
    failed: int = 0  # handovers refused, failed or corrupt: recomputed
    pulled_blocks: int = 0
    local_blocks: int = 0  # prompt blocks the decode worker's own tiers already had
    bytes: int = 0  # KV bytes pulled
    seconds: float = 0.0  # spent in reads (wall time on the engine thread)
    verify_seconds: float = 0.0  # spent hashing what was read (the checksum check)
    corrupt: int = 0  # the part of ``failed`` whose blocks failed their checksum


class DecodeSide:
    def __init__(self, engine: LLMEngine, agent: KVAgent, pull_timeout: float,
                 secret: Optional[bytes] = None) -> None:
        self.engine, self.agent, self.pull_timeout = engine, agent, pull_timeout
        self.secret = secret  # the graph's: handovers not signed with it are recomputed
        self._pending: Dict[str, HandoverParams] = {}
        self.pulled: Dict[str, int] = {}  # request id -> prompt tokens pulled, until the request ends
        self.stats = DecodeStats()

    def expect(self, request_id: str, params: Optional[HandoverParams]) -> None:
        if params is not None and self._trusted(request_id, params):
            self._pending[request_id] = params

    def _trusted(self, request_id: str, params: HandoverParams) -> bool:
        """A handover not signed with this graph's secret is recomputed, and no release is sent
        for it: its agent and lease may name another request's live lease."""
        try:
            params.verify(self.secret)
            return True
        except HandoverRefused as e:
            self.stats.failed += 1
            log.warning("request %s: recomputing its prompt: %s", request_id, e)
            return False

    def forget(self, request_id: str) -> None:
        """The request ended before it was allocated (aborted): release its lease now."""
        self.pulled.pop(request_id, None)
        p = self._pending.pop(request_id, None)
        if p is not None:
            self._release(p)

    def refuse(self, params: HandoverParams) -> None:
        """A request this worker refused before its engine saw it: release the lease unused."""
        if self._trusted("(refused)", params):
            self._release(params)

    def fill(self, req: Request, first: int, cap: int) -> int:
        p = self._pending.pop(req.id, None)
        if p is None:
            return 0
        self.stats.handovers += 1
        self.pulled[req.id] = 0
        self.stats.local_blocks += min(first, cap)
        released = False  # a read that completes delivers the release notice itself
        try:
            n = min(len(p.blocks), cap)
            if n <= first:
                self.stats.local += 1
                return 0
            self.agent.check_compatible(p)
            budget = min(self.pull_timeout, p.lease_expires_unix - time.time() - LEASE_MARGIN_S)
            if budget <= 0:
                raise HandoverRefused(f"lease {p.lease} ends before a read could finish (expired or about to)")
            if p.last_hash != int(req.hashes.sequence[n - 1]):
                raise HandoverRefused("the handed-over blocks are not this prompt's (sequence hash differs)")
            t0 = time.perf_counter()
            try:
                nbytes = self.agent.pull(p, p.blocks[first:n], req.block_table[first:n], budget,
                                         notif=RELEASE + p.lease.encode())
            finally:
                self.stats.seconds += time.perf_counter() - t0
            released = True
            t0 = time.perf_counter()
            try:  # before anything computes on them: a corrupt block is recomputed, not used
                self.agent.verify(p, first, req.block_table[first:n])
            finally:
                self.stats.verify_seconds += time.perf_counter() - t0
            self.stats.ok += 1
            self.stats.bytes += nbytes
            self.stats.pulled_blocks += n - first
            self.pulled[req.id] = (n - first) * req.hashes.block_size
            return n - first
        except (HandoverFailed, HandoverRefused) as e:
            self.stats.failed += 1
            self.stats.corrupt += isinstance(e, HandoverCorrupt)
            log.warning("request %s: KV handover from %s failed, recomputing its prompt: %s", req.id, p.agent, e)
            return 0
        finally:
            if not released:
                self._release(p)

    def _release(self, p: HandoverParams) -> None:
        if not self.agent.notify(p, RELEASE + p.lease.encode()):
            log.info("lease %s: prefill agent %s unreachable; its lease ends by timeout", p.lease, p.agent)
