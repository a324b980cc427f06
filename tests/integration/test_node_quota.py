"""Quotas per tenant on the node cache service (core/node/quota.py, docs/NODE_CACHE.md): the
configured sizes are the node's budget, each tenant's namespace gets tiers of its quota, and a
tenant that floods the service evicts only its own blocks: another tenant's stay resident and load
bit-exact. Bad quotas are refused with a message naming the flag and the fix."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from node_helpers import BS, SPEC, Engine, node_server, prompt, server_config
from repo_paths import ROOT
from served import scrape, total, wait_until

from dynamo_flexkv.cache_server import serve_metrics
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.node.quota import Quota, TenantQuotas
from dynamo_flexkv.core.sysutil import free_port

GiB = 1 << 30
BLOCK = SPEC.num_layers * 2 * SPEC.num_kv_heads * SPEC.head_size * BS * 4  # float32 K and V of one block


def quotas(default=None, **tenants: str) -> TenantQuotas:
    parsed = TenantQuotas.parse(default, [f"{t}={q}" for t, q in tenants.items()])
    assert parsed is not None
    return parsed


def test_a_flooding_tenant_leaves_another_tenants_blocks_resident_and_stays_within_its_quota(tmp_path):
    # Budget 0.02 GB host, 0.05 GB disk; acme 2 MiB host + 4 MiB disk (~64 + 128 blocks), bolt more.
    q = quotas(acme="0.002:0.004", bolt="0.006:0.012")
    with node_server(tmp_path, host_gb=0.02, ssd_gb=0.05, max_models=2, quotas=q) as server:
        port = free_port()
        metrics = serve_metrics(server, "127.0.0.1", port)
        try:
            path = server.options.socket_path
            acme, bolt = Engine(path, "A", tenant="acme"), Engine(path, "B", tenant="bolt")
            kept = prompt(1, 100 * BS)  # 100 blocks: within bolt's host quota
            bolt.store(kept, list(range(100)))
            quota_host, quota_disk = int(0.002 * GiB), int(0.004 * GiB)
            for i in range(12):  # 12 x 100 blocks: about 19 times acme's host quota, 9 times its disk
                acme.store(prompt(100 + i, 100 * BS), list(range(100)), key=f"flood{i}")
                assert acme.offload.drain(30)
                page = scrape(port)
                host = total(page, "flexkv_node_tenant_used_bytes", tenant="acme", tier="host")
                disk = total(page, "flexkv_node_tenant_used_bytes", tenant="acme", tier="disk")
                assert 0 < host <= quota_host and 0 < disk <= quota_disk, (i, host, disk)
            page = scrape(port)
            assert total(page, "flexkv_node_tenant_quota_bytes", tenant="acme", tier="host") == quota_host
            assert total(page, "flexkv_node_tenant_quota_bytes", tenant="bolt", tier="disk") == int(0.012 * GiB)
            # acme filled its quota (block-rounded) and no more; bolt lost nothing.
            assert quota_host - BLOCK < total(page, "flexkv_node_tenant_used_bytes", tenant="acme", tier="host")
            assert total(page, "flexkv_node_tenant_used_bytes", tenant="bolt", tier="host") == 100 * BLOCK
            assert bolt.load(kept, list(range(100))) == 100
            assert bolt.check(kept, list(range(100)), 0, 100) == []
            bolt_tiers = bolt.offload.stats()
            assert bolt_tiers.host.hit_blocks == 100 and bolt_tiers.host.evicted_blocks == 0
            for e in (acme, bolt):
                e.offload.shutdown()
        finally:
            metrics.shutdown()


def test_quotas_are_reserved_and_a_tenant_without_one_is_refused(tmp_path, caplog):
    """Named quotas are the tenants' own; default-quota tenants take what the budget has left; a
    tenant with no quota, or a second model of a tenant, is refused with the flag to set."""
    q = quotas("0.004", acme="0.01")  # budget 0.02: acme 0.01 reserved, room for two default tenants
    caplog.set_level(logging.WARNING)
    with node_server(tmp_path, host_gb=0.02, max_models=8, quotas=q) as server:
        path = server.options.socket_path
        engines = [Engine(path, name, tenant=name) for name in ("acme", "d1", "d2")]
        tokens = prompt(7, 4 * BS)
        for e in engines:
            e.store(tokens, list(range(4)))
        sizes = {ns.tenant: ns.kv.host.nbytes for ns in server.namespaces()}
        assert sizes == {"acme": 0.01 * GiB // BLOCK * BLOCK, "d1": 0.004 * GiB // BLOCK * BLOCK, "d2": sizes["d2"]}
        refused = server.stats()["refused"]
        third = Engine(path, "d3", tenant="d3")  # 0.01 + 3 x 0.004 > 0.02
        other_model = Engine(path, "acme2", model_id="another", tenant="acme")
        wait_until("both refused", lambda: server.stats()["refused"] >= refused + 2)
        text = caplog.text
        assert "tenant 'd3' would get --default-quota 0.004:0:0, but the node's host budget cpu_cache_gb=0.02" in text
        assert "raise cpu_cache_gb, lower --default-quota" in text
        assert "tenant 'acme''s quota (0.01:0:0 GB host:disk:remote) is held by its model 'm'" in text
        assert len(server.namespaces()) == 3
        for e in (*engines, third, other_model):
            e.offload.shutdown()
    with node_server(tmp_path, quotas=quotas(acme="0.01")) as server:
        caplog.clear()
        nobody = Engine(server.options.socket_path, "N")  # no tenant, no --default-quota
        wait_until("refused", lambda: server.stats()["refused"] >= 1)
        assert "an engine without a tenant has no quota on this cache server: give it one with --tenant-quota" in (
            caplog.text
        )
        nobody.offload.shutdown()


@pytest.mark.parametrize(
    "default, tenants, words",
    [
        (None, ["acme"], "--tenant-quota 'acme': expected TENANT=HOST_GB[:DISK_GB[:REMOTE_GB]]"),
        (None, ["acme=x"], "HOST_GB 'x' is not a number of GB"),
        (None, ["acme=0"], "HOST_GB must be > 0"),
        (None, ["acme=1:0.5"], "DISK_GB=0.5 is smaller than HOST_GB=1"),
        (None, ["acme=1:2:3:4"], "expected HOST_GB[:DISK_GB[:REMOTE_GB]]"),
        (None, ["acme=1", "acme=2"], "names tenant 'acme' twice"),
        (None, ["a b=1"], "the tenant name must be 1 to 256 characters without '=' or spaces"),
        ("-1", [], "--default-quota '-1': HOST_GB=-1 must be a finite number >= 0"),
        ("nan", [], "must be a finite number >= 0"),
    ],
)
def test_bad_quotas_name_the_flag_and_the_fix(default, tenants, words):
    with pytest.raises(ConfigError) as e:
        TenantQuotas.parse(default, tenants)
    assert words in str(e.value)


def test_quotas_past_the_budget_are_refused_at_start(tmp_path):
    config = server_config(tmp_path, host_gb=0.02, ssd_gb=0.05)
    for q, words in (
        (quotas(a="0.015", b="0.01"), "the --tenant-quota host quotas sum to 0.025 GB, more than the node's host "),
        (quotas(a="0.03"), "host 0.03 GB is more than the node's host budget cpu_cache_gb=0.02"),
        (quotas("0.01:0.06"), "--default-quota 0.01:0.06:0: disk 0.06 GB is more than"),
        (quotas(a="0.01:0:1"), "REMOTE_GB=1 but the remote tier is off"),
    ):
        with pytest.raises(ConfigError) as e:
            q.check(config)
        assert words in str(e.value)
    with pytest.raises(ConfigError, match="DISK_GB=0.02 but the server has no disk tier"):
        quotas(a="0.01:0.02").check(server_config(tmp_path, host_gb=0.02))
    assert quotas("1:2:3", acme="4").argv() == ["--default-quota", "1:2:3", "--tenant-quota", "acme=4:0:0"]
    assert TenantQuotas.parse(None, []) is None
    assert Quota(1, 2).bytes() == {"host": GiB, "disk": 2 * GiB, "remote": 0}


def test_cache_server_refuses_a_bad_quota_with_the_flag_and_names_the_options_in_help(tmp_path):
    run = [sys.executable, "-m", "dynamo_flexkv.cli", "cache-server", "--socket", str(tmp_path / "s" / "n.sock")]
    bad = subprocess.run(
        [*run, "--set", "cpu_cache_gb=0.02", "--tenant-quota", "acme=0.5"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert "error: --tenant-quota acme=0.5:0:0: host 0.5 GB is more than the node's host budget" in bad.stderr
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert "--tenant-quota TENANT=HOST_GB[:DISK_GB[:REMOTE_GB]]" in helped.stdout
    assert "--default-quota HOST_GB[:DISK_GB[:REMOTE_GB]]" in helped.stdout


def test_a_serve_graphs_node_cache_quotas_become_the_servers_flags_and_bad_ones_are_refused(tmp_path):
    from dynamo_flexkv.serve import GraphError, load_graph
    from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

    def plan(quotas: str):
        config = apply_overrides(
            load_config(str(ROOT / "configs" / "agg_router.yaml")),
            [
                "Common.model=tiny",
                "FlexKVWorker.cache={mode: node}",
                f"NodeCache.cache={{cpu_cache_gb: 0.02, ssd_cache_gb: 0.05, ssd_cache_dir: {tmp_path}/ssd}}",
                f"NodeCache.quotas={quotas}",
            ],
        )
        graph = load_graph(str(ROOT / "graphs" / "agg_router.py"))
        return build_plan(graph, config, run_dir=tmp_path / "run", source="agg_router.yaml")

    p = plan("{default: {host_gb: 0.004}, tenants: {acme: {host_gb: 0.01, disk_gb: 0.02}}}")
    argv = next(proc for proc in p.processes if proc.name == "NodeCache").argv
    assert argv[argv.index("--default-quota") :] == [
        "--default-quota",
        "0.004:0:0",
        "--tenant-quota",
        "acme=0.01:0.02:0",
    ]
    for quotas, words in (
        ("{tenants: {acme: 4:32}}", "tenants.acme=272: write a mapping, e.g. {host_gb: 4, disk_gb: 32, remote_gb: 0}"),
        ("{tenants: {acme: {host_gb: 1}}}", "NodeCache.quotas: --tenant-quota acme=1:0:0: host 1 GB is more than"),
        ("{defaults: {host_gb: 1}}", "unknown key(s) ['defaults']: use default and tenants"),
    ):
        with pytest.raises(GraphError) as e:
            plan(quotas)
        assert words in str(e.value), str(e.value)


def test_tensor_parallel_shards_split_their_tenants_quota_and_key_the_remote_tier_apart(tmp_path):
    """Each shard of a TP=2 model gets half its tenant's quota, and its own tp_rank/tp_size: the
    remote tier's key fingerprint covers them, so rank 1 never reads rank 0's bytes."""
    with node_server(tmp_path, host_gb=0.02, quotas=quotas(acme="0.008")) as server:
        path = server.options.socket_path
        shards = [Engine(path, "E", tenant="acme", rank=r, ranks=2) for r in range(2)]
        wait_until("both shards attached", lambda: len(server.namespaces()) == 2, timeout=30)
        configs = sorted(
            (ns.kv.config.tp_rank, ns.kv.config.tp_size, ns.kv.config.cpu_cache_gb) for ns in server.namespaces()
        )
        assert configs == [(0, 2, 0.004), (1, 2, 0.004)]
        for e in shards:
            e.offload.shutdown()
