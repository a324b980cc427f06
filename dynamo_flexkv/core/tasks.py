"""Task records of the KVManager: what a caller waits on, and what it gets back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.core.transfer.fence import DeviceFence

if TYPE_CHECKING:  # a task only holds its graph; the transfer layer builds and runs it
    from dynamo_flexkv.core.transfer.graph import TransferGraph


class TaskKind(str, Enum):
    GET = "get"
    PUT = "put"
    PREFETCH = "prefetch"


class TaskStatus(str, Enum):
    SUCCESS = "success"
    NOT_FOUND = "not_found"  # nothing of the prefix is cached: recompute it
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"  # not finished within wait()'s timeout; still running, wait again or cancel
    FAILED = "failed"  # see TaskResult.error; nothing became visible, recompute


@dataclass(frozen=True)
class TaskResult:
    task_id: int
    kind: TaskKind
    status: TaskStatus
    num_tokens: int = 0  # get/prefetch: tokens loaded; put: tokens newly stored on host
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is TaskStatus.SUCCESS

    @property
    def reason(self) -> str:
        """Why the task did not succeed, in words (its error, or what its status means)."""
        return self.error or _REASONS.get(self.status, "")


_REASONS = {
    TaskStatus.NOT_FOUND: "nothing of the prompt was cached to load: recompute it",
    TaskStatus.CANCELLED: "cancelled before it finished: recompute what it would have loaded",
    TaskStatus.FAILED: "failed: recompute what it would have loaded",
}


class TaskFailed(RuntimeError, FlexKVError):
    """wait_for_layer on a task that failed or was cancelled: the engine must recompute."""


class TooManyTasks(RuntimeError, FlexKVError):
    """max_tasks_in_flight tasks are running: this one was refused (nothing was planned or queued).
    The engine recomputes instead, or waits for some tasks first."""


class ManagerClosed(RuntimeError, FlexKVError):
    """A call on a KVManager after its shutdown(): its memory and cache directories are released
    (another manager may hold them now); create a new KVManager instead."""


@dataclass(eq=False)
class Task:
    id: int
    kind: TaskKind
    num_layers: int
    graph: TransferGraph | None = None
    planned_tokens: int = 0  # what a get or prefetch will load if it succeeds
    planned_disk_tokens: int = 0  # the part of planned_tokens read from the disk tier
    planned_remote_tokens: int = 0  # the part of planned_tokens read from the remote tier
    result: TaskResult | None = None
    done: threading.Event = field(default_factory=threading.Event)  # the caller may proceed
    layer_ready: list[threading.Event] = field(default_factory=list)
    on_finish: Callable[[Task], None] | None = None  # called once, when the result is set
    # The result's receiver, instead of wait(): called once with it (the result is not kept).
    deliver: Callable[[TaskResult], None] | None = None
    finished_at: float = 0.0  # time.monotonic() of the result
    # A load into the registered device: its device writes pass this fence, so a cancel finishes
    # the task once none can land (the graph's host side drains later, on its own).
    fence: DeviceFence | None = None
    _finish_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.layer_ready = [threading.Event() for _ in range(self.num_layers)]

    def finish(self, result: TaskResult) -> None:
        """First result wins (a put finishes for its caller when the device copy is done)."""
        with self._finish_lock:
            first = self.result is None
            if first:
                self.result, self.finished_at = result, time.monotonic()
        if first and self.on_finish is not None:
            self.on_finish(self)
        for ev in self.layer_ready:  # wake layer waiters; they check the result
            ev.set()
        self.done.set()
