"""FlexKVConnector's P->D handover (vllm_connector/handover.py) between two real NIXL agents over
vLLM-shaped KV tensors (one per layer, [blocks, kv_heads, block_size, 2*head_size], as on the CPU
platform): what decode reads equals what prefill computed, bit for bit; the read releases the
prefill's hold; and every way a read can go wrong (corrupt bytes, a block reused without its
digest, an expired lease, a malformed or foreign payload) ends in a recompute, never in used bytes."""

import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from served import wait_until

from dynamo_flexkv.integrations.disagg.params import HandoverRefused
from dynamo_flexkv.integrations.vllm_connector.handover import (
    KEY,
    Handover,
    Verify,
    VllmHandover,
    read_source,
    source_file,
)
from dynamo_flexkv.integrations.vllm_connector.settings import DEFAULT_HANDOVER_ORPHAN_S

LAYERS, BLOCKS, HEADS, BS, WIDTH = 4, 32, 2, 16, 64


def prompt(seed: int, blocks: int = 24) -> list:
    """The sequence hash of each full block of a prompt (what both roles compute from its tokens)."""
    from dynamo_flexkv.core.hashing import block_hashes

    g = torch.Generator().manual_seed(1000 + seed)
    return block_hashes(torch.randint(0, 32000, (blocks * BS,), generator=g).tolist(), BS).sequence.tolist()


class _Prompts(dict):
    """Each request's prompt block hashes, made on first use (the request name seeds its tokens)."""

    def __missing__(self, req: str) -> list:
        import zlib

        self[req] = got = prompt(zlib.crc32(req.encode()))
        return got


P = _Prompts()


def kv(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BS, WIDTH, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


@pytest.fixture
def pair(tmp_path, request):
    verify = getattr(request, "param", (Verify.BYTES, Verify.BYTES))  # (prefill's, decode's) handover_verify
    p_layers, d_layers = kv(1), [torch.zeros(BLOCKS, HEADS, BS, WIDTH, dtype=torch.bfloat16) for _ in range(LAYERS)]
    prefill = Handover(p_layers, "prefill-engine", str(tmp_path), verify[0])
    decode = Handover(d_layers, "decode-engine", str(tmp_path), verify[1])
    try:
        yield prefill, decode, p_layers, d_layers, tmp_path
    finally:
        decode.close()
        prefill.close()


def handed(tmp_path, req: str, blocks, lease_s: float = 30.0) -> VllmHandover:
    """What the prefill scheduler returns in kv_transfer_params, through its JSON round trip."""
    import json
    from dataclasses import asdict

    src = read_source("prefill-engine", str(tmp_path))
    params = VllmHandover(
        **asdict(src), req=req, blocks=list(blocks), lease_expires_unix=time.time() + lease_s
    ).to_params()
    return VllmHandover.from_params(json.loads(json.dumps(params)))


def released(prefill: Handover, req: str) -> bool:
    return req in prefill.finished()


BOTH_MODES = pytest.mark.parametrize(
    "pair",
    [(Verify.BYTES, Verify.BYTES), (Verify.OWNER, Verify.OWNER), (Verify.BYTES, Verify.OWNER)],
    indirect=True,
    ids=str,
)


@BOTH_MODES
def test_decode_reads_exactly_the_prefill_blocks_and_the_read_releases_them(pair):
    prefill, decode, p_layers, d_layers, tmp = pair
    remote, local = [7, 3, 20, 21, 0], [1, 2, 30, 5, 9]
    prefill.digest("r1", remote, P["r1"][: len(remote)])
    prefill.hold("r1", time.time() + 30)
    r = decode.pull(handed(tmp, "r1", remote), 0, local, timeout=30, hashes=P["r1"])
    decode.send_releases()  # the worker sends them after the step's forward
    assert r.ok and r.why == "" and r.nbytes == len(local) * LAYERS * p_layers[0][0].nbytes
    for p, d in zip(p_layers, d_layers):
        assert torch.equal(d[local], p[remote])
    wait_until("r1 released", lambda: released(prefill, "r1"), timeout=30, every=0.01)
    assert prefill.released == 1 and prefill.expired == 0


@BOTH_MODES
def test_a_read_that_skips_blocks_vllm_already_holds_reads_only_the_rest(pair):
    prefill, decode, p_layers, d_layers, tmp = pair
    remote = [4, 5, 6, 7]
    prefill.digest("r2", remote, P["r2"][: len(remote)])
    prefill.hold("r2", time.time() + 30)
    r = decode.pull(handed(tmp, "r2", remote), 2, [11, 12], timeout=30, hashes=P["r2"])
    assert r.ok
    for p, d in zip(p_layers, d_layers):
        assert torch.equal(d[[11, 12]], p[[6, 7]])
        assert not d[[0, 1]].any()


def test_bytes_changed_after_their_digest_are_refused_as_corrupt(pair):
    prefill, decode, p_layers, _, tmp = pair
    remote = [1, 2, 3]
    prefill.digest("r3", remote, P["r3"][: len(remote)])
    p_layers[2][2, 1, 3, 5] += 1  # one value of one layer of block 2
    prefill.hold("r3", time.time() + 30)
    r = decode.pull(handed(tmp, "r3", remote), 0, [4, 5, 6], timeout=30, hashes=P["r3"])
    decode.send_releases()
    assert not r.ok and r.why == "corrupt"
    wait_until(
        "r3 released", lambda: released(prefill, "r3"), timeout=30, every=0.01
    )  # a corrupt read still frees them


def test_a_block_reused_without_a_new_digest_is_refused(pair):
    """The digest table is per vLLM block: a block rewritten for another prompt keeps its old
    digest until its own prompt completes, and a read in between must not pass."""
    prefill, decode, p_layers, _, tmp = pair
    prefill.digest("r4", [8], P["r4"][: len([8])])
    for layer in p_layers:
        layer[8].normal_()
    r = decode.pull(handed(tmp, "r4", [8]), 0, [3], timeout=30, hashes=P["r4"])
    assert not r.ok and r.why == "corrupt"


def test_an_expired_lease_is_not_read_and_releases_the_prefill_at_once(pair):
    prefill, decode, _, d_layers, tmp = pair
    prefill.digest("r5", [1], P["r5"][: len([1])])
    prefill.hold("r5", time.time() + 30)
    r = decode.pull(handed(tmp, "r5", [1], lease_s=0.1), 0, [2], timeout=30, hashes=P["r5"])
    decode.send_releases()
    assert not r.ok and r.why == "lease" and r.nbytes == 0
    assert not any(d[2].any() for d in d_layers)
    wait_until("r5 released", lambda: released(prefill, "r5"), timeout=30, every=0.01)


def test_a_hold_nobody_reads_ends_with_its_lease(pair):
    prefill, *_ = pair
    prefill.hold("r6", time.time() + 0.2)
    wait_until("r6 expired", lambda: released(prefill, "r6"), timeout=30, every=0.01)
    assert prefill.expired == 1


def test_a_release_that_arrives_before_its_hold_still_ends_it(pair):
    prefill, decode, _, _, tmp = pair
    prefill.digest("r7", [2], P["r7"][: len([2])])
    assert decode.pull(handed(tmp, "r7", [2]), 0, [2], timeout=30, hashes=P["r7"]).ok
    decode.send_releases()

    def release_seen() -> bool:
        assert prefill.finished() == set()  # a release of a request not held yet ends nothing
        return "r7" in prefill._early

    wait_until("r7's early release seen", release_seen, timeout=30, every=0.01)
    prefill.hold("r7", time.time() + 30)
    assert prefill.finished() == {"r7"} and prefill.released == 1 and prefill.expired == 0


def test_what_a_request_left_without_a_hold_is_dropped_after_handover_orphan_s(pair):
    """A release whose hold never came and the digests of a request never held (an aborted
    request) are kept handover_orphan_s (600 s by default), then dropped: a hold that comes later
    waits out its lease, and a read of the dropped digests fails its check."""
    prefill, decode, _, _, tmp = pair
    assert prefill.orphan_s == DEFAULT_HANDOVER_ORPHAN_S == 600.0
    prefill.orphan_s = 0.2
    prefill.digest("r8", [2], P["r8"][:1])
    assert decode.pull(handed(tmp, "r8", [2]), 0, [2], timeout=30, hashes=P["r8"]).ok
    decode.send_releases()
    wait_until("r8's early release seen", lambda: prefill.finished() == set() and "r8" in prefill._early, every=0.01)
    prefill.digest("r9", [3], P["r9"][:1])  # never held
    wait_until("both dropped", lambda: not prefill.finished() and not prefill._early and not prefill._stamped)
    r = decode.pull(handed(tmp, "r9", [3]), 0, [4], timeout=30, hashes=P["r9"])
    assert not r.ok and r.why == "corrupt"
    prefill.hold("r8", time.time() + 0.3)  # its release is forgotten: it ends with its lease
    wait_until("r8 expired", lambda: "r8" in prefill.finished(), timeout=30, every=0.01)
    assert prefill.expired == 1


@BOTH_MODES
def test_a_block_the_prefill_reused_for_another_request_never_passes_for_the_first(pair):
    """Digests are mixed with the request: a second read of r10's handover after its blocks went
    to r11 (re-digested for r11, same table slot) fails, though r11's bytes hash correctly."""
    prefill, decode, p_layers, d_layers, tmp = pair
    prefill.digest("r10", [5], P["r10"][: len([5])])
    assert decode.pull(handed(tmp, "r10", [5]), 0, [6], timeout=30, hashes=P["r10"]).ok
    for layer in p_layers:
        layer[5].normal_()
    prefill.digest("r11", [5], P["r11"][: len([5])])
    r = decode.pull(handed(tmp, "r10", [5]), 0, [6], timeout=30, hashes=P["r10"])
    assert not r.ok and r.why == "corrupt"
    assert decode.pull(handed(tmp, "r11", [5]), 0, [7], timeout=30, hashes=P["r11"]).ok


@pytest.mark.parametrize("local", [[4, 4], [BLOCKS, 1], [-1, 2]])
def test_local_blocks_repeated_or_outside_the_cache_are_refused_not_raised(pair, local):
    prefill, decode, *_, tmp = pair
    prefill.digest("r12", [3, 4], P["r12"][: len([3, 4])])
    r = decode.pull(handed(tmp, "r12", [3, 4]), 0, local, timeout=30, hashes=P["r12"])
    assert not r.ok and r.why == "refused"


def test_kv_of_another_dtype_or_block_shape_with_the_same_bytes_is_refused(tmp_path):
    prefill = Handover(kv(4), "p2", str(tmp_path))
    other = Handover(
        [torch.zeros(BLOCKS, HEADS, BS, WIDTH, dtype=torch.float16) for _ in range(LAYERS)], "d2", str(tmp_path)
    )
    try:
        from dataclasses import asdict

        prefill.digest("r13", [1], P["r13"][: len([1])])
        h = VllmHandover(
            **asdict(read_source("p2", str(tmp_path))), req="r13", blocks=[1], lease_expires_unix=time.time() + 30
        )
        r = other.pull(h, 0, [1], timeout=30, hashes=P["r13"])
        assert not r.ok and r.why == "refused"
    finally:
        other.close()
        prefill.close()
    assert read_source("p2", str(tmp_path)) is None  # close removed its source file


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"blocks": [1, float("inf")]}, "malformed"),
        ({"block_bytes": float("inf")}, "malformed"),
        ({"blocks": [True, 2]}, "malformed"),
        ({"num_blocks": "16"}, "malformed"),
        ({"agent": None}, "malformed"),
        ({"version": True}, "version"),
        ({"version": 99}, "version"),
        ({"blocks": [0, BLOCKS]}, "outside"),
        ({"blocks": "1,2"}, "malformed"),
        ({"mem": "GPU"}, "memory"),
        ({"digest_addr": 0}, "memory"),
        ({"lease_expires_unix": float("nan")}, "finite"),
        ({"verify": "none"}, "verify"),
        ({"verify": None}, "malformed"),
        ({"version": 1}, "version"),
    ],
)
def test_malformed_params_are_refused_naming_what_is_wrong(pair, bad, why):
    *_, tmp = pair
    params = handed(tmp, "r9", [1, 2]).to_params()
    params[KEY].update(bad)
    with pytest.raises(HandoverRefused, match=why):
        VllmHandover.from_params(params)


def test_params_without_a_handover_are_none_and_a_closed_source_is_gone(tmp_path):
    assert VllmHandover.from_params(None) is None
    assert VllmHandover.from_params({"do_remote_prefill": True}) is None
    h = Handover(kv(3), "gone", str(tmp_path))
    assert read_source("gone", str(tmp_path)).num_blocks == BLOCKS
    h.close()
    h.close()  # twice: nothing more to do
    assert read_source("gone", str(tmp_path)) is None
    path = source_file("../gone", str(tmp_path))  # an engine id never leaves the run directory
    assert path.startswith(str(tmp_path) + "/")


@pytest.mark.parametrize("pair", [(Verify.OWNER, Verify.OWNER)], indirect=True)
def test_owner_stamps_catch_a_wrong_or_undigested_block_but_not_changed_bytes(pair):
    """handover_verify=owner: what it catches (a block that was not this request's when read) and
    what it leaves to the transport (bytes changed in place after the stamp: read as they are)."""
    prefill, decode, p_layers, d_layers, tmp = pair
    prefill.digest("o1", [3, 4], P["o1"][: len([3, 4])])
    wrong = handed(tmp, "o1", [4, 3])  # the blocks swapped: each stamp names the other block
    r = decode.pull(wrong, 0, [10, 11], timeout=30, hashes=P["o1"])
    assert not r.ok and r.why == "corrupt"
    r = decode.pull(handed(tmp, "o1", [3, 5]), 0, [10, 11], timeout=30, hashes=P["o1"])  # block 5 never stamped for o1
    assert not r.ok and r.why == "corrupt"
    p_layers[1][4, 0, 0, 0] += 1
    r = decode.pull(handed(tmp, "o1", [3, 4]), 0, [10, 11], timeout=30, hashes=P["o1"])
    assert r.ok and r.verify_seconds < 0.01
    assert torch.equal(d_layers[1][11], p_layers[1][4])


@pytest.mark.parametrize("pair", [(Verify.OWNER, Verify.BYTES)], indirect=True)
def test_a_decode_that_verifies_bytes_refuses_owner_stamps_naming_the_setting(pair, caplog):
    prefill, decode, _, d_layers, tmp = pair
    prefill.digest("o2", [1], P["o2"][: len([1])])
    with caplog.at_level("WARNING"):
        r = decode.pull(handed(tmp, "o2", [1]), 0, [2], timeout=30, hashes=P["o2"])
    assert not r.ok and r.why == "refused" and not d_layers[0][2].any()
    assert "handover_verify" in caplog.text


def test_an_unknown_verify_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="handover_verify='crc'"):
        Handover(kv(2), "bad-mode", str(tmp_path), "crc")


@BOTH_MODES
def test_a_block_in_the_wrong_place_never_passes(pair):
    """Each digest names the prefix its block holds: a handover that lists the prompt's blocks
    swapped, repeated or shifted (pulled from the wrong place) is refused in both modes."""
    prefill, decode, _, d_layers, tmp = pair
    prefill.digest("w1", [7, 3, 12, 0], P["w1"][:4])
    for blocks, first in (([3, 7, 12, 0], 0), ([7, 7, 12, 0], 0), ([12, 0], 0), ([3, 12, 0], 1)):
        h = handed(tmp, "w1", blocks)
        n = len(blocks) - first
        r = decode.pull(h, first, list(range(20, 20 + n)), timeout=30, hashes=P["w1"])
        assert not r.ok and r.why == "corrupt", (blocks, first, r)
    assert decode.pull(handed(tmp, "w1", [7, 3, 12, 0]), 0, [20, 21, 22, 23], timeout=30, hashes=P["w1"]).ok
    assert decode.pull(handed(tmp, "w1", [7, 3, 12, 0]), 1, [24, 25, 26], timeout=30, hashes=P["w1"]).ok


@BOTH_MODES
def test_prompts_sharing_a_prefix_block_both_hand_it_over(pair):
    """vLLM's prefix cache gives two prompts with a common first block the same physical block;
    its one digest slot serves both, and one hold ending keeps it while the other's goes on."""
    prefill, decode, p_layers, d_layers, tmp = pair
    shared = P["s1"][:1]
    second = [shared[0]] + P["s2"][1:2]  # not a real chain, but any hash names a block's prefix
    prefill.digest("s1", [4, 9], P["s1"][:2])
    prefill.digest("s2", [4, 10], second)
    prefill.hold("s1", time.time() + 30)
    prefill.hold("s2", time.time() + 30)
    assert decode.pull(handed(tmp, "s1", [4, 9]), 0, [1, 2], timeout=30, hashes=P["s1"]).ok
    decode.send_releases()
    wait_until("s1 released", lambda: released(prefill, "s1"), timeout=30, every=0.01)
    assert decode.pull(handed(tmp, "s2", [4, 10]), 0, [3, 5], timeout=30, hashes=second).ok
    for p, d in zip(p_layers, d_layers):
        assert torch.equal(d[[1, 2, 3, 5]], p[[4, 9, 4, 10]])


@BOTH_MODES
def test_a_hold_that_ended_takes_its_digests_with_it(pair):
    """Once decode released a handover (or its lease ended on the prefill), its blocks may be
    reused before a new prompt's digests reach them: a late or repeated read of the old payload
    is refused whatever decode's clock says about the lease."""
    prefill, decode, p_layers, _, tmp = pair
    prefill.digest("e1", [6, 7], P["e1"][:2])
    prefill.hold("e1", time.time() + 30)
    assert decode.pull(handed(tmp, "e1", [6, 7]), 0, [1, 2], timeout=30, hashes=P["e1"]).ok
    decode.send_releases()
    wait_until("e1 released", lambda: released(prefill, "e1"), timeout=30, every=0.01)
    for layer in p_layers:
        layer[6].normal_()  # vLLM reused the block; its new prompt is not digested yet
    r = decode.pull(handed(tmp, "e1", [6, 7]), 0, [1, 2], timeout=30, hashes=P["e1"])
    assert not r.ok and r.why == "corrupt"
    prefill.digest("e2", [3], P["e2"][:1])
    prefill.hold("e2", time.time() + 0.2)
    wait_until("e2 expired", lambda: released(prefill, "e2"), timeout=30, every=0.01)
    r = decode.pull(handed(tmp, "e2", [3]), 0, [4], timeout=30, hashes=P["e2"])  # payload lease still 30 s
    assert not r.ok and r.why == "corrupt"


def test_a_decode_prompt_shorter_than_the_read_is_refused(pair):
    prefill, decode, *_, tmp = pair
    prefill.digest("h1", [1, 2, 3], P["h1"][:3])
    r = decode.pull(handed(tmp, "h1", [1, 2, 3]), 0, [4, 5, 6], timeout=30, hashes=P["h1"][:2])
    assert not r.ok and r.why == "refused"


@BOTH_MODES
def test_a_block_digested_again_for_another_prefix_clears_when_that_hold_ends(pair):
    """Carriers are counted per (block, digest): an earlier request's stamp on a block that was
    then digested for another prefix (never held, or its hold still on) does not keep the later
    request's digest in the table after the later hold ended."""
    prefill, decode, p_layers, _, tmp = pair
    prefill.digest("a1", [5], P["a1"][:1])  # never held (aborted)
    prefill.digest("a2", [6], P["a2"][:1])
    prefill.hold("a2", time.time() + 30)
    for layer in p_layers:
        layer[5].normal_()
        layer[6].normal_()
    prefill.digest("b1", [5], P["b1"][:1])
    prefill.digest("b2", [6], P["b2"][:1])  # a2's hold still on, its block reused (a bug upstream)
    for req in ("b1", "b2"):
        prefill.hold(req, time.time() + 30)
        assert decode.pull(handed(tmp, req, [5 if req == "b1" else 6]), 0, [1], timeout=30, hashes=P[req]).ok
    decode.send_releases()
    seen: set = set()
    wait_until(
        "b1, b2 released", lambda: seen.update(prefill.finished()) or {"b1", "b2"} <= seen, timeout=30, every=0.01
    )
    for req, block in (("b1", 5), ("b2", 6)):
        r = decode.pull(handed(tmp, req, [block]), 0, [2], timeout=30, hashes=P[req])
        assert not r.ok and r.why == "corrupt", (req, r)


def test_digest_refuses_repeated_or_outside_block_ids(pair):
    prefill, *_ = pair
    for bad in ([5, 5], [-1], [BLOCKS]):
        with pytest.raises(ValueError, match="distinct and in"):
            prefill.digest("d1", bad, P["d1"][: len(bad)])


def test_releases_leave_from_an_agent_of_their_own_not_the_reading_one(pair):
    """A release sent on the reading agent's endpoint left the next READ from that prefill in
    progress for 5-15 ms on this host (bench disagg --vllm); the notices agent carries them."""
    prefill, decode, p_layers, d_layers, tmp = pair
    senders: dict = {}
    for i, req in enumerate(("n1", "n2")):
        prefill.digest(req, [i], P[req][:1])
        prefill.hold(req, time.time() + 30)
        assert decode.pull(handed(tmp, req, [i]), 0, [i + 4], timeout=30, hashes=P[req]).ok
        decode.send_releases()
        wait_until(
            f"{req}'s release",
            lambda: (
                [senders.setdefault(k, []).extend(v) for k, v in prefill.agent.agent.get_new_notifs().items()]
                and False
                or sum(map(len, senders.values())) > i
            ),
            timeout=30,
            every=0.01,
        )
    assert list(senders) == [decode.notices_agent] and decode.agent.name not in senders
    assert all(torch.equal(d_layers[0][i + 4], p_layers[0][i]) for i in range(2))


@BOTH_MODES
def test_digests_in_a_transfer_of_their_own_verify_the_same(pair, monkeypatch):
    """The digests ride in the KV's own transfer when both tables sit in host memory; where they
    cannot (GPU KV) they go in a transfer of their own. Forced here on CPU: same checks, same bytes."""
    prefill, decode, p_layers, d_layers, tmp = pair
    monkeypatch.setattr(decode.agent, "_landed_base", None)
    remote, local = [9, 2, 17], [3, 30, 8]
    prefill.digest("s1", remote, P["s1"][:3])
    assert decode.pull(handed(tmp, "s1", remote), 0, local, timeout=30, hashes=P["s1"]).ok
    assert all(torch.equal(d[local], p[remote]) for p, d in zip(p_layers, d_layers))
    r = decode.pull(handed(tmp, "s1", remote[::-1]), 0, local, timeout=30, hashes=P["s1"])
    assert not r.ok and r.why == "corrupt"


def test_a_notice_after_close_or_to_an_unknown_agent_is_false_not_raised(pair):
    from dynamo_flexkv.core.transfer.nixl_agent import Notifier

    prefill, decode, _, _, tmp = pair
    n = Notifier("test-notices")
    h = handed(tmp, "x1", [0])
    assert n.notify(h, b"hello")
    wait_until("the notice", lambda: prefill.agent.notifications() == [b"hello"], timeout=30, every=0.01)
    from dataclasses import replace

    assert not n.notify(replace(h, agent="no-such-agent", metadata=None), b"lost")
    assert not n.notify(replace(h, agent="garbled", metadata="!!not base64!!"), b"lost")
    n.close()
    assert not n.notify(h, b"after close")


@BOTH_MODES
def test_a_read_after_the_prefill_closed_is_refused_not_used(pair):
    """A closed prefill worker's memory may still be readable (shared memory): its digest table is
    cleared first, so a late read fails its check."""
    prefill, decode, _, d_layers, tmp = pair
    prefill.digest("c1", [3, 4], P["c1"][:2])
    prefill.hold("c1", time.time() + 30)
    h = handed(tmp, "c1", [3, 4])  # the source file goes with close
    prefill.close()
    r = decode.pull(h, 0, [1, 2], timeout=30, hashes=P["c1"])
    assert not r.ok and r.why in ("corrupt", "failed")


@pytest.mark.unit
def test_no_prefix_hash_gives_an_owner_stamp_of_zero_the_cleared_slot():
    from dynamo_flexkv.integrations.vllm_connector.handover import _owner_stamps

    mul, add = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F
    zero_before = (-add * pow(mul, -1, 2**64)) % 2**64  # the tag the plain affine map sent to 0
    tags = np.array([zero_before, 0, 2**64 - 1, 12345], dtype=np.uint64)
    assert (_owner_stamps(tags) != 0).all()
