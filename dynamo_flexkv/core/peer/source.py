"""The source half of a peer pull: serves a worker's control endpoint, pins what its host tier
holds of the named blocks under a lease and answers with NIXL descriptors of that host memory.

What is pinned: the ready host blocks of the request's prefix from the receiver's first missing
block, locked in the host tier's index (KVManager.pin_host: the lock a get's read takes), so
eviction and reuse skip them. A pin ends on the receiver's Release, when its connection closes
(the receiver died or gave up), or when its lease ends, whichever comes first: a pin never
outlives its lease. Bounded: at most ``max_peers`` connections, ``max_pins_per_peer`` pins per
connection and ``max_pinned_blocks`` blocks pinned in total; a Pull beyond them is refused (busy),
as is one naming more than ``max_blocks_per_pull`` blocks (oversized). A full connection table
makes room by closing the connection idle longest that pins nothing (receivers keep their link
between pulls and reconnect), and a frame must arrive whole within ``FRAME_TIMEOUT_S`` once it
started: neither idle links nor half-sent frames can lock members out."""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.peer.protocol import (
    HEADER_BYTES,
    MAX_CLOCK_SKEW_S,
    VERSION,
    Pinned,
    ProtocolError,
    Pull,
    Refusal,
    Refused,
    Release,
    decode_to_source,
    encode,
    pack_u64,
    peer_frame_length,
    proof_refusal,
    unpack_u64,
)

log = logging.getLogger(__name__)

FRAME_TIMEOUT_S = 5.0  # a frame that started must end within this (a stalled sender is closed)


@dataclass(frozen=True)
class SourceLimits:
    lease_s: float = 2.0  # longest a pin holds without a Release
    max_peers: int = 64  # connections served at once
    max_pins_per_peer: int = 4  # pins one connection holds at once
    max_pinned_blocks: int = 0  # blocks pinned at once, all peers; 0: a quarter of the host tier
    max_blocks_per_pull: int = 16384  # blocks one Pull may name past its start

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= 60:
            raise ValueError(f"peer source lease_s={self.lease_s}: expected a number of seconds in (0, 60]")
        for name in ("max_peers", "max_pins_per_peer", "max_blocks_per_pull"):
            if getattr(self, name) <= 0:
                raise ValueError(f"peer source {name}={getattr(self, name)}: expected a positive number")
        if self.max_pinned_blocks < 0:
            raise ValueError(f"peer source max_pinned_blocks={self.max_pinned_blocks}: expected >= 0")


@dataclass
class SourceStats:
    pins: int = 0  # pulls answered with pinned blocks
    pinned_blocks: int = 0  # gauge: blocks pinned now
    released: int = 0  # pins ended by the receiver's Release
    expired: int = 0  # pins ended by their lease
    dropped: int = 0  # pins ended because their connection closed
    blocks_served: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # Refusal value -> pulls refused


@dataclass
class _Pin:
    key: tuple[str, int]
    conn: _Conn
    pull_id: int
    blocks: int
    deadline: float  # monotonic


class _Conn:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.pins: dict[int, _Pin] = {}  # pull id -> pin
        self.send_lock = threading.Lock()
        self.active = time.monotonic()  # when its last frame arrived (or it connected)

    def hang_up(self) -> None:
        """Ends the connection from another thread: its reader wakes with EOF and drops it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, message: Any) -> None:
        with self.send_lock:
            self.sock.sendall(encode(message))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class PeerSource:
    """Serves ``kv``'s host tier to peers on ``host:port`` (port 0: any free port, see ``port``)
    until close(). ``agent``: the KVAgent over the host tier (core/peer/receiver.host_agent), shared
    with this worker's receiver. ``secret``: the deployment's (required: no proof, no bytes)."""

    def __init__(
        self,
        kv: Any,
        agent: Any,
        secret: bytes | None,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: SourceLimits = SourceLimits(),
    ) -> None:
        if not secret:
            raise ValueError(
                "a peer source needs the deployment's shared secret (FLEXKV_HANDOVER_SECRET): without it "
                "any process that reaches the control port could read this worker's KV"
            )
        self.kv, self.agent, self.secret, self.limits = kv, agent, secret, limits
        host_blocks = kv.host.num_blocks
        self.max_pinned = limits.max_pinned_blocks or max(1, host_blocks // 4)
        self.stats = SourceStats()
        self._layout = kv_layout(kv)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._conns: list[_Conn] = []
        self._pins: dict[tuple[str, int], _Pin] = {}
        self._seq = itertools.count(1)
        self._nonces: dict[str, float] = {}  # nonce -> when seen (replays inside the skew window)
        self._nonce_order: collections.deque[tuple[float, str]] = collections.deque()
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=limits.max_peers)
        self.host, self.port = self._listener.getsockname()[:2]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="flexkv-peer-accept", daemon=True),
            threading.Thread(target=self._lease_loop, name="flexkv-peer-leases", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("peer source: serving host blocks on %s:%d (lease %.1f s)", self.host, self.port, limits.lease_s)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    # ---- connections -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            idle = None
            with self._lock:
                if not self._closed and len(self._conns) >= self.limits.max_peers:
                    idle = min((c for c in self._conns if not c.pins), key=lambda c: c.active, default=None)
                    if idle is not None:
                        self._conns.remove(idle)  # its slot is the new one's; its thread closes it
                full = self._closed or len(self._conns) >= self.limits.max_peers
                if not full:
                    self._conns.append(conn)
            if idle is not None:
                log.debug("peer source: %d peers connected; closing %s, idle longest", self.limits.max_peers, idle.peer)
                idle.hang_up()
            if full:
                self._refuse(conn, 0, Refusal.BUSY, f"{self.limits.max_peers} peers connected (max_peers)")
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="flexkv-peer-conn", daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        try:
            while True:
                conn.sock.settimeout(None)  # idle between frames: as long as the peer likes
                first = conn.sock.recv(1)
                if not first:
                    return
                conn.sock.settimeout(FRAME_TIMEOUT_S)  # a frame that started ends soon
                rest = _recv_exact(conn.sock, HEADER_BYTES - 1)
                if rest is None:
                    return
                body = _recv_exact(conn.sock, peer_frame_length(first + rest))
                if body is None:
                    return
                conn.active = time.monotonic()
                msg = decode_to_source(body)
                if isinstance(msg, Pull):
                    self._pull(conn, msg)
                else:
                    self._release(conn, msg)
        except ProtocolError as e:
            self._count(Refusal.MALFORMED)
            log.warning("peer source: %s sent a frame that is not a peer pull message (%s); closing it", conn.peer, e)
        except TimeoutError:
            self._count(Refusal.MALFORMED)
            log.warning(
                "peer source: %s sent part of a frame and stalled for %.0f s; closing it", conn.peer, FRAME_TIMEOUT_S
            )
        except OSError:
            pass  # the receiver went away
        finally:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """The connection ended: whatever it still pins is released now."""
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
            pins = list(conn.pins.values())
            conn.pins.clear()
            for pin in pins:
                self._end(pin)
                self.stats.dropped += 1
        try:
            conn.sock.close()
        except OSError:
            pass

    # ---- requests ----------------------------------------------------------------------------------
    def _refuse(self, conn: _Conn, pull_id: int, reason: Refusal, message: str) -> None:
        self._count(reason)
        try:
            conn.send(Refused(pull_id, reason.value, message))
        except OSError:
            pass

    def _count(self, reason: Refusal) -> None:
        with self._lock:
            self.stats.refused[reason.value] = self.stats.refused.get(reason.value, 0) + 1

    def _pull(self, conn: _Conn, p: Pull) -> None:
        if p.version != VERSION:
            return self._refuse(conn, p.id, Refusal.VERSION, f"this source speaks version {VERSION}, not {p.version}")
        why = proof_refusal(p, self.secret)
        if why is not None:
            log.warning("peer source: a pull from %s is %s; refused", conn.peer, why.value)
            return self._refuse(conn, p.id, why, "the pull's proof does not match this deployment's secret")
        now = time.time()
        if abs(now - p.sent_unix) > MAX_CLOCK_SKEW_S or not self._fresh(p.nonce, now):
            return self._refuse(conn, p.id, Refusal.STALE, "sent too long ago, or seen before")
        if (p.model_id, p.tenant, p.layout) != (self.kv.model_id, self.kv.namespace or "", self._layout):
            return self._refuse(
                conn, p.id, Refusal.NAMESPACE, "this source holds another model, tenant or KV layout's blocks"
            )
        try:
            hashes = unpack_u64(p.hashes, "block hashes")
        except ProtocolError as e:
            return self._refuse(conn, p.id, Refusal.MALFORMED, str(e))
        if not 0 <= p.start < len(hashes):
            return self._refuse(conn, p.id, Refusal.MALFORMED, f"start={p.start} outside the {len(hashes)} blocks")
        if len(hashes) - p.start > self.limits.max_blocks_per_pull:
            return self._refuse(
                conn,
                p.id,
                Refusal.OVERSIZED,
                f"{len(hashes) - p.start} blocks named, at most {self.limits.max_blocks_per_pull} per pull",
            )
        pin, closed = None, False
        with self._lock:
            if self._closed:
                return self._refuse(conn, p.id, Refusal.CLOSED, "the source is shutting down")
            room = self.max_pinned - self.stats.pinned_blocks
            if len(conn.pins) >= self.limits.max_pins_per_peer or room <= 0 or p.id in conn.pins:
                busy = f"{len(conn.pins)} pins of this peer, {self.stats.pinned_blocks} blocks pinned in total"
            else:
                busy = ""
                key = ("peer-pin", next(self._seq))
                # Under our lock: a pin is in the table (and so covered by its lease) once it exists.
                try:
                    pin = self.kv.pin_host(key, hashes.tolist(), p.start, min(room, len(hashes) - p.start))
                except FlexKVError:  # the tiers shut down under an open link (close the link first)
                    closed = True
                    pin = None
                if pin is not None:
                    lease = _Pin(key, conn, p.id, len(pin.slots), time.monotonic() + self.limits.lease_s)
                    self._pins[key] = conn.pins[p.id] = lease
                    self.stats.pins += 1
                    self.stats.pinned_blocks += lease.blocks
                    self.stats.blocks_served += lease.blocks
                    self._wake.notify()
        if closed:
            return self._refuse(conn, p.id, Refusal.CLOSED, "the source's tiers are shut down")
        if busy:
            return self._refuse(conn, p.id, Refusal.BUSY, busy)
        if pin is None:
            return self._refuse(conn, p.id, Refusal.NOT_HELD, "this source's host tier holds none of those blocks")
        try:
            conn.send(
                Pinned(
                    p.id,
                    self.agent.name,
                    self.agent.metadata,
                    self.kv.host.base,
                    self.kv.host.layout.block_bytes,
                    self.kv.host.num_blocks,
                    pin.start,
                    pack_u64(pin.slots),
                    pack_u64(pin.checksums),
                    self.limits.lease_s,
                )
            )
        except OSError:
            pass  # _serve's next read sees the close and drops the pin

    def _fresh(self, nonce: str, now: float) -> bool:
        with self._lock:
            while self._nonce_order and self._nonce_order[0][0] < now - 2 * MAX_CLOCK_SKEW_S:
                self._nonces.pop(self._nonce_order.popleft()[1], None)
            if not nonce or nonce in self._nonces or len(self._nonces) > 1_000_000:
                return False
            self._nonces[nonce] = now
            self._nonce_order.append((now, nonce))
            return True

    def _release(self, conn: _Conn, r: Release) -> None:
        with self._lock:
            pin = conn.pins.pop(r.id, None)
            if pin is not None:
                self._end(pin)
                self.stats.released += 1

    def _end(self, pin: _Pin) -> None:
        """Under the lock: the pin's blocks are free to be evicted or reused again."""
        if self._pins.pop(pin.key, None) is None:
            return
        pin.conn.pins.pop(pin.pull_id, None)
        self.stats.pinned_blocks -= pin.blocks
        try:
            self.kv.unpin(pin.key)
        except Exception:  # a closed manager released everything already
            log.debug("peer source: unpin of %s failed", pin.key, exc_info=True)

    # ---- leases --------------------------------------------------------------------------------------
    def _lease_loop(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for pin in [x for x in self._pins.values() if x.deadline <= now]:
                    self._end(pin)
                    self.stats.expired += 1
                    log.info("peer source: a pin of %d blocks for %s ended with its lease", pin.blocks, pin.conn.peer)
                nxt = min((x.deadline for x in self._pins.values()), default=now + 1.0)
                self._wake.wait(max(0.001, nxt - now))

    def close(self) -> None:
        """Stops serving; every pin is released, every connection closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            for pin in list(self._pins.values()):
                self._end(pin)
            self._wake.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)


def kv_layout(kv: Any) -> str:
    """What must agree for a peer's host block to mean the same bytes here (core/layout.py)."""
    import json

    return json.dumps(kv.host.layout.fingerprint(), sort_keys=True)
