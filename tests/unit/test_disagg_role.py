"""What each role does with a request before the engine sees it (dynamo_flexkv.integrations.disagg.dynamo_handlers)."""

import pytest

pytest.importorskip("dynamo.common.backend", reason="ai-dynamo is installed by make test")

from dynamo.health_check import HEALTH_CHECK_KEY
from dynamo.llm.exceptions import InvalidArgument

from dynamo_flexkv.integrations.disagg.dynamo_handlers import BYPASS_REMOTE_PREFILL, Role
from dynamo_flexkv.integrations.disagg.params import KEY, HandoverParams
from dynamo_flexkv.integrations.dynamo_worker.args import build_parser

HANDOVER = HandoverParams("a", None, "L", [1, 2], 9, [100], 64, "DRAM", 0, 1e12, 4, checksums=[5, 6]).to_dict()


def role(mode):
    return Role(build_parser().parse_args(["--disaggregation-mode", mode]))


def test_prefill_caps_max_tokens_to_one():
    request = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 50}}
    assert role("prefill").prepare(request) is None
    assert request["stop_conditions"]["max_tokens"] == 1


def test_decode_takes_the_handover_from_prefill_result():
    got = role("decode").prepare({"token_ids": [1], "prefill_result": {"disaggregated_params": HANDOVER}})
    assert got == HandoverParams.from_dict(HANDOVER)


@pytest.mark.parametrize(
    "request_",
    [
        {"token_ids": [1], HEALTH_CHECK_KEY: True},  # a health probe: no prefill peer involved
        {"token_ids": [1], "annotations": [BYPASS_REMOTE_PREFILL]},  # conditional disaggregation
        {"token_ids": [1], "prefill_result": {"disaggregated_params": {}}},  # the prefill worker held nothing
        {"token_ids": [1], "prefill_result": {"disaggregated_params": {KEY: {"version": 0}}}},  # unusable: recompute
    ],
)
def test_decode_prefills_locally_when_there_is_nothing_to_pull(request_):
    assert role("decode").prepare(request_) is None


def test_decode_refuses_a_request_that_skipped_the_prefill_router():
    with pytest.raises(InvalidArgument, match="prefill_result"):
        role("decode").prepare({"token_ids": [1]})


def test_agg_leaves_requests_alone():
    request = {"token_ids": [1], "stop_conditions": {"max_tokens": 50}}
    assert role("agg").prepare(request) is None and request["stop_conditions"]["max_tokens"] == 50
