"""``dynamo-flexkv render --k8s``: the same graph and config as a DynamoGraphDeployment for the
Dynamo operator (nvidia.com/v1alpha1, one service per component).

In Kubernetes the operator supplies discovery and the event plane: it sets DYN_NAMESPACE,
DYN_DISCOVERY_BACKEND (and ETCD_ENDPOINTS or NATS_SERVER where they are used), DYN_EVENT_PLANE,
DYN_NAMESPACE_WORKER_SUFFIX on workers and DYN_NAMESPACE_PREFIX on the frontend in every pod, and
every rendered command leaves those choices to that environment (no --namespace,
--discovery-backend, --request-plane or --event-plane). The workers' cache options become FLEXKV_*
environment variables, and each worker pod gets its own emptyDir at its SSD cache directory (swap
in a hostPath or local PersistentVolume on nodes with NVMe: the disk tier is only as fast as what
backs that directory)."""

from __future__ import annotations

import re
from typing import Any, Dict, List

import yaml

from dynamo_flexkv.integrations.disagg.params import SECRET_ENV as HANDOVER_SECRET_ENV
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve import node_cache, vllm_worker
from dynamo_flexkv.serve.plan import PRE_COMMIT_PEEK_ENV, LaunchPlan
from dynamo_flexkv.serve.process import Process

SYSTEM_PORT = 9090  # the pods' system server (/health, /metrics), as the operator's probes expect
SKIP_ARGS = {
    "--http-host",
    "--discovery-backend",
    "--event-plane",
    "--model-dir",
    "--namespace",
    "--request-plane",
}  # the operator sets these
# The reference worker binds and advertises loopback unless told otherwise (LOOPBACK_ENV, for serve
# on one machine); in a pod the frontend and the operator's probes reach it at the pod's address.
SYSTEM_HOST = "0.0.0.0"  # its system server (/health, /metrics): Dynamo's default
POD_IP = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def render_k8s(plan: LaunchPlan, image: str) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", f"flexkv-{plan.graph.name}".lower())
    services: Dict[str, Any] = {}
    remote_secret = handover_secret = None
    own_model_dirs = []  # vLLM workers on a model directory the pods must provide
    for comp in plan.graph.components:
        procs = [p for p in plan.processes if p.name == comp.name or p.name.startswith(comp.name + "-")]
        first = procs[0]
        container: Dict[str, Any] = {
            "image": image,
            "command": ["python3"] + first.argv[1:3],
            "args": _portable_args(first.argv[3:]),
        }
        service: Dict[str, Any] = {
            "dynamoNamespace": name,
            "componentType": comp.kind.value,
            "replicas": len(procs),
            "extraPodSpec": {"mainContainer": container},
        }
        if comp.kind is Kind.FRONTEND:
            container["args"] = _replace_arg(container["args"], "--http-port", "8000")
            if PRE_COMMIT_PEEK_ENV in first.env:  # a refused stream is a 400, as under serve
                service["envs"] = [{"name": PRE_COMMIT_PEEK_ENV, "value": first.env[PRE_COMMIT_PEEK_ENV]}]
        else:
            service["envs"] = [{"name": "DYN_SYSTEM_PORT", "value": str(SYSTEM_PORT)}] + _cache_env(first)
            if first.cache is not None and first.cache.enable_remote:  # the Redis URL (and password) from a Secret
                service["envs"] = [e for e in service["envs"] if e["name"] != "FLEXKV_REMOTE_CACHE_URL"] + [
                    {
                        "name": "FLEXKV_REMOTE_CACHE_URL",
                        "valueFrom": {"secretKeyRef": {"name": f"{name}-redis", "key": "url"}},
                    }
                ]
                remote_secret = f"{name}-redis"
            mode = (
                first.argv[first.argv.index("--disaggregation-mode") + 1]
                if "--disaggregation-mode" in first.argv
                else "agg"
            )
            if mode != "agg":  # the operator's (and planner's) name for the role
                service["subComponentType"] = mode
            if first.engine == "flexkv":
                service["envs"] += _pod_hosts()
            if mode != "agg" and first.engine == "flexkv":
                # Every prefill and decode pod signs and checks handovers with one graph secret,
                # from a Secret (serve makes one per graph; a manifest must not carry it). vLLM's
                # NixlConnector has no such secret: its handshake port is the pod network's to guard.
                service["envs"].append(
                    {
                        "name": HANDOVER_SECRET_ENV,
                        "valueFrom": {"secretKeyRef": {"name": f"{name}-handover", "key": "secret"}},
                    }
                )
                handover_secret = f"{name}-handover"
            dirs = _ssd_dirs(first)
            vols = [{"name": f"ssd-cache-{i}", "emptyDir": {}} for i in range(len(dirs))]
            mounts = [{"name": v["name"], "mountPath": d} for v, d in zip(vols, dirs)]
            if first.cache is not None and first.cache.mode == "node":  # its node's cache server's socket
                vol, mount = node_cache.worker_mounts()
                vols.append(vol)
                mounts.append(mount)
            if first.engine == vllm_worker.ENGINE:
                service["envs"] += [{"name": k, "value": first.env[k]} for k in vllm_worker.PORTABLE_KEYS]
                model = first.argv[first.argv.index("--model") + 1]
                if model == vllm_worker.RENDER_MODEL_DIR:  # a preset: an init container writes its directory
                    vols.append({"name": "model", "emptyDir": {}})
                    mounts.append({"name": "model", "mountPath": model})
                    service["extraPodSpec"]["initContainers"] = [
                        {
                            "name": "model-dir",
                            "image": image,
                            "command": [
                                "python3",
                                "-c",
                                _write_model_dir(plan, model, not vllm_worker.loads_dummy(first.argv)),
                            ],
                            "volumeMounts": [{"name": "model", "mountPath": model}],
                        }
                    ]
                else:
                    own_model_dirs.append(f"{comp.name}: {model}")
            if vols:
                service["extraPodSpec"]["volumes"] = vols
                container["volumeMounts"] = mounts
        services[comp.name] = service
    manifest = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"services": services},
    }
    header = (
        f"# Rendered by dynamo-flexkv from graph {plan.graph.name}; apply with kubectl apply -f.\n"
        "# Worker SSD cache directories are emptyDir volumes: back them by local NVMe in production.\n"
    )
    if remote_secret:
        header += (
            f"# Remote tier: create the Secret first, e.g. kubectl create secret generic {remote_secret} "
            "--from-literal=url='redis://:PASSWORD@redis-host:6379' (or redis+cluster://h:p,h:p).\n"
        )
    if own_model_dirs:
        header += (
            "# vLLM workers load their model from a directory in the pod; mount it there (e.g. a "
            "PersistentVolume): " + ", ".join(own_model_dirs) + ".\n"
        )
    if plan.node_options:
        header += (
            "# Not carried over: "
            + ", ".join(f"{c}.node={n}" for c, n in plan.node_options.items())
            + " (places a component on a network-namespace node of serve --nodes); Kubernetes schedules "
            "the pods itself: pin them with a nodeSelector or affinity in extraPodSpec.\n"
        )
    if handover_secret:
        header += (
            f"# Disaggregation: prefill and decode workers sign and check handovers with one secret; create it "
            f"first, e.g. kubectl create secret generic {handover_secret} "
            "--from-literal=secret=$(openssl rand -hex 32).\n"
        )
    extra = []
    for proc in plan.processes:
        if proc.kind is Kind.CACHE:
            docs = node_cache.render_daemonset(proc, name, image)
            extra += [docs["configMap"], docs["daemonSet"]]
    if extra:
        header += (
            f"# Node cache: a DaemonSet runs one cache server per node ({name}-node-cache); the worker pods "
            f"attach over the hostPath {node_cache.RENDER_SOCKET_DIR} and must run as its user.\n"
        )
    return header + yaml.safe_dump_all([manifest, *extra], sort_keys=False)


def _write_model_dir(plan: LaunchPlan, path: str, weights: bool) -> str:
    """The init container's script: the preset's model directory (config.json + tokenizer, and the
    seeded weights unless vLLM loads dummy ones), as serve's launcher writes it."""
    return (
        "from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset; "
        f"write_preset({plan.model!r}, {path!r}, weights={weights!r})"
    )


def _portable_args(args: List[str]) -> List[str]:
    """Drops what only makes sense on this machine (loopback binding, file discovery, run dir)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in SKIP_ARGS:
            skip = True
            continue
        out.append(a)
    return out


def _pod_hosts() -> List[Dict[str, Any]]:
    """The reference worker's request, response, event and system servers on the pod's network
    (in place of its loopback defaults, which would register an address no other pod reaches)."""
    return [
        {"name": var, "value": SYSTEM_HOST} if var == "DYN_SYSTEM_HOST" else {"name": var, **POD_IP}
        for var in LOOPBACK_ENV
    ]


def _replace_arg(args: List[str], flag: str, value: str) -> List[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    return out


def _cache_env(proc: Process) -> List[Dict[str, str]]:
    path = proc.env.get("FLEXKV_CONFIG_PATH")
    if path is None or path not in proc.files:
        return []
    values = yaml.safe_load(proc.files[path]) or {}
    return [
        {"name": f"FLEXKV_{k.upper()}", "value": ";".join(map(str, v)) if isinstance(v, list) else str(v)}
        for k, v in sorted(values.items())
    ]


def _ssd_dirs(proc: Process) -> List[str]:
    if proc.cache is None or proc.cache.ssd_cache_gb <= 0:
        return []
    for e in _cache_env(proc):
        if e["name"] == "FLEXKV_SSD_CACHE_DIR":
            return [d for d in e["value"].split(";") if d]
    return []
