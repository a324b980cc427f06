"""Keys and value format of the remote tier.

Key:   ``{prefix}{fingerprint:016x}:{sequence_hash:016x}`` -- content-addressed, so any worker with
       the same fingerprint finds any other's blocks.
Value: a 48-byte little-endian header, then the block's bytes::

    magic "FKVR" | version u16 | flags u16 (bit 0: has parent) | fingerprint u64 | sequence hash u64
    | parent hash u64 | payload length u64 | xxh3_64(payload) u64

Every read checks every field against what the reader asked for; anything else ends the prefix.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping
from typing import Any

import xxhash

MAGIC = b"FKVR"
VERSION = 1
HEADER = struct.Struct("<4sHHQQQQQ")
HEADER_BYTES = HEADER.size  # 48
_HAS_PARENT = 1
_U64 = (1 << 64) - 1


class Verdict(enum.Enum):
    """What a read found for one block."""

    OK = "ok"
    MISSING = "missing"  # no such key (never written, evicted, expired)
    TRUNCATED = "truncated"  # value length is not header + block bytes
    FOREIGN = "foreign"  # written under another fingerprint (other model, layout or namespace)
    CORRUPT = "corrupt"  # bad magic/version, wrong sequence or parent hash, checksum mismatch
    ERROR = "error"  # the server answered an error (e.g. MOVED during a cluster resharding)


def fingerprint_of(parts: Mapping[str, Any]) -> int:
    """u64 fingerprint of everything that makes block bytes incompatible (model shape, dtype,
    tokens_per_block, layout, TP rank/size, namespace/cache salt...): xxh3_64 of the canonical
    JSON of ``parts`` plus the value format version."""
    canonical = json.dumps({"format": VERSION, **parts}, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_64_intdigest(canonical.encode("utf-8"))


def block_key(prefix_bytes: bytes, fingerprint: int, seq_hash: int) -> bytes:
    return b"%s%016x:%016x" % (prefix_bytes, fingerprint & _U64, seq_hash & _U64)


def key_prefix_bytes(key_prefix: str, fingerprint: int) -> bytes:
    """The part of every key before the sequence hash (for building many keys fast)."""
    return b"%s%016x:" % (key_prefix.encode("utf-8"), fingerprint & _U64)


def encode_header(
    fingerprint: int, seq_hash: int, parent: int | None, payload: memoryview, checksum: int | None = None
) -> bytes:
    """``checksum``: xxh3_64(payload) when the caller already has it (the host pool records it
    when a block's bytes land); hashed here otherwise. A wrong one makes every read refuse the
    value (readers verify the payload), never accept other bytes."""
    flags = 0 if parent is None else _HAS_PARENT
    return HEADER.pack(
        MAGIC,
        VERSION,
        flags,
        fingerprint & _U64,
        seq_hash & _U64,
        0 if parent is None else parent & _U64,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload) if checksum is None else checksum & _U64,
    )


def check_header(
    header: memoryview, fingerprint: int, seq_hash: int, parent: int | None, payload_bytes: int
) -> tuple[Verdict, int]:
    """Verdict for a header before its payload is read, and the checksum the payload must have."""
    magic, version, flags, fp, seq, par, length, checksum = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        return Verdict.CORRUPT, 0
    if fp != fingerprint & _U64:
        return Verdict.FOREIGN, 0
    if length != payload_bytes:
        return Verdict.TRUNCATED, 0
    if (
        seq != seq_hash & _U64
        or bool(flags & _HAS_PARENT) != (parent is not None)
        or (parent is not None and par != parent & _U64)
    ):
        return Verdict.CORRUPT, 0
    return Verdict.OK, checksum


def payload_ok(payload: memoryview, checksum: int) -> bool:
    return xxhash.xxh3_64_intdigest(payload) == checksum


def header_problem(header: memoryview, fingerprint: int, seq_hash: int, parent: int | None, payload_bytes: int) -> str:
    """Why ``check_header`` refused ``header`` (for the log line of a dropped value; hashes in hex,
    never the value's bytes). Only called for a header it refused."""
    magic, version, flags, fp, seq, par, length, _ = HEADER.unpack(header)
    if magic != MAGIC:
        return f"bad header: magic is not {MAGIC.decode()}"
    if version != VERSION:
        return f"bad header: format version {version}, this reader's is {VERSION}"
    if fp != fingerprint & _U64:
        return f"written under fingerprint {fp:016x}, not this model's {fingerprint & _U64:016x}"
    if length != payload_bytes:
        return f"wrong size: header says {length} payload bytes, a block is {payload_bytes}"
    if seq != seq_hash & _U64:
        return f"bad header: it is block {seq:016x}'s value"
    return "bad header: its parent hash is not this block's parent"
