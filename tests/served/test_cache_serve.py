"""``dynamo-flexkv cache`` on running graphs, as an operator runs it: on the agg graph (a reference
worker with device, host and SSD tiers) it lists the tiers' contents, a prompt's blocks by its
token ids and by its text, clears them, and the next request misses (cached 0); the same against a
node cache service (over its socket and its HTTP port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from served import MODEL, assert_gone, make_plan, metric, wait_until

from dynamo_flexkv.core.http_client import http_json
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.launcher import Launcher

PROMPT = [((i * 37) % 250) + 1 for i in range(16 * 8 + 5)]  # 8 full blocks of 16 tokens (the tiny preset's)
TEXT = "A system prompt everybody shares, and the question after it. " * 3  # byte tokens: 189 of them


def cache(*args: str, expect: int = 0) -> str:
    """``dynamo-flexkv cache ARGS`` as a user runs it; its output."""
    r = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.cli", "cache", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == expect, (r.returncode, r.stdout, r.stderr)
    return r.stdout + r.stderr


def cache_json(*args: str) -> list:
    return json.loads(cache(*args, "--json"))


def cached_tokens(plan, prompt) -> int:
    r = http_json(f"{plan.base_url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def tiers_of(report: dict) -> dict:
    (ns,) = report["contents"]
    return {t["tier"]: t for t in ns["tiers"]}


def test_see_a_prompts_blocks_clear_them_and_the_next_request_misses(tmp_path):
    plan = make_plan(tmp_path, "agg")
    worker = f"http://127.0.0.1:{plan.workers[0].port}"
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        assert cached_tokens(plan, PROMPT) == 0 and cached_tokens(plan, TEXT) == 0
        # The stores' disk copies land in the background: wait until the disk tier holds both prompts.
        wait_until(
            "the disk copies", lambda: tiers_of(cache_json("--url", worker)[0]["report"])["disk"]["blocks"] >= 8 + 11
        )
        shown = cache("--url", worker)
        print(shown)
        assert "worker flexkv-tiny (embedded)" in shown
        for row in ("device", "host", "disk"):
            assert f"\n    {row} " in shown
        tiers = tiers_of(cache_json("--url", worker)[0]["report"])
        assert tiers["device"]["blocks"] >= 8 + 11 and tiers["host"]["blocks"] >= 8 + 11
        assert tiers["host"]["oldest_s"] >= tiers["host"]["newest_s"] >= 0
        by_ids = cache("prefix", "--url", worker, "--tokens", ",".join(map(str, PROMPT)))
        print(by_ids)
        assert "blocks 0-7" in by_ids and "device, host, disk" in by_ids
        (p,) = cache_json("prefix", "--url", worker, "--tokens", json.dumps(PROMPT))[0]["report"]["prefixes"]
        assert p["held"] == {"device": 8, "host": 8, "disk": 8} and len(p["hashes"]) == 8
        (t,) = cache_json("prefix", "--url", worker, "--text", TEXT)[0]["report"]["prefixes"]
        assert t["tokens"] == len(TEXT.encode()) and t["held"] == {"device": 11, "host": 11, "disk": 11}
        cleared = cache("clear", "--url", worker)
        print(cleared)
        (done,) = cache_json("show", "--url", worker)[0]["report"]["contents"]
        assert all(t["blocks"] == 0 for t in done["tiers"]), done
        assert "device" in cleared and "host" in cleared and "disk" in cleared and "cleared" in cleared
        assert cached_tokens(plan, PROMPT) == 0  # the next request misses: computed again
        assert metric(plan.workers[0].port, "flexkv_removed_blocks_total", tier="host", reason="cleared") >= 19
        assert metric(plan.workers[0].port, "flexkv_removed_blocks_total", tier="disk", reason="cleared") >= 19
        # Bad input names the fix.
        assert (
            "this target holds no namespace of tenant 'nobody'; it holds model 'tiny|flexkv-tiny' tenant ''"
            in cache("show", "--url", worker, "--tenant", "nobody", expect=1)
        )
        assert "cannot reach http://127.0.0.1:1" in cache("--url", "http://127.0.0.1:1", expect=1)
        assert "invalid choice: 'ssd'" in cache("clear", "--url", worker, "--tier", "ssd", expect=2)
    assert_gone(launcher)


NODE_SETS = [
    "FlexKVWorker.cache={mode: node}",
    "FlexKVWorker.device-prefix-cache=false",  # every hit is the node's: its clear is what makes the miss
]


@pytest.mark.slow  # ~56 s on 2 CPUs; tests/unit/test_node_cache_admin.py covers the service in-process
def test_the_same_against_a_node_cache_service(tmp_path):
    from served import TINY

    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    config = apply_overrides(
        load_config(str(ROOT / "configs" / "agg.yaml")),
        [
            *[s for s in TINY if not s.startswith("FlexKVWorker.cache")],
            *NODE_SETS,
            f"NodeCache.cache={{cpu_cache_gb: 0.02, ssd_cache_gb: 0.05, ssd_cache_dir: {tmp_path}/ssd}}",
        ],
    )
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg.py")), config, run_dir=tmp_path / "run", source="agg.yaml")
    (node,) = [p for p in plan.processes if p.kind is Kind.CACHE]
    sock = str(tmp_path / "run" / "node-cache.sock")
    node_url = f"http://127.0.0.1:{node.port}"
    with Launcher(plan) as launcher:
        launcher.wait_ready(120)
        assert cached_tokens(plan, PROMPT) == 0
        wait_until(
            "the disk copies", lambda: tiers_of(cache_json("--socket", sock)[0]["report"])["disk"]["blocks"] >= 8
        )
        shown = cache("--socket", sock)
        print(shown)
        assert "cache server pid" in shown and "1 engine(s)" in shown
        over_http = tiers_of(cache_json("--url", node_url)[0]["report"])
        assert over_http["host"]["blocks"] == 8 and over_http["disk"]["blocks"] == 8
        (p,) = cache_json("prefix", "--socket", sock, "--tokens", json.dumps(PROMPT))[0]["report"]["prefixes"]
        assert p["held"] == {"host": 8, "disk": 8}
        worker = f"http://127.0.0.1:{plan.workers[0].port}"
        (w,) = cache_json("prefix", "--url", worker, "--tokens", json.dumps(PROMPT))[0]["report"]["prefixes"]
        assert w["held"] == {"device": 0, "host": 8, "disk": 8}  # the worker sees its node namespace
        cleared = cache("clear", "--url", node_url)
        print(cleared)
        assert "host    8 block(s) cleared" in cleared and "disk    8 block(s) cleared" in cleared
        assert cached_tokens(plan, PROMPT) == 0  # the next request misses
        assert "holds no namespace of tenant 'nobody'" in cache(
            "--socket", sock, "show", "--tenant", "nobody", expect=1
        )
    assert_gone(launcher)


@pytest.mark.slow  # a vLLM graph: minutes on 2 CPUs
def test_a_vllm_workers_connector_tiers_are_seen_and_cleared(tmp_path):
    """serve graphs/agg_vllm.py: `dynamo-flexkv cache --vllm RUN_DIR/VllmWorker` asks the
    connector in vLLM's worker process on its lookup socket; vLLM's own device tier is refused,
    naming Dynamo's clear_kv_blocks."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    import shutil
    import tempfile

    from served import Serve

    short = Path(tempfile.mkdtemp(prefix="fkv-", dir="/tmp"))  # the lookup socket's path fits in the run dir
    serve = Serve(
        short,
        "vllm",
        graph="agg_vllm",
        ready_timeout=400,
        base=[
            "Frontend.http-port=0",
            f"VllmWorker.cache.ssd_cache_dir={tmp_path}/vllm/ssd{{replica}}",
            "VllmWorker.num-device-blocks=64",
            "VllmWorker.max-model-len=2048",
            "VllmWorker.cache.cpu_cache_gb=0.05",
            "VllmWorker.cache.ssd_cache_gb=0.1",
        ],
    )
    try:
        replica = str(serve.run / "VllmWorker")  # one replica: no -0
        ids = [((i * 53) % 20000) + 300 for i in range(64 * 4 + 3)]  # 4 full blocks of 64
        body = {"model": "vllm-small", "prompt": ids, "max_tokens": 2, "temperature": 0}
        assert http_json(f"{serve.base_url}/v1/completions", body)["usage"]["prompt_tokens"] == len(ids)

        def held() -> dict:
            (p,) = cache_json("prefix", "--vllm", replica, "--tokens", json.dumps(ids))[0]["report"]["prefixes"]
            return p["held"] if p["held"].get("disk") == len(p["hashes"]) > 0 else {}

        print(wait_until("the connector's disk copies", held, timeout=120))
        shown = cache("--vllm", replica)
        print(shown)
        assert "vLLM worker" in shown and "\n    host " in shown and "\n    disk " in shown
        cleared = cache("clear", "--vllm", replica)
        print(cleared)
        assert "cleared" in cleared
        (p,) = cache_json("prefix", "--vllm", replica, "--tokens", json.dumps(ids))[0]["report"]["prefixes"]
        assert p["held"] == {"host": 0, "disk": 0}
        assert "clear it with Dynamo's clear_kv_blocks" in cache(
            "clear", "--vllm", replica, "--tier", "device", expect=1
        )
    finally:
        serve.close()
        shutil.rmtree(short, ignore_errors=True)
