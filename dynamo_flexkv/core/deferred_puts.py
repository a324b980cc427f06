"""Puts waiting for host room: the host tier was full of blocks that running tasks lock (disk
writes in flight). They are retried, oldest first, each time a transfer graph finishes, and
when the oldest has waited ``max_wait_s``: a put whose wait is over stores what fits then, so its
engine gets its device blocks back even if no graph ever finishes (a hung disk)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dynamo_flexkv.core.tasks import Task


@dataclasses.dataclass(eq=False)
class DeferredPut:
    """What a put needs to be planned later (its task is issued, its device blocks are the caller's)."""

    task: Task
    seq: list[int]
    token_ids: Any
    dev_ids: np.ndarray
    after: Any  # the CUDA event recorded at put_async: the copy waits for the engine's writes
    device: Any = None  # an attached engine's device (node cache), which copies its blocks itself
    generation: int | None = None  # the cache engine's generation its hashes belong to
    since: float = dataclasses.field(default_factory=time.monotonic)


class DeferredPuts:
    """The queue and its retry loop. ``put_now(put)`` plans and submits a put, returning False when
    it had to wait again (it re-queued itself with ``add``); ``fail(put, error)`` ends one whose
    retry raised. ``cond`` is the manager's idle condition: ``drain()`` waits on it until
    ``busy()`` is False, and every change here notifies it."""

    def __init__(
        self,
        cond: threading.Condition,
        put_now: Callable[[DeferredPut], bool],
        fail: Callable[[DeferredPut, BaseException], None],
        max_wait_s: float,
    ) -> None:
        self._cond = cond
        self._put_now = put_now
        self._fail = fail
        self.max_wait_s = max_wait_s
        self._queue: collections.deque[DeferredPut] = collections.deque()
        self._retrying = self._again = False
        self._timer: threading.Timer | None = None  # armed while puts wait: the oldest's wait ends

    def __len__(self) -> int:
        return len(self._queue)

    def busy(self) -> bool:
        """(Under ``cond``.) Puts are queued or being retried."""
        return bool(self._queue) or self._retrying

    def add(self, put: DeferredPut) -> None:
        """(Under ``cond``.) Queues a put last."""
        self._queue.append(put)
        if self._timer is None:
            oldest = min(self._queue[0].since, put.since)  # a retry re-adds the oldest put last
            left = oldest + self.max_wait_s - time.monotonic()
            self._timer = threading.Timer(max(0.01, left), self._wait_over)
            self._timer.daemon = True
            self._timer.start()

    def _wait_over(self) -> None:
        """The oldest put's wait is over: retried now, whether or not a graph finished."""
        with self._cond:
            self._timer = None
        self.retry()

    def close(self) -> None:
        """Disarms the timer (the manager shut down: its queued puts were dropped)."""
        with self._cond:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def drop(self, which: Callable[[DeferredPut], bool]) -> list[DeferredPut]:
        """Takes the puts ``which(put)`` selects out of the queue (they were never planned)."""
        with self._cond:
            out = [p for p in self._queue if which(p)]
            for p in out:
                self._queue.remove(p)
            self._cond.notify_all()
        return out

    def retry(self) -> None:
        """Retries queued puts, oldest first, until one has to wait again. One thread at a time; a
        call meanwhile makes that thread look again, so no wake-up is lost."""
        with self._cond:
            if self._retrying:
                self._again = True
                return
            self._retrying = True
        while True:
            with self._cond:
                put = self._queue.popleft() if self._queue else None
                if put is None:
                    if self._again:
                        self._again = False
                        continue
                    self._retrying = False
                    self._cond.notify_all()
                    return
                self._again = False
            try:
                waiting = not self._put_now(put)
            except BaseException as e:  # noqa: BLE001 - this put fails, the retry loop goes on
                self._fail(put, e)
                waiting = False
            if waiting:  # put_now queued it last: back to the front, the rest wait behind it
                with self._cond:
                    if put in self._queue:  # cancel() may have taken it meanwhile
                        self._queue.remove(put)
                        self._queue.appendleft(put)
                    if not self._again:
                        self._retrying = False
                        self._cond.notify_all()
                        return
                    self._again = False
