"""A graph over separate nodes: network namespaces joined by veth pairs to one bridge, each with a
link-local address (and a ULA for UCX), no route anywhere else (dynamo_flexkv.serve.nodes).

The plan checks need no root; the namespaces do (the tests skip, naming why, without it)."""

import json
import os
import signal
import subprocess
import sys

import pytest
from disagg_helpers import disagg_plan
from served import ROOT

from dynamo_flexkv.serve import GraphError
from dynamo_flexkv.serve.nodes import Node, Nodes

# Nodes that do not exist: planning refuses what it can before it looks for them.
FAKE = Nodes(
    "t-sw",
    {n: Node(n, f"t-{n.lower()}", f"169.254.9.{i + 1}", f"fd00:9::{i + 1}", port=f"p{i}") for i, n in enumerate("ABC")},
    "t",
)
PLACED = ("Frontend.node=A", "PrefillWorker.node=B", "DecodeWorker.node=C")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_a_placement_serve_cannot_honour_is_refused_naming_the_fix(tmp_path, monkeypatch):
    etcd_nats = dict(discovery_backend="etcd", event_plane="nats", nodes=FAKE)
    with pytest.raises(GraphError, match="--discovery-backend etcd --event-plane nats"):
        disagg_plan(tmp_path, "disagg", *PLACED, nodes=FAKE)
    with pytest.raises(GraphError, match=r"PrefillWorker.node='B' needs serve --nodes FILE"):
        disagg_plan(tmp_path, "disagg", "PrefillWorker.node=B")
    with pytest.raises(GraphError, match=r"node 'D' is not in the nodes file \(it has \['A', 'B', 'C'\]\)"):
        disagg_plan(tmp_path, "disagg", "Frontend.node=A", "PrefillWorker.node=B", "DecodeWorker.node=D", **etcd_nats)
    with pytest.raises(GraphError, match=r"every component names its node: \['Frontend'\] name none"):
        disagg_plan(tmp_path, "disagg", "PrefillWorker.node=B", "DecodeWorker.node=C", **etcd_nats)
    with pytest.raises(GraphError, match="remote_cache_url every node reaches"):
        disagg_plan(tmp_path, "disagg", *PLACED, "DecodeWorker.cache.enable_remote=true", **etcd_nats)
    monkeypatch.setenv("NATS_SERVER", "nats://127.0.0.1:4222")
    with pytest.raises(GraphError, match="NATS_SERVER=nats://127.0.0.1:4222 is this machine's loopback"):
        disagg_plan(tmp_path, "disagg", *PLACED, **etcd_nats)
    monkeypatch.delenv("NATS_SERVER")
    with pytest.raises(GraphError, match=r"network namespaces \['t-a', 't-b', 't-c', 't-sw'\] do not exist"):
        disagg_plan(tmp_path, "disagg", *PLACED, **etcd_nats)
    bad = tmp_path / "nodes.yaml"
    bad.write_text("nodes: [A, B]\n")
    with pytest.raises(GraphError, match="not a nodes file written by `dynamo-flexkv nodes up`"):
        Nodes.load(str(bad))
    FAKE.save(bad)
    bad.write_text(bad.read_text().replace("switch: t-sw", "switch: victim"))
    with pytest.raises(GraphError, match=r"namespaces \['victim'\] do not match its prefix 't'"):
        Nodes.load(str(bad))  # `nodes down` would have deleted a namespace the file did not make


def test_a_worker_takes_a_node_per_replica_and_a_list_that_does_not_fit_is_refused(tmp_path):
    from served import make_plan

    etcd_nats = dict(discovery_backend="etcd", event_plane="nats", nodes=FAKE)
    with pytest.raises(GraphError, match=r"FlexKVWorker.node lists 3 nodes for 2 replicas: give one node per replica"):
        make_plan(tmp_path, "agg_router", "Frontend.node=A", "FlexKVWorker.node=[A,B,C]", **etcd_nats)
    with pytest.raises(
        GraphError, match=r"FlexKVWorker.node=\[.A., 3\]: expected a node name, or a list of one node name"
    ):
        make_plan(tmp_path, "agg_router", "Frontend.node=A", "FlexKVWorker.node=[A, 3]", **etcd_nats)
    with pytest.raises(GraphError, match=r"node per replica, which cache.mode: node does not take yet"):
        make_plan(
            tmp_path,
            "agg_router",
            "Frontend.node=A",
            "FlexKVWorker.node=[A,B]",
            "FlexKVWorker.cache.mode=node",
            **etcd_nats,
        )
    with pytest.raises(GraphError, match=r"node 'D' is not in the nodes file"):  # each replica's node is looked up
        make_plan(tmp_path, "agg_router", "Frontend.node=A", "FlexKVWorker.node=[B,D]", **etcd_nats)
    with pytest.raises(GraphError, match=r"FlexKVWorker.node=\[A, B\] needs serve --nodes FILE"):
        make_plan(tmp_path, "agg_router", "FlexKVWorker.node=[A,B]")


def test_vllm_workers_take_a_node_too(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    from dynamo_flexkv.serve import load_graph
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    config = apply_overrides(
        load_config(str(ROOT / "configs" / "disagg_vllm.yaml")),
        [
            "Frontend.http-port=0",
            *PLACED[:3],
            *(f"{w}.cache.ssd_cache_dir={tmp_path}/{w}" for w in ("PrefillWorker", "DecodeWorker")),
        ],
    )
    with pytest.raises(GraphError, match="do not exist"):  # accepted as an option, then looked for
        build_plan(
            load_graph(str(ROOT / "graphs" / "disagg_vllm.py")),
            config,
            run_dir=tmp_path / "run",
            discovery_backend="etcd",
            event_plane="nats",
            nodes=FAKE,
        )


@pytest.fixture
def nodes(tmp_path):
    made = Nodes.up(f"fx{os.getpid() % 100000}", path=tmp_path / "nodes.yaml")
    try:
        yield made
    finally:
        made.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made.switch not in listed and not any(n.netns in listed for n in made.nodes.values())


PLAN_IN_A = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from disagg_helpers import disagg_plan
from dynamo_flexkv.serve.nodes import Nodes
plan = disagg_plan(Path({tmp!r}), "disagg", *{placed!r}, discovery_backend="etcd", event_plane="nats",
                   nodes=Nodes.load({file!r}))
print(json.dumps({{"base_url": plan.base_url, "processes": [
    {{"name": p.name, "argv": p.argv, "env": p.env, "host": p.host, "metrics_url": p.metrics_url}}
    for p in plan.processes + plan.infra]}}))
"""


@needs_root
@pytest.mark.integration
def test_each_component_binds_and_advertises_its_nodes_address_and_reaches_etcd_and_nats_on_the_frontends(
    nodes, tmp_path
):
    with pytest.raises(GraphError, match=f"serve must run on the frontend's node A .*ip netns exec {nodes['A'].netns}"):
        disagg_plan(tmp_path, "disagg", *PLACED, discovery_backend="etcd", event_plane="nats", nodes=nodes)
    code = PLAN_IN_A.format(
        tests=str(ROOT / "tests"), tmp=str(tmp_path), placed=PLACED, file=str(tmp_path / "nodes.yaml")
    )
    p = subprocess.run(
        ["ip", "netns", "exec", nodes["A"].netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    plan = json.loads(p.stdout.splitlines()[-1])
    procs = {x["name"]: x for x in plan["processes"]}
    a, b, c = (nodes[n] for n in "ABC")
    assert plan["base_url"].startswith(f"http://{a.address}:")
    front = procs["Frontend"]
    assert front["argv"][:4] == ["ip", "netns", "exec", a.netns]
    assert front["argv"][front["argv"].index("--http-host") + 1] == a.address
    for name, node in (("PrefillWorker", b), ("DecodeWorker", c)):
        proc = procs[name]
        assert proc["argv"][:4] == ["ip", "netns", "exec", node.netns] and proc["host"] == node.address
        assert proc["metrics_url"].startswith(f"http://{node.address}:")
        for key in ("DYN_TCP_RPC_HOST", "DYN_SYSTEM_HOST", "DYN_EVENT_PLANE_HOST"):
            assert proc["env"][key] == node.address, key
        assert proc["env"]["UCX_TLS"] == "tcp" and proc["env"]["UCX_NET_DEVICES"] == "eth0"  # over the link
        assert proc["env"]["ETCD_ENDPOINTS"].startswith(f"http://{a.address}:")
        assert proc["env"]["NATS_SERVER"].startswith(f"nats://{a.address}:")
    for name in ("etcd", "nats"):
        assert procs[name]["host"] == a.address and procs[name]["argv"][:4] == ["ip", "netns", "exec", a.netns]
        assert "127.0.0.1" not in " ".join(procs[name]["argv"])


HINT_PLAN_IN_A = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from served import vplan
from dynamo_flexkv.serve.nodes import Nodes
plan = vplan(Path({tmp!r}), "Frontend.node=A", "VllmWorker.node=[A,B]", "VllmWorker.router-hints=true",
             discovery_backend="etcd", event_plane="nats", nodes=Nodes.load({file!r}))
print(json.dumps([p.argv for p in plan.workers]))
"""


@needs_root
@pytest.mark.integration
def test_router_hint_peers_reach_each_vllm_replica_at_its_own_nodes_address(nodes, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/install.sh")
    code = HINT_PLAN_IN_A.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), file=str(tmp_path / "nodes.yaml"))
    p = subprocess.run(
        ["ip", "netns", "exec", nodes["A"].netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    workers = json.loads(p.stdout.splitlines()[-1])
    assert len(workers) == 2
    for argv, node in zip(workers, (nodes["A"], nodes["B"])):  # VllmWorker.node=[A,B]: replica i on the i-th
        assert argv[:4] == ["ip", "netns", "exec", node.netns]
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert extra["secondary_tiers"][0]["control_advertise_host"] == node.address


@needs_root
@pytest.mark.integration
def test_nodes_up_refuses_names_it_could_not_keep_apart_and_leaves_nothing_behind(tmp_path):
    from dynamo_flexkv.serve.nodes import NodesError

    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for names, match in (
        (["A", "a"], "differ from the others in more than case"),
        (["a b"], "letters or digits"),
        (["sw"], "none may be 'sw'"),
        (["A", "A"], "differ from the others"),
    ):
        with pytest.raises(NodesError, match=match):
            Nodes.up("rvt", names, path=tmp_path / "n.yaml")
    with pytest.raises(OSError):  # the file cannot be written: refused before any namespace is made
        Nodes.up("rvt", ["A"], path=tmp_path / "missing" / "n.yaml")
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


@needs_root
@pytest.mark.integration
def test_nodes_reach_each_other_only_over_their_links_and_a_link_can_be_cut(nodes):
    def probe(src: str, dst: str) -> int:
        """1 when dst's stack answered (refused: nothing listens on port 9), 0 when nothing came back."""
        connect = f"exec 3<>/dev/tcp/{nodes[dst].address}/9"
        p = subprocess.run(
            ["ip", "netns", "exec", nodes[src].netns, "timeout", "2", "bash", "-c", connect],
            capture_output=True,
            text=True,
        )
        return int("Connection refused" in p.stderr)

    assert probe("A", "C") == 1  # reached C's stack (nothing listens on port 9): the link works
    route = subprocess.run(["ip", "-n", nodes["A"].netns, "route", "show", "default"], capture_output=True, text=True)
    assert route.stdout.strip() == ""  # no way off the bridge
    nodes.set_link("C", False)
    assert probe("A", "C") == 0  # timed out: C's cable is out
    nodes.set_link("C", True)
    assert probe("A", "C") == 1
    with pytest.raises(Exception, match="exist already"):
        Nodes.up(nodes.switch[:-3])


@needs_root
@pytest.mark.slow
@pytest.mark.served
def test_a_disagg_graph_over_three_nodes_serves_exact_tokens_moves_kv_over_the_link_and_survives_a_cut(nodes, tmp_path):
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    pytest.importorskip("nixl._api", reason="NIXL is installed by make install")
    out = tmp_path / "report.json"
    p = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            nodes["A"].netns,
            sys.executable,
            str(ROOT / "tests" / "nodes_scenario.py"),
            str(tmp_path / "nodes.yaml"),
            str(tmp_path),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(ROOT / "tests"),
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    r = json.loads(out.read_text())
    assert r["disagg"] == r["agg"]  # exact greedy tokens, prefilled on B, decoded on C
    assert r["prefill_computed"] > 0 and r["handover_bytes"] > 0
    assert r["c_rx_bytes"] >= r["handover_bytes"]  # the KV crossed C's link (UCX over TCP, not shared memory)
    assert r["after_restart"] == r["agg"][0]
    assert r["c_remote_tokens"] > 0  # B's prefix, loaded on C from the Redis Cluster spread over A, B, C
    assert all(h.startswith("redis://169.254.") for h in r["redis_masters"]) and len(set(r["redis_masters"])) == 3
    for name in ("C", "B"):  # requests while decode's, then prefill's cable was out: served or a clean
        down = r[f"link_down_{name}"]  # refusal within the bound, no hang; served again once it is back
        assert down["max_s"] <= 30 and set(down["statuses"]) <= {200, 404, 503}, (name, down)
        assert down["recovered_s"] is not None and down["recovered_s"] <= 120, (name, down)
    assert r["after_link"] == r["agg"][:4]
    codes = r["exit_codes"]
    assert {codes[n] for n in ("Frontend", "PrefillWorker", "DecodeWorker")} == {0}, codes
    assert all(codes[n] in (0, -signal.SIGINT) for n in ("etcd", "nats")), codes  # etcd re-raises the SIGINT it handled
    print(json.dumps({k: v for k, v in r.items() if k not in ("agg", "disagg", "after_link", "events")}))


def test_an_unknown_node_is_blamed_on_the_set_that_named_it(tmp_path, capsys):
    from dynamo_flexkv.cli import main

    path = tmp_path / "nodes.yaml"
    FAKE.save(path)
    argv = ["serve", str(ROOT / "graphs" / "disagg.py"), "-f", str(ROOT / "configs" / "disagg.yaml"), "--nodes"]
    argv += [str(path), "--discovery-backend", "etcd", "--event-plane", "nats"]
    for item in ("Frontend.node=A", "PrefillWorker.node=B", "DecodeWorker.node=D"):
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set DecodeWorker.node=D: node 'D' is not in the nodes file"), err
