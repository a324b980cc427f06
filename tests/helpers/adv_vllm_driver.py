"""Adversarial driver: runs real vLLM (CPU) with or without FlexKVConnector through a list of
scenarios and writes what it saw as JSON. Used by tests/integration/test_vllm_connector_faults.py in a subprocess:

    python tests/helpers/adv_vllm_driver.py MODEL_DIR OUT.json --connector {0,1} --scenarios a,b,c [--extra JSON]
                                    [--engine JSON]

Every scenario builds its prompts from its own seeded RNG, so an engine without the connector
(the reference) sees the same prompts in the same order as one with it. Each scenario computes its
prompts cold, lets the stores land, drops vLLM's prefix cache and zeroes the KV tensors, and
computes them again ("warm": loaded from the connector's tiers when there is one). MODEL_DIR holds
seeded weights, served in float32, and every generation records its tokens' logprobs, so the tests
compare warm with cold by tests/helpers/exactness.py's oracle. FLEXKV_TEST_WRONG_KV=1 adds the wrong_kv seam."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

from exactness import EXACT_DTYPE, Generation, connector_extra


def _conn():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _zero(worker):
    for t in worker.model_runner.kv_caches:
        t.zero_()


def _log(worker):
    c = _conn()
    if c is None:
        return []
    return [(r.kind, r.req_id, list(r.block_ids), r.ok) for r in c.transfer_log]


def _drain_stats(worker):
    c = _conn()
    if c is None:
        return None
    c.drain(60)
    s = c.tier_stats()
    return s.as_dict() if s is not None else {}


def _files(worker):
    c = _conn()
    return [] if c is None else [str(f) for f in c.tier_files()]


class Driver:
    def __init__(self, llm):
        self.llm = llm

    def log(self):
        return self.llm.collective_rpc(_log)[0]

    def stats(self):
        return self.llm.collective_rpc(_drain_stats)[0]

    def settle(self):
        """Steps the engine until the stores are reported, then drains the background writes."""
        from vllm import SamplingParams

        for _ in range(4):
            self.llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
        st = self.stats()
        self.llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
        return st

    def drop_device(self):
        self.llm.reset_prefix_cache()
        self.llm.collective_rpc(_zero)

    def gen(self, prompts, sp):
        if sp.logprobs is None:  # every generation's logprobs, for the exactness oracle
            sp = sp.clone()
            sp.logprobs = 0
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        res = []
        for o in outs:
            r = {
                "tokens": [list(c.token_ids) for c in o.outputs],
                "cached": o.num_cached_tokens,
                "logprobs": [Generation.of_vllm(c).logprobs for c in o.outputs],
            }
            if o.prompt_logprobs is not None:
                pl = []
                for i, d in enumerate(o.prompt_logprobs):
                    if d is None:
                        pl.append(None)
                    else:
                        tok = o.prompt_token_ids[i]
                        pl.append(round(d[tok].logprob, 3) if tok in d else "missing")
                r["prompt_logprobs"] = pl
            res.append(r)
        return res

    def cold_warm(self, prompts, sp, hit=False):
        """cold, [vLLM prefix hit,] settle, drop device cache, warm."""
        log0 = len(self.log())
        out = {"cold": self.gen(prompts, sp)}
        if hit:
            out["hit"] = self.gen(prompts, sp)
        out["stats_before"] = self.settle()
        self.drop_device()
        log1 = len(self.log())
        out["warm"] = self.gen(prompts, sp)
        lg = self.log()
        out["stores"] = [[r[3], len(r[2])] for r in lg[log0:log1] if r[0] == "store"]
        out["loads"] = [[r[3], len(r[2])] for r in lg[log1:] if r[0] == "load"]
        out["stats_after"] = self.settle()
        return out


def rand_prompt(rnd, n):
    return [rnd.randrange(300, 30000) for _ in range(n)]


def sc_lengths(d, rnd):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    res = {}
    for n in (1, 2, 63, 64, 65, 127, 128, 129, 1000, 4032, 4096):
        p = rand_prompt(rnd, n)
        res[str(n)] = d.cold_warm([{"prompt_token_ids": p}], sp)
    return res


def sc_batch32(d, rnd):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    prefix = rand_prompt(rnd, 1024)
    suffix_lens = [0, 64, 1, 63, 65] + [rnd.randrange(1, 300) for _ in range(27)]
    prompts = [{"prompt_token_ids": prefix + rand_prompt(rnd, s)} for s in suffix_lens]
    return d.cold_warm(prompts, sp, hit=True)


def sc_dup(d, rnd):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    p = rand_prompt(rnd, 700)
    out = d.cold_warm([{"prompt_token_ids": p}, {"prompt_token_ids": p}], sp)
    out["single"] = d.gen([{"prompt_token_ids": p}], sp)
    return out


def sc_nsample(d, rnd):
    from vllm import SamplingParams

    p = rand_prompt(rnd, 700)
    q = rand_prompt(rnd, 700)
    return {
        "seeded_n3": d.cold_warm(
            [{"prompt_token_ids": q}], SamplingParams(max_tokens=8, temperature=0.8, n=3, seed=123)
        ),
        "seeded_n1": d.cold_warm([{"prompt_token_ids": p}], SamplingParams(max_tokens=8, temperature=0.8, seed=7)),
    }


def sc_plogprobs(d, rnd):
    from vllm import SamplingParams

    p = rand_prompt(rnd, 300)
    return d.cold_warm([{"prompt_token_ids": p}], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1))


def sc_salt(d, rnd):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    p = rand_prompt(rnd, 700)
    out = {"a": d.cold_warm([{"prompt_token_ids": p, "cache_salt": "a"}], sp)}
    # p is now in the tiers under salt "a" only.
    for name, prompt in (
        ("b", {"prompt_token_ids": p, "cache_salt": "b"}),
        ("none", {"prompt_token_ids": p}),
        ("a_again", {"prompt_token_ids": p, "cache_salt": "a"}),
    ):
        d.drop_device()
        log0 = len(d.log())
        g = d.gen([prompt], sp)
        out[name] = {"gen": g, "loads": [[r[3], len(r[2])] for r in d.log()[log0:] if r[0] == "load"]}
        d.settle()
    return out


def sc_many(d, rnd):
    """Many distinct prompts one after the other (fills small tiers), then all of them again."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0)
    prompts = [{"prompt_token_ids": rand_prompt(rnd, 1500)} for _ in range(10)]
    log0 = len(d.log())
    cold = [d.gen([p], sp)[0] for p in prompts]
    st0 = d.settle()
    d.drop_device()
    log1 = len(d.log())
    warm = [d.gen([p], sp)[0] for p in reversed(prompts)][::-1]
    lg = d.log()
    return {
        "cold": cold,
        "warm": warm,
        "stats_before": st0,
        "stats_after": d.settle(),
        "stores": [[r[3], len(r[2])] for r in lg[log0:log1] if r[0] == "store"],
        "loads": [[r[3], len(r[2])] for r in lg[log1:] if r[0] == "load"],
    }


def sc_preempt(d, rnd):
    """Long prompts with long outputs submitted together into a small device cache: vLLM preempts."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    prefix = rand_prompt(rnd, 640)
    prompts = [{"prompt_token_ids": prefix + rand_prompt(rnd, 700 + 64 * i)} for i in range(6)]
    return d.cold_warm(prompts, sp)


def sc_restart_a(d, rnd):
    """First engine on an SSD dir: compute and persist."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = [{"prompt_token_ids": rand_prompt(rnd, 1500)} for _ in range(3)]
    out = {"cold": d.gen(prompts, sp)}
    out["stats"] = d.settle()
    out["files"] = d.llm.collective_rpc(_files)[0]
    return out


def sc_restart_b(d, rnd):
    """Second engine, same SSD dir and the same prompts: loaded from disk."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0)
    rnd = random.Random(1000 + sum(map(ord, "restart_a")))  # restart_a's prompts
    prompts = [{"prompt_token_ids": rand_prompt(rnd, 1500)} for _ in range(3)]
    st0 = d.stats()
    log0 = len(d.log())
    out = {"warm": d.gen(prompts, sp), "stats_before": st0}
    out["loads"] = [[r[3], len(r[2])] for r in d.log()[log0:] if r[0] == "load"]
    out["stats_after"] = d.settle()
    return out


def sc_embeds(d, rnd):
    """Two different prompt_embeds of one length (vLLM's token ids of both are zeros), then a
    prompt of zero token ids of that length: none may load another's blocks (the engine needs
    enable_prompt_embeds)."""
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0)
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    hidden = d.llm.llm_engine.model_config.get_hidden_size()
    e1, e2 = (torch.randn(1000, hidden, generator=g) for _ in range(2))
    out = {}
    for name, prompt in (
        ("e1", {"prompt_embeds": e1}),
        ("e2", {"prompt_embeds": e2}),
        ("zeros", {"prompt_token_ids": [0] * 1000}),
        ("e1_again", {"prompt_embeds": e1}),
    ):
        d.settle()
        d.drop_device()
        log0 = len(d.log())
        out[name] = {
            "gen": d.gen([prompt], sp),
            "loads": [[r[3], len(r[2])] for r in d.log()[log0:] if r[0] == "load"],
            "stores": [[r[3], len(r[2])] for r in d.log()[log0:] if r[0] == "store"],
        }
    out["stats"] = d.settle()
    return out


def sc_reset(d, rnd):
    """vLLM's cache clear after a weight update: reset_prefix_cache(reset_connector=True) must
    drop the tiers too (or say it failed), so the same prompt is computed, not loaded."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0)
    p = {"prompt_token_ids": rand_prompt(rnd, 1500)}
    out = {"cold": d.gen([p], sp), "stats_before": d.settle()}
    d.llm.collective_rpc(_zero)
    out["reset"] = d.llm.reset_prefix_cache(reset_connector=True)
    out["stats_reset"] = d.stats()
    log0 = len(d.log())
    out["after"] = d.gen([p], sp)
    out["loads"] = [[r[3], len(r[2])] for r in d.log()[log0:] if r[0] == "load"]
    out["stats_after"] = d.settle()
    return out


SCENARIOS = {k[3:]: v for k, v in globals().items() if k.startswith("sc_")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--connector", type=int, default=1)
    ap.add_argument("--scenarios", default="lengths")
    ap.add_argument("--extra", default='{"layerwise": true}', help="kv_connector_extra_config as JSON")
    ap.add_argument("--kt", default="{}", help="more kv_transfer_config keys as JSON")
    ap.add_argument("--engine", default="{}", help="more LLM(...) keyword arguments as JSON")
    a = ap.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    kw = dict(
        model=a.model_dir,
        dtype=EXACT_DTYPE,
        max_model_len=8192,
        block_size=64,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        seed=0,
    )
    kw.update(json.loads(a.engine))
    if a.connector:
        kt = {
            "kv_connector": "FlexKVConnector",
            "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**json.loads(a.extra), **connector_extra()},
        }
        kt.update(json.loads(a.kt))
        kw["kv_transfer_config"] = kt
    results = {}
    t0 = time.time()
    try:
        llm = LLM(**kw)
    except BaseException as e:  # noqa: BLE001 -- the refusal is what some cases check
        results["start_error"] = f"{type(e).__name__}: {e}"
        with open(a.out, "w") as f:
            json.dump(results, f)
        return 3
    results["start_s"] = time.time() - t0
    d = Driver(llm)
    for name in a.scenarios.split(","):
        t = time.time()
        try:
            results[name] = SCENARIOS[name](d, random.Random(1000 + sum(map(ord, name))))
        except BaseException as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-4000:]}
        results[name + "_s"] = time.time() - t
        with open(a.out, "w") as f:
            json.dump(results, f)
    results["final_stats"] = d.stats()
    with open(a.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
