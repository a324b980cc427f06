"""The P->D handover carried by FlexKVConnector (disaggregated vLLM workers, ``handover: true``).

Prefill (the request's kv_transfer_params say ``do_remote_decode``): in the step that computes the
last prompt token, the worker half writes each full prompt block's digest into its digest table (a
NIXL-registered array, one u64 per vLLM block) right after the forward, so the digests exist
before the request's output leaves the engine. What a digest is follows ``handover_verify``
(Verify): the xxh3 of the block's bytes over every layer, or only a stamp, each mixed with the
prefix hash of its block (_content_tags). When the request finishes, the scheduler half holds
its blocks (request_finished returns True) and returns under ``flexkv_vllm_handover`` where they
are: the worker's NIXL agent (name and metadata, from the file the worker wrote at registration),
each layer's base address, the block ids, the digest table, the lease. The worker frees the blocks
when decode's release notification arrives or the lease ends.

Decode: a request with such params is loaded from the prefill worker, not from the tiers, as a tier
load is: synchronously inside the step that computes the rest of the prompt (no polling step). One
prepared READ of every (layer, block), beside a READ of those blocks' digests; the bytes are
verified before vLLM computes on them, and the notice that releases the prefill's blocks leaves
after the step's forward (off the prompt's critical path). A
read that cannot finish inside the lease, fails, or does not match its digests is recomputed
(kv_load_failure_policy=recompute) and counted. Why not vLLM's NixlConnector: docs/VLLM.md."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from dynamo_flexkv.core.transfer.nixl_agent import HandoverFailed, KVAgent, Notifier, kv_block_checksums
from dynamo_flexkv.integrations.disagg.params import HandoverRefused
from dynamo_flexkv.integrations.vllm_connector.settings import (
    DEFAULT_HANDOVER_ORPHAN_S,
    MAX_LEASE_S,
    run_dir_or_default,
)

log = logging.getLogger(__name__)

KEY = "flexkv_vllm_handover"  # in kv_transfer_params, beside NixlConnector's keys
VERSION = 2  # 2: the payload names its digests' kind (verify)
RELEASE = b"flexkv-release:"  # + request id: decode is done with the prefill's blocks
# A read goes as up to this many reads of consecutive blocks (at least 8 blocks each), so each
# one's verify overlaps the transfer of the next.
PULL_CHUNKS = 4
LEASE_MARGIN_S = 0.5  # a read must end this long before the lease does (clock reads, the release's trip)
NOTICE_POLL_S = 0.005  # the prefill asks NIXL for release notices at most this often
MAX_HOLD_S = MAX_LEASE_S  # the longest a prefill holds a finished request's blocks


class Verify:
    """What decode checks before vLLM computes on handed-over blocks (``handover_verify``).

    BYTES: every landed byte hashes (xxh3, all layers) to the digest the prefill wrote after its
    forward, mixed with the block's prefix hash: catches bytes changed at the source or on the way, and a
    block reused for another prompt. It costs a second pass over the bytes on decode's core (and
    one on the prefill's, after its forward): on loopback shared memory as much CPU as half the
    read itself (docs/BENCHMARKS.md, bench disagg --vllm).
    OWNER: only each block's stamp (its prefix hash, mixed), read in the same NIXL transfer: the
    prefill's block held this prefix when it was read, and its hold had not ended (a hold's
    digests leave the table when it ends). This catches a wrong, swapped or reused block; it trusts
    the transport and the source memory for the bytes themselves (TCP and RDMA checksum them on the
    wire; shared memory is a memcpy)."""

    BYTES = "bytes"
    OWNER = "owner"
    ALL = (BYTES, OWNER)


def _owner_stamps(tags: np.ndarray) -> np.ndarray:
    """The OWNER digest of blocks whose content tags are ``tags`` (``_content_tags``); never 0,
    the value of a cleared table slot (an ended hold), so no prefix hash can match a freed block."""
    return (tags * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0xC2B2AE3D27D4EB4F)) | np.uint64(1)


def _content_tags(hashes: np.ndarray | Sequence[int]) -> np.ndarray:
    """What each block's digest is mixed with: the sequence hash of the prompt up to and including
    the block (core/hashing.py: token ids, block size, adapter and salt, chained), which both roles
    compute from the prompt. A block's digest then says which prefix it holds the KV of: a block
    in the wrong place, or reused for another prompt, never passes; prompts sharing a prefix block
    (vLLM's prefix cache) write the same digest into its one slot, so neither loses the other's."""
    return np.asarray(hashes, dtype=np.uint64)


@dataclass(frozen=True)
class SourceInfo:
    """What does not change while a prefill worker lives: its agent and where its KV is."""

    agent: str
    metadata: str  # packed NIXL agent metadata (disagg/params.pack_metadata)
    layer_addrs: list[int]
    block_bytes: int
    num_blocks: int
    mem: str
    dev: int
    digest_addr: int
    block_shape: list[int]  # one block of one layer, e.g. [kv_heads, block_size, 2*head_size]
    dtype: str  # torch dtype of the KV, e.g. "torch.bfloat16"
    verify: str = Verify.BYTES  # what the digest table holds (Verify)


@dataclass(frozen=True)
class VllmHandover(SourceInfo):
    """One request's handover, as the decode worker gets it."""

    req: str = ""  # the prefill engine's request id (the release names it)
    blocks: list[int] = ()  # type: ignore[assignment]  # prefill block of each full prompt block, in order
    lease_expires_unix: float = 0.0

    def to_params(self) -> dict[str, Any]:
        return {KEY: dict(asdict(self), version=VERSION)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> VllmHandover | None:
        """None when ``params`` carries no handover of ours; HandoverRefused when it is malformed."""
        if not isinstance(params, Mapping) or params.get(KEY) is None:
            return None
        d = params[KEY]
        version = d.get("version") if isinstance(d, Mapping) else None
        if (
            not isinstance(d, Mapping)
            or isinstance(version, bool)
            or not isinstance(version, int)
            or version != VERSION
        ):
            raise HandoverRefused(
                f"kv_transfer_params.{KEY}: expected version {VERSION}, got "
                f"{d.get('version') if isinstance(d, Mapping) else type(d).__name__}"
            )
        try:
            h = cls(**{f.name: _field(f.name, d) for f in fields(cls)})
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise HandoverRefused(f"kv_transfer_params.{KEY} is malformed ({type(e).__name__}: {e})") from None
        if h.verify not in Verify.ALL:
            raise HandoverRefused(f"kv_transfer_params.{KEY}: verify={h.verify!r}, expected one of {Verify.ALL}")
        if h.mem not in ("DRAM", "VRAM") or h.block_bytes <= 0 or h.num_blocks <= 0 or not h.digest_addr:
            raise HandoverRefused(f"kv_transfer_params.{KEY}: bad memory description")
        if any(not 0 <= b < h.num_blocks for b in h.blocks):
            raise HandoverRefused(f"kv_transfer_params.{KEY}: a block id outside [0, {h.num_blocks})")
        if not math.isfinite(h.lease_expires_unix):
            raise HandoverRefused(f"kv_transfer_params.{KEY}: the lease end must be a finite number")
        return h


_INT_LISTS = ("layer_addrs", "blocks", "block_shape")
_INTS = ("block_bytes", "num_blocks", "dev", "digest_addr")
_STRS = ("agent", "metadata", "mem", "req", "dtype", "verify")


def _field(name: str, d: Mapping[str, Any]) -> Any:
    """One field of a payload, of exactly its type (no bool for int, no string for a list)."""
    v = d[name]

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if name in _INT_LISTS:
        if not isinstance(v, list) or not all(is_int(x) for x in v):
            raise TypeError(f"{name} must be a list of integers")
        return v
    if name in _INTS:
        if not is_int(v):
            raise TypeError(f"{name} must be an integer")
        return v
    if name in _STRS:
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a string")
        return v
    if name == "lease_expires_unix":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a number")
        return float(v)
    raise KeyError(name)


def source_file(engine_id: str, run_dir: str | None) -> str:
    """Where a prefill engine's worker leaves its SourceInfo for its scheduler (same machine)."""
    base = run_dir_or_default(run_dir)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id).lstrip(".")
    return os.path.join(base, f"flexkv-handover-{safe}.json")


def read_source(engine_id: str, run_dir: str | None) -> SourceInfo | None:
    try:
        with open(source_file(engine_id, run_dir)) as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise TypeError("not a JSON object")
        return SourceInfo(**{f.name: _field(f.name, d) for f in fields(SourceInfo)})
    except (OSError, ValueError, TypeError, KeyError, RecursionError, OverflowError) as e:
        log.warning(
            "FlexKVConnector: no handover source for engine %s (%s): requests are handed over by the "
            "next connector, if any",
            engine_id,
            e,
        )
        return None


@dataclass
class PullResult:
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    why: str = ""  # "", "lease", "failed", "corrupt", "refused"
    verify_seconds: float = 0.0  # of ``seconds``: hashing what landed


class Handover:
    """One NIXL agent over this worker's vLLM KV: the prefill half (digests, holds, releases) and
    the decode half (pull, verify); a worker uses the half of its role."""

    def __init__(
        self,
        layers: Sequence[Any],
        engine_id: str,
        run_dir: str | None,
        verify: str = Verify.OWNER,
        orphan_s: float = DEFAULT_HANDOVER_ORPHAN_S,
    ) -> None:
        import uuid

        if verify not in Verify.ALL:
            raise ValueError(f"handover_verify={verify!r}: expected one of {Verify.ALL}")
        self.verify = verify
        self.orphan_s = orphan_s  # the handover_orphan_s setting
        self.agent = KVAgent(layers, name=f"flexkv-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._notices = Notifier(f"{self.agent.name}-notices")  # decode's releases: not on the reading agent
        self.agent.enable_digests()
        digests, landed = self.agent.digests, self.agent.landed
        assert digests is not None and landed is not None  # enable_digests() just made both tables
        self._table = digests.numpy().view(np.uint64)
        self._landed = landed.numpy().view(np.uint64)
        self._holds: dict[str, float] = {}  # request -> monotonic end of its lease
        self._early: dict[str, float] = {}  # released before its hold arrived -> when seen
        # request -> (its stamped blocks, the digests written, when): cleared when its hold ends
        self._stamped: dict[str, tuple] = {}
        # (block, digest) -> requests that wrote it and whose hold has not ended (shared prefixes)
        self._stampers: dict[tuple[int, int], int] = {}
        self._done: set[str] = set()
        self._releases: list[VllmHandover] = []  # decode: read (or given up), not yet released
        self._polled = 0.0
        self.released = self.expired = 0
        info = SourceInfo(
            agent=self.agent.name,
            metadata=self.agent.metadata,
            layer_addrs=[x.data_ptr() for x in self.agent.layers],
            block_bytes=self.agent.block_bytes,
            num_blocks=self.agent.num_blocks,
            mem=self.agent.mem,
            dev=self.agent.dev,
            digest_addr=self.agent.digest_addr,
            block_shape=list(self.agent.layers[0].shape[1:]),
            dtype=str(self.agent.layers[0].dtype),
            verify=verify,
        )
        self.layout = (tuple(info.block_shape), info.dtype)
        self.path = source_file(engine_id, run_dir)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(info), f)
        os.replace(tmp, self.path)
        self._closed = False

    def digest(self, req_id: str, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Called once the blocks' bytes are final (after the forward that wrote them): ``blocks``
        hold the prompt's first blocks, ``hashes`` their sequence hashes (``_content_tags``)."""
        if len(hashes) != len(blocks):
            raise ValueError(f"digest of {req_id}: {len(blocks)} blocks but {len(hashes)} hashes")
        self._unstamp(req_id)
        if not len(blocks):
            return
        ids = np.asarray(blocks, dtype=np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.agent.num_blocks or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"digest of {req_id}: block ids must be distinct and in [0, {self.agent.num_blocks})")
        tags = _content_tags(hashes)
        if self.verify == Verify.OWNER:
            values = _owner_stamps(tags)
        else:
            values = kv_block_checksums(self.agent.layers, blocks) ^ tags
        self._table[ids] = values
        self._stamped[req_id] = (ids, values, time.monotonic())
        for key in zip(ids.tolist(), values.tolist()):
            self._stampers[key] = self._stampers.get(key, 0) + 1

    def _unstamp(self, req_id: str) -> None:
        """A request's hold ended: its digests leave the table (unless another request whose hold
        goes on wrote the same digest into the same block: a shared prefix), so a read of the
        freed blocks can no longer pass whatever decode's clock says about the lease. Counted per
        (block, digest): a block digested again for another prefix clears when that one ends."""
        got = self._stamped.pop(req_id, None)
        if got is None:
            return
        ids, values, _ = got
        for key in zip(ids.tolist(), values.tolist()):
            left = self._stampers.get(key, 0) - 1
            if left > 0:
                self._stampers[key] = left
                continue
            self._stampers.pop(key, None)
            if int(self._table[key[0]]) == key[1]:
                self._table[key[0]] = 0

    def hold(self, req_id: str, lease_expires_unix: float) -> None:
        if self._early.pop(req_id, None) is not None:
            self.released += 1
            self._done.add(req_id)
            self._unstamp(req_id)
            return
        left = lease_expires_unix - time.time()
        self._holds[req_id] = time.monotonic() + (min(max(0.0, left), MAX_HOLD_S) if math.isfinite(left) else 0.0)

    def finished(self) -> set[str]:
        """Requests whose blocks decode released, or whose lease ended, since the last call."""
        now = time.monotonic()
        # An engine holding blocks steps in a tight loop; asking NIXL for notices at every step
        # contends with the progress thread that serves decode's read (measured: a 0.4 ms read
        # took 10-30 ms while the prefill engine polled every step). Releases wait a few ms.
        if now - self._polled < NOTICE_POLL_S:
            out, self._done = self._done, set()
            return out
        self._polled = now
        for msg in self.agent.notifications():
            if not msg.startswith(RELEASE):
                continue
            rid = msg[len(RELEASE) :].decode("utf-8", "replace")
            if self._holds.pop(rid, None) is not None:
                self.released += 1
                self._done.add(rid)
                self._unstamp(rid)
            else:
                self._early[rid] = now
        for rid, end in list(self._holds.items()):
            if now >= end:
                del self._holds[rid]
                self.expired += 1
                self._done.add(rid)
                self._unstamp(rid)
                log.warning(
                    "FlexKVConnector: handover lease of request %s ended before a decode worker released "
                    "it; its blocks are freed",
                    rid,
                )
        for rid, seen in list(self._early.items()):  # a release whose hold never came (aborted request)
            if now - seen > self.orphan_s:
                del self._early[rid]
        for rid, (_, _, when) in list(self._stamped.items()):  # digested, never held (aborted): no payload
            if rid not in self._holds and now - when > self.orphan_s:
                self._unstamp(rid)
        out, self._done = self._done, set()
        return out

    def pull(
        self,
        h: VllmHandover,
        first: int,
        local_blocks: Sequence[int],
        timeout: float,
        hashes: np.ndarray | Sequence[int],
    ) -> PullResult:
        """Reads prompt blocks [first, first + len(local_blocks)) of ``h`` into ``local_blocks``;
        ``hashes``: the sequence hash of each full block of decode's own prompt, from block 0.
        Whatever the outcome, the prefill's release is queued for ``send_releases`` (after the
        forward: the notice is not on the prompt's critical path)."""
        self._releases.append(h)
        remote = h.blocks[first : first + len(local_blocks)] if first >= 0 else []
        try:
            tags = _content_tags(hashes[first : first + len(local_blocks)]) if first >= 0 else _content_tags([])
            np.asarray(local_blocks, dtype=np.int64)  # refuses ids that are not int64 before anything moves
        except (OverflowError, ValueError, TypeError) as e:
            log.warning(
                "FlexKVConnector: handover of %s refused: bad block ids or prompt hashes (%s); recomputing", h.req, e
            )
            return PullResult(False, why="refused")
        if len(remote) == len(local_blocks) and len(tags) != len(local_blocks):
            log.warning(
                "FlexKVConnector: handover of %s refused: this worker's prompt has %d full blocks, the read "
                "names prompt blocks %d-%d; recomputing",
                h.req,
                len(hashes),
                first,
                first + len(local_blocks),
            )
            return PullResult(False, why="refused")
        if (
            len(remote) != len(local_blocks)
            or len(set(local_blocks)) != len(local_blocks)
            or (tuple(h.block_shape), h.dtype) != self.layout
        ):
            log.warning(
                "FlexKVConnector: handover of %s refused: %d local blocks for %d remote ones (distinct: %s), "
                "prefill's blocks %s %s vs this worker's %s %s; recomputing",
                h.req,
                len(local_blocks),
                len(remote),
                len(set(local_blocks)) == len(local_blocks),
                h.block_shape,
                h.dtype,
                *self.layout,
            )
            return PullResult(False, why="refused")
        if h.verify == Verify.OWNER and self.verify == Verify.BYTES:
            log.warning(
                "FlexKVConnector: handover of %s refused: the prefill worker stamps owners only "
                "(handover_verify=owner) and this worker verifies bytes (handover_verify=bytes): set the "
                "same handover_verify on both roles; recomputing",
                h.req,
            )
            return PullResult(False, why="refused")
        lease_left = h.lease_expires_unix - LEASE_MARGIN_S - time.time()
        budget = min(timeout, lease_left)
        if budget <= 0 and lease_left > 0:
            return PullResult(False, why="failed")
        if budget <= 0:
            log.warning(
                "FlexKVConnector: handover of %s reached decode %.1f s before its lease ends; recomputing",
                h.req,
                h.lease_expires_unix - time.time(),
            )
            return PullResult(False, why="lease")
        # What each block's landed digest must be, computed before the read: after a multi-MB copy
        # has flushed the caches every numpy call costs several times more (measured: the owner
        # check took 23-44 us per handover computed after the read, over a 0.2-1.4 ms read).
        # The digests land in the pull's block order (KVAgent.pull), so a check compares runs of bytes.
        owner = h.verify == Verify.OWNER
        want = _owner_stamps(tags) if owner else tags
        want_b = want.tobytes()
        t0 = time.perf_counter()
        bad: list[int] = []
        verify_s = [0.0]

        def verify(a: int, b: int) -> None:  # one chunk, while the next ones still move
            v0 = time.perf_counter()
            got = self._landed[a:b]
            if not owner:
                got = got ^ kv_block_checksums(self.agent.layers, local_blocks[a:b])
            if got.tobytes() != want_b[8 * a : 8 * b]:
                bad.extend(a + int(i) for i in np.flatnonzero(got != want[a:b]))
            verify_s[0] += time.perf_counter() - v0

        # Chunks only let a byte verify overlap the rest of the read; an owner check has nothing to
        # overlap, and each chunk is one more NIXL transfer (~10% more CPU per read, measured).
        chunks = 1 if h.verify == Verify.OWNER else min(PULL_CHUNKS, max(1, len(local_blocks) // 8))
        try:
            self.agent.check_compatible(h)
            nbytes = self.agent.pull(h, remote, local_blocks, budget, digests=True, landed=verify, chunks=chunks)
        except (HandoverRefused, ValueError) as e:  # ValueError: local block ids outside this cache
            log.warning("FlexKVConnector: handover of %s refused (%s); recomputing", h.req, e)
            return PullResult(False, why="refused")
        except HandoverFailed as e:
            log.warning("FlexKVConnector: handover of %s failed (%s); recomputing", h.req, e)
            return PullResult(False, why="failed")
        if time.time() > h.lease_expires_unix:  # the prefill may have reused the blocks mid-read
            return PullResult(False, nbytes, time.perf_counter() - t0, "lease")
        t2 = time.perf_counter()
        if bad:
            log.warning(
                "FlexKVConnector: %d of %d blocks handed over for %s fail their digest (first: prompt "
                "block %d); recomputing",
                len(bad),
                len(local_blocks),
                h.req,
                first + bad[0],
            )
            return PullResult(False, nbytes, t2 - t0, "corrupt", verify_s[0])
        return PullResult(True, nbytes, t2 - t0, "", verify_s[0])

    @property
    def notices_agent(self) -> str:
        """Name of the NIXL agent decode's release notices leave from: one of their own, never the
        reading agent (a notice there held up the next read from that prefill)."""
        return self._notices.name

    def send_releases(self) -> None:
        """Tells each prefill whose blocks this worker read (or gave up on) since the last call that
        it may free them; an unreachable one frees them when their lease ends."""
        out, self._releases = self._releases, []
        for h in out:
            self._notices.notify(h, RELEASE + h.req.encode())

    def close(self) -> None:
        """Ends the agent and removes the source file (a restarted engine writes its own)."""
        if self._closed:
            return
        self._closed = True
        self._table[:] = 0  # a decode still reading this worker's memory fails its check from now on
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self._notices.close()
        self.agent.close()
