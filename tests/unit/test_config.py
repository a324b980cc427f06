import os

import pytest

from dynamo_flexkv.core.config import CacheConfig, ConfigError
from dynamo_flexkv.core.index.policies import EvictionPolicy
from dynamo_flexkv.core.layout import ModelSpec

LLAMA8B = ModelSpec(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")


def test_defaults_and_capacity_in_blocks():
    cfg = CacheConfig.load(env={})
    assert cfg.tokens_per_block == 16 and cfg.eviction_policy is EvictionPolicy.LRU
    # Llama-3.1-8B, 16 tokens: 32 layers * 2 * 16 * 8 * 128 * 2 bytes = 2 MiB per block.
    assert cfg.layout(LLAMA8B, 1).block_bytes == 2 * 1024 * 1024
    assert cfg.replace(cpu_cache_gb=1).tier_blocks(LLAMA8B) == {"host": 512, "disk": 0}


def test_yaml_then_env_override(tmp_path):
    path = tmp_path / "c.yaml"
    ssd = tmp_path / "ssd"
    path.write_text(f"cpu_cache_gb: 2\nssd_cache_gb: 8\nssd_cache_dir: {ssd}\neviction_policy: SLRU\n")
    cfg = CacheConfig.load(env={"FLEXKV_CONFIG_PATH": str(path), "FLEXKV_CPU_CACHE_GB": "3"})
    assert cfg.cpu_cache_gb == 3.0 and cfg.ssd_cache_gb == 8.0
    assert cfg.ssd_cache_dir == (str(ssd),) and cfg.eviction_policy is EvictionPolicy.SLRU
    assert not ssd.exists()  # reading a config creates nothing: the disk tier makes it when it starts


def test_kvbm_aliases_and_dir_list(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = CacheConfig.load(
        env={
            "DYN_KVBM_CPU_CACHE_GB": "1.5",
            "DYN_KVBM_DISK_CACHE_GB": "4",
            "DYN_KVBM_DISK_CACHE_DIR": f"{a};{b}",
            "FLEXKV_EVICTION_POLICY": "FILO",
            "FLEXKV_ENABLE_NIXL": "yes",
        }
    )
    assert cfg.cpu_cache_gb == 1.5 and cfg.ssd_cache_gb == 4 and cfg.ssd_cache_dir == (str(a), str(b))
    assert cfg.eviction_policy is EvictionPolicy.FILO and cfg.enable_nixl is True


@pytest.mark.parametrize(
    "values, words",
    [
        ({"cpu_cache_gbb": 1}, "unknown config key 'cpu_cache_gbb' in test; did you mean 'cpu_cache_gb'?"),
        ({"tokens_per_block": 24}, "tokens_per_block=24 must be a power of two"),
        ({"tokens_per_block": 0}, "tokens_per_block=0 must be a power of two"),
        ({"cpu_cache_gb": -1}, "cpu_cache_gb=-1.0 must be >= 0"),
        ({"ssd_cache_gb": 10}, "ssd_cache_gb=10.0 needs ssd_cache_dir"),
        ({"eviction_policy": "random"}, "unknown eviction_policy 'random'"),
        ({"evict_ratio": 0}, "evict_ratio=0.0 must be in (0, 1]"),
        ({"evict_start_threshold": 1.5}, "evict_start_threshold=1.5 must be in (0, 1]"),
        ({"enable_gds": "maybe"}, "enable_gds='maybe' in test is invalid"),
        ({"io_queue_depth": 0}, "io_queue_depth=0 must be in [1, 32768]"),
        ({"disk_admission_hits": 1.5}, "disk_admission_hits=1.5 in test is invalid"),
        ({"host_layout": "LAYERFIRST"}, "unknown config key 'host_layout'"),
        ({"enable_gds": True}, "enable_gds=true needs a disk tier"),
    ],
)
def test_bad_values_name_key_and_fix(values, words):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(values, source="test")
    assert words in str(info.value)


def test_ssd_smaller_than_cpu(tmp_path):
    with pytest.raises(ConfigError, match="ssd_cache_gb=1.0 is smaller than cpu_cache_gb=4.0"):
        CacheConfig.from_dict({"cpu_cache_gb": 4, "ssd_cache_gb": 1, "ssd_cache_dir": str(tmp_path)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits; test_unwritable_dir covers the root case")
def test_unwritable_dir_as_user(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        CacheConfig.from_dict({"cpu_cache_gb": 1, "ssd_cache_gb": 2, "ssd_cache_dir": str(ro / "x")})


def test_unwritable_dir(tmp_path):
    # A regular file where a directory should be fails for root too.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"ssd_cache_dir .* is not writable .*set ssd_cache_gb=0"):
        CacheConfig.from_dict({"cpu_cache_gb": 1, "ssd_cache_gb": 2, "ssd_cache_dir": str(blocker / "sub")})


def test_capacity_too_small_for_one_block():
    cfg = CacheConfig.from_dict({"cpu_cache_gb": 0.001})
    with pytest.raises(ConfigError, match=r"cpu_cache_gb=0.001 holds no block of 2097152 bytes"):
        cfg.tier_blocks(LLAMA8B)
    with pytest.raises(ConfigError, match="cpu_cache_gb=0"):
        CacheConfig.from_dict({"cpu_cache_gb": 0}).tier_blocks(LLAMA8B)


def test_contradicting_env_names():
    with pytest.raises(ConfigError, match="FLEXKV_SSD_CACHE_GB='2' and DYN_KVBM_DISK_CACHE_GB='3' both set"):
        CacheConfig.load(env={"FLEXKV_SSD_CACHE_GB": "2", "DYN_KVBM_DISK_CACHE_GB": "3"})


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        CacheConfig.load(env={"FLEXKV_CONFIG_PATH": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        CacheConfig.load(str(bad), env={})
    typo = tmp_path / "typo.yaml"
    typo.write_text("evict_ration: 0.1\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'evict_ration' in {typo}; did you mean 'evict_ratio'"):
        CacheConfig.load(str(typo), env={})


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"kv_dim": 3}, "kv_dim must be 2"),
        ({"dtype": "float64"}, "dtype 'float64' is not supported"),
    ],
)
def test_bad_model(kw, words):
    base = dict(num_layers=2, num_kv_heads=2, head_size=8)
    base.update(kw)
    with pytest.raises(ValueError, match=words):
        ModelSpec(**base)


# ---- the constructor checks and converts like the loader (defects found as a new user) -----------


def test_constructor_takes_a_directory_string_like_the_loader(tmp_path, monkeypatch):
    """One directory, not one per letter; a config's check of it creates nothing (a template such as
    serve's ``w{replica}`` or a mistyped path is never made by reading a config)."""
    monkeypatch.chdir(tmp_path)
    cfg = CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir="some-dir")
    assert cfg.ssd_cache_dir == ("some-dir",)
    assert os.listdir(tmp_path) == []  # checked in its parent, created by the disk tier, not here
    absolute = tmp_path / "a" / "b"
    cfg = CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=f"{absolute};{tmp_path / 'c'}")
    assert cfg.ssd_cache_dir == (str(absolute), str(tmp_path / "c"))
    assert CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=absolute).ssd_cache_dir == (str(absolute),)
    assert cfg.replace(ssd_cache_dir=str(absolute)).ssd_cache_dir == (str(absolute),)


def test_constructor_parses_the_policy_and_rejects_unknown_ones():
    assert CacheConfig(eviction_policy="lfu").eviction_policy is EvictionPolicy.LFU
    assert CacheConfig(eviction_policy="SLRU").eviction_policy is EvictionPolicy.SLRU
    with pytest.raises(
        ConfigError,
        match=r"eviction_policy='bogus' in CacheConfig\(\) is invalid: unknown "
        r"eviction_policy 'bogus': use one of lru, lfu",
    ):
        CacheConfig(eviction_policy="bogus")
    with pytest.raises(ConfigError, match=r"cpu_cache_gb='lots' in CacheConfig\(\) is invalid"):
        CacheConfig(cpu_cache_gb="lots")
    assert CacheConfig(enable_nixl="yes").enable_nixl is True


def test_a_constructed_config_drives_a_manager(tmp_path):
    from kv_helpers import BLOCK_BYTES, MODEL

    from dynamo_flexkv import KVManager

    gb = BLOCK_BYTES / (1 << 30)
    cfg = CacheConfig(
        cpu_cache_gb=8 * gb, ssd_cache_gb=16 * gb, ssd_cache_dir=str(tmp_path / "ssd"), eviction_policy="lfu"
    )
    with KVManager(MODEL, cfg) as kv:
        assert kv.stats().disk.capacity_blocks == 16


def test_gds_needs_nixl(tmp_path):
    with pytest.raises(
        ConfigError,
        match="enable_gds=true moves disk blocks through NIXL's GDS_MT backend: "
        "set enable_nixl=true as well, or enable_gds=false",
    ):
        CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=str(tmp_path), enable_gds=True)
    cfg = CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=str(tmp_path), enable_gds=True, enable_nixl=True)
    assert cfg.enable_gds and cfg.enable_nixl


def test_task_result_ttl():
    assert CacheConfig().task_result_ttl_seconds == 600.0 and CacheConfig().max_tasks_in_flight == 4096
    with pytest.raises(ConfigError, match="max_tasks_in_flight=0 must be >= 1"):
        CacheConfig(max_tasks_in_flight=0)
    assert CacheConfig.load(env={"FLEXKV_TASK_RESULT_TTL_SECONDS": "2.5"}).task_result_ttl_seconds == 2.5
    with pytest.raises(ConfigError, match=r"task_result_ttl_seconds=0.0 must be > 0"):
        CacheConfig(task_result_ttl_seconds=0)


def test_remote_keys_from_env_and_their_errors_name_the_key_and_fix():
    env = {
        "FLEXKV_ENABLE_REMOTE": "true",
        "FLEXKV_REMOTE_CACHE_URL": "redis://:s3cret@127.0.0.1:6390/2",
        "FLEXKV_REMOTE_TTL_S": "60",
        "FLEXKV_REMOTE_TIMEOUT_S": "0.5",
    }
    cfg = CacheConfig.load(env=env)
    rc = cfg.remote_config()
    assert (rc.ttl_s, rc.timeout_s, rc.parsed.db, rc.password) == (60.0, 0.5, 2, "s3cret")
    assert "s3cret" not in repr(cfg) and "s3cret" not in rc.redacted_url
    assert CacheConfig(enable_remote=True, remote_cache_url="redis://h:1").remote_config().ttl_s is None
    with pytest.raises(ConfigError, match="enable_remote=true needs remote_cache_url"):
        CacheConfig(enable_remote=True)
    with pytest.raises(ConfigError, match="remote_cache_url 'http://h' has an unknown scheme"):
        CacheConfig(enable_remote=True, remote_cache_url="http://h")
    with pytest.raises(ConfigError, match="remote_key_prefix"):
        CacheConfig(enable_remote=True, remote_cache_url="redis://h:1", remote_key_prefix="a{b}")
    with pytest.raises(ConfigError, match="remote_timeout_s must be a finite positive number of seconds, got 0.0"):
        CacheConfig(enable_remote=True, remote_cache_url="redis://h:1", remote_timeout_s=0)
    with pytest.raises(ConfigError, match="remote_ttl_s=-1.0 must be >= 0"):
        CacheConfig(enable_remote=True, remote_cache_url="redis://h:1", remote_ttl_s=-1)
    with pytest.raises(ConfigError, match="remote_admission_hits=-1 must be >= 0"):
        CacheConfig(remote_admission_hits=-1)
    CacheConfig(remote_cache_url="not a url")  # unused while the tier is off


# ---- every error names where the bad value came from: the file, the variable, the --set ----------------


def test_a_bad_value_names_its_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: lots\n")
    with pytest.raises(ConfigError, match=rf"^cpu_cache_gb='lots' in {path} \(-f\) is invalid"):
        CacheConfig.load(str(path), env={}, path_flag="-f")
    with pytest.raises(ConfigError, match=rf"^cpu_cache_gb='lots' in {path} \(FLEXKV_CONFIG_PATH\) is invalid"):
        CacheConfig.load(env={"FLEXKV_CONFIG_PATH": str(path)})


def test_a_missing_file_names_the_option_or_the_variable_that_named_it(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as given:
        CacheConfig.load(str(missing), env={}, path_flag="-f")
    assert str(given.value) == f"cannot read config file {missing} (-f): No such file or directory"
    with pytest.raises(ConfigError) as from_env:
        CacheConfig.load(env={"FLEXKV_CONFIG_PATH": str(missing)})
    assert str(from_env.value) == (
        f"cannot read config file {missing} (FLEXKV_CONFIG_PATH): No such file or directory; "
        "fix or unset FLEXKV_CONFIG_PATH"
    )


def test_a_bad_value_names_its_environment_variable():
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(env={"FLEXKV_CPU_CACHE_GB": "abc"})
    assert str(info.value) == (
        "cpu_cache_gb='abc' in environment variable FLEXKV_CPU_CACHE_GB is invalid: "
        "could not convert string to float: 'abc'"
    )
    with pytest.raises(ConfigError, match="in environment variable DYN_KVBM_CPU_CACHE_GB is invalid"):
        CacheConfig.load(env={"DYN_KVBM_CPU_CACHE_GB": "abc"})


def test_a_bad_value_names_its_set():
    with pytest.raises(ConfigError) as typo:
        CacheConfig.load(env={}, sets=["cpu_cach_gb=1"])
    assert str(typo.value) == "unknown config key 'cpu_cach_gb' in --set cpu_cach_gb=1; did you mean 'cpu_cache_gb'?"
    with pytest.raises(ConfigError, match=r"^evict_ratio='x' in --set evict_ratio=x is invalid"):
        CacheConfig.load(env={}, sets=["evict_ratio=x"])
    with pytest.raises(ConfigError, match=r"--set 'cpu_cache_gb': expected KEY=VALUE"):
        CacheConfig.load(env={}, sets=["cpu_cache_gb"])


def test_set_wins_over_the_environment_which_wins_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: 1\nevict_ratio: 0.5\n")
    env = {"FLEXKV_CONFIG_PATH": str(path), "FLEXKV_CPU_CACHE_GB": "abc", "FLEXKV_EVICT_RATIO": "0.25"}
    cfg = CacheConfig.load(env=env, sets=["cpu_cache_gb=2"])  # the bad variable is replaced, never parsed
    assert cfg.cpu_cache_gb == 2.0 and cfg.evict_ratio == 0.25


def test_a_check_across_keys_cites_where_each_came_from(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: 4\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(
            env={"FLEXKV_CONFIG_PATH": str(path), "FLEXKV_SSD_CACHE_GB": "1"},
            sets=[f"ssd_cache_dir={tmp_path / 'ssd'}"],
        )
    message = str(info.value)
    assert message.startswith("ssd_cache_gb=1.0 is smaller than cpu_cache_gb=4.0")
    assert message.endswith(
        f"(ssd_cache_gb from environment variable FLEXKV_SSD_CACHE_GB; cpu_cache_gb from {path} (FLEXKV_CONFIG_PATH))"
    )
    with pytest.raises(ConfigError, match=r"needs ssd_cache_dir.* \(ssd_cache_gb from --set ssd_cache_gb=8\)$"):
        CacheConfig.load(env={}, sets=["ssd_cache_gb=8"])


def test_from_dict_names_each_keys_origin():
    origins = {"cpu_cache_gb": "--set W.cache.cpu_cache_gb=x"}
    with pytest.raises(ConfigError, match=r"^cpu_cache_gb='x' in --set W.cache.cpu_cache_gb=x is invalid"):
        CacheConfig.from_dict({"cpu_cache_gb": "x", "evict_ratio": 0.5}, "c.yaml", origins)
    with pytest.raises(ConfigError, match=r"^unknown config key 'evict_ration' in c.yaml;"):
        CacheConfig.from_dict({"evict_ration": 0.5}, "c.yaml", origins)


@pytest.mark.parametrize(
    "argv, env, error",
    [
        (["-f", "{tmp}/no.yaml"], {}, "cannot read config file {tmp}/no.yaml (-f): No such file or directory"),
        ([], {"FLEXKV_CPU_CACHE_GB": "abc"}, "cpu_cache_gb='abc' in environment variable FLEXKV_CPU_CACHE_GB"),
        (["--set", "cpu_cach_gb=1"], {}, "unknown config key 'cpu_cach_gb' in --set cpu_cach_gb=1"),
        (["--set", "cpu_cache_gb=1", "--set", "ssd_cache_gb=0.5"], {}, "(ssd_cache_gb from --set ssd_cache_gb=0.5"),
    ],
)
def test_cache_server_refuses_naming_where_the_value_came_from(tmp_path, monkeypatch, capsys, argv, env, error):
    """`dynamo-flexkv cache-server`'s config errors (exit 2, before anything starts) name the -f
    file, the variable or the --set, as every engine's do."""
    from dynamo_flexkv.cli import main

    for var in [v for v in os.environ if v.startswith(("FLEXKV_", "DYN_KVBM_"))]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["cache-server", "--socket", str(tmp_path / "s" / "node.sock"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and error.replace("{tmp}", str(tmp_path)) in err


def test_an_unwritable_parent_of_a_missing_ssd_dir_is_refused_naming_it(tmp_path):
    """The check walks up to the nearest existing parent and writes there; a file on the way is
    not a directory: both refused naming ssd_cache_dir and the fix, nothing created."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(
        ConfigError, match=r"ssd_cache_dir .*a-file/sub.* nearest existing parent .* set ssd_cache_gb=0"
    ):
        CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=str(blocker / "sub"))
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_a_misspelled_flexkv_variable_is_named_with_the_closest_known_one(caplog, monkeypatch):
    """A FLEXKV_* variable nothing reads is a misspelling until shown otherwise: loading a config
    warns (once per process) naming it and the closest known variable, doctor reports the config as
    invalid; the variables read elsewhere, a test seam and the remote password's variable are not
    reported."""
    import logging

    from dynamo_flexkv.core import config as config_module
    from dynamo_flexkv.core.config import OTHER_ENV, unknown_env
    from dynamo_flexkv.doctor import Status, check_config

    env = {
        "FLEXKV_CPU_CACHE_G": "3",
        "FLEXKV_SSD_CACHEDIR": "/x",
        "FLEXKV_cpu_cache_gb": "1",  # the right name in the wrong case: matched case aside
        "FLEXKV_QWERTY": "1",
        "FLEXKV_TEST_WRONG_KV": "1",
        "FLEXKV_MY_PASSWORD": "pw",
        **{var: "1" for var in OTHER_ENV},
    }
    assert unknown_env(env, "FLEXKV_MY_PASSWORD") == {
        "FLEXKV_CPU_CACHE_G": "FLEXKV_CPU_CACHE_GB",
        "FLEXKV_QWERTY": None,
        "FLEXKV_SSD_CACHEDIR": "FLEXKV_SSD_CACHE_DIR",
        "FLEXKV_cpu_cache_gb": "FLEXKV_CPU_CACHE_GB",
    }
    monkeypatch.setattr(config_module, "_warned_env", set())
    small = {"FLEXKV_CPU_CACHE_G": "3", "FLEXKV_CPU_CACHE_GB": "1"}
    with caplog.at_level(logging.WARNING, logger="dynamo_flexkv.core.config"):
        assert CacheConfig.load(env=small).cpu_cache_gb == 1
        CacheConfig.load(env=small)
    warned = [r.getMessage() for r in caplog.records if r.name == "dynamo_flexkv.core.config"]
    assert warned == [
        "environment variable FLEXKV_CPU_CACHE_G is not one dynamo-flexkv reads (did you mean "
        "FLEXKV_CPU_CACHE_GB?): it has no effect; rename or unset it"
    ], warned
    monkeypatch.setenv("FLEXKV_CPU_CACHE_G", "3")
    check, cfg = check_config()
    assert check.status is Status.INVALID and "FLEXKV_CPU_CACHE_G " in check.detail and cfg is not None


def test_every_flexkv_variable_the_package_reads_is_known():
    """unknown_env's list of the variables read outside the config keys stays true: every FLEXKV_*
    name in the package's source is a config key's variable or in OTHER_ENV."""
    import dataclasses
    import re
    from pathlib import Path

    import dynamo_flexkv
    from dynamo_flexkv.core.config import OTHER_ENV, TEST_ENV_PREFIX

    keys = {f"FLEXKV_{f.name.upper()}" for f in dataclasses.fields(CacheConfig)}
    named = set()
    for path in Path(dynamo_flexkv.__file__).parent.rglob("*.py"):
        named |= set(re.findall(r"""["'](FLEXKV_[A-Z0-9_]+)["']""", path.read_text()))
    assert named, "no FLEXKV_ name found: the pattern is wrong"
    assert named - keys - set(OTHER_ENV) - {TEST_ENV_PREFIX} == set()
