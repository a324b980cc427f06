"""Dynamo router hints in FlexKVConnector (vllm_connector/hints.py): the secondary_tiers entry that
turns them on is checked as dynamo.vllm reads it; a request's kv.fetch hint is used only for the
leading blocks whose hashes are this request's own; and a worker's hinted pull (two real
KVManagers over NIXL) counts what it saw, used and why it failed, as the metrics report them."""

from __future__ import annotations

import pytest

from dynamo_flexkv.integrations.vllm_connector.hints import (
    HintRefused,
    HintTier,
    fetch_hint,
    parse_secondary_tiers,
    router_hash,
)
from dynamo_flexkv.integrations.vllm_connector.settings import checked_extra_config

TIER = {"router_capabilities": ["router_hint"], "control_ports": [7301, 7302], "control_advertise_host": "127.0.0.1"}


@pytest.mark.unit
def test_the_router_hint_tier_is_accepted_and_names_its_port_per_local_dp_rank():
    got = checked_extra_config({"secondary_tiers": [TIER]})["secondary_tiers"]
    assert got == HintTier((7301, 7302), "127.0.0.1", "127.0.0.1")
    assert (got.port(0), got.port(1)) == (7301, 7302)
    with pytest.raises(ValueError, match="one port per local DP rank"):
        got.port(2)
    assert parse_secondary_tiers([]) is None
    bound = parse_secondary_tiers([dict(TIER, control_bind_host="0.0.0.0", lease_s=5)])
    assert bound is not None and (bound.bind_host, bound.lease_s) == ("0.0.0.0", 5.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "tiers, why",
    [
        ({"router_capabilities": ["router_hint"]}, "must be a list"),
        ([TIER, TIER], "exactly one mapping"),
        ([dict(TIER, router_capabilities=["kv.other"])], "router_capabilities"),
        ([dict(TIER, control_ports=[0])], "control_ports"),
        ([dict(TIER, control_ports="7301")], "control_ports"),
        ([dict(TIER, control_advertise_host="0.0.0.0")], "not an address a peer can reach"),
        ([dict(TIER, control_advertise_host="::")], "not an address a peer can reach"),
        ([{k: v for k, v in TIER.items() if k != "control_advertise_host"}], "control_advertise_host"),
        ([dict(TIER, lease_s=0)], "lease_s"),
        ([dict(TIER, typo=1)], "unknown key"),
    ],
)
def test_a_wrong_router_hint_tier_is_refused_naming_what_is_wrong(tiers, why):
    with pytest.raises(ValueError, match=why):
        checked_extra_config({"secondary_tiers": tiers})


def envelope(hashes, endpoint="tcp://127.0.0.1:7301", version="0.1", action_version="1.0"):
    return {
        "protocol_version": version,
        "message_id": "m1",
        "actions": [
            {
                "action_id": "a1",
                "action_type": "kv.fetch",
                "action_version": action_version,
                "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes},
            }
        ],
    }


@pytest.mark.unit
def test_a_hint_counts_only_the_leading_blocks_that_are_this_requests():
    ours = [bytes([i]) * 32 for i in range(1, 9)]  # vLLM's block hashes (sha256 bytes)
    theirs = [router_hash(h) for h in ours]
    assert theirs[0] == int.from_bytes(ours[0], "big") & (2**64 - 1)
    assert fetch_hint(envelope(theirs), ours).blocks == 8
    assert fetch_hint(envelope(theirs[:5] + [1, 2, 3]), ours).blocks == 5  # diverges at block 5
    assert fetch_hint(envelope(theirs + [7, 7]), ours).blocks == 8  # longer than the request
    assert fetch_hint(None, ours) is None
    assert fetch_hint({"protocol_version": "0.1", "message_id": "x", "actions": []}, ours) is None
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # what dynamo.vllm hands vLLM

    env = KvHintsEnvelope(
        "0.1",
        "m",
        [KvHintAction("a1", "kv.fetch", "1.0", {"source_control_endpoint": "tcp://h:1", "block_hashes": theirs})],
    )
    got = fetch_hint(env, ours)
    assert (got.endpoint, got.blocks) == ("tcp://h:1", 8)


@pytest.mark.unit
@pytest.mark.parametrize(
    "hint, why",
    [
        (envelope([1], version="0.2"), "version"),
        (envelope([1], action_version="2.0"), "version"),
        (envelope([1], endpoint="h:1"), "malformed"),
        (envelope(["1"]), "malformed"),
        (envelope([True]), "malformed"),
        (envelope(list(range(70000))), "oversized"),
        (envelope([12345]), "foreign"),
        ({"protocol_version": "0.1", "actions": "x"}, "malformed"),
    ],
)
def test_a_hint_this_worker_cannot_use_is_refused_with_its_reason(hint, why):
    with pytest.raises(HintRefused) as e:
        fetch_hint(hint, [bytes(32)])
    assert e.value.reason == why


nixl = pytest.importorskip("nixl._api", reason="NIXL is installed by make install")


@pytest.mark.integration
def test_a_workers_hinted_pull_counts_seen_used_failed_and_pinned(tmp_path, monkeypatch):
    from kv_helpers import MODEL, config, device_tensors, fill
    from served import wait_until

    from dynamo_flexkv import KVLayoutType, KVManager
    from dynamo_flexkv.core.offload import EmbeddedOffload
    from dynamo_flexkv.integrations.vllm_connector.hints import FetchHint, WorkerHints

    tier = parse_secondary_tiers([TIER])  # bound to any free port below (port 0)
    with pytest.raises(ValueError, match="FLEXKV_HANDOVER_SECRET"):
        WorkerHints(None, tier, 0, None)
    layout = KVLayoutType.LAYERBLOCK
    kvs = [KVManager(MODEL, config(tmp_path / n, host_blocks=32, disk_blocks=0), model_id="m") for n in "ab"]
    hints = []
    try:
        dev = device_tensors(layout, 32)
        kvs[0].register_device_cache(dev, layout)
        tokens = list(range(16 * 12))
        for i, h in enumerate(kvs[0].hashes(tokens).sequence):
            fill(dev, layout, i, int(h))
        kvs[0].wait([kvs[0].put_async(tokens, list(range(12)))])
        hints = [WorkerHints(EmbeddedOffload(kv), tier, 0, b"s") for kv in kvs]
        src, dst = hints
        assert dst.pull(FetchHint(src.link.endpoint, 8), tokens, None, None, 16).blocks == 8
        assert kvs[1].match(tokens)["host"] == 8 * 16
        assert dst.pull(FetchHint("tcp://127.0.0.1:1", 12), tokens, None, None, 16).blocks == 0  # nobody there
        totals = dst.totals()
        assert totals["hints_used"] == 1 and totals["hint_pulled_tokens"] == 128
        assert totals["hints_failed/source_gone"] == 1
        assert src.totals()["peer_pins"] == 1
        # The receiver's Release reaches the source's connection thread after the pull returns.
        wait_until("the pin's release", lambda: src.gauges() == {"gauge:peer_pinned_blocks": 0}, timeout=10)
    finally:
        for h in hints:
            h.close()
        for kv in kvs:
            kv.shutdown()


# ---- serve's configuration: VllmWorker.router-hints ---------------------------------------------------


def _tiers(worker) -> list:
    import json

    argv = worker.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"].get(
        "secondary_tiers", []
    )


@pytest.mark.unit
def test_serve_turns_router_hints_on_with_a_control_port_each_and_one_graph_secret(tmp_path):
    from served import vplan

    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV

    p = vplan(tmp_path, "VllmWorker.router-hints=true")
    w0, w1 = p.workers
    t0, t1 = _tiers(w0), _tiers(w1)
    # As the connector and dynamo.vllm read it: one tier, loopback, one port per local DP rank.
    assert checked_extra_config({"secondary_tiers": t0})["secondary_tiers"].advertise_host == "127.0.0.1"
    assert len(t0[0]["control_ports"]) == len(t1[0]["control_ports"]) == 1
    assert t0[0]["control_ports"] != t1[0]["control_ports"]
    assert w0.env[SECRET_ENV] == w1.env[SECRET_ENV] and len(w0.env[SECRET_ENV]) == 64
    assert SECRET_ENV not in p.processes[0].env  # the frontend does not pull

    dp = vplan(tmp_path, "VllmWorker.router-hints=true", "VllmWorker.data-parallel-size=2", "VllmWorker.replicas=1")
    ports = _tiers(dp.workers[0])[0]["control_ports"]
    assert len(ports) == 2 and ports[1] == ports[0] + 1

    off = vplan(tmp_path)  # the default: no tier, no secret
    assert all(_tiers(w) == [] and SECRET_ENV not in w.env for w in off.workers)


@pytest.mark.unit
@pytest.mark.parametrize(
    "sets, why",
    [
        (["VllmWorker.offload=false"], "offload is false"),
        (["VllmWorker.tensor-parallel-size=2"], "tensor-parallel-size=2"),
        (["VllmWorker.disaggregation-mode=prefill"], "disaggregation-mode='prefill'"),
        (["VllmWorker.connector={secondary_tiers: []}"], "set VllmWorker.router-hints: true instead"),
    ],
)
def test_serve_refuses_router_hints_where_they_cannot_run(tmp_path, sets, why):
    from served import vplan

    from dynamo_flexkv.serve import GraphError

    with pytest.raises(GraphError, match=why):
        vplan(tmp_path, "VllmWorker.router-hints=true", *sets)


@pytest.mark.unit
def test_render_k8s_advertises_the_pod_address_and_takes_the_secret_from_a_secret(tmp_path):
    import yaml
    from served import vplan

    from dynamo_flexkv.integrations.disagg.params import SECRET_ENV
    from dynamo_flexkv.serve.render import render_k8s

    text = render_k8s(vplan(tmp_path, "VllmWorker.router-hints=true", local=False), "img")
    doc = yaml.safe_load(text)
    svc = doc["spec"]["services"]["VllmWorker"]
    args = svc["extraPodSpec"]["mainContainer"]["args"]
    import json

    tier = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["secondary_tiers"]
    assert tier == [
        {"router_capabilities": ["router_hint"], "control_ports": [7301], "control_advertise_host": "$(POD_IP)"}
    ]
    env = {e["name"]: e for e in svc["envs"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # Kubernetes expands $(POD_IP)
    name = doc["metadata"]["name"]
    assert env[SECRET_ENV]["valueFrom"] == {"secretKeyRef": {"name": f"{name}-handover", "key": "secret"}}
    assert f"kubectl create secret generic {name}-handover" in text
