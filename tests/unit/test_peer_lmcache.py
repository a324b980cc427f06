"""bench vllm --peer lmcache: the parts that need no engine (refusals, the server's command line,
case names, ratio rows, first-token checks, the interleaving, shared-memory cleanup), and a slow
test that serves a prompt through LMCache MP on our vLLM and sees its second send cached."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

from dynamo_flexkv.bench import build_parser
from dynamo_flexkv.bench import peer_lmcache as lmc
from dynamo_flexkv.bench import vllm_setup as vs
from dynamo_flexkv.bench import vllm_ttft as v


def _recs(ms, cached=0, token=7):
    return [{"wall_s": m / 1e3, "engine_s": None, "cached": cached, "token": token} for m in ms]


# ---- refusals -----------------------------------------------------------------------------------------
def test_peer_absent_exits_2_naming_the_install_command_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(lmc.PREFIX_ENV, str(tmp_path / "nope"))
    work = tmp_path / "work"
    work.mkdir()
    args = build_parser().parse_args(["vllm", "--peer", "lmcache", "--dir", str(work)])
    with pytest.raises(SystemExit) as e:
        v.run(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "make peer-lmcache" in err and "not lmcache 0.5.6" in err, err
    assert list(work.iterdir()) == []  # no work directory, no engine


def test_another_lmcache_version_in_the_prefix_is_named(tmp_path, monkeypatch):
    (tmp_path / "lmcache-0.4.0.dist-info").mkdir()
    monkeypatch.setenv(lmc.PREFIX_ENV, str(tmp_path))
    assert "lmcache-0.4.0.dist-info, not lmcache 0.5.6" in lmc.missing_reason(lmc.prefix_dir())
    (tmp_path / "lmcache-0.5.6.dist-info").mkdir()
    assert lmc.missing_reason(lmc.prefix_dir()) is None and lmc.require_installed() == tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["vllm", "--peer", "vllm"], "invalid choice: 'vllm'"),
        (["index", "--peer", "lmcache"], "--peer lmcache is bench vllm's"),
        (["all", "--peer", "lmcache"], "--peer lmcache is bench vllm's"),
    ],
)
@pytest.mark.integration
def test_bad_peer_arguments_exit_2(argv, message):
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.bench", *argv], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and message in p.stderr, (p.returncode, p.stderr[-2000:])


# ---- what the engines and the server are given ---------------------------------------------------------
def test_server_command_line_and_connector_config(tmp_path):
    s = lmc.LMCacheServer(tmp_path, str(tmp_path), 256 << 20, 64, port=5001, http_port=5002)
    a = s.args()
    opt = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--")}
    assert a[1:5] == ["-m", "lmcache.cli.main", "server", "--host"]
    assert (opt["--host"], opt["--http-host"], opt["--port"], opt["--http-port"]) == (
        "127.0.0.1",
        "127.0.0.1",
        "5001",
        "5002",
    )
    assert opt["--chunk-size"] == "64" and float(opt["--l1-size-gb"]) == 0.25 and opt["--eviction-policy"] == "LRU"
    assert '"type": "fs"' in opt["--l2-adapter"] and '"use_odirect": true' in opt["--l2-adapter"]
    assert "--disable-observability" in a and s.http == "http://127.0.0.1:5002"
    kt = lmc.kv_transfer_config(5001)["kv_connector_extra_config"]
    assert kt == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": 5001,
        "lmcache.mp.mp_transfer_mode": "lmcache_driven",
    }
    env = lmc.peer_env({"PYTHONPATH": "/a"}, Path("/p"))
    assert env["PYTHONPATH"] == os.pathsep.join(["/p", "/a"]) and lmc.peer_env({}, Path("/p"))["PYTHONPATH"] == "/p"


def test_restart_engine_starts_on_the_flexkv_engines_disk_tier(tmp_path):
    a = vs.engine_env(str(tmp_path), "flexkv", 1 << 30, 2 << 30)
    b = vs.engine_env(str(tmp_path), "flexkv-restart", 1 << 30, 2 << 30)
    assert a["FLEXKV_SSD_CACHE_DIR"] == b["FLEXKV_SSD_CACHE_DIR"] and a["FLEXKV_RUN_DIR"] != b["FLEXKV_RUN_DIR"]


# ---- results -> rows -------------------------------------------------------------------------------------
def test_lmcache_rows_and_the_vs_lmcache_verdict_rows():
    r = {
        "recompute-8192": _recs([1000, 1000]),
        "device-hit-8192": _recs([40], 7360),
        "host-8192": _recs([60, 50], 7360),
        "disk-8192": _recs([80], 7360),
        "restart-8192": _recs([90], 7360),
        "miss-8192": _recs([1010]),
        "lmcache-host-8192": _recs([40], 7360),
        "lmcache-disk-8192": _recs([160], 7360),
        "lmcache-restart-8192": _recs([45], 7360),
        "lmcache-miss-8192": _recs([1100]),
        "recompute-2048": _recs([100]),
        "host-2048": _recs([20], 1856),
    }  # no LMCache row at 2k: no verdict there
    cases = {c.case: c for c in v.build_cases(r, [2048, 8192], checks={"lmcache-disk-8192": [115]})}
    for name in (
        "lmcache-host-90-8k",
        "lmcache-disk-90-8k",
        "lmcache-restart-90-8k",
        "lmcache-miss-8k",
        "restart-90-8k",
        "lmcache-host-90-8k-vs-device-hit",
    ):
        assert cases[name].baseline in (1000, 40), name
    assert "115 blocks per request from it (vLLM's cached tokens)" in cases["lmcache-disk-90-8k"].note
    verdict = {k: c for k, c in cases.items() if "vs-lmcache" in k}
    assert set(verdict) == {
        "host-90-vs-lmcache-8k",
        "disk-90-vs-lmcache-8k",
        "miss-vs-lmcache-8k",
        "restart-90-vs-lmcache-8k",
    }
    assert verdict["host-90-vs-lmcache-8k"].ratio == pytest.approx(55 / 40)  # our median / theirs
    assert verdict["disk-90-vs-lmcache-8k"].ratio == pytest.approx(0.5)
    assert verdict["miss-vs-lmcache-8k"].ratio == pytest.approx(1010 / 1100)
    assert verdict["restart-90-vs-lmcache-8k"].ratio == pytest.approx(2.0)
    j = verdict["disk-90-vs-lmcache-8k"].to_json()
    assert j["bench"] == "vllm" and j["unit"] == "ms" and "LMCache 0.5.6" in j["baseline_name"]


def test_every_loaded_case_is_checked_against_the_same_prompts_reference():
    ok = {
        "device-hit-2048": _recs([1], token=5),
        "ref-disk-2048": _recs([1], token=6),
        "ref-restart-2048": _recs([1], token=4),
        "recompute-2048": _recs([1], token=9),
    }
    good = dict(
        ok,
        **{
            "disk-2048": _recs([1], token=6),
            "lmcache-disk-2048": _recs([1], token=6),
            "lmcache-host-2048": _recs([1], token=5),
            "restart-2048": _recs([1], token=4),
            "lmcache-restart-2048": _recs([1], token=4),
            "lmcache-miss-2048": _recs([1], token=9),
        },
    )
    assert v.check_tokens(good, [2048]) == []
    for case in ("disk", "lmcache-disk", "lmcache-host", "restart", "lmcache-restart", "lmcache-miss"):
        bad = dict(good, **{f"{case}-2048": _recs([1], token=1)})
        assert [m.split(":")[0] for m in v.check_tokens(bad, [2048])] == [f"{case}-2048 request 0"], case


# ---- the interleaving and the cleanup --------------------------------------------------------------------
class _FakeEngine:
    """Stands for a ServedEngine: an idle process group, and the requests it was sent."""

    def __init__(self, log):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        self.log = log

    def request(self, case, size, index, timeout_s):
        self.log.append(case)
        return {"cached": 0, "wall_s": 0.1, "token": 1}

    def call(self, cmd, timeout_s, waiting_for):
        self.log.append(f"{cmd['tier']}-{cmd['size']}#{cmd['index']}")
        return {"cached": 1856, "wall_s": 0.1, "token": 1, "loaded_blocks": 29}


def _stop(engines):
    for e in engines:
        e.proc.kill()
        e.proc.wait()


@pytest.mark.integration
def test_three_engines_are_interleaved_in_reversed_order_each_round():
    from dynamo_flexkv.bench.vllm_pair import run_interleaved

    log: list = []
    engines = [_FakeEngine(log) for _ in range(3)]
    try:
        out = run_interleaved([list(zip(engines, ("recompute", "miss", "lmcache-miss")))], [2048], 2, timeout_s=10)
    finally:
        _stop(engines)
    assert log == [f"{c}-2048" for c in ("recompute", "miss", "lmcache-miss", "lmcache-miss", "miss", "recompute")]
    assert {k: len(r) for k, r in out.items()} == {"recompute-2048": 2, "miss-2048": 2, "lmcache-miss-2048": 2}


@pytest.mark.integration
def test_each_loaded_case_takes_turns_with_the_peers_same_case():
    from dynamo_flexkv.bench.vllm_pair import run_interleaved

    log: list = []
    ours, theirs = _FakeEngine(log), _FakeEngine(log)
    try:
        out = run_interleaved(
            [[(ours, "host"), (theirs, "lmcache-host")], [(ours, "disk"), (theirs, "lmcache-disk")]],
            [2048, 8192],
            2,
            timeout_s=10,
            tier=True,
        )
    finally:
        _stop([ours, theirs])
    assert log[:8] == [
        "host-2048#0",
        "lmcache-host-2048#0",
        "lmcache-host-2048#1",
        "host-2048#1",
        "disk-2048#0",
        "lmcache-disk-2048#0",
        "lmcache-disk-2048#1",
        "disk-2048#1",
    ]
    assert len(log) == 16 and log[8] == "host-8192#0"
    assert set(out) == {f"{c}-{n}" for c in ("host", "lmcache-host", "disk", "lmcache-disk") for n in (2048, 8192)}


@pytest.mark.integration
def test_only_new_segments_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lmcache_kv_1_0").write_text("")  # there before the run: not ours to remove
    before = lmc.shm_segments(str(tmp_path))
    for name in (f"lmcache_kv_{dead.pid}_0", f"lmcache_kv_{os.getpid()}_3", "other_segment"):
        (tmp_path / name).write_text("")
    assert lmc.remove_orphan_shm(before, str(tmp_path)) == [f"lmcache_kv_{dead.pid}_0"]
    assert {p.name for p in tmp_path.iterdir()} == {"lmcache_kv_1_0", f"lmcache_kv_{os.getpid()}_3", "other_segment"}


# ---- LMCache MP on our vLLM ---------------------------------------------------------------------------------
_PEER_MISSING = lmc.missing_reason(lmc.prefix_dir())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.skipif(
    _PEER_MISSING is not None,
    reason=f"LMCache {lmc.VERSION} is not installed ({_PEER_MISSING}): install it with {lmc.INSTALL}",
)
@pytest.mark.integration
def test_lmcache_mp_serves_a_prompt_again_from_its_cache(tmp_path):
    """One 1,024-token prompt through LMCacheMPConnector (vLLM's prefix cache reset after each
    send): the first send computes it, the second gets 15 of its 16 blocks from LMCache's CPU tier,
    a third after its CPU tier was cleared from its disk tier, all with the same first token. So
    the bench's LMCache rows cannot degrade to recompute unseen."""
    from dynamo_flexkv.bench.vllm_pair import ServedEngine
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    shm_before = lmc.shm_segments()
    model_dir = write_model_dir(EngineModelConfig.preset("small"), str(tmp_path / "model"), context_length=2048)
    spec = {
        "model_dir": str(model_dir),
        "sizes": [1024],
        "repeat": 1,
        "seed": 0,
        "block_size": 64,
        "max_model_len": 2048,
        "kv_cache_bytes": 128 << 20,
        "warmup_sizes": [256],
    }
    with lmc.LMCacheServer(lmc.prefix_dir(), str(tmp_path), 64 << 20, 64) as server:
        spec.update(kv_transfer_config=lmc.kv_transfer_config(server.port), lmcache_http=server.http)
        env = lmc.peer_env(vs.engine_env(str(tmp_path), "plain", 0, 0), lmc.prefix_dir())
        eng = ServedEngine("lmcache-test", spec, env, str(tmp_path))
        try:
            eng.wait_ready(600)
            first = eng.request("send", 1024, 0, 300)
            assert lmc.l1_state(server.http)["objects"] >= 16
            second = eng.request("send", 1024, 0, 300)
            lmc.clear_l1(server.http)
            third = eng.request("send", 1024, 0, 300)
        finally:
            eng.stop()
    assert first["cached"] == 0, first
    assert second["cached"] >= 960 and third["cached"] >= 960, (second, third)
    assert first["token"] == second["token"] == third["token"]
    lmc.remove_orphan_shm(shm_before)
    assert set(lmc.shm_segments()) <= set(shm_before)


# ---- the replay's lmcache row ------------------------------------------------------------------------------


def _vllm_config(*sets: str):
    from dynamo_flexkv.serve.plan import apply_overrides, load_config

    return apply_overrides(
        load_config(str(ROOT / "configs" / "agg_router_vllm.yaml")),
        ["Frontend.http-port=0", "VllmWorker.cache.cpu_cache_gb=0.0625", *sets],
    )


def test_the_replays_lmcache_row_serves_the_same_graph_on_one_lmcache_server_for_the_node(tmp_path, monkeypatch):
    """`replay --configs lmcache`: our offload off, LMCacheMPConnector in every worker, one LMCache
    server for the node planned before the workers (the launcher waits for it and stops it after
    them), its CPU tier the workers' host tiers together, its chunks the workers' blocks."""
    import json

    from dynamo_flexkv.replay.configs import CONFIGURATIONS
    from dynamo_flexkv.replay.peers import SERVER, add_lmcache_server, lmcache_config
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.graph import Kind
    from dynamo_flexkv.serve.plan import build_plan

    (tmp_path / "peer" / "lmcache-0.5.6.dist-info").mkdir(parents=True)
    monkeypatch.setenv(lmc.PREFIX_ENV, str(tmp_path / "peer"))
    assert CONFIGURATIONS["lmcache"].peer == "lmcache" and not CONFIGURATIONS["lmcache"].offload
    cfg, server = lmcache_config(_vllm_config(), "VllmWorker", tmp_path / "run")
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg_router_vllm.py")), cfg, run_dir=tmp_path / "run")
    add_lmcache_server(plan, server)
    kinds = [(p.name, p.kind) for p in plan.processes]
    assert kinds.index((SERVER, Kind.CACHE)) < min(i for i, (_, k) in enumerate(kinds) if k is Kind.WORKER)
    assert server.l1_bytes == 2 * int(0.0625 * (1 << 30)) and server.chunk_tokens == 64
    assert len(plan.workers) == 2
    for w in plan.workers:
        kt = json.loads(w.argv[w.argv.index("--kv-transfer-config") + 1])
        assert (
            kt["kv_connector"] == "LMCacheMPConnector"
            and kt["kv_connector_extra_config"]["lmcache.mp.port"] == server.port
        )
        assert "FlexKVConnector" not in " ".join(w.argv) and w.cache is None
        assert w.env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "peer")


def test_the_replays_lmcache_row_is_refused_before_anything_is_served_without_lmcache_or_on_the_reference_engine(
    tmp_path, monkeypatch, capsys
):
    import argparse

    from dynamo_flexkv.replay.main import add_arguments
    from dynamo_flexkv.replay.main import run as replay_run

    monkeypatch.setenv(lmc.PREFIX_ENV, str(tmp_path / "nope"))
    for argv, message in (
        (["--configs", "host+ssd,lmcache"], "not lmcache 0.5.6; install it with make peer-lmcache"),
        (["--engine", "reference", "--configs", "lmcache"], "runs vLLM workers: use --engine vllm"),
    ):
        p = argparse.ArgumentParser()
        add_arguments(p)
        out = tmp_path / "out"
        assert replay_run(p.parse_args([*argv, "--out", str(out)])) == 1
        assert message in capsys.readouterr().err
        assert not out.exists()  # nothing served, nothing written
    with pytest.raises(ValueError, match="make peer-lmcache"):
        from dynamo_flexkv.replay.peers import lmcache_config

        lmcache_config(_vllm_config(), "VllmWorker", tmp_path)
