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

FAKE = Nodes("t-sw", {n: Node(n, f"t-{n.lower()}", f"169.254.9.{i + 1}", f"fd00:9::{i + 1}")
                      for i, n in enumerate("ABC")})
PLACED = ("Frontend.node=A", "PrefillWorker.node=B", "DecodeWorker.node=C")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_each_component_binds_and_advertises_its_nodes_address_and_reaches_etcd_and_nats_on_the_frontends(tmp_path):
    plan = disagg_plan(tmp_path, "disagg", *PLACED, discovery_backend="etcd", event_plane="nats", nodes=FAKE)
    front, prefill, decode = plan.processes
    assert plan.base_url == f"http://169.254.9.1:{plan.http_port}"
    assert front.argv[:4] == ["ip", "netns", "exec", "t-a"]
    assert front.argv[front.argv.index("--http-host") + 1] == "169.254.9.1"
    for proc, ns, addr in ((prefill, "t-b", "169.254.9.2"), (decode, "t-c", "169.254.9.3")):
        assert proc.argv[:4] == ["ip", "netns", "exec", ns] and proc.host == addr
        assert proc.metrics_url == f"http://{addr}:{proc.port}/metrics"
        for key in ("DYN_TCP_RPC_HOST", "DYN_SYSTEM_HOST", "DYN_EVENT_PLANE_HOST"):
            assert proc.env[key] == addr, key
        assert proc.env["UCX_TLS"] == "tcp" and proc.env["UCX_NET_DEVICES"] == "eth0"  # over the link
        assert proc.env["ETCD_ENDPOINTS"].startswith("http://169.254.9.1:")
        assert proc.env["NATS_SERVER"].startswith("nats://169.254.9.1:")
    etcd, nats = plan.infra
    assert etcd.host == nats.host == "169.254.9.1" and etcd.argv[:4] == ["ip", "netns", "exec", "t-a"]
    assert "127.0.0.1" not in " ".join(etcd.argv + nats.argv)


def test_a_placement_serve_cannot_honour_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(GraphError, match="--discovery-backend etcd --event-plane nats"):
        disagg_plan(tmp_path, "disagg", *PLACED, nodes=FAKE)
    with pytest.raises(GraphError, match=r"PrefillWorker.node='B' needs serve --nodes FILE"):
        disagg_plan(tmp_path, "disagg", "PrefillWorker.node=B")
    with pytest.raises(GraphError, match=r"node 'D' is not in the nodes file \(it has \['A', 'B', 'C'\]\)"):
        disagg_plan(tmp_path, "disagg", "DecodeWorker.node=D", discovery_backend="etcd", event_plane="nats",
                    nodes=FAKE)
    with pytest.raises(GraphError, match="remote_cache_url every node reaches"):
        disagg_plan(tmp_path, "disagg", *PLACED, "DecodeWorker.cache.enable_remote=true",
                    discovery_backend="etcd", event_plane="nats", nodes=FAKE)
    bad = tmp_path / "nodes.yaml"
    bad.write_text("nodes: [A, B]\n")
    with pytest.raises(GraphError, match="not a nodes file written by `dynamo-flexkv nodes up`"):
        Nodes.load(str(bad))


@pytest.fixture
def nodes(tmp_path):
    made = Nodes.up(f"fx{os.getpid() % 100000}")
    made.save(tmp_path / "nodes.yaml")
    try:
        yield made
    finally:
        made.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made.switch not in listed and not any(n.netns in listed for n in made.nodes.values())


@needs_root
def test_nodes_reach_each_other_only_over_their_links_and_a_link_can_be_cut(nodes):
    def probe(src: str, dst: str) -> int:
        """1 when dst's stack answered (refused: nothing listens on port 9), 0 when nothing came back."""
        connect = f"exec 3<>/dev/tcp/{nodes[dst].address}/9"
        p = subprocess.run(["ip", "netns", "exec", nodes[src].netns, "timeout", "2", "bash", "-c", connect],
                           capture_output=True, text=True)
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
def test_a_disagg_graph_over_three_nodes_serves_exact_tokens_moves_kv_over_the_link_and_survives_a_cut(nodes, tmp_path):
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo is installed by make test")
    pytest.importorskip("nixl._api", reason="NIXL is installed by make install")
    out = tmp_path / "report.json"
    p = subprocess.run(["ip", "netns", "exec", nodes["A"].netns, sys.executable, str(ROOT / "tests" / "nodes_scenario.py"),
                        str(tmp_path / "nodes.yaml"), str(tmp_path), str(out)],
                       capture_output=True, text=True, timeout=900, cwd=str(ROOT / "tests"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    r = json.loads(out.read_text())
    assert r["disagg"] == r["agg"]  # exact greedy tokens, prefilled on B, decoded on C
    assert r["prefill_computed"] > 0 and r["handover_bytes"] > 0
    assert r["c_rx_bytes"] >= r["handover_bytes"]  # the KV crossed C's link (UCX over TCP, not shared memory)
    assert r["after_restart"] == r["agg"][0]
    assert r["c_remote_tokens"] > 0  # B's prefix, loaded on C from the Redis Cluster spread over A, B, C
    assert all(h.startswith("redis://169.254.") for h in r["redis_masters"]) and len(set(r["redis_masters"])) == 3
    down = r["link_down"]  # requests while C's cable was out: a clean refusal within the bound, no hang
    assert down["max_s"] <= 30 and set(down["statuses"]) <= {200, 404, 503}, down
    assert r["recovered_s"] is not None and r["recovered_s"] <= 120, r
    assert r["after_link"] == r["agg"][:4]
    codes = r["exit_codes"]
    assert {codes[n] for n in ("Frontend", "PrefillWorker", "DecodeWorker")} == {0}, codes
    assert all(codes[n] in (0, -signal.SIGINT) for n in ("etcd", "nats")), codes  # etcd re-raises the SIGINT it handled
    print(json.dumps({k: v for k, v in r.items() if k not in ("agg", "disagg", "after_link", "events")}))
