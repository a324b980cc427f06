"""A test seam that makes an engine's device copies slow on demand (FlexKVConnector's
``mover_hook``), so a test can kill a worker while its copy runs: while the file SLOW_KV_FILE
names exists, every host<->device copy sleeps SLOW_KV_S seconds (default 3) before it moves a
byte. ``slow_kv:slow_copies``."""

from __future__ import annotations

import os
import time

from dynamo_flexkv.core.transfer.graph import OpKind

HOOK = "slow_kv:slow_copies"


class _Slow:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.trigger = os.environ.get("SLOW_KV_FILE", "")
        self.seconds = float(os.environ.get("SLOW_KV_S", "3"))

    def run(self, op):
        if self.trigger and os.path.exists(self.trigger):
            time.sleep(self.seconds)
        return self.inner.run(op)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def slow_copies(kind, mover):
    return _Slow(mover) if kind in (OpKind.H2D, OpKind.D2H) else mover
