"""What each worker held, and when: the replay subscribes to the workers' KV event sockets as
Dynamo's vLLM worker does (vLLM's ZMQ publisher: device blocks from vLLM's prefix cache, host and
disk blocks from FlexKVConnector, ``medium`` CPU_PINNED / DISK; docs/WIRE_FORMATS.md) and keeps
every event with the time its batch was published, which is when the router could learn of it.

A second subscriber changes nothing for the first (a PUB socket copies each frame to every
subscriber). Frames lost (the sequence numbers skip) are counted; events sent before the
subscription (the graph's start) are not seen, which the accounting reads as blocks it never
heard of."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

DEVICE, HOST, DISK, REMOTE = "device", "host", "disk", "remote"
MEDIA = {
    None: DEVICE,
    "GPU": DEVICE,
    "CPU_PINNED": HOST,
    "CPU": HOST,
    "DISK": DISK,
    "STORAGE": DISK,
    "EXTERNAL": REMOTE,
}


@dataclass(frozen=True)
class KvEvent:
    """One event of one worker: ``kind`` stored, removed or cleared; ``t`` the publisher's clock
    (unix seconds) for its batch."""

    t: float
    worker: str
    kind: str
    tier: str
    hashes: tuple[Any, ...] = ()
    parent: Any = None
    token_ids: tuple[int, ...] = ()


def decode_frame(worker: str, payload: bytes) -> list[KvEvent]:
    """A publisher frame's payload (msgpack ``[ts, [events...], dp_rank]``, each event a map with
    its ``type``) as KvEvents; events of other kinds are skipped."""
    batch = msgspec.msgpack.decode(payload)
    ts, events = float(batch[0]), batch[1]
    out = []
    for ev in events:
        if isinstance(ev, (list, tuple)):  # array-like structs: [tag, fields...] (not what vLLM sends)
            continue
        kind = ev.get("type")
        tier = MEDIA.get(ev.get("medium"), DEVICE)
        hashes = tuple(_hashable(h) for h in ev.get("block_hashes") or ())
        if kind == "BlockStored":
            parent = ev.get("parent_block_hash")
            out.append(
                KvEvent(
                    ts,
                    worker,
                    "stored",
                    tier,
                    hashes,
                    None if parent is None else _hashable(parent),
                    tuple(ev.get("token_ids") or ()),
                )
            )
        elif kind == "BlockRemoved":
            out.append(KvEvent(ts, worker, "removed", tier, hashes))
        elif kind == "AllBlocksCleared":
            out.append(KvEvent(ts, worker, "cleared", DEVICE))
    return out


def _hashable(h: Any) -> Any:
    return tuple(h) if isinstance(h, list) else h


@dataclass
class EventTap:
    """Subscribes to ``endpoints`` (worker name -> ZMQ endpoint) from a thread of its own until
    ``stop``; ``events`` in arrival order, ``lost`` frames the sequence numbers skipped."""

    endpoints: dict[str, str]
    events: list[KvEvent] = field(default_factory=list)
    lost: int = 0
    undecodable: int = 0

    def __post_init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[Any, str] = {}
        for name, ep in self.endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(ep)
            self._socks[sock] = name
        self._stop = threading.Event()
        self._seq: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="replay-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                self._read(sock)
        for sock in self._socks:  # what arrived before stop
            self._read(sock)
            sock.close()

    def _read(self, sock: Any) -> None:
        name = self._socks[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self.undecodable += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            last = self._seq.get(name)
            if last is not None and seq > last + 1:
                self.lost += seq - last - 1
            self._seq[name] = seq
            try:
                self.events.extend(decode_frame(name, frames[2]))
            except (msgspec.DecodeError, TypeError, ValueError, IndexError, AttributeError):
                self.undecodable += 1

    def stop(self) -> list[KvEvent]:
        """Stops (what arrived is read first) and returns the events. Those of the last steps may
        still be on their way: no request of the replay is judged by them."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.events


def worker_endpoints(workers: Sequence[Any]) -> dict[str, str]:
    """Each vLLM worker's KV event endpoint, from its ``--kv-events-config`` argument (serve's
    plan: an ipc:// socket in the worker's run directory); workers without one are left out."""
    import json

    out = {}
    for p in workers:
        argv = list(p.argv)
        if "--kv-events-config" in argv:
            cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
            ep = str(cfg.get("endpoint") or "")
            if ep.startswith("tcp://*"):
                ep = "tcp://127.0.0.1" + ep[len("tcp://*") :]
            if ep:
                out[p.name] = ep
    return out
