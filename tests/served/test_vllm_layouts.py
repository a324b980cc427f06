"""The model shapes and parallel layouts vLLM users deploy, under FlexKVConnector on vLLM's CPU
build: the hybrid sliding-window preset (configs/models/hybrid-sw: Gemma 3, two window groups and
one full-attention group), the MLA preset (configs/models/mla-small: DeepSeek V2's latent cache),
tensor parallel (TP=2, a rank per core) and data parallel (DP=2 under dynamo.vllm).

* test_loaded_bytes_*: vLLM's offline engine (tests/helpers/vllm_layout_check.py) from inside every rank's
  worker: a 1,500-token prompt computed, its KV copied, vLLM's prefix cache reset and its KV zeroed
  (disk: the host tier evicted too), the prompt again: every block loaded into every group on every
  rank equals, byte for byte, the block computed at its position; tokens and logprobs equal.
  MLA runs vLLM's reference CPU_MLA backend in float32 on every host (named: vLLM would pick
  AMX_MLA on a host with AMX, which takes bfloat16 only); on a host with AMX, AMX_MLA in bfloat16
  is checked too (skipped elsewhere).
* test_served_*: ``dynamo-flexkv serve`` of the router graph with that layout: prompts of 1.2K, 4K
  and 8K tokens sharing a 1K prefix give the token ids and logprobs of the same graph without
  offload, and come back from the host tier, then (after other prompts pushed them out) from disk.
  DP: the router's view has the prompt on the data-parallel rank that computed it, and routes the
  returning prompt there.

All -m slow: every case starts vLLM (1-5 minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by scripts/install.sh"),
]
pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")

import exactness  # noqa: E402
import vllm_graph as vg  # noqa: E402
from exactness import Generation  # noqa: E402
from repo_paths import HELPERS  # noqa: E402
from served import Serve  # noqa: E402
from vllm_graph import VllmServe  # noqa: E402

from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset  # noqa: E402

MLA_LOGPROB_TOLERANCE = 5e-2  # vLLM's CPU MLA computes a prefill over context a connector loaded
# through another path than a whole-prompt prefill (and has no prefix cache of its own to compare
# with): with byte-equal KV (test_loaded_bytes_of_an_mla_model_equal_the_computed_ones) logprobs
# differed by up to 3.7e-3 at 1.5K tokens and 0.025 at 4K-8K (float32). For MLA the bytes are the
# oracle; token ids must still be equal.
AMX_MLA_LOGPROB_TOLERANCE = 0.1  # bfloat16 (AMX_MLA takes nothing else): a logprob near -6 carries
# about 8 significant bits (steps of 0.03); measured 0.031 (host) and 5e-4 (disk) with byte-equal KV.
# The bytes are the oracle here too: FLEXKV_TEST_WRONG_KV=1 fails them, its logprobs moved by 0.063.
MLA_BACKEND = "CPU_MLA"  # vLLM's reference CPU MLA, named: on a host with AMX vLLM would pick AMX_MLA,
# which takes bfloat16 weights only (float32 is the exactness dtype); named, every x86 or Arm host
# runs the same float32 backend with the same tolerance


def _check(tmp: Path, model: str, *args: str, env: dict[str, str] | None = None) -> dict:
    model_dir = write_preset(model, tmp / model, context_length=8192, weights=True)
    out = tmp / "out.json"
    run_env = dict(
        os.environ,
        FLEXKV_RUN_DIR=str(tmp),
        FLEXKV_CPU_CACHE_GB="0.25",
        FLEXKV_SSD_CACHE_GB="0.5",
        FLEXKV_SSD_CACHE_DIR=str(tmp / "ssd"),
        **(env or {}),
    )
    r = subprocess.run(
        [
            sys.executable,
            str(HELPERS / "vllm_layout_check.py"),
            str(model_dir),
            str(out),
            "--scenario",
            "host,disk",
            *args,
        ],
        env=run_env,
        cwd=str(HELPERS),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0 and out.is_file(), r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text())


def _assert_loaded_exact(results: dict, ranks: int, groups: int, tolerance: float = exactness.LOGPROB_TOLERANCE):
    for scenario, res in results.items():
        first, second = Generation.from_json(res["first"]), Generation.from_json(res["second"])
        m = exactness.margin(second, first)
        print(
            f"\n{scenario}: cached {res['second_cached']} of the prompt, loads {res['loads']}, "
            f"groups {res['ranks']}, logprob difference {m:.3g}"
        )
        assert m <= tolerance, (scenario, first, second)
        assert res["second_cached"] > 1000 and all(x and x[-1][0] for x in res["loads"]), res  # from our tiers
        assert len(res["ranks"]) == ranks
        for rank in res["ranks"]:
            assert rank["loaded"], (scenario, res)
            assert len(rank["groups"]) == groups, rank
            assert all(g["equal"] and g["blocks"] > 0 for g in rank["groups"].values()), (scenario, rank)


@pytest.mark.integration
def test_loaded_bytes_of_a_hybrid_sliding_window_model_equal_the_computed_ones(tmp_path):
    res = _check(tmp_path, "hybrid-sw")
    _assert_loaded_exact(res, ranks=1, groups=3)
    for r in res.values():  # the windows hold 4 blocks (window 256), the full group every block
        counts = sorted(g["blocks"] for g in r["ranks"][0]["groups"].values())
        assert counts == [4, 4, r["stored_blocks"]], counts


@pytest.mark.integration
def test_loaded_bytes_of_an_mla_model_equal_the_computed_ones(tmp_path):
    # vLLM's reference CPU MLA backend (float32 allowed) sets 16-token blocks itself.
    res = _check(tmp_path, "mla-small", "--block-size", "16", "--attention-backend", MLA_BACKEND)
    _assert_loaded_exact(res, ranks=1, groups=1, tolerance=MLA_LOGPROB_TOLERANCE)


def _vllm_picks_amx_mla() -> bool:
    """Whether vLLM runs MLA on its AMX backend here, by vLLM's own test (platforms/cpu.py): an x86
    host whose CPU has AMX tiles (Intel Sapphire Rapids and later; no AMD CPU has them)."""
    import torch
    from vllm.platforms import CpuArchEnum
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()


@pytest.mark.integration
def test_loaded_bytes_of_an_mla_model_under_vllms_amx_backend_equal_the_computed_ones(tmp_path):
    """What an MLA model runs on where the host has AMX and its dtype is bfloat16 (serve's default):
    AMX_MLA, with 64-token blocks and vLLM's own prefix cache on, not the reference backend above."""
    if not _vllm_picks_amx_mla():
        pytest.skip("vLLM runs AMX_MLA on an x86 host with AMX tiles only; this one has none")
    res = _check(tmp_path, "mla-small", "--dtype", "bfloat16", "--attention-backend", "AMX_MLA")
    _assert_loaded_exact(res, ranks=1, groups=1, tolerance=AMX_MLA_LOGPROB_TOLERANCE)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds a rank to each of two cores")
@pytest.mark.integration
def test_loaded_bytes_with_tensor_parallel_ranks_equal_the_computed_ones(tmp_path):
    res = _check(tmp_path, "small", "--tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    _assert_loaded_exact(res, ranks=2, groups=1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds a rank to each of two cores")
@pytest.mark.integration
def test_loaded_bytes_with_tensor_parallel_ranks_on_the_node_cache(tmp_path):
    """Both ranks attach to one node cache service as shards of one engine (issue: one cache per node)."""
    from node_helpers import node_server

    with node_server(tmp_path, host_gb=0.25, ssd_gb=0.5) as server:
        res = _check(
            tmp_path,
            "small",
            "--tp",
            "2",
            env={
                "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                "FLEXKV_MODE": "node",
                "FLEXKV_NODE_SOCKET": server.options.socket_path,
            },
        )
    _assert_loaded_exact(res, ranks=2, groups=1)


# ---- served ------------------------------------------------------------------------------------

PREFIX = vg.tokens(7000, 1024)
# Lengths whose full blocks end where the prompt and its 8 generated tokens do (a hybrid model's
# windows are stored at a request's end, which a resent prompt then hits).
PROMPTS = [PREFIX + vg.tokens(7001 + i, n - len(PREFIX)) for i, n in enumerate((1224, 4000, 7990))]
FILLERS = [vg.tokens(7100 + j, 7990) for j in range(4)]
MAX_TOKENS = 8
HOST_TOKENS = 31000  # the prompts (~11K tokens apart from the shared prefix) and two fillers: the
# host tier keeps p0 through two fillers and lets p1 and p2 go after two more
LAYOUTS = {  # name: (preset, worker options, bytes per token of one rank's KV, its main offload's share, device blocks)
    "hybrid": ("hybrid-sw", [], 2 * 2 * 64 * 2 * 4, 64 / 72, 300),  # two tensors; 2 windows of 4 blocks beside 64
    "mla": (
        "mla-small",
        ["VllmWorker.block-size=16", f"VllmWorker.extra-args=[--attention-backend, {MLA_BACKEND}]"],
        4 * 576 * 4,
        1.0,
        8192 // 16 + 8,
    ),
    "tp2": ("small", ["VllmWorker.tensor-parallel-size=2"], 4 * 1 * 64 * 2 * 4, 1.0, 136),
    "dp2": ("small", ["VllmWorker.data-parallel-size=2"], 4 * 2 * 64 * 2 * 4, 1.0, 136),
}


def _sets(tmp: Path, name: str, layout: str) -> list[str]:
    model, extra, per_token, main_share, device = LAYOUTS[layout]
    host_gb = HOST_TOKENS * per_token / main_share / 2**30
    return [
        "Frontend.http-port=0",
        *exactness.serve_sets(),
        f"Common.model={model}",
        "VllmWorker.served-model-name=" + vg.MODEL,
        "VllmWorker.replicas=1",
        f"VllmWorker.num-device-blocks={device}",
        "VllmWorker.max-model-len=8192",
        f"VllmWorker.cache.cpu_cache_gb={host_gb:.4f}",
        "VllmWorker.cache.ssd_cache_gb=1.0",
        f"VllmWorker.cache.ssd_cache_dir={tmp}/{name}/ssd{{replica}}",
        *extra,
    ]


def _run(tmp: Path, layout: str, offload: bool) -> dict:
    name = f"{layout}-{'offload' if offload else 'baseline'}"
    extra = exactness.offload_sets() if offload else ["VllmWorker.offload=false"]
    t0 = time.monotonic()
    serve = VllmServe(tmp, name, *extra, graph="agg_router_vllm", base=_sets(tmp, name, layout))
    out: dict = {"gens": {}, "cached": {}, "loads": [], "ranks": {}, "rank_views": {}}
    probe = None
    try:
        print(f"\n{name}: ready in {time.monotonic() - t0:.0f} s")
        worker = "VllmWorker"
        if offload and layout == "dp2":
            front = [p for p in vg_children(serve) if b"dynamo.frontend" in open(f"/proc/{p}/cmdline", "rb").read()]
            probe = vg.RouterProbe(front[0], tmp / f"{name}-probe.log")

        def send(key: str, prompt: list[int]) -> dict:
            r = vg.complete(serve.base_url, prompt, MAX_TOKENS, timeout=600)
            out["gens"][key], out["cached"][key] = r["gen"], r["cached"]
            if offload:
                out["loads"].append((key, vg.loaded(vg.scrape(serve.metrics[worker]))))
            return r

        for i, p in enumerate(PROMPTS):
            send(f"p{i}", p)
            if probe is not None:  # the data-parallel rank that computed it holds it
                out["ranks"][f"p{i}"], out["rank_views"][f"p{i}"] = wait_rank(probe, p)
        send("f0", FILLERS[0])
        send("f1", FILLERS[1])  # the device cache let the prompts go; the host tier keeps them
        send("p0-host", PROMPTS[0])
        send("f2", FILLERS[2])
        send("f3", FILLERS[3])  # the host tier let p1 and p2 go; the disk keeps them
        for i in (1, 2):
            if probe is not None:
                out["ranks"][f"p{i}-before"], out["rank_views"][f"p{i}-before"] = wait_rank(probe, PROMPTS[i])
            send(f"p{i}-disk", PROMPTS[i])
    finally:
        if probe is not None:
            probe.close()
        serve.close()
    assert serve.proc.returncode == 0, "\n".join(serve.lines[-40:])
    assert vg.ours_left(serve.run) == []
    out["routing"] = vg.routing_log(serve.run / "logs" / "Frontend.log") if layout == "dp2" else {}
    return out


def vg_children(serve: Serve) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(serve.proc.pid)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def wait_rank(probe: vg.RouterProbe, prompt: list[int], timeout: float = 20) -> tuple:
    """(the (worker id, dp rank) the router's view holds most of ``prompt`` on, once it holds
    some, with its (device, host, disk) blocks; the whole view)."""
    deadline = time.monotonic() + timeout
    while True:
        view = probe.rank_scores(prompt)
        best = max(view.items(), key=lambda kv: kv[1][2], default=None)
        if best is not None and best[1][2] > 0 or time.monotonic() > deadline:
            return best, view
        time.sleep(0.2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_served_layout_gives_the_no_offload_tokens_from_host_and_disk(tmp_path, layout):
    if layout in ("tp2", "dp2") and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two ranks bind a core each")
    base = _run(tmp_path, layout, offload=False)
    ours = _run(tmp_path, layout, offload=True)
    tolerance = MLA_LOGPROB_TOLERANCE if layout == "mla" else exactness.LOGPROB_TOLERANCE
    exactness.assert_exact(ours["gens"], base["gens"], f"{layout} served", tolerance=tolerance)
    print(f"{layout}: cached tokens {ours['cached']}\nloaded by tier after each request {ours['loads']}")
    loads = dict(ours["loads"])
    for key in ("p0-host", "p1-disk", "p2-disk"):
        assert ours["cached"][key] > 0, (key, ours["cached"])
    if layout != "dp2":  # one engine: its device cache let the prompts go, its tiers served them
        assert loads["p0-host"]["host"] > loads["f1"]["host"], ours["loads"]
        assert loads["p2-disk"]["disk"] > loads["f3"]["disk"], ours["loads"]
    else:  # two engines, two device caches: the fillers may have gone to the other rank
        print(f"dp ranks (worker, rank) -> (device, host, disk) blocks: {ours['ranks']}")
        ranks = {ours["ranks"][f"p{i}"][0][1] for i in range(3)}
        for i in (1, 2):  # the router still sees the prompt where it was computed, now in host/disk only
            assert ours["ranks"][f"p{i}-before"][0] == ours["ranks"][f"p{i}"][0], ours["ranks"]
            # no other rank holds any of it (each DP rank has tiers of its own), so the cached tokens
            # it came back with say the router sent it to the rank that holds it
            assert all(
                v == (0, 0, 0) for k, v in ours["rank_views"][f"p{i}-before"].items() if k != ours["ranks"][f"p{i}"][0]
            ), ours["rank_views"]
        print(f"prompts computed on dp ranks {sorted(ranks)}")
