"""DeviceFence: the gate every device write of one load passes, so a cancel ends in bounded time.

A load's copy may stall anywhere before it writes (a slow disk, a busy transfer queue, a hook): a
cancel that waited for every copy to return waited without bound (the vLLM engine died of its RPC
timeout, docs/LIMITATIONS.md). Instead each device write runs inside ``writing()``; ``close()``
stops new writes, and once the writes inside have returned the fence is *drained*: no copy of the
load can write the engine's blocks any more, even one that wakes up later (it finds the fence
closed, raises CopyFenced and writes nothing). The engine may reuse the blocks from then on,
while the load's host side (locked host slots, disk reads into them) drains on its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from dynamo_flexkv.core.errors import FlexKVError


class CopyFenced(RuntimeError, FlexKVError):
    """A device copy of a cancelled load reached its fence after the cancel: it wrote nothing."""


class DeviceFence:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._writing = 0  # writes inside the fence now
        self._on_drained: list[Callable[[], None]] = []
        self.drained = threading.Event()  # closed, and no write inside

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """One device write: raises CopyFenced (before any byte moves) once the fence is closed."""
        with self._lock:
            if self._closed:
                raise CopyFenced("the load was cancelled before this device copy started: it wrote nothing")
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                drained = self._closed and self._writing == 0
            if drained:
                self._drain()

    def close(self, on_drained: Callable[[], None]) -> None:
        """No write starts any more; ``on_drained`` runs once none is inside (at once if none is:
        then on this thread; else on the thread of the last write to return)."""
        with self._lock:
            self._on_drained.append(on_drained)
            self._closed = True
            drained = self._writing == 0
        if drained:
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            callbacks, self._on_drained = self._on_drained, []
        self.drained.set()
        for cb in callbacks:
            cb()


CLOSED = DeviceFence()  # a fence closed from the start: for copies of a load already collected
CLOSED.close(lambda: None)
