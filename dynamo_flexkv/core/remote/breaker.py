"""Circuit breaker: stop hammering a remote that keeps failing, try again after a cool-down."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"  # ops go through
    OPEN = "open"  # ops are refused without touching the network until the cool-down ends
    HALF_OPEN = "half_open"  # one trial op is in flight; its outcome closes or reopens


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_open = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether an op may touch the network now (an open breaker lets one trial through
        after its cool-down)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or self._failures >= self.failures_to_open:
                if self._state is not BreakerState.OPEN:
                    self.times_opened += 1
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()

    def trip(self) -> None:
        """Opens now (e.g. the server was unreachable at start)."""
        with self._lock:
            self._failures = self.failures_to_open
            if self._state is not BreakerState.OPEN:
                self.times_opened += 1
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
