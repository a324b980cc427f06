"""What travels in ``disaggregated_params`` from the prefill worker to the decode worker: the
prefill agent's NIXL metadata and name, where its KV lives, the leased block ids and the lease."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dynamo_flexkv.core.transfer.nixl_errors import HandoverRefused

if TYPE_CHECKING:
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent

KEY = "flexkv_handover"
# The graph's handover secret (hex), set by `dynamo-flexkv serve` for every worker of the graph and
# never on a command line: the prefill worker signs each handover with it and the decode worker
# refuses (recomputes) one whose signature is missing or wrong. Unset: no signing on either side.
SECRET_ENV = "FLEXKV_HANDOVER_SECRET"
# 2: num_blocks (the decode worker prepares the prefill worker's KV descriptors once); 3: checksums;
# 4: renew_by_unix, renew_s (the lease holds briefly unless the decode worker claims and renews it)
VERSION = 4


@dataclass(frozen=True)
class HandoverParams:
    agent: str  # the prefill worker's NIXL agent name
    metadata: str | None  # its agent metadata, zlib + base64 (None: the decode worker knows it already)
    lease: str
    blocks: list[int]  # device block ids of the prompt's first len(blocks) full blocks, in order
    last_hash: int | None  # sequence hash of the last leased block: same prompt, same model
    layer_addrs: list[int]  # base address of each layer's KV tensor on the prefill worker
    block_bytes: int  # bytes of one block of one layer
    mem: str  # "DRAM" or "VRAM"
    dev: int  # device id of those tensors
    lease_expires_unix: float  # wall-clock end of the lease: a read must be over by then
    num_blocks: int  # blocks per layer tensor on the prefill worker (what its descriptors cover)
    sig: str | None = None  # HMAC-SHA256 of the fields that say what to read (see ``signed``)
    # xxh3_64 of each block's bytes over every layer (core/transfer/nixl_agent.block_checksums), as the prefill
    # worker computed them: decode verifies what it read before using any of it.
    checksums: list[int] = field(default_factory=list)
    # The lease ends at renew_by_unix unless a decode worker's claim reaches the prefill worker
    # first; each claim or renewal holds it renew_s seconds more (never past lease_expires_unix).
    renew_by_unix: float = 0.0
    renew_s: float = 0.0

    @classmethod
    def of_agent(
        cls,
        agent: KVAgent,
        lease: str,
        blocks: list[int],
        last_hash: int | None,
        lease_expires_unix: float,
        with_metadata: bool = True,
        renew_by_unix: float = 0.0,
        renew_s: float = 0.0,
    ) -> HandoverParams:
        """What a decode worker needs to read ``blocks`` of ``agent``'s KV under ``lease``."""
        from dynamo_flexkv.core.transfer.nixl_agent import block_checksums  # torch: not for a light reader

        return cls(
            agent=agent.name,
            metadata=agent.metadata if with_metadata else None,
            lease=lease,
            blocks=list(blocks),
            last_hash=last_hash,
            layer_addrs=[x.data_ptr() for x in agent.layers],
            block_bytes=agent.block_bytes,
            mem=agent.mem,
            dev=agent.dev,
            lease_expires_unix=lease_expires_unix,
            num_blocks=agent.num_blocks,
            checksums=block_checksums(agent.layers, blocks),
            renew_by_unix=renew_by_unix,
            renew_s=renew_s,
        )

    def _mac(self, secret: bytes) -> str:
        # Every field that names what is read, from where, for how long, and what it must hash to.
        fields = [
            self.agent,
            self.lease,
            self.blocks,
            self.num_blocks,
            self.last_hash,
            self.layer_addrs,
            self.block_bytes,
            self.mem,
            self.dev,
            repr(float(self.lease_expires_unix)),
            self.checksums,
            repr(float(self.renew_by_unix)),
            repr(float(self.renew_s)),
        ]
        return hmac.new(secret, json.dumps(fields).encode(), hashlib.sha256).hexdigest()

    def signed(self, secret: bytes | None) -> HandoverParams:
        return self if secret is None else replace(self, sig=self._mac(secret))

    def verify(self, secret: bytes | None) -> None:
        """Raises HandoverRefused unless signed with ``secret`` (None: nothing to check)."""
        if secret is None:
            return
        if self.sig is None or not hmac.compare_digest(self.sig, self._mac(secret)):
            raise HandoverRefused(
                f"handover from {self.agent} is {'unsigned' if self.sig is None else 'forged'}: "
                f"its signature does not match this graph's {SECRET_ENV}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {KEY: dict(asdict(self), version=VERSION, checksums=pack_checksums(self.checksums))}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any] | None) -> HandoverParams | None:
        """None when the payload carries no handover (a prefill worker that held nothing)."""
        if not isinstance(payload, Mapping) or payload.get(KEY) is None:
            return None
        d = payload[KEY]
        if not isinstance(d, Mapping) or d.get("version") != VERSION:
            raise HandoverRefused(
                f"disaggregated_params.{KEY}: expected version {VERSION}, got "
                f"{d.get('version') if isinstance(d, Mapping) else type(d).__name__}"
            )
        try:
            p = cls(
                agent=str(d["agent"]),
                metadata=d.get("metadata"),
                lease=str(d["lease"]),
                blocks=[int(b) for b in d["blocks"]],
                last_hash=None if d.get("last_hash") is None else int(d["last_hash"]),
                layer_addrs=[int(a) for a in d["layer_addrs"]],
                block_bytes=int(d["block_bytes"]),
                mem=str(d["mem"]),
                dev=int(d["dev"]),
                lease_expires_unix=float(d["lease_expires_unix"]),
                num_blocks=int(d["num_blocks"]),
                sig=None if d.get("sig") is None else str(d["sig"]),
                checksums=unpack_checksums(d["checksums"]),
                renew_by_unix=float(d["renew_by_unix"]),
                renew_s=float(d["renew_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HandoverRefused(f"disaggregated_params.{KEY} is malformed ({type(e).__name__}: {e})") from None
        if p.mem not in ("DRAM", "VRAM") or p.block_bytes <= 0 or p.num_blocks <= 0:
            raise HandoverRefused(
                f"disaggregated_params.{KEY}: bad memory description "
                f"{p.mem}/{p.block_bytes} bytes/{p.num_blocks} blocks"
            )
        if any(not 0 <= b < p.num_blocks for b in p.blocks):
            raise HandoverRefused(f"disaggregated_params.{KEY}: a block id outside [0, {p.num_blocks})")
        if not all(math.isfinite(x) for x in (p.lease_expires_unix, p.renew_by_unix, p.renew_s)):
            raise HandoverRefused(f"disaggregated_params.{KEY}: lease times must be finite numbers")
        if len(p.checksums) != len(p.blocks):
            raise HandoverRefused(
                f"disaggregated_params.{KEY}: {len(p.checksums)} checksums for "
                f"{len(p.blocks)} blocks (one per block expected)"
            )
        return p


def pack_checksums(values: list[int]) -> str:
    """Little-endian u64 per block, base64: 11 characters a block, and no JSON number past 2^53."""
    return base64.b64encode(np.asarray(values, dtype="<u8").tobytes()).decode("ascii")


def unpack_checksums(text: Any) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"checksums must be a base64 string, not {type(text).__name__}")
    raw = base64.b64decode(text, validate=True)  # binascii.Error is a ValueError
    if len(raw) % 8:
        raise ValueError(f"checksums are {len(raw)} bytes, not 8 per block")
    return [int(x) for x in np.frombuffer(raw, dtype="<u8")]


def handover_secret() -> bytes | None:
    """This worker's graph secret from the environment; None when started by hand without one."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None
