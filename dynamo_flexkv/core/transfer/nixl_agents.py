"""Every NIXL agent of this package is created here, with a progress thread that sleeps when idle.

NIXL's Python binding (1.x) creates each agent with a progress-thread delay of 0: the UCX progress
thread then polls without ever blocking. Measured on this machine, one idle agent keeps one core
100% busy (0.017 of a core with a 100 us delay, 0.0 without a progress thread). A vLLM worker has
several agents (NixlConnector's, ours), each pinned beside the engine thread: the engine thread got
a fraction of its core, and a 0.4 ms handover read took 8-50 ms waiting on the run queue
(docs/BENCHMARKS.md, bench disagg --vllm). ``quiet_progress_threads`` gives every agent the process
creates from then on (vLLM's NixlConnector's included) a delay, so its thread waits in the kernel
for UCX events or the delay, whichever comes first; a transfer's own events still wake it.

``FLEXKV_NIXL_PROGRESS_DELAY_US`` sets the delay (default 100, at most 1 s; 0 keeps NIXL's busy
polling). vLLM's NixlConnector sets ``UCX_RCACHE_MAX_UNRELEASED=1024`` (a guard against a UCX
registration-cache leak) only if NIXL is not imported yet; we import NIXL first in a worker, so we
set the same default before importing it."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from dynamo_flexkv.core.errors import FlexKVError

DEFAULT_DELAY_US = 100
MAX_DELAY_US = 1_000_000  # NIXL keeps the delay in 32 bits; larger values wrapped back to polling
_lock = threading.Lock()
_installed: list[int] = []  # the delay installed in this process, once


class ProgressDelayError(ValueError, FlexKVError):
    """FLEXKV_NIXL_PROGRESS_DELAY_US holds something other than whole microseconds in range."""


def progress_delay_us() -> int:
    raw = os.environ.get("FLEXKV_NIXL_PROGRESS_DELAY_US", "").strip()
    if not raw:
        return DEFAULT_DELAY_US
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_DELAY_US:
        raise ProgressDelayError(
            f"FLEXKV_NIXL_PROGRESS_DELAY_US={raw!r}: expected whole microseconds from 0 to "
            f"{MAX_DELAY_US} (default {DEFAULT_DELAY_US}; 0 keeps NIXL's busy-polling progress thread)"
        )
    return int(raw)


def quiet_progress_threads() -> int:
    """Installs the delay for every NIXL agent this process creates from now on; returns it. Safe to
    call often; a no-op (0) where NIXL is not importable or the delay is 0."""
    with _lock:
        if _installed:
            return _installed[0]
        delay = progress_delay_us()
        if "nixl" not in sys.modules:
            os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as vLLM's nixl_utils would
        try:
            from nixl import _api
        except ImportError:
            return 0
        bind = getattr(_api, "nixlBind", None)
        make = getattr(bind, "nixlAgent", None)
        if delay == 0 or bind is None or make is None:  # no nixlBind means no nixlAgent either
            _installed.append(0)
            return 0

        def agent_with_delay(name: str, config: Any) -> Any:
            if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", 1) == 0:
                config.pthrDelay = delay
            return make(name, config)

        bind.nixlAgent = agent_with_delay
        _installed.append(delay)
        return delay


def new_agent(name: str, backends: list[str]) -> Any:
    """A NIXL agent with these backends (NIXL's own exceptions propagate)."""
    from nixl._api import nixl_agent, nixl_agent_config

    quiet_progress_threads()
    return nixl_agent(name, nixl_agent_config(backends=backends))
