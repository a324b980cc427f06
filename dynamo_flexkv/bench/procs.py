"""Stopping what a benchmark started: a process in its own process group (start_new_session),
with the processes it spawned (vLLM's EngineCore and Worker, a cache server's helpers)."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Optional, Sequence, Tuple

# (signal to the group, or None to just wait; seconds to wait for the leader after it)
TERM_THEN_KILL: Sequence[Tuple[Optional[int], float]] = ((signal.SIGTERM, 20), (signal.SIGKILL, 10))


def stop_group(p: subprocess.Popen, steps: Sequence[Tuple[Optional[int], float]] = TERM_THEN_KILL) -> None:
    """Each step's signal to ``p``'s process group until ``p`` exits, then SIGKILL to whatever of
    the group is still alive (children outliving their parent)."""
    for sig, wait_s in steps:
        if sig is not None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
        try:
            p.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
