"""A scripted worker for test_router_events: the real Dynamo runtime (file discovery, TCP request
plane, ZMQ event plane, all on 127.0.0.1), a relay-mode KvEventPublisher fed by our KvEventRelay,
a real KvRouter, and the reference engine with host+disk offload; events go through a ZMQ broker as
in served graphs. Prints one JSON line per check: what the router reports per tier against what
the worker holds. Run as a script (own process: the runtime's threads and NIXL's exit path stay
out of pytest): ``router_scenario.py WORKDIR [tiers|bursts]``."""

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from dynamo._core import (
    DistributedRuntime,
    KvEventPublisher,
    KvRouter,
    KvRouterConfig,
    ModelInput,
    ModelType,
    WorkerType,
    register_model,
)

from dynamo_flexkv import CacheConfig, KVManager
from dynamo_flexkv.core.index import Tier
from dynamo_flexkv.core.offload import EmbeddedOffload
from dynamo_flexkv.core.sysutil import free_port
from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
from dynamo_flexkv.integrations.events import KvEventRelay, OffloadEvents
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine, SamplingParams

CFG = EngineModelConfig.preset("tiny")
BS = CFG.block_size


def expected(engine, kv, prompt):
    """What the worker holds, in the router's terms: each tier's count is the prefix available from
    that tier or a faster one (host_pinned_blocks covers device blocks too; disk covers both)."""
    device = engine.pool.peek(kv.hashes(prompt).sequence)
    m = kv.match(prompt)
    host = max(device, m["host"] // BS)
    return {"device": device, "host": host, "disk": max(host, m["disk"] // BS)}


def observed(scores):
    rows = scores["workers"]
    if not rows:
        return {"device": 0, "host": 0, "disk": 0}
    r = rows[0]
    return {"device": r["device_blocks"], "host": r["host_pinned_blocks"], "disk": r["disk_blocks"]}


class Checker:
    """Compares what the router reports for a prompt with what the worker holds, per tier."""

    def __init__(self, router) -> None:
        self.router, self.failures = router, 0

    async def check(self, name, engine, kv, prompt, timeout=10.0):
        assert await asyncio.to_thread(kv.drain, 30)  # background disk writes land before we look
        want = expected(engine, kv, prompt)
        start = time.monotonic()
        while True:
            got = observed(await self.router.get_overlap_scores(prompt))
            if got == want or time.monotonic() > start + timeout:
                break
            await asyncio.sleep(0.1)
        self.failures += got != want
        waited = round(time.monotonic() - start, 2)  # until the router agreed (events in flight)
        print(json.dumps({"check": name, "want": want, "got": got, "waited_s": waited}), flush=True)


def cache_config(workdir, host_blocks, disk_blocks):
    gb = CFG.kv_spec().token_bytes() * BS / (1 << 30)
    return CacheConfig.from_dict(
        dict(
            tokens_per_block=BS,
            cpu_cache_gb=host_blocks * gb,
            ssd_cache_gb=disk_blocks * gb,
            ssd_cache_dir=os.path.join(workdir, "ssd"),
        )
    )


def device_events(relay):
    return dict(
        on_device_stored=lambda h, p, t: relay.stored(None, h, p, t), on_device_removed=lambda h: relay.removed(None, h)
    )


async def tiers(workdir, relay, checker) -> None:
    """A prompt's blocks move through device, host and disk, then a restart re-announces disk."""
    cfg = cache_config(workdir, 64, 256)
    with KVManager(CFG.kv_spec(), cfg, listener=OffloadEvents(relay)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=24, offload=EmbeddedOffload(kv), **device_events(relay))
        rng = np.random.default_rng(0)
        a = rng.integers(0, CFG.vocab_size, 6 * BS + 5).tolist()

        async def check(name, prompt):
            await checker.check(name, engine, kv, prompt)

        engine.generate([a], SamplingParams(max_tokens=1))
        engine.flush()
        await check("after-first-request", a)  # device, host and disk hold a's 6 full blocks
        for _i in range(3):  # other prompts push a's tail out of the 24-block device cache (not host's 64);
            # its first 2 blocks stay: eviction takes tails first, so what stays is a usable prefix
            engine.generate([rng.integers(0, CFG.vocab_size, 7 * BS).tolist()], SamplingParams(max_tokens=1))
            engine.flush()
        await check("after-device-eviction", a)
        kv.cache.tiers[Tier.HOST].evict(10**9)
        await check("after-host-eviction", a)
        b = a[: 3 * BS] + rng.integers(0, CFG.vocab_size, 4 * BS).tolist()
        engine.generate([b], SamplingParams(max_tokens=1))  # a's 3rd block comes back from disk
        engine.flush()
        await check("shared-prefix-request", b)
        await check("first-prompt-again", a)
    # Restart: the router forgets this worker (a new process would be a new worker); the new
    # KVManager re-adopts the disk tier from its journal and announces it again.
    relay.cleared()
    with KVManager(CFG.kv_spec(), cfg, listener=OffloadEvents(relay)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=24, offload=EmbeddedOffload(kv))
        announced = kv.announce_adopted()
        print(json.dumps({"announced": announced}), flush=True)
        await checker.check("restart-first-prompt", engine, kv, a)
        await checker.check("restart-shared-prefix", engine, kv, b)


async def bursts(workdir, relay, checker) -> None:
    """Bursts of long prompts (2,000+ tokens) into a full device cache: each burst evicts and
    stores hundreds of blocks per tier within a fraction of a second. After each, the router's
    view of every prompt sent so far equals what the worker holds, tier by tier."""
    with KVManager(CFG.kv_spec(), cache_config(workdir, 256, 768), listener=OffloadEvents(relay)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=320, offload=EmbeddedOffload(kv), **device_events(relay))
        rng = np.random.default_rng(1)
        system = rng.integers(0, CFG.vocab_size, 40 * BS).tolist()  # a shared system prompt
        sent = []
        for burst in range(3):
            prompts = [system + rng.integers(0, CFG.vocab_size, 125 * BS + 7).tolist() for _ in range(4)]
            prompts += [rng.integers(0, CFG.vocab_size, 130 * BS).tolist() for _ in range(2)]
            if sent:  # a returning prompt: its head comes back from wherever it still is
                prompts.append(sent[0])
            for p in prompts:
                engine.add_request(p, SamplingParams(max_tokens=1))
            while engine.has_unfinished():
                engine.step()
            engine.flush()
            sent += prompts
            for i, p in enumerate(sent):
                await checker.check(f"burst-{burst}-prompt-{i}", engine, kv, p)
        print(
            json.dumps(
                {
                    "device_evictions": engine.pool.evictions,
                    "host_evictions": kv.cache.tiers[Tier.HOST].evictions,
                    "disk_evictions": kv.cache.tiers[Tier.DISK].evictions,
                }
            ),
            flush=True,
        )


@contextlib.asynccontextmanager
async def relay_and_router(workdir: str):
    """A registered tiny-model worker endpoint with a relay-mode KvEventPublisher fed by our
    KvEventRelay, and a separate KvRouter that learns only from the events: (relay, router)."""
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    ep = rt.endpoint("flexkv.worker.generate")

    async def handler(request, context=None):
        yield {"ok": True}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    model_dir = write_model_dir(CFG, os.path.join(workdir, "model"))  # real assets: config + tokenizer
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat,
        ep,
        str(model_dir),
        "flexkv-tiny",
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=BS,
    )
    relay = KvEventRelay(BS)
    # Relay mode: the publisher subscribes to our PUB socket and forwards to the router. Keep the
    # reference: dropping it stops the relay.
    publisher = KvEventPublisher(ep, kv_block_size=BS, zmq_endpoint=relay.endpoint, enable_local_indexer=True)
    router = KvRouter(ep, BS, KvRouterConfig())
    try:
        if not relay.wait_for_subscriber(30):
            raise RuntimeError("the KvEventPublisher never subscribed to the relay")
        await router_hears(relay, router)
        yield relay, router
    finally:
        relay.close()
        del publisher
        serving.cancel()
        rt.shutdown()


async def router_hears(relay, router, timeout: float = 60.0) -> None:
    """Waits until the router's subscription carries events: a probe block is stored until the
    router counts it (a store sent before the subscription reached the broker is lost, so each try
    is a new block), then the counted probe is removed and its removal seen."""
    rng = np.random.default_rng(12345)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = rng.integers(0, CFG.vocab_size, BS).tolist()
        h = int(rng.integers(1, 2**62))
        relay.stored(None, [h], None, probe)
        for _ in range(10):
            await asyncio.sleep(0.1)
            if observed(await router.get_overlap_scores(probe))["device"] == 1:
                relay.removed(None, [h])
                while observed(await router.get_overlap_scores(probe))["device"] != 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the router never applied the probe block's removal")
                    await asyncio.sleep(0.1)
                return
    raise RuntimeError(f"the router counted no probe block within {timeout:.0f} s: its event subscription never worked")


def run_with_broker(work: str, coro_fn) -> None:
    """Runs ``coro_fn()`` (returns an exit code) with Dynamo on loopback, file discovery under
    ``work`` and the event plane through a ZMQ broker as the launcher serves graphs (that path has
    the router's 64-frame lane per worker); exits the process with the code."""
    from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)
    os.environ["DYN_FILE_KV"] = os.path.join(work, "discovery")
    xsub, xpub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    broker = subprocess.Popen([sys.executable, "-m", "dynamo_flexkv.serve.zmq_broker", xsub, xpub])
    os.environ["DYN_ZMQ_BROKER_URL"] = f"xsub={xsub} , xpub={xpub}"
    try:
        code = asyncio.run(coro_fn())
    finally:
        broker.terminate()
        broker.wait(10)
    sys.stdout.flush()
    os._exit(code)  # the runtime keeps background tasks; nothing left to flush


async def main(workdir: str, scenario: str) -> int:
    async with relay_and_router(workdir) as (relay, router):
        checker = Checker(router)
        await {"tiers": tiers, "bursts": bursts}[scenario](workdir, relay, checker)
        print(
            json.dumps({"relay": {"frames": relay.sent, "events": relay.events_sent, "skipped": relay.skipped}}),
            flush=True,
        )
    return 1 if checker.failures else 0


if __name__ == "__main__":
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    scenario = sys.argv[2] if len(sys.argv) > 2 else "tiers"
    run_with_broker(work, lambda: main(work, scenario))
