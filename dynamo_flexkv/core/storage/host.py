"""Host tier memory: one page-aligned pool allocated once, pinned when CUDA exists, and the
checksum of each block's bytes taken when they landed (reused by every write of the block)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Sequence

import numpy as np
import torch

from dynamo_flexkv.core import native as _native
from dynamo_flexkv.core.layout import KVLayout

log = logging.getLogger(__name__)

_MAP_HUGETLB = 0x40000
_HUGE_PAGE = 2 << 20


class HostPool:
    """``layout.num_blocks`` blocks in ``layout`` (BLOCKFIRST by default) in one anonymous mapping.

    Page alignment makes every block usable for O_DIRECT disk I/O; pinning (cudaHostRegister)
    makes host<->device copies asynchronous DMA.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        use_huge_pages: bool = False,
        pin: bool | None = None,
        share: bool = False,
        shared_fd: int | None = None,
    ) -> None:
        """``share``: a shared-memory segment (memfd) whose descriptor ``fd`` other processes map
        with ``shared_fd`` (the node cache's engines); the segment lives while any mapping does."""
        self.layout = layout
        self.nbytes = layout.total_bytes
        self.huge_pages = False
        self.fd: int | None = None
        self._mm = None
        if share or shared_fd is not None:
            self._mm = self._map_shared(share, shared_fd)
        elif use_huge_pages:
            size = -(-self.nbytes // _HUGE_PAGE) * _HUGE_PAGE
            try:
                self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
                self.huge_pages = True
            except OSError as e:
                log.warning("host pool: huge pages unavailable (%s); using normal pages", e.strerror)
        if self._mm is None:
            self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if not self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:  # transparent huge pages: fewer TLB misses in gathers (shared memory: where the kernel allows)
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)
        # xxh3_64 of each slot's bytes, known from when they landed: the D2H copy hashes what it
        # copies, disk and remote reads verify theirs. Disk and remote writes reuse it instead of
        # hashing the block again. Every path that writes a slot forgets its checksum before the
        # first byte moves (a failed or partial write leaves it unknown), so a reused slot never
        # carries the previous block's checksum; an unknown one is hashed by the writer that needs it.
        self._sums = np.zeros(layout.num_blocks, dtype=np.uint64)
        self._sum_known = np.zeros(layout.num_blocks, dtype=np.bool_)
        self.pinned = False
        if pin if pin is not None else torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.base, len(self._mm), 0)
            self.pinned = int(err) == 0
            if not self.pinned:
                log.warning("host pool: cudaHostRegister failed (%s); copies will be synchronous", err)

    def _map_shared(self, create: bool, fd: int | None) -> mmap.mmap:
        if create:
            fd = os.memfd_create("flexkv-host-tier", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.nbytes)
            except OSError:
                os.close(fd)
                raise
            self.fd = fd
        elif fd is None:
            raise ValueError("attaching to a shared host segment needs its descriptor (shared_fd)")
        size = os.fstat(fd).st_size
        if size < self.nbytes:
            raise ValueError(f"shared host segment of {size} bytes is smaller than the tier's {self.nbytes}")
        # Mapping another process's segment (an engine attaching to the node cache): its page
        # tables filled now, not by faults inside the first loads of a freshly started engine.
        populate = 0 if create else getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def block_addrs(self, block_ids: np.ndarray) -> np.ndarray:
        """Start address of each whole block (BLOCKFIRST) for disk I/O."""
        self.check_ids(block_ids)
        return (self.base + np.asarray(block_ids, dtype=np.uint64) * np.uint64(self.layout.block_bytes)).astype(
            np.uint64
        )

    def forget_checksums(self, block_ids: np.ndarray | Sequence[int]) -> None:
        """Called before anything writes these slots: their bytes are about to change."""
        self._sum_known[np.asarray(block_ids, dtype=np.int64)] = False

    def record_checksums(self, block_ids: np.ndarray, sums: np.ndarray | Sequence[int]) -> None:
        """The xxh3_64 of the bytes that just landed in these slots (hashed or verified by the
        path that wrote them, after its last byte landed)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        self._sums[ids] = np.asarray(sums, dtype=np.uint64)
        self._sum_known[ids] = True

    def known_checksums(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(checksums, known) of these slots; a checksum is meaningful only where known."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return self._sums[ids], self._sum_known[ids]

    def checksums(self, block_ids: np.ndarray) -> np.ndarray:
        """xxh3_64 of each slot's bytes, for a writer that copies them out (disk, remote): the
        recorded ones, and the unknown ones hashed now (natively, GIL released) and recorded.
        The caller must hold the blocks immutable (locked as a write's sources)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        self.check_ids(ids)
        sums, known = self._sums[ids], self._sum_known[ids]
        if not known.all():
            missing = ids[~known]
            bb = self.layout.block_bytes
            sums[~known] = got = _native.checksums(self.base, missing.astype(np.uint64) * np.uint64(bb), bb)
            self.record_checksums(missing, got)
        return sums

    def check_ids(self, block_ids: np.ndarray) -> None:
        ids = np.asarray(block_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError(f"host block id out of range [0, {self.num_blocks}): {ids.min()}..{ids.max()}")

    def close(self) -> None:
        if self._mm is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
        del self.array
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if self.fd is not None:
            os.close(self.fd)  # engines that mapped the segment keep it until they unmap it
            self.fd = None
