"""A prefill engine in its own process for the handover fault tests: for each prompt (one JSON
list per stdin line) it computes the prompt and prints the handover (one JSON line), then serves
leases until killed."""

import json
import sys
import threading

from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
from dynamo_flexkv.integrations.disagg.roles import PrefillSide
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine
from dynamo_flexkv.integrations.reference_engine.request import SamplingParams

engine = LLMEngine(EngineModelConfig.load("tiny"), num_device_blocks=48)
side = PrefillSide(engine, KVAgent(engine.kv_cache.layers), lease_ttl=float(sys.argv[1]))
lock = threading.Lock()


def service():
    while True:
        with lock:
            side.service()
        threading.Event().wait(0.02)


threading.Thread(target=service, daemon=True).start()
for line in sys.stdin:
    prompt = json.loads(line)
    with lock:
        engine.generate([prompt], SamplingParams(max_tokens=1))
        print("HANDOVER " + json.dumps(side.hand_over(prompt)), flush=True)  # NIXL logs to stdout too
