"""Two real vLLM engines (CPU) in the roles of the disagg_vllm graph, each with MultiConnector
[FlexKVConnector, NixlConnector]: the prefill engine computes a prompt (do_remote_decode), the
decode engine reads its KV over NIXL (FlexKVConnector's handover) and generates. Checks, from inside
both workers, that the KV bytes decode holds for the prompt equal the bytes prefill computed
(torch.equal, every layer, every full block), and that decode's FlexKVConnector stored what it
received in its own tiers. Run by tests/served/test_vllm_disagg.py:

    python tests/helpers/vllm_disagg_kv_check.py MODEL_DIR OUT.json RUN_DIR

MODEL_DIR holds seeded weights, served in float32; decode's generation and the prefill engine's
own (computed) one are written with their logprobs for tests/helpers/exactness.py's oracle."""

from __future__ import annotations

import json
import os
import random
import sys

from exactness import EXACT_DTYPE, Generation, connector_extra


def _ours(worker=None):
    """This worker's FlexKVConnector inside the MultiConnector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    return next(c for c in getattr(group, "_connectors", [group]) if hasattr(c, "transfer_log"))


def _stores(worker):
    ours = _ours()
    ours.drain(60)
    return [(r.req_id, list(r.block_ids), r.ok) for r in ours.transfer_log if r.kind == "store"]


def _handovers(worker):
    return [(r.req_id, list(r.block_ids), r.nbytes, r.ok) for r in _ours().transfer_log if r.kind == "handover"]


def _blocks(worker, block_ids):
    return [t[block_ids].clone() for t in worker.model_runner.kv_caches]


def engine(model_dir: str, run_dir: str, name: str, port: int, core: int):
    from vllm import LLM

    from dynamo_flexkv.bench.vllm_disagg import disagg_transfer_config

    os.makedirs(os.path.join(run_dir, name), exist_ok=True)
    # Read by the worker process vLLM spawns now: each engine its own NIXL handshake port, core,
    # host tier and SSD directory.
    os.environ.update(
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(port),
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        FLEXKV_CPU_CACHE_GB="0.1",
        FLEXKV_SSD_CACHE_GB="0",
        FLEXKV_RUN_DIR=os.path.join(run_dir, name),
    )
    kt = disagg_transfer_config(os.path.join(run_dir, name))
    for child in kt["kv_connector_extra_config"]["connectors"]:  # FlexKVConnector: the wrong_kv seam, when on
        if child["kv_connector"] == "FlexKVConnector":
            child["kv_connector_extra_config"].update(connector_extra())
    return LLM(
        model=model_dir,
        dtype=EXACT_DTYPE,
        max_model_len=4096,
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

    prefill = engine(model_dir, run_dir, "prefill", 5611, 0)
    decode = engine(model_dir, run_dir, "decode", 5612, 1)
    rnd = random.Random(5)
    from dynamo_flexkv.integrations.vllm_connector.handover import KEY

    results = []
    for n_tokens in (700, 1500):  # 10 and 23 full blocks of 64, and a partial one
        prompt = [rnd.randrange(300, 30000) for _ in range(n_tokens)]
        first = prefill.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
        )[0]
        params = dict(first.kv_transfer_params)
        remote_ids = params[KEY]["blocks"]  # every full prompt block, held for decode's read
        computed = prefill.collective_rpc(_blocks, args=(list(remote_ids),))[0]  # held for decode's read
        stores_before = len(decode.collective_rpc(_stores)[0])
        handovers_before = len(decode.collective_rpc(_handovers)[0])
        out_d = decode.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=6, temperature=0, logprobs=0, extra_args={"kv_transfer_params": params}),
        )[0]
        new_stores = []
        for _ in range(50):  # the store rides on a later step's metadata: run steps until it is done
            new_stores = [s for s in decode.collective_rpc(_stores)[0][stores_before:] if s[2]]
            if new_stores:
                break
            decode.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
        stored_ids = new_stores[0][1] if new_stores else []
        full = n_tokens // 64
        restored = decode.collective_rpc(_blocks, args=(stored_ids[:full],))[0] if stored_ids else []
        equal = bool(stored_ids) and all(
            torch.equal(c[:full].contiguous().view(torch.uint8), r.contiguous().view(torch.uint8))
            for c, r in zip(computed, restored)
        )
        handovers = decode.collective_rpc(_handovers)[0][handovers_before:]
        agg = prefill.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0, logprobs=0))[
            0
        ]
        results.append(
            {
                "prompt_tokens": n_tokens,
                "remote_blocks": len(remote_ids),
                "full_blocks": full,
                "decode_stored_blocks": len(stored_ids),
                "bytes_equal": equal,
                "layers": len(computed),
                "nonzero": all(bool(c.abs().sum() > 0) for c in computed),
                "handovers": [(len(b), n, ok) for _, b, n, ok in handovers],
                "block_bytes": sum(c[0].numel() * c.element_size() for c in computed),
                "decode": Generation.of_vllm(out_d.outputs[0]).as_json(),
                "agg": Generation.of_vllm(agg.outputs[0]).as_json(),
            }
        )
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
