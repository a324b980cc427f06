"""The one check of a duration in seconds, shared by every validator of one (serve's worker
options, the handover lease and timeout, the remote tier's keys, replay's options, CacheConfig):
each words its own message, naming its key, from this one answer. Standard library only."""

from __future__ import annotations

import math


def is_duration(value: object, low: float = 0.0, high: float | None = None, low_ok: bool = False) -> bool:
    """``value`` is a real number (not a bool), finite (inf would overflow timeouts, NaN compares
    false to everything), above ``low`` (or equal to it with ``low_ok``) and at most ``high``."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value >= low if low_ok else value > low)
        and (high is None or value <= high)
    )
