"""Logging helpers shared by the tiers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """At most one line per ``every_s`` seconds on ``logger``, for an event that can repeat per
    block: a line asked for sooner is not logged but counted, and the next line that is logged
    says how many were left out (``flush()`` logs that count on its own, e.g. at close)."""

    def __init__(
        self, logger: logging.Logger, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._lock = threading.Lock()
        self._next = float("-inf")
        self._left_out = 0

    def log(self, level: int, msg: str, *args: Any) -> bool:
        """Logs ``msg % args`` unless a line went out less than ``every_s`` ago; True if logged."""
        with self._lock:
            now = self.clock()
            if now < self._next:
                self._left_out += 1
                return False
            self._next = now + self.every_s
            left_out, self._left_out = self._left_out, 0
        if left_out:
            msg += " (and %d more like it since the last such line, not logged one by one)"
            args += (left_out,)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def flush(self, what: str, level: int = logging.WARNING) -> None:
        """Logs how many lines were left out since the last one (``what``: what they were about)."""
        with self._lock:
            left_out, self._left_out = self._left_out, 0
        if left_out:
            self.logger.log(level, "%d more %s since the last such line, not logged one by one", left_out, what)
