"""The disaggregated graphs' configs are checked before anything starts, and render --k8s names
both roles."""

import pytest
import yaml
from repo_paths import ROOT

from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.graph import GraphError
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config
from dynamo_flexkv.serve.render import render_k8s


def plan(tmp_path, graph, *overrides):
    config = apply_overrides(load_config(str(ROOT / "configs" / f"{graph}.yaml")), list(overrides))
    return build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path, local=False)


@pytest.mark.parametrize("graph,prefills", [("disagg", 1), ("disagg_router", 2)])
def test_disagg_graphs_plan_prefill_and_decode_workers(tmp_path, graph, prefills):
    p = plan(tmp_path, graph)
    modes = [w.argv[w.argv.index("--disaggregation-mode") + 1] for w in p.workers]
    assert modes == ["prefill"] * prefills + ["decode"]
    for w in p.workers:  # prefill workers are their own component: the frontend tells the roles apart
        assert (w.argv[w.argv.index("--component") + 1] if "--component" in w.argv else None) == (
            "prefill" if "prefill" in w.argv else None
        )
    dirs = {w.env["FLEXKV_CONFIG_PATH"] for w in p.workers}
    assert len(dirs) == len(p.workers)


@pytest.mark.parametrize(
    "override,message",
    [
        ("DecodeWorker.disaggregation-mode=prefill", "no decode worker"),
        ("PrefillWorker.disaggregation-mode=decode", "no prefill worker"),
        ("DecodeWorker.disaggregation-mode=agg", "aggregated and disaggregated"),
        ("PrefillWorker.disaggregation-mode=both", "use one of"),
        ("PrefillWorker.device-prefix-cache=false", "device-prefix-cache: true"),
        ("PrefillWorker.handover-lease-s=0", "must be > 0"),
        ("DecodeWorker.handover-timeout-s=-1", "must be > 0"),
        ("PrefillWorker.handover-renew-s=1", "must be at least 2 seconds"),
    ],
)
def test_bad_disagg_configs_are_refused_before_anything_starts(tmp_path, override, message):
    with pytest.raises(GraphError, match=message):
        plan(tmp_path, "disagg", override)


def test_render_k8s_names_both_roles(tmp_path):
    manifest = yaml.safe_load(render_k8s(plan(tmp_path, "disagg_router"), "img"))
    services = manifest["spec"]["services"]
    assert services["PrefillWorker"]["subComponentType"] == "prefill"
    assert services["PrefillWorker"]["replicas"] == 2
    assert services["DecodeWorker"]["subComponentType"] == "decode"
    assert "subComponentType" not in services["Frontend"]
    args = services["PrefillWorker"]["extraPodSpec"]["mainContainer"]["args"]
    assert args[args.index("--disaggregation-mode") + 1] == "prefill"


def test_render_k8s_gives_both_roles_the_handover_secret_from_a_secret(tmp_path):
    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV

    text = render_k8s(plan(tmp_path, "disagg_router"), "img")
    services = yaml.safe_load(text)["spec"]["services"]
    name = yaml.safe_load(text)["metadata"]["name"]
    for role in ("PrefillWorker", "DecodeWorker"):
        env = [e for e in services[role]["envs"] if e["name"] == SECRET_ENV]
        assert env == [
            {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": f"{name}-handover", "key": "secret"}}}
        ]
    assert "envs" not in services["Frontend"] or all(e["name"] != SECRET_ENV for e in services["Frontend"]["envs"])
    assert f"kubectl create secret generic {name}-handover" in text


def test_render_k8s_names_the_node_placement_it_does_not_carry_over(tmp_path):
    """A config written for serve --nodes renders, saying which placement Kubernetes takes over."""
    text = render_k8s(plan(tmp_path, "disagg", "Frontend.node=A", "PrefillWorker.node=B", "DecodeWorker.node=C"), "img")
    note = next(line for line in text.splitlines() if line.startswith("# Not carried over"))
    assert "PrefillWorker.node=B" in note and "DecodeWorker.node=C" in note and "nodeSelector" in note
    pod = yaml.safe_load(text)["spec"]["services"]["PrefillWorker"]["extraPodSpec"]
    assert pod["nodeSelector"] == {"dynamo-flexkv/node": "true"}  # render's own label, not serve's node B
    assert "'B'" not in str(pod) and "nodeName" not in str(pod)
    assert "Not carried over" not in render_k8s(plan(tmp_path, "disagg"), "img")


def test_disagg_graph_gives_its_workers_one_handover_secret_by_environment_only(tmp_path):
    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV

    def secrets_of(run):
        config = apply_overrides(
            load_config(str(ROOT / "configs" / "disagg.yaml")), ["Common.model=tiny", "Frontend.http-port=0"]
        )
        p = build_plan(load_graph(str(ROOT / "graphs" / "disagg.py")), config, run_dir=tmp_path / run)
        assert not any(w.env[SECRET_ENV] in " ".join(w.argv) for w in p.workers)
        return {w.env[SECRET_ENV] for w in p.workers}

    first, second = secrets_of("a"), secrets_of("b")
    assert len(first) == len(second) == 1 and first != second and len(next(iter(first))) == 64
