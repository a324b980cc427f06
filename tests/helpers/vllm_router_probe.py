"""A second KV router attached to a served graph (tests/served/test_vllm_graph_e2e.py): Dynamo's real
KvRouter in its own process, on the graph's discovery directory (DYN_FILE_KV) and event plane
(DYN_ZMQ_BROKER_URL, the launcher's ZMQ broker), watching the workers' endpoint. It only listens to
the workers' KV events (device blocks from vLLM, host/disk blocks from FlexKVConnector) and routes
nothing. One JSON request per stdin line, one JSON answer per stdout line:

    {"tokens": [...], "lora_name": NAME or absent}  ->  {"workers": [{"worker_id", "device", "host", "disk"}, ...]}
    {"call": "NAMESPACE.COMPONENT.ENDPOINT", "body": {...}}  ->  {"replies": [...]}  (a request-plane
        call, e.g. dynamo.vllm's load_lora; each streamed reply's data)
    {"quit": true}     ->  exits

Run as ``vllm_router_probe.py NAMESPACE.COMPONENT.ENDPOINT BLOCK_SIZE`` with the graph's environment
(DYN_FILE_KV, DYN_ZMQ_BROKER_URL and the loopback DYN_* hosts). It prints {"ready": true} once its
router exists."""

import asyncio
import json
import os
import sys


async def main(endpoint: str, block_size: int) -> None:
    from dynamo._core import DistributedRuntime, KvRouter, KvRouterConfig

    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    router = KvRouter(rt.endpoint(endpoint), block_size, KvRouterConfig())
    print(json.dumps({"ready": True}), flush=True)
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            if "call" in req:
                client = await rt.endpoint(req["call"]).client()
                await client.wait_for_instances()
                stream = await client.round_robin(req["body"])
                print(json.dumps({"replies": [r.data() async for r in stream]}), flush=True)
                continue
            scores = await router.get_overlap_scores(req["tokens"], lora_name=req.get("lora_name"))
            rows = [
                {
                    "worker_id": int(r["worker_id"]),
                    "dp_rank": int(r.get("dp_rank") or 0),
                    "device": int(r["device_blocks"]),
                    "host": int(r["host_pinned_blocks"]),
                    "disk": int(r["disk_blocks"]),
                }
                for r in scores["workers"]
            ]
            out = {"workers": rows, "num_blocks": scores.get("num_blocks")}
        except Exception as e:  # noqa: BLE001 - the test reads the error
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    rt.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    sys.stdout.flush()
    os._exit(0)  # the runtime keeps background tasks; nothing left to flush
