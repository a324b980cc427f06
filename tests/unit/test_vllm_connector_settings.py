"""FlexKVConnector's kv_connector_extra_config: every key typed and checked at engine start, a bad
value refused with a message that names the key and what it accepts."""

from types import SimpleNamespace

import pytest

from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings


def vllm_config(tmp_path, **extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"run_dir": str(tmp_path), **extra}, engine_id="e0"
        ),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="some/model", revision=None),
        load_config=SimpleNamespace(load_format="auto"),
    )


def test_defaults_and_handover_verify(tmp_path):
    s = ConnectorSettings.from_vllm(vllm_config(tmp_path), None)
    assert s.handover is False and s.handover_verify == "owner" and s.block_size == 16
    s = ConnectorSettings.from_vllm(vllm_config(tmp_path, handover=True, handover_verify="bytes"), None)
    assert s.handover and s.handover_verify == "bytes"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"handover_verify": "crc32"}, "handover_verify='crc32' must be 'bytes' or 'owner'"),
        ({"handover_verify": True}, "handover_verify=True must be a string"),
        ({"handover": "yes"}, "handover='yes' must be true or false"),
        ({"handover_lease_s": 0}, "handover_lease_s=0 must be a finite positive number"),
        ({"handover_verifi": "owner"}, r"unknown kv_connector_extra_config key\(s\) \['handover_verifi'\]"),
        ({"handover_lease_s": 1e9}, "handover_lease_s=1000000000.0 is over 3600 s"),
        ({"model_id": "  "}, "model_id='' names no weights"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_vllm(vllm_config(tmp_path, **extra), None)


def test_the_installed_vllm_has_every_field_the_connector_reads_and_a_renamed_one_fails_clearly(monkeypatch):
    from dynamo_flexkv.integrations.vllm_connector import vllm_api

    assert vllm_api.missing() == []
    monkeypatch.setattr(vllm_api, "REQUEST", vllm_api.REQUEST + ("block_hashes_v2",))
    key = ("vllm.v1.core.sched.output", "SchedulerOutput")
    monkeypatch.setitem(vllm_api.FIELDS, key, vllm_api.FIELDS[key] + ("scheduled_spec_reqs",))
    with pytest.raises(
        RuntimeError,
        match=r"lacks Request.block_hashes_v2, SchedulerOutput.scheduled_spec_reqs, "
        r"which the connector reads .* install vllm==0.31.0",
    ):
        vllm_api.check()


def test_a_pipeline_parallel_engine_is_refused_at_connector_start_naming_the_setting_and_the_fix(tmp_path):
    """vLLM's own config, through the connector's constructor: the tiers, disk paths, lookup
    socket and remote fingerprint carry no pipeline stage, so stages would load each other's layers."""
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from dynamo_flexkv.integrations.vllm_connector import FlexKVConnector

    config = VllmConfig(
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FlexKVConnector",
            kv_connector_module_path="dynamo_flexkv.integrations.vllm_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"run_dir": str(tmp_path)},
        ),
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as e:
            FlexKVConnector(config, role, None)
        msg = str(e.value)
        assert "does not support pipeline parallelism" in msg and "pipeline_parallel_size=2" in msg, msg
        assert "run with --pipeline-parallel-size 1" in msg, msg
