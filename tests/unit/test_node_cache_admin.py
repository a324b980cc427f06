"""Seeing and clearing what the node cache holds (dynamo-flexkv cache against a cache-server): per
tenant and model over its socket (protocol.Admin) and its HTTP port, a clear that engines hear
(the router forgets the blocks) and that misses after, and bad input refused naming the fix."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from node_helpers import BS, Engine, Held, node_server, prompt

from dynamo_flexkv.cache_server import serve_metrics
from dynamo_flexkv.core.inventory import HTTP_ROUTE, CacheRequest
from dynamo_flexkv.core.node.admin import AdminError, NodeAdmin
from dynamo_flexkv.core.node.connection import NodeRequestFailed
from dynamo_flexkv.core.node.protocol import ADMIN_VERSION, Admin, Reply, decode_to_engine, encode, frame_length
from dynamo_flexkv.core.sysutil import free_port

BLOCKS = list(range(40))


@pytest.fixture
def two_tenants(tmp_path):
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05, max_models=2) as server:
        path = server.options.socket_path
        held = Held()
        acme = Engine(path, "A", model_id="m1", tenant="acme", listener=held)
        bolt = Engine(path, "B", model_id="m2", tenant="bolt")
        a, b = prompt(1, 6 * BS + 3), prompt(2, 4 * BS)
        acme.store(a, BLOCKS)
        bolt.store(b, BLOCKS)
        assert acme.offload.drain(30) and bolt.offload.drain(30)
        yield server, path, acme, bolt, a, b, held
        acme.offload.shutdown()
        bolt.offload.shutdown()


def test_contents_per_tenant_and_model_over_the_socket(two_tenants):
    server, path, *_ = two_tenants
    with NodeAdmin(path) as admin:
        report = admin.request(CacheRequest())
        assert report.target.startswith("cache server pid")
        by_tenant = {c.tenant: c for c in report.contents}
        assert set(by_tenant) == {"acme", "bolt"}
        acme = by_tenant["acme"]
        assert acme.model_id == "m1" and acme.engines == 1
        assert [(t.tier, t.blocks, t.ready) for t in acme.tiers] == [("host", 6, 6), ("disk", 6, 6)]
        assert acme.tiers[0].bytes == 6 * acme.tiers[0].block_bytes and acme.tiers[0].oldest_s is not None
        only = admin.request(CacheRequest(tenant="bolt", tiers=["disk"]))
        assert [(c.tenant, [(t.tier, t.blocks) for t in c.tiers]) for c in only.contents] == [("bolt", [("disk", 4)])]
        assert [c.model_id for c in admin.request(CacheRequest(model="m1")).contents] == ["m1"]
    # The operator's connection is no engine: the metrics count the two that attached.
    assert len(server.stats()["engines"]) == 2


def test_prefix_blocks_by_token_ids(two_tenants):
    _, path, _, _, a, _, _ = two_tenants
    with NodeAdmin(path) as admin:
        report = admin.request(CacheRequest(op="prefix", tenant="acme", tokens=a + prompt(9, 2 * BS)))
        (p,) = report.prefixes
        assert p.tenant == "acme" and len(p.hashes) == 8
        assert p.held == {"host": 6, "disk": 6}
        assert p.runs() == [(0, 6, ["host", "disk"]), (6, 8, [])]
        with pytest.raises(AdminError, match="no tokenizer: send token ids"):
            admin.request(CacheRequest(op="prefix", text="hello"))


def test_a_clear_of_one_tenant_leaves_the_other_and_its_engine_misses_after(two_tenants):
    server, path, acme, bolt, a, b, held = two_tenants
    assert held.prefix(["host"], acme.offload.block_hashes(a)) == 6  # the router was told of them
    with NodeAdmin(path) as admin:
        report = admin.request(CacheRequest(op="clear", tenant="acme"))
        (done,) = report.cleared
        assert done.tenant == "acme" and done.note is None
        assert [(t.tier, t.cleared, t.kept) for t in done.tiers] == [("host", 6, {}), ("disk", 6, {})]
        after = {c.tenant: {t.tier: t.blocks for t in c.tiers} for c in admin.request(CacheRequest()).contents}
    assert after == {"acme": {"host": 0, "disk": 0}, "bolt": {"host": 4, "disk": 4}}
    assert acme.offload.cached_tokens(a) == 0  # the next request misses
    assert bolt.load(b, BLOCKS[:4]) == 4 and bolt.check(b, BLOCKS[:4], 0, 4) == []
    assert held.prefix(["host", "disk"], acme.offload.block_hashes(a)) == 0  # and the router forgot them
    stats = acme.offload.stats()
    assert stats.host.removed_blocks == {"cleared": 6} and stats.disk.removed_blocks == {"cleared": 6}


def test_an_attached_engine_clears_only_its_own_namespace(two_tenants):
    _, path, acme, bolt, a, b, _ = two_tenants
    with pytest.raises(NodeRequestFailed, match="this target holds no namespace of tenant 'bolt'; it holds model 'm1'"):
        acme.offload.cache_admin(CacheRequest(op="clear", tenant="bolt"))
    report = acme.offload.cache_admin(CacheRequest(op="clear", tiers=["host"]))
    assert [(c.tenant, [(t.tier, t.cleared) for t in c.tiers]) for c in report.cleared] == [("acme", [("host", 6)])]
    with NodeAdmin(path) as admin:
        (p,) = admin.request(CacheRequest(op="prefix", tenant="acme", tokens=a)).prefixes
        (q,) = admin.request(CacheRequest(op="prefix", tenant="bolt", tokens=b)).prefixes
    assert p.held == {"host": 0, "disk": 6} and q.held == {"host": 4, "disk": 4}


def test_bad_requests_name_the_fix(two_tenants):
    _, path, *_ = two_tenants
    with NodeAdmin(path) as admin:
        with pytest.raises(AdminError, match=r"no namespace of tenant 'nobody'; it holds model 'm1' tenant 'acme'"):
            admin.request(CacheRequest(tenant="nobody"))
        with pytest.raises(
            AdminError, match=r"tier 'device': this target has no device tier \(its tiers: host, disk\)"
        ):
            admin.request(CacheRequest(op="clear", tiers=["device"]))
        with pytest.raises(AdminError, match="tier 'ssd' is not a tier"):
            admin.request(CacheRequest(op="clear", tiers=["ssd"]))
    with pytest.raises(AdminError, match="no cache server socket at .*: start one"):
        NodeAdmin(path + ".missing")


def test_another_admin_version_is_refused_naming_both(two_tenants):
    _, path, *_ = two_tenants
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(encode(Admin(id=7, version=ADMIN_VERSION + 1, op="contents")))
        header = s.recv(4, socket.MSG_WAITALL)
        reply = decode_to_engine(s.recv(frame_length(header), socket.MSG_WAITALL))
    assert isinstance(reply, Reply) and reply.id == 7 and reply.kind == "refused"
    assert f"admin protocol version {ADMIN_VERSION + 1}; this cache server speaks {ADMIN_VERSION}" in reply.error


def test_the_same_over_http_on_the_metrics_port(two_tenants):
    server, _, acme, _, a, _, _ = two_tenants
    port = free_port()
    http = serve_metrics(server, "127.0.0.1", port)
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}{HTTP_ROUTE}?tenant=bolt", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "ok"
        assert [c["tenant"] for c in body["report"]["contents"]] == ["bolt"]
        req = urllib.request.Request(
            base + HTTP_ROUTE, json.dumps({"op": "clear", "tenant": "acme", "tiers": ["disk"]}).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            cleared = json.loads(r.read())["report"]["cleared"]
        assert [(t["tier"], t["cleared"]) for t in cleared[0]["tiers"]] == [("disk", 6)]
        bad = urllib.request.Request(base + HTTP_ROUTE, json.dumps({"op": "wipe"}).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=10)
        assert e.value.code == 400 and "op 'wipe' is not one of contents, prefix, clear" in e.value.read().decode()
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:  # the metrics stay where they were
            page = r.read().decode()
        assert 'flexkv_removed_blocks_total{model="m1",reason="cleared",source="node",tier="disk"} 6.0' in page
    finally:
        http.shutdown()
