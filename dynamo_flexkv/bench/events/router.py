"""The router process: a DistributedRuntime and Dynamo's KvRouter that lists every simulated worker
(through file discovery), measuring event lag with probe blocks, decision latency, CPU and RSS."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from dynamo_flexkv.bench.events.plumbing import ENDPOINT, cpu_seconds, emit, read_cmd, rss_mib, worker_ids
from dynamo_flexkv.bench.events.workload import (
    BLOCK_TOKENS,
    HELLO_TOKENS,
    PROBE_INTERVAL,
    block_tokens,
    load_prompts,
    probe_tokens,
)
from dynamo_flexkv.core.http_client import scrape, sums_by

POLL_S = 0.005  # how often the router polls best_worker for a probe
DECISIONS_PER_S = 20
LIVE_TIMEOUT = 90.0  # for every simulated worker's hello to reach the router


def register_fake_workers(discovery: str, ids: Sequence[int], timeout: float = 30.0) -> list[str]:
    """Copies this process's own instance record and model card once per simulated worker id:
    file discovery then lists N workers of the model (nobody serves their requests: none is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        inst = glob.glob(os.path.join(discovery, "v1", "instances", "*"))
        mdc = glob.glob(os.path.join(discovery, "v1", "mdc", "*"))
        if inst and mdc:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no instance / model card under {discovery} after {timeout} s")
        time.sleep(0.05)
    with open(inst[0]) as f:
        instance = json.load(f)
    with open(mdc[0]) as f:
        card = json.load(f)
    tcp = instance["transport"]["tcp"].split("/", 1)[0]
    written: list[str] = []
    for wid in ids:
        h = format(wid, "x")
        rec = dict(instance, instance_id=wid, transport={"tcp": f"{tcp}/{h}/bench/worker/generate"})
        for path, obj in ((inst[0], rec), (mdc[0], dict(card, instance_id=wid))):
            target = path.rsplit("%2F", 1)[0] + "%2F" + h
            with open(target + ".tmp", "w") as f:
                json.dump(obj, f)
            os.replace(target + ".tmp", target)
            written.append(target)
    return written


def keep_alive(paths: Sequence[str], stop: threading.Event, every: float = 2.0) -> None:
    """File discovery expires records whose owner stopped refreshing them (~10 s): refresh the
    simulated workers' records as their own runtimes would."""
    while not stop.wait(every):
        for p in paths:
            try:
                os.utime(p)
            except OSError:
                pass


async def router_main(cfg: dict[str, Any]) -> None:
    from dynamo._core import (
        DistributedRuntime,
        KvRouter,
        KvRouterConfig,
        ModelInput,
        ModelType,
        WorkerType,
        register_model,
    )

    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane=cfg["transport"])
    ep = rt.endpoint(ENDPOINT)

    async def handler(request, context=None):
        yield {"error": "bench events serves no requests"}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    model = EngineModelConfig.preset("tiny")
    model_dir = write_model_dir(model, os.path.join(cfg["workdir"], "model"), name="bench-events")
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat,
        ep,
        str(model_dir),
        "bench-events",
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=BLOCK_TOKENS,
    )
    ids = worker_ids(cfg["workers"])
    paths = await asyncio.to_thread(register_fake_workers, os.environ["DYN_FILE_KV"], ids)
    stop_refresh = threading.Event()
    threading.Thread(target=keep_alive, args=(paths, stop_refresh), daemon=True).start()
    router = KvRouter(ep, BLOCK_TOKENS, KvRouterConfig())
    deadline = time.monotonic() + 120
    while True:  # the router added every simulated worker (its own instance is one more)
        rows = (await router.get_overlap_scores(probe_tokens(0)))["workers"]
        if len(rows) >= len(ids):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router lists {len(rows)} of {len(ids)} workers after 120 s")
        await asyncio.sleep(0.2)
    emit({"ready": True, "pid": os.getpid()})
    await asyncio.to_thread(read_cmd)  # the publishers are up and saying hello
    deadline = time.monotonic() + LIVE_TIMEOUT
    while True:
        rows = (await router.get_overlap_scores(HELLO_TOKENS))["workers"]
        seen_ids = {r["worker_id"] for r in rows if r["device_blocks"] >= 1}
        live = len(seen_ids)
        if live >= len(ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    missing = sorted(set(ids) - seen_ids)
    listed = {r["worker_id"] for r in rows}
    emit({"live": live, "missing": missing[:20], "missing_unlisted": sorted(set(missing) - listed)[:20]})
    await asyncio.to_thread(read_cmd)  # the publishers stopped saying hello
    before: dict[str, float] = {}
    for _ in range(50):  # what the router applied before the run, once it stops changing
        await asyncio.sleep(0.2)
        now = scrape_applied(cfg["system_port"])
        if now == before:
            break
        before = now
    emit({"applied_before": before})
    go = await asyncio.to_thread(read_cmd)
    prompts = load_prompts()
    start, end = go["t0"] + go["warmup"], go["t0"] + go["warmup"] + go["duration"]
    rng = random.Random(7)
    decisions: list[float] = []
    probe_seen: dict[int, float] = {}
    probe_polls: list[float] = []

    async def sleep_until(t: float) -> None:
        d = t - time.time()
        if d > 0:
            await asyncio.sleep(d)

    async def decide() -> None:
        i = 0
        while True:
            t = start + i / DECISIONS_PER_S
            if t >= end:
                return
            await sleep_until(t)
            tokens = block_tokens(prompts[rng.randrange(len(prompts))])
            t1 = time.perf_counter()
            await router.best_worker(tokens)
            decisions.append(time.perf_counter() - t1)
            i += 1

    async def probe(k: int, at: float) -> None:
        await sleep_until(at)
        tokens = probe_tokens(k)
        give_up = at + 30
        while time.time() < give_up:
            t1 = time.perf_counter()
            _, _, overlap = await router.best_worker(tokens)
            probe_polls.append(time.perf_counter() - t1)
            if overlap >= 1:
                probe_seen[k] = time.time()
                return
            await asyncio.sleep(POLL_S)

    loop_stalls: list[float] = []

    async def heartbeat() -> None:
        """How late this process's event loop wakes up: a late probe poll inflates the lag."""
        while time.time() < end:
            t1 = time.monotonic()
            await asyncio.sleep(0.01)
            loop_stalls.append(time.monotonic() - t1 - 0.01)

    await sleep_until(start)
    beat = asyncio.ensure_future(heartbeat())
    cpu0, wall0 = cpu_seconds(os.getpid()), time.monotonic()
    n_probes = int(go["duration"] / PROBE_INTERVAL)
    tasks = [asyncio.ensure_future(probe(k, start + k * PROBE_INTERVAL)) for k in range(n_probes)]
    await decide()
    await sleep_until(end)
    await beat
    cpu1, wall1 = cpu_seconds(os.getpid()), time.monotonic()
    rss, hwm = rss_mib(os.getpid())
    emit({"measured": True})
    cmd = await asyncio.to_thread(read_cmd)  # {"published": events the relays sent}
    await asyncio.wait(tasks, timeout=35)
    applied: dict[str, float] = {}
    deadline = time.monotonic() + cmd.get("settle", 20)
    while True:  # the router catches up with everything the publishers sent, or time is up
        applied = scrape_applied(cfg["system_port"])
        if sum(applied.values()) - sum(before.values()) >= cmd["published"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    emit(
        {
            "cpu_cores": (cpu1 - cpu0) / (wall1 - wall0),
            "rss_mib": rss,
            "hwm_mib": hwm,
            "decisions": decisions,
            "probe_polls": probe_polls,
            "probe_seen": probe_seen,
            "applied": {k: v - before.get(k, 0.0) for k, v in applied.items()},
            "workers": len(ids),
            "loop_stall_max_s": max(loop_stalls, default=0.0),
        }
    )
    for t in tasks:
        t.cancel()
    serving.cancel()
    rt.shutdown()


def scrape_applied(port: int) -> dict[str, float]:
    """dynamo_component_kv_cache_events_applied summed by (event_type, status)."""
    sums = sums_by(scrape(port, timeout=5), "dynamo_component_kv_cache_events_applied", "event_type", "status")
    return {f"{event_type}/{status}": value for (event_type, status), value in sums.items()}
