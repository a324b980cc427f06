"""RemoteMover: REMOTE2H / H2REMOTE between the host pool and a RemoteStore (Redis).

Bytes go between the socket and the host pool's BLOCKFIRST slots with no Python copy (each slot
is one contiguous view). A read that verifies fewer blocks than asked raises RemoteShortRead
carrying the verified count: the caller commits that prefix and recomputes the rest.
"""

from __future__ import annotations

from typing import List

import numpy as np

from dynamo_flexkv.remote.store import RemoteStore
from dynamo_flexkv.storage.host import HostPool
from dynamo_flexkv.transfer.graph import OpKind, TransferOp


class RemoteShortRead(IOError):
    """Fewer remote blocks were present and verified than planned (evicted, corrupt, foreign, or
    the server failed mid-read). ``verified`` leading blocks landed intact."""

    def __init__(self, verified: int, planned: int) -> None:
        self.verified, self.planned = verified, planned
        super().__init__(f"remote tier verified {verified} of {planned} planned blocks "
                         "(evicted, corrupt, foreign or unreachable): the rest is recomputed")


class RemoteMover:
    def __init__(self, host: HostPool, store: RemoteStore) -> None:
        self.host, self.store = host, store
        self.block_bytes = host.layout.block_bytes

    def _views(self, host_ids: np.ndarray) -> List[np.ndarray]:
        self.host.check_ids(host_ids)
        bb, arr = self.block_bytes, self.host.array
        return [arr[int(b) * bb:(int(b) + 1) * bb] for b in host_ids]

    def _bad_values(self) -> int:
        s = self.store.stats()
        return s.truncated + s.foreign + s.corrupt

    def _parents(self, op: TransferOp) -> list:
        seq = op.seq_hashes or []
        return [op.parent, *seq[:-1]]

    def run(self, op: TransferOp) -> int:
        seq = op.seq_hashes
        if seq is None or len(seq) != op.dst.size:
            raise ValueError(f"{op.kind.value}: needs one sequence hash per block")
        if op.kind is OpKind.REMOTE2H:
            bad_before = self._bad_values()
            n = self.store.get_into(seq, self._views(op.dst), self._parents(op))
            op.result = n
            if n < len(seq):
                if self._bad_values() > bad_before:
                    # The value that ended the prefix is torn, corrupt or foreign: drop it, so the next
                    # put of that block rewrites it instead of every later get failing on it. (Not
                    # after a timeout: that value may be fine, and the server may be stalled.)
                    self.store.delete(seq[n:n + 1])
                raise RemoteShortRead(n, len(seq))
            return n * self.block_bytes
        if op.kind is OpKind.H2REMOTE:
            n = self.store.put(seq, self._views(op.src), self._parents(op), skip_existing=True)
            op.result = n
            return n * self.block_bytes
        raise ValueError(f"RemoteMover cannot run {op.kind.value}")
