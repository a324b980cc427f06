"""FlexKVConnector's kv_connector_extra_config: every key typed and checked at engine start, a bad
value refused with a message that names the key and what it accepts."""

from types import SimpleNamespace

import pytest

from dynamo_flexkv.integrations.vllm_connector.settings import ConnectorSettings


def vllm_config(tmp_path, **extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"run_dir": str(tmp_path), **extra},
                                           engine_id="e0"),
        cache_config=SimpleNamespace(block_size=16), parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(model="some/model", revision=None),
        load_config=SimpleNamespace(load_format="auto"))


def test_defaults_and_handover_verify(tmp_path):
    s = ConnectorSettings.from_vllm(vllm_config(tmp_path), None)
    assert s.handover is False and s.handover_verify == "owner" and s.block_size == 16
    s = ConnectorSettings.from_vllm(vllm_config(tmp_path, handover=True, handover_verify="bytes"), None)
    assert s.handover and s.handover_verify == "bytes"


@pytest.mark.parametrize("extra, message", [
    ({"handover_verify": "crc32"}, "handover_verify='crc32' must be 'bytes' or 'owner'"),
    ({"handover_verify": True}, "handover_verify=True must be a string"),
    ({"handover": "yes"}, "handover='yes' must be true or false"),
    ({"handover_lease_s": 0}, "handover_lease_s=0 must be a finite positive number"),
    ({"handover_verifi": "owner"}, r"unknown kv_connector_extra_config key\(s\) \['handover_verifi'\]"),
    ({"handover_lease_s": 1e9}, "handover_lease_s=1000000000.0 is over 3600 s"),
    ({"model_id": "  "}, "model_id='' names no weights"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_vllm(vllm_config(tmp_path, **extra), None)
