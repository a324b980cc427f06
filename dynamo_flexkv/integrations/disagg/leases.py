"""The prefill side's leases on handed-over device blocks. A lease keeps its blocks referenced
(so nothing frees or evicts them under a decode worker's read) until the decode worker's
completion notice or its timeout, whichever comes first: a decode worker that dies holding a lease
costs its blocks for ``ttl`` seconds, never for ever. Engine-thread only (no locking)."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from dynamo_flexkv.core.durations import is_duration


# A handover lease or pull timeout past a day is a typo (or inf): blocks held that long are lost.
MAX_HANDOVER_S = 86400.0


def handover_seconds_problem(value: float) -> Optional[str]:
    """Why ``value`` cannot be a handover lease or pull timeout in seconds; None if it can. Shared
    by the worker's argparse and serve's plan check, so both refuse the same values."""
    if not is_duration(value):
        return f"{value} must be > 0 seconds (a finite number)"
    if value > MAX_HANDOVER_S:
        return f"{value} must be at most {MAX_HANDOVER_S:.0f} seconds (one day)"
    return None


@dataclass(frozen=True)
class Lease:
    id: str
    blocks: List[int]
    expires_at: float  # monotonic clock
    expires_unix: float  # the same moment on the wall clock, for the decode worker


class LeaseTable:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        problem = handover_seconds_problem(ttl)
        if problem is not None:
            raise ValueError(f"lease ttl: {problem}")
        self.ttl, self._clock = ttl, clock
        self._leases: Dict[str, Lease] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{int(time.time() * 1000) % 10**9}"  # unique across restarts
        self.granted = self.released = self.expired_count = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, blocks: List[int]) -> Lease:
        lease = Lease(f"{self._prefix}-{next(self._ids)}", list(blocks), self._clock() + self.ttl,
                      time.time() + self.ttl)
        self._leases[lease.id] = lease
        self.granted += 1
        return lease

    def release(self, lease_id: str) -> Optional[Lease]:
        """The lease's blocks for the caller to unreference; None for an unknown or expired lease
        (a late notice after expiry must not release the blocks twice)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.released += 1
        return lease

    def expire(self) -> List[Lease]:
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.id]
        self.expired_count += len(gone)
        return gone

    def drain(self) -> List[Lease]:
        """Every lease still held (shutdown)."""
        out, self._leases = list(self._leases.values()), {}
        return out
