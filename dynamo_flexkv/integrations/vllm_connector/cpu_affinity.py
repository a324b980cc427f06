"""Keeps a CPU vLLM worker's model thread on the core vLLM's OpenMP binding gave it.

vLLM's CPU worker binds OpenMP thread i to the i-th core of its VLLM_CPU_OMP_THREADS_BIND list
(GOMP_CPU_AFFINITY, KMP_AFFINITY or OMP_PLACES; vllm/utils/ompmultiprocessing.py), so the thread
that runs the model, OpenMP's thread 0, sits on the list's first core. Two things move it:

* NixlConnector, our sibling in the disaggregated graphs, pins the thread that creates it to the
  last core of each NUMA node ("reserve different cores for start_load_kv() from model_forward()",
  nixl/base_worker.py): a prefill worker bound to core 0 had all 59 threads on core 1, next to the
  decode worker.
* Widening it to the whole list is as bad: the model thread then wanders onto a core whose
  OpenMP thread is pinned there, the two share it at half speed while the other core idles (and
  vLLM's engine core, spinning on its reply, fills it). Measured: 8K-token prefills of a 2-core
  worker ran 1.14-1.18 s with the thread on its core and 1.21-1.75 s while it floated.

So FlexKVConnector creates its helper threads (transfers, hashing, lookups) with the whole list,
which they inherit and share with whatever is idle, then puts the model thread back on the
list's first core; again when vLLM registers the KV caches (after every connector of a
MultiConnector was created, whatever their order).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, List, Optional, Set

log = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_list(value: Optional[str], rank: int = 0) -> Optional[List[int]]:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value gives ``rank``, in its order ("0-3,5"; ranks
    split by "|"); None for "auto", "nobind", "all" or an unset/unreadable value (vLLM then
    binds nothing we could restore)."""
    if not value or value.strip() in ("auto", "nobind", "all"):
        return None
    parts = value.split("|")
    if rank >= len(parts):
        return None
    cpus: List[int] = []
    try:
        for item in parts[rank].split(","):
            lo, _, hi = item.strip().partition("-")
            cpus.extend(c for c in range(int(lo), int(hi or lo) + 1) if c not in cpus)
    except ValueError:
        return None
    return cpus or None


def bind_cpus(value: Optional[str], rank: int = 0) -> Optional[Set[int]]:
    """``bind_list`` as a set."""
    cpus = bind_list(value, rank)
    return None if cpus is None else set(cpus)


def _set(cpus: Set[int]) -> bool:
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # cores outside this process's cgroup: leave it as vLLM set it
        log.warning("FlexKVConnector: cannot move the worker thread to cores %s (%s): it stays on %s",
                    sorted(cpus), e, sorted(os.sched_getaffinity(0)))
        return False
    return True


def restore_bind(rank: int = 0) -> bool:
    """Puts the calling thread (the one that runs the model) back on the core vLLM's binding gave
    it, the first of its VLLM_CPU_OMP_THREADS_BIND list, if something moved it; True if it did."""
    cpus = bind_list(os.environ.get(BIND_ENV), rank)
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return False
    home, now = {cpus[0]}, os.sched_getaffinity(0)
    if now == home or not _set(home):
        return False
    log.info("FlexKVConnector: worker thread moved back from cores %s to core %d (OpenMP's thread 0 of %s=%s; "
             "NixlConnector pins it on CPU platforms)", sorted(now), cpus[0], BIND_ENV, os.environ.get(BIND_ENV))
    return True


@contextlib.contextmanager
def helpers_on_bind_cores(rank: int = 0) -> Iterator[None]:
    """Threads the calling thread starts inside may run on every core of its bind list; on the
    way out the calling thread goes back to its own core (``restore_bind``)."""
    cpus = bind_list(os.environ.get(BIND_ENV), rank)
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        _set(set(cpus))
    try:
        yield
    finally:
        restore_bind(rank)
