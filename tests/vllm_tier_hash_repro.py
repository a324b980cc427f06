"""Reproduction (not collected by pytest) of why FlexKVConnector's tier events must name blocks by
vLLM's own block hashes: Dynamo 1.6.1's KvRouter starts a worker's host/disk walk at the last block
its device matched, anchored on that block's external hash (the engine's). Lower-tier blocks named
otherwise are cut off at the device prefix. Found by test_vllm_graph_e2e.py on the served graph,
where the connector named its host/disk blocks by our sequence hashes and vLLM its device blocks by
vLLM's; fixed in 70db498 (the tiers now carry vLLM's hash of each block, from request.block_hashes).

One scripted worker (the real runtime, a relay-mode KvEventPublisher fed by our KvEventRelay, events
through the ZMQ broker, as tests/router_scenario.py) stores 12 blocks in device, host and disk, then
removes the device's last 8 blocks, then the host's last 4, then the device's first 4. ``same``:
device events under the tiers' hashes (the connector now; the reference worker); ``distinct``: under
other hashes (the connector before the fix). Seen here (device, host_pinned, disk blocks):

    same:     (12,12,12) (4,12,12) (4,8,12) (0,8,12)
    distinct: (12,12,12) (4,4,4)   (4,4,4)  (0,8,12)   <- host/disk cut to the device prefix

In the served graph the cut showed as requests that loaded most of their prompt from host/disk while
get_overlap_scores and the frontend's router ("Selected worker ... host_pinned_blocks=0
disk_blocks=0") counted only the few blocks still on the device: a worker whose device keeps a
prompt's first blocks (a shared system prompt) got no credit for the rest it holds in host/disk.

    python tests/vllm_tier_hash_repro.py same       # exit 0
    python tests/vllm_tier_hash_repro.py distinct   # exit 1: the router cut host/disk to the device prefix
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from dynamo._core import (DistributedRuntime, KvEventPublisher, KvRouter, KvRouterConfig, ModelInput, ModelType,
                          WorkerType, register_model)

from dynamo_flexkv.dynamo.model_dir import write_model_dir
from dynamo_flexkv.engine import EngineModelConfig
from dynamo_flexkv.events import KvEventRelay
from dynamo_flexkv.index import Tier

CFG = EngineModelConfig.preset("tiny")
BS = CFG.block_size


async def main(work: str, same: bool) -> int:
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    ep = rt.endpoint("flexkv.worker.generate")

    async def handler(request, context=None):
        yield {"ok": True}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    await register_model(ModelInput.Tokens, ModelType.Chat, ep, str(write_model_dir(CFG, os.path.join(work, "model"))),
                         "flexkv-tiny", worker_type=WorkerType.Aggregated, kv_cache_block_size=BS)
    relay = KvEventRelay(BS)
    publisher = KvEventPublisher(ep, kv_block_size=BS, zmq_endpoint=relay.endpoint, enable_local_indexer=True)
    router = KvRouter(ep, BS, KvRouterConfig())
    assert relay.wait_for_subscriber(30)
    await asyncio.sleep(3)  # the router's subscription reaches the broker
    n = 12
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, n * BS).tolist()
    tiers = [1000 + i for i in range(n)]  # host and disk: our sequence hashes
    device = tiers if same else [5000 + i for i in range(n)]  # vLLM's own block hashes
    seen = []

    async def check(step: str, want: tuple) -> None:
        relay.flush()
        await asyncio.sleep(2)
        rows = (await router.get_overlap_scores(tokens))["workers"]
        got = tuple((r["device_blocks"], r["host_pinned_blocks"], r["disk_blocks"]) for r in rows)[0]
        seen.append(got == want)
        print(json.dumps({"hashes": "same" if same else "distinct", "step": step, "want": want, "got": got}),
              flush=True)

    relay.stored(None, device, None, tokens)
    relay.stored(Tier.HOST, tiers, None, tokens)
    relay.stored(Tier.DISK, tiers, None, tokens)
    await check("all three tiers hold 12 blocks", (12, 12, 12))
    relay.removed(None, device[4:][::-1])
    await check("the device keeps the first 4", (4, 12, 12))
    relay.removed(Tier.HOST, tiers[8:][::-1])
    await check("the host keeps the first 8", (4, 8, 12))
    relay.removed(None, device[:4][::-1])
    await check("the device keeps none", (0, 8, 12))
    relay.close()
    del publisher
    serving.cancel()
    rt.shutdown()
    return 0 if all(seen) else 1


if __name__ == "__main__":
    from router_scenario import free_port
    from dynamo_flexkv.dynamo import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)
    os.environ.setdefault("DYN_LOG", "error")
    work = tempfile.mkdtemp()
    os.environ["DYN_FILE_KV"] = os.path.join(work, "discovery")
    xsub, xpub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    broker = subprocess.Popen([sys.executable, "-m", "dynamo_flexkv.serve.zmq_broker", xsub, xpub])
    os.environ["DYN_ZMQ_BROKER_URL"] = f"xsub={xsub} , xpub={xpub}"
    try:
        code = asyncio.run(main(work, (sys.argv[1] if len(sys.argv) > 1 else "distinct") == "same"))
    finally:
        broker.terminate()
        broker.wait(10)
    sys.stdout.flush()
    os._exit(code)
