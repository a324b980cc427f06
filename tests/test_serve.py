"""Serve graphs and their configs: every bad config fails before any process starts, with a
message that names the section, the key and the fix; render writes a DynamoGraphDeployment."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynamo_flexkv.serve import GraphError, Kind, load_graph
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
from dynamo_flexkv.serve.render import render_k8s

ROOT = Path(__file__).resolve().parents[1]
AGG_ROUTER = str(ROOT / "graphs" / "agg_router.py")
CONFIG = str(ROOT / "configs" / "agg_router.yaml")


def plan(tmp_path, *overrides, graph=AGG_ROUTER, **kw):
    config = apply_overrides(load_config(CONFIG), ["Frontend.http-port=0",
                                                   f"FlexKVWorker.cache.ssd_cache_dir={tmp_path}/ssd{{replica}}",
                                                   *overrides])
    return build_plan(load_graph(graph), config, run_dir=tmp_path / "run", source="agg_router.yaml", **kw)


def test_the_shipped_configs_plan_every_component(tmp_path):
    p = plan(tmp_path)
    assert [x.name for x in p.processes] == ["Frontend", "FlexKVWorker-0", "FlexKVWorker-1"]
    front, w0, w1 = p.processes
    assert front.argv[front.argv.index("--router-mode") + 1] == "kv"
    assert "--router-host-cache-hit-weight" in front.argv
    assert w0.cache.ssd_cache_dir != w1.cache.ssd_cache_dir  # {replica} expanded
    assert w0.cache.tokens_per_block == 64  # follows the model's block size
    assert len({w0.port, w1.port}) == 2 and all(x.port < 32768 for x in (w0, w1))  # Dynamo reads an i16
    assert all(x.env["DYN_TCP_RPC_HOST"] == "127.0.0.1" for x in p.processes)
    assert [x.name for x in p.infra] == ["zmq-broker"]  # no event publisher binds 0.0.0.0
    agg = build_plan(load_graph(str(ROOT / "graphs" / "agg.py")), load_config(str(ROOT / "configs" / "agg.yaml")),
                     run_dir=tmp_path, local=False)
    assert [x.kind for x in agg.processes] == [Kind.FRONTEND, Kind.WORKER]


@pytest.mark.parametrize("overrides, message", [
    (["Planner.replicas=1"], "unknown component 'Planner'"),
    (["FlexKVWorker.num-blocks=4"], "FlexKVWorker.num-blocks is not an option of a worker"),
    (["Common.colour=red"], "Common.colour is not an option of any component"),
    (["FlexKVWorker.model=llama-9000"], "unknown model preset 'llama-9000'"),
    (["FlexKVWorker.replicas=0"], "FlexKVWorker.replicas=0 must be >= 1"),
    (["FlexKVWorker.offload=maybe"], "FlexKVWorker.offload='maybe': expected true or false"),
    (["Frontend.router-mode=nearest"], "router-mode='nearest'"),
    (["FlexKVWorker.cache.cpu_cache_gb=-1"], "cpu_cache_gb=-1.0 must be >= 0"),
    (["FlexKVWorker.cache.ssd_cache_dir=/proc/flexkv"], "is not writable"),
    (["FlexKVWorker.cache.ssd_cache_dir=/tmp/flexkv-shared-test"], "is shared by FlexKVWorker-0 and FlexKVWorker-1"),
    (["FlexKVWorker.system-port=40000"], "below 32768"),
    (["FlexKVWorker.extra-args=[--frobnicate]"], "are not worker options"),
    (["Frontend"], "expected Section.key=value"),
])
def test_bad_configs_fail_with_a_message_that_names_the_fix(tmp_path, overrides, message):
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace("[", r"\[")):
        plan(tmp_path, *overrides)


def test_ports_in_use_and_locked_ssd_dirs_are_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(GraphError, match=f"Frontend.http-port={port} is in use"):
            plan(tmp_path, f"Frontend.http-port={port}")
    from dynamo_flexkv.storage.ssd import lock_dir
    (tmp_path / "ssd1").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dynamo_flexkv.storage.ssd import lock_dir; "
                               f"lock_dir({str(tmp_path / 'ssd1')!r}); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(GraphError, match=f"in use by pid {holder.pid}"):
            plan(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    os.close(lock_dir(str(tmp_path / "ssd1")))  # released when its holder died
    plan(tmp_path)


def test_bad_graph_files_are_named(tmp_path):
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("graph = 42\n")
    with pytest.raises(GraphError, match="must bind `graph = Graph"):
        load_graph(str(bad))


def test_serve_refuses_a_bad_config_before_starting_anything(tmp_path):
    """The CLI exits 2 with the message; no frontend or worker was ever spawned."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"Common": {"model": "tiny"}, "Router": {"replicas": 2}}))
    r = subprocess.run([sys.executable, "-m", "dynamo_flexkv.cli", "serve", AGG_ROUTER, "-f", str(bad),
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown component 'Router'" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_render_k8s_writes_a_graph_deployment(tmp_path):
    doc = yaml.safe_load(render_k8s(plan(tmp_path, local=False), "registry.example/dynamo-flexkv:1"))
    assert doc["apiVersion"] == "nvidia.com/v1alpha1" and doc["kind"] == "DynamoGraphDeployment"
    front, worker = doc["spec"]["services"]["Frontend"], doc["spec"]["services"]["FlexKVWorker"]
    assert front["componentType"] == "frontend" and worker["componentType"] == "worker"
    assert worker["replicas"] == 2
    main = worker["extraPodSpec"]["mainContainer"]
    assert main["image"] == "registry.example/dynamo-flexkv:1"
    assert main["command"] == ["python3", "-m", "dynamo_flexkv.worker"]
    assert "--discovery-backend" not in main["args"] and "--model-dir" not in main["args"]
    env = {e["name"]: e["value"] for e in worker["envs"]}
    assert env["FLEXKV_CPU_CACHE_GB"] == "0.125" and env["FLEXKV_TOKENS_PER_BLOCK"] == "64"
    assert [m["mountPath"] for m in main["volumeMounts"]] == [env["FLEXKV_SSD_CACHE_DIR"]]


def test_render_cli_writes_the_manifest_file(tmp_path):
    out = tmp_path / "agg_router.k8s.yaml"
    r = subprocess.run([sys.executable, "-m", "dynamo_flexkv.cli", "render", AGG_ROUTER, "-f", CONFIG, "--k8s",
                        "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert set(doc["spec"]["services"]) == {"Frontend", "FlexKVWorker"}
