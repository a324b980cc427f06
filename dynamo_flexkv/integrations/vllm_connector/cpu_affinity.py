"""Keeps a CPU vLLM worker's model thread on the core vLLM's OpenMP binding gave it.

vLLM's CPU executor gives each worker process its cores (from VLLM_CPU_OMP_THREADS_BIND, or its
own "auto" choice, sorted and sliced per worker) as the binding variable of the OpenMP runtime in
LD_PRELOAD: KMP_AFFINITY's proclist, GOMP_CPU_AFFINITY, or else OMP_PLACES with OMP_PROC_BIND
(vllm/utils/ompmultiprocessing.py).
OpenMP thread i is pinned to the i-th core of that list, so the thread that runs the model,
OpenMP's thread 0, sits on its first core. Two things move it:

* NixlConnector, our sibling in the disaggregated graphs, pins the thread that creates it to the
  last core of each NUMA node ("reserve different cores for start_load_kv() from model_forward()",
  nixl/base_worker.py): a prefill worker bound to core 0 had all 59 threads on core 1, next to the
  decode worker.
* Widening it to the whole list is as bad: the model thread then wanders onto a core whose
  OpenMP thread is pinned there, the two share it at half speed while the other core idles (and
  vLLM's engine core, spinning on its reply, fills it). Measured: 8K-token misses of a 2-core
  worker took 1.15-1.19 s (medians) with the thread on its core and 1.33-1.38 s while it floated.

So FlexKVConnector starts its helper threads (transfers, hashing, lookups) on the whole list,
which they inherit and share with whatever is idle, then puts the model thread back on the list's
first core; again when vLLM registers the KV caches (after every connector of a MultiConnector
was created, whatever their order). Where vLLM bound nothing (VLLM_CPU_OMP_THREADS_BIND=nobind, or
no binding variable in the worker's environment), nothing is moved.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PROCLIST = re.compile(r"proclist=\[([^\]]*)\]")
MAX_CORE = 1 << 16  # beyond any Linux CPU set: a larger id is not a core vLLM wrote
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits only, as the OpenMP runtimes read them


def _ids(text: str, sep: str) -> list[int] | None:
    """Cores of a list such as "0 1 2" or "0,2-3" in its order, duplicates dropped; None when
    anything in it is not a core id or an ascending range of them (strides and the like, which
    vLLM does not write, included)."""
    out: list[int] = []
    for item in filter(None, (s.strip() for s in re.split(sep, text))):
        m = _ITEM.fullmatch(item)
        if m is None:
            return None
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        if last < first or last >= MAX_CORE:
            return None
        out.extend(range(first, last + 1))
    return list(dict.fromkeys(out)) or None


@dataclass(frozen=True)
class OmpBinding:
    """The cores vLLM bound this worker's OpenMP threads to, in thread order, and whether each
    thread has its own core (GNU and Intel OpenMP lists) or all share them (OMP_PLACES with one
    place)."""

    cores: list[int]
    one_per_thread: bool

    @property
    def model_cores(self) -> list[int]:
        """Where OpenMP's thread 0, the model's, belongs."""
        return self.cores[:1] if self.one_per_thread else self.cores


def omp_binding(environ: Mapping[str, str] | None = None) -> OmpBinding | None:
    """The binding vLLM set for the OpenMP runtime it found, chosen as vLLM chooses it (by the
    runtime in LD_PRELOAD): KMP_AFFINITY's proclist for Intel's, GOMP_CPU_AFFINITY for GNU's,
    OMP_PLACES (one place, OMP_PROC_BIND=true) otherwise; None when it bound nothing we can read."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "")
    cores, per_thread = None, True
    if "libiomp" in preload or "libomp" in preload:
        m = _PROCLIST.search(env.get("KMP_AFFINITY", ""))
        cores = _ids(m.group(1), r",") if m else None
    elif "libgomp" in preload:
        cores = _ids(env.get("GOMP_CPU_AFFINITY", ""), r"[\s,]+")
    elif env.get("OMP_PROC_BIND", "").strip().lower() == "true":
        places = env.get("OMP_PLACES", "").strip()
        if places.startswith("{") and places.endswith("}") and places.count("{") == 1:
            cores, per_thread = _ids(places[1:-1], r","), False
    return None if cores is None else OmpBinding(cores, per_thread)


def _move(cpus: list[int], why: str) -> bool:
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, OverflowError) as e:  # cores outside this process's cgroup: leave it as vLLM set it
        log.warning(
            "FlexKVConnector: cannot move the worker thread to cores %s for %s (%s): it stays on %s",
            cpus,
            why,
            e,
            sorted(os.sched_getaffinity(0)),
        )
        return False
    return True


def restore_bind() -> bool:
    """Puts the calling thread (the one that runs the model) back where vLLM's OpenMP binding put
    it, the first core of this worker's list, if something moved it; True if it did."""
    bound = omp_binding()
    if bound is None or not hasattr(os, "sched_setaffinity"):
        return False
    home, now = bound.model_cores, os.sched_getaffinity(0)
    if now == set(home) or not _move(home, "the model"):
        return False
    log.info(
        "FlexKVConnector: worker thread moved back from cores %s to %s, where vLLM's OpenMP binding put it "
        "(NixlConnector pins it on CPU platforms)",
        sorted(now),
        home,
    )
    return True


_depth = threading.local()


@contextlib.contextmanager
def helpers_on_bind_cores() -> Iterator[None]:
    """Threads the calling thread starts inside may run on every core of this worker's list; when
    the outermost use ends, the calling thread goes back to its own core (``restore_bind``)."""
    depth = getattr(_depth, "n", 0)
    bound = omp_binding()
    if depth == 0 and bound is not None and hasattr(os, "sched_setaffinity"):
        _move(bound.cores, "its helper threads")
    _depth.n = depth + 1
    try:
        yield
    finally:
        _depth.n = depth
        if depth == 0:
            restore_bind()
