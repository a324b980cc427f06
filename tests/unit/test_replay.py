"""The concurrent trace replay: arrivals, the concurrency cap and conversation order hold; the
engines' metric mappings (flexkv_* for the reference engine, vllm:* for vLLM workers) read a
worker's /metrics into the same accounting; the options and defaults (--engine vllm) are what the
command runs. Against a real two-worker reference graph (frontend in KV-router mode, host + SSD
offload) 200+ requests at concurrency 8 finish without an error, and every response's cached
tokens per tier add up, per worker, to that worker's flexkv_* counters. The same graph serves the
dashboard check (every metric the Grafana dashboard queries exists on a running worker's or the
frontend's /metrics) and the `replay --url` command end to end (report, JSON lines, plots);
``-m slow`` runs the demo itself on both engines, smaller."""

import json
import math
import re

import pytest
from dashboard_queries import load_dashboard, queried_metrics, reference_worker_metric
from repo_paths import ROOT
from served import scrape

from dynamo_flexkv.replay.client import RequestRecord, arrival_times, tier_split
from dynamo_flexkv.replay.configs import (
    CONFIGURATIONS,
    ENGINES,
    ConfigRun,
    ReplaySettings,
    WorkerTotals,
    device_block_list,
    parse_configs,
    replay_url,
    worker_totals,
)
from dynamo_flexkv.replay.main import sampled, within_window
from dynamo_flexkv.replay.report import check_accounting, findings, kept_on_worker, percentile, summarize
from dynamo_flexkv.workload import Scale, Turn, trace_turns


# ---- units ----------------------------------------------------------------------------------------
def test_arrivals_are_trace_time_divided_by_the_scale():
    turns = [Turn(0, 0, 5_000, [1], 1), Turn(1, 0, 9_000, [1], 1), Turn(0, 1, 25_000, [1], 1)]
    assert arrival_times(turns, 10) == [0.0, 0.4, 2.0]
    with pytest.raises(ValueError, match="time-scale=0"):
        arrival_times(turns, 0)


def test_tier_split_reads_the_workers_engine_data():
    nvext = {"engine_data": {"flexkv": {"cached_tokens": {"device": 64, "host": 128}}}}
    assert tier_split(nvext) == {"device": 64, "host": 128, "disk": 0, "remote": 0}
    remote = {"engine_data": {"flexkv": {"cached_tokens": {"device": 16, "remote": 256}}}}
    assert tier_split(remote) == {"device": 16, "host": 0, "disk": 0, "remote": 256}
    assert tier_split({"worker_id": {"decode_worker_id": 1}}) is None


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert (percentile(xs, 50), percentile(xs, 90), percentile(xs, 99), percentile(xs, 100)) == (50, 90, 99, 100)
    assert math.isnan(percentile([], 50))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="unknown configuration 'ssd'"):
        parse_configs("host,ssd")
    with pytest.raises(ValueError, match="--device-blocks '64,x'"):
        device_block_list("64,x")
    with pytest.raises(ValueError, match="must be >= 1"):
        device_block_list("0")
    assert [c.name for c in parse_configs("host+ssd, kv-device-only")] == ["host+ssd", "kv-device-only"]


@pytest.mark.parametrize(
    "option,value",
    [
        ("--conversations", "0"),
        ("--sample-every", "-1"),
        ("--concurrency", "0"),
        ("--time-scale", "nan"),
        ("--time-scale", "0"),
        ("--request-timeout", "inf"),
        ("--trace-window-s", "-1"),
        ("--host-gb", "nan"),
        ("--host-gb", "x"),
        ("--ready-timeout", "0"),
    ],
)
def test_out_of_range_numbers_are_refused_by_the_parser(option, value, capsys):
    """argparse refuses them (exit 2, naming the option) before anything is served."""
    import argparse

    from dynamo_flexkv.replay.main import add_arguments

    parser = argparse.ArgumentParser(prog="replay")
    add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args([option, value])
    assert e.value.code == 2 and f"argument {option}:" in capsys.readouterr().err
    assert parser.parse_args([option, "1"]) is not None


@pytest.mark.parametrize(
    "option,value,words",
    [
        ("--configs", "", "is empty"),  # was the defaults, silently: a script's empty variable ran all of them
        ("--sweep-configs", " ", "is empty"),
        ("--device-blocks", "", "is empty"),
        ("--configs", "host,hints,host", "names host more than once"),  # was host run twice, both "host @40 #1"
        ("--sweep-configs", "no-offload,no-offload", "names no-offload more than once"),
        ("--device-blocks", "40,64,40", "names 40 more than once"),  # was every sweep row again at 40
        ("--configs", "host,ssd", "unknown configuration 'ssd'"),
        ("--device-blocks", "40,x", "expected comma-separated block counts"),
    ],
)
def test_configuration_lists_are_refused_by_the_parser_when_empty_unknown_or_repeated(option, value, words, capsys):
    """What runs is what was named, each row once (--repeat runs rows again): argparse refuses the
    rest (exit 2, naming the option) before anything is served."""
    with pytest.raises(SystemExit) as e:
        _parse(option, value)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}:" in err and words in err, err
    assert _parse("--configs", "host, hints", "--device-blocks", "40,64", "--sweep-configs", "host").configs


# What a vLLM worker's /metrics shows (dynamo.vllm 1.6.1 forwarding vLLM 0.31's vllm:* families,
# FlexKVConnector's through vLLM's connector-stats path), trimmed to the families the mapping reads
# and a few it must not (the _created samples, queries, the preempted requests' hits).
VLLM_METRICS = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="vllm-small"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="vllm-small"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="vllm-small"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="length",model_name="vllm-small"} 1.7e9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="vllm-small"} 9000.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="vllm-small"} 9000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="vllm-small"} 1408.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="vllm-small"} 3200.0
# HELP vllm:flexkv_prompt_tokens_cached_total Prompt tokens not recomputed, by the offload tier
# TYPE vllm:flexkv_prompt_tokens_cached_total counter
vllm:flexkv_prompt_tokens_cached_total{engine="0",model_name="vllm-small",source="vllm",tier="host"} 2560.0
vllm:flexkv_prompt_tokens_cached_total{engine="0",model_name="vllm-small",source="vllm",tier="disk"} 640.0
# HELP vllm:flexkv_recomputed_tokens_total Tokens recomputed
# TYPE vllm:flexkv_recomputed_tokens_total counter
vllm:flexkv_recomputed_tokens_total{engine="0",model_name="vllm-small",source="vllm"} 0.0
"""


def test_the_vllm_mapping_reads_a_vllm_workers_metrics():
    """device = vLLM's own prefix-cache hits, host/disk/remote = FlexKVConnector's loaded tokens by
    tier; finished requests summed over finish reasons; a tier with no sample is 0."""
    w = worker_totals(VLLM_METRICS, ENGINES["vllm"].metrics)
    assert (w.requests, w.prompt_tokens) == (7, 9000)
    assert w.cached == {"device": 1408, "host": 2560, "disk": 640, "remote": 0}
    # the reference mapping finds none of its flexkv_* counters there, and reads its own
    assert worker_totals(VLLM_METRICS) == WorkerTotals()
    ref = (
        "flexkv_requests_total 3.0\nflexkv_prompt_tokens_total 300.0\n"
        'flexkv_prompt_tokens_cached_total{tier="device"} 64.0\nflexkv_prompt_tokens_cached_total{tier="disk"} 128.0\n'
    )
    assert worker_totals(ref, ENGINES["reference"].metrics) == WorkerTotals(
        3, 300, {"device": 64, "host": 0, "disk": 128, "remote": 0}
    )
    assert (
        set(ENGINES["vllm"].metrics.cached)
        == set(ENGINES["reference"].metrics.cached)
        == {"device", "host", "disk", "remote"}
    )


def test_configurations_set_the_engines_worker_section():
    assert CONFIGURATIONS["no-offload"].overrides_for("VllmWorker") == ["VllmWorker.offload=false"]
    assert CONFIGURATIONS["no-offload"].overrides_for("FlexKVWorker") == ["FlexKVWorker.offload=false"]
    assert CONFIGURATIONS["host"].overrides_for("VllmWorker") == ["VllmWorker.cache.ssd_cache_gb=0"]
    assert CONFIGURATIONS["kv-device-only"].overrides_for("VllmWorker") == [
        "Frontend.router-host-cache-hit-weight=0",
        "Frontend.router-disk-cache-hit-weight=0",
    ]
    # every override names a section the engine's config has (or Frontend)
    from dynamo_flexkv.serve.plan import load_config

    for e in ENGINES.values():
        sections = set(load_config(str(ROOT / "configs" / f"{e.config}.yaml")))
        assert (ROOT / "graphs" / f"{e.graph}.py").is_file() and e.worker in sections
        for c in CONFIGURATIONS.values():
            assert {o.split(".", 1)[0] for o in c.overrides_for(e.worker)} <= sections, (e.name, c.name)


HINT_METRICS = """\
vllm:flexkv_hints_seen_total{engine="0",model_name="vllm-small",source="vllm"} 5.0
vllm:flexkv_hints_used_total{engine="0",model_name="vllm-small",source="vllm"} 3.0
vllm:flexkv_hint_pulled_tokens_total{engine="0",model_name="vllm-small",source="vllm"} 1920.0
vllm:flexkv_hint_pulled_bytes_total{engine="0",model_name="vllm-small",source="vllm"} 3932160.0
vllm:flexkv_hint_pull_seconds_total{engine="0",model_name="vllm-small",source="vllm"} 0.25
vllm:flexkv_hints_failed_total{engine="0",model_name="vllm-small",reason="timeout",source="vllm"} 1.0
vllm:flexkv_hints_failed_total{engine="0",model_name="vllm-small",reason="busy",source="vllm"} 1.0
vllm:flexkv_peer_pins_total{engine="0",model_name="vllm-small",source="vllm"} 2.0
vllm:flexkv_peer_refused_total{engine="0",model_name="vllm-small",reason="busy",source="vllm"} 1.0
"""


def test_the_hints_row_turns_router_hints_on_and_reads_their_counters():
    from dynamo_flexkv.replay.configs import hint_delta, hint_totals
    from dynamo_flexkv.replay.main import DEFAULT, _check_peers, _for_engine

    hints = CONFIGURATIONS["hints"]
    assert hints.overrides_for("VllmWorker") == ["VllmWorker.router-hints=true"] and hints.vllm_only
    assert not CONFIGURATIONS["host+ssd"].vllm_only and CONFIGURATIONS["lmcache"].vllm_only
    # not a default row while its stall is not understood (docs/HINTS.md); named, only on vLLM
    assert "hints" in DEFAULT.configs.split(",")  # the main job's row beside host+ssd
    assert _for_engine("host+ssd,hints", "vllm") == "host+ssd,hints"
    assert _for_engine(DEFAULT.configs, "reference") == DEFAULT.configs.replace(",hints", "")
    with pytest.raises(ValueError, match="configuration hints runs vLLM workers: use --engine vllm"):
        _check_peers([hints], "reference")
    after = hint_totals(HINT_METRICS)
    assert after["hints_seen"] == 5 and after["hints_used"] == 3 and after["hint_pulled_tokens"] == 1920
    assert after["hints_failed/timeout"] == after["hints_failed/busy"] == after["peer_refused/busy"] == 1
    assert after["hints_skipped"] == after["peer_pins_expired"] == 0  # a counter not there yet: 0
    before = {**after, "hints_seen": 2.0, "hints_failed/busy": 1.0, "hints_failed/timeout": 0.0}
    delta = hint_delta(after, before)
    assert delta["hints_seen"] == 3 and delta["hints_failed/timeout"] == 1 and "hints_failed/busy" not in delta
    assert hint_totals(VLLM_METRICS) == {k: 0.0 for k in hint_totals("")}  # hints off: all 0


def test_the_report_gives_the_hints_row_its_counters_and_pulled_loads_count_as_host():
    """A hints row's summary sums its workers' hint counters (JSON fields and a table); the
    accounting's host loads pulled on a hint count as host against the workers' counters."""
    from dynamo_flexkv.replay.accounting import RequestAccount, RowAccount
    from dynamo_flexkv.replay.report import markdown

    recs = [_record(0, 1, {"device": 10, "host": 20}), _record(1, 2, {"host": 30})]
    for r in recs:
        r.cached_by_tier = None
    workers = {
        "w1": WorkerTotals(1, 100, {"device": 10, "host": 20, "disk": 0, "remote": 0}),
        "w2": WorkerTotals(1, 100, {"device": 0, "host": 30, "disk": 0, "remote": 0}),
    }
    run = ConfigRun(CONFIGURATIONS["hints"], 40, recs, 1.0, workers, {1: "w1", 2: "w2"}, "vllm")
    run.turns = [Turn(i, 0, 0, [1] * 100, 2) for i in range(2)]
    run.hints = {
        "w1": {"hints_seen": 0.0, "peer_pins": 1.0, "peer_refused/busy": 1.0},
        "w2": {"hints_seen": 2.0, "hints_used": 1.0, "hint_pulled_tokens": 20.0, "hints_failed/timeout": 1.0},
    }
    accounts = [
        RequestAccount(0, "w1", 100, {"device": 10, "host": 20, "new": 70}),
        RequestAccount(1, "w2", 100, {"host": 10, "host_pulled": 20, "hint_missed": 20, "new": 50}),
    ]
    run.account = RowAccount(
        accounts, {"device": 10, "host": 30, "host_pulled": 20, "hint_missed": 20, "new": 120}, 200, 0, 0, 2, []
    )
    from dynamo_flexkv.replay.report import _against_counters

    assert _against_counters(run, run.account) == []  # w2: host 10 + pulled 20 = its counter's 30
    s = summarize(run)
    assert s.hints == {
        "hint_pulled_tokens": 20,
        "hints_failed/timeout": 1,
        "hints_seen": 2,
        "hints_used": 1,
        "peer_pins": 1,
        "peer_refused/busy": 1,
    }
    assert s.to_json()["hints"]["hints_seen"] == 2
    assert (
        summarize(ConfigRun(CONFIGURATIONS["host+ssd"], 40, recs, 1.0, workers, {1: "w1", 2: "w2"}, "vllm")).hints == {}
    )
    report = markdown([s], "w", "s")
    assert "| hints @40 | 2 | 1 | 0 | 1 (timeout 1) | 0 | 20 (20) | 0.0 | 0.00 | 1 (0) | 1 (busy 1) |" in report
    assert "| loaded: host, pulled from another worker on a hint | 20 (10%) |" in report
    assert "| computed: another worker held it, its hint's pull failed or was skipped | 20 (10%) |" in report


def _parse(*argv):
    import argparse

    from dynamo_flexkv.replay.main import add_arguments

    parser = argparse.ArgumentParser(prog="replay")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_demo_serves_vllm_by_default_and_the_reference_engine_on_request():
    from dynamo_flexkv.replay.main import DEFAULT, _check_context, _served_name, engine_overrides

    args = _parse()
    assert args.engine == "vllm" and args.graph is None and args.config is None
    args.graph, args.config = str(ROOT / "graphs/agg_router_vllm.py"), str(ROOT / "configs/agg_router_vllm.yaml")
    scale = Scale(max_prompt_tokens=2048, max_output_tokens=8)
    # vLLM's max-model-len: the longest prompt plus output in whole 64-token blocks (33 blocks), so
    # the demo's 40-block device cache holds one request besides the block vLLM keeps back
    assert engine_overrides(ENGINES["vllm"], args, scale) == [
        "VllmWorker.cache.cpu_cache_gb=0.015625",
        "VllmWorker.max-model-len=2112",
    ]
    args.set = engine_overrides(ENGINES["vllm"], args, scale)
    _check_context(args, scale, int(DEFAULT.device_blocks.split(",")[0]))
    _check_context(args, scale, 34)
    with pytest.raises(ValueError, match="cannot hold one request of max-model-len 2112 .* to 34"):
        _check_context(args, scale, 33)
    with pytest.raises(ValueError, match="exceed VllmWorker.max-model-len=2112"):
        _check_context(args, Scale(max_prompt_tokens=2100, max_output_tokens=16), 64)
    assert _served_name(args) == "vllm-small"

    ref = _parse("--engine", "reference", "--host-gb", "0.25")
    ref.graph, ref.config = str(ROOT / "graphs/agg_router.py"), str(ROOT / "configs/agg_router.yaml")
    assert engine_overrides(ENGINES["reference"], ref, scale) == ["FlexKVWorker.cache.cpu_cache_gb=0.25"]
    ref.set = engine_overrides(ENGINES["reference"], ref, scale)
    _check_context(ref, scale, 33)  # 2,112 tokens: the reference engine keeps no block back
    with pytest.raises(ValueError, match="do not fit a device cache of 32 blocks"):
        _check_context(ref, scale, 32)
    assert _served_name(ref) == "flexkv-small"
    with pytest.raises(SystemExit):
        _parse("--engine", "sglang")


def _record(i: int, worker: int, cached: dict) -> RequestRecord:
    return RequestRecord(
        i,
        i,
        0,
        0.0,
        prompt_tokens=100,
        output_tokens=2,
        ttft_ms=10.0 + i,
        e2e_ms=20.0,
        worker_id=worker,
        cached_tokens=sum(cached.values()),
        cached_by_tier=dict(cached),
    )


def test_accounting_names_each_mismatch():
    recs = [_record(0, 1, {"device": 10, "host": 20, "disk": 0}), _record(1, 2, {"device": 0, "host": 0, "disk": 30})]
    workers = {
        "w1": WorkerTotals(1, 100, {"device": 10, "host": 20, "disk": 0}),
        "w2": WorkerTotals(1, 100, {"device": 0, "host": 0, "disk": 30}),
    }
    run = ConfigRun(CONFIGURATIONS["host+ssd"], 64, recs, 1.0, workers, {1: "w1", 2: "w2"})
    assert check_accounting(run) == "exact"
    workers["w2"].cached["disk"] = 29
    assert check_accounting(run) == "w2: disk cached 30 in responses vs 29 in metrics"
    workers["w2"].cached["disk"], workers["w1"].requests = 30, 2
    assert check_accounting(run) == "w1: 1 responses, flexkv_requests_total +2"


def test_vllm_accounting_checks_the_cached_total_against_its_counters():
    """vLLM's responses carry only usage.prompt_tokens_details.cached_tokens: per worker, their sum
    must equal the change of prefix-cache hits (device) plus the connector's loaded tokens (tiers);
    the table's per-tier split then comes from those counters."""
    recs = [_record(0, 1, {"device": 64, "host": 128}), _record(1, 1, {"disk": 64})]
    for r in recs:
        r.cached_by_tier = None
    workers = {"w1": WorkerTotals(2, 200, {"device": 64, "host": 128, "disk": 64, "remote": 0})}
    run = ConfigRun(CONFIGURATIONS["host+ssd"], 40, recs, 1.0, workers, {1: "w1"}, "vllm")
    assert check_accounting(run) == "exact"
    s = summarize(run)
    assert s.tier_source == "worker metrics" and s.engine == "vllm"
    assert s.cached == {"device": 64, "host": 128, "disk": 64, "remote": 0} and s.hit_rate["all"] == 256 / 200
    workers["w1"].requests, workers["w1"].cached["host"] = 3, 64
    assert check_accounting(run) == (
        "w1: 2 responses, vllm:request_success_total +3; w1: cached 256 in responses vs 192 in metrics"
    )


def test_aiperf_gets_our_request_bodies_as_sessions(tmp_path):
    """--client aiperf: each conversation an aiperf session, each turn the body our client sends
    (token ids, greedy, streamed) at its scaled arrival; aiperf's records come back matched to
    the turns by session and turn index."""
    from dynamo_flexkv.replay.aiperf import records_from_export, replay_seconds, write_trace

    turns = [Turn(0, 0, 1_000, [5, 6, 7], 4), Turn(1, 0, 3_000, [8, 9], 2), Turn(0, 1, 5_000, [5, 6, 7, 1], 3)]
    write_trace(turns, "m", 2.0, tmp_path / "t.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [(x["session_id"], x["timestamp"]) for x in lines] == [
        ("conv-0", 0.0),
        ("conv-1", 1000.0),
        ("conv-0", 2000.0),
    ]
    assert lines[2]["payload"] == {
        "model": "m",
        "prompt": [5, 6, 7, 1],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def row(conv: str, k: int, ttft: float, error=None) -> str:
        return json.dumps(
            {
                "metadata": {"conversation_id": conv, "turn_index": k},
                "error": error,
                "metrics": {
                    "time_to_first_token": {"value": ttft},
                    "inter_chunk_latency": {"value": [2.0, 3.0]},
                    "request_latency": {"value": ttft + 5},
                    "output_sequence_length": {"value": 3},
                },
            }
        )

    recs = records_from_export(
        [row("conv-0", 1, 30.0), row("conv-1", 0, 20.0, {"message": "HTTP 503"}), row("conv-0", 0, 10.0)], turns, 2.0
    )
    assert [(r.conversation, r.turn, r.ttft_ms, r.error) for r in recs] == [
        (0, 0, 10.0, None),
        (1, 0, 20.0, "HTTP 503"),
        (0, 1, 30.0, None),
    ]
    assert recs[2].itl_ms == [2.0, 3.0] and recs[2].prompt_tokens == 4 and recs[2].arrival_s == 2.0
    missing = records_from_export([row("conv-0", 0, 10.0)], turns)
    assert [r.error for r in missing] == [None, "aiperf sent no request for it", "aiperf sent no request for it"]
    with pytest.raises(RuntimeError, match="session 'conv-7' turn 0"):
        records_from_export([row("conv-7", 0, 1.0)], turns)
    spans = [
        json.dumps({"metadata": {"request_start_ns": a, "request_end_ns": b}})
        for a, b in ((5_000_000_000, 6_000_000_000), (4_500_000_000, 9_000_000_000))
    ]
    assert replay_seconds(spans) == 4.5  # first start to last end, not aiperf's own start-up


def test_aiperf_runs_are_accounted_from_the_workers_counters():
    """aiperf's records name no worker and no cached tokens: hits, requests per worker and the
    accounting (the graph's totals) come from the workers' counters; no later turn counts as kept."""
    recs = [
        RequestRecord(i, i % 2, i // 2, 0.0, prompt_tokens=100, output_tokens=2, ttft_ms=5.0, itl_ms=[1.0])
        for i in range(4)
    ]
    workers = {
        "w1": WorkerTotals(3, 300, {"device": 64, "host": 64, "disk": 0, "remote": 0}),
        "w2": WorkerTotals(1, 100, {"device": 0, "host": 0, "disk": 64, "remote": 0}),
    }
    run = ConfigRun(CONFIGURATIONS["host+ssd"], 40, recs, 1.0, workers, {}, "vllm", "aiperf")
    s = summarize(run)
    assert s.client == "aiperf" and s.accounting.startswith("totals exact")
    assert s.requests_per_worker == {"w1": 3, "w2": 1} and math.isnan(s.kept_on_worker)
    assert s.hit_rate["all"] == 192 / 400 and s.computed_tokens == 400 - 192
    workers["w2"].requests = 2
    assert check_accounting(run) == "4 requests of 400 prompt tokens succeeded, the workers' counters say 5 of 400"


def test_plots_skip_what_has_no_data(tmp_path):
    """No request succeeded: no plot (matplotlib failed on the empty legend of requests per worker)."""
    from dynamo_flexkv.replay.plots import write_plots

    failed = [RequestRecord(i, i, 0, 0.0, error="ClientConnectorError: 127.0.0.1:9") for i in range(2)]
    run = ConfigRun(CONFIGURATIONS["host+ssd"], 0, failed, 1.0, {}, {})
    assert write_plots(tmp_path, [run], [summarize(run)], 0) == []
    run = ConfigRun(CONFIGURATIONS["host+ssd"], 0, failed + [_record(2, 1, {"device": 10})], 1.0, {}, {})
    assert [p.name for p in write_plots(tmp_path, [run], [summarize(run)], 0)] == [
        "ttft_cdf.png",
        "cached_tokens.png",
        "requests_per_worker.png",
        "throughput.png",
    ]


def test_findings_say_when_the_measurement_disagrees():
    def summary(config: str, cached_host: int, ttft: float):
        recs = [_record(i, 1, {"device": 10, "host": cached_host, "disk": 0}) for i in range(4)]
        for r in recs:
            r.ttft_ms = ttft
        workers = {"w1": WorkerTotals(4, 400, {"device": 40, "host": 4 * cached_host, "disk": 0})}
        return summarize(ConfigRun(CONFIGURATIONS[config], 64, recs, 2.0, workers, {1: "w1"}))

    good = findings([summary("host+ssd", 50, 100.0), summary("kv-device-only", 10, 300.0)])
    assert good == [
        "- 64 device blocks: tier-aware routing beats device-only routing: hit rate 60% vs 20%, "
        "TTFT p50 100 vs 300 ms (later turns - vs - ms; on their previous turn's worker - vs -).",
        "- One run per row: the spread is not known (--repeat 3 measures it).",
    ]
    bad = findings([summary("host+ssd", 50, 400.0), summary("kv-device-only", 10, 300.0)])
    assert "does NOT beat" in bad[0]
    # Three runs each: medians, and whether each difference exceeds the rows' ranges.
    runs = []
    for rep, (ttft_tiered, ttft_device) in enumerate([(100.0, 300.0), (250.0, 200.0), (120.0, 320.0)], 1):
        for s in (summary("host+ssd", 50, ttft_tiered), summary("kv-device-only", 10, ttft_device)):
            s.repeat = rep
            runs.append(s)
    assert findings(runs) == [
        "- 64 device blocks: tier-aware routing beats device-only routing: hit rate 60% vs 20% (beyond the "
        "spread), TTFT p50 120 vs 300 ms (within the spread) (later turns - vs - ms; on their previous turn's "
        "worker - vs -)."
    ]


def test_goodput_counts_requests_within_the_ttft_target_per_minute_against_no_offload():
    from dynamo_flexkv.replay.report import TtftTarget, apply_goodput

    def run(config: str, ttfts, rate: float = 1.0):
        recs = [_record(i, 1, {"device": 10}) for i in range(len(ttfts))]
        for r, t in zip(recs, ttfts):
            r.ttft_ms = t
        r = ConfigRun(CONFIGURATIONS[config], 40, recs, 30.0, {}, {1: "w1"}, time_scale=20 * rate)
        return r, summarize(r, 20)

    runs = [run("no-offload", [10, 20, 30, 50]), run("host+ssd", [5, 10, 15, 60]), run("host+ssd", [5, 45, 90, 95], 2)]
    summaries = [s for _, s in runs]
    why = apply_goodput(summaries, [r for r, _ in runs], TtftTarget.parse("2x"))
    # 2x no-offload's p50 at the trace's rate (20 ms, nearest rank) = 40 ms; 30 s of replay
    assert why.startswith("40 ms = 2x no-offload's TTFT p50 at the trace's rate")
    assert [(s.rate, s.goodput_target_ms, s.goodput_rpm) for s in summaries] == [(1, 40, 6), (1, 40, 6), (2, 40, 2)]
    assert summaries[1].goodput_ratio == 1.0 and math.isnan(summaries[2].goodput_ratio)  # no no-offload at x2
    assert apply_goodput(summaries, [r for r, _ in runs], TtftTarget.parse("12ms")) == "12 ms, fixed (--ttft-target)"
    assert [s.goodput_rpm for s in summaries] == [2, 4, 2]
    assert summaries[0].to_json()["goodput_rpm"] == 2
    for bad in ("fast", "0", "-2x", "nanms"):
        with pytest.raises(ValueError, match="--ttft-target"):
            TtftTarget.parse(bad)


def test_a_rows_runs_give_median_and_range_and_differences_are_judged_against_them():
    from dynamo_flexkv.replay.report import Spread, beyond

    a, b = Spread.of([30.0, 10.0, 20.0]), Spread.of([35.0, 40.0, 50.0])
    assert (a.median, a.low, a.high, a.n) == (20.0, 10.0, 30.0, 3)
    assert a.fmt(lambda x: f"{x:.0f}") == "20 (10-30)"
    assert beyond(a, b) == "beyond the spread" and beyond(a, Spread.of([25.0, 60.0])) == "within the spread"
    assert beyond(a, Spread.of([99.0])) == "one run: spread unknown"
    assert Spread.of([float("nan")]).n == 0


def test_repeated_rows_run_interleaved_with_the_higher_rate_after_each_round():
    from dynamo_flexkv.replay.main import interleaved

    plan = [("a", 40), ("b", 40), ("a", 64)]
    assert interleaved(plan, 2.0, 2) == [
        ("a", 40, 1.0, 1),
        ("b", 40, 1.0, 1),
        ("a", 64, 1.0, 1),
        ("a", 40, 2.0, 1),
        ("b", 40, 2.0, 1),
        ("a", 40, 1.0, 2),
        ("b", 40, 1.0, 2),
        ("a", 64, 1.0, 2),
        ("a", 40, 2.0, 2),
        ("b", 40, 2.0, 2),
    ]
    assert interleaved(plan, 0, 1) == [("a", 40, 1.0, 1), ("b", 40, 1.0, 1), ("a", 64, 1.0, 1)]


def test_later_turns_kept_on_their_previous_worker():
    recs = [
        RequestRecord(0, 0, 0, 0.0, worker_id=1),
        RequestRecord(1, 0, 1, 1.0, worker_id=1),
        RequestRecord(2, 0, 2, 2.0, worker_id=2),
        RequestRecord(3, 1, 0, 0.5, worker_id=2),
    ]
    assert kept_on_worker(recs) == 0.5  # turn 1 stayed on worker 1, turn 2 moved to worker 2
    assert math.isnan(kept_on_worker(recs[:1]))


def test_main_job_samples_conversations_and_cuts_the_window():
    turns = trace_turns(Scale(conversations=12))
    every_third = sampled(turns, 3)
    assert sorted({t.conversation for t in every_third}) == [0, 1, 2, 3]
    assert [t.tokens for t in every_third if t.conversation == 1] == [t.tokens for t in turns if t.conversation == 3]
    t0 = min(t.timestamp_ms for t in turns)
    early = within_window(turns, 300)
    assert early and all(t.timestamp_ms - t0 <= 300_000 for t in early) and len(early) < len(turns)
    assert within_window(turns, None) == turns
    with pytest.raises(ValueError, match="--trace-window-s -1"):
        within_window(turns, -1)


# ---- against a served graph -------------------------------------------------------------------------
TINY = [
    "Common.model=tiny",
    "Common.served-model-name=flexkv-tiny",
    "Frontend.http-port=0",
    "FlexKVWorker.num-device-blocks=64",  # 1,024 tokens per worker: most prefixes leave the device
    "FlexKVWorker.cache.cpu_cache_gb=0.002",  # 256 tiny blocks: the disk tier serves hits too
    "FlexKVWorker.cache.ssd_cache_gb=0.05",
]
SCALE = Scale(
    conversations=64,
    max_turns=6,
    tokens_per_hash_block=16,  # 207 requests
    max_prompt_tokens=1000,
    max_output_tokens=3,
)  # prompt + output within 64 blocks of 16 tokens
CONCURRENCY = 8


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    tmp = tmp_path_factory.mktemp("replay-graph")
    config = apply_overrides(
        load_config(str(ROOT / "configs" / "agg_router.yaml")),
        [*TINY, f"FlexKVWorker.cache.ssd_cache_dir={tmp}/ssd{{replica}}"],
    )
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg_router.py")), config, run_dir=tmp / "run")
    with Launcher(plan) as launcher:
        launcher.wait_ready(240)
        yield plan, launcher


@pytest.fixture(scope="module")
def replayed(graph):
    plan, launcher = graph
    turns = trace_turns(SCALE)
    run = replay_url(
        plan.base_url,
        plan.served_model_name,
        ReplaySettings(turns, time_scale=1000, concurrency=CONCURRENCY),
        ports=[p.port for p in plan.workers],
        on_done=lambda r: None,
    )
    launcher.check_alive()
    return turns, run


@pytest.mark.served
def test_replay_at_concurrency_8_accounts_every_tier_exactly(replayed):
    turns, run = replayed
    assert len(run.records) == len(turns) >= 200
    assert [r.error for r in run.records if r.error] == []
    s = summarize(run)
    assert s.requests == len(turns) and s.errors == 0
    # per-request tiers from the responses, adding up per worker to the workers' own counters
    assert s.tier_source == "responses"
    assert s.accounting == "exact"
    assert sum(s.requests_per_worker.values()) == len(turns) and min(s.requests_per_worker.values()) > 0
    for t in ("device", "host", "disk"):
        assert s.cached[t] > 0, f"the workload never hit the {t} tier: {s.cached}"
    assert all(r.cached_tokens == sum(r.cached_by_tier.values()) for r in run.records)
    assert s.prompt_tokens == sum(len(t.tokens) for t in turns)


@pytest.mark.served
def test_replay_keeps_arrivals_the_cap_and_conversation_order(replayed):
    turns, run = replayed
    eps = 0.002
    spans = [(r.sent_s, r.sent_s + r.e2e_ms / 1000) for r in run.records]
    in_flight = [sum(1 for a, b in spans if a <= s + eps and s < b - eps) for s, _ in spans]
    assert max(in_flight) == CONCURRENCY  # everything arrives at once: the cap binds, and holds
    assert all(r.sent_s >= r.arrival_s - eps for r in run.records)
    previous = {}
    for r in sorted(run.records, key=lambda r: (r.conversation, r.turn)):
        if r.turn > 0:
            p = previous[r.conversation]
            assert r.sent_s >= p.sent_s + p.e2e_ms / 1000 - eps, "a turn went out before its previous turn answered"
        previous[r.conversation] = r
    assert all(r.ttft_ms <= r.e2e_ms and len(r.itl_ms) == r.output_tokens - 1 for r in run.records)


def _metric_names(url: str) -> set:
    text = scrape(url)
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"^([a-z_:][a-z0-9_:]*)[{ ]", text, re.M)} | set(
        re.findall(r"^([a-z_:][a-z0-9_:]*)[{ ]", text, re.M)
    )


@pytest.mark.served
def test_every_dashboard_metric_exists_on_the_running_graph(graph, replayed):
    plan, _ = graph
    workers = set.union(*(_metric_names(f"http://127.0.0.1:{p.port}/metrics") for p in plan.workers))
    frontend = _metric_names(f"{plan.base_url}/metrics")
    queried = {m: p for m, p in queried_metrics(load_dashboard()).items() if reference_worker_metric(m)}
    missing = {m: panels for m, panels in queried.items() if m not in workers | frontend}
    assert missing == {}
    exported = {m for m in workers if m.startswith("flexkv_") and not re.search(r"_(bucket|sum|count)$", m)}
    assert exported - set(queried_metrics(load_dashboard())) == set(), "flexkv_ metrics not on the dashboard"


def replay_argv(plan, out, summaries, *extra: str) -> list:
    """`dynamo-flexkv replay` of 6 small conversations against the served graph ``plan``."""
    workers = ",".join(str(p.port) for p in plan.workers)
    return [
        "replay", "--engine", "reference", *extra, "--url", plan.base_url, "--model", plan.served_model_name,
        "--worker-metrics", workers, "--conversations", "6", "--tokens-per-hash-block", "16",
        "--max-prompt-tokens", "1000", "--time-scale", "500", "--concurrency", "4",
        "--out", str(out), "--json", str(summaries),
    ]  # fmt: skip


@pytest.mark.served
def test_replay_command_against_a_served_graph(graph, replayed, tmp_path):
    from dynamo_flexkv.cli import main

    plan, _ = graph
    out, summaries = tmp_path / "results", tmp_path / "summaries.jsonl"
    code = main(replay_argv(plan, out, summaries))
    assert code == 0
    report = (out / "report.md").read_text()
    assert "| served | 0 |" in report
    assert "accounting against the workers' counters: served @0: exact" in report
    assert "requests flexkv_requests_total" in report
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert lines[0]["bench"] == "replay" and lines[0]["errors"] == 0 and lines[0]["tier_source"] == "responses"
    runs = [x for x in lines if x["bench"] == "replay"]  # the trace's rate and --higher-rate's (default 2x)
    assert len(runs) == 2 and len([x for x in lines if x["bench"] == "replay-request"]) == sum(
        r["requests"] for r in runs
    )
    assert [json.loads(x)["config"] for x in summaries.read_text().splitlines()] == ["served", "served"]  # both rates
    for png in ("ttft_cdf.png", "cached_tokens.png", "requests_per_worker.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


@pytest.mark.slow
@pytest.mark.served
def test_replay_timed_by_aiperf_against_a_served_graph(graph, replayed, tmp_path):
    """The same replay with aiperf as the client (installed into .venv-aiperf on first use): every
    turn answered with a TTFT and inter-chunk gaps aiperf measured, the graph's request and prompt
    token totals equal to what aiperf sent."""
    from dynamo_flexkv.cli import main

    plan, _ = graph
    out, summaries = tmp_path / "results", tmp_path / "summaries.jsonl"
    code = main(replay_argv(plan, out, summaries, "--client", "aiperf"))
    assert code == 0
    report = (out / "report.md").read_text()
    assert "Timed by: aiperf" in report and "served @0: totals exact" in report
    requests = [
        json.loads(x)
        for x in (out / "results.jsonl").read_text().splitlines()
        if json.loads(x)["bench"] == "replay-request"
    ]
    assert requests and all(r["error"] is None and r["ttft_ms"] > 0 for r in requests)
    # Chunks that reach aiperf in one read share a timestamp (gaps 0.0, TTFT == e2e); the gaps
    # always add up to the time from the first chunk to the last (aiperf rounds each to 0.01 ms).
    for r in requests:
        assert len(r["itl_ms"]) >= 1 and all(g >= 0 for g in r["itl_ms"]), r
        assert abs(sum(r["itl_ms"]) - (r["e2e_ms"] - r["ttft_ms"])) <= 0.01 * len(r["itl_ms"]), r
    summary = json.loads(summaries.read_text().splitlines()[0])
    assert summary["client"] == "aiperf" and summary["errors"] == 0 and summary["requests"] == len(requests)


@pytest.mark.slow
@pytest.mark.served
def test_main_job_compares_configurations_end_to_end(tmp_path):
    """`dynamo-flexkv demo` as a user runs it, smaller: each configuration on its own served graph,
    a second device size, the table, the findings and every plot."""
    import subprocess
    import sys

    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "demo",
            "--engine",
            "reference",
            "--conversations",
            "8",
            "--configs",
            "host+ssd,kv-device-only",
            "--device-blocks",
            "64,128",
            "--sweep-configs",
            "host+ssd",
            "--higher-rate",
            "0",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "s.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| host+ssd | 64 |" in proc.stdout and "| kv-device-only | 64 |" in proc.stdout
    assert "| host+ssd | 128 |" in proc.stdout and "tier-aware routing" in proc.stdout
    assert str(out) in proc.stdout
    summaries = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(s["config"], s["device_blocks"]) for s in summaries] == [
        ("host+ssd", 64),
        ("kv-device-only", 64),
        ("host+ssd", 128),
    ]
    assert all(s["errors"] == 0 and s["accounting"] == "exact" for s in summaries)
    # every prompt token accounted for (the reference engine's responses say their tiers)
    assert all(sum(s["account"].values()) == s["prompt_tokens"] and s["account_check"] == "exact" for s in summaries)
    for png in ("ttft_cdf.png", "cached_tokens.png", "requests_per_worker.png", "throughput.png", "device_sweep.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


@pytest.mark.slow
@pytest.mark.served
def test_the_vllm_demo_end_to_end(tmp_path):
    """`dynamo-flexkv demo` on its default engine, tiny: two vLLM workers (small preset, random
    weights) with no offload, then with FlexKVConnector's host + SSD tiers, 24 device blocks each;
    every request answered, the responses' cached tokens add up per worker to vLLM's prefix-cache
    hits plus the connector's loaded tokens, table and plots written. 10m27s at load ~12 (two
    vLLM graphs starting, 4-5 min each at that load)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    import subprocess
    import sys

    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "demo",
            "--conversations",
            "6",
            "--configs",
            "no-offload,host+ssd",
            "--device-blocks",
            "24",
            "--max-prompt-tokens",
            "1024",
            "--time-scale",
            "100",
            "--higher-rate",
            "0",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "s.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert "| no-offload | 24 |" in proc.stdout and "| host+ssd | 24 |" in proc.stdout
    assert "vllm:prefix_cache_hits_total" in proc.stdout and "agg_router_vllm.py" in proc.stdout
    summaries = {s["config"]: s for s in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines())}
    assert set(summaries) == {"no-offload", "host+ssd"}
    for s in summaries.values():
        assert s["engine"] == "vllm" and s["errors"] == 0 and s["requests"] > 0, s
        assert s["accounting"] == "exact" and s["tier_source"] == "worker metrics", s
        assert sum(s["requests_per_worker"].values()) == s["requests"]
        # every prompt token accounted for, from the workers' KV events and the connector's records
        assert sum(s["account"].values()) == s["prompt_tokens"] and s["account_check"] == "exact", s
        assert s["account"]["device"] == s["cached"]["device"], s
    assert summaries["no-offload"]["cached"]["host"] == summaries["no-offload"]["cached"]["disk"] == 0
    # At this size the router kept later turns where the device still held them (measured: host+ssd
    # cached 2,560 device tokens, none from the tiers); the default demo's host tier serves 23-27%.
    for png in ("ttft_cdf.png", "cached_tokens.png", "requests_per_worker.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
