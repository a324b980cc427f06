"""One NIXL agent per worker over KV tensors (one per layer, registered once): the engine's paged
KV for the disaggregation handover (integrations/disagg), a worker's host tier for peer pulls
(core/peer). A reader READs blocks from the other agent's registered memory: UCX picks the fastest
transport the two processes share (shared memory or TCP here; RDMA, NVLink or CUDA IPC on GPU
nodes), with the same descriptors. Both sides' KV is prepared once as a NIXL descriptor list with
one descriptor per (layer, block) -- the local one at start, a peer's on its first handover -- so a
pull is one ``make_prepped_xfer`` with two index arrays. The reference engine's lease release
rides on the read as its completion notification; the vLLM connector's leaves after the step from
a ``Notifier`` (below). Requests are serialized per agent (NIXL 1.5.1 crashed with two
threads driving one agent, see transfer/nixl_mover.py)."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.transfer.nixl_errors import HandoverCorrupt, HandoverFailed, HandoverRefused, ReadNotCancelled

log = logging.getLogger(__name__)

SETTLE_S = 10.0  # a read NIXL refused to cancel gets this long to end by itself (UCX fails reads of a dead peer)
_ucx_agents = 0  # agents with a UCX backend this process created
_STILL_WRITTEN: list[Any] = []  # local memory of reads NIXL could not cancel (ReadNotCancelled): never freed


def ucx_agents_created() -> int:
    """Agents with a UCX backend this process created: once there is one, the process must end
    past NIXL's libnl (``exit_past_libnl``)."""
    return _ucx_agents


class KVSource(Protocol):
    """What a read or a notice needs of the prefill worker: its agent and where its KV is
    (HandoverParams, or the vLLM connector's VllmHandover; a ``digest_addr`` where it has one)."""

    @property
    def agent(self) -> str: ...
    @property
    def metadata(self) -> str | None: ...
    @property
    def layer_addrs(self) -> list[int]: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def mem(self) -> str: ...
    @property
    def dev(self) -> int: ...


@contextlib.contextmanager
def exit_past_libnl() -> Iterator[None]:
    """Wraps a process's main work. NIXL 1.5.1's UCX plugin bundles a libnl whose exit-time
    destructor crashes (SIGSEGV in rtnl_tc_unregister) in any process that created a UCX backend,
    which would turn a clean shutdown into a failure. Once such a backend exists, the process ends
    with os._exit and the exit code the work earned, after flushing logs and streams."""
    code = 0
    try:
        yield
    except SystemExit as e:
        if not _ucx_agents:
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        if not _ucx_agents:
            raise
        traceback.print_exc()
        code = 1
    if _ucx_agents:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def pack_metadata(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def unpack_metadata(text: str) -> bytes:
    try:
        return zlib.decompress(base64.b64decode(text))
    except (ValueError, zlib.error) as e:
        raise HandoverRefused(f"NIXL agent metadata does not decode: {e}") from None


def block_checksums(layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> list[int]:
    """One xxh3_64 per block over all its layers: the native xxh3 the SSD tier checks its blocks
    with, over each (layer, block) span, then over those per-layer digests (LE u64, layer order).
    Device tensors are gathered to host first."""
    return kv_block_checksums(layers, blocks).tolist()  # Python ints, as the payload carries them


def kv_block_checksums(layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> np.ndarray:
    """``block_checksums`` as a uint64 array. Host KV is hashed in place by one native call
    (GIL released, block-major; measured here, a 2 MiB handover's verify went from 0.25 to 0.17 ms
    and an 8 MiB one's from 0.69 to 0.47 ms against one call per layer); device KV is gathered to
    host first."""
    n = len(blocks)
    if not n:
        return np.empty(0, dtype=np.uint64)
    if not layers or layers[0].dim() < 1:
        raise ValueError("block checksums need at least one KV tensor of [blocks, ...]")
    t = layers[0]
    # The native call reads raw memory: every layer the same shape (block count included), and
    # integer ids inside it, or it would read past a layer's end.
    if any(x.shape != t.shape or x.dtype != t.dtype or x.device != t.device or not x.is_contiguous() for x in layers):
        raise ValueError("every layer's KV tensor must be contiguous with the same shape, dtype and device")
    ids = np.asarray(blocks)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be a flat sequence of integers, got {ids.dtype} of shape {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) >= t.shape[0]:
        raise ValueError(f"block ids must be in [0, {t.shape[0]})")
    ids = ids.astype(np.int64)
    if t.is_cuda:
        index = torch.as_tensor(ids, device=t.device)
        layers = [x[index].cpu() for x in layers]
        ids = np.arange(n, dtype=np.int64)
    bb = layers[0][0].nbytes
    addrs = np.fromiter((x.data_ptr() for x in layers), dtype=np.uint64, count=len(layers))
    return _native.kv_block_checksums(addrs, bb, ids.astype(np.uint64))


@dataclass
class _Peer:
    metadata: str  # the agent metadata it was added with
    layout: tuple[Any, ...] | None = None  # what ``dlist`` describes: layer addresses, block bytes, blocks, mem, dev
    dlist: Any = None  # its KV prepared as one descriptor per (layer, block)
    offsets: list[int] = field(default_factory=list)  # _layer_offsets of ``dlist``
    digest_dlist: Any = None  # its digest table, one 8-byte descriptor per block (enable_digests)
    digest_base: int | None = None  # host KV: the same rows at the end of ``dlist`` too, from here


def _block_rows(addrs: Sequence[int], block_bytes: int, num_blocks: int, dev: int) -> np.ndarray:
    """NIXL's strided form (address, length, device, stride, count): each layer's row expands to
    one descriptor per block, so preparing a whole KV cache takes one row per layer."""
    return np.array([(a, block_bytes, dev, block_bytes, num_blocks) for a in addrs], dtype=np.uint64)


def _layer_offsets(layers: int, num_blocks: int) -> list[int]:
    """Index of each layer's first descriptor in a prepared list (layer-major: block b of layer l
    is descriptor l * num_blocks + b; a digest table's rows may follow the last layer's); adding
    block ids gives a pull's indices, and local index i pairs with remote index i, so NIXL merges
    descriptors adjacent on both sides into one."""
    if (layers + 1) * num_blocks >= 2**31:
        raise ValueError(f"{layers} layers x {num_blocks} blocks exceed NIXL's 32-bit descriptor indices")
    return [layer * num_blocks for layer in range(layers)]


def _indices(offsets: list[int], blocks: Sequence[int]) -> list[int]:
    # A list, not numpy: measured here, building two small arrays right after a multi-MB read cost
    # ~0.1 ms per pull, the list ~0.02 ms (a short prompt's whole read is ~1 ms).
    return [o + b for o in offsets for b in blocks]


class Notifier:
    """A NIXL agent of its own that only sends notifications (a decode worker's lease releases),
    so the agent that READs the KV never carries one. Measured in bench disagg --vllm on this
    host: a release sent on the reading agent's endpoint left the next READ from that prefill
    worker in progress for 5-15 ms (a 2 MiB read that otherwise completes in 0.3 ms, inline); sent
    from this agent, no read waited. Created with its first notice."""

    def __init__(self, name: str, backend: str = "UCX") -> None:
        self.name, self.backend = name, backend
        self.agent: Any = None
        self._peers: dict[str, str] = {}  # remote agent name -> the metadata it was added with
        self._lock = threading.Lock()
        self._closed = False

    def notify(self, p: KVSource, message: bytes) -> bool:
        """Sends ``message`` to ``p.agent``; False when it cannot (unreachable or gone: the
        receiver's lease then ends by timeout), or after close."""
        from dynamo_flexkv.core.transfer.nixl_agents import new_agent

        with self._lock:
            if self._closed:
                return False
            try:
                if self.agent is None:
                    global _ucx_agents
                    self.agent = new_agent(self.name, [self.backend])
                    _ucx_agents += 1
                known = self._peers.get(p.agent)
                if known is not None and p.metadata is not None and known != p.metadata:
                    self._drop(p.agent)
                    known = None
                if known is None:
                    if p.metadata is None:
                        return False
                    self.agent.add_remote_agent(unpack_metadata(p.metadata))
                    self._peers[p.agent] = p.metadata
                self.agent.send_notif(p.agent, message)
                return True
            except HandoverRefused:
                return False
            except Exception:  # noqa: BLE001 - NIXL's own types: unknown or unreachable agent
                self._drop(p.agent)
                return False

    def _drop(self, agent_name: str) -> None:
        if self._peers.pop(agent_name, None) is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for name in list(self._peers):
                self._drop(name)


class KVAgent:
    def __init__(self, layers: Sequence[torch.Tensor], name: str = "", backend: str = "UCX") -> None:
        from dynamo_flexkv.core.transfer.nixl_agents import ProgressDelayError, new_agent

        self.layers = list(layers)
        t = self.layers[0]
        if any(x.shape != t.shape or x.dtype != t.dtype or not x.is_contiguous() for x in self.layers):
            raise ValueError(
                "KVAgent: every layer's KV tensor must be contiguous with the same shape and dtype "
                "(block i of a layer at offset i * block bytes)"
            )
        self.block_bytes = t[0].nbytes
        self.num_blocks = t.shape[0]
        self.mem = "VRAM" if t.is_cuda else "DRAM"
        self.dev = (t.device.index or 0) if t.is_cuda else 0
        self.name = name or f"flexkv-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = new_agent(self.name, [backend])
        except ProgressDelayError:  # our own setting: its message names it
            raise
        except Exception as e:  # NIXL's own exception types
            raise HandoverFailed(f"NIXL {backend} backend unavailable: {e}") from e
        global _ucx_agents
        _ucx_agents += 1
        if backend not in self.agent.backends:
            raise HandoverFailed(f"NIXL could not create its {backend} backend on this machine")
        self.agent.register_memory([(x.data_ptr(), x.nbytes, self.dev, "") for x in self.layers], self.mem)
        self._offsets = _layer_offsets(len(self.layers), self.num_blocks)
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _block_rows([x.data_ptr() for x in self.layers], self.block_bytes, self.num_blocks, self.dev),
            self.mem,
        )
        self._lock = threading.Lock()
        self._metadata = pack_metadata(self.agent.get_agent_metadata())
        self._peers: dict[str, _Peer] = {}  # remote agent name -> what this agent holds of it
        self.digests: torch.Tensor | None = None  # enable_digests
        self.landed: torch.Tensor | None = None
        self._landed_dlist: Any = None
        self._landed_base: int | None = None  # host KV: ``landed``'s rows at the end of ``_local``
        self.bytes_pulled = 0
        self.pulls = 0
        self.uncancelled = 0  # reads NIXL could not cancel that outlived SETTLE_S (ReadNotCancelled)
        self._uncancelled: list[Any] = []

    @property
    def metadata(self) -> str:
        return self._metadata

    def verify(self, p: Any, first: int, local_blocks: Sequence[int]) -> None:
        """Raises HandoverCorrupt unless the local blocks (just read for ``p.blocks[first:]``) hash
        to the prefill worker's checksums."""
        want = p.checksums[first : first + len(local_blocks)]
        got = block_checksums(self.layers, local_blocks)
        bad = [first + i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        if bad:
            raise HandoverCorrupt(
                f"{len(bad)} of {len(local_blocks)} blocks read from {p.agent} fail their "
                f"checksum (first: prompt block {bad[0]}, prefill block {p.blocks[bad[0]]})"
            )

    def check_compatible(self, p: KVSource) -> None:
        if len(p.layer_addrs) != len(self.layers) or p.block_bytes != self.block_bytes:
            raise HandoverRefused(
                f"the prefill worker's KV layout ({len(p.layer_addrs)} layers x {p.block_bytes} "
                f"bytes per block) differs from this worker's ({len(self.layers)} x "
                f"{self.block_bytes}): serve the same model on both roles"
            )

    def _connect(self, p: KVSource, prep: bool = True) -> _Peer:
        """The peer, added once (and again only if it comes with other metadata); its KV
        descriptors prepared once per layout (``prep``: the reads need them, a notice does not)."""
        peer = self._peers.get(p.agent)
        if peer is not None and p.metadata is not None and p.metadata != peer.metadata:
            self._forget(p.agent)
            peer = None
        if peer is None:
            if p.metadata is None:
                raise HandoverFailed(f"no NIXL metadata for prefill agent {p.agent}")
            self.agent.add_remote_agent(unpack_metadata(p.metadata))
            peer = self._peers[p.agent] = _Peer(p.metadata)
        layout = (tuple(p.layer_addrs), p.block_bytes, p.num_blocks, p.mem, p.dev, getattr(p, "digest_addr", 0))
        if prep and peer.layout != layout:
            if peer.dlist is not None:
                self.agent.release_dlist_handle(peer.dlist)
                peer.dlist = peer.layout = None
            peer.offsets = _layer_offsets(len(p.layer_addrs), p.num_blocks)
            if peer.digest_dlist is not None:
                self.agent.release_dlist_handle(peer.digest_dlist)
                peer.digest_dlist = None
            rows = _block_rows(p.layer_addrs, p.block_bytes, p.num_blocks, p.dev)
            digest_addr = int(getattr(p, "digest_addr", 0))  # a KVSource with a digest table has one
            digest_rows = _block_rows([digest_addr], 8, p.num_blocks, 0) if digest_addr else None
            # Host KV: the digest table in the same list (a read of blocks and digests is then one
            # transfer: one post and one poll fewer per handover, ~5% of a 2 MiB read's CPU).
            peer.digest_base = (
                len(p.layer_addrs) * p.num_blocks if digest_rows is not None and p.mem == "DRAM" else None
            )
            if peer.digest_base is not None:
                rows = np.concatenate([rows, digest_rows])
            peer.dlist = self.agent.prep_xfer_dlist(p.agent, rows, p.mem)
            if digest_rows is not None:  # for a reader whose own table is not in its KV's list (GPU KV)
                peer.digest_dlist = self.agent.prep_xfer_dlist(p.agent, digest_rows, "DRAM")
            peer.layout = layout
        return peer

    def pull(
        self,
        p: KVSource,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        timeout: float,
        notif: bytes = b"",
        digests: bool = False,
        landed: Callable[[int, int], None] | None = None,
        chunks: int = 1,
    ) -> int:
        """READs the remote blocks into the local ones, every layer; returns bytes moved. ``notif``
        reaches the prefill agent once the read is done (only then). With ``digests`` the peer's
        digest of ``remote_blocks[i]`` (``p.digest_addr``'s table) lands in ``self.landed[i]`` by
        the same time (see ``enable_digests``; read it before the agent's next pull). ``chunks`` splits
        the read into that many reads of
        consecutive blocks, all posted at once; ``landed(start, end)`` is called for each chunk of
        ``local_blocks[start:end]`` once its bytes (and the digests) are here, in order, while the
        later chunks still move (a verify overlaps the transfer); whatever it raises is raised
        once every chunk is over. Raises HandoverFailed on any failure or after ``timeout`` seconds
        (the local blocks then hold garbage and must be recomputed; ``notif`` was not sent)."""
        n = len(local_blocks)
        if len(remote_blocks) != n:
            raise ValueError("pull: remote and local block lists differ in length")
        if not n:
            return 0
        # Plain min/max and one small array per side: a pull's fixed cost is what a short prompt pays.
        if min(local_blocks) < 0 or max(local_blocks) >= self.num_blocks:
            raise ValueError(f"pull: local block ids must be in [0, {self.num_blocks})")
        if min(remote_blocks) < 0 or max(remote_blocks) >= p.num_blocks:
            raise HandoverRefused(f"handover names a block outside the prefill worker's {p.num_blocks}")
        nbytes = n * self.block_bytes * len(self.layers)
        if digests and (self.landed is None or not getattr(p, "digest_addr", 0)):
            raise HandoverRefused(
                "pull with digests: this agent has no digest tables (enable_digests) or the "
                "handover names no digest table"
            )
        if digests and n > self.num_blocks:
            raise ValueError(f"pull with digests: {n} blocks exceed the landed table's {self.num_blocks}")
        chunks = max(1, min(chunks, n))
        bounds = [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)]
        with self._lock:
            handles = []
            try:
                peer = self._connect(p)
                # Digests in the first chunk's own transfer when both tables sit in the KV's lists
                # (host KV), else in a transfer of their own: handle 0, posted first only when a KV
                # read carries a notice (below).
                inline = digests and peer.digest_base is not None and self._landed_base is not None
                if digests and not inline:
                    handles.append(
                        self.agent.make_prepped_xfer(
                            "READ", self._landed_dlist, list(range(n)), peer.digest_dlist, list(remote_blocks), b""
                        )
                    )
                for i, (a, b) in enumerate(bounds):
                    local, remote = (
                        _indices(self._offsets, local_blocks[a:b]),
                        _indices(peer.offsets, remote_blocks[a:b]),
                    )
                    if inline and i == 0:  # after the chunk's KV: over shared memory, read after it
                        assert self._landed_base is not None and peer.digest_base is not None  # ``inline``
                        local += range(self._landed_base, self._landed_base + n)
                        remote += [peer.digest_base + x for x in remote_blocks]
                    handles.append(
                        self.agent.make_prepped_xfer(
                            "READ", self._local, local, peer.dlist, remote, notif if i == chunks - 1 else b""
                        )
                    )
            except HandoverRefused:
                self._release(handles)
                raise
            except Exception as e:  # NIXL raises its own types for an unknown or unreachable agent
                self._release(handles)
                self._forget(p.agent)
                raise HandoverFailed(f"NIXL could not start a read from {p.agent}: {e}") from e
            raised: BaseException | None = None
            try:
                # The digests' read goes last unless the notice rides the last KV chunk: posted after
                # the KV (copied inline over shared memory) it too completed inline, where posted
                # first it stayed in flight and cost the engine step another poll (bench disagg --vllm).
                order = list(range(len(handles)))
                head = 1 if digests and not inline else 0  # the KV chunks' handles start here
                if head and not notif:
                    order = order[1:] + order[:1]
                states = [""] * len(handles)
                for k in order:
                    states[k] = self.agent.transfer(handles[k])
                deadline = time.monotonic() + timeout
                seen = 0  # chunks handed to ``landed``
                while True:
                    states = [s if s != "PROC" else self.agent.check_xfer_state(h) for h, s in zip(handles, states)]
                    if any(s not in ("PROC", "DONE") for s in states):
                        raise HandoverFailed(f"NIXL read of {nbytes} bytes from {p.agent} failed ({states})")
                    while (
                        landed is not None
                        and raised is None
                        and seen < chunks
                        and states[head + seen] == "DONE"
                        and states[0] == "DONE"
                    ):
                        try:
                            landed(*bounds[seen])
                        except BaseException as e:  # noqa: BLE001 - raised once every chunk is over
                            raised = e
                        seen += 1
                    if "PROC" not in states:
                        break
                    if time.monotonic() > deadline:
                        raise HandoverFailed(
                            f"NIXL read of {nbytes} bytes from {p.agent} still running after {timeout:.1f} s"
                        )
                    time.sleep(0)  # other Python threads run while UCX moves the bytes
            except HandoverFailed:
                self._forget(p.agent)
                raise
            except Exception as e:
                self._forget(p.agent)
                raise HandoverFailed(f"NIXL read from {p.agent} failed: {e}") from e
            finally:
                stuck = self._settle(self._release(handles))
                if stuck:  # raised over whatever ended the read: these blocks are not the caller's to reuse
                    self.uncancelled += len(stuck)
                    self._uncancelled.extend(stuck)  # released at close(), if NIXL lets us by then
                    _STILL_WRITTEN.append(self.layers)  # the memory stays mapped while the process lives
                    raise ReadNotCancelled(
                        f"NIXL refused to cancel {len(stuck)} read(s) from {p.agent} that did not end within "
                        f"{SETTLE_S:.0f} s: local blocks {list(local_blocks)[:8]}... may still be written",
                        local_blocks,
                    )
        if raised is not None:
            raise raised
        self.bytes_pulled += nbytes
        self.pulls += 1
        return nbytes

    def _release(self, handles: list[Any]) -> list[Any]:
        """Releases the handles (NIXL cancels a transfer still running); returns those it refused:
        a transfer NIXL could not cancel may still write."""
        refused = []
        for h in handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - NIXL's own types
                refused.append(h)
        return refused

    def _settle(self, handles: list[Any]) -> list[Any]:
        """Waits up to SETTLE_S for transfers NIXL refused to cancel to end by themselves (done,
        or failed as UCX gives up on a dead peer), releasing each that does; returns those still
        running: their local blocks may yet be written."""
        deadline = time.monotonic() + SETTLE_S
        while handles:
            running = []
            for h in handles:
                try:
                    over = self.agent.check_xfer_state(h) != "PROC"
                except Exception:  # noqa: BLE001 - a state NIXL cannot tell: assume it may still write
                    over = False
                if over:
                    self._release([h])  # refused again: the handle leaks, the transfer writes nothing more
                else:
                    running.append(h)
            handles = running
            if not handles or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if handles:
            log.error("NIXL: %d read(s) could not be cancelled and still run after %.0f s", len(handles), SETTLE_S)
        return handles

    def enable_digests(self) -> None:
        """Two tables of one u64 per block, registered with NIXL (host memory, whatever the KV's
        device): ``digests`` holds this worker's checksum of each of its blocks, written by the
        prefill side once a block's bytes are final, and read by a decode worker beside the blocks;
        ``landed`` receives a peer's digests in a pull, in the pull's block order (entry i: the
        pull's i-th block), so a check reads them as one contiguous run."""
        if self.digests is not None:
            return
        self.digests = torch.zeros(self.num_blocks, dtype=torch.int64)
        self.landed = torch.zeros(self.num_blocks, dtype=torch.int64)
        with self._lock:
            self.agent.register_memory([(t.data_ptr(), t.nbytes, 0, "") for t in (self.digests, self.landed)], "DRAM")
            landed_rows = _block_rows([self.landed.data_ptr()], 8, self.num_blocks, 0)
            self._landed_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", landed_rows, "DRAM")
            if self.mem == "DRAM":  # host KV: also at the end of the KV's own list (pull's inline digests)
                local = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    np.concatenate(
                        [
                            _block_rows(
                                [x.data_ptr() for x in self.layers], self.block_bytes, self.num_blocks, self.dev
                            ),
                            landed_rows,
                        ]
                    ),
                    self.mem,
                )
                self.agent.release_dlist_handle(self._local)
                self._local, self._landed_base = local, len(self.layers) * self.num_blocks
            self._metadata = pack_metadata(self.agent.get_agent_metadata())  # peers must see the tables

    @property
    def digest_addr(self) -> int:
        return self.digests.data_ptr() if self.digests is not None else 0

    def notify(self, p: KVSource, message: bytes) -> bool:
        """A standalone notification to the prefill agent (the lease release); False when it is
        unreachable (dead: its leases died with it; alive: the lease ends by timeout)."""
        with self._lock:
            try:
                self._connect(p, prep=False)
                self.agent.send_notif(p.agent, message)
                return True
            except HandoverRefused:
                return False
            except Exception:  # noqa: BLE001 - NIXL's own types: unknown or unreachable agent
                self._forget(p.agent)
                return False

    def notifications(self) -> list[bytes]:
        with self._lock:
            got = self.agent.get_new_notifs()
        return [m for msgs in got.values() for m in msgs]

    def _forget(self, agent_name: str) -> None:
        """Drops a peer after a failure so the next handover from it reconnects from scratch."""
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        with contextlib.suppress(Exception):  # its descriptors or the agent itself may be gone already
            if peer.dlist is not None:
                self.agent.release_dlist_handle(peer.dlist)
        with contextlib.suppress(Exception):
            if peer.digest_dlist is not None:
                self.agent.release_dlist_handle(peer.digest_dlist)
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        with self._lock:
            self._uncancelled = self._release(self._uncancelled)
            for name in list(self._peers):
                self._forget(name)
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(self._local)
            with contextlib.suppress(Exception):
                if self._landed_dlist is not None and self.digests is not None and self.landed is not None:
                    self.agent.release_dlist_handle(self._landed_dlist)
                    self.agent.deregister_memory(
                        self.agent.get_reg_descs(
                            [(t.data_ptr(), t.nbytes, 0, "") for t in (self.digests, self.landed)], "DRAM"
                        )
                    )
            try:
                self.agent.deregister_memory(
                    self.agent.get_reg_descs([(x.data_ptr(), x.nbytes, self.dev, "") for x in self.layers], self.mem)
                )
            except Exception:  # noqa: BLE001 - closing: NIXL's own types; memory never registered, or the agent gone
                pass
