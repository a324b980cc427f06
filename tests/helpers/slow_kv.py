"""Test seams that make an engine's copies slow or hung on demand (FlexKVConnector's
``mover_hook`` setting), switched on and off by a file, so a served test can act on a worker's
copies from outside its processes:

* ``slow_kv:slow_copies`` (HOOK): while the file SLOW_KV_FILE names exists, every host<->device
  copy sleeps SLOW_KV_S seconds (default 3) before it moves a byte (a test kills a worker while
  its copy runs);
* ``slow_kv:hung_disk_writes`` (HUNG_DISK_HOOK): while the file HUNG_DISK_FILE names exists, every
  disk write (H2DISK) blocks until the file is gone, as a stalled disk's O_DIRECT writes do
  (kv_helpers.HungDisk, the in-process tests' hook); a write still blocked after HUNG_DISK_MAX_S
  seconds (default 600) fails instead, so a broken test cannot hang a worker for good."""

from __future__ import annotations

import os
import time

from kv_helpers import HungDisk

from dynamo_flexkv.core.transfer.graph import OpKind

HOOK = "slow_kv:slow_copies"
HUNG_DISK_HOOK = "slow_kv:hung_disk_writes"
HUNG_DISK_FILE = "HUNG_DISK_FILE"
HUNG_DISK_MAX_S = "HUNG_DISK_MAX_S"


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


class _FileGone:
    """kv_helpers.HungDisk's ``answers`` (threading.Event's ``wait``): set once the file is gone."""

    def __init__(self, path: str) -> None:
        self.path = path

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while os.path.exists(self.path):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # polled: nothing outside the worker's process can wake it
        return True


def hung_disk_writes(kind, mover):
    trigger = os.environ.get(HUNG_DISK_FILE, "")
    if kind is not OpKind.H2DISK or not trigger:
        return mover
    return HungDisk(mover, _FileGone(trigger), max_s=float(os.environ.get(HUNG_DISK_MAX_S, "600")))
