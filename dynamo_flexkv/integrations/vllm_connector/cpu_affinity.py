"""Undoes vLLM 0.31 NixlConnector's CPU pin, for the disaggregated graphs on a CPU platform.

On a CPU platform NixlConnector's worker pins the thread that creates it to the last core of each
NUMA node ("reserve different cores for start_load_kv() from model_forward()",
nixl/base_worker.py). That thread is the vLLM worker's main thread, which runs the model, and
every thread started after it inherits the pin. On a one-node machine every worker then computes
on the same last core, whatever VLLM_CPU_OMP_THREADS_BIND gave it (measured here: a prefill
worker bound to core 0 had all 59 threads on core 1, next to the decode worker). FlexKVConnector
puts the thread back on the worker's own cores when it is created and again when vLLM registers the
KV caches (after every connector of a MultiConnector was created, whatever their order).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Set

log = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_cpus(value: Optional[str], rank: int = 0) -> Optional[Set[int]]:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value gives ``rank`` ("0-3,5"; ranks split by "|");
    None for "auto", "nobind", "all" or an unset/unreadable value (nothing to restore)."""
    if not value or value.strip() in ("auto", "nobind", "all"):
        return None
    parts = value.split("|")
    if rank >= len(parts):
        return None
    cpus: Set[int] = set()
    try:
        for item in parts[rank].split(","):
            lo, _, hi = item.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return cpus or None


def restore_bind(rank: int = 0) -> bool:
    """Puts the calling thread back on its VLLM_CPU_OMP_THREADS_BIND cores if something moved it;
    True if it did."""
    want = bind_cpus(os.environ.get(BIND_ENV), rank)
    if want is None or not hasattr(os, "sched_setaffinity"):
        return False
    now = os.sched_getaffinity(0)
    if now == want:
        return False
    try:
        os.sched_setaffinity(0, want)
    except OSError as e:  # cores outside this process's cgroup: leave it as vLLM set it
        log.warning("FlexKVConnector: cannot restore the worker thread's cores %s (%s): it stays on %s",
                    sorted(want), e, sorted(now))
        return False
    log.info("FlexKVConnector: worker thread moved back from cores %s to %s (%s; NixlConnector pins it "
             "on CPU platforms)", sorted(now), sorted(want), BIND_ENV)
    return True
