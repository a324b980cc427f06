"""RemoteMover: REMOTE2H / H2REMOTE between the host pool and a RemoteStore (Redis).

Bytes go between the socket and the host pool's BLOCKFIRST slots with no Python copy (each slot
is one contiguous view). A read that verifies fewer blocks than asked raises RemoteShortRead
carrying the verified count: the caller commits that prefix and recomputes the rest.

Layerwise gets chain one REMOTE2H op per layer span (``op.layers``): each reads that span of every
block (GETRANGE), so layer 0 computes while later layers are on their way. The first span checks
the headers and keeps their checksums on its op's result; each later op takes them from the
REMOTE2H op it depends on, and the last one verifies whole blocks before anything commits (as the
disk tier's per-layer reads end in a VERIFY).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.remote.store import RefusedValue, RemoteStore
from dynamo_flexkv.core.storage.host import HostPool
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp


class RemoteShortRead(IOError, FlexKVError):
    """Fewer remote blocks were present and verified than planned (evicted, corrupt, foreign, or
    the server failed mid-read). ``verified`` leading blocks landed intact."""

    def __init__(self, verified: int, planned: int) -> None:
        self.verified, self.planned = verified, planned
        super().__init__(
            f"remote tier verified {verified} of {planned} planned blocks "
            "(evicted, corrupt, foreign or unreachable): the rest is recomputed"
        )


@dataclass
class _LayeredRead:
    """What the ops of one layerwise remote read pass along the chain."""

    checksums: list[int]  # of the blocks whose every span so far landed (a prefix)


class RemoteMover:
    def __init__(self, host: HostPool, store: RemoteStore) -> None:
        self.host, self.store = host, store
        self.block_bytes = host.layout.block_bytes
        self.layer_bytes = host.layout.layer_block_bytes
        self.num_layers = host.layout.model.num_layers

    def _views(self, host_ids: np.ndarray) -> list[np.ndarray]:
        self.host.check_ids(host_ids)
        bb, arr = self.block_bytes, self.host.array
        return [arr[int(b) * bb : (int(b) + 1) * bb] for b in host_ids]

    def _parents(self, op: TransferOp) -> list:
        seq = op.seq_hashes or []
        return [op.parent, *seq[:-1]]

    def run(self, op: TransferOp) -> int:
        seq = op.seq_hashes
        if seq is None or len(seq) != op.dst.size:
            raise ValueError(f"{op.kind.value}: needs one sequence hash per block")
        if op.kind is OpKind.REMOTE2H:
            views = self._views(op.dst)
            self.host.forget_checksums(op.dst)
            refused: list[RefusedValue] = []
            if op.layers is None or tuple(op.layers) == (0, self.num_layers):
                sums: list[int] = []
                n = self.store.get_into(seq, views, self._parents(op), refused=refused, checksums=sums)
                self.host.record_checksums(op.dst[:n], sums[:n])  # verified: the bytes that landed
                op.result = n
            else:
                n = self._read_span(op, seq, op.layers, views, refused)
            if n < len(seq):
                for value in refused:
                    # The value that ended the prefix is torn, corrupt or foreign: drop it (logged), so
                    # the next put of that block rewrites it instead of every later get failing on it.
                    # (Not after a timeout or a miss: the store reports only values it refused.)
                    self.store.drop_refused(value)
                raise RemoteShortRead(n, len(seq))
            return n * (self.block_bytes if op.layers is None else (op.layers[1] - op.layers[0]) * self.layer_bytes)
        if op.kind is OpKind.H2REMOTE:
            # The checksums the host pool took when these bytes landed: one hash per block,
            # shared with its disk write.
            n = self.store.put(
                seq,
                self._views(op.src),
                self._parents(op),
                skip_existing=True,
                checksums=self.host.checksums(op.src).tolist(),
            )
            op.result = n
            return n * self.block_bytes
        raise ValueError(f"RemoteMover cannot run {op.kind.value}")

    def _read_span(
        self,
        op: TransferOp,
        seq: list[int],
        layers: tuple[int, int],
        views: list[np.ndarray],
        refused: list[RefusedValue],
    ) -> int:
        """One layer span of a layerwise read; returns the blocks landed so far (verified, for
        the last span). A short span reads the rest of the landed blocks' layers at once and
        verifies them, so a RemoteShortRead always names whole verified blocks. ``seq``, ``layers``:
        the op's seq_hashes and layers (run() checked them)."""
        lo, hi = layers
        lb = self.layer_bytes
        if lo == 0:
            state = _LayeredRead([])
            n, state.checksums = self.store.get_range_into(
                seq, [v[: hi * lb] for v in views], 0, self.block_bytes, self._parents(op), refused=refused
            )
        else:
            prev: TransferOp | None = next((d for d in op.deps if d.kind is OpKind.REMOTE2H), None)
            if prev is None or not isinstance(prev.result, _LayeredRead):
                raise ValueError(f"remote2h layers {lo}..{hi} must follow the read of layers 0..{lo}")
            state = prev.result
            k = len(state.checksums)
            n, _ = self.store.get_range_into(
                seq[:k],
                [v[lo * lb : hi * lb] for v in views[:k]],
                lo * lb,
                self.block_bytes,
                self._parents(op)[:k],
                refused=refused,
            )
            state.checksums = state.checksums[:n]
        op.result = state
        if n < len(seq) and hi < self.num_layers and n:
            # Short: finish the landed prefix's other layers now, so it commits whole.
            n, _ = self.store.get_range_into(
                seq[:n],
                [v[hi * lb :] for v in views[:n]],
                hi * lb,
                self.block_bytes,
                self._parents(op)[:n],
                refused=refused,
            )
            hi = self.num_layers
        if hi == self.num_layers:
            n = self.store.verify_landed(views[:n], state.checksums[:n], seq_hashes=seq[:n], refused=refused)
            self.host.record_checksums(op.dst[:n], state.checksums[:n])  # verified whole blocks
        return n
