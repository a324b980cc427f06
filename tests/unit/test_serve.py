"""Serve graphs and their configs: every bad config fails before any process starts, with a
message that names the section, the key and the fix; render writes a DynamoGraphDeployment."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from repo_paths import ROOT
from served import AGG_ROUTER, CONFIG, agg_router_plan, sleeper_plan, vplan

from dynamo_flexkv.core.procgroup import members
from dynamo_flexkv.serve import GraphError, Kind, load_graph
from dynamo_flexkv.serve.launcher import GraphStopped, Launcher
from dynamo_flexkv.serve.plan import OnDeath, RestartPolicy, build_plan, load_config
from dynamo_flexkv.serve.render import render_k8s


def test_the_shipped_configs_plan_every_component(tmp_path):
    p = agg_router_plan(tmp_path)
    assert [x.name for x in p.processes] == ["Frontend", "FlexKVWorker-0", "FlexKVWorker-1"]
    front, w0, w1 = p.processes
    assert front.argv[front.argv.index("--router-mode") + 1] == "kv"
    assert "--router-host-cache-hit-weight" in front.argv
    assert w0.cache.ssd_cache_dir != w1.cache.ssd_cache_dir  # {replica} expanded
    assert w0.cache.tokens_per_block == 64  # follows the model's block size
    assert len({w0.port, w1.port}) == 2 and all(x.port < 32768 for x in (w0, w1))  # Dynamo reads an i16
    assert all(x.env["DYN_TCP_RPC_HOST"] == "127.0.0.1" for x in p.processes)
    assert [x.name for x in p.infra] == ["zmq-broker"]  # no event publisher binds 0.0.0.0
    agg = build_plan(
        load_graph(str(ROOT / "graphs" / "agg.py")),
        load_config(str(ROOT / "configs" / "agg.yaml")),
        run_dir=tmp_path,
        local=False,
    )
    assert [x.kind for x in agg.processes] == [Kind.FRONTEND, Kind.WORKER]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["Planner.replicas=1"], "unknown component 'Planner'"),
        (["FlexKVWorker.num-blocks=4"], "FlexKVWorker.num-blocks is not an option of a worker"),
        (["Common.colour=red"], "Common.colour is not an option of any component"),
        (["FlexKVWorker.model=llama-9000"], "unknown model preset 'llama-9000'"),
        (["FlexKVWorker.replicas=0"], "FlexKVWorker.replicas=0 must be >= 1"),
        (["FlexKVWorker.offload=maybe"], "FlexKVWorker.offload='maybe': expected true or false"),
        (["Frontend.router-mode=nearest"], "router-mode='nearest'"),
        (["FlexKVWorker.cache.cpu_cache_gb=-1"], "cpu_cache_gb=-1.0 must be >= 0"),
        (["FlexKVWorker.cache.ssd_cache_dir=/proc/flexkv"], "is not writable"),
        (
            ["FlexKVWorker.cache.ssd_cache_dir=/tmp/flexkv-shared-test"],
            "is shared by FlexKVWorker-0 and FlexKVWorker-1",
        ),
        (["FlexKVWorker.system-port=40000"], "below 32768"),
        (["FlexKVWorker.extra-args=[--frobnicate]"], "are not worker options"),
        (["Frontend"], "expected Section.key=value"),
        (["Frontend.migration-limit=-1"], "Frontend.migration-limit=-1 must be >= 0"),
        (["Frontend.migration-limit=lots"], "Frontend.migration-limit='lots': expected an integer"),
        (["Frontend.extra-args=[--migration-limit, '2']"], "sets --migration-limit: use Frontend.migration-limit"),
        (["Frontend.on-death=restart"], "Frontend.on-death is not an option of a frontend"),
        (["FlexKVWorker.on-death=ignore"], "FlexKVWorker.on-death='ignore': use restart"),
        (["FlexKVWorker.max-restarts=-1"], "FlexKVWorker.max-restarts=-1 must be >= 0"),
        (["FlexKVWorker.restart-window-s=0"], "FlexKVWorker.restart-window-s=0.0 must be > 0 seconds"),
        (["FlexKVWorker.restart-backoff-s=60"], "FlexKVWorker.restart-backoff-s=60.0 must be between 0 and 30"),
    ],
)
def test_bad_configs_fail_with_a_message_that_names_the_fix(tmp_path, overrides, message):
    with pytest.raises(GraphError, match=message.replace("(", r"\(").replace("[", r"\[")):
        agg_router_plan(tmp_path, *overrides)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["FlexKVWorker.system-port=32768", "FlexKVWorker.replicas=1"],
            "FlexKVWorker.system-port=32768 is out of range",
        ),
        (["FlexKVWorker.system-port=40000"], "FlexKVWorker.system-port=40000 is out of range"),
        (
            ["FlexKVWorker.system-port=32767"],
            "FlexKVWorker.system-port=32767 with replicas=2 gives replica 1 port 32768",
        ),
        (["FlexKVWorker.system-port=-1"], "FlexKVWorker.system-port=-1 is out of range"),
    ],
)
def test_a_system_port_dynamo_cannot_read_is_refused_naming_the_limit_and_the_fix(tmp_path, overrides, named):
    """Dynamo reads DYN_SYSTEM_PORT as an i16: serve refuses any worker's port >= 32768 before starting."""
    with pytest.raises(GraphError) as e:
        agg_router_plan(tmp_path, *overrides, local=False)
    msg = str(e.value)
    assert named in msg and "DYN_SYSTEM_PORT" in msg and "below 32768" in msg, msg
    replicas = 1 if "FlexKVWorker.replicas=1" in overrides else 2
    assert f"set FlexKVWorker.system-port to a port from 1 to {32768 - replicas}" in msg, msg
    assert "or leave it out" in msg
    last = agg_router_plan(tmp_path, "FlexKVWorker.system-port=32766", local=False)  # the highest that fits 2 replicas
    assert [w.env["DYN_SYSTEM_PORT"] for w in last.workers] == ["32766", "32767"]


@pytest.mark.integration
def test_ports_in_use_and_locked_ssd_dirs_are_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(GraphError, match=f"Frontend.http-port={port} is in use"):
            agg_router_plan(tmp_path, f"Frontend.http-port={port}")
    from dynamo_flexkv.core.storage.ssd import lock_dir

    (tmp_path / "ssd1").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from dynamo_flexkv.core.storage.ssd import lock_dir; "
            f"lock_dir({str(tmp_path / 'ssd1')!r}); print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(GraphError, match=f"in use by pid {holder.pid}"):
            agg_router_plan(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    os.close(lock_dir(str(tmp_path / "ssd1")))  # released when its holder died
    agg_router_plan(tmp_path)


def test_bad_graph_files_are_named(tmp_path):
    with pytest.raises(GraphError, match="does not exist"):
        load_graph(str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("graph = 42\n")
    with pytest.raises(GraphError, match="must bind `graph = Graph"):
        load_graph(str(bad))


@pytest.mark.integration
def test_serve_refuses_a_bad_config_before_starting_anything(tmp_path):
    """The CLI exits 2 with the message; no frontend or worker was ever spawned."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"Common": {"model": "tiny"}, "Router": {"replicas": 2}}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "serve",
            AGG_ROUTER,
            "-f",
            str(bad),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown component 'Router'" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_render_k8s_writes_a_graph_deployment(tmp_path):
    doc = yaml.safe_load(render_k8s(agg_router_plan(tmp_path, local=False), "registry.example/dynamo-flexkv:1"))
    assert doc["apiVersion"] == "nvidia.com/v1alpha1" and doc["kind"] == "DynamoGraphDeployment"
    front, worker = doc["spec"]["services"]["Frontend"], doc["spec"]["services"]["FlexKVWorker"]
    assert front["componentType"] == "frontend" and worker["componentType"] == "worker"
    assert worker["replicas"] == 2
    main = worker["extraPodSpec"]["mainContainer"]
    assert main["image"] == "registry.example/dynamo-flexkv:1"
    assert main["command"] == ["python3", "-m", "dynamo_flexkv.integrations.dynamo_worker"]
    assert "--discovery-backend" not in main["args"] and "--model-dir" not in main["args"]
    env = {e["name"]: e.get("value") for e in worker["envs"]}  # pod-IP hosts: valueFrom
    assert env["FLEXKV_CPU_CACHE_GB"] == "0.125" and env["FLEXKV_TOKENS_PER_BLOCK"] == "64"
    assert [m["mountPath"] for m in main["volumeMounts"]] == [env["FLEXKV_SSD_CACHE_DIR"]]
    # A stream the worker refuses is answered 400, as under serve.
    assert {"name": "DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS", "value": "500"} in front["envs"]


@pytest.mark.integration
def test_render_cli_writes_the_manifest_file(tmp_path):
    out = tmp_path / "agg_router.k8s.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.cli", "render", AGG_ROUTER, "-f", CONFIG, "--k8s", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(out.read_text())
    assert set(doc["spec"]["services"]) == {"Frontend", "FlexKVWorker"}


def test_migration_and_restart_options_are_checked_and_reach_the_processes(tmp_path):
    p = agg_router_plan(tmp_path)
    front, w0, w1 = p.processes
    assert front.argv[front.argv.index("--migration-limit") + 1] == "3"  # on by default
    assert front.restart.on_death is OnDeath.STOP  # the frontend's death always stops the graph
    assert w0.restart == w1.restart == RestartPolicy(OnDeath.RESTART, max_restarts=3, window_s=300, backoff_s=1.0)
    assert [x.metrics_url for x in p.processes] == [f"http://127.0.0.1:{x.port}/metrics" for x in p.processes]
    off = agg_router_plan(
        tmp_path, "Frontend.migration-limit=0", "FlexKVWorker.on-death=stop", "FlexKVWorker.max-restarts=5"
    )
    assert off.processes[0].argv[off.processes[0].argv.index("--migration-limit") + 1] == "0"
    assert {w.restart.on_death for w in off.workers} == {OnDeath.STOP}
    assert off.workers[0].restart.max_restarts == 5
    backoff = RestartPolicy(backoff_s=1.5)
    assert [backoff.delay(n) for n in (1, 2, 3, 6)] == [1.5, 3.0, 6.0, 30.0]  # doubles, capped at 30 s


@pytest.mark.integration
def test_the_launcher_restarts_a_dead_worker_with_backoff_until_its_budget_is_spent(tmp_path):
    launcher = Launcher(sleeper_plan(tmp_path, RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.1)))
    worker = launcher.plan.workers[0]
    try:
        launcher.start()
        pids = [launcher.running[worker.name].pid]
        for death, delay in ((1, 0.1), (2, 0.2)):
            os.kill(pids[-1], signal.SIGKILL)
            launcher.running[worker.name].wait()
            launcher.step()
            assert f"(death {death} within 60 s, budget 2); restarting it in {delay:.1f} s" in launcher.events[-1]
            assert worker.name in launcher.pending
            launcher.step()  # not due yet
            assert launcher.restarts.get(worker.name, 0) == death - 1
            time.sleep(delay + 0.05)
            launcher.step()
            assert launcher.restarts[worker.name] == death
            pids.append(launcher.running[worker.name].pid)
            assert launcher.running[worker.name].poll() is None and pids[-1] != pids[-2]
        os.kill(pids[-1], signal.SIGKILL)
        launcher.running[worker.name].wait()
        with pytest.raises(
            GraphStopped,
            match=rf"{worker.name} exited with signal SIGKILL: it died 3 times "
            r"within 60 s, more than its restart budget \(max-restarts=2\)",
        ):
            launcher.step()
        assert "---- restart 2 of" in (launcher.log_dir / f"{worker.name}.log").read_text()  # one log, all lives
    finally:
        launcher.shutdown()
    for pid in pids:
        assert members(pid) == []  # no live process (zombies wait for init)


@pytest.mark.integration
def test_deaths_outside_the_window_are_forgiven_and_the_frontends_death_stops_the_graph(tmp_path):
    launcher = Launcher(sleeper_plan(tmp_path, RestartPolicy(max_restarts=1, window_s=0.3, backoff_s=0)))
    front, worker = launcher.plan.processes
    try:
        launcher.start()
        for _ in range(3):  # one death per window: always within budget
            launcher.running[worker.name].kill()
            launcher.running[worker.name].wait()
            launcher.step()
            launcher.step()
            assert launcher.running[worker.name].poll() is None
            time.sleep(0.35)
        assert launcher.restarts[worker.name] == 3
        launcher.running[front.name].kill()
        launcher.running[front.name].wait()
        with pytest.raises(GraphStopped, match="Frontend exited with signal SIGKILL; its on-death policy is stop"):
            launcher.step()
    finally:
        launcher.shutdown()


@pytest.mark.integration
def test_a_dead_worker_is_removed_from_file_discovery_and_nothing_else(tmp_path):
    """The files as Dynamo 1.6.1's FileStore writes them: a model card naming the worker's system
    port, its endpoint instances, its KV event source."""
    p = sleeper_plan(tmp_path, RestartPolicy(backoff_s=30))  # its restart stays pending while the test looks
    worker = p.workers[0]
    root = tmp_path / "discovery"
    worker.env["DYN_FILE_KV"] = str(root)

    def write(kind, name, doc):
        (root / "v1" / kind).mkdir(parents=True, exist_ok=True)
        (root / "v1" / kind / name).write_text(json.dumps(doc))

    for iid, port in ((111, worker.port), (222, worker.port + 1)):
        write(
            "mdc",
            f"dynamo%2Fflexkv%2Fgenerate%2F{iid:x}",
            {
                "type": "Model",
                "instance_id": iid,
                "card_json": {
                    "model_info": {"hf_config_json": {"path": f"http://127.0.0.1:{port}/v1/metadata/config.json"}}
                },
            },
        )
        write("instances", f"dynamo%2Fflexkv%2Fgenerate%2F{iid:x}", {"type": "Endpoint", "instance_id": iid})
        write("instances", f"dynamo%2Fflexkv%2Fquery%2F{iid:x}", {"type": "Endpoint", "instance_id": iid})
        write(
            "event_sources",
            f"kv-events%2F{iid + 5}",
            {"type": "EventSource", "metadata": {"worker": {"worker_id": iid}}},
        )
    (root / "v1" / "instances" / ".tmp_0123").write_text("{partial")
    launcher = Launcher(p)
    try:
        launcher.start()
        launcher.running[worker.name].kill()
        launcher.running[worker.name].wait()
        launcher.step()  # the launcher sees the death
        assert "; removed its 4 discovery entries; restarting it in 30.0 s" in launcher.events[-1], launcher.events
        left = sorted(f.name for f in (root / "v1").glob("*/*"))
        assert left == sorted(
            [
                ".tmp_0123",
                "dynamo%2Fflexkv%2Fgenerate%2Fde",
                "dynamo%2Fflexkv%2Fgenerate%2Fde",
                "dynamo%2Fflexkv%2Fquery%2Fde",
                "kv-events%2F227",
            ]
        )
    finally:
        launcher.shutdown()


@pytest.mark.integration
def test_a_closed_terminal_ends_the_echo_not_the_logs_or_the_shutdown(tmp_path):
    """serve's stdout reader went away (a closed terminal, a dead pipe): writes fail with EPIPE. The
    component logs still reach their files and shutdown still stops every process."""
    p = sleeper_plan(tmp_path, RestartPolicy())
    p.workers[0].argv = ["sh", "-c", "for i in $(seq 2000); do echo worker line $i; done; exec sleep 60"]
    read_end, write_end = os.pipe()
    os.close(read_end)
    launcher = Launcher(p, echo=os.fdopen(write_end, "w"))
    try:
        launcher.start()
        log = launcher.log_dir / f"{p.workers[0].name}.log"
        deadline = time.monotonic() + 30
        while "worker line 2000" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the worker's log stopped flowing"
            time.sleep(0.05)
        launcher.emit("stopping...\n")  # does not raise
        assert launcher.echo is None
    finally:
        launcher.shutdown()
    for proc in launcher.spawned:
        assert members(proc.pid) == []  # no live process (zombies wait for init)


def test_a_cache_variable_in_serves_environment_is_refused_not_silently_applied(tmp_path, monkeypatch):
    """A worker applies FLEXKV_<KEY> over the cache file serve checked (defaults < file <
    environment) and inherits serve's environment: serve refuses such a variable, naming it, so
    what serve checked is what every worker runs; rendering for elsewhere is not affected."""
    monkeypatch.setenv("FLEXKV_SSD_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "2")
    monkeypatch.setenv("FLEXKV_REMOTE_CACHE_URL", "redis://:hunter2@127.0.0.1:6379")
    with pytest.raises(
        GraphError,
        match=r"^environment variables DYN_KVBM_CPU_CACHE_GB \(cpu_cache_gb\), "
        r"FLEXKV_REMOTE_CACHE_URL \(remote_cache_url\), FLEXKV_SSD_CACHE_DIR "
        r"\(ssd_cache_dir\) in serve's environment: .*--set",
    ) as refused:
        agg_router_plan(tmp_path)
    assert "hunter2" not in str(refused.value)  # values stay out of the message (a URL may hold a password)
    assert agg_router_plan(tmp_path, local=False).workers  # a manifest for pods: they do not inherit it
    for var in ("FLEXKV_SSD_CACHE_DIR", "DYN_KVBM_CPU_CACHE_GB", "FLEXKV_REMOTE_CACHE_URL"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("FLEXKV_TEST_WRONG_KV", "0")  # not a cache key: passes through
    assert agg_router_plan(tmp_path).workers
    # The worker's own loading applies such a variable over the file, which is why it is refused.
    from dynamo_flexkv.core.config import CacheConfig

    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: 1\n")
    assert CacheConfig.load(str(path), env={"FLEXKV_CPU_CACHE_GB": "3"}).cpu_cache_gb == 3


@pytest.mark.parametrize(
    "args, shown",
    [
        (["--pipeline-parallel-size", "2"], "2"),
        (["-pp", "2"], "2"),
        (["--pipeline_parallel_size=4"], "4"),
        (["--pipeline-parallel=2"], "2"),  # argparse takes an unambiguous abbreviation
        (["--pipeline-parallel-size", "1", "-pp", "2"], "2"),  # the last one wins
    ],
)
def test_a_vllm_worker_with_pipeline_parallelism_is_refused_naming_the_flag_and_the_fix(tmp_path, args, shown):
    """FlexKVConnector keys its tiers, disk paths, lookup socket and remote fingerprint by model,
    tensor and data-parallel rank only: two pipeline stages would load each other's layers."""
    extra = "VllmWorker.extra-args=[" + ", ".join(f"'{a}'" for a in args) + "]"
    with pytest.raises(GraphError) as e:
        vplan(tmp_path, extra)
    msg = str(e.value)
    assert f"VllmWorker.extra-args sets --pipeline-parallel-size {shown}" in msg, msg
    assert "does not support pipeline parallelism" in msg and "remove it" in msg, msg
    assert "set offload: false" in msg and "VllmWorker.tensor-parallel-size" in msg, msg
    # one stage is no pipeline; without the connector vLLM runs pipeline stages on its own
    vplan(tmp_path, "VllmWorker.extra-args=['-pp', '1']")
    vplan(tmp_path, extra, "VllmWorker.offload=false")


@pytest.mark.integration
def test_serve_exits_2_on_a_pipeline_parallel_vllm_worker(tmp_path):
    cfg = tmp_path / "pp.yaml"
    cfg.write_text(yaml.safe_dump({"VllmWorker": {"extra-args": ["--pipeline-parallel-size", "2"]}}))
    r = subprocess.run(
        [sys.executable, "-m", "dynamo_flexkv.cli", "serve", str(ROOT / "graphs" / "agg_vllm.py")]
        + ["-f", str(cfg), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "VllmWorker.extra-args sets --pipeline-parallel-size 2" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.parametrize(
    "config, sets, error",
    [
        (None, ["FlexKVWorker.replica=1"], "--set FlexKVWorker.replica=1: FlexKVWorker.replica is not an option"),
        (None, ["FlexKVWorker.replicas=abc"], "--set FlexKVWorker.replicas=abc: FlexKVWorker.replicas='abc': expected"),
        (None, ["Common.replicas=0"], "--set Common.replicas=0: FlexKVWorker.replicas=0 must be >= 1"),
        (None, ["Nope.x=1"], "--set Nope.x=1: unknown component 'Nope'"),
        (
            None,
            ["FlexKVWorker.cache.cpu_cach_gb=1"],
            "FlexKVWorker.cache: unknown config key 'cpu_cach_gb' in --set FlexKVWorker.cache.cpu_cach_gb=1; "
            "did you mean 'cpu_cache_gb'?\n",
        ),
        (
            None,
            ["FlexKVWorker.cache={cpu_cach_gb: 1}"],
            "unknown config key 'cpu_cach_gb' in --set FlexKVWorker.cache={cpu_cach_gb: 1}",
        ),
        (
            None,
            ["FlexKVWorker.cache.ssd_cache_gb=0.01"],
            "(ssd_cache_gb from --set FlexKVWorker.cache.ssd_cache_gb=0.01; cpu_cache_gb from {config})",
        ),
        (
            {"FlexKVWorker": {"replica": 1}},
            [],
            "{config}: FlexKVWorker.replica is not an option",
        ),
        (
            {"FlexKVWorker": {"cache": {"cpu_cach_gb": 1}}},
            ["FlexKVWorker.replicas=1"],
            "FlexKVWorker.cache: unknown config key 'cpu_cach_gb' in {config}; did you mean 'cpu_cache_gb'?\n",
        ),
        ({"Common": {"replicas": 0}}, [], "{config}: FlexKVWorker.replicas=0 must be >= 1"),
    ],
)
def test_a_bad_value_is_blamed_on_where_it_came_from_the_file_or_the_set(tmp_path, capsys, config, sets, error):
    """Each refusal names the one place to fix, once: the --set that gave the value (a typo in a
    --set is not the file's), or the config file."""
    from dynamo_flexkv.cli import main

    path = str(ROOT / "configs" / "agg.yaml")
    if config is not None:
        path = str(tmp_path / "c.yaml")
        Path(path).write_text(yaml.safe_dump(config))
    argv = ["render", str(ROOT / "graphs" / "agg.py"), "-f", path, "--k8s", "-o", str(tmp_path / "out.yaml")]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and error.replace("{config}", path) in err, err
    if sets and config is None:
        assert path not in err.split("(")[0], err  # the file is not blamed for the --set


def test_a_bad_run_dir_is_refused_before_anything_starts_naming_the_flag(tmp_path, capsys):
    """serve --run-dir is checked first: a path that cannot be a directory exits 2 naming --run-dir
    and the fix (not exit 1 with a traceback after "starting"); a --run-dir serve made for a start
    it then refused is removed again."""
    from dynamo_flexkv.cli import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    locked = tmp_path / "locked"
    locked.mkdir(0o500)
    unwritable = Path("/sys/kernel") if os.geteuid() == 0 else locked
    argv = ["serve", str(ROOT / "graphs" / "agg_router.py"), "-f", CONFIG, "--run-dir"]
    for run_dir, said in (
        (a_file / "run", f"--run-dir {a_file / 'run'}: cannot make it a directory (Not a directory): name a"),
        (a_file, f"the run directory (--run-dir) {a_file} is not a directory: remove it, or choose another path"),
        ("", "--run-dir is empty: name a directory you can write to, or leave --run-dir out"),
        # a directory of this user's that no directory can be made in: /sys/kernel for root (who ignores
        # modes), else one made 0500
        (unwritable, f"--run-dir {unwritable}: cannot make a directory in it ("),
    ):
        assert main([*argv, str(run_dir)]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and said in captured.err, captured.err
        assert "starting" not in captured.out and "Traceback" not in captured.err
    made = tmp_path / "new" / "run"
    assert main([*argv, str(made), "--set", "Common.bogus=1"]) == 2
    assert "--set Common.bogus=1" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # made for a refused start: removed again


def test_values_from_a_set_or_the_environment_are_blamed_on_it(tmp_path, capsys, monkeypatch):
    """A --set node_socket render refuses names the --set, not the config file; a FLEXKV_ variable
    serve refuses names the variable, not the file."""
    from dynamo_flexkv.cli import main

    item = "FlexKVWorker.cache={mode: node, node_socket: /tmp/x.sock}"
    argv = ["render", str(ROOT / "graphs" / "agg_router.py"), "-f", CONFIG, "--k8s", "-o", str(tmp_path / "o.yaml")]
    assert main([*argv, "--set", item]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --set {item}: FlexKVWorker.cache.node_socket='/tmp/x.sock'"), err
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "abc")
    with pytest.raises(GraphError) as refused:
        agg_router_plan(tmp_path)
    assert str(refused.value).startswith("environment variable FLEXKV_CPU_CACHE_GB (cpu_cache_gb) in serve's")
    assert CONFIG not in str(refused.value)


def test_a_misspelled_flexkv_variable_is_a_note_before_serve_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXKV_CPU_CACHE_G", "3")  # FLEXKV_CPU_CACHE_GB would be refused; this one does nothing
    notes = agg_router_plan(tmp_path).notes
    assert any(n.startswith("environment variable FLEXKV_CPU_CACHE_G is not one") for n in notes), notes
    assert any("did you mean FLEXKV_CPU_CACHE_GB?" in n for n in notes), notes


def test_an_empty_config_file_and_a_node_socket_that_is_not_a_socket_are_named(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(GraphError, match=rf"config file {empty} is empty .*leave -f out"):
        load_config(str(empty))
    for what, path in (("a directory", tmp_path), ("a regular file", empty)):
        with pytest.raises(GraphError, match=rf"{path} is {what}, not a socket: name the socket of a running"):
            agg_router_plan(tmp_path, f"FlexKVWorker.cache={{mode: node, node_socket: {path}}}")


@pytest.mark.parametrize(
    "sets, said",
    [
        (
            ["FlexKVWorker.cache.cpu_cache_gb=100000", "FlexKVWorker.cache.ssd_cache_gb=0"],
            "--set FlexKVWorker.cache.cpu_cache_gb=100000: FlexKVWorker.cache.cpu_cache_gb=100000 x "
            "FlexKVWorker.replicas 2: the host tiers (200000.0 GiB) are larger than this machine's memory (",
        ),
        (
            ["NodeCache.cache.cpu_cache_gb=100000", "NodeCache.cache.ssd_cache_gb=0", "FlexKVWorker.cache.mode=node"],
            "--set NodeCache.cache.cpu_cache_gb=100000: NodeCache.cache.cpu_cache_gb=100000: the host tier "
            "(100000.0 GiB) is larger than this machine's memory (",
        ),
    ],
)
def test_a_host_tier_larger_than_the_machines_memory_is_refused_before_serve_starts(tmp_path, sets, said):
    """As cache-server refuses it: the --set it came from, the machine's memory and a size that fits
    (as a --set), counting each replica's tier; not a worker's traceback after the start."""
    from dynamo_flexkv.cli import _plan, build_parser

    argv = ["serve", str(ROOT / "graphs" / "agg_router.py"), "-f", CONFIG, "--set", "Common.model=tiny"]
    args = build_parser().parse_args(
        [*argv, "--set", "FlexKVWorker.replicas=2", *(a for s in sets for a in ("--set", s))]
    )
    with pytest.raises(GraphError) as refused:
        _plan(args, str(tmp_path / "run"))
    assert said in str(refused.value) and ".cache.cpu_cache_gb=" in str(refused.value).split(": set ")[1], refused.value
