"""The prefill side's leases on handed-over device blocks. A lease keeps its blocks referenced
(so nothing frees or evicts them under a decode worker's read) until the decode worker's
completion notice or its timeout, whichever comes first. The timeout is short (``renew_s``) unless
the decode worker renews it: it claims the lease when the request reaches it and renews it while
the request waits there, so a decode leg that never started (no decode worker, the frontend's
decode call failed, the client left) or a decode worker that died costs the blocks for
``renew_s`` seconds, and no lease outlives ``ttl`` whatever is renewed. Engine-thread only (no
locking)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynamo_flexkv.core.durations import is_duration

# A handover lease or pull timeout past a day is a typo (or inf): blocks held that long are lost.
MAX_HANDOVER_S = 86400.0


def handover_seconds_problem(value: float) -> str | None:
    """Why ``value`` cannot be a handover lease or pull timeout in seconds; None if it can. Shared
    by the worker's argparse and serve's plan check, so both refuse the same values."""
    if not is_duration(value):
        return f"{value} must be > 0 seconds (a finite number)"
    if value > MAX_HANDOVER_S:
        return f"{value} must be at most {MAX_HANDOVER_S:.0f} seconds (one day)"
    return None


# Default of --handover-renew-s: how long a lease holds without a claim or renewal from a decode
# worker. Covers the frontend's hop to the decode worker and one engine step there.
DEFAULT_RENEW_S = 5.0


@dataclass
class Lease:
    id: str
    blocks: list[int]
    expires_at: float  # monotonic clock: now + renew_s at grant and at each renewal, at most hard_at
    hard_at: float  # monotonic clock: grant + ttl, whatever is renewed
    expires_unix: float  # hard_at on the wall clock, for the decode worker
    renew_by_unix: float  # the first expires_at on the wall clock: a decode worker claims it by then
    renewals: int = 0


class LeaseTable:
    def __init__(
        self, ttl: float, clock: Callable[[], float] = time.monotonic, renew_s: float = DEFAULT_RENEW_S
    ) -> None:
        for what, value in (("lease ttl", ttl), ("lease renewal window", renew_s)):
            problem = handover_seconds_problem(value)
            if problem is not None:
                raise ValueError(f"{what}: {problem}")
        self.ttl, self._clock = ttl, clock
        self.renew_s = min(renew_s, ttl)
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{int(time.time() * 1000) % 10**9}"  # unique across restarts
        self.granted = self.released = self.expired_count = 0
        self.unclaimed_count = 0  # the part of expired_count no decode worker ever claimed

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> Lease | None:
        """The lease while it holds (its renewals, when it ends); None once released or expired."""
        return self._leases.get(lease_id)

    def grant(self, blocks: list[int]) -> Lease:
        now, unix = self._clock(), time.time()
        lease = Lease(
            f"{self._prefix}-{next(self._ids)}",
            list(blocks),
            now + self.renew_s,
            now + self.ttl,
            unix + self.ttl,
            unix + self.renew_s,
        )
        self._leases[lease.id] = lease
        self.granted += 1
        return lease

    def renew(self, lease_id: str) -> bool:
        """A decode worker's claim or renewal: the lease holds ``renew_s`` more seconds (never past
        its ttl). False for an unknown or expired lease (nothing to extend)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expires_at = min(lease.hard_at, self._clock() + self.renew_s)
        lease.renewals += 1
        return True

    def release(self, lease_id: str) -> Lease | None:
        """The lease's blocks for the caller to unreference; None for an unknown or expired lease
        (a late notice after expiry must not release the blocks twice)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.released += 1
        return lease

    def expire(self) -> list[Lease]:
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.id]
        self.expired_count += len(gone)
        self.unclaimed_count += sum(1 for lease in gone if not lease.renewals)
        return gone

    def drain(self) -> list[Lease]:
        """Every lease still held (shutdown)."""
        out, self._leases = list(self._leases.values()), {}
        return out
