"""Streaming clients see every token. NVIDIA's aiperf (the benchmark client Dynamo documents),
unmodified, replays a small Mooncake trace against a served graph (real frontend in KV-router
mode, two reference-engine workers of the `small` preset) with streaming: every request succeeds
and has a time to first token and an inter-token latency above zero. That needs a stream chunk per
generated token, so every id the model can emit must decode to text (integrations/dynamo_worker/model_dir.py): with a
261-token tokenizer under a 32,000-id model most requests arrived as one or two chunks and aiperf
counted them as errors. aiperf is installed into its own venv, ``.venv-aiperf/``, the first time
this runs (about 2 minutes, 1.2 GB); slow, so not in the default suite. Our own replay client
counts tokens per chunk (``chunk_tokens``), checked here too."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from repo_paths import ROOT

from dynamo_flexkv.core.procgroup import kill_group
from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_hf_cache_entry
from dynamo_flexkv.replay.aiperf import aiperf_exe
from dynamo_flexkv.replay.client import chunk_tokens

BLOCK = 64  # tokens per KV block of the small preset: one trace hash id per block
TOKENIZER = "flexkv/small"  # aiperf's --tokenizer: a repo id in an HF cache laid out by write_hf_cache_entry
SMALL = [
    "Common.model=small",
    "Common.served-model-name=flexkv-small",
    "Frontend.http-port=0",
    "FlexKVWorker.num-device-blocks=64",
    "FlexKVWorker.cache.cpu_cache_gb=0.02",
    "FlexKVWorker.cache.ssd_cache_gb=0.1",
]


@pytest.mark.unit
def test_replay_client_counts_tokens_not_text():
    """A chunk whose text is still empty (a byte that starts a UTF-8 character) carries a token."""
    assert chunk_tokens({"choices": [{"text": ""}]}, {"completion_token_ids": [112]}) == 1
    assert chunk_tokens({"choices": [{"text": "\u00e9 ba"}]}, {"completion_token_ids": [150, 261]}) == 2
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}, {}) == 0
    assert chunk_tokens({"choices": [{"text": "x"}]}, {}) == 1  # a server that sends no token ids


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """The demo's graph (agg_router: KV router, two workers with host + SSD tiers), small preset."""
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    tmp = tmp_path_factory.mktemp("aiperf-graph")
    config = apply_overrides(
        load_config(str(ROOT / "configs" / "agg_router.yaml")),
        [*SMALL, f"FlexKVWorker.cache.ssd_cache_dir={tmp}/ssd{{replica}}"],
    )
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg_router.py")), config, run_dir=tmp / "run")
    with Launcher(plan) as launcher:
        launcher.wait_ready(300)
        yield plan, launcher


def write_trace(path: Path) -> int:
    """A Mooncake-format trace: 3 conversations of 4 turns, each turn's prompt extends the previous
    one's (shared hash ids, so prefixes hit the cache), 150 ms apart, 16 output tokens each."""
    lines = []
    for i in range(12):
        conv, turn = i % 3, i // 3
        blocks = 3 * (turn + 1)  # 192 to 768 prompt tokens: prompt + output fit 64 device blocks
        lines.append(
            {
                "timestamp": 150 * i,
                "input_length": BLOCK * blocks,
                "output_length": 16,
                "hash_ids": [1000 * conv + k for k in range(blocks)],
            }
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return len(lines)


def run_aiperf(plan, tmp: Path, timeout_s: float = 600) -> tuple:
    """One ``aiperf profile`` of the trace against the graph's frontend; returns its artifact dir
    and the number of requests in the trace.
    aiperf starts a dozen processes of its own: all run in one new session, which is killed
    whole when it is done or past the time limit."""
    exe = aiperf_exe()
    trace, out, hub = tmp / "trace.jsonl", tmp / "aiperf", tmp / "hub"
    requests = write_trace(trace)
    write_hf_cache_entry(plan.run_dir / "model", hub, TOKENIZER)
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "XDG_CACHE_HOME": str(tmp / "cache"),
        "MPLCONFIGDIR": str(tmp / "mpl"),
    }
    argv = [
        str(exe),
        "profile",
        "-m",
        plan.served_model_name,
        "--url",
        plan.base_url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        TOKENIZER,
        "--input-file",
        str(trace),
        "--custom-dataset-type",
        "mooncake_trace",
        "--isl-block-size",
        str(BLOCK),
        "--fixed-schedule",
        "--use-server-token-count",
        "--random-seed",
        "1",
        "--request-timeout-seconds",
        "120",
        "--ui",
        "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--workers-max",
        "2",
        "--output-artifact-dir",
        str(out),
    ]
    with open(tmp / "aiperf.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(proc)  # stragglers of its session (or aiperf itself, timed out), trackers last
    tail = (tmp / "aiperf.log").read_text()[-4000:]
    assert code == 0, f"aiperf {'timed out' if code is None else f'exited {code}'}:\n{tail}"
    return out, requests


def _value(record: dict, metric: str) -> float:
    m = (record.get("metrics") or {}).get(metric)
    return float(m["value"]) if isinstance(m, dict) and m.get("value") is not None else math.nan


@pytest.mark.slow
def test_aiperf_streams_every_request_with_ttft_and_itl(graph, tmp_path):
    plan, launcher = graph
    out, requests = run_aiperf(plan, tmp_path)
    launcher.check_alive()

    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    records = [json.loads(x) for x in next(out.rglob("profile_export.jsonl")).read_text().splitlines() if x.strip()]
    errors = [r.get("error") for r in records if r.get("error")]
    assert errors == [], f"{len(errors)} of {len(records)} requests failed: {errors[:3]}"
    assert len(records) == requests and not summary.get("error_summary"), summary.get("error_summary")
    ttft = [_value(r, "time_to_first_token") for r in records]
    itl = [_value(r, "inter_token_latency") for r in records]
    osl = [_value(r, "output_sequence_length") for r in records]
    assert all(t > 0 for t in ttft), ttft
    assert all(t > 0 for t in itl), itl  # >= 2 chunks with text: not all tokens in one chunk at the end
    assert all(n >= 2 for n in osl), osl
    latency = [_value(r, "request_latency") for r in records]
    assert all(t < e for t, e in zip(ttft, latency)), "the first token came with the last"
    # A chunk per token, but for a byte 0x80-0xFF (part of a UTF-8 character): the frontend holds
    # its text until the next token (128 of the 32,000 ids).
    chunks = sum(1 + len((r["metrics"].get("inter_chunk_latency") or {}).get("value") or []) for r in records)
    assert chunks >= 0.9 * sum(osl), f"{chunks} chunks with text for {sum(osl):.0f} tokens"
    t, i = summary["time_to_first_token"], summary["inter_token_latency"]
    print(
        f"aiperf: {len(records)} requests, 0 errors, {chunks} chunks with text for {sum(osl):.0f} tokens, "
        f"TTFT p50 {t['p50']:.1f} ms p99 {t['p99']:.1f} ms, ITL p50 {i['p50']:.1f} ms"
    )
