"""bench events: Dynamo's real KvRouter fed by 100 to 1,000 simulated workers that speak our
tier-tagged KV events (device, host CPU_PINNED, disk DISK, remote EXTERNAL), against the same
workers sending device events only (what a worker without offload sends), same run, same rate.

What runs (all on 127.0.0.1):
- one router process: a DistributedRuntime (file discovery, TCP request plane, the event plane
  under test), Dynamo's KvRouter on one endpoint, and N simulated workers made known to it through
  the file discovery backend (an instance record and a model card per worker id, copied from the
  router process's own registration: the router adds a worker when its card appears);
- a few publisher processes, each with one DistributedRuntime and, per simulated worker, our
  KvEventRelay (a loopback XPUB socket, the code the real workers publish with) and a relay-mode
  ``KvEventPublisher(worker_id=...)`` that subscribes to it and forwards onto the event plane: the
  same path a served worker's events take, one relay and one publisher lane per worker;
- the event plane: a ZMQ broker (dynamo_flexkv.serve.zmq_broker, as served graphs run it) or a
  nats-server.

Each simulated worker replays the Mooncake conversation trace (its own offset into it) at
``--rate`` requests/s, one trace block (512 tokens) as one KV block of BLOCK_TOKENS tokens
(workload.Scale's x1/8), prompts cut at MAX_BLOCKS blocks, through LRU tiers of CAPACITY blocks:
a request stores its missing tail in each tier (host, disk and remote write-through, as our offload
does) and evicts leaves first. Ours publishes every tier's Stored/Removed; device-only publishes
the device tier's (identical, since the device cache sees the same requests either way).

Measured over ``--duration`` s after ``--warmup`` s:
- event lag: a probe block is published by one worker every PROBE_INTERVAL s (in the same relay as
  that worker's load, so it queues behind it); the router process polls ``best_worker`` for the
  probe's tokens every POLL_S s until the router reports it: lag = seen - published (the polling
  adds up to POLL_S);
- dropped batches: events published (the relays' count) minus events the router applied
  (dynamo_component_kv_cache_events_applied, every status) once the publishers stopped, plus
  applied events whose status is not ok, and the router log's lines that report a lost or
  unapplied event (orchestrate.LOST_EVENT_MESSAGES: Dynamo's own messages, not the word "dropped");
- router CPU (cores: CPU seconds / wall seconds of the router process) and RSS;
- decision latency: ``best_worker`` calls on trace prompts (query only) at DECISIONS_PER_S.

Not exercised: real engines, real GPUs or real networks; the request plane (no request is
served); active-sequence (load) events; more than one router replica; the worker's own local
indexer (publishers run without it). All processes share 2 CPU cores here, publishers included,
so absolute lag and CPU are those of a crowded machine.

Modules: ``workload`` (the trace as block chains, a worker's LRU tiers), ``router`` and
``publisher`` (the two kinds of child process, started as ``python -m dynamo_flexkv.bench.events
ROLE CFG``), ``orchestrate`` (one case end to end, rows, cases, the plot) and ``plumbing`` (what
they share).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from dynamo_flexkv.bench.events.orchestrate import cases, check_plan, measure, plot
from dynamo_flexkv.bench.events.workload import TRACE_RATE_NOTE
from dynamo_flexkv.bench.report import Case

__all__ = ["DEFAULT_RATE", "cases", "measure", "plot", "run"]


def run(args: argparse.Namespace) -> list[Case]:
    workers = args.workers if args.workers is not None else ("20" if args.quick else "100,300,1000")
    try:
        sizes = [int(x) for x in workers.split(",")]
    except ValueError:
        raise ValueError(
            f"bench events: --workers takes comma-separated worker counts (e.g. 100,300,1000), got {workers!r}"
        ) from None
    transports = (args.transports if args.transports is not None else "zmq,nats").split(",")
    duration = args.duration if args.duration is not None else (4.0 if args.quick else 15.0)
    warmup = args.warmup if args.warmup is not None else (2.0 if args.quick else 10.0)
    rate = args.rate if args.rate is not None else DEFAULT_RATE
    check_plan(transports, sizes, rate, warmup, duration)
    plot_path = getattr(args, "plot", None)
    if plot_path and not os.access(os.path.dirname(os.path.abspath(plot_path)), os.W_OK):
        raise ValueError(f"bench events: cannot write the plot to {plot_path}: its folder is missing or read-only")
    print(
        f"bench events: {', '.join(transports)}; {sizes} simulated workers; {rate} req/s per worker; "
        f"{warmup:g} s warm-up + {duration:g} s measured per case\n  ({TRACE_RATE_NOTE})",
        flush=True,
    )
    if args.rows:
        open(args.rows, "w").close()
    # A plain kill of this process must still stop the event plane and the children it started
    # (they run in sessions of their own); signal handlers can only be set from the main thread.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main_thread else None
    try:
        rows = measure(transports, sizes, rate, warmup, duration, rows_path=args.rows)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if plot_path:
        plot(rows, plot_path)
        print(f"wrote {plot_path}")
    return cases(rows)


# Requests/s per simulated worker. The trace's mean request (12,035 tokens, 63% of its blocks never
# seen before in the trace) at 0.5 req/s is ~3,800 new prefill tokens/s per worker, what one GPU
# worker prefills; the trace's own 3.40 req/s is then ~7 such workers, and 1,000 workers carry 147x
# the trace's rate. docs/BENCHMARKS.md says more.
DEFAULT_RATE = 0.5
