"""A scripted worker for test_router_events: the real Dynamo runtime (file discovery, TCP request
plane, ZMQ event plane, all on 127.0.0.1), a relay-mode KvEventPublisher fed by our KvEventRelay,
a real KvRouter, and the reference engine with host+disk offload. Prints one JSON line per check:
what the router reports per tier against what the worker holds. Run as a script (own process:
the runtime's threads and NIXL's exit path stay out of pytest)."""

import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

from dynamo._core import (DistributedRuntime, KvEventPublisher, KvRouter, KvRouterConfig, ModelInput, ModelType,
                          WorkerType, register_model)

from dynamo_flexkv import CacheConfig, KVManager
from dynamo_flexkv.dynamo.model_dir import write_model_dir
from dynamo_flexkv.engine import EngineModelConfig, LLMEngine, SamplingParams
from dynamo_flexkv.events import KvEventRelay, OffloadEvents
from dynamo_flexkv.index import Tier

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


async def main(workdir: str) -> int:
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    ep = rt.endpoint("flexkv.worker.generate")

    async def handler(request, context=None):
        yield {"ok": True}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    model_dir = write_model_dir(CFG, os.path.join(workdir, "model"))  # real assets: config + tokenizer
    await register_model(ModelInput.Tokens, ModelType.Chat, ep, str(model_dir), "flexkv-tiny",
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=BS)
    relay = KvEventRelay(BS)
    # Relay mode: the publisher subscribes to our PUB socket and forwards to the router. Keep the
    # reference: dropping it stops the relay.
    publisher = KvEventPublisher(ep, kv_block_size=BS, zmq_endpoint=relay.endpoint, enable_local_indexer=True)
    router = KvRouter(ep, BS, KvRouterConfig())
    await asyncio.sleep(1.0)  # let the relay's subscriber connect before the first event

    block_bytes = CFG.kv_spec().token_bytes() * BS
    gb = block_bytes / (1 << 30)
    cfg = CacheConfig.from_dict(dict(tokens_per_block=BS, cpu_cache_gb=64 * gb, ssd_cache_gb=256 * gb,
                                     ssd_cache_dir=os.path.join(workdir, "ssd")))
    failures = 0
    with KVManager(CFG.kv_spec(), cfg, listener=OffloadEvents(relay)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=24, kv_manager=kv,
                           on_device_stored=lambda h, p, t: relay.stored(None, h, p, t),
                           on_device_removed=lambda h: relay.removed(None, h))
        rng = np.random.default_rng(0)
        a = rng.integers(0, CFG.vocab_size, 6 * BS + 5).tolist()

        async def check(name, prompt):
            nonlocal failures
            while kv.cache.task_ids():  # background disk writes land before we look
                await asyncio.sleep(0.01)
            want = expected(engine, kv, prompt)
            deadline = time.monotonic() + 10
            while True:
                got = observed(await router.get_overlap_scores(prompt))
                if got == want or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            failures += got != want
            print(json.dumps({"check": name, "want": want, "got": got}), flush=True)

        engine.generate([a], SamplingParams(max_tokens=1))
        engine.flush()
        await check("after-first-request", a)  # device, host and disk hold a's 6 full blocks
        for i in range(3):  # other prompts push `a` out of the 24-block device cache (not host's 64)
            engine.generate([rng.integers(0, CFG.vocab_size, 7 * BS).tolist()], SamplingParams(max_tokens=1))
            engine.flush()
        await check("after-device-eviction", a)
        kv.cache.tiers[Tier.HOST].evict(10**9)
        await check("after-host-eviction", a)
        b = a[: 3 * BS] + rng.integers(0, CFG.vocab_size, 4 * BS).tolist()
        engine.generate([b], SamplingParams(max_tokens=1))  # loads a's first blocks back from disk
        engine.flush()
        await check("shared-prefix-request", b)
        await check("first-prompt-again", a)
    # Restart: the router forgets this worker (a new process would be a new worker); the new
    # KVManager re-adopts the disk tier from its journal and announces it again.
    relay.cleared()
    with KVManager(CFG.kv_spec(), cfg, listener=OffloadEvents(relay)) as kv:
        engine = LLMEngine(CFG, num_device_blocks=24, kv_manager=kv)
        announced = kv.announce_adopted()
        print(json.dumps({"announced": announced}), flush=True)
        await check("restart-first-prompt", a)
        await check("restart-shared-prefix", b)
    relay.close()
    del publisher
    serving.cancel()
    rt.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    from dynamo_flexkv.dynamo import LOOPBACK_ENV
    os.environ.update(LOOPBACK_ENV)
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.environ["DYN_FILE_KV"] = os.path.join(work, "discovery")
    code = asyncio.run(main(work))
    sys.stdout.flush()
    os._exit(code)  # the runtime keeps background tasks; nothing left to flush
