"""A publisher process: per simulated worker, our KvEventRelay and a relay-mode KvEventPublisher,
and the schedule that replays the trace through each worker's tiers."""

from __future__ import annotations

import asyncio
import heapq
import os
import random
import threading
import time
from typing import Any

from dynamo_flexkv.bench.events.plumbing import ENDPOINT, WORKER_BASE, cpu_seconds, emit, percentile, read_cmd
from dynamo_flexkv.bench.events.workload import (
    BLOCK_TOKENS,
    DEVICE_TIERS,
    HELLO_HASH,
    HELLO_TOKENS,
    OURS_TIERS,
    PREROLL,
    PROBE_INTERVAL,
    SimWorker,
    chain,
    load_prompts,
    probe_hash,
    probe_tokens,
)


async def publisher_main(cfg: dict[str, Any]) -> None:
    from dynamo._core import DistributedRuntime, KvEventPublisher

    from dynamo_flexkv.integrations.events import KvEventRelay

    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane=cfg["transport"])
    ep = rt.endpoint(ENDPOINT)
    ids: list[int] = cfg["ids"]
    all_n = cfg["workers"]
    tiers = OURS_TIERS if cfg["format"] == "ours" else DEVICE_TIERS
    relays, publishers, sims = [], [], []
    for wid in ids:
        relay = KvEventRelay(BLOCK_TOKENS, flush_interval=cfg["flush_interval"])
        relays.append(relay)
        publishers.append(KvEventPublisher(ep, worker_id=wid, kv_block_size=BLOCK_TOKENS, zmq_endpoint=relay.endpoint))
        sims.append(SimWorker(relay, tiers))
    for r in relays:
        if not await asyncio.to_thread(r.wait_for_subscriber, 60):
            raise RuntimeError("a KvEventPublisher never subscribed to its relay")
    prompts = load_prompts()
    seqs_cache: dict[int, list[int]] = {}
    emit({"ready": True, "pid": os.getpid()})
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.append(read_cmd()), daemon=True)
    reader.start()
    while not got:  # hello from every worker until the run starts (see HELLO_TOKENS)
        for r in relays:
            r.stored(None, [HELLO_HASH], None, HELLO_TOKENS)
        await asyncio.to_thread(reader.join, 2.0)
    await asyncio.sleep(0.1)  # the relays' flushers sent the last hellos
    emit({"quiet": True, "events": sum(r.events_sent for r in relays)})
    go = await asyncio.to_thread(read_cmd)
    result = await asyncio.to_thread(drive, cfg, go, ids, all_n, sims, relays, prompts, seqs_cache)
    for r in relays:
        r.close()  # sends what is queued
    result["events"] = sum(r.events_sent for r in relays)
    result["frames"] = sum(r.sent for r in relays)
    result["skipped"] = sum(r.skipped for r in relays)
    emit(result)
    await asyncio.to_thread(read_cmd)  # keep the KvEventPublishers until the router settled
    del publishers
    rt.shutdown()


def drive(cfg, go, ids, all_n, sims, relays, prompts, seqs_cache) -> dict[str, Any]:
    """Runs the schedule: each worker's requests at go['rate'] per second (a random phase each),
    and the probes this process owns (probe k belongs to worker k mod N)."""
    rate, t0 = go["rate"], go["t0"]
    start, end = t0 + go["warmup"], t0 + go["warmup"] + go["duration"]
    warm_rate = max(rate, PREROLL / max(1e-3, 0.75 * go["warmup"]))  # the last quarter of the warm-up at rate
    rng = random.Random(cfg["seed"])
    heap: list[tuple[float, int, int]] = []  # (time, kind 0 request / 1 probe, worker index or probe k)
    offsets = []
    for i, wid in enumerate(ids):
        heapq.heappush(heap, (t0 + rng.random() / warm_rate, 0, i))
        offsets.append(((wid - WORKER_BASE) * len(prompts)) // all_n)
    served = [0] * len(ids)
    index_of = {wid: i for i, wid in enumerate(ids)}
    for k in range(int(go["duration"] / PROBE_INTERVAL)):
        owner = WORKER_BASE + k % all_n
        if owner in index_of:
            heapq.heappush(heap, (start + k * PROBE_INTERVAL, 1, k))
    probes: dict[int, float] = {}
    late: list[float] = []
    requests = 0
    blocks0 = None
    cpu0 = None
    while heap:
        at, kind, x = heapq.heappop(heap)
        if at >= end:
            break
        now = time.time()
        if at > now:
            time.sleep(at - now)
        elif at >= start:
            late.append(now - at)
        if blocks0 is None and at >= start:
            blocks0 = {t: list(v) for t, v in _sum_blocks(sims).items()}
            cpu0 = (cpu_seconds(os.getpid()), time.monotonic())
        if kind == 1:
            owner = index_of[WORKER_BASE + x % all_n]
            probes[x] = time.time()
            relays[owner].stored(None, [probe_hash(x)], None, probe_tokens(x))
            continue
        p = (offsets[x] + served[x]) % len(prompts)
        served[x] += 1
        hids = prompts[p]
        seqs = seqs_cache.get(p)
        if seqs is None:
            seqs = seqs_cache[p] = chain(hids)
        sims[x].serve(hids, seqs)
        if at >= start:
            requests += 1
        nxt = at + 1.0 / warm_rate
        if nxt >= t0 + 0.75 * go["warmup"]:
            nxt = (
                max(nxt, t0 + 0.75 * go["warmup"] + rng.random() / rate)
                if at < t0 + 0.75 * go["warmup"]
                else at + 1.0 / rate
            )
        heapq.heappush(heap, (nxt, 0, x))
    blocks1 = _sum_blocks(sims)
    blocks0 = blocks0 or {t: [0, 0] for t in blocks1}
    cpu1 = (cpu_seconds(os.getpid()), time.monotonic())
    cpu0 = cpu0 or cpu1
    return {
        "probes": probes,
        "requests": requests,
        "blocks": {t: [blocks1[t][0] - blocks0[t][0], blocks1[t][1] - blocks0[t][1]] for t in blocks1},
        "late_p99_s": percentile(late, 99) if late else 0.0,
        "late_max_s": max(late) if late else 0.0,
        "cpu_cores": (cpu1[0] - cpu0[0]) / max(1e-9, cpu1[1] - cpu0[1]),
    }


def _sum_blocks(sims) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in sims:
        for t, (a, b) in s.blocks.items():
            v = out.setdefault(t, [0, 0])
            v[0] += a
            v[1] += b
    return out
