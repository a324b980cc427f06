"""The receiver half of a peer pull: given a source's control endpoint and a request's tokens,
pulls the blocks this worker lacks into its own host tier over NIXL, verifies each block's xxh3
against the checksum the source's host tier holds for it, and only then makes it visible (a
Stored event, like any host block); the normal load path then serves it layer by layer.

Every failure is a miss, never an error: the source unreachable or gone mid-read, a refusal
(busy, not held, namespace, ...), a read that outruns the pin's lease, a checksum mismatch. The
blocks staged for it are rolled back and the engine recomputes them."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.peer.protocol import (
    HEADER_BYTES,
    VERSION,
    PeerRefused,
    Pinned,
    ProtocolError,
    Pull,
    Refused,
    Release,
    decode_to_receiver,
    encode,
    mac_of,
    pack_u64,
    peer_frame_length,
    unpack_u64,
)
from dynamo_flexkv.core.peer.source import _recv_exact, kv_layout
from dynamo_flexkv.core.transfer.nixl_agent import HandoverFailed, KVAgent
from dynamo_flexkv.core.transfer.nixl_errors import ReadNotCancelled

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 0.2  # a read must end this long before the source's pin does
# Reads NIXL could not cancel keep their staged blocks for good; once they hold 1/QUARANTINE_SHARE of
# the host tier, this receiver pulls no more (each later hint counts "uncancelled" at once).
QUARANTINE_SHARE = 4


def host_agent(kv: Any, name: str = "") -> KVAgent:
    """One NIXL agent over ``kv``'s host tier (one registered region, one descriptor per block):
    what a source serves and a receiver reads into. One per worker, shared by both halves."""
    pool = torch.from_numpy(kv.host.array).view(kv.host.num_blocks, kv.host.layout.block_bytes)
    return KVAgent([pool], name=name or f"flexkv-peer-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@dataclass(frozen=True)
class RemoteHost:
    """A source's host tier as KVAgent.pull reads it (the KVSource protocol)."""

    agent: str
    metadata: str
    layer_addrs: list[int]
    block_bytes: int
    num_blocks: int
    mem: str = "DRAM"
    dev: int = 0


@dataclass
class PullResult:
    ok: bool  # False: what was not pulled is recomputed (``why``)
    blocks: int = 0  # blocks that became visible in the host tier
    held: int = 0  # blocks of the prefix this worker's tiers held already
    nbytes: int = 0
    seconds: float = 0.0
    why: str = ""  # "" or a failure reason (ReceiverStats.failed's keys)
    decision: str = ""  # the cost model's reason when it was asked (core/cost.py): "slower" pulls nothing
    start: int = 0  # the first block staged for the pull (the host tier's prefix then): ``blocks`` follow it


@dataclass
class ReceiverStats:
    pulls: int = 0  # pulls asked of a source
    used: int = 0  # pulls that made blocks visible
    blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    skipped: int = 0  # pulls the cost model left out: recomputing was predicted faster
    failed: dict[str, int] = field(default_factory=dict)  # reason -> pulls that ended in a recompute


class _Link:
    """One TCP connection to a source's control endpoint (one request at a time)."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        host, port = parse_endpoint(endpoint)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Lock()
        self.seq = 0

    def ask(self, message: Any, timeout: float) -> Any:
        self.sock.settimeout(max(0.001, timeout))
        self.sock.sendall(encode(message))
        header = _recv_exact(self.sock, HEADER_BYTES)
        body = None if header is None else _recv_exact(self.sock, peer_frame_length(header))
        if body is None:
            raise ConnectionError("the source closed the connection")
        return decode_to_receiver(body)

    def tell(self, message: Any) -> None:
        self.sock.sendall(encode(message))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def parse_endpoint(endpoint: str) -> tuple:
    """``tcp://host:port`` (what Dynamo's router sends as source_control_endpoint) -> (host, port)."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"source endpoint {endpoint!r}: expected tcp://host:port")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"source endpoint {endpoint!r}: expected tcp://host:port")
    return host.strip("[]"), int(port)


class PeerReceiver:
    """Pulls blocks into ``kv``'s host tier through ``agent`` (host_agent), proving membership
    with ``secret`` (the deployment's)."""

    def __init__(self, kv: Any, agent: Any, secret: bytes | None, connect_timeout: float = 1.0) -> None:
        self.kv, self.agent, self.secret = kv, agent, secret
        self.connect_timeout = connect_timeout
        self.stats = ReceiverStats()
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._layout = kv_layout(kv)
        self._keys = 0
        self._closed = False
        # Staged runs a read NIXL could not cancel may still write: they keep their host blocks
        # (unready, so invisible and never reused) while this manager lives.
        self.quarantined: list[tuple[Any, Any]] = []

    def pull(
        self,
        endpoint: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        blocks: int | None = None,
        timeout: float = 5.0,
        prompt_tokens: int | None = None,
        skip_blocks: int = 0,
    ) -> PullResult:
        """Pulls the first ``blocks`` full blocks of ``token_ids`` (default: all) that this worker's
        tiers lack from the source at ``endpoint``. Never raises for the source's sake: a failure
        is a PullResult with ``why`` (and nothing of it visible). With ``prompt_tokens`` (the whole
        prompt's length; ``skip_blocks``: blocks the engine holds already) the load policy decides
        first (KVManager.pull_decision, with the pulls' measured link): predicted slower than
        recomputing, nothing is pulled (``decision`` "slower"). Every pull that lands feeds that
        link's measurement."""
        t0 = time.perf_counter()
        if self._closed:
            return self._failed("closed", 0, t0)
        if sum(len(run) for _key, run in self.quarantined) * QUARANTINE_SHARE >= self.kv.host.num_blocks:
            return self._failed("uncancelled", 0, t0)  # NIXL keeps refusing: pull no more, keep the tier's room
        deadline = time.monotonic() + timeout
        kv = self.kv
        generation = kv.cache.generation
        hashes = [int(h) for h in kv.hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt).sequence]
        n = len(hashes) if blocks is None else min(len(hashes), max(0, int(blocks)))
        hashes = hashes[:n]
        held = kv.cache.match(hashes).num_blocks if n else 0
        if held >= n:
            return PullResult(True, 0, held)
        decision = ""
        if prompt_tokens is not None:
            d = kv.pull_decision(
                token_ids,
                n,
                prompt_tokens=prompt_tokens,
                skip_blocks=skip_blocks,
                lora_name=lora_name,
                cache_salt=cache_salt,
            )
            decision = d.reason
            if d.end < n:
                self.stats.skipped += 1
                return PullResult(True, 0, held, seconds=time.perf_counter() - t0, decision=decision)
        with self._lock:
            self._keys += 1
            key = ("peer-pull", os.getpid(), self._keys)
        run = kv.stage_host(key, token_ids, hashes, n, generation)
        if run is None:
            return self._failed("no_room", held, t0)
        self.stats.pulls += 1
        verified, sums, nbytes, why = 0, None, 0, ""
        reading: list[bool] = []  # gets an entry once the source pinned and the read starts
        try:
            verified, sums, nbytes = self._read(endpoint, hashes, run, deadline, reading)
            if sums is not None and verified < len(sums):
                why = "corrupt"  # the verified head is used, the rest recomputed
        except ReadNotCancelled as e:
            why = "uncancelled"
            log.error("peer pull from %s: %s; its %d staged host blocks stay out of use", endpoint, e, len(run))
        except PeerRefused as e:
            why = e.reason
            log.info("peer pull from %s: %s; recomputing", endpoint, e)
        except Exception as e:  # noqa: BLE001 - every failure is a recompute
            why = "failed"
            log.warning("peer pull from %s failed (%s: %s); recomputing", endpoint, type(e).__name__, e)
        finally:
            if why == "uncancelled":  # neither committed nor rolled back: unready, never reused
                self.quarantined.append((key, run))
            else:  # a refusal before any read (not_held, busy, ...) is no rollback of bytes
                kv.commit_staged(key, run, verified, sums, read=bool(reading))
        seconds = time.perf_counter() - t0
        if verified:
            kv.cost.observe_link("peer", nbytes, seconds)  # what the next decision predicts with
            self.stats.used += 1
            self.stats.blocks += verified
            self.stats.nbytes += nbytes
            self.stats.seconds += seconds
        if why:
            self.stats.failed[why] = self.stats.failed.get(why, 0) + 1
        return PullResult(not why, verified, held, nbytes, seconds, why, decision, run.start)

    def _failed(self, why: str, held: int, t0: float) -> PullResult:
        self.stats.failed[why] = self.stats.failed.get(why, 0) + 1
        return PullResult(False, 0, held, 0, time.perf_counter() - t0, why)

    def _read(
        self, endpoint: str, hashes: list[int], run: Any, deadline: float, reading: list[bool], retry: bool = True
    ) -> tuple:
        """(verified blocks, their checksums, bytes read) of ``run``'s blocks from the source."""
        link, fresh = self._link(endpoint, deadline)
        with link.lock:
            link.seq += 1
            pull = Pull(
                link.seq,
                VERSION,
                self.kv.model_id,
                self.kv.namespace or "",
                self._layout,
                pack_u64(hashes[: run.end]),
                run.start,
                time.time(),
                uuid.uuid4().hex,
            )
            if self.secret:
                pull.mac = mac_of(pull, self.secret)
            try:
                reply = link.ask(pull, deadline - time.monotonic())
            except TimeoutError as e:  # it took the Pull and did not answer in time (hung, overloaded)
                self._forget(endpoint)  # a late answer would be read as the next Pull's
                raise PeerRefused("timeout", f"no answer from {endpoint} in time ({e})") from None
            except (OSError, ProtocolError) as e:
                self._forget(endpoint)
                if retry and not fresh and isinstance(e, OSError):  # the source closed our idle link
                    return self._read(endpoint, hashes, run, deadline, reading, retry=False)
                raise PeerRefused("source_gone", f"no answer from {endpoint} ({type(e).__name__}: {e})") from None
            if isinstance(reply, Refused):
                raise PeerRefused(reply.reason, reply.message)
            assert isinstance(reply, Pinned)
            lease_end = time.monotonic() + reply.lease_s - LEASE_MARGIN_S
            try:
                return self._copy(reply, run, min(deadline, lease_end), reading)
            finally:
                try:
                    link.tell(Release(reply.id))
                except OSError:
                    self._forget(endpoint)  # the source drops the pin when it sees the close

    def _copy(self, pinned: Pinned, run: Any, deadline: float, reading: list[bool]) -> tuple:
        host = self.kv.host
        slots = [int(x) for x in np.frombuffer(pinned.slots, dtype="<i8")]
        want = unpack_u64(pinned.checksums, "checksums")
        if pinned.start != run.start or len(want) != len(slots) or not 0 < len(slots) <= len(run):
            raise PeerRefused("malformed", f"the source pinned blocks {pinned.start}+{len(slots)} for {run.start}+")
        if pinned.block_bytes != host.layout.block_bytes:
            raise PeerRefused("namespace", "the source's host blocks are another size")
        local = run.block_ids[: len(slots)]
        reading.append(True)
        src = RemoteHost(pinned.agent, pinned.metadata, [pinned.base], pinned.block_bytes, pinned.num_blocks)
        budget = deadline - time.monotonic()
        if budget <= 0:
            raise PeerRefused("timeout", "no time left inside the pin's lease")
        try:
            nbytes = self.agent.pull(src, slots, local, budget)
        except HandoverFailed as e:
            raise PeerRefused("timeout" if "still running" in str(e) else "failed", str(e)) from None
        if time.monotonic() > deadline:  # the lease may have ended mid-read: the bytes are not trusted
            raise PeerRefused("timeout", "the read ended after the pin's lease")
        bb = host.layout.block_bytes
        got = _native.checksums(host.base, np.asarray(local, dtype=np.uint64) * np.uint64(bb), bb)
        bad = np.flatnonzero(got != want)
        verified = int(bad[0]) if len(bad) else len(slots)
        if len(bad):
            log.warning(
                "peer pull: %d of %d blocks from %s fail their checksum (first: block %d); recomputing from there",
                len(bad),
                len(slots),
                pinned.agent,
                run.start + verified,
            )
        return verified, got, nbytes

    def _link(self, endpoint: str, deadline: float) -> tuple[_Link, bool]:
        """The link to ``endpoint`` and whether it is new (a kept one the source may have closed)."""
        with self._lock:
            link = self._links.get(endpoint)
        if link is not None:
            return link, False
        try:
            link = _Link(endpoint, min(self.connect_timeout, max(0.001, deadline - time.monotonic())))
        except ValueError as e:
            raise PeerRefused("malformed", str(e)) from None
        except OSError as e:
            raise PeerRefused("source_gone", f"cannot connect to {endpoint} ({e})") from None
        with self._lock:
            self._links[endpoint] = link
        return link, True

    def _forget(self, endpoint: str) -> None:
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        """Closes every link; later pulls fail at once (``closed``), connecting nowhere."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
