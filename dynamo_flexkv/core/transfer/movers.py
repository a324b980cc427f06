"""Movers: how bytes move on each link. Each reports bytes moved; errors raise.

* HostDeviceMover  D2H / H2D between the engine's tensors and the host pool. On CPU tensors one
  native multi-threaded gather/scatter of (block, layer, kv) chunks; on CUDA, torch copies on a
  dedicated stream that waits for the engine's writes and never blocks the engine's stream.
* HostHasher       HASH: a put's checksums of the host blocks its D2H just filled, recorded in
  the host pool for the blocks' disk and remote writes (after the D2H, so the engine's put does
  not wait for it; hashing inside the gather measured 0.74 of a contiguous copy at 128 KiB
  blocks against 0.93 for the plain gather, on CPU tensors where the copy itself is CPU work).
* DiskMover        H2DISK / DISK2H between the host pool and the block files: native batches
  (io_uring, or a pread/pwrite pool), GIL released. A write journals the checksums the host pool
  already holds (hashing, inside the batch, only blocks whose checksum is unknown); a read
  verifies every block inside the batch as soon as its own I/O completes, while the rest are in
  flight (a pass after each part's I/O left ~0.1-0.2 of the read link exposed), and records the
  verified checksums on the host slots. Subclasses that move bytes their own way (NIXL) hash on a
  second thread while their I/O is in flight.

Checksum once: every path that writes host slots forgets their checksums before the first byte
moves and records them only after the last one landed and was hashed or verified, so a slot
reused for another block never carries the old block's checksum (and a wrong one could only make
a read refuse good bytes: every read verifies).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.layout import KVLayoutType
from dynamo_flexkv.core.storage.device import TORCH_DTYPES, DeviceCache
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import SsdStore
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp


class ChecksumError(IOError, FlexKVError):
    """Bytes read back differ from the bytes written: the disk block is torn or was overwritten."""

    def __init__(self, disk_ids: np.ndarray) -> None:
        self.disk_ids = [int(b) for b in disk_ids]
        super().__init__(
            f"checksum mismatch on disk blocks {self.disk_ids[:8]}"
            f"{'...' if len(self.disk_ids) > 8 else ''}: refusing to load them"
        )


MAX_COPY_THREADS = 4


def copy_threads() -> int:
    """Threads of a CPU block copy: up to MAX_COPY_THREADS, never more than the cores this process
    may run on (on 2 cores, 4 threads copied 128 KiB blocks at 20-21 GB/s and 2 threads at 23)."""
    return max(1, min(MAX_COPY_THREADS, len(os.sched_getaffinity(0))))


SHORT_RUN_BYTES = 64 << 10  # a block's K and V in one layer below this: copied in the device's order


class HostDeviceMover:
    def __init__(self, host: HostPool, device: DeviceCache, threads: int | None = None) -> None:
        if host.layout.type is not KVLayoutType.BLOCKFIRST:
            raise ValueError("the host pool must be BLOCKFIRST for device copies")
        self.host, self.device = host, device
        self.threads = copy_threads() if threads is None else threads
        self.cuda = device.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device.device)
            m = host.layout.model
            flat = torch.frombuffer(host.array, dtype=TORCH_DTYPES[m.dtype])
            self.host_blocks = flat.view(
                host.num_blocks, m.num_layers, m.kv_dim, host.layout.tokens_per_block, m.num_kv_heads, m.head_size
            )

    def run(self, op: TransferOp) -> int:
        to_host = op.kind is OpKind.D2H
        dev_ids, host_ids = (op.src, op.dst) if to_host else (op.dst, op.src)
        self.device.check_ids(dev_ids)
        self.host.check_ids(host_ids)
        m = self.host.layout.model
        lo, hi = op.layers or (0, m.num_layers)
        if to_host:
            self.host.forget_checksums(host_ids)  # new bytes: a put's HASH op records them
        # A load's write passes its fence: after a cancel it raises CopyFenced before any byte moves.
        fence = op.fence.writing() if op.fence is not None and not to_host else contextlib.nullcontext()
        with fence:
            if self.cuda:
                self._cuda_copy(dev_ids, host_ids, lo, hi, to_host, op.after)
            else:
                self._cpu_copy(dev_ids, host_ids, lo, hi, to_host)
        return int(dev_ids.size) * (hi - lo) * self.host.layout.layer_block_bytes

    def _cpu_copy(self, dev_ids: np.ndarray, host_ids: np.ndarray, lo: int, hi: int, to_host: bool) -> None:
        """One native call: chunk addresses are generated there (K and V of a block stay
        neighbours, so they merge), in the device's order (layer by layer, blocks ascending) except
        for host->device copies of long runs, read in the BLOCKFIRST host's order (block by block).
        Measured on 512 MiB of random blocks (A/B rounds, three processes), against a contiguous
        copy: device->host 16 KiB runs 0.85-0.89 either way, 64 KiB runs 0.94-0.97 in device order
        against 0.86-0.88; host->device 16 KiB runs 0.93-0.97 in device order against 0.87-0.90,
        64 KiB runs 0.93-0.94 against 0.96-0.99 in host order."""
        hl = self.host.layout
        device_order = to_host or hl.model.kv_dim * hl.chunk_bytes < SHORT_RUN_BYTES
        order = np.argsort(dev_ids if device_order else host_ids, kind="stable")
        dev = (*self.device.chunk_grid(lo, hi), dev_ids[order].astype(np.uint64))
        sb, sl, sk = hl.strides()
        host_base = np.uint64(self.host.base) + np.arange(lo, hi, dtype=np.uint64) * np.uint64(sl)
        hst = (host_base, int(sb), int(sk), host_ids[order].astype(np.uint64))
        (db, dsb, dsk, dids), (sbase, ssb, ssk, sids) = (hst, dev) if to_host else (dev, hst)
        _native.copy_kv_grid(
            db,
            dids,
            dsb,
            dsk,
            sbase,
            sids,
            ssb,
            ssk,
            hl.model.kv_dim,
            hl.chunk_bytes,
            block_major=not device_order,
            threads=self.threads,
        )

    def _cuda_copy(
        self, dev_ids: np.ndarray, host_ids: np.ndarray, lo: int, hi: int, to_host: bool, after: Any
    ) -> None:
        dev = self.device.device
        dev_idx = torch.as_tensor(dev_ids, device=dev)
        host_idx = torch.as_tensor(host_ids)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for layer in range(lo, hi):
                dview = self.device.block_tensor(layer)
                hview = self.host_blocks[:, layer]
                staging = torch.empty((len(host_ids), *hview.shape[1:]), dtype=hview.dtype, pin_memory=True)
                if to_host:
                    staging.copy_(dview.index_select(0, dev_idx), non_blocking=True)
                    self.stream.synchronize()
                    hview.index_copy_(0, host_idx, staging)
                else:
                    torch.index_select(hview, 0, host_idx, out=staging)
                    dview.index_copy_(0, dev_idx, staging.to(dev, non_blocking=True))
            self.stream.synchronize()


class HostHasher:
    """HASH: records the checksums of host blocks whose bytes just landed (a put's D2H), once,
    for every later write of them (disk journal, Redis header). Already known ones are kept."""

    def __init__(self, host: HostPool) -> None:
        self.host = host

    def run(self, op: TransferOp) -> int:
        self.host.checksums(op.src)
        return int(op.src.size) * self.host.layout.block_bytes


class DiskMover:
    # Subclasses' verified reads are split into parts of about this many bytes so part k is
    # hashed while part k+1 is read; each part still fills the I/O queue.
    READ_PART_BYTES = 32 << 20
    MAX_READ_PARTS = 8

    def __init__(
        self, host: HostPool, ssd: SsdStore, depth: int = 512, use_uring: bool | None = None, threads: int = 8
    ) -> None:
        if host.layout.block_bytes != ssd.block_bytes:
            raise ValueError("host and disk blocks differ in size")
        self.host, self.ssd, self.depth, self.threads = host, ssd, depth, threads
        self.use_uring = _native.uring_available() if use_uring is None else use_uring
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="flexkv-disk-hash")

    def run(self, op: TransferOp) -> int:
        """H2DISK: whole blocks, checksummed first. DISK2H: whole blocks, verified after; with
        ``op.layers`` only those layers' span of each block, verified later by a VERIFY op."""
        if op.kind is OpKind.VERIFY:
            self._verify(op.src, op.dst)
            return 0
        write = op.kind is OpKind.H2DISK
        host_ids, disk_ids = (op.src, op.dst) if write else (op.dst, op.src)
        offset, length = self.span(op.layers)
        if not write:
            self.host.forget_checksums(host_ids)
        if write:
            if op.layers is not None:  # the journal's checksums cover whole blocks
                raise ValueError("H2DISK writes whole blocks: op.layers must be None")
            op.result = self._write_hashed(host_ids, disk_ids)
        elif op.layers is None:
            self._read_verified(host_ids, disk_ids)
        else:
            self._transfer(host_ids, disk_ids, False, offset, length)
        return int(host_ids.size) * length

    def span(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """(offset, length) inside a BLOCKFIRST block of a layer range; whole block for None."""
        layout = self.host.layout
        if layers is None:
            return 0, layout.block_bytes
        lo, hi = layers
        return lo * layout.layer_block_bytes, (hi - lo) * layout.layer_block_bytes

    def _verify(self, disk_ids: np.ndarray, host_ids: np.ndarray) -> None:
        bad = self._mismatches(disk_ids, host_ids, record=True)
        if bad.size:
            raise ChecksumError(bad)

    def _mismatches(
        self, disk_ids: np.ndarray, host_ids: np.ndarray, got: np.ndarray | None = None, record: bool = False
    ) -> np.ndarray:
        """Disk ids whose bytes now in their host slots differ from what was written (``got``:
        those slots' checksums when already taken). ``record``: when all match, the host pool
        keeps them (the slots hold whole, verified blocks)."""
        got = self._checksums(host_ids) if got is None else got
        want = np.fromiter((self.ssd.checksum_of(int(d)) for d in disk_ids), dtype=np.uint64, count=disk_ids.size)
        bad = disk_ids[got != want]
        if record and not bad.size:
            self.host.record_checksums(host_ids, got)
        return bad

    def _hashes_in_batch(self) -> bool:
        """Whether ``_transfer`` is the native batch, which checksums each block as its I/O
        completes; a subclass moving bytes its own way hashes on the hasher thread instead."""
        return type(self)._transfer is DiskMover._transfer

    def _write_hashed(self, host_ids: np.ndarray, disk_ids: np.ndarray) -> np.ndarray:
        """Whole-block write; returns the blocks' checksums for the journal: the ones the host
        pool recorded when the bytes landed (no second hash), else taken now. The source host
        blocks are locked (immutable) for the whole op, so hashing them during or right after
        their own write gives the bytes that landed."""
        sums, known = self.host.known_checksums(host_ids)
        if known.all():
            self._transfer(host_ids, disk_ids, True)
            return sums
        if self._hashes_in_batch():
            got = self._transfer_hashed(host_ids, disk_ids, True)
            self.host.record_checksums(host_ids, got)
            return got
        hashing = self._hasher.submit(self.host.checksums, host_ids)
        try:
            self._transfer(host_ids, disk_ids, True)
        finally:
            got = hashing.result()  # the hasher is done with the host blocks before this raises
        return got

    def _read_verified(self, host_ids: np.ndarray, disk_ids: np.ndarray) -> None:
        """Whole-block read, verified. The native batch hashes each block as its read completes.
        Otherwise part k is hashed on the hasher thread while part k+1 is read, and every part's
        hashing has finished before this returns or raises, so no thread touches the host slots
        after a failed op rolled back."""
        if self._hashes_in_batch():
            got = self._transfer(host_ids, disk_ids, False, checksums=True)
            bad_ids = self._mismatches(disk_ids, host_ids, got, record=True)
            if bad_ids.size:
                raise ChecksumError(bad_ids)
            return
        total = int(host_ids.size) * self.host.layout.block_bytes
        parts = max(1, min(self.MAX_READ_PARTS, total // self.READ_PART_BYTES, int(host_ids.size)))
        pending: list[Future] = []
        try:
            for part in np.array_split(np.arange(host_ids.size), parts):
                self._transfer(host_ids[part], disk_ids[part], write=False)
                pending.append(self._hasher.submit(self._mismatches, disk_ids[part], host_ids[part], record=True))
        finally:
            bad = [f.result() for f in pending]
        bad_ids = np.concatenate(bad) if bad else np.zeros(0, dtype=np.int64)
        if bad_ids.size:
            raise ChecksumError(bad_ids)

    def _transfer(
        self,
        host_ids: np.ndarray,
        disk_ids: np.ndarray,
        write: bool,
        offset: int = 0,
        length: int | None = None,
        checksums: bool = False,
    ) -> np.ndarray | None:
        """Moves [offset, offset + length) of each block between host and disk slots: one batch.
        ``checksums``: also returns each moved span's xxh3_64, hashed as its I/O completes."""
        length = self.host.layout.block_bytes if length is None else length
        fds, offsets = self.ssd.locate(disk_ids)
        lens = np.full(host_ids.size, length, dtype=np.uint64)
        return _native.file_io(
            fds,
            offsets + np.uint64(offset),
            self.host.block_addrs(host_ids) + np.uint64(offset),
            lens,
            write,
            self.depth,
            self.use_uring,
            self.threads,
            checksums,
        )

    def _transfer_hashed(self, host_ids: np.ndarray, disk_ids: np.ndarray, write: bool) -> np.ndarray:
        """Whole blocks through the native batch, with each block's checksum (where _hashes_in_batch())."""
        sums = self._transfer(host_ids, disk_ids, write, checksums=True)
        if sums is None:
            raise RuntimeError(f"{type(self).__name__}: the disk batch returned no checksums though asked to")
        return sums

    def _checksums(self, host_ids: np.ndarray) -> np.ndarray:
        bb = self.host.layout.block_bytes
        return _native.checksums(self.host.base, host_ids.astype(np.uint64) * np.uint64(bb), bb)

    def read_for_adoption(self, disk_ids: np.ndarray, host_ids: np.ndarray) -> np.ndarray:
        """Reads disk blocks into host slots and returns their checksums (restart verification)."""
        self.host.forget_checksums(host_ids)
        if self._hashes_in_batch():
            return self._transfer_hashed(host_ids, disk_ids, False)
        self._transfer(host_ids, disk_ids, write=False)
        return self._checksums(host_ids)
