"""The manager's task table: ids issued in order, results handed out once, uncollected results
expiring after a TTL (never one a blocked wait is waiting for), so the table stays bounded."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal, overload

import numpy as np

from dynamo_flexkv.core.tasks import Task, TaskKind


class TaskTable:
    def __init__(self, result_ttl_s: float) -> None:
        self.result_ttl_s = result_ttl_s
        self.lock = threading.Lock()
        self._tasks: dict[int, Task] = {}
        self._next_id = 1  # ids are issued in order: an id below it that is not in _tasks has finished
        self._waiters: dict[int, int] = {}  # task id -> wait()/wait_for_layer() calls blocked on it
        # Finished results nobody has collected yet, oldest first: id -> finish time (for expiry).
        self._uncollected: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.expired_results = 0

    def issue(self, kind: TaskKind, num_layers: int) -> Task:
        """A new task (call under ``lock``, after the caller's admission checks)."""
        task = Task(self._next_id, kind, num_layers, on_finish=self._finished)
        self._next_id += 1
        self._tasks[task.id] = task
        return task

    def discard(self, task_id: int) -> None:
        with self.lock:
            self._tasks.pop(task_id, None)

    def counts(self) -> tuple[int, int]:
        """(in flight, finished and not collected)."""
        with self.lock:
            uncollected = len(self._uncollected)
            return len(self._tasks) - uncollected, uncollected

    def get(self, task_id: Any) -> Task:
        """The task of an id whose result has not been collected; KeyError naming why otherwise."""
        self.expire()
        with self.lock:
            return self._lookup(task_id)

    def get_all(self, task_ids: list[Any]) -> list[Task | None]:
        """Every id checked before any is returned: None for one issued whose result is gone, a
        KeyError (and nothing returned) for one never issued."""
        self.expire()
        with self.lock:
            return [self._lookup(t, finished_ok=True) for t in task_ids]

    @contextlib.contextmanager
    def awaited(self, task_ids: list[Any]) -> Iterator[list[Task]]:
        """The tasks, marked as waited for while the block runs: their results do not expire."""
        self.expire()
        with self.lock:
            tasks = [self._lookup(t) for t in task_ids]
            for t in tasks:
                self._waiters[t.id] = self._waiters.get(t.id, 0) + 1
        try:
            yield tasks
        finally:
            with self.lock:
                for t in tasks:
                    left = self._waiters.pop(t.id) - 1
                    if left:
                        self._waiters[t.id] = left

    def collect(self, finished: list[Task]) -> None:
        """Hands out the results of finished tasks, all at once: two threads waiting on one task get
        it once and lose nothing else."""
        with self.lock:
            taken = [t.id for t in finished if self._tasks.get(t.id) is not t]
            if taken:
                raise KeyError(
                    f"task(s) {taken}: the result was already collected by another wait(); "
                    "wait on a task from one thread only"
                )
            for t in finished:
                self._tasks.pop(t.id, None)  # an id listed twice in one call is handed out once
                self._uncollected.pop(t.id, None)

    def expire(self) -> None:
        """Drops results nobody collected within the TTL (oldest first); results a blocked wait()
        is waiting for stay."""
        cutoff = time.monotonic() - self.result_ttl_s
        with self.lock:
            expired = []
            for task_id, finished_at in self._uncollected.items():
                if finished_at > cutoff:
                    break
                if task_id not in self._waiters:
                    expired.append(task_id)
            for task_id in expired:
                del self._uncollected[task_id]
                if self._tasks.pop(task_id, None) is not None:
                    self.expired_results += 1

    def _finished(self, task: Task) -> None:
        if task.deliver is not None:  # handed to its receiver, never to wait()
            with self.lock:
                self._tasks.pop(task.id, None)
            assert task.result is not None  # on_finish runs only after finish() set the result
            task.deliver(task.result)
            return
        with self.lock:
            if task.id in self._tasks:
                self._uncollected[task.id] = task.finished_at

    @overload
    def _lookup(self, task_id: Any, finished_ok: Literal[False] = False) -> Task: ...

    @overload
    def _lookup(self, task_id: Any, finished_ok: bool) -> Task | None: ...

    def _lookup(self, task_id: Any, finished_ok: bool = False) -> Task | None:
        """(Under ``lock``.) One issued but gone (its result collected or expired) is None with
        ``finished_ok``, else KeyError; one never issued is a KeyError."""
        issued = (
            isinstance(task_id, (int, np.integer)) and not isinstance(task_id, bool) and 0 < task_id < self._next_id
        )
        task = self._tasks.get(task_id) if issued else None
        if task is not None or (issued and finished_ok):
            return task
        if issued:
            raise KeyError(
                f"task id {task_id!r} has finished and its result is gone: already taken by wait(), "
                "or nobody collected it within task_result_ttl_seconds"
            )
        raise KeyError(f"unknown task id {task_id!r}: never issued (task ids are the ints the *_async calls return)")
