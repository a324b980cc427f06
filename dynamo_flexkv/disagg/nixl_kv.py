"""One NIXL agent per worker over the engine's paged KV tensors (one per layer, registered once).
The decode worker READs blocks from the prefill worker's registered memory: UCX picks the fastest
transport the two processes share (shared memory or TCP here; RDMA, NVLink or CUDA IPC on GPU
nodes), with the same descriptors. Requests are serialized per agent (NIXL 1.5.1 crashed with two
threads driving one agent, see transfer/nixl_mover.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from dynamo_flexkv.disagg.params import HandoverParams, HandoverRefused, pack_metadata, unpack_metadata


_ucx_agents = 0  # agents with a UCX backend this process created


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


class HandoverFailed(IOError):
    """A pull did not complete (peer gone, transfer error, timeout): the decode worker recomputes."""


def _runs(local: Sequence[int], remote: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(local_first, remote_first, count) runs where both block ids advance by one: one
    descriptor per run and layer instead of one per block."""
    out: List[Tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if out and out[-1][0] + out[-1][2] == lb and out[-1][1] + out[-1][2] == rb:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((lb, rb, 1))
    return out


class KVAgent:
    def __init__(self, layers: Sequence[torch.Tensor], name: str = "", backend: str = "UCX") -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.layers = list(layers)
        t = self.layers[0]
        self.block_bytes = t[0].nbytes
        self.mem = "VRAM" if t.is_cuda else "DRAM"
        self.dev = (t.device.index or 0) if t.is_cuda else 0
        self.name = name or f"flexkv-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=[backend]))
        except Exception as e:  # NIXL's own exception types
            raise HandoverFailed(f"NIXL {backend} backend unavailable: {e}") from e
        global _ucx_agents
        _ucx_agents += 1
        if backend not in self.agent.backends:
            raise HandoverFailed(f"NIXL could not create its {backend} backend on this machine")
        self.agent.register_memory([(x.data_ptr(), x.nbytes, self.dev, "") for x in self.layers], self.mem)
        self._lock = threading.Lock()
        self._metadata = pack_metadata(self.agent.get_agent_metadata())
        self._peers: Dict[str, str] = {}  # remote agent name -> the metadata it was added with
        self.bytes_pulled = 0
        self.pulls = 0

    @property
    def metadata(self) -> str:
        return self._metadata

    def describe(self, lease: str, blocks: List[int], last_hash, lease_expires_unix: float,
                 with_metadata: bool = True) -> HandoverParams:
        return HandoverParams(agent=self.name, metadata=self._metadata if with_metadata else None, lease=lease,
                              blocks=list(blocks), last_hash=last_hash,
                              layer_addrs=[x.data_ptr() for x in self.layers], block_bytes=self.block_bytes,
                              mem=self.mem, dev=self.dev, lease_expires_unix=lease_expires_unix)

    def check_compatible(self, p: HandoverParams) -> None:
        if len(p.layer_addrs) != len(self.layers) or p.block_bytes != self.block_bytes:
            raise HandoverRefused(f"the prefill worker's KV layout ({len(p.layer_addrs)} layers x {p.block_bytes} "
                                  f"bytes per block) differs from this worker's ({len(self.layers)} x "
                                  f"{self.block_bytes}): serve the same model on both roles")

    def _connect(self, p: HandoverParams) -> None:
        known = self._peers.get(p.agent)
        if known is not None and (p.metadata is None or p.metadata == known):
            return
        if p.metadata is None:
            raise HandoverFailed(f"no NIXL metadata for prefill agent {p.agent}")
        if known is not None:
            self.agent.remove_remote_agent(p.agent)
        self.agent.add_remote_agent(unpack_metadata(p.metadata))
        self._peers[p.agent] = p.metadata

    def pull(self, p: HandoverParams, remote_blocks: Sequence[int], local_blocks: Sequence[int],
             timeout: float) -> int:
        """READs the remote blocks into the local ones, every layer; returns bytes moved. Raises
        HandoverFailed on any failure or after ``timeout`` seconds (the local blocks then hold
        garbage and must be recomputed)."""
        if len(remote_blocks) != len(local_blocks):
            raise ValueError("pull: remote and local block lists differ in length")
        if not local_blocks:
            return 0
        bb = self.block_bytes
        rows_l, rows_r = [], []
        for lb, rb, n in _runs(local_blocks, remote_blocks):
            for layer, x in enumerate(self.layers):
                rows_l.append((x.data_ptr() + lb * bb, n * bb, self.dev))
                rows_r.append((p.layer_addrs[layer] + rb * bb, n * bb, p.dev))
        nbytes = len(local_blocks) * bb * len(self.layers)
        with self._lock:
            try:
                self._connect(p)
                handle = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(np.array(rows_l, dtype=np.uint64), self.mem),
                    self.agent.get_xfer_descs(np.array(rows_r, dtype=np.uint64), p.mem), p.agent)
            except HandoverRefused:
                raise
            except Exception as e:  # NIXL raises its own types for an unknown or unreachable agent
                self._forget(p.agent)
                raise HandoverFailed(f"NIXL could not start a read from {p.agent}: {e}") from e
            try:
                state = self.agent.transfer(handle)
                deadline = time.monotonic() + timeout
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise HandoverFailed(f"NIXL read of {nbytes} bytes from {p.agent} still running after "
                                             f"{timeout:.1f} s")
                    time.sleep(0)  # other Python threads run while UCX moves the bytes
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise HandoverFailed(f"NIXL read of {nbytes} bytes from {p.agent} failed ({state})")
            except HandoverFailed:
                self._forget(p.agent)
                raise
            except Exception as e:
                self._forget(p.agent)
                raise HandoverFailed(f"NIXL read from {p.agent} failed: {e}") from e
            finally:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:  # a transfer that could not be aborted: its handle is gone with the peer
                    pass
        self.bytes_pulled += nbytes
        self.pulls += 1
        return nbytes

    def notify(self, p: HandoverParams, message: bytes) -> bool:
        """A standalone notification to the prefill agent (the lease release); False when it is
        unreachable (dead: its leases died with it; alive: the lease ends by timeout)."""
        with self._lock:
            try:
                self._connect(p)
                self.agent.send_notif(p.agent, message)
                return True
            except HandoverRefused:
                return False
            except Exception:  # NIXL's own types: unknown or unreachable agent
                self._forget(p.agent)
                return False

    def notifications(self) -> List[bytes]:
        with self._lock:
            got = self.agent.get_new_notifs()
        return [m for msgs in got.values() for m in msgs]

    def _forget(self, agent_name: str) -> None:
        """Drops a peer after a failure so the next handover from it reconnects from scratch."""
        if self._peers.pop(agent_name, None) is not None:
            try:
                self.agent.remove_remote_agent(agent_name)
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            for name in list(self._peers):
                self._forget(name)
            try:
                self.agent.deregister_memory(
                    self.agent.get_reg_descs([(x.data_ptr(), x.nbytes, self.dev, "") for x in self.layers], self.mem))
            except Exception:
                pass
