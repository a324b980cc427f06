"""What `dynamo-flexkv render --k8s` gives a cluster admin: every rendered manifest valid against the
Kubernetes JSON schemas, offline (kubernetes-validate's, strict: an unknown field fails), the
DynamoGraphDeployment's services against the operator's fields (its resources items, its
extraPodSpec as a PodSpec with a mainContainer); resource requests and limits on every pod; SSD
tiers on a directory of the node that outlives the pod (one replica per node) or, asked for, an
emptyDir; a nodeSelector on the workers and the node cache; the DaemonSet's host privileges
explained in the manifest; and a warning in the header for each thing render cannot decide."""

import copy
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from served import ROOT

from dynamo_flexkv import cli
from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
from dynamo_flexkv.serve.render import HOST_DATA_DIR, SsdVolume, render_k8s

K8S_VERSION = "1.33.0"  # a release the Dynamo 1.6 operator runs on
DEFS_ID = "https://kubernetes.io/api/_definitions.json"
OURS_ID = "https://dynamo-flexkv.invalid/_definitions.json"  # the k8s definitions plus the operator's types
# The operator's resource quantity (its CRD's pattern for cpu, memory, gpu and custom items).
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A DynamoGraphDeployment service's fields (the operator's DynamoComponentDeploymentSharedSpec).
SERVICE_FIELDS = {
    "annotations",
    "labels",
    "serviceName",
    "componentType",
    "subComponentType",
    "dynamoNamespace",
    "globalDynamoNamespace",
    "resources",
    "autoscaling",
    "envs",
    "envFromSecret",
    "volumeMounts",
    "ingress",
    "modelRef",
    "sharedMemory",
    "extraPodMetadata",
    "extraPodSpec",
    "livenessProbe",
    "readinessProbe",
    "replicas",
    "multinode",
    "scalingAdapter",
}
SHIPPED = [(p.stem, p.stem) for p in sorted((ROOT / "graphs").glob("*.py"))] + [
    ("agg_router_vllm", "agg_router_vllm_node")
]

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (scripts/install.sh does)")
jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")


def render_text(tmp_path, graph: str, config: str, **kw) -> str:
    cfg = apply_overrides(load_config(str(ROOT / "configs" / f"{config}.yaml")), [])
    plan = build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), cfg, run_dir=tmp_path / "run", local=False)
    return render_k8s(plan, "registry.example/dynamo-flexkv:1", **kw)


def docs_of(text: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(text))


def dgd_validator():
    """The DynamoGraphDeployment as the operator takes it, in terms of the Kubernetes definitions."""
    defs_path = (
        importlib.resources.files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{K8S_VERSION}-local-strict"
        / "_definitions.json"
    )
    defs = json.loads(defs_path.read_text())
    ours = copy.deepcopy(defs)
    ours["$id"] = OURS_ID
    pod_spec = copy.deepcopy(defs["$defs"]["io.k8s.api.core.v1.PodSpec"])
    pod_spec.pop("required", None)  # the operator adds the containers
    main = copy.deepcopy(defs["$defs"]["io.k8s.api.core.v1.Container"])
    main.pop("required", None)  # ... and names the main one
    pod_spec["properties"]["mainContainer"] = {"$ref": "#/$defs/dgd.MainContainer"}
    ours["$defs"]["dgd.ExtraPodSpec"] = pod_spec
    ours["$defs"]["dgd.MainContainer"] = main
    quantity = {"type": "string", "pattern": QUANTITY}
    item = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "cpu": quantity,
            "memory": quantity,
            "gpu": quantity,
            "gpuType": {"type": "string"},
            "custom": {"type": "object", "additionalProperties": quantity},
        },
    }
    service = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            **{f: {} for f in SERVICE_FIELDS},
            "componentType": {"type": "string"},
            "subComponentType": {"type": "string"},
            "dynamoNamespace": {"type": "string"},
            "replicas": {"type": "integer", "minimum": 0},
            "resources": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"requests": item, "limits": item, "claims": {"type": "array"}},
            },
            "envs": {"type": "array", "items": {"$ref": f"{DEFS_ID}#/$defs/io.k8s.api.core.v1.EnvVar"}},
            "extraPodSpec": {"$ref": f"{OURS_ID}#/$defs/dgd.ExtraPodSpec"},
        },
    }
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "nvidia.com/v1alpha1"},
            "kind": {"const": "DynamoGraphDeployment"},
            "metadata": {"$ref": f"{DEFS_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
            "spec": {
                "type": "object",
                "required": ["services"],
                "properties": {"services": {"type": "object", "additionalProperties": service}},
            },
        },
    }
    registry = referencing.Registry().with_resources(
        [
            (DEFS_ID, referencing.Resource.from_contents(defs)),
            (OURS_ID, referencing.Resource.from_contents(ours)),
        ]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


DGD = None


def problems(doc: dict[str, Any]) -> list[str]:
    """Why ``doc`` is not what the cluster accepts (empty: it is)."""
    global DGD
    if doc["kind"] == "DynamoGraphDeployment":
        DGD = DGD or dgd_validator()
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in DGD.iter_errors(doc)]
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    # The schema takes any string as a quantity: the API server does not.
    return [f"{path}: {q!r} is not a quantity" for path, q in quantities(doc) if not re.match(QUANTITY, q)]


def quantities(node, path="") -> list:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("requests", "limits") and isinstance(v, dict):
                out += [(f"{path}.{k}.{r}", str(q)) for r, q in v.items()]
            else:
                out += quantities(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += quantities(v, f"{path}[{i}]")
    return out


@pytest.mark.parametrize("ssd", list(SsdVolume), ids=[s.value for s in SsdVolume])
@pytest.mark.parametrize("graph,config", SHIPPED, ids=[c for _, c in SHIPPED])
def test_every_rendered_manifest_is_valid_against_the_kubernetes_schemas(tmp_path, graph, config, ssd):
    text = render_text(tmp_path, graph, config, ssd_volume=ssd)
    for doc in docs_of(text):
        assert problems(doc) == [], f"{doc['kind']} {doc['metadata']['name']}"
    assert "&id" not in text  # no YAML aliases: every object its own


def test_the_validation_catches_what_the_cluster_would_refuse(tmp_path):
    """The checks above are not vacuous: a quantity with a space, a field the operator does not
    have, a misspelt pod field and a DaemonSet without its selector are each refused."""
    dgd, _, daemonset = docs_of(render_text(tmp_path, "agg_router_vllm", "agg_router_vllm_node"))
    for breaks in (
        lambda d: d["spec"]["services"]["VllmWorker"]["resources"]["requests"].update(memory="8 GiB"),
        lambda d: d["spec"]["services"]["VllmWorker"].update(resource={}),
        lambda d: d["spec"]["services"]["VllmWorker"]["extraPodSpec"].update(nodeSelecter={"a": "b"}),
        lambda d: d["spec"]["services"]["VllmWorker"]["extraPodSpec"]["mainContainer"].update(volumeMount=[]),
    ):
        broken = copy.deepcopy(dgd)
        breaks(broken)
        assert problems(broken), "accepted"
    broken = copy.deepcopy(daemonset)
    del broken["spec"]["selector"]
    assert problems(broken)
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"
    assert problems(broken)


@pytest.mark.parametrize("graph,config", SHIPPED, ids=[c for _, c in SHIPPED])
def test_every_pod_has_resources_and_every_worker_a_node_selector(tmp_path, graph, config):
    dgd, *extra = docs_of(render_text(tmp_path, graph, config))
    for name, svc in dgd["spec"]["services"].items():
        res = svc["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], name
        pod = svc["extraPodSpec"]
        if svc["componentType"] == "worker":
            assert pod["nodeSelector"] == {"dynamo-flexkv/node": "true"}, name
            assert pod["securityContext"]["runAsUser"] == 1000, name
            if "vllm" in svc["extraPodSpec"]["mainContainer"]["command"][2]:
                assert res["requests"]["gpu"] == res["limits"]["gpu"] == "1", name
    for doc in extra:
        if doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            assert spec["nodeSelector"] == {"dynamo-flexkv/node": "true"}
            assert spec["containers"][0]["resources"]["requests"]["memory"].endswith("Gi")


def test_ssd_tiers_outlive_the_pod_on_a_node_directory_one_replica_per_node(tmp_path):
    text = render_text(tmp_path, "agg_router", "agg_router")
    svc = docs_of(text)[0]["spec"]["services"]["FlexKVWorker"]
    pod = svc["extraPodSpec"]
    ssd = [v for v in pod["volumes"] if v["name"].startswith("ssd-cache-")]
    assert ssd and all(
        v["hostPath"]["path"].startswith(f"{HOST_DATA_DIR}/flexkv-agg-router/FlexKVWorker/") for v in ssd
    )
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"]["nvidia.com/dynamo-component"] == "FlexKVWorker"
    owner = pod["initContainers"][0]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    mounted = {m["mountPath"] for m in pod["mainContainer"]["volumeMounts"] if m["name"].startswith("ssd-cache-")}
    assert {m["mountPath"] for m in owner["volumeMounts"]} == mounted
    assert "FlexKVWorker (2 replica(s)) need that many labelled nodes" in text
    assert "pod-security.kubernetes.io/enforce=privileged" in text

    text = render_text(tmp_path, "agg_router", "agg_router", ssd_volume=SsdVolume.EMPTYDIR)
    pod = docs_of(text)[0]["spec"]["services"]["FlexKVWorker"]["extraPodSpec"]
    assert all("emptyDir" in v for v in pod["volumes"] if v["name"].startswith("ssd-cache-"))
    assert "affinity" not in pod and "initContainers" not in pod
    assert "hostPath" not in text and "each pod restart starts the disk tier empty" in text


def test_the_node_cache_daemonset_says_why_it_needs_the_host(tmp_path):
    text = render_text(tmp_path, "agg_router_vllm", "agg_router_vllm_node")
    daemonset = docs_of(text)[2]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    why = daemonset["metadata"]["annotations"]
    assert "pidfd" in why["dynamo-flexkv/why-host-pid"] and "Unix socket" in why["dynamo-flexkv/why-host-path"]
    assert spec["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    ssd = [v for v in spec["volumes"] if v["name"].startswith("ssd-")]
    assert ssd and all(v["hostPath"]["path"].startswith(f"{HOST_DATA_DIR}/") for v in ssd)  # never the host's /tmp
    assert "# WARNING: the node cache DaemonSet runs with hostPID" in text


def test_the_header_warns_of_what_render_cannot_decide(tmp_path):
    text = render_text(tmp_path, "disagg_router_vllm", "disagg_router_vllm")
    warnings = [ln for ln in text.splitlines() if ln.startswith("# WARNING: ")]
    assert any("resources are estimates" in w for w in warnings)
    assert any("dynamo-flexkv/node=true" in w for w in warnings)
    cfg = apply_overrides(load_config(str(ROOT / "configs" / "agg.yaml")), [])
    plan = build_plan(load_graph(str(ROOT / "graphs" / "agg.py")), cfg, run_dir=tmp_path / "run", local=False)
    assert "has no registry" in render_k8s(plan)  # the default image: where does the cluster pull it from?
    assert "nodeSelector" not in render_k8s(plan, node_selector={})


def test_render_node_selector_and_its_mistakes_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "m.yaml"
    args = ["render", str(ROOT / "graphs" / "agg.py"), "-f", str(ROOT / "configs" / "agg.yaml"), "--k8s"]
    assert cli.main([*args, "--node-selector", "gpu=h100", "-o", str(out)]) == 0
    pod = docs_of(out.read_text())[0]["spec"]["services"]["FlexKVWorker"]["extraPodSpec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert "warning(s) to read first" in capsys.readouterr().err
    assert cli.main([*args, "--node-selector", "gpu"]) == 2
    assert "--node-selector 'gpu': expected KEY=VALUE" in capsys.readouterr().err
    for bad in ("Bad Key=v", "k=v w", "a=b=c", "a/b/c=v", "k=-v", "k=" + "v" * 64):  # the cluster would refuse them
        assert cli.main([*args, "--node-selector", bad]) == 2
        assert "a Kubernetes label key" in capsys.readouterr().err
    assert cli.main([*args, "--node-selector", "k=v", "--node-selector", "k=w"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert cli.main([*args, "--node-selector", "nvidia.com/gpu.present=true", "-o", str(out)]) == 0
    for where in (tmp_path / "missing" / "m.yaml", tmp_path):  # no such directory; a directory
        assert cli.main([*args, "-o", str(where)]) == 2
        assert f"render -o {where}: " in capsys.readouterr().err


def test_an_unvalidated_kind_would_be_seen(tmp_path):
    """Every kind render writes has a schema here (a new kind must get one)."""
    kinds = set()
    for graph, config in SHIPPED:
        kinds |= {d["kind"] for d in docs_of(render_text(tmp_path, graph, config))}
    assert kinds == {"DynamoGraphDeployment", "ConfigMap", "DaemonSet"}
    assert Path(kv.__file__).exists()
