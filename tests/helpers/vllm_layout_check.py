"""Runs real vLLM (CPU) with FlexKVConnector on a model layout (a hybrid sliding-window model, MLA,
tensor parallelism) and checks, from inside every rank's worker, that the KV bytes the connector
loads equal the bytes vLLM computed (torch.equal, every KV cache group, every rank). Run by
tests/served/test_vllm_layouts.py in a subprocess:

    python tests/helpers/vllm_layout_check.py MODEL_DIR OUT.json [--tp N] [--dtype D] [--scenario host,disk]

Per scenario, a fresh prompt is computed (its tokens and logprobs kept), vLLM's KV tensors are
copied once the connector reported the store (vLLM keeps the request's blocks until then), vLLM's
prefix cache is reset and its KV zeroed (``disk``: the host tier evicted as well), and the prompt
is generated again: its tokens and logprobs must equal the first (tests/helpers/exactness.py), the load
must cover the prefix, and each loaded block, by position in each group, must equal the block
the first run computed at that position."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from exactness import Generation, connector_extra


def _conn():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def _log(worker):
    return [
        (r.kind, r.req_id, list(r.block_ids), r.ok, {int(g): list(ids) for g, ids in r.groups.items()})
        for r in _conn().transfer_log
    ]


def _storages(worker):
    """vLLM's KV tensors, each once (a hybrid model's groups share them)."""
    seen, out = {}, []
    for t in worker.model_runner.kv_caches:
        if t.data_ptr() not in seen:
            seen[t.data_ptr()] = len(out)
            out.append(t)
    return out


def _snapshot(worker):
    """Keeps a copy of vLLM's KV in the worker (tensors sent back as arguments do not survive
    collective_rpc's serialization)."""
    worker.flexkv_layout_snapshot = [t.clone() for t in _storages(worker)]


def _zero(worker):
    for t in _storages(worker):
        t.zero_()


def _evict_host(worker):
    conn = _conn()
    conn.drain(60)
    return conn.evict_host(60)


def _compare(worker, per_rank):
    """Per group: how many loaded blocks, and whether each equals the block computed at its
    position (raw bytes of every KV tensor). ``per_rank``: (stored, loaded) block ids by group."""
    import torch

    stored, loaded = per_rank[worker.rank]
    if loaded is None:
        return {"loaded": False}
    now, before = _storages(worker), worker.flexkv_layout_snapshot
    out = {}
    for g, ids in loaded.items():  # block ids by position from the request's first block
        src = stored.get(g, [])
        pairs = [(src[pos], b) for pos, b in enumerate(ids[: len(src)]) if b and src[pos]]
        ok = bool(pairs)
        for old, new in zip(before, now):
            for s, d in pairs:
                if not torch.equal(old[s].contiguous().view(torch.uint8), new[d].contiguous().view(torch.uint8)):
                    ok = False
        out[str(g)] = {"blocks": len(pairs), "equal": ok}
    del worker.flexkv_layout_snapshot
    return {"loaded": True, "groups": out}


def run_scenario(llm, scenario: str, rnd: random.Random, a) -> dict:
    from vllm import SamplingParams

    def log():
        return llm.collective_rpc(_log)

    seen = [len(x) for x in log()]
    prompt = [rnd.randrange(300, 30000) for _ in range(a.prompt_tokens)]
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    for _ in range(50):  # later steps run until every rank reported the store's device copy
        stores = [[r for r in x[n:] if r[0] == "store"] for x, n in zip(log(), seen)]
        if all(stores):
            break
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
    llm.collective_rpc(_snapshot)
    stored = [s[0] for s in stores]
    if scenario == "disk":
        llm.collective_rpc(_evict_host)
    llm.reset_prefix_cache()
    llm.collective_rpc(_zero)
    before = [len(x) for x in log()]
    second = llm.generate([{"prompt_token_ids": prompt}], sp)[0]
    loads = [[r for r in x[n:] if r[0] == "load"] for x, n in zip(log(), before)]
    result = {
        "first": Generation.of_vllm(first.outputs[0]).as_json(),
        "second": Generation.of_vllm(second.outputs[0]).as_json(),
        "first_cached": first.num_cached_tokens,
        "second_cached": second.num_cached_tokens,
        "stored_blocks": len(stored[0][2]),
        "loads": [[[r[3], len(r[2])] for r in x] for x in loads],
    }
    per_rank = []
    for st, ld in zip(stored, loads):
        if not ld or not ld[-1][3]:
            per_rank.append((None, None))
            continue
        # one group: the loaded blocks from the first on (the reset left vLLM no block of its own)
        per_rank.append((st[4] or {0: st[2]}, ld[-1][4] or {0: ld[-1][2]}))
    ranks = llm.collective_rpc(_compare, args=(per_rank,))
    result["ranks"] = ranks
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--scenario", default="host", help="host and/or disk, comma-separated, in order on one engine")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--attention-backend", default=None)
    a = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc pickles these functions (a local test)
    for var in ("VLLM_HOST_IP", "VLLM_LOOPBACK_IP"):  # the ranks' message queues on loopback only
        os.environ.setdefault(var, "127.0.0.1")
    from vllm import LLM

    kt = {
        "kv_connector": "FlexKVConnector",
        "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"layerwise": True, **connector_extra()},
    }
    extra = {"attention_config": {"backend": a.attention_backend}} if a.attention_backend else {}
    llm = LLM(
        model=a.model_dir,
        dtype=a.dtype,
        max_model_len=8192,
        block_size=a.block_size,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        kv_transfer_config=kt,
        seed=0,
        tensor_parallel_size=a.tp,
        distributed_executor_backend="mp" if a.tp > 1 else None,
        **extra,
    )
    results = {}
    for i, scenario in enumerate(a.scenario.split(",")):
        results[scenario] = run_scenario(llm, scenario, random.Random(11 + i), a)
    with open(a.out, "w") as f:
        json.dump(results, f)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as vllm_kv_check.py: the engine is down, skip the interpreter's finalization
