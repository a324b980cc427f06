"""``dynamo-flexkv render --k8s``: the same graph and config as a DynamoGraphDeployment for the
Dynamo operator (nvidia.com/v1alpha1, one service per component), plus a DaemonSet per node cache.

In Kubernetes the operator supplies discovery and the event plane: it sets DYN_NAMESPACE,
DYN_DISCOVERY_BACKEND (and ETCD_ENDPOINTS or NATS_SERVER where they are used), DYN_EVENT_PLANE,
DYN_NAMESPACE_WORKER_SUFFIX on workers and DYN_NAMESPACE_PREFIX on the frontend in every pod, and
every rendered command leaves those choices to that environment (no --namespace,
--discovery-backend, --request-plane or --event-plane). The workers' cache options become FLEXKV_*
environment variables.

What a cluster admin needs beyond that, and where render cannot know the answer it says so in
the manifest's header (``# WARNING:`` lines): resource requests and limits (estimated from the
config), the SSD tier's volume (a hostPath per node by default, so that the disk tier survives a
pod restart and is re-adopted; one replica of a worker service per node, since two workers never
share an SSD directory; ``--ssd-volume emptydir`` where hostPath is not allowed), a nodeSelector on
the worker pods and the node cache (nodes an admin labels), the user the pods run as, and why the
node cache's DaemonSet needs hostPID and hostPath."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

import yaml

from dynamo_flexkv.integrations.disagg.params import SECRET_ENV as HANDOVER_SECRET_ENV
from dynamo_flexkv.integrations.dynamo_worker import LOOPBACK_ENV
from dynamo_flexkv.serve import node_cache, vllm_worker
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.logs import COMPONENT_LOG_ENV
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
DEFAULT_IMAGE = "dynamo-flexkv:latest"


class SsdVolume(Enum):
    """What backs a worker's SSD cache directory in its pod (``render --ssd-volume``)."""

    HOSTPATH = "hostpath"  # a directory of the node: survives a pod restart, one replica per node
    EMPTYDIR = "emptydir"  # the pod's own: no host access needed, emptied at each pod restart


HOST_DATA_DIR = "/var/lib/dynamo-flexkv"  # on each node: <graph>/<component>/ssd-<i>
RUN_AS = 1000  # the image's user (the Dockerfile's RUN_USER, dynamo): the node cache and its workers share it
DEFAULT_NODE_SELECTOR = {"dynamo-flexkv/node": "true"}
# Memory a process needs beside its host tier (GiB), a starting point: the frontend (tokenizer,
# router), the reference worker (its device KV in host memory), a vLLM worker (the engine and its
# CPU-side buffers; a model's weights on GPU do not count here).
BASE_MEMORY_GIB = {"frontend": 2.0, "flexkv": 4.0, "vllm": 8.0, "cache": 1.0}
CPU_REQUEST = {"frontend": "2", "flexkv": "2", "vllm": "4", "cache": "1"}
# The DaemonSet's two host privileges, said in the manifest itself.
WHY_HOST_PID = (
    "The cache server watches each attached engine's process (a pidfd from the socket's peer credentials) "
    "so that a device-to-host copy an engine had in flight when it died can never land in host slots the "
    "server gives to another block; it holds those slots until the process has exited. In its own pid "
    "namespace an engine pod's pid reads 0: the server cannot watch it and keeps such slots fenced until it restarts."
)
WHY_HOST_PATH = (
    "The socket directory is how the node's worker pods reach the server (a Unix socket that passes the "
    "shared host-tier segment); the SSD directories keep the node's disk tier across a server restart."
)


def render_k8s(
    plan: LaunchPlan,
    image: str = DEFAULT_IMAGE,
    ssd_volume: SsdVolume = SsdVolume.HOSTPATH,
    node_selector: Mapping[str, str] | None = None,
) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", f"flexkv-{plan.graph.name}".lower())
    selector = dict(DEFAULT_NODE_SELECTOR if node_selector is None else node_selector)
    services: dict[str, Any] = {}
    remote_secret = handover_secret = None
    own_model_dirs = []  # vLLM workers on a model directory the pods must provide
    warnings: list[str] = []
    per_node: list[str] = []  # worker services held to one replica per node (hostPath SSD directories)
    for comp in plan.graph.components:
        procs = [p for p in plan.processes if p.name == comp.name or p.name.startswith(comp.name + "-")]
        first = procs[0]
        container: dict[str, Any] = {
            "image": image,
            "command": ["python3"] + first.argv[1:3],
            "args": _portable_args(first.argv[3:]),
        }
        service: dict[str, Any] = {
            "dynamoNamespace": name,
            "componentType": comp.kind.value,
            "replicas": len(procs),
            "resources": _resources(first),
            "extraPodSpec": {"mainContainer": container},
        }
        log_env = [{"name": k, "value": v} for k, v in COMPONENT_LOG_ENV.items()]
        if comp.kind is Kind.FRONTEND:
            container["args"] = _replace_arg(container["args"], "--http-port", "8000")
            service["envs"] = list(log_env)
            if PRE_COMMIT_PEEK_ENV in first.env:  # a refused stream is a 400, as under serve
                service["envs"].append({"name": PRE_COMMIT_PEEK_ENV, "value": first.env[PRE_COMMIT_PEEK_ENV]})
        else:
            service["envs"] = [{"name": "DYN_SYSTEM_PORT", "value": str(SYSTEM_PORT)}] + log_env + _cache_env(first)
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
            if vllm_worker.has_hints(first):
                # Router hints: the pod advertises its own address (args say $(POD_IP), which
                # Kubernetes expands from this variable) and proves membership with the graph secret.
                service["envs"].append({"name": "POD_IP", **copy.deepcopy(POD_IP)})
            if (mode != "agg" and first.engine == "flexkv") or vllm_worker.has_hints(first):
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
            pod = service["extraPodSpec"]
            pod["securityContext"] = _pod_security()
            if selector:
                pod["nodeSelector"] = dict(selector)
            dirs = _ssd_dirs(first)
            vols, mounts = _ssd_volumes(first, dirs, ssd_volume, f"{HOST_DATA_DIR}/{name}/{comp.name}")
            if dirs and ssd_volume is SsdVolume.HOSTPATH:
                pod["initContainers"] = [_owner_init(image, mounts)]
                pod["affinity"] = _one_per_node(name, comp.name)
                per_node.append(f"{comp.name} ({len(procs)} replica(s))")
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
                    pod.setdefault("initContainers", []).append(
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
                    )
                else:
                    own_model_dirs.append(f"{comp.name}: {model}")
            if vols:
                pod["volumes"] = vols
                container["volumeMounts"] = mounts
        services[comp.name] = service
    manifest = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"services": services},
    }
    header = f"# Rendered by dynamo-flexkv from graph {plan.graph.name}; apply with kubectl apply -f.\n"
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
            "the pods itself (the nodeSelector below).\n"
        )
    if handover_secret:
        header += (
            f"# Disaggregation handovers and router-hint pulls are signed and checked with one secret; create it "
            f"first, e.g. kubectl create secret generic {handover_secret} "
            "--from-literal=secret=$(openssl rand -hex 32).\n"
        )
    extra = []
    caches = [proc for proc in plan.processes if proc.kind is Kind.CACHE]
    for proc in caches:
        docs = node_cache.render_daemonset(
            proc,
            name,
            image,
            node_selector=selector,
            host_dir=f"{HOST_DATA_DIR}/{name}/node-cache",
            pod_security=_pod_security(),
            owner_init=_owner_init,
            resources=_container_resources(proc),
            annotations={"dynamo-flexkv/why-host-pid": WHY_HOST_PID, "dynamo-flexkv/why-host-path": WHY_HOST_PATH},
        )
        extra += [docs["configMap"], docs["daemonSet"]]
    if extra:
        header += (
            f"# Node cache: a DaemonSet runs one cache server per node ({name}-node-cache); the worker pods "
            f"attach over the hostPath {node_cache.RENDER_SOCKET_DIR} and run as its user (uid {RUN_AS}).\n"
        )
    warnings += _warnings(plan, image, selector, ssd_volume, per_node, bool(caches))
    header += "".join(f"# WARNING: {w}\n" for w in warnings)
    return header + yaml.safe_dump_all([manifest, *extra], sort_keys=False)


def _warnings(
    plan: LaunchPlan, image: str, selector: Mapping[str, str], ssd_volume: SsdVolume, per_node: list[str], cache: bool
) -> list[str]:
    """What render cannot decide for the cluster, said where the admin reads it."""
    out = [
        "resources are estimates from the config: memory = the host tier (cpu_cache_gb) plus "
        f"{BASE_MEMORY_GIB['frontend']:g} GiB (frontend), {BASE_MEMORY_GIB['flexkv']:g} (reference worker), "
        f"{BASE_MEMORY_GIB['vllm']:g} (vLLM worker), {BASE_MEMORY_GIB['cache']:g} (node cache), limits 25% above; "
        "a vLLM worker's GPUs = its tensor-parallel size; no CPU limits (a throttled decode loop costs latency). "
        "Size them for your model before applying.",
    ]
    if image == DEFAULT_IMAGE:
        out.append(
            f"image {image} has no registry: build it (make image), push it where the cluster pulls from and "
            "render with --image REGISTRY/dynamo-flexkv:TAG."
        )
    if selector:
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        out.append(
            f"worker pods{' and the node cache' if cache else ''} run only on nodes labelled {labels} "
            f"(kubectl label node NODE {' '.join(f'{k}={v}' for k, v in selector.items())}): label the nodes "
            f"that have the local disk for {HOST_DATA_DIR}, or render with --node-selector KEY=VALUE."
        )
    if per_node:
        out.append(
            f"SSD tiers are hostPath directories under {HOST_DATA_DIR}/ on each node: they survive a pod restart "
            "(the disk tier is re-adopted), and a worker service runs at most one replica per node (required "
            "pod anti-affinity: two workers never share an SSD directory): "
            + ", ".join(per_node)
            + " need that many labelled nodes. An init container (root, CHOWN and FOWNER only) gives the "
            f"directories to uid {RUN_AS}."
        )
    if per_node or cache:
        out.append(
            "hostPath volumes"
            + (" and the node cache's hostPID" if cache else "")
            + " need a namespace whose Pod Security admission allows them (label it "
            "pod-security.kubernetes.io/enforce=privileged: the baseline and restricted levels forbid both). "
            + (
                "Without them: --ssd-volume emptydir (the disk tier is lost at each pod restart)"
                + (" and workers in embedded cache mode instead of a node cache." if cache else ".")
            )
        )
    if cache:
        out.append(f"the node cache DaemonSet runs with hostPID: {WHY_HOST_PID}")
    if ssd_volume is SsdVolume.EMPTYDIR and any(_ssd_dirs(p) for p in plan.workers):
        out.append("SSD tiers are emptyDir volumes: each pod restart starts the disk tier empty.")
    return out


def _resources(proc: Process) -> dict[str, Any]:
    """A DynamoGraphDeployment service's resources (the operator's cpu / memory / gpu items)."""
    kind = "frontend" if proc.kind is Kind.FRONTEND else proc.engine
    memory = _memory_gib(proc, kind)
    requests: dict[str, str] = {"cpu": CPU_REQUEST[kind], "memory": f"{memory}Gi"}
    limits: dict[str, str] = {"memory": f"{math.ceil(memory * 1.25)}Gi"}
    if proc.engine == vllm_worker.ENGINE and proc.kind is Kind.WORKER:
        requests["gpu"] = limits["gpu"] = str(_flag(proc.argv, "--tensor-parallel-size", 1))
    return {"requests": requests, "limits": limits}


def _container_resources(proc: Process) -> dict[str, Any]:
    """A plain container's resources (the node cache's DaemonSet)."""
    memory = _memory_gib(proc, "cache")
    return {
        "requests": {"cpu": CPU_REQUEST["cache"], "memory": f"{memory}Gi"},
        "limits": {"memory": f"{math.ceil(memory * 1.25)}Gi"},
    }


def _memory_gib(proc: Process, kind: str) -> int:
    host = 0.0
    if proc.cache is not None and proc.cache.mode != "node":  # a node-mode worker's host tier is the server's
        host = proc.cache.cpu_cache_gb
    elif proc.kind is Kind.CACHE:
        host = float((yaml.safe_load(next(iter(proc.files.values()))) or {}).get("cpu_cache_gb") or 0)
    return math.ceil(host + BASE_MEMORY_GIB[kind])


def _flag(argv: list[str], flag: str, default: int) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


def _pod_security() -> dict[str, Any]:
    return {
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _owner_init(image: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """An init container that gives hostPath directories (made root's by the kubelet) to RUN_AS,
    owner-only: the workers write their SSD tier there, the cache server its socket."""
    paths = " ".join(m["mountPath"] for m in mounts)
    return {
        "name": "host-dir-owner",
        "image": image,
        "command": ["sh", "-c", f"chown {RUN_AS}:{RUN_AS} {paths} && chmod 700 {paths}"],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        },
        "volumeMounts": [dict(m) for m in mounts],
    }


def _one_per_node(name: str, component: str) -> dict[str, Any]:
    """No two pods of this worker service on one node: they would share its SSD hostPath."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchLabels": {
                            "nvidia.com/dynamo-graph-deployment-name": name,
                            "nvidia.com/dynamo-component": component,
                        }
                    },
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }


def _ssd_volumes(proc: Process, dirs: list[str], how: SsdVolume, host_base: str):
    """(volumes, mounts) for a worker's SSD cache directories."""
    vols: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    per_dir_gb = proc.cache.ssd_cache_gb / len(dirs) if proc.cache is not None and dirs else 0.0
    for i, d in enumerate(dirs):
        vol: dict[str, Any] = {"name": f"ssd-cache-{i}"}
        if how is SsdVolume.HOSTPATH:
            vol["hostPath"] = {"path": f"{host_base}/ssd-{i}", "type": "DirectoryOrCreate"}
        else:  # the tier's files, and a little room for its journal
            vol["emptyDir"] = {"sizeLimit": f"{math.ceil(per_dir_gb * 1.1 + 0.5)}Gi"}
        vols.append(vol)
        mounts.append({"name": vol["name"], "mountPath": d})
    return vols, mounts


def _write_model_dir(plan: LaunchPlan, path: str, weights: bool) -> str:
    """The init container's script: the preset's model directory (config.json + tokenizer, and the
    seeded weights unless vLLM loads dummy ones), as serve's launcher writes it."""
    return (
        "from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset; "
        f"write_preset({plan.model!r}, {path!r}, weights={weights!r})"
    )


def _portable_args(args: list[str]) -> list[str]:
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


def _pod_hosts() -> list[dict[str, Any]]:
    """The reference worker's request, response, event and system servers on the pod's network
    (in place of its loopback defaults, which would register an address no other pod reaches)."""
    return [
        {"name": var, "value": SYSTEM_HOST} if var == "DYN_SYSTEM_HOST" else {"name": var, **copy.deepcopy(POD_IP)}
        for var in LOOPBACK_ENV
    ]  # each its own dict: a shared one is written as a YAML alias (&id001)


def _replace_arg(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    return out


def _cache_env(proc: Process) -> list[dict[str, str]]:
    path = proc.env.get("FLEXKV_CONFIG_PATH")
    if path is None or path not in proc.files:
        return []
    values = yaml.safe_load(proc.files[path]) or {}
    return [
        {"name": f"FLEXKV_{k.upper()}", "value": ";".join(map(str, v)) if isinstance(v, list) else str(v)}
        for k, v in sorted(values.items())
    ]


def _ssd_dirs(proc: Process) -> list[str]:
    if proc.cache is None or proc.cache.ssd_cache_gb <= 0:
        return []
    for e in _cache_env(proc):
        if e["name"] == "FLEXKV_SSD_CACHE_DIR":
            return [d for d in e["value"].split(";") if d]
    return []
