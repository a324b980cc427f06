"""The two sides of a handover, driven from the engine thread (the engine is not thread-safe).

Prefill: when a request's prompt is computed, ``hand_over`` re-references the prompt's cached
device blocks (the ones just computed, or loaded from its own host/disk tiers), puts them under a
lease and describes them for ``disaggregated_params``. ``service`` (every engine-loop turn)
renews leases on the decode worker's claims and renewals and ends them on its release notice or on
timeout (leases.py).

Decode: ``expect`` files a request's handover and claims its lease; ``service`` renews the leases
of requests still waiting; the engine calls ``fill`` when it allocates the request, after matching
its own device prefix cache and planning loads from its host/disk tiers: only the blocks still
missing are pulled, then verified against the prefill worker's checksums. Whatever happens, the
lease is released right after; a failed or corrupt pull returns 0 and the engine recomputes those
blocks (exact tokens)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dynamo_flexkv.core.hashing import block_hashes
from dynamo_flexkv.core.logutil import RateLimitedLog
from dynamo_flexkv.core.transfer.nixl_agent import HandoverCorrupt, HandoverFailed, KVAgent
from dynamo_flexkv.integrations.disagg.leases import DEFAULT_RENEW_S, LeaseTable
from dynamo_flexkv.integrations.disagg.params import HandoverParams, HandoverRefused
from dynamo_flexkv.integrations.reference_engine.llm import LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import Request

log = logging.getLogger(__name__)
RELEASE = b"flexkv-release:"
RENEW = b"flexkv-renew:"  # a decode worker claims (first) or renews a lease for a request it holds
# A pull must end this long before the prefill worker's lease does (its blocks may be reused right
# after): covers clock skew between the two hosts and the release of an aborted read.
LEASE_MARGIN_S = 1.0


class PrefillSide:
    def __init__(
        self,
        engine: LLMEngine,
        agent: KVAgent,
        lease_ttl: float,
        secret: bytes | None = None,
        renew_s: float = DEFAULT_RENEW_S,
    ) -> None:
        self.engine, self.agent, self.secret = engine, agent, secret
        self.leases = LeaseTable(lease_ttl, renew_s=renew_s)
        self._expired_log = RateLimitedLog(log, 5.0)  # a decode outage expires one lease per request

    def hand_over(self, prompt: list[int]) -> dict[str, object]:
        """Right after the prompt's request finished, before the engine allocates again (so its
        released blocks are still cached). ``{}``: nothing to hand over (decode computes all)."""
        bs = self.engine.cfg.block_size
        cap = (len(prompt) - 1) // bs  # the decode worker computes the last token itself
        hashes = block_hashes(prompt, bs).sequence[:cap]
        blocks = self.engine.pool.match(hashes)  # referenced now: the lease owns these references
        if not blocks:
            return {}
        lease = self.leases.grant(blocks)
        p = HandoverParams.of_agent(
            self.agent,
            lease.id,
            blocks,
            int(hashes[len(blocks) - 1]),
            lease.expires_unix,
            renew_by_unix=lease.renew_by_unix,
            renew_s=self.leases.renew_s,
        )
        return p.signed(self.secret).to_dict()

    def service(self) -> None:
        # Notices first, expiry after: a renewal that arrived in time is never lost to a busy step.
        for msg in self.agent.notifications():
            if msg.startswith(RELEASE):
                lease = self.leases.release(msg[len(RELEASE) :].decode(errors="replace"))
                if lease is not None:
                    self.engine.pool.release(lease.blocks)
            elif msg.startswith(RENEW):
                self.leases.renew(msg[len(RENEW) :].decode(errors="replace"))
        for lease in self.leases.expire():
            if lease.renewals:
                self._expired_log.warning(
                    "handover lease %s expired: its decode worker renewed it %d times, then neither renewed "
                    "nor released it (it died or hangs); its %d blocks are released",
                    lease.id,
                    lease.renewals,
                    len(lease.blocks),
                )
            else:
                self._expired_log.warning(
                    "handover lease %s expired unclaimed after %.1f s: no decode worker took its request (none "
                    "running, the frontend's decode call failed, or the client left); its %d blocks are released",
                    lease.id,
                    self.leases.renew_s,
                    len(lease.blocks),
                )
            self.engine.pool.release(lease.blocks)

    def close(self) -> None:
        self._expired_log.flush("handover leases expired")
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
    renewals: int = 0  # lease claims and renewals sent
    corrupt: int = 0  # the part of ``failed`` whose blocks failed their checksum


def _renew_every(renew_s: float) -> float:
    """Seconds between renewals of a waiting request's lease: each one must leave with
    LEASE_MARGIN_S to spare before the window the previous one bought ends, and a lost or late
    one leaves room for the next."""
    return max(0.05, min(renew_s / 3, (renew_s - LEASE_MARGIN_S) / 2))


@dataclass
class _Pending:
    """A handover filed for a request not yet allocated here."""

    params: HandoverParams
    held_until: float  # wall clock: until when the prefill worker surely holds the lease
    renewed_at: float = 0.0  # wall clock of the last claim or renewal sent
    renewable: bool = True  # False once a renewal could not be sent in time (or at all)


class DecodeSide:
    def __init__(self, engine: LLMEngine, agent: KVAgent, pull_timeout: float, secret: bytes | None = None) -> None:
        self.engine, self.agent, self.pull_timeout = engine, agent, pull_timeout
        self.secret = secret  # the graph's: handovers not signed with it are recomputed
        self._pending: dict[str, _Pending] = {}
        self.pulled: dict[str, int] = {}  # request id -> prompt tokens pulled, until the request ends
        self.stats = DecodeStats()

    @property
    def pending_handovers(self) -> int:
        """Handovers filed for requests not allocated here yet (their leases renewed while they wait)."""
        return len(self._pending)

    def expect(self, request_id: str, params: HandoverParams | None) -> None:
        """Files the request's handover and claims its lease at once: an unclaimed lease ends
        ``renew_s`` after the prefill worker granted it."""
        if params is not None and self._trusted(request_id, params):
            pending = self._pending[request_id] = _Pending(params, min(params.renew_by_unix, params.lease_expires_unix))
            self._renew(pending)

    def service(self) -> None:
        """Every engine-loop turn: renews the leases of requests still waiting here every
        ``_renew_every(renew_s)`` seconds, so a wait in the queue does not lose them."""
        now = time.time()
        for pending in self._pending.values():
            if pending.renewable and now >= pending.renewed_at + _renew_every(pending.params.renew_s):
                self._renew(pending)

    def _renew(self, pending: _Pending) -> bool:
        """Claims or renews the lease; True when it now surely holds ``renew_s`` more seconds.
        Sent too close to its end (it may be gone by the time the notice lands), it is not sent and
        the pull will be refused: the prompt is recomputed."""
        p, now = pending.params, time.time()
        if p.renew_s <= 0 or now > pending.held_until - LEASE_MARGIN_S:
            pending.renewable = False
            return False
        if not self.agent.notify(p, RENEW + p.lease.encode()):
            pending.renewable = False  # prefill agent unreachable: the pull would fail as well
            return False
        pending.renewed_at = now
        pending.held_until = min(p.lease_expires_unix, now + p.renew_s)
        self.stats.renewals += 1
        return True

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
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._release(pending.params)

    def refuse(self, params: HandoverParams) -> None:
        """A request this worker refused before its engine saw it: release the lease unused."""
        if self._trusted("(refused)", params):
            self._release(params)

    def fill(self, req: Request, first: int, cap: int) -> int:
        pending = self._pending.pop(req.id, None)
        if pending is None:
            return 0
        p = pending.params
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
            if pending.renewable and time.time() >= pending.renewed_at + _renew_every(p.renew_s):
                self._renew(pending)  # a fresh window for the read
            budget = min(self.pull_timeout, pending.held_until - time.time() - LEASE_MARGIN_S)
            if budget <= 0:
                raise HandoverRefused(
                    f"lease {p.lease} ends before a read could finish (not claimed in time, expired or about to)"
                )
            if p.last_hash != int(req.hashes.sequence[n - 1]):
                raise HandoverRefused("the handed-over blocks are not this prompt's (sequence hash differs)")
            t0 = time.perf_counter()
            try:
                nbytes = self.agent.pull(
                    p, p.blocks[first:n], req.block_table[first:n], budget, notif=RELEASE + p.lease.encode()
                )
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
