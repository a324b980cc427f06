"""bench vllm: the parts that need no engine (arguments, prompts, case names, ratios, the engines'
environment), and a slow smoke run of the whole bench against real vLLM (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from dynamo_flexkv.bench import BENCHES, NOT_IN_ALL, build_parser
from dynamo_flexkv.bench import vllm_setup as vs
from dynamo_flexkv.bench import vllm_ttft as v
from dynamo_flexkv.core.procgroup import members


def test_registered_and_left_out_of_all():
    assert BENCHES["vllm"][0] == "dynamo_flexkv.bench.vllm_ttft"
    assert "vllm" in NOT_IN_ALL
    a = build_parser().parse_args(
        ["vllm", "--quick", "--repeat", "1", "--sizes", "2k", "--compare-offloading-connector"]
    )
    assert (a.name, a.quick, a.repeat, a.sizes, a.compare_offloading_connector) == ("vllm", True, 1, "2k", True)
    a = build_parser().parse_args(["vllm"])
    assert a.repeat is None and a.sizes is None and a.compare_offloading_connector is False


def test_sizes_and_repeats():
    assert vs.parse_sizes("2k,8k") == [2048, 8192]
    assert vs.parse_sizes(" 32K, 2048 ,2k") == [2048, 32768]
    for bad in ("", ",", "64", "1x"):
        with pytest.raises(ValueError):
            vs.parse_sizes(bad)
    p = build_parser()
    assert v.plan(p.parse_args(["vllm"])) == ([2048, 8192, 32768], 3)
    assert v.plan(p.parse_args(["vllm", "--quick"])) == ([2048, 8192], 2)
    assert v.plan(p.parse_args(["vllm", "--quick", "--sizes", "4k", "--repeat", "5"])) == ([4096], 5)
    with pytest.raises(ValueError):
        v.plan(p.parse_args(["vllm", "--repeat", "0"]))
    assert [vs.label(n) for n in (2048, 8192, 32768, 3000)] == ["2k", "8k", "32k", "3000"]


def test_cached_prefix_is_90_percent_in_whole_blocks():
    assert {n: vs.cached_tokens(n) for n in (2048, 8192, 32768)} == {2048: 1856, 8192: 7360, 32768: 29504}
    for n in range(128, 5000, 37):
        c = vs.cached_tokens(n)
        assert c % 64 == 0 and 64 <= c < n
        assert abs(c - 0.9 * n) <= 32 or c == (n - 1) // 64 * 64


def test_prompts_are_deterministic_and_never_share_a_first_block():
    assert vs.fresh_prompt(0, 2048, 1) == vs.fresh_prompt(0, 2048, 1)
    pre = vs.prefix_prompt(0, 2048)
    assert len(pre) == 1856 and pre == vs.prefix_prompt(0, 2048)
    firsts = {tuple(vs.fresh_prompt(0, 2048, i)[:64]) for i in range(3)} | {tuple(pre[:64])}
    assert len(firsts) == 4
    sufs = [vs.suffix(0, 2048, 64, kind, i) for kind in ("device", "disk") for i in range(3)]
    assert all(len(s) == 2048 - 1856 for s in sufs)
    assert len({tuple(s[:64]) for s in sufs}) == 6  # no request finds another one's stored suffix
    lo, hi = vs.TOKEN_RANGE
    assert all(lo <= t < hi for t in pre)


def _recs(ms, cached=0, token=7):
    return [{"wall_s": m / 1e3, "engine_s": m / 1e3 - 0.002, "cached": cached, "token": token} for m in ms]


def test_cases_names_baselines_and_ratios():
    r = {
        "recompute-8192": _recs([1000, 900, 1100]),
        "device-hit-8192": _recs([30, 20, 40], 7360),
        "host-8192": _recs([60, 50, 70], 7360),
        "disk-8192": _recs([80, 90, 70], 7360),
        "remote-8192": _recs([100, 120, 110], 7360),
        "miss-8192": _recs([1010, 1020, 1000]),
        "recompute-2048": _recs([100]),
        "host-2048": _recs([20], 1856),
    }
    cases = {c.case: c for c in v.build_cases(r, [2048, 8192], checks={"disk-8192": [115, 115, 115]})}
    assert set(cases) == {
        "recompute-8k",
        "device-hit-90-8k",
        "host-90-8k",
        "host-90-8k-vs-device-hit",
        "disk-90-8k",
        "disk-90-8k-vs-device-hit",
        "remote-90-8k",
        "remote-90-8k-vs-device-hit",
        "miss-8k",
        "recompute-2k",
        "host-90-2k",
    }  # no device hit at 2k: no -vs-device-hit row there
    c = cases["host-90-8k"]
    assert (c.bench, c.unit, c.ours, c.baseline) == ("vllm", "ms", 60, 1000) and c.ratio == pytest.approx(0.06)
    assert cases["host-90-8k-vs-device-hit"].baseline == 30 and cases["host-90-8k-vs-device-hit"].ratio == 2.0
    assert cases["miss-8k"].ours == 1010 and cases["miss-8k"].baseline == 1000
    assert cases["recompute-8k"].ratio == 1.0
    assert "7360 cached, median of 3 (50-70 ms)" in c.note and "vLLM metrics 58 ms" in c.note
    assert "115 blocks per request from it (tier_stats)" in cases["disk-90-8k"].note
    j = c.to_json()
    assert j["case"] == "host-90-8k" and j["ratio"] == pytest.approx(0.06) and j["baseline_name"]
    # With vLLM's OffloadingConnector measured too: its rows and ours against theirs.
    r.update({"offloading-host-8192": _recs([45], 7360), "offloading-miss-8192": _recs([1005])})
    cases = {c.case: c for c in v.build_cases(r, [8192])}
    assert cases["host-90-8k-vs-offloading"].ratio == pytest.approx(60 / 45)
    assert {"offloading-host-90-8k", "offloading-host-90-8k-vs-device-hit", "offloading-miss-8k"} <= set(cases)


def test_first_tokens_are_checked_against_the_reference_engine():
    r = {
        "device-hit-2048": _recs([1, 1], token=5),
        "host-2048": _recs([1, 1], token=5),
        "recompute-2048": _recs([1, 1], token=9),
        "miss-2048": [_recs([1], token=9)[0], _recs([1], token=8)[0]],
    }
    assert v.check_tokens(r, [2048]) == ["miss-2048 request 1: first token 8 != recompute's 9"]
    r["remote-2048"] = _recs([1], token=4)
    assert len(v.check_tokens(r, [2048])) == 2


def test_engine_environment_and_connector_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "99")
    monkeypatch.setenv("FLEXKV_CONFIG_PATH", "/nope.yaml")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    plain = vs.engine_env(str(tmp_path), "plain", 1 << 30, 2 << 30)
    assert not any(k.startswith("FLEXKV_") for k in plain)  # no tier settings of the caller leak in
    assert plain["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    ours = vs.engine_env(str(tmp_path), "flexkv", 1 << 30, 2 << 30)
    assert float(ours["FLEXKV_CPU_CACHE_GB"]) == 1.0 and float(ours["FLEXKV_SSD_CACHE_GB"]) == 2.0
    assert os.path.isdir(ours["FLEXKV_SSD_CACHE_DIR"]) and "FLEXKV_ENABLE_REMOTE" not in ours
    remote = vs.engine_env(str(tmp_path), "flexkv-remote", 1 << 30, 2 << 30, "redis://127.0.0.1:1")
    assert remote["FLEXKV_ENABLE_REMOTE"] == "true" and remote["FLEXKV_REMOTE_CACHE_URL"] == "redis://127.0.0.1:1"
    assert remote["FLEXKV_SSD_CACHE_DIR"] != ours["FLEXKV_SSD_CACHE_DIR"]  # fresh local tiers per engine
    assert vs.kv_transfer_config("plain", 1) is None
    kt = vs.kv_transfer_config("flexkv", 1)
    assert (kt["kv_connector"], kt["kv_connector_module_path"], kt["kv_load_failure_policy"]) == (
        "FlexKVConnector",
        "dynamo_flexkv.integrations.vllm_connector",
        "recompute",
    )
    off = vs.kv_transfer_config("offloading", 123)
    assert off["kv_connector"] == "OffloadingConnector"
    assert off["kv_connector_extra_config"] == {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 123}
    assert v.block_bytes() == 128 << 10  # small preset in bf16, 64-token blocks


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_vllm
def test_offloading_connector_is_refused_on_the_cpu_platform():
    ok, platform = v.offloading_platform_ok()
    if ok:
        pytest.skip(f"vLLM here runs on {platform}: the OffloadingConnector cases run")
    assert platform == "cpu" and "refuses" in v.OFFLOADING_SKIP


@needs_vllm
@pytest.mark.slow
@pytest.mark.bench
def test_bench_vllm_smoke(tmp_path):
    """The whole bench at one size, one request per case (three vLLM engines, one after the other):
    3 min 17 s here at load ~1, most of it the three engines' start-up (~50 s each)."""
    out = tmp_path / "vllm.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.bench",
            "vllm",
            "--quick",
            "--sizes",
            "2k",
            "--repeat",
            "1",
            "--compare-offloading-connector",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    want = {
        "recompute-2k",
        "device-hit-90-2k",
        "host-90-2k",
        "host-90-2k-vs-device-hit",
        "disk-90-2k",
        "disk-90-2k-vs-device-hit",
        "miss-2k",
    }
    assert want <= set(rows), sorted(rows)
    if "remote-90-2k" not in rows:
        assert "redis-server not installed" in p.stdout
    for r in rows.values():
        assert r["bench"] == "vllm" and r["unit"] == "ms" and r["ours"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"])
    # Loading 90% of the prompt beats computing it.
    assert rows["host-90-2k"]["ratio"] < 1 and rows["device-hit-90-2k"]["ratio"] < 1
    if "offloading-host-90-2k" not in rows:
        assert "OffloadingConnector (CPUOffloadingSpec) refuses it" in p.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--model", ""], "unknown model preset ''"),
        (["--sizes", ""], "--sizes: no size given"),
        (["--sizes", "abc"], "--sizes: 'abc' is not a token count"),
        (["--sizes", "8k"], "--sizes 8192 tokens: the engines hold at most 8191"),
        (["--repeat", "0"], "--repeat 0: needs at least 1"),
        (["--repeat", "-1"], "--repeat -1: needs at least 1"),
        (["--handover-verify", ""], "--handover-verify '': expected bytes and/or owner"),
        (["--handover-verify", "owner,crc"], "--handover-verify 'owner,crc': expected bytes and/or owner"),
    ],
)
def test_bench_disagg_vllm_refuses_bad_arguments_before_starting_anything(tmp_path, argv, message):
    from dynamo_flexkv.bench import vllm_disagg

    args = build_parser().parse_args(["disagg", "--vllm", "--dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        vllm_disagg.run(args)
    assert list(tmp_path.iterdir()) == []  # no work directory left behind


@needs_vllm
@pytest.mark.slow
@pytest.mark.bench
def test_bench_disagg_vllm_smoke(tmp_path):
    """bench disagg --vllm at its quick sizes, two repeats: each case's handover moved the bytes
    the prefill engine held (the bench checks that against NixlConnector's counter) at a positive
    rate, beside a positive raw NIXL rate; as root the nodes placement runs too and its decode
    node's link carried at least those bytes; the served agg_vllm and disagg_vllm graphs give
    positive TTFT and inter-token latencies."""
    out = tmp_path / "disagg.jsonl"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.bench",
            "disagg",
            "--vllm",
            "--quick",
            "--repeat",
            "2",
            "--handover-verify",
            "owner",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    where = ["loopback"] + (["nodes"] if os.geteuid() == 0 else [])
    serving = {f"vllm-serving-{m}-p{q}" for m in ("ttft", "itl") for q in (50, 99)}
    sizes = ("256", "1K")  # --quick: the default model's first two sizes
    assert set(rows) == {f"vllm-{w}-handover-owner-{k}" for w in where for k in sizes} | serving, sorted(rows)
    for r in rows.values():
        assert r["unit"] == ("ms" if r["case"] in serving else "GB/s") and r["ours"] > 0 and r["baseline"] > 0
    for k in sizes:
        if "nodes" in where:
            note = rows[f"vllm-nodes-handover-owner-{k}"]["note"]
            mib = float(re.search(r"([\d.]+) MiB", note)[1])
            received = int(note.split("link received ")[1].split(" B")[0].replace(",", ""))
            # per round (3): the handover, the raw read in its step, a warm and a timed raw read
            # between steps, all over the link, none over shared memory
            assert received >= 0.99 * 12 * mib * 2**20, note


@pytest.mark.integration
def test_the_pair_waits_for_idle_engines_by_their_cpu_time():
    """bench vllm's recompute/miss pair starts a request only once both engines' process groups
    are idle (measured from /proc): a spinning group keeps it waiting, a sleeping one does not."""
    from dynamo_flexkv.bench.vllm_pair import group_cpu_s, wait_quiet

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        with pytest.raises(RuntimeError, match="still busy"):
            wait_quiet([busy.pid, idle.pid], timeout_s=1.0)
        assert group_cpu_s(busy.pid) > 0.1
        busy.kill()
        busy.wait()
        assert wait_quiet([busy.pid, idle.pid], timeout_s=30.0) < 30.0
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


# ---- --node: ours through the node cache beside ours embedded ------------------------------------------------
def test_node_rows_put_the_node_cache_against_embedded_in_the_same_case():
    r = {
        "recompute-8192": _recs([1000]),
        "device-hit-8192": _recs([30], 7360),
        "miss-8192": _recs([1000]),
        "node-miss-8192": _recs([1020]),
        "host-8192": _recs([60], 7360),
        "node-host-8192": _recs([66], 7360),
        "disk-8192": _recs([80], 7360),
        "node-disk-8192": _recs([72], 7360),
        "restart-8192": _recs([90], 7360),
        "node-restart-8192": _recs([45], 7360),
    }
    cases = {c.case: c for c in v.build_cases(r, [8192])}
    assert cases["host-90-node-vs-embedded-8k"].ratio == pytest.approx(1.1)
    assert cases["disk-90-node-vs-embedded-8k"].ratio == pytest.approx(0.9)
    assert cases["miss-node-vs-embedded-8k"].ratio == pytest.approx(1.02)
    assert cases["restart-90-node-vs-embedded-8k"].ratio == pytest.approx(0.5)
    assert cases["node-miss-8k"].baseline == 1000 and "node cache" in cases["node-host-90-8k"].note
    # A node case must give the same prompt's first token as the engine that computed it.
    r["node-host-8192"] = _recs([66], 7360, token=3)
    assert v.check_tokens(r, [8192]) == ["node-host-8192 request 0: first token 3 != device-hit's 7"]


@pytest.mark.integration
def test_node_is_refused_for_other_benches():
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.bench", "index", "--node"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "--node is bench vllm's" in p.stderr, p.stderr[-2000:]


@pytest.mark.integration
def test_the_node_engines_attach_to_a_real_cache_server_that_stops_with_its_group(tmp_path):
    """What `bench vllm --node` gives its node engines: a running cache server with our engine's
    host and disk sizes, its socket in their environment, no local tier of their own."""
    from dynamo_flexkv.bench.vllm_node import new_server

    server = new_server(str(tmp_path), 64 << 20, 256 << 20, 64)
    try:
        env = vs.engine_env(str(tmp_path), "flexkv-node", 64 << 20, 0, node_socket=server.socket)
        assert (env["FLEXKV_MODE"], env["FLEXKV_NODE_SOCKET"]) == ("node", server.socket)
        assert "FLEXKV_SSD_CACHE_DIR" not in env and "FLEXKV_CPU_CACHE_GB" not in env
        assert os.path.exists(server.socket)
        pid = server.proc.pid
    finally:
        server.stop()
    assert members(pid) == []  # no live process (zombies wait for init)


# ---- --pull: a prefix pulled on a router hint, beside recompute, the own host tier and Redis -------------------
def test_pull_rows_put_the_hinted_pull_against_recompute_host_and_redis():
    from dynamo_flexkv.bench import vllm_pull as vp

    hint = {"hints_seen": 1, "hints_used": 1, "hint_pulled_bytes": 115 * (128 << 10), "hint_pull_seconds": 0.02}
    pull = [dict(r, hints=hint) for r in _recs([300, 320, 310], 7360)]
    r = {"recompute-8192": _recs([1000, 1100, 1200]), "pull-8192": pull, "host-8192": _recs([200], 7360)}
    r["remote-8192"] = _recs([400], 7360)
    wire = [vp.RedisInfo(2_000, 115 * 131_500, 0)]
    extra = {8192: {"raw_ms": 5.0, "remote_wire": wire, "stored": vp.RedisInfo(115 * 131_200, 4_000, 115 * 140_000)}}
    cases = {c.case: c for c in vp.build_cases(r, [8192], extra, "; load 1")}
    assert set(cases) == {
        "recompute-8k",
        "pull-8k",
        "host-90-8k",
        "remote-90-8k",
        "pull-vs-recompute-8k",
        "pull-vs-host-8k",
        "pull-vs-remote-8k",
        "pull-read-8k",
        "wire-per-block-8k",
        "redis-memory-per-block-8k",
    }
    assert cases["pull-vs-recompute-8k"].ratio == pytest.approx(310 / 1100)
    assert cases["pull-vs-host-8k"].ratio == pytest.approx(310 / 200)
    assert cases["pull-vs-remote-8k"].ratio == pytest.approx(310 / 400)
    assert (cases["pull-read-8k"].ours, cases["pull-read-8k"].baseline) == (pytest.approx(20.0), 5.0)
    assert (
        cases["wire-per-block-8k"].ours == pytest.approx(131_500) and cases["wire-per-block-8k"].baseline == 128 << 10
    )
    assert cases["redis-memory-per-block-8k"].ours == pytest.approx(140_000)
    assert "115 blocks (14.4 MiB) pulled" in cases["pull-8k"].note and "load 1" in cases["recompute-8k"].note
    # Without the pull's records (a size that failed) no row of that size.
    assert vp.build_cases({"recompute-8192": _recs([1])}, [8192], {}) == []


def test_a_pulled_request_must_give_the_no_connector_engines_first_token():
    r = {"ref-pull-2048": _recs([1], token=5), "pull-2048": _recs([1], token=6)}
    assert v.check_tokens(r, [2048]) == ["pull-2048 request 0: first token 6 != ref-pull's 5"]


@pytest.mark.parametrize("argv", [["index", "--pull"], ["vllm", "--pull", "--node"]])
def test_pull_is_refused_for_other_benches_and_beside_node_or_peer(argv):
    from dynamo_flexkv.bench import run

    with pytest.raises(SystemExit) as e:
        run(build_parser().parse_args(argv))
    assert e.value.code == 2


@pytest.mark.integration
def test_the_pulls_loopback_ceiling_is_a_raw_nixl_read_that_moves_the_bytes():
    from dynamo_flexkv.bench.vllm_pull import raw_read_ms

    assert raw_read_ms(8, 64 << 10, repeat=3) > 0  # raises if the bytes read differ from the source's


@needs_vllm
@pytest.mark.slow
@pytest.mark.bench
def test_bench_vllm_pull_smoke(tmp_path):
    """bench vllm --pull at its smallest case (2K, one request per case; four vLLM engines and a
    redis-server): the rows exist, the pull used its hint (the bench fails otherwise) and every
    loaded request gave the no-connector engine's first token. 4 min here at load 7-9."""
    out = tmp_path / "pull.jsonl"
    argv = ["vllm", "--pull", "--sizes", "2k", "--repeat", "1", "--json", str(out), "--dir", str(tmp_path)]
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.bench", *argv], capture_output=True, text=True, timeout=1200
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    want = {"recompute-2k", "pull-2k", "host-90-2k", "remote-90-2k", "pull-vs-recompute-2k", "pull-vs-host-2k"}
    assert want | {"pull-read-2k", "wire-per-block-2k", "redis-memory-per-block-2k"} <= set(rows), sorted(rows)
    assert "hints used 1/1" in rows["pull-2k"]["note"]
    assert "first tokens equal the no-connector engine's (1 of 1)" in rows["pull-2k"]["note"]
    # No timing bound: one 2K request each on a busy machine (pull / recompute was 1.05 once at load 8).
    assert all(r["ours"] > 0 and r["baseline"] > 0 for r in rows.values())
