"""`pip install .` (not editable) makes a package that works without the source tree: the wheel
carries the native extension, the model presets, the serve graphs and configs; `dynamo-flexkv
doctor` runs; a KVManager stores blocks to disk and, after a restart, restores their exact bytes.

The wheel goes into a fresh venv made without pip or network: torch, Dynamo and NIXL come from
this interpreter's site-packages through a .pth path entry (which, unlike a site directory, runs
none of its .pth hooks, so the editable install of the checkout stays out). Everything runs from a
temporary directory, and the script checks it imported the installed copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from repo_paths import ROOT

# The editable install's CMake build dir (pyproject's build-dir): its objects are up to date after
# `make install`, so the wheel recompiles nothing that did not change (a separate dir cost a full
# native compile, ~30 s of the default suite on 2 cores). The editable install copied its extension
# out of this dir, so the wheel build cannot change what the checkout imports; the lock keeps two
# test runs from building here at once.
_CP = f"cp{sys.version_info.major}{sys.version_info.minor}"
BUILD_DIR = ROOT / "build" / f"{_CP}-{_CP}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"

ROUND_TRIP = r"""
import os, sys, time
import torch
import dynamo_flexkv
from dynamo_flexkv import CacheConfig, KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig
from dynamo_flexkv.resources import CONFIGS, GRAPHS, resolve
from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.plan import load_config

venv_dir, work = sys.argv[1], sys.argv[2]
assert dynamo_flexkv.__file__.startswith(venv_dir), f"imported {dynamo_flexkv.__file__}, not the wheel"
assert dynamo_flexkv.core._native.__file__.startswith(venv_dir), dynamo_flexkv.core._native.__file__

# Shipped graphs and configs by name and by their repository path.
graph = resolve(GRAPHS, "agg_router")
assert graph == resolve(GRAPHS, "graphs/agg_router.py") and graph.startswith(venv_dir), graph
assert load_graph(graph).name == "agg_router"
assert load_config(resolve(CONFIGS, "agg_router"))["FlexKVWorker"]["replicas"] == 2

spec = EngineModelConfig.preset("tiny").kv_spec()
tpb, blocks = 16, 4
block_bytes = spec.token_bytes() * tpb
cfg = CacheConfig.from_dict(dict(tokens_per_block=tpb, cpu_cache_gb=16 * block_bytes / 2**30,
                                 ssd_cache_gb=32 * block_bytes / 2**30, ssd_cache_dir=os.path.join(work, "ssd")))
prompt = list(range(1000, 1000 + blocks * tpb))

def device():
    return [torch.zeros(8, spec.kv_dim, tpb, spec.num_kv_heads, spec.head_size, dtype=torch.float32)
            for _ in range(spec.num_layers)]

g = torch.Generator().manual_seed(7)
stored = [torch.randint(-2**31, 2**31 - 1, (blocks, spec.kv_dim, tpb, spec.num_kv_heads, spec.head_size),
                        generator=g, dtype=torch.int32) for _ in range(spec.num_layers)]
with KVManager(spec, cfg) as kv:
    dev = device()
    kv.register_device_cache(dev, KVLayoutType.LAYERBLOCK)
    for layer, want in zip(dev, stored):
        layer[[5, 2, 7, 0]] = want.view(torch.float32)
    t = kv.put_async(prompt, [5, 2, 7, 0])
    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
    deadline = time.monotonic() + 30
    while kv.match(prompt).get("disk", 0) < len(prompt):  # the disk write follows the put
        assert time.monotonic() < deadline, kv.match(prompt)
        time.sleep(0.05)

with KVManager(spec, cfg) as kv:  # a restart: only the disk tier holds the blocks now
    assert kv.match(prompt) == {"host": 0, "disk": len(prompt)}, kv.match(prompt)
    dev = device()
    kv.register_device_cache(dev, KVLayoutType.LAYERBLOCK)
    t = kv.get_async(prompt, [1, 3, 4, 6])
    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
    for layer, want in zip(dev, stored):
        assert torch.equal(layer[[1, 3, 4, 6]].view(torch.int32), want), "restored bytes differ"
print("round trip ok")
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding the freshly built wheel of this checkout (and nothing else of it)."""
    wheels = tmp_path_factory.mktemp("wheels")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR.parent / "wheel-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once must not share one CMake build
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "--disable-pip-version-check",
                "-C",
                f"build-dir={BUILD_DIR}",
                "-w",
                str(wheels),
                str(ROOT),
            ],
            check=True,
            timeout=900,
        )
    (wheel,) = wheels.glob("dynamo_flexkv-*.whl")
    env = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    # Only after the install: pip must not see (and try to replace) the checkout's editable install.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    Path(site, "project-deps.pth").write_text("".join(p + "\n" for p in deps))
    return env


def run_in(env: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLEXKV_CONFIG_PATH")}
    return subprocess.run(args, cwd=cwd, env=clean, capture_output=True, text=True, timeout=300)


def test_wheel_ships_presets_graphs_and_configs(installed):
    names = [Path(p).name for p in (installed / "lib").glob("python3*/site-packages/dynamo_flexkv/_data/*/*")]
    assert {"agg_router.py", "agg.py", "agg_router.yaml", "agg.yaml", "models"} <= set(names), names
    presets = {
        p.stem for p in (installed / "lib").glob("python3*/site-packages/dynamo_flexkv/_data/configs/models/*.yaml")
    }
    assert presets == {p.stem for p in (ROOT / "configs" / "models").glob("*.yaml")}


def test_doctor_runs_from_the_wheel(installed, tmp_path):
    r = run_in(
        installed,
        tmp_path,
        str(installed / "bin" / "dynamo-flexkv"),
        "doctor",
        "--json",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout[r.stdout.index("[") :])}
    assert checks["native extension"]["status"] == "ok"
    assert checks["native extension"]["detail"].startswith(str(installed))
    assert checks["package data"]["status"] == "ok" and str(installed) in checks["package data"]["detail"]


def test_kv_manager_round_trip_from_the_wheel(installed, tmp_path):
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    r = run_in(installed, tmp_path, str(installed / "bin" / "python"), str(script), str(installed), str(tmp_path))
    assert r.returncode == 0 and "round trip ok" in r.stdout, r.stdout + r.stderr


def test_resolve_in_the_checkout(tmp_path, monkeypatch):
    """In a checkout (no _data/), names and repository paths resolve to the top-level folders; a
    file that exists wins; anything else comes back unchanged for the caller's error."""
    from dynamo_flexkv.resources import CONFIGS, GRAPHS, presets_dir, resolve, shipped_names

    monkeypatch.chdir(tmp_path)  # graphs/agg.py does not exist here: the shipped one is meant
    for name in ("agg", "agg.py", "graphs/agg.py"):
        assert resolve(GRAPHS, name) == str(ROOT / "graphs" / "agg.py")
    assert resolve(CONFIGS, "configs/agg_router") == str(ROOT / "configs" / "agg_router.yaml")
    own = tmp_path / "agg.py"
    own.write_text("")
    assert resolve(GRAPHS, "agg.py") == "agg.py"  # the user's own file, not the shipped one
    for missing in ("nope", "graphs/nope.py", "elsewhere/agg.py", "configs/models/tiny.yaml"):
        assert resolve(GRAPHS, missing) == missing
    assert presets_dir() == ROOT / "configs" / "models" and {"agg", "agg_router"} <= set(shipped_names(GRAPHS))
    with pytest.raises(ValueError, match="unknown resource kind"):
        resolve("models", "tiny")
