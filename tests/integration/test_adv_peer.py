"""Adversarial: a source's control endpoint keeps a connection slot for every peer that ever
connected, and for any process that opens a connection without a word of the protocol: once 64
such connections are open (64 receivers that each pulled once and keep their link, as a receiver
does; or a port scanner, or a client that sends half a frame), every further worker's pull is
refused ``busy`` for as long as those connections stay open, though nothing is pinned."""

from __future__ import annotations

import random
import socket
import time
import uuid

import pytest

pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from kv_helpers import MODEL, TPB, config, content, device_tensors
from served import wait_until

from dynamo_flexkv import KVLayoutType
from dynamo_flexkv.core.offload import open_offload
from dynamo_flexkv.core.peer import protocol as wire
from dynamo_flexkv.core.peer.source import kv_layout

LAYOUT = KVLayoutType.LAYERBLOCK
SECRET = b"adv-secret"
BLOCKS = 8
MAX_PEERS = 64  # HINTS.md: "Bounds: 64 connections"


def _worker(tmp_path, name: str):
    off = open_offload(MODEL, config(tmp_path / name, host_blocks=64, disk_blocks=0), model_id="m", engine=name)
    dev = device_tensors(LAYOUT, BLOCKS)
    off.register(dev, LAYOUT)
    return off, dev


@pytest.fixture
def source(tmp_path):
    off, dev = _worker(tmp_path, "src")
    rng = random.Random(7)
    tokens = [rng.randrange(32000) for _ in range(BLOCKS * TPB)]
    for b, h in enumerate(off.block_hashes(tokens)):
        for layer in range(MODEL.num_layers):
            dev[layer][b].copy_(content(h, layer))
    off.store(tokens, list(range(BLOCKS)), key="s")
    wait_until("the store's hold", off.finished_holds, timeout=30, every=0.01)
    link = off.open_peer_link(SECRET, "127.0.0.1", 0, 2.0)
    try:
        yield off, link, tokens
    finally:
        link.close()
        off.shutdown()


def _recv(sock: socket.socket):
    head = sock.recv(wire.HEADER_BYTES, socket.MSG_WAITALL)
    body = sock.recv(wire.peer_frame_length(head), socket.MSG_WAITALL)
    return wire.decode_to_receiver(body)


def _connect(link) -> socket.socket:
    host, port = link.endpoint.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _pull_and_keep_the_link(off, link, tokens) -> socket.socket:
    """What a receiver does with one source: a signed Pull, the Pinned answer, a Release; then its
    connection stays open for its next pull from that source."""
    sock = _connect(link)
    hashes = wire.pack_u64(off.block_hashes(tokens))
    p = wire.Pull(1, wire.VERSION, "m", "", kv_layout(off.kv), hashes, 0, time.time(), uuid.uuid4().hex)
    p.mac = wire.mac_of(p, SECRET)
    sock.sendall(wire.encode(p))
    assert isinstance(_recv(sock), wire.Pinned)
    sock.sendall(wire.encode(wire.Release(1)))
    wait_until("the pin released", lambda: link.source_stats.pinned_blocks == 0, timeout=10, every=0.01)
    return sock


def _a_new_worker_pulls(tmp_path, source_link, tokens, timeout: float) -> None:
    off, _ = _worker(tmp_path, "late")
    link = off.open_peer_link(SECRET, "127.0.0.1", 0, 2.0)
    seen: list[str] = []
    try:

        def pulled() -> bool:
            r = link.pull(source_link.endpoint, tokens, timeout=2.0)
            seen.append(r.why)
            return r.ok and r.blocks == BLOCKS

        try:
            wait_until("a new worker's pull", pulled, timeout=timeout, every=0.2)
        except AssertionError:
            raise AssertionError(
                f"the 65th worker never pulled in {timeout} s, with nothing pinned on the source "
                f"(pinned_blocks={source_link.source_stats.pinned_blocks}): its pulls ended {sorted(set(seen))}, "
                f"the source refused {source_link.source_stats.refused}"
            ) from None
    finally:
        link.close()
        off.shutdown()


def test_64_receivers_that_pulled_once_do_not_lock_every_other_worker_out(source, tmp_path):
    off, link, tokens = source
    socks = [_pull_and_keep_the_link(off, link, tokens) for _ in range(MAX_PEERS)]
    try:
        wait_until("every pin released", lambda: link.source_stats.pinned_blocks == 0, timeout=10)
        _a_new_worker_pulls(tmp_path, link, tokens, timeout=20)
    finally:
        for s in socks:
            s.close()


def test_connections_without_a_proof_do_not_lock_the_members_out(source, tmp_path):
    _, link, tokens = source
    socks = []
    for k in range(MAX_PEERS):
        s = _connect(link)
        s.sendall(b"\x10\x00" if k % 2 else (500).to_bytes(wire.HEADER_BYTES, "little") + b"x" * 10)  # half a frame
        socks.append(s)
    try:
        _a_new_worker_pulls(tmp_path, link, tokens, timeout=20)
    finally:
        for s in socks:
            s.close()
