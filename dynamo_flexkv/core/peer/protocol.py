"""The peer pull protocol's control plane: what a receiver and a source say on the source's TCP
control endpoint (the one a worker advertises to Dynamo's router as its ``source_control_endpoint``).

Framing as the node cache's (core/node/protocol.py): a 4-byte little-endian length, then a msgpack
map tagged by ``t``. One connection per receiver; everything the source pinned for a connection is
released when it closes (the receiver died or gave up). The bytes never travel here: the source
answers a Pull with NIXL descriptors of its pinned host blocks and the receiver READs them (data
plane, core/peer/receiver.py), then sends Release.

A Pull proves the receiver belongs to the deployment: ``mac`` is the HMAC-SHA256, under the
deployment's shared secret (the handover's, FLEXKV_HANDOVER_SECRET), of every field that says what
is asked and by whom, and ``sent_unix`` must be recent (a replayed request is refused)."""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from typing import Any

import msgspec
import numpy as np

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.node.protocol import HEADER_BYTES, ProtocolError, frame_length

__all__ = ["HEADER_BYTES", "ProtocolError", "frame_length"]

VERSION = 1
MAX_FRAME = 1 << 20  # a Pull of 64K block hashes is 512 KiB; nothing here needs more
MAX_CLOCK_SKEW_S = 30.0  # a Pull sent longer ago (or later) than this is refused as stale


class Refusal(str, enum.Enum):
    """Why a source refused a Pull (the receiver counts each reason; every one is a recompute)."""

    VERSION = "version"  # another protocol version
    MALFORMED = "malformed"  # not a message of this protocol, or fields out of range
    UNSIGNED = "unsigned"  # the source has a secret and the request carries no proof
    FORGED = "forged"  # the proof does not match the source's secret
    STALE = "stale"  # sent too long ago (or in the future): a replay
    NAMESPACE = "namespace"  # another model, tenant or KV layout than the source's
    OVERSIZED = "oversized"  # more blocks than one pull may name
    BUSY = "busy"  # the source's pin limits are reached (per peer or in total)
    NOT_HELD = "not_held"  # the source holds none of the named blocks now
    CLOSED = "closed"  # the source is shutting down


class PeerRefused(IOError, FlexKVError):
    """A pull the source refused (``reason``) or that could not complete: the receiver recomputes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


# ---- receiver -> source -----------------------------------------------------------------------
class Pull(msgspec.Struct, tag="pull", forbid_unknown_fields=True):
    id: int  # the receiver's request number on this connection
    version: int
    model_id: str  # names the weights (and the KV layout tag): other weights are other bytes
    tenant: str  # the namespace the blocks belong to ("" for none)
    layout: str  # the host tier's layout fingerprint (JSON): the bytes of a block must mean the same
    hashes: bytes  # the request's block sequence hashes from block 0, little-endian u64
    start: int  # the first block the receiver lacks: the source pins [start, its held prefix)
    sent_unix: float
    nonce: str
    mac: str = ""  # HMAC-SHA256 (hex) of the fields above under the deployment's secret


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    id: int  # the Pull whose pin ends (the receiver read it, or gave up)


# ---- source -> receiver -----------------------------------------------------------------------
class Pinned(msgspec.Struct, tag="pinned", forbid_unknown_fields=True):
    id: int
    agent: str  # the source's NIXL agent name
    metadata: str  # its packed agent metadata (disagg/params.pack_metadata)
    base: int  # address of the source's host tier (one region, block i at base + i * block_bytes)
    block_bytes: int
    num_blocks: int
    start: int  # the first pinned block of the request
    slots: bytes  # host slot of each pinned block, little-endian i64
    checksums: bytes  # xxh3_64 of each pinned block's bytes, little-endian u64
    lease_s: float  # the pin ends this long after the source sent this (sooner on Release)


class Refused(msgspec.Struct, tag="refused", forbid_unknown_fields=True):
    id: int
    reason: str  # a Refusal value
    message: str


ToSource = Pull | Release
ToReceiver = Pinned | Refused
_encoder = msgspec.msgpack.Encoder()
_to_source = msgspec.msgpack.Decoder(ToSource)
_to_receiver = msgspec.msgpack.Decoder(ToReceiver)


def encode(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"{type(message).__name__} of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return len(body).to_bytes(HEADER_BYTES, "little") + body


def peer_frame_length(header: bytes) -> int:
    n = frame_length(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes is over the peer protocol's {MAX_FRAME}-byte limit")
    return n


def decode_to_source(body: bytes) -> Any:
    try:
        return _to_source.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"not a message of the peer pull protocol: {e}") from None


def decode_to_receiver(body: bytes) -> Any:
    try:
        return _to_receiver.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"not a message of the peer pull protocol: {e}") from None


def pack_u64(values: np.ndarray | list[int]) -> bytes:
    return np.asarray(values, dtype=np.uint64).astype("<u8", copy=False).tobytes()


def unpack_u64(data: bytes, what: str) -> np.ndarray:
    if len(data) % 8:
        raise ProtocolError(f"{what} of {len(data)} bytes: not a whole number of 8-byte values")
    return np.frombuffer(data, dtype="<u8")


def mac_of(p: Pull, secret: bytes) -> str:
    """The proof of a Pull: every field but ``mac`` itself, under the deployment's secret."""
    fields = [
        p.id,
        p.version,
        p.model_id,
        p.tenant,
        p.layout,
        hashlib.sha256(p.hashes).hexdigest(),
        p.start,
        repr(float(p.sent_unix)),
        p.nonce,
    ]
    return hmac.new(secret, json.dumps(fields).encode(), hashlib.sha256).hexdigest()


def proof_refusal(p: Pull, secret: bytes | None) -> Refusal | None:
    """None when ``p`` carries a valid proof under ``secret``; else why not."""
    if secret is None:  # a source never serves without a secret (PeerSource refuses to start)
        return Refusal.UNSIGNED
    if not p.mac:
        return Refusal.UNSIGNED
    if not hmac.compare_digest(p.mac, mac_of(p, secret)):
        return Refusal.FORGED
    return None
