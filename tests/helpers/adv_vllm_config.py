"""Adversarial config checks: builds vLLM's own VllmConfig (EngineArgs.create_engine_config, as
`vllm serve` does) with a kv_transfer_config and constructs FlexKVConnector the way vLLM's
KVConnectorFactory does, for the scheduler and the worker role, without starting an engine.

    python tests/helpers/adv_vllm_config.py MODEL_DIR OUT.json CASES_JSON

CASES_JSON: {name: {"kt": {...kv_transfer_config overrides...}, "extra": {...}, "env": {...}}}.
Writes {name: {"scheduler": "ok" | "Error: message", "worker": ...}}."""

from __future__ import annotations

import json
import os
import sys


def build(model_dir, kt):
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(
        model=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=8192,
        block_size=64,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        kv_transfer_config=kt,
        seed=0,
    )
    return ea.create_engine_config()


def make(vc, role):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kcc = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(4)], spec)],
    )
    return KVConnectorFactory.create_connector(vc, r, kcc)


def main() -> int:
    model_dir, out, cases = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())
    res = {}
    base_env = dict(os.environ)
    for name, c in cases.items():
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(c.get("env", {}))
        kt = {
            "kv_connector": "FlexKVConnector",
            "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": c.get("extra", {"layerwise": True}),
        }
        kt.update(c.get("kt", {}))
        r = {}
        try:
            vc = build(model_dir, kt)
        except BaseException as e:  # noqa: BLE001
            r["config"] = f"{type(e).__name__}: {e}"
            res[name] = r
            continue
        for role in c.get("roles", ["scheduler", "worker"]):
            try:
                conn = make(vc, role)
                r[role] = "ok"
                if role == "worker" and c.get("register", True):
                    import torch

                    store = torch.zeros(4, 64, 2, 64, 128, dtype=torch.bfloat16)
                    try:
                        conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": store[i] for i in range(4)})
                        r["register"] = "ok"
                        st = conn.tier_stats().as_dict()
                        r["tiers"] = {t: st[t].get("capacity_blocks") for t in ("host", "disk", "remote") if t in st}
                    except BaseException as e:  # noqa: BLE001
                        r["register"] = f"{type(e).__name__}: {e}"[:1500]
                for m in ("shutdown", "close"):
                    if hasattr(conn, m):
                        try:
                            getattr(conn, m)()
                        except BaseException:  # noqa: BLE001
                            pass
                        break
            except BaseException as e:  # noqa: BLE001
                r[role] = f"{type(e).__name__}: {e}"[:1500]
        res[name] = r
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
