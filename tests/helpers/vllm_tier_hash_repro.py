"""Reproduction (not collected by pytest) of why FlexKVConnector's tier events must name blocks by
vLLM's own block hashes: Dynamo 1.6.1's KvRouter starts a worker's host/disk walk at the last block
its device matched, anchored on that block's external hash (the engine's). Lower-tier blocks named
otherwise are cut off at the device prefix. Found by test_vllm_graph_e2e.py on the served graph,
where the connector named its host/disk blocks by our sequence hashes and vLLM its device blocks by
vLLM's; fixed in 70db498 (the tiers now carry vLLM's hash of each block, from request.block_hashes).

One scripted worker (the real runtime, a relay-mode KvEventPublisher fed by our KvEventRelay, events
through the ZMQ broker, as tests/helpers/router_scenario.py) stores 12 blocks in device, host and disk, then
removes the device's last 8 blocks, then the host's last 4, then the device's first 4. ``same``:
device events under the tiers' hashes (the connector now; the reference worker); ``distinct``: under
other hashes (the connector before the fix). Seen here (device, host_pinned, disk blocks):

    same:     (12,12,12) (4,12,12) (4,8,12) (0,8,12)
    distinct: (12,12,12) (4,4,4)   (4,4,4)  (0,8,12)   <- host/disk cut to the device prefix

In the served graph the cut showed as requests that loaded most of their prompt from host/disk while
get_overlap_scores and the frontend's router ("Selected worker ... host_pinned_blocks=0
disk_blocks=0") counted only the few blocks still on the device: a worker whose device keeps a
prompt's first blocks (a shared system prompt) got no credit for the rest it holds in host/disk.

    python tests/helpers/vllm_tier_hash_repro.py same       # exit 0
    python tests/helpers/vllm_tier_hash_repro.py distinct   # exit 1: the router cut host/disk to the device prefix
"""

import asyncio
import json
import os
import sys
import tempfile

import numpy as np
from router_scenario import BS, CFG, relay_and_router, run_with_broker

from dynamo_flexkv.core.index import Tier


async def main(work: str, same: bool) -> int:
    async with relay_and_router(work) as (relay, router):
        return await scenario(relay, router, same)


async def scenario(relay, router, same: bool) -> int:
    n = 12
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, n * BS).tolist()
    tiers = [1000 + i for i in range(n)]  # host and disk: our sequence hashes
    device = tiers if same else [5000 + i for i in range(n)]  # vLLM's own block hashes
    seen = []

    async def check(step: str, want: tuple) -> None:
        relay.flush()
        await asyncio.sleep(2)  # a reproduction, not a test: the events reach the router
        rows = (await router.get_overlap_scores(tokens))["workers"]
        got = tuple((r["device_blocks"], r["host_pinned_blocks"], r["disk_blocks"]) for r in rows)[0]
        seen.append(got == want)
        print(
            json.dumps({"hashes": "same" if same else "distinct", "step": step, "want": want, "got": got}), flush=True
        )

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
    return 0 if all(seen) else 1


if __name__ == "__main__":
    os.environ.setdefault("DYN_LOG", "error")
    work = tempfile.mkdtemp()
    run_with_broker(work, lambda: main(work, (sys.argv[1] if len(sys.argv) > 1 else "distinct") == "same"))
