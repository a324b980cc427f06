"""Profile (issue 11 item 6): 16 concurrent requests on the agg graph (small preset), offload on
vs off, two turns of 16 conversations with eviction traffic between them. Prints per
configuration: mean batch (requests per engine step), the engine's busy share of the wall time,
mean step time, time steps stalled on offload loads, and the per-response per-tier cached tokens
next to the worker's metric deltas (they must be equal).

    .venv/bin/python tests/helpers/profile_worker_concurrency.py [REPEATS]
"""

import json
import re
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from repo_paths import ROOT

from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

TIERS = ("device", "host", "disk")


def scrape(port: int) -> dict:
    """flexkv_* samples keyed by name plus our own tier/state/link label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r"^(flexkv_[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$", text, re.M):
        ours = [kv for kv in (m.group(2) or "").split(",") if kv.split("=")[0] in ("tier", "state", "link")]
        out[m.group(1) + (f"{{{','.join(ours)}}}" if ours else "")] = float(m.group(3))
    return out


def profile(offload: bool, tmp: Path) -> dict:
    config = apply_overrides(
        load_config(str(ROOT / "configs/agg.yaml")),
        [
            "Common.model=small",
            "Common.served-model-name=flexkv-small",
            "Frontend.http-port=0",
            "FlexKVWorker.num-device-blocks=160",
            "FlexKVWorker.cache.cpu_cache_gb=0.05",
            "FlexKVWorker.cache.ssd_cache_gb=0.5",
            f"FlexKVWorker.cache.ssd_cache_dir={tmp}/ssd",
            f"FlexKVWorker.offload={'true' if offload else 'false'}",
        ],
    )
    plan = build_plan(load_graph(str(ROOT / "graphs/agg.py")), config, run_dir=tmp / "run")
    conversations = [[(c * 97 + i * 7) % 30000 + 300 for i in range(1024)] for c in range(16)]

    def ask(conv_turn):
        c, turn = conv_turn
        body = {
            "model": "flexkv-small",
            "prompt": conversations[c][: 512 * (turn + 1)] + [c + 1, turn + 1],
            "max_tokens": 24,
            "nvext": {"extra_fields": ["engine_data"]},
        }
        req = urllib.request.Request(
            plan.base_url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        return json.load(urllib.request.urlopen(req, timeout=300))

    with Launcher(plan) as launcher:
        launcher.wait_ready(300)
        port = plan.workers[0].port
        before, t0, replies = scrape(port), time.monotonic(), []
        with ThreadPoolExecutor(16) as pool:
            for turn in range(2):
                replies += pool.map(ask, [(c, turn) for c in range(16)])
                replies += pool.map(ask, [(c, 0) for c in range(8, 16)])  # evicts the device cache
        wall, after = time.monotonic() - t0, scrape(port)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    steps = delta("flexkv_engine_steps_total")
    return {
        "offload": offload,
        "wall_s": round(wall, 2),
        "requests": len(replies),
        "mean_batch": round(delta("flexkv_engine_step_requests_total") / steps, 2),
        "steps": steps,
        "engine_busy_share": round(delta("flexkv_engine_step_seconds_total") / wall, 3),
        "step_ms": round(1000 * delta("flexkv_engine_step_seconds_total") / steps, 2),
        "load_stall_s": round(delta("flexkv_engine_load_stall_seconds_total"), 3),
        "cached_per_response_sum": {
            t: sum(r["nvext"]["engine_data"]["flexkv"]["cached_tokens"][t] for r in replies) for t in TIERS
        },
        "metric_cached_delta": {t: delta(f'flexkv_prompt_tokens_cached_total{{tier="{t}"}}') for t in TIERS},
        "prompt_computed": delta("flexkv_prompt_tokens_computed_total"),
    }


if __name__ == "__main__":
    for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
        for offload in (True, False):
            print(
                json.dumps({"run": rep, **profile(offload, Path(tempfile.mkdtemp(prefix="flexkv-prof-")))}), flush=True
            )
