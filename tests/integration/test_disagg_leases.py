"""A handover lease holds only as long as it can still be used: briefly (renew_s) unless a decode
worker claims it, and while a claimed request waits on the decode worker, only as long as that
worker keeps renewing it. A decode leg that never starts (the decode worker died, the frontend's
decode call failed) costs the prefill worker's blocks for renew_s seconds, not the lease's ttl."""

import logging
import time

import pytest
from disagg_helpers import Clock, engine_pair

from dynamo_flexkv.integrations.disagg import LeaseTable

CFG_NAME = "tiny"


@pytest.mark.unit
def test_an_unclaimed_lease_ends_after_the_renewal_window_a_renewed_one_at_most_at_its_ttl():
    clock = Clock()
    table = LeaseTable(30.0, clock, renew_s=2.0)
    unclaimed, renewed = table.grant([1]), table.grant([2])
    assert renewed.renew_by_unix < renewed.expires_unix  # the decode worker learns both
    clock.now = 1.5
    assert table.renew(renewed.id)
    clock.now = 2.0
    assert [x.id for x in table.expire()] == [unclaimed.id] and table.unclaimed_count == 1
    assert not table.renew(unclaimed.id)  # too late: nothing to extend
    for t in range(3, 40):  # renewed every second: it still ends at its ttl
        clock.now = float(t) - 0.5
        table.renew(renewed.id)
        clock.now = float(t)
        if table.expire():
            break
    assert clock.now == 30.0 and len(table) == 0
    assert (table.expired_count, table.unclaimed_count) == (2, 1)
    assert LeaseTable(3.0, clock, renew_s=5.0).renew_s == 3.0  # never past the ttl
    with pytest.raises(ValueError, match="renewal window"):
        LeaseTable(30.0, clock, renew_s=0)


nixl = pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from dynamo_flexkv.integrations.disagg import HandoverParams  # noqa: E402
from dynamo_flexkv.integrations.disagg.params import KEY  # noqa: E402
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine  # noqa: E402
from dynamo_flexkv.integrations.reference_engine.request import SamplingParams  # noqa: E402

CFG = EngineModelConfig.load(CFG_NAME)


@pytest.fixture
def pair():
    with engine_pair(renew_s=2.0) as p:
        yield p


def until(what: str, condition, service, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        service()
        assert time.monotonic() < deadline, f"not {what} after {timeout:.0f} s"
        time.sleep(0.01)


def test_a_lease_no_decode_worker_claims_ends_after_renew_s_and_its_blocks_come_back(pair, caplog):
    prefill, _, p_side, _ = pair
    clock = Clock()
    p_side.leases = LeaseTable(30.0, clock, renew_s=1.5)
    prompt = list(range(1, 100))
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    p_side.hand_over(prompt)  # the frontend's decode call then fails: nobody claims it
    assert prefill.pool.num_available < prefill.pool.num_blocks
    clock.now = 1.4
    p_side.service()
    assert len(p_side.leases) == 1
    clock.now = 1.5
    with caplog.at_level(logging.WARNING, logger="dynamo_flexkv.integrations.disagg.roles"):
        p_side.service()
    assert len(p_side.leases) == 0 and prefill.pool.num_available == prefill.pool.num_blocks
    assert p_side.leases.unclaimed_count == 1
    assert any("expired unclaimed" in r.getMessage() for r in caplog.records)


def test_a_claimed_request_waiting_on_decode_keeps_its_lease_by_renewals_then_pulls_it(pair):
    prefill, decode, p_side, d_side = pair
    agg = LLMEngine(CFG, num_device_blocks=48)
    prompt, params = list(range(1, 100)), SamplingParams(max_tokens=5)
    (want,) = agg.generate([prompt], params)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    handover = p_side.hand_over(prompt)
    handed = HandoverParams.from_dict(handover)
    d_side.expect("w", handed)  # reached decode: claimed at once
    lease = p_side.leases.get(handed.lease)

    def both():
        p_side.service()
        d_side.service()

    # The request waits on the decode worker (queued) past several renewal windows.
    until("renewed past its window", lambda: lease.renewals >= 7, both)  # every 0.5 s: ~3 s
    assert len(p_side.leases) == 1 and p_side.leases.expired_count == 0
    decode.add_request(prompt, params, request_id="w")
    while decode.has_unfinished():
        decode.step()
    (req,) = decode.take_finished()
    assert req.output == want.output and d_side.stats.ok == 1 and d_side.stats.failed == 0
    until("the lease released", lambda: len(p_side.leases) == 0, p_side.service)
    assert p_side.leases.released == 1 and p_side.leases.expired_count == 0


def test_a_handover_that_reaches_decode_too_late_to_claim_is_recomputed_and_released(pair):
    prefill, decode, p_side, d_side = pair
    agg = LLMEngine(CFG, num_device_blocks=48)
    prompt, params = list(range(1, 100)), SamplingParams(max_tokens=5)
    (want,) = agg.generate([prompt], params)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    handover = p_side.hand_over(prompt)
    late = dict(handover[KEY], renew_by_unix=time.time() + 0.5)  # less than the margin left
    decode.add_request(prompt, params, request_id="late")
    d_side.expect("late", HandoverParams.from_dict({KEY: late}))
    while decode.has_unfinished():
        decode.step()
    (req,) = decode.take_finished()
    assert req.output == want.output and d_side.stats.failed == 1 and d_side.stats.pulled_blocks == 0
    until("the lease released", lambda: len(p_side.leases) == 0, p_side.service)
    assert p_side.leases.released == 1  # by decode's notice, not by expiry


@pytest.mark.unit
def test_the_worker_refuses_a_renewal_window_too_short_to_claim_in():
    from dynamo_flexkv.integrations.disagg.leases import DEFAULT_RENEW_S
    from dynamo_flexkv.integrations.dynamo_worker.args import build_parser

    assert build_parser().parse_args([]).handover_renew_s == DEFAULT_RENEW_S
    assert build_parser().parse_args(["--handover-renew-s", "2"]).handover_renew_s == 2.0
    for bad in ("1.5", "0", "nan", "1e6"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--handover-renew-s", bad])
