"""The remote store's counters (what RemoteStore.stats() returns a copy of)."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_flexkv.core.remote.breaker import BreakerState


@dataclass
class RemoteStats:
    """Counters since open (``RemoteStore.stats()`` returns a copy).

    Remote failures are counted here, never raised: ``op_errors`` counts ops of every kind (exists,
    get, put, delete) cut short by a connection failure or timeout, one per op; ``breaker_refused``
    the ops not tried while the breaker was open. What a put did not store is counted per block by
    cause: ``put_refused`` (the server said no: OOM), ``server_errors`` (other error replies) and
    ``put_failed`` (no answer: the op was cut short or refused by the breaker). A write-behind whose
    put failed so still succeeds (its blocks stay on host): the manager's ``write_failures`` counts
    only H2REMOTE ops that raised (a bug or a bad argument), not Redis failures, which land here.
    """

    exists_keys: int = 0
    hits: int = 0  # blocks read and verified
    misses: int = 0  # the block that ended a read's prefix was missing
    truncated: int = 0
    foreign: int = 0
    corrupt: int = 0
    server_errors: int = 0  # error replies (MOVED during resharding, ...)
    bytes_read: int = 0
    puts: int = 0  # blocks stored
    put_skipped: int = 0  # already there (skip_existing)
    put_refused: int = 0  # refused by the server (OOM: maxmemory reached with noeviction)
    put_failed: int = 0  # not stored for want of an answer: connection failure, timeout, open breaker
    bytes_written: int = 0
    op_errors: int = 0  # ops cut short by a connection failure or timeout
    breaker_refused: int = 0  # ops refused while the breaker was open
    breaker_opened: int = 0
    connects: int = 0  # connections opened (reconnects included)
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    exists_seconds: float = 0.0
    breaker_state: str = BreakerState.CLOSED.value
    # The tenant's quota (remote_quota_gb; 0: none), its bytes accounted in Redis as of this
    # store's last put or delete, and the blocks of the tenant this store evicted to stay within it.
    quota_bytes: int = 0
    quota_used_bytes: int = 0
    quota_evicted: int = 0
