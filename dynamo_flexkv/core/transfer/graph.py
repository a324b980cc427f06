"""Transfer graphs: a task's copies as a DAG of ops, each on one link."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from dynamo_flexkv.core.transfer.fence import DeviceFence


class OpKind(str, Enum):
    D2H = "d2h"
    H2D = "h2d"
    DISK2H = "disk2h"
    H2DISK = "h2disk"
    VERIFY = "verify"  # checksums of disk blocks that landed in host slots (after per-layer reads)
    REMOTE2H = "remote2h"  # remote (Redis) blocks read and verified into host slots
    H2REMOTE = "h2remote"  # host blocks written behind to remote
    HASH = "hash"  # checksums of host blocks a put's D2H filled, recorded once for their writes


class OpState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # never started: its graph failed or was cancelled first


@dataclass(eq=False)
class TransferOp:
    """Copy blocks ``src[i]`` of the source tier into ``dst[i]`` of the destination tier."""

    kind: OpKind
    src: np.ndarray
    dst: np.ndarray
    deps: tuple[TransferOp, ...] = ()
    layers: tuple[int, int] | None = None  # [lo, hi) for device copies; None = all layers
    on_done: Callable[[TransferOp], None] | None = None  # runs on the worker after success
    after: Any = None  # CUDA event the copy waits for: the engine's writes to these blocks
    seq_hashes: list[int] | None = None  # remote ops: the blocks' sequence hashes (their keys)
    parent: int | None = None  # remote ops: sequence hash before seq_hashes[0] (None at the root)
    # Device copies (H2D, D2H) of an engine attached to the node cache: the engine's device, which
    # copies them itself (core/node/engines.py); None: the manager's own registered device.
    device: Any = None
    task_id: int | None = None  # the task whose graph this op belongs to
    # H2D: the load's fence (fence.py); the device write runs inside it, so none lands after a cancel.
    fence: DeviceFence | None = None
    # Filled in by the engine and the mover.
    state: OpState = OpState.PENDING
    nbytes: int = 0
    started: float = 0.0  # time.perf_counter() when a worker thread began the op
    seconds: float = 0.0
    # When the copy ended, on time.perf_counter()'s clock (system-wide on Linux), where a mover
    # that copies elsewhere says so (an attached engine: core/node/engines.py); 0: when it settled.
    ended: float = 0.0
    error: BaseException | None = None
    result: Any = None

    def __post_init__(self) -> None:
        self.src = np.asarray(self.src, dtype=np.int64)
        self.dst = np.asarray(self.dst, dtype=np.int64)
        if self.src.shape != self.dst.shape:
            raise ValueError(f"{self.kind.value}: {self.src.size} source blocks for {self.dst.size} destination blocks")


class GraphState(str, Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class TransferGraph:
    ops: list[TransferOp]
    on_finish: Callable[[TransferGraph], None] | None = None  # runs once, after every op settled
    state: GraphState = GraphState.RUNNING
    error: BaseException | None = None
    cancel_requested: bool = False
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops)
