"""Peer pulls (core/peer/) between two real KVManagers and two real NIXL agents on loopback: what
the receiver pulls is what the source stored, bit for bit; every request the source must not serve
(no proof, a forged one, another tenant's or model's blocks, oversized, unknown version, garbage,
a replay) is refused and pins nothing; a pin ends with its Release, its connection or its lease,
whichever comes first, and pinned blocks are never evicted meanwhile; a flood of pins is bounded;
a source SIGKILLed mid-pull and bytes changed under a pin are misses that leave nothing behind."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("nixl._api", reason="NIXL is installed by make install")

from kv_helpers import MODEL, assert_no_leaks, config, device_tensors, fill, holds
from repo_paths import HELPERS
from served import wait_until

from dynamo_flexkv import KVLayoutType, KVManager
from dynamo_flexkv.core.peer import PeerReceiver, PeerSource, SourceLimits, host_agent
from dynamo_flexkv.core.peer import protocol as wire
from dynamo_flexkv.core.peer.source import kv_layout

LAYOUT = KVLayoutType.LAYERBLOCK
SECRET = b"deployment-secret"
TPB = 16


def tokens_of(seed: int, blocks: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(blocks * TPB)]


class Worker:
    """One worker's manager, device KV and host agent."""

    def __init__(self, tmp, name: str, host_blocks: int = 96, tenant=None, model_id: str = "m") -> None:
        self.kv = KVManager(
            MODEL, config(tmp / name, host_blocks=host_blocks, disk_blocks=0), model_id=model_id, namespace=tenant
        )
        self.dev = device_tensors(LAYOUT, host_blocks)
        self.kv.register_device_cache(self.dev, LAYOUT)
        self.agent = host_agent(self.kv)

    def store(self, tokens: list) -> list:
        hashes = [int(h) for h in self.kv.hashes(tokens).sequence]
        for i, h in enumerate(hashes):
            fill(self.dev, LAYOUT, i, h)
        tid = self.kv.put_async(tokens, list(range(len(hashes))))
        assert self.kv.wait([tid])[tid].ok
        return hashes

    def loads(self, tokens: list) -> bool:
        """Loads the prompt from the host tier into fresh device blocks: every block as stored?"""
        hashes = [int(h) for h in self.kv.hashes(tokens).sequence]
        self.dev[0].zero_()
        for t in self.dev:
            t.zero_()
        tid = self.kv.get_async(tokens, list(range(len(hashes))))
        r = self.kv.wait([tid])[tid]
        return r.num_tokens == len(hashes) * TPB and all(holds(self.dev, LAYOUT, i, h) for i, h in enumerate(hashes))

    def close(self) -> None:
        self.agent.close()
        self.kv.shutdown()


@pytest.fixture
def pair(tmp_path):
    a, b = Worker(tmp_path, "a"), Worker(tmp_path, "b")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(lease_s=10.0, max_pinned_blocks=64))
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    try:
        yield a, b, source, receiver
    finally:
        receiver.close()
        source.close()
        b.close()
        a.close()


def no_pins(source: PeerSource, a: Worker) -> bool:
    return source.stats.pinned_blocks == 0 and a.kv.cache.task_ids() == []


@pytest.mark.parametrize("seed", range(3))
def test_pulled_blocks_equal_the_stored_ones_and_load_like_host_blocks(pair, seed):
    a, b, source, receiver = pair
    rng = random.Random(seed)
    blocks = rng.randrange(8, 40)
    tokens = tokens_of(seed, blocks)
    a.store(tokens)
    held = rng.randrange(0, blocks // 2)  # the receiver already holds a prefix of its own
    if held:
        b.store(tokens[: held * TPB])
    r = receiver.pull(source.endpoint, tokens)
    assert r.ok and (r.held, r.blocks) == (held, blocks - held), r
    assert r.nbytes == (blocks - held) * a.kv.host.layout.block_bytes
    assert b.kv.match(tokens)["host"] == blocks * TPB
    assert b.loads(tokens)  # the normal load path serves the pulled blocks, bit for bit
    wait_until("the source's pin released", lambda: no_pins(source, a), timeout=10)
    assert source.stats.released == 1 and source.stats.expired == 0
    assert receiver.pull(source.endpoint, tokens).blocks == 0  # held now: nothing asked
    assert_no_leaks(b.kv)


def test_a_pull_stops_where_the_source_prefix_ends(pair):
    a, b, source, receiver = pair
    tokens = tokens_of(7, 20)
    a.store(tokens[: 12 * TPB])
    r = receiver.pull(source.endpoint, tokens)
    assert r.ok and r.blocks == 12
    assert b.kv.match(tokens)["host"] == 12 * TPB
    assert_no_leaks(b.kv)


def _raw(source: PeerSource) -> socket.socket:
    return socket.create_connection((source.host, source.port), timeout=5)


def _ask(sock: socket.socket, message) -> object:
    sock.sendall(wire.encode(message))
    header = sock.recv(wire.HEADER_BYTES, socket.MSG_WAITALL)
    return wire.decode_to_receiver(sock.recv(wire.peer_frame_length(header), socket.MSG_WAITALL))


def _pull(kv: KVManager, tokens: list, secret=SECRET, start: int = 0, **change) -> wire.Pull:
    hashes = [int(h) for h in kv.hashes(tokens).sequence]
    p = wire.Pull(
        1,
        wire.VERSION,
        kv.model_id,
        kv.namespace or "",
        kv_layout(kv),
        wire.pack_u64(hashes),
        start,
        time.time(),
        uuid.uuid4().hex,
    )
    for k, v in change.items():
        setattr(p, k, v)
    if secret:
        p.mac = wire.mac_of(p, secret)
    return p


def test_requests_without_proof_or_for_other_blocks_are_refused_and_pin_nothing(pair, tmp_path):
    a, b, source, receiver = pair
    tokens = tokens_of(3, 10)
    a.store(tokens)
    cases = {
        "unsigned": _pull(a.kv, tokens, secret=None),
        "forged": _pull(a.kv, tokens, secret=b"another deployment"),
        "version": _pull(a.kv, tokens, version=wire.VERSION + 1),
        "namespace": _pull(a.kv, tokens, tenant="another-tenant"),
        "stale": _pull(a.kv, tokens, sent_unix=time.time() - 3600),
        "malformed": _pull(a.kv, tokens, start=10),
    }
    signed_then_changed = _pull(a.kv, tokens)
    signed_then_changed.tenant = "another-tenant"  # a tenant edited after signing
    cases["forged "] = signed_then_changed
    with _raw(source) as sock:
        for want, pull in cases.items():
            reply = _ask(sock, pull)
            assert isinstance(reply, wire.Refused) and reply.reason == want.strip(), (want, reply)
        replay = _pull(a.kv, tokens)
        assert isinstance(_ask(sock, replay), wire.Pinned)
        sock.sendall(wire.encode(wire.Release(1)))
        wait_until("the first pin released", lambda: no_pins(source, a), timeout=10)
        assert _ask(sock, replay).reason == "stale"  # the same request again: a replay
    # A receiver of another tenant, model or secret gets nothing, and its staged blocks roll back.
    for name, kw, secret, why in (
        ("t", dict(tenant="other"), SECRET, "namespace"),
        ("m", dict(model_id="other-weights"), SECRET, "namespace"),
        ("s", {}, b"wrong", "forged"),
        ("n", {}, None, "unsigned"),
    ):
        w = Worker(tmp_path, name, **kw)
        try:
            r = PeerReceiver(w.kv, w.agent, secret).pull(source.endpoint, tokens)
            assert not r.ok and r.why == why and r.blocks == 0, (name, r)
            assert w.kv.match(tokens)["host"] == 0
            assert_no_leaks(w.kv)
        finally:
            w.close()
    assert no_pins(source, a) and source.stats.pins == 1


def test_oversized_and_garbage_requests_are_refused(tmp_path):
    a = Worker(tmp_path, "a")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(max_blocks_per_pull=8))
    try:
        tokens = tokens_of(4, 10)
        a.store(tokens)
        with _raw(source) as sock:
            assert _ask(sock, _pull(a.kv, tokens)).reason == "oversized"
            assert isinstance(_ask(sock, _pull(a.kv, tokens, start=2)), wire.Pinned)  # 8 blocks past start
        with _raw(source) as sock:
            sock.sendall(b"\x05\x00\x00\x00hello")
            assert sock.recv(1) == b""  # the source closes a connection that speaks garbage
        with _raw(source) as sock:
            sock.sendall((64 << 20).to_bytes(4, "little"))
            assert sock.recv(1) == b""
        wait_until("garbage counted", lambda: source.stats.refused.get("malformed") == 2, timeout=10)
        wait_until("no pins", lambda: no_pins(source, a), timeout=10)
    finally:
        source.close()
        a.close()


def test_a_pin_holds_its_blocks_until_its_lease_ends_or_its_connection_closes(tmp_path):
    a = Worker(tmp_path, "a")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(lease_s=1.5, max_pinned_blocks=64))
    try:
        tokens = tokens_of(5, 12)
        a.store(tokens)
        sock = _raw(source)
        t0 = time.monotonic()
        pinned = _ask(sock, _pull(a.kv, tokens))
        assert isinstance(pinned, wire.Pinned) and source.stats.pinned_blocks == 12
        assert a.kv.evict("host") == 0  # pinned: nothing of it goes
        wait_until("the lease's end", lambda: no_pins(source, a), timeout=10, every=0.02)
        assert time.monotonic() - t0 >= 1.5 - 0.05 and source.stats.expired == 1
        assert a.kv.evict("host") == 12  # free again
        a.store(tokens)
        assert isinstance(_ask(sock, _pull(a.kv, tokens)), wire.Pinned)
        sock.close()  # the receiver dies: its pin ends with its connection, not its lease
        wait_until("the pin dropped", lambda: no_pins(source, a), timeout=1.0, every=0.01)
        assert source.stats.dropped == 1
    finally:
        source.close()
        a.close()


def test_a_flood_of_pins_is_bounded_per_peer_in_total_and_in_connections(tmp_path):
    """Pins are bounded per connection and in all; connections too, but a full table makes room by
    closing the connection idle longest that pins nothing (a receiver keeps its link between
    pulls and reconnects), so idle links never lock a member out; only when every connection
    holds a pin is a new one refused."""
    a = Worker(tmp_path, "a")
    limits = SourceLimits(lease_s=30.0, max_peers=3, max_pins_per_peer=2, max_pinned_blocks=40)
    source = PeerSource(a.kv, a.agent, SECRET, limits=limits)
    socks = []
    try:
        prompts = [tokens_of(100 + i, 10) for i in range(4)]
        for t in prompts:
            a.store(t)
        socks = [_raw(source) for _ in range(3)]
        first = [_ask(socks[0], _pull(a.kv, t, id=i)) for i, t in enumerate(prompts[:3])]
        assert [type(x).__name__ for x in first] == ["Pinned", "Pinned", "Refused"]  # 2 per peer
        second = _ask(socks[1], _pull(a.kv, prompts[2]))
        assert isinstance(second, wire.Pinned) and len(second.slots) // 8 == 10
        third = _ask(socks[2], _pull(a.kv, prompts[3], id=7))
        assert isinstance(third, wire.Pinned) and len(third.slots) // 8 == 10  # 40 blocks in all
        assert _ask(socks[2], _pull(a.kv, prompts[0], id=8)).reason == "busy"
        assert source.stats.pinned_blocks == 40
        with _raw(source) as extra:  # every connection pins: a fourth is refused at once
            header = extra.recv(wire.HEADER_BYTES, socket.MSG_WAITALL)
            reply = wire.decode_to_receiver(extra.recv(wire.peer_frame_length(header), socket.MSG_WAITALL))
            assert reply.reason == "busy" and extra.recv(1) == b""
        socks[2].sendall(wire.encode(wire.Release(7)))
        wait_until("the third peer's pin released", lambda: source.stats.pinned_blocks == 30, timeout=10)
        with _raw(source) as late:  # the third peer pins nothing now: its slot is the newcomer's
            assert socks[2].recv(1) == b""
            pinned = _ask(late, _pull(a.kv, prompts[3]))
            assert isinstance(pinned, wire.Pinned) and len(pinned.slots) // 8 == 10
        for s in socks:
            s.close()
        wait_until("every pin dropped", lambda: no_pins(source, a), timeout=10)
        assert source.stats.refused["busy"] == 3
    finally:
        for s in socks:
            s.close()
        source.close()
        a.close()


def test_a_refused_pull_is_no_rollback_and_a_failed_read_is(pair, monkeypatch):
    """A source that holds none of the blocks (not_held) refuses before any byte moves: the blocks
    staged for it are released without counting as rolled back (the receiver's stats would read
    as failed copies). A read that fails its checksum rolls back what it wrote, counted."""
    a, b, source, receiver = pair

    def rolled_back() -> int:
        return b.kv.stats().host.rolled_back_blocks

    tokens = tokens_of(41, 8)
    r = receiver.pull(source.endpoint, tokens)  # a never stored these
    assert (r.ok, r.why, r.blocks) == (False, "not_held", 0)
    assert rolled_back() == 0 and b.kv.match(tokens)["host"] == 0
    a.store(tokens)
    real = b.agent.pull

    def corrupt_block_3(src, remote, local, timeout, **kw):
        host = a.kv.host
        host.array[remote[3] * host.layout.block_bytes + 7] ^= 0xFF
        return real(src, remote, local, timeout, **kw)

    monkeypatch.setattr(b.agent, "pull", corrupt_block_3)
    r = receiver.pull(source.endpoint, tokens)
    assert (r.why, r.blocks) == ("corrupt", 3)
    assert rolled_back() == 5  # the 5 blocks read from block 3 on
    assert_no_leaks(b.kv)


def test_bytes_changed_under_a_pin_fail_their_checksum_and_only_the_good_head_is_used(pair, monkeypatch):
    a, b, source, receiver = pair
    tokens = tokens_of(9, 10)
    a.store(tokens)
    real = b.agent.pull

    def change_block_6_then_read(src, remote, local, timeout, **kw):
        host = a.kv.host
        slot = remote[6]
        bb = host.layout.block_bytes
        host.array[slot * bb + 100] ^= 0xFF  # the source's memory changes after its checksum was sent
        return real(src, remote, local, timeout, **kw)

    monkeypatch.setattr(b.agent, "pull", change_block_6_then_read)
    r = receiver.pull(source.endpoint, tokens)
    assert not r.ok and r.why == "corrupt" and r.blocks == 6
    assert b.kv.match(tokens)["host"] == 6 * TPB  # the verified head only
    assert receiver.stats.failed == {"corrupt": 1}
    assert_no_leaks(b.kv)
    wait_until("released", lambda: no_pins(source, a), timeout=10)


def test_a_read_nixl_will_not_cancel_keeps_its_staged_blocks_out_of_use_for_good(pair, monkeypatch):
    """NIXL refuses to release a read that timed out and reports it running past the settle time
    (fault injected on the real agent): the pull is a miss counted ``uncancelled``, and the host
    blocks it staged stay unready for good: nothing becomes visible, and a host tier filled
    several times over by later stores never reuses them (a late byte could land there)."""
    from dynamo_flexkv.core.transfer import nixl_agent

    a, b, source, receiver = pair
    tokens = tokens_of(21, 10)
    a.store(tokens)
    nixl = b.agent.agent
    release, state = nixl.release_xfer_handle, nixl.check_xfer_state

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: cannot cancel")  # what NIXL raises for a busy handle

    monkeypatch.setattr(nixl_agent, "SETTLE_S", 0.3)
    monkeypatch.setattr(nixl, "release_xfer_handle", refuse)
    monkeypatch.setattr(nixl, "check_xfer_state", lambda handle: "PROC")
    r = receiver.pull(source.endpoint, tokens, timeout=1.0)
    assert not r.ok and r.why == "uncancelled" and r.blocks == 0, r
    assert receiver.stats.failed == {"uncancelled": 1} and b.agent.uncancelled == 1
    assert b.kv.match(tokens)["host"] == 0  # nothing of it visible
    [(_key, run)] = receiver.quarantined
    kept = list(run.block_ids)
    assert len(kept) == 10
    bb = b.kv.host.layout.block_bytes
    for slot in kept:
        b.kv.host.array[slot * bb : (slot + 1) * bb] = 0xA5  # what a late write could have left
    monkeypatch.setattr(nixl, "release_xfer_handle", release)
    monkeypatch.setattr(nixl, "check_xfer_state", state)
    for seed in range(100, 130):  # 30 prompts of 8 blocks through a 96-block host tier
        b.store(tokens_of(seed, 8))
    assert all((b.kv.host.array[slot * bb : (slot + 1) * bb] == 0xA5).all() for slot in kept)
    assert b.kv.match(tokens)["host"] == 0
    other = tokens_of(22, 4)
    a.store(other)
    again = receiver.pull(source.endpoint, other)
    assert again.ok and again.blocks == 4  # the receiver goes on pulling other prompts
    wait_until("the source's pins released", lambda: source.stats.pinned_blocks == 0, timeout=10)


def test_a_read_whose_release_nixl_refuses_once_but_that_ended_is_used(pair, monkeypatch):
    """A release NIXL refuses while the read is already over (done): settled at once, the pull's
    blocks are verified and visible as usual, nothing is held back."""
    a, b, source, receiver = pair
    tokens = tokens_of(23, 12)
    a.store(tokens)
    nixl = b.agent.agent
    release, refused = nixl.release_xfer_handle, []

    def refuse_first(handle):
        if not refused:
            refused.append(handle)
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: cannot cancel")
        return release(handle)

    monkeypatch.setattr(nixl, "release_xfer_handle", refuse_first)
    r = receiver.pull(source.endpoint, tokens)
    assert r.ok and r.blocks == 12 and refused, r
    assert receiver.quarantined == [] and b.agent.uncancelled == 0
    assert b.loads(tokens)
    assert_no_leaks(b.kv)


def test_a_source_killed_mid_pull_is_a_miss_that_leaves_nothing_behind(tmp_path, monkeypatch):
    b = Worker(tmp_path, "b")
    here = str(HELPERS)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(here, "peer_source_proc.py"), str(tmp_path / "a"), SECRET.decode(), "7", "24"],
        stdout=subprocess.PIPE,
        cwd=here,
        env=dict(os.environ, PYTHONPATH=here),
    )
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    try:
        line = b""
        while not line.startswith(b"{"):  # NIXL logs on stdout too
            line = proc.stdout.readline()
            assert line, "the source process ended before it served"
        endpoint = json.loads(line)["endpoint"]
        tokens = list(range(7, 7 + 16 * 24))
        warm = receiver.pull(endpoint, tokens, blocks=2)  # the agents connected: the kill lands in a read
        assert warm.ok and warm.blocks == 2
        real = b.agent.pull

        def kill_then_read(src, remote, local, timeout, **kw):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            return real(src, remote, local, timeout, **kw)

        monkeypatch.setattr(b.agent, "pull", kill_then_read)
        t0 = time.monotonic()
        r = receiver.pull(endpoint, tokens, timeout=5.0)
        assert not r.ok and r.why in ("failed", "timeout") and r.blocks == 0, r
        assert time.monotonic() - t0 < 6.0  # never past the pull's timeout
        assert b.kv.match(tokens)["host"] == 2 * TPB  # nothing of the killed pull is visible
        assert_no_leaks(b.kv)
        again = receiver.pull(endpoint, tokens, timeout=2.0)
        assert not again.ok and again.why == "source_gone"
        assert_no_leaks(b.kv)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        receiver.close()
        b.close()


def test_the_load_policy_decides_pull_versus_recompute_with_the_pulls_measured_speed(pair):
    """Asked with the prompt's length, the receiver pulls while the peer link is unmeasured (and
    the pull measures it: tier_costs' ``peer``); with the link measured slower than the engine's
    prefill, it pulls nothing (decision ``slower``, counted as skipped), and the blocks stay a miss."""
    a, b, source, receiver = pair
    first, second = tokens_of(11, 8), tokens_of(12, 8)
    a.store(first)
    a.store(second)
    r = receiver.pull(source.endpoint, first, prompt_tokens=len(first) + 1)
    assert (r.ok, r.blocks, r.decision) == (True, 8, "cold_start")
    assert "peer" in b.kv.stats().tier_costs
    assert b.loads(first)  # measures the host link too
    for n in (64, 512, 2048):  # a very fast engine: recomputing 8 blocks costs microseconds
        b.kv.observe_prefill(n, 4096, n * 1e-9)
    for blocks in (1, 4, 8):  # and a slow link: 1 MB/s after 50 ms
        b.kv.cost.observe_link("peer", blocks * b.kv.host.layout.block_bytes, 0.05 + blocks * 24576 / 1e6)
    r = receiver.pull(source.endpoint, second, prompt_tokens=len(second) + 1)
    assert (r.ok, r.blocks, r.decision) == (True, 0, "slower")
    assert receiver.stats.skipped == 1 and b.kv.match(second)["host"] == 0
    assert no_pins(source, a)


def test_a_source_needs_the_deployment_secret(tmp_path):
    a = Worker(tmp_path, "a")
    try:
        with pytest.raises(ValueError, match="FLEXKV_HANDOVER_SECRET"):
            PeerSource(a.kv, a.agent, None)
    finally:
        a.close()


def test_pull_of_an_8k_prefix_against_the_receivers_own_host_tier(tmp_path, capsys):
    """Not a pass/fail bench: the numbers beside each other in one run, printed (docs/HINTS.md).
    hinted: pull the prefix into host, then load it host->device; host: load the same prefix
    again from the receiver's own host tier. The agents connect in a warm-up pull first."""
    blocks = 8192 // TPB
    a, b = Worker(tmp_path, "a", host_blocks=2 * blocks), Worker(tmp_path, "b", host_blocks=2 * blocks)
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(max_pinned_blocks=blocks))
    receiver = PeerReceiver(b.kv, b.agent, SECRET)

    def load(tokens) -> float:
        t0 = time.perf_counter()
        tid = b.kv.get_async(tokens, list(range(blocks)))
        assert b.kv.wait([tid])[tid].num_tokens == blocks * TPB
        return time.perf_counter() - t0

    rows = []
    try:
        warm = tokens_of(499, blocks)
        a.store(warm)
        assert receiver.pull(source.endpoint, warm).ok
        load(warm)
        for run in range(2):
            tokens = tokens_of(500 + run, blocks)
            a.store(tokens)
            t0 = time.perf_counter()
            r = receiver.pull(source.endpoint, tokens)
            pull_s = time.perf_counter() - t0
            assert r.ok and r.blocks == blocks
            hinted_s = pull_s + load(tokens)
            host_s = load(tokens)
            rows.append((run, r.nbytes, pull_s, hinted_s, host_s))
        with capsys.disabled():
            for run, nbytes, pull_s, hinted_s, host_s in rows:
                print(
                    f"\npull-8k run {run}: {nbytes / 2**20:.1f} MiB pulled in {pull_s * 1e3:.1f} ms "
                    f"({nbytes / pull_s / 1e9:.2f} GB/s); pull+load {hinted_s * 1e3:.1f} ms, load from own "
                    f"host {host_s * 1e3:.1f} ms: pull-vs-host {hinted_s / host_s:.2f}"
                )
    finally:
        receiver.close()
        source.close()
        b.close()
        a.close()


def test_a_source_that_never_answers_is_a_timeout_within_the_pulls_time(tmp_path):
    """A hung source (it accepts, as the kernel does for a stopped process, and never answers) costs
    the pull's timeout and is counted as one, not as a source that is gone."""
    b = Worker(tmp_path, "b")
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.monotonic()
        r = receiver.pull(f"tcp://127.0.0.1:{silent.getsockname()[1]}", list(range(16 * 4)), timeout=0.5)
        took = time.monotonic() - t0
    assert not r.ok and r.why == "timeout" and r.blocks == 0, r
    assert took < 2.0
    assert receiver.stats.failed == {"timeout": 1}
    assert_no_leaks(b.kv)


def test_a_closed_receiver_connects_nowhere_and_a_source_whose_tiers_shut_down_refuses(tmp_path):
    """close() before shutdown is the contract's order; called the other way round, nothing
    crashes: a closed receiver's pull fails at once (``closed``) without a connection, and a source
    whose tiers shut down under it refuses the pull (``closed``) instead of dying in its thread."""
    a, b = Worker(tmp_path, "a"), Worker(tmp_path, "b")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(lease_s=10.0))
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    try:
        tokens = tokens_of(21, 6)
        a.store(tokens)
        receiver.close()
        r = receiver.pull(source.endpoint, tokens)
        assert (r.ok, r.blocks, r.why) == (False, 0, "closed")
        assert source.stats.pins == 0 and not source._conns
        a.kv.shutdown()
        with _raw(source) as sock:
            assert _ask(sock, _pull(b.kv, tokens)).reason == "closed"
        assert source.stats.refused == {"closed": 1} and source.stats.pinned_blocks == 0
    finally:
        source.close()
        b.close()
        a.agent.close()


def test_a_receiver_whose_idle_link_the_source_closed_pulls_again_on_a_new_one(tmp_path):
    a, b = Worker(tmp_path, "a"), Worker(tmp_path, "b")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(lease_s=10.0, max_peers=1))
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    try:
        first, second = tokens_of(31, 4), tokens_of(32, 4)
        a.store(first)
        a.store(second)
        assert receiver.pull(source.endpoint, first).blocks == 4  # its link stays open, idle
        wait_until("the receiver's pin released", lambda: no_pins(source, a), timeout=10)  # unpinned: evictable
        with _raw(source) as other:  # the one slot goes to a newcomer: the idle link is closed
            assert isinstance(_ask(other, _pull(a.kv, first)), wire.Pinned)  # served, not refused
        wait_until("the newcomer gone, its pin dropped", lambda: no_pins(source, a) and not source._conns, timeout=10)
        r = receiver.pull(source.endpoint, second)
        assert (r.ok, r.blocks, r.why) == (True, 4, "") and b.loads(second)
    finally:
        receiver.close()
        source.close()
        b.close()
        a.close()


def _refuse_to_cancel(monkeypatch, b, state=lambda handle: "PROC") -> None:
    """Every read NIXL is asked to release is refused and reported ``state`` (fault on the real agent)."""
    from dynamo_flexkv.core.transfer import nixl_agent

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: cannot cancel")

    monkeypatch.setattr(nixl_agent, "SETTLE_S", 0.2)
    monkeypatch.setattr(b.agent.agent, "release_xfer_handle", refuse)
    monkeypatch.setattr(b.agent.agent, "check_xfer_state", state)


def test_a_read_whose_state_nixl_cannot_tell_is_quarantined_and_the_source_unpinned(pair, monkeypatch):
    """Release refused and check_xfer_state raising: the pull is a miss (never raises), its staged
    blocks are quarantined (the read may still write), the source's pins end."""
    a, b, source, receiver = pair
    tokens = tokens_of(31, 10)
    a.store(tokens)

    def unknown(handle):
        raise RuntimeError("NIXL_ERR_BACKEND")

    _refuse_to_cancel(monkeypatch, b, unknown)
    r = receiver.pull(source.endpoint, tokens, timeout=1.0)
    assert not r.ok and r.blocks == 0, r
    assert r.why == "uncancelled" and len(receiver.quarantined) == 1, r
    assert b.kv.match(tokens)["host"] == 0
    wait_until("the source's pins released", lambda: no_pins(source, a), timeout=15)


def test_quarantined_pulls_stop_at_a_quarter_of_the_host_tier_and_shut_down(pair, monkeypatch):
    """Pull after pull NIXL will not cancel: each quarantines 10 of the 96 host blocks until they
    hold a quarter of the tier; then the receiver pulls no more (``uncancelled`` at once, without
    asking the source); other prompts still store and load exact in the rest; drain,
    receiver.close() and the manager's shutdown end promptly."""
    a, b, source, receiver = pair
    _refuse_to_cancel(monkeypatch, b)
    whys = []
    for seed in range(40, 52):
        tokens = tokens_of(seed, 10)
        a.store(tokens)
        r = receiver.pull(source.endpoint, tokens, timeout=0.5)
        assert not r.ok and r.blocks == 0, r
        whys.append(r.why)
        wait_until("the source's pins released", lambda: no_pins(source, a), timeout=15)
    assert whys == ["uncancelled"] * 12, whys
    assert [len(run) for _k, run in receiver.quarantined] == [10] * 3  # 30 >= 96 / 4: no more pulls
    assert source.stats.pins == 3  # the later ones never reached the source
    small = tokens_of(60, 4)  # the other 66 host blocks still serve
    b.store(small)
    assert b.loads(small)
    assert b.kv.drain(timeout=10)
    t0 = time.monotonic()
    receiver.close()
    assert receiver.pull(source.endpoint, small).why == "closed"
    b.kv.shutdown()
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("stuck_chunk", [None, 0, 2])
def test_a_chunked_read_with_refused_releases(pair, monkeypatch, stuck_chunk):
    """KVAgent.pull in 3 chunks, every release refused: with all reads done the bytes are exact and
    every chunk was handed to ``landed`` in order; with one chunk still running it raises
    ReadNotCancelled (never HandoverFailed alone, never a hang) and counts it once."""
    from dynamo_flexkv.core.peer.receiver import RemoteHost
    from dynamo_flexkv.core.transfer import nixl_agent
    from dynamo_flexkv.core.transfer.nixl_errors import ReadNotCancelled

    a, b, _source, _receiver = pair
    a.store(tokens_of(70, 12))
    slots = list(range(12))  # any source host blocks: the check compares bytes, whatever they hold
    src = RemoteHost(
        a.agent.name, a.agent.metadata, [a.kv.host.base], a.kv.host.layout.block_bytes, a.kv.host.num_blocks
    )
    nixl = b.agent.agent
    real_state, handles_seen = nixl.check_xfer_state, []

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: cannot cancel")

    def state(handle):
        if handle not in handles_seen:
            handles_seen.append(handle)
        s = real_state(handle)
        return "PROC" if stuck_chunk is not None and handles_seen.index(handle) == stuck_chunk else s

    monkeypatch.setattr(nixl_agent, "SETTLE_S", 0.2)
    monkeypatch.setattr(nixl, "release_xfer_handle", refuse)
    monkeypatch.setattr(nixl, "check_xfer_state", state)
    local = list(range(50, 62))
    landed: list = []
    if stuck_chunk is None:
        n = b.agent.pull(src, slots, local, 5.0, landed=lambda s, e: landed.append((s, e)), chunks=3)
        assert n > 0 and landed == [(0, 4), (4, 8), (8, 12)] and b.agent.uncancelled == 0
        bb = a.kv.host.layout.block_bytes
        for r, dst in zip(slots, local):
            assert (a.kv.host.array[r * bb : (r + 1) * bb] == b.kv.host.array[dst * bb : (dst + 1) * bb]).all()
    else:
        t0 = time.monotonic()
        with pytest.raises(ReadNotCancelled):
            b.agent.pull(src, slots, local, 0.5, landed=lambda s, e: landed.append((s, e)), chunks=3)
        assert time.monotonic() - t0 < 5 and b.agent.uncancelled == 1
