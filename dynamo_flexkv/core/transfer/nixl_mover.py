"""Host<->disk through NIXL: the POSIX backend on any machine, GDS_MT where CUDA and cuFile exist.

Same contract and checksums as DiskMover (it only replaces how the bytes move), so every disk
test runs against it too. Memory and files are registered once; each op is one NIXL request.
Requests are serialized per agent: NIXL 1.5.1's POSIX backend crashed (SIGSEGV in
check_xfer_state) with two transfer threads driving one agent at once.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.storage.ssd import SsdStore
from dynamo_flexkv.core.transfer.movers import DiskMover

_names = itertools.count()


class NixlError(IOError, FlexKVError):
    pass


class NixlDiskMover(DiskMover):
    def __init__(self, host: HostPool, ssd: SsdStore, gds: bool = False) -> None:
        super().__init__(host, ssd)
        from dynamo_flexkv.core.transfer.nixl_agents import ProgressDelayError, new_agent

        self.backend = "GDS_MT" if gds else "POSIX"
        self.name = f"flexkv-disk-{os.getpid()}-{next(_names)}"
        try:
            self.agent = new_agent(self.name, [self.backend])
        except ProgressDelayError:  # our own setting: its message names it
            raise
        except Exception as e:  # NIXL's own exception types
            raise NixlError(
                f"NIXL {self.backend} backend unavailable ({e}); set enable_nixl=false "
                "(and enable_gds=false) to use the native io_uring mover"
            ) from e
        if self.backend not in self.agent.backends:
            raise NixlError(
                f"NIXL could not create its {self.backend} backend here; set enable_nixl=false"
                f"{' and enable_gds=false' if gds else ''}"
            )
        self.agent.register_memory([(host.base, host.nbytes, 0, "")], "DRAM")
        file_bytes = -(-ssd.num_blocks // len(ssd.fds)) * ssd.block_bytes
        self.agent.register_memory([(0, file_bytes, fd, "") for fd in ssd.fds], "FILE")
        self._agent_lock = threading.Lock()

    def _transfer(
        self,
        host_ids: np.ndarray,
        disk_ids: np.ndarray,
        write: bool,
        offset: int = 0,
        length: int | None = None,
        checksums: bool = False,
    ) -> None:
        """As DiskMover's, without ``checksums``: this mover's bytes are hashed on the hasher thread
        (_hashes_in_batch() is False for it), so nothing asks it for them."""
        if checksums:
            raise ValueError("NIXL moves the bytes without hashing them: DiskMover hashes them on its hasher thread")
        if host_ids.size == 0:
            return
        bb = self.host.layout.block_bytes if length is None else length
        fds, offsets = self.ssd.locate(disk_ids)
        n = host_ids.size
        addrs = self.host.block_addrs(host_ids) + np.uint64(offset)
        dram = np.stack([addrs, np.full(n, bb, np.uint64), np.zeros(n, np.uint64)], axis=1)
        files = np.stack([offsets + np.uint64(offset), np.full(n, bb, np.uint64), fds.astype(np.uint64)], axis=1)
        with self._agent_lock:
            handle = self.agent.initialize_xfer(
                "WRITE" if write else "READ",
                self.agent.get_xfer_descs(dram, "DRAM"),
                self.agent.get_xfer_descs(files, "FILE"),
                self.name,
            )
            try:
                state = self.agent.transfer(handle)
                while state == "PROC":
                    time.sleep(0)  # let other Python threads run while NIXL's workers move bytes
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlError(
                        f"NIXL {self.backend} {'write' if write else 'read'} of {n} blocks failed ({state})"
                    )
            finally:
                self.agent.release_xfer_handle(handle)
