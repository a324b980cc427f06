"""The replay's per-request accounting (dynamo_flexkv/replay/accounting.py): synthetic requests,
KV event streams and connector records whose answer is known, one per cause; every request's
causes add up to its prompt tokens, and a table that does not add up raises."""

from __future__ import annotations

import json

import pytest

from dynamo_flexkv.integrations.request_log import RequestLog, lookup_tokens, prompt_key
from dynamo_flexkv.replay.accounting import (
    CAUSES,
    AccountingError,
    Request,
    RequestAccount,
    account,
    check_sums,
)
from dynamo_flexkv.replay.events import KvEvent, decode_frame

B = 4  # tokens per block


def prompt(*blocks: int, tail: int = 1) -> list:
    """Block b of a prompt is B copies of b (so prompts share a prefix when their first blocks
    agree), then ``tail`` more tokens."""
    return [b for b in blocks for _ in range(B)] + [999] * tail


def req(index, tokens, sent, done, worker="A", cached=0, **kw) -> Request:
    return Request(index, tokens, float(sent), float(done), worker, cached, **kw)


class Chain:
    """Event hashes for a prompt's blocks, as a worker would name them (any names do: the
    accounting follows parents and token ids)."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.hashes = [hash((tuple(tokens[: (i + 1) * B]),)) for i in range(len(tokens) // B)]

    def stored(self, t, worker, tier, first, last) -> KvEvent:
        parent = self.hashes[first - 1] if first else None
        return KvEvent(
            t, worker, "stored", tier, tuple(self.hashes[first:last]), parent, tuple(self.tokens[first * B : last * B])
        )

    def removed(self, t, worker, tier, first, last) -> KvEvent:
        return KvEvent(t, worker, "removed", tier, tuple(self.hashes[first:last]))


def causes(row, index) -> dict:
    return {k: v for k, v in row.requests[index].causes.items() if v}


def test_a_first_request_is_new_but_its_last_block_and_token():
    row = account([req(0, prompt(1, 2, 3, tail=2), 0, 1)], B, events=None)
    # 14 tokens: 3 whole blocks leaving a token to compute -> 12 new, 2 tail
    assert causes(row, 0) == {"new": 12, "tail": 2}
    assert row.prompt_tokens == 14 and sum(row.totals.values()) == 14 and row.check == "exact"


def test_a_prompt_of_whole_blocks_keeps_its_last_block_computed():
    # 12 tokens: vLLM must compute at least one, so only 2 blocks are cacheable
    row = account([req(0, prompt(1, 2, 3, tail=0), 0, 1)], B, events=[])
    assert causes(row, 0) == {"new": 8, "tail": 4}


def test_the_device_hit_and_what_no_earlier_prompt_had():
    p0, p1 = prompt(1, 2), prompt(1, 2, 5, 6)
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 2)]
    row = account([req(0, p0, 0, 1), req(1, p1, 2, 3, cached=8)], B, events=events)
    assert causes(row, 1) == {"device": 8, "new": 8, "tail": 1}


def test_an_earlier_request_still_being_served():
    p = prompt(1, 2, 3)
    row = account([req(0, p, 0, 5), req(1, p, 1, 6)], B, events=[])
    assert causes(row, 1) == {"in_flight": 12, "tail": 1}


def test_routed_to_the_worker_that_did_not_hold_it():
    p0, p1 = prompt(1, 2), prompt(1, 2, 3)
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 2), c.stored(1.2, "A", "host", 0, 2)]
    row = account([req(0, p0, 0, 1, "A"), req(1, p1, 2, 3, "B")], B, events=events)
    assert causes(row, 1) == {"other_worker": 8, "new": 4, "tail": 1}


def test_evicted_names_the_tier_its_last_copy_left():
    p = prompt(1, 2, 3)
    c = Chain(p)
    events = [
        c.stored(0.5, "A", "device", 0, 3),
        c.stored(1.1, "A", "host", 0, 3),
        c.removed(1.5, "A", "device", 0, 3),
        c.removed(1.8, "A", "host", 0, 3),
    ]
    row = account([req(0, p, 0, 1), req(1, p, 2, 3)], B, events=events)
    assert causes(row, 1) == {"evicted_host": 12, "tail": 1}
    # no offload: the device copy was the last
    row = account([req(0, p, 0, 1), req(1, p, 2, 3)], B, events=[events[0], c.removed(1.5, "A", "device", 0, 3)])
    assert causes(row, 1) == {"evicted_device": 12, "tail": 1}


def test_a_store_that_had_not_landed_when_the_next_turn_came():
    """The previous turn finished (t=1) and left the device; its copy reached host only at t=2.5,
    after the next turn looked (t=2)."""
    p0, p1 = prompt(1, 2), prompt(1, 2, 3)
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 2), c.removed(1.5, "A", "device", 0, 2), c.stored(2.5, "A", "host", 0, 2)]
    row = account([req(0, p0, 0, 1), req(1, p1, 2, 3)], B, events=events)
    assert causes(row, 1) == {"store_pending": 8, "new": 4, "tail": 1}


def test_the_load_policy_declined_with_its_estimate_against_the_measured_ttft():
    p0, p1 = prompt(1, 2, 3, 4), prompt(1, 2, 3, 4, 5)
    key = prompt_key(p1[: lookup_tokens(len(p1), B)])
    decision = {
        "reason": "slower",
        "start": 4,
        "end": 4,
        "found": {"host": 12},
        "predicted_ms": 20.0,
        "recompute_ms": 20.0,
        "load_all_ms": 31.0,
    }
    logs = {"A": [{"kind": "lookup", "t": 2.1, "key": key, "device": 4, "answer": 4, "decision": decision}]}
    row = account([req(0, p0, 0, 1), req(1, p1, 2, 3, cached=4, ttft_ms=250.0)], B, events=[], logs=logs)
    assert causes(row, 1) == {"device": 4, "declined": 12, "new": 4, "tail": 1}
    assert row.requests[1].decision == {**decision, "ttft_ms": 250.0}
    assert row.lookups == 1
    assert "load all 31 ms vs the chosen 20 ms; measured TTFT median 250 ms" in row.declined_summary()


def test_found_by_the_lookup_but_gone_when_loaded():
    """The lookup answered 12 tokens (4 on vLLM's device, 8 in host); the load planned 4 of them."""
    p0, p1 = prompt(1, 2, 3, 4), prompt(1, 2, 3, 4, 5)
    key = prompt_key(p1[: lookup_tokens(len(p1), B)])
    logs = {
        "A": [
            {"kind": "lookup", "t": 2.1, "key": key, "device": 4, "answer": 12, "decision": None},
            {"kind": "load", "t": 2.2, "key": key, "device": 4, "planned": 4, "loaded": {"host": 4}, "ok": True},
        ]
    }
    row = account([req(0, p0, 0, 1), req(1, p1, 2, 3, cached=8)], B, events=None, logs=logs)
    assert causes(row, 1) == {"device": 4, "host": 4, "lost_before_load": 4, "untraced": 4, "new": 4, "tail": 1}
    assert row.check == "exact"


def _hinted(p0, p1, hint: dict, load: dict | None):
    """p0 served on A (device, then host); p1 booked on B with a router hint naming A."""
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 3), c.stored(0.8, "A", "host", 0, 3)]
    key = prompt_key(p1[: lookup_tokens(len(p1), B)])
    answer = hint["start"] + hint["pulled"]
    logs = {
        "B": [{"kind": "lookup", "t": 2.1, "key": key, "device": 0, "answer": answer, "decision": None, "hint": hint}]
    }
    if load is not None:
        logs["B"].append({"kind": "load", "t": 2.2, "key": key, **load})
    cached = sum((load or {}).get("loaded", {}).values())
    return account([req(0, p0, 0, 1, "A"), req(1, p1, 2, 3, "B", cached=cached)], B, events=events, logs=logs)


def test_blocks_a_hint_pulled_count_as_host_loads_pulled_from_another_worker():
    """B's host held block 0; the hint named A's 3 blocks; B pulled blocks 1-2 into its host tier
    and loaded all 3 from there: 4 own host tokens, 8 pulled, and no "another worker held it"."""
    p0, p1 = prompt(1, 2, 3), prompt(1, 2, 3, 4)
    hint = {"hinted": 12, "start": 4, "pulled": 8, "why": "", "skipped": False}
    load = {"device": 0, "planned": 12, "loaded": {"host": 12}, "ok": True}
    row = _hinted(p0, p1, hint, load)
    assert causes(row, 1) == {"host": 4, "host_pulled": 8, "new": 4, "tail": 1}
    assert row.check == "exact" and sum(row.totals.values()) == row.prompt_tokens
    # the load covered only part of the pulled range: only that part counts as pulled
    row = _hinted(p0, p1, hint, {"device": 0, "planned": 8, "loaded": {"host": 8}, "ok": True})
    assert causes(row, 1) == {"host": 4, "host_pulled": 4, "lost_before_load": 4, "new": 4, "tail": 1}
    # vLLM's device held block 0: the load starts past it
    row = _hinted(p0, p1, hint, {"device": 4, "planned": 8, "loaded": {"host": 8}, "ok": True})
    assert causes(row, 1) == {"device": 4, "host_pulled": 8, "new": 4, "tail": 1}
    # a failed load brings nothing, pulled or not
    row = _hinted(p0, p1, hint, {"device": 0, "planned": 12, "loaded": {}, "ok": False})
    assert causes(row, 1) == {"lost_before_load": 12, "new": 4, "tail": 1}


def test_a_hint_that_failed_or_was_skipped_names_what_it_would_have_brought():
    p0, p1 = prompt(1, 2, 3), prompt(1, 2, 3, 4)
    for why, skipped in (("timeout", False), ("", True)):
        hint = {"hinted": 12, "start": 0, "pulled": 0, "why": why, "skipped": skipped}
        row = _hinted(p0, p1, hint, None)
        assert causes(row, 1) == {"hint_missed": 12, "new": 4, "tail": 1}, why
    # no hint at all: the router sent it away from A's copy
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 3)]
    row = account([req(0, p0, 0, 1, "A"), req(1, p1, 2, 3, "B")], B, events=events)
    assert causes(row, 1) == {"other_worker": 12, "new": 4, "tail": 1}


def test_a_response_that_disagrees_with_the_connector_is_named():
    p = prompt(1, 2, 3)
    key = prompt_key(p[: lookup_tokens(len(p), B)])
    logs = {"A": [{"kind": "load", "t": 2.2, "key": key, "device": 0, "planned": 8, "loaded": {}, "ok": False}]}
    row = account([req(0, p, 0, 1), req(1, p, 2, 3, cached=8)], B, events=[], logs=logs)
    assert "request 1: the response says 8 cached tokens, the connector 0 (its load failed)" in row.check


def test_held_on_its_own_worker_but_not_hit():
    p = prompt(1, 2)
    c = Chain(p)
    row = account([req(0, p, 0, 1), req(1, p, 2, 3)], B, events=[c.stored(0.5, "A", "device", 0, 2)])
    assert causes(row, 1) == {"held_not_hit": 8, "tail": 1}


def test_two_requests_with_the_same_prompt_each_get_their_own_records():
    """Two conversations opened with the same prompt, sent 0.5 s apart to one worker: the first
    found nothing and was answered in 60 ms; the second loaded it. Each gets its own lookup, and
    the load is the second's (it came after the first's first token)."""
    p = prompt(1, 2, 3)
    key = prompt_key(p[: lookup_tokens(len(p), B)])
    lookup = {"kind": "lookup", "key": key, "device": 0, "decision": None}
    logs = {
        "A": [
            {**lookup, "t": 2.01, "answer": 0},
            {**lookup, "t": 2.51, "answer": 8},
            {"kind": "load", "t": 2.52, "key": key, "device": 0, "planned": 8, "loaded": {"host": 8}, "ok": True},
        ]
    }
    reqs = [req(0, p, 2.0, 2.1, ttft_ms=60.0), req(1, p, 2.5, 2.6, cached=8, ttft_ms=40.0)]
    row = account(reqs, B, events=None, logs=logs)
    assert causes(row, 0) == {"new": 12, "tail": 1}
    assert causes(row, 1) == {"host": 8, "untraced": 4, "tail": 1}
    assert row.check == "exact" and row.lookups == 2


def test_the_peer_row_splits_its_hit_by_the_device_events():
    p0, p1 = prompt(1, 2, 3, 4), prompt(1, 2, 3, 4, 5, 6)
    c = Chain(p0)
    events = [c.stored(0.5, "A", "device", 0, 4), c.removed(1.5, "A", "device", 2, 4)]
    row = account([req(0, p0, 0, 1), req(1, p1, 2, 3, cached=12)], B, events=events, peer=True)
    assert causes(row, 1) == {"device": 8, "host": 4, "peer_missed": 4, "new": 8, "tail": 1}


def test_the_reference_engine_says_its_tiers_per_response():
    p = prompt(1, 2, 3)
    row = account([req(0, p, 0, 1), req(1, p, 2, 3, cached=8, by_tier={"device": 4, "host": 4})], B, events=None)
    assert causes(row, 1) == {"device": 4, "host": 4, "untraced": 4, "tail": 1}


def test_every_cause_is_a_known_one_and_the_sums_hold_over_a_mixed_row():
    ps = [prompt(1, 2, 3), prompt(1, 2, 3, 4), prompt(7, 8), prompt(1, 2, 3, 4, 5), prompt(7, 8, 9)]
    c0, c2 = Chain(ps[0]), Chain(ps[2])
    events = [
        c0.stored(0.5, "A", "device", 0, 3),
        c2.stored(2.5, "B", "device", 0, 2),
        c0.removed(3.5, "A", "device", 0, 3),
    ]
    reqs = [req(i, p, 2 * i, 2 * i + 1, "AB"[i % 2], cached=4 * (i == 1)) for i, p in enumerate(ps)]
    row = account(reqs, B, events=events)
    assert set(row.totals) == set(CAUSES)
    assert sum(row.totals.values()) == row.prompt_tokens == sum(len(p) for p in ps)
    for a in row.requests:
        assert sum(a.causes.values()) == a.prompt_tokens


def test_lost_event_frames_are_named():
    p = prompt(1, 2)
    c = Chain(p)
    row = account([req(0, p, 0, 1)], B, events=[c.stored(0.5, "A", "device", 0, 2)], lost_frames=3)
    assert row.check == "3 KV event frames lost: the causes read from events may be off"
    assert (
        account([req(0, p, 0, 1)], B, events=[]).check
        == "no KV events arrived: the causes read from events are missing"
    )


def test_causes_that_do_not_add_up_fail_loudly():
    bad = RequestAccount(3, "A", 10, {"new": 8, "tail": 1})
    with pytest.raises(AccountingError, match="request 3: causes .* add up to 9, not its 10 prompt tokens"):
        check_sums([bad], {"new": 8, "tail": 1}, 10)
    good = RequestAccount(3, "A", 10, {"new": 8, "tail": 2})
    with pytest.raises(AccountingError, match="the row's causes add up to 9, not 10"):
        check_sums([good], {"new": 8, "tail": 1}, 10)


def test_a_connectors_log_file_is_what_the_accounting_reads(tmp_path):
    log = RequestLog(str(tmp_path))
    p = prompt(1, 2, 3)
    looked = p[: lookup_tokens(len(p), B)]
    log.lookup(looked, len(p), 0, 8, {"reason": "faster", "start": 0, "end": 8, "found": {"host": 8}})
    log.load(prompt_key(looked), "req-1", 0, 8, {"host": 8, "disk": 0}, True)
    hint = {"hinted": 8, "start": 0, "pulled": 8, "why": "", "skipped": False}
    log.lookup(looked, len(p), 0, 8, {"reason": "faster", "start": 0, "end": 8, "found": {"host": 8}}, hint)
    log.load(prompt_key(looked), "req-2", 0, 8, {"host": 8}, True)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "flexkv-requests.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["lookup", "load", "lookup", "load"] and lines[1]["loaded"] == {"host": 8}
    assert "hint" not in lines[0] and lines[2]["hint"] == hint
    t = lines[0]["t"]
    row = account(
        [req(0, p, t - 10, t - 9), req(1, p, t - 0.1, lines[1]["t"] + 0.01, cached=8)],
        B,
        events=[],
        logs={"A": lines[:2]},
    )
    assert causes(row, 1) == {"host": 8, "untraced": 4, "tail": 1}
    row = account([req(0, p, t - 10, t - 9), req(1, p, t - 0.1, t + 1, cached=8)], B, events=[], logs={"A": lines[2:]})
    assert causes(row, 1) == {"host_pulled": 8, "untraced": 4, "tail": 1}


def test_worker_event_frames_decode_as_vllm_and_our_relay_send_them():
    import msgspec

    payload = msgspec.msgpack.encode(
        [
            12.5,
            [
                {"type": "BlockStored", "block_hashes": [b"\x01", b"\x02"], "parent_block_hash": None,
                 "token_ids": list(range(8)), "block_size": 4, "medium": "CPU_PINNED"},
                {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 6, "token_ids": [1, 2, 3, 4],
                 "block_size": 4, "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "DISK"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )  # fmt: skip
    events = decode_frame("A", payload)
    assert [(e.kind, e.tier, e.t) for e in events] == [
        ("stored", "host", 12.5),
        ("stored", "device", 12.5),
        ("removed", "disk", 12.5),
        ("cleared", "device", 12.5),
    ]
    assert events[0].hashes == (b"\x01", b"\x02") and events[1].parent == 6 and len(events[0].token_ids) == 8
