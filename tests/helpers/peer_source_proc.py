"""A peer source in a process of its own (test_peer_pull's SIGKILL test): fills its host tier
with the blocks of the prompt its arguments name, serves them, prints its endpoint and waits."""

import json
import sys
import time

from kv_helpers import MODEL, config, device_tensors, fill

from dynamo_flexkv import KVLayoutType, KVManager
from dynamo_flexkv.core.peer import PeerSource, SourceLimits, host_agent


def main() -> None:
    tmp, secret, first, blocks = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
    kv = KVManager(MODEL, config(tmp, host_blocks=2 * blocks, disk_blocks=0), model_id="m")
    layout = KVLayoutType.LAYERBLOCK
    dev = device_tensors(layout, blocks)
    kv.register_device_cache(dev, layout)
    tokens = list(range(first, first + 16 * blocks))
    for i, h in enumerate(kv.hashes(tokens).sequence):
        fill(dev, layout, i, int(h))
    kv.wait([kv.put_async(tokens, list(range(blocks)))])
    source = PeerSource(kv, host_agent(kv), secret, limits=SourceLimits(lease_s=30.0, max_pinned_blocks=blocks))
    print(json.dumps({"endpoint": source.endpoint}), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
