"""What `dynamo-flexkv render --k8s` writes, read and started the way the Dynamo operator runs it:
every pod of a DynamoGraphDeployment gets DYN_NAMESPACE, DYN_DISCOVERY_BACKEND (with
ETCD_ENDPOINTS), DYN_EVENT_PLANE (with NATS_SERVER), DYN_NAMESPACE_WORKER_SUFFIX on workers and
DYN_NAMESPACE_PREFIX on the frontend, and each rendered component must register, or look, where
that environment says (flag > environment > default, as dynamo.vllm and dynamo.frontend read it)."""

import argparse
import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from served import ROOT, TINY, assert_gone, events_applied, post

from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV
from dynamo_flexkv.integrations.dynamo_worker.args import build_parser
from dynamo_flexkv.serve import GraphError, load_graph
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.plan import LaunchPlan, apply_overrides, build_plan, load_config
from dynamo_flexkv.serve.process import Process
from dynamo_flexkv.serve.render import render_k8s

# What an operator's pods hold (its DYN_NAMESPACE is "<k8s namespace>-<graph name>").
NAMESPACE = "team-a-flexkv-agg-router"
SUFFIX = "3f9c2a1b"  # the rollout's worker pool
POD_ENV = {
    "DYN_NAMESPACE": NAMESPACE,
    "DYN_DISCOVERY_BACKEND": "kubernetes",
    "DYN_REQUEST_PLANE": "tcp",
    "DYN_EVENT_PLANE": "nats",
}
WORKER_ENV = {**POD_ENV, "DYN_NAMESPACE_WORKER_SUFFIX": SUFFIX}
FRONTEND_ENV = {**POD_ENV, "DYN_NAMESPACE_PREFIX": NAMESPACE}
# Flags that would pin a choice the operator's environment makes (dynamo.vllm's --endpoint
# dyn://ns.component.endpoint names a namespace too).
OPERATOR_FLAGS = {
    "--namespace",
    "--namespace-prefix",
    "--endpoint",
    "--discovery-backend",
    "--request-plane",
    "--event-plane",
}
OPERATOR_VARS = {
    *POD_ENV,
    "DYN_NAMESPACE_WORKER_SUFFIX",
    "DYN_NAMESPACE_PREFIX",
    "ETCD_ENDPOINTS",
    "NATS_SERVER",
    "DYN_FILE_KV",
    "DYN_ZMQ_BROKER_URL",
}

# (graph, config, overrides): every shipped graph with its config, and a vLLM graph on a node cache.
SHIPPED = [(p.stem, p.stem, ()) for p in sorted((ROOT / "graphs").glob("*.py"))] + [
    ("agg_router_vllm", "agg_router_vllm_node", ())
]


def render(tmp_path, graph: str, config: str, *overrides: str) -> list[dict[str, Any]]:
    cfg = apply_overrides(load_config(str(ROOT / "configs" / f"{config}.yaml")), list(overrides))
    plan = build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), cfg, run_dir=tmp_path / "run", local=False)
    return list(yaml.safe_load_all(render_k8s(plan, "img")))


def services(docs) -> dict[str, dict[str, Any]]:
    return docs[0]["spec"]["services"]


def main_args(service) -> list[str]:
    return service["extraPodSpec"]["mainContainer"]["args"]


def engine(service) -> str:
    return service["extraPodSpec"]["mainContainer"]["command"][2]


@pytest.mark.parametrize("graph,config,overrides", SHIPPED, ids=[c for _, c, _ in SHIPPED])
def test_no_rendered_component_pins_what_the_operators_environment_chooses(tmp_path, graph, config, overrides):
    docs = render(tmp_path, graph, config, *overrides)
    containers = [(n, s["extraPodSpec"]["mainContainer"], s.get("envs", [])) for n, s in services(docs).items()]
    for doc in docs[1:]:  # the node cache's DaemonSet: it joins no discovery, but must not pin one either
        if doc["kind"] == "DaemonSet":
            containers += [(c["name"], c, c.get("env", [])) for c in doc["spec"]["template"]["spec"]["containers"]]
    assert containers
    for name, container, envs in containers:
        args = container.get("args", [])
        assert not OPERATOR_FLAGS & {a.split("=")[0] for a in args}, (name, args)
        assert not OPERATOR_VARS & {e["name"] for e in envs}, (name, envs)


@pytest.mark.parametrize("graph", ["agg_router", "disagg_router"])
def test_rendered_reference_workers_register_where_the_operators_environment_says(tmp_path, monkeypatch, graph):
    """The reference worker, prefill and decode roles included, reads the pod's environment as
    Dynamo's own workers do: DYN_NAMESPACE plus the rollout's suffix, the operator's discovery
    backend and planes; and its servers bind the pod's address, not loopback."""
    for var, value in WORKER_ENV.items():
        monkeypatch.setenv(var, value)
    workers = [s for s in services(render(tmp_path, graph, graph)).values() if s["componentType"] == "worker"]
    assert workers
    for service in workers:
        assert engine(service) == "dynamo_flexkv.integrations.dynamo_worker"
        args = build_parser().parse_args(main_args(service))
        assert args.namespace == f"{NAMESPACE}-{SUFFIX}"
        assert (args.discovery_backend, args.request_plane, args.event_plane) == ("kubernetes", "tcp", "nats")
        env = {e["name"]: e for e in service["envs"]}
        for var in LOOPBACK_ENV:  # the worker's own defaults would advertise 127.0.0.1 to other pods
            want = (
                {"value": "0.0.0.0"}
                if var == "DYN_SYSTEM_HOST"
                else {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
            )
            assert {k: v for k, v in env[var].items() if k != "name"} == want, var


def test_rendered_vllm_workers_and_frontend_read_the_operators_environment_with_dynamos_parsers(tmp_path, monkeypatch):
    """dynamo.vllm and dynamo.frontend parse the rendered arguments with their own argument groups
    (the runtime options: namespace, discovery, planes) under the operator's environment."""
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    from dynamo.common.configuration.groups.runtime_args import DynamoRuntimeArgGroup, DynamoRuntimeConfig
    from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig

    svc = services(render(tmp_path, "disagg_router_vllm", "disagg_router_vllm"))
    for var, value in WORKER_ENV.items():
        monkeypatch.setenv(var, value)
    for name in ("PrefillWorker", "DecodeWorker"):
        assert engine(svc[name]) == "dynamo.vllm"
        parser = argparse.ArgumentParser()
        DynamoRuntimeArgGroup().add_arguments(parser)
        known, _ = parser.parse_known_args(main_args(svc[name]))
        runtime = DynamoRuntimeConfig.from_cli_args(known)
        assert runtime.endpoint is None  # dyn://ns.component.endpoint would override the namespace
        runtime.validate()  # composes the worker namespace (dynamo.common.utils.namespace)
        assert runtime.namespace == f"{NAMESPACE}-{SUFFIX}"
        assert (runtime.discovery_backend, runtime.request_plane, runtime.event_plane) == ("kubernetes", "tcp", "nats")
    monkeypatch.delenv("DYN_NAMESPACE_WORKER_SUFFIX")
    for var, value in FRONTEND_ENV.items():
        monkeypatch.setenv(var, value)
    parser = argparse.ArgumentParser()
    FrontendArgGroup().add_arguments(parser)
    known, unknown = parser.parse_known_args(main_args(svc["Frontend"]))
    assert not unknown
    front = FrontendConfig.from_cli_args(known)
    assert (front.namespace, front.namespace_prefix) == (NAMESPACE, NAMESPACE)
    assert (front.discovery_backend, front.request_plane, front.event_plane) == ("kubernetes", "tcp", "nats")


def test_the_worker_reads_flag_then_environment_then_default(monkeypatch):
    for var in (*POD_ENV, "DYN_NAMESPACE_WORKER_SUFFIX"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args([])
    assert (args.namespace, args.discovery_backend, args.request_plane, args.event_plane) == (
        "dynamo",
        "file",
        "tcp",
        "zmq",
    )
    monkeypatch.setenv("DYN_NAMESPACE", "")  # set but empty: as unset
    assert build_parser().parse_args([]).namespace == "dynamo"
    for var, value in POD_ENV.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(["--discovery-backend", "etcd", "--namespace", "mine"])
    assert (args.namespace, args.discovery_backend, args.event_plane) == ("mine", "etcd", "nats")
    monkeypatch.setenv("DYN_NAMESPACE_WORKER_SUFFIX", SUFFIX)  # appended to the flag's value too, as Dynamo does
    assert build_parser().parse_args(["--namespace", "mine"]).namespace == f"mine-{SUFFIX}"


def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "consul")
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    err = capsys.readouterr().err
    assert "--discovery-backend: 'consul'" in err and "$DYN_DISCOVERY_BACKEND" in err and "etcd" in err


@pytest.mark.parametrize("var", ["DYN_NAMESPACE_WORKER_SUFFIX", "DYN_NAMESPACE_PREFIX"])
def test_serve_refuses_the_operators_namespace_variables_in_its_environment(tmp_path, monkeypatch, var):
    """Left in serve's shell, they would put the workers in another namespace than its frontend's."""
    monkeypatch.setenv(var, "abc")
    cfg = apply_overrides(load_config(str(ROOT / "configs" / "agg_router.yaml")), TINY)
    with pytest.raises(GraphError, match=f"{var}='abc'.*Unset them"):
        build_plan(load_graph(str(ROOT / "graphs" / "agg_router.py")), cfg, run_dir=tmp_path / "run")


# ---- the rendered agg_router graph, started with an operator's environment on 127.0.0.1 ----------


def etcd_keys(endpoint: str) -> list[str]:
    """Every key in etcd (its v3 JSON gateway: no etcdctl needed)."""
    import urllib.request

    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()})
    with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/v3/kv/range", body.encode()), timeout=10) as r:
        return [base64.b64decode(kv["key"]).decode() for kv in json.load(r).get("kvs", [])]


def pod_env(service, operator: dict[str, str], **pod: str) -> dict[str, str]:
    """A pod's environment: the service's envs (the pod's address where they ask for it), then the
    operator's, then what this machine needs (``pod``)."""
    env = {}
    for e in service.get("envs", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom") == {"fieldRef": {"fieldPath": "status.podIP"}}:
            env[e["name"]] = "127.0.0.1"  # the "pod network" here
        else:
            raise AssertionError(f"an env this test cannot give: {e}")
    return {**env, **operator, **pod}


def command(service) -> list[str]:
    container = service["extraPodSpec"]["mainContainer"]
    assert container["command"][0] == "python3"
    return [sys.executable, *container["command"][1:], *container["args"]]


ETCD_AND_NATS = pytest.mark.skipif(
    not (Path("/usr/bin/etcd").exists() and Path("/usr/sbin/nats-server").exists()),
    reason="etcd-server and nats-server are installed by make test",
)


def pod_process(tmp_path: Path, name: str, service, ports, operator: dict[str, str]) -> Process:
    """A rendered worker service's pod on this machine: its command, the operator's environment,
    and in place of the pod's own filesystem and network paths, ones under ``tmp_path``."""
    from dynamo_flexkv.serve.vllm_worker import LOCAL_ENV, RENDER_MODEL_DIR, VLLM_PORT_BAND, VLLM_PORTS_PER_WORKER

    system_port = ports.take(0, f"{name} system", "", any_port=False)  # Dynamo's: below 32768
    here = {"DYN_SYSTEM_PORT": str(system_port), "DYN_SYSTEM_HOST": "127.0.0.1"}  # loopback only
    if any(e["name"] == "FLEXKV_SSD_CACHE_DIR" for e in service["envs"]):
        here["FLEXKV_SSD_CACHE_DIR"] = str(tmp_path / "ssd")  # the pod's emptyDir
    argv = command(service)
    if engine(service) != "dynamo.vllm":
        return Process(name, argv, pod_env(service, operator, **here), Kind.WORKER, system_port)
    # The init container writes the preset's model directory; /tmp is the pod's own.
    model = tmp_path / "model"
    for init in service["extraPodSpec"]["initContainers"]:
        script = init["command"][2].replace(repr(RENDER_MODEL_DIR), repr(str(model)))
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    argv = [
        a.replace("ipc:///tmp/", f"ipc://{tmp_path}/").replace('"run_dir": "/tmp"', f'"run_dir": "{tmp_path}"')
        for a in argv
    ]
    argv[argv.index("--model") + 1] = str(model)
    here.update(LOCAL_ENV, HOME=str(tmp_path / "home"))
    here["VLLM_PORT"] = str(ports.take_range(VLLM_PORTS_PER_WORKER, f"{name} VLLM_PORT", VLLM_PORT_BAND))
    return Process(
        name, argv, pod_env(service, operator, **here), Kind.WORKER, system_port, engine="vllm", stop_group=False
    )


def serve_rendered(tmp_path: Path, graph: str, worker: str, *overrides: str) -> None:
    """The rendered Frontend and ``worker`` commands, each with the environment the operator gives
    its pod (etcd discovery, NATS events, a namespace of the operator's, the workers' rollout
    suffix): the frontend lists the model, a completion is answered, etcd holds the worker under
    NAMESPACE-SUFFIX only, and the frontend's router applies the worker's KV events."""
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    from dynamo_flexkv.core.http_client import http_json
    from dynamo_flexkv.serve.infra import infra_processes
    from dynamo_flexkv.serve.launcher import Launcher
    from dynamo_flexkv.serve.ports import PortBook

    svc = services(render(tmp_path, graph, graph, *overrides, f"{worker}.replicas=1"))
    run = tmp_path / "run"
    ports = PortBook()
    infra, infra_env = infra_processes(run, "etcd", "nats", ports)
    assert [p.name for p in infra] == ["etcd", "nats"]
    reach = {k: infra_env[k] for k in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    etcd_env = dict(POD_ENV, DYN_DISCOVERY_BACKEND="etcd", **reach)

    front = svc["Frontend"]
    http_port = ports.take(0, "Frontend http", "", any_port=True)
    argv = command(front)
    argv[argv.index("--http-port") + 1] = str(http_port)  # the pod's 8000
    frontend = Process(
        "Frontend",
        argv,
        pod_env(front, {**etcd_env, "DYN_NAMESPACE_PREFIX": NAMESPACE}, DYN_HTTP_HOST="127.0.0.1"),
        Kind.FRONTEND,
        http_port,
    )
    proc = pod_process(tmp_path, worker, svc[worker], ports, {**etcd_env, "DYN_NAMESPACE_WORKER_SUFFIX": SUFFIX})
    args = main_args(svc[worker])
    served = args[args.index("--served-model-name") + 1]
    plan = LaunchPlan(
        load_graph(str(ROOT / "graphs" / f"{graph}.py")),
        run,
        "tiny",
        served,
        http_port,
        "etcd",
        "nats",
        infra,
        [frontend, proc],
        write_model=False,  # a reference worker writes its own (no --model-dir in a pod)
    )
    base = f"http://127.0.0.1:{http_port}"
    with Launcher(plan) as launcher:
        launcher.wait_ready(400)  # the worker's /health, then the frontend lists the model
        models = http_json(f"{base}/v1/models")
        assert [m["id"] for m in models["data"]] == [served]
        status, body = post(base, {"model": served, "prompt": "The operator supplies discovery. " * 4, "max_tokens": 4})
        assert status == 200, body
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1
        # Registered in the operator's namespace plus the rollout's suffix, nowhere else.
        instances = [k for k in etcd_keys(reach["ETCD_ENDPOINTS"]) if k.startswith(("v1/instances/", "v1/mdc/"))]
        assert any(k.startswith(f"v1/mdc/{NAMESPACE}-{SUFFIX}/") for k in instances), instances
        assert all(k.split("/")[2] == f"{NAMESPACE}-{SUFFIX}" for k in instances), instances
        if proc.engine == "flexkv":  # ... and its KV events reach the router over the operator's event plane
            applied = events_applied(f"{base}/metrics", [f"http://127.0.0.1:{proc.port}/metrics"])
            assert applied and all(status == "ok" for _, status in applied), applied
    assert_gone(launcher)


@pytest.mark.served
@ETCD_AND_NATS
def test_the_rendered_reference_worker_serves_through_the_rendered_frontend_on_etcd_and_nats(tmp_path):
    serve_rendered(tmp_path, "agg_router", "FlexKVWorker", *TINY)


@pytest.mark.served
@pytest.mark.slow  # a vLLM worker starts in 45 s or more on 2 cores
@ETCD_AND_NATS
def test_the_rendered_vllm_worker_serves_through_the_rendered_frontend_on_etcd_and_nats(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is installed by make test")
    serve_rendered(tmp_path, "agg_router_vllm", "VllmWorker")
