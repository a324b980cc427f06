"""What is cached and clearing it (core/inventory.py, KVManager.contents / prefix_blocks / clear):
counts, bytes and ages per tier, a prompt's blocks per tier, and a clear that takes what is free,
keeps what a load reads (and says why), and reports its removals as cleared."""

import threading

import numpy as np
import pytest
from kv_helpers import BLOCK_BYTES, MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds
from redis_fixtures import needs_redis, redis_server  # noqa: F401 (fixtures)

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.core.inventory import (
    REMOTE_NOT_CLEARED,
    BadCacheRequest,
    CacheReport,
    CacheRequest,
    parse_report,
    parse_request,
    to_builtins,
)
from dynamo_flexkv.core.transfer.graph import OpKind

LAYOUT = KVLayoutType.LAYERBLOCK
DEVICE_BLOCKS = 64


class _Gated:
    """A host->device mover that waits for ``gate`` before it moves a byte: a load held in flight."""

    def __init__(self, inner, gate: threading.Event, entered: threading.Event) -> None:
        self.inner, self.gate, self.entered = inner, gate, entered

    def run(self, op):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.run(op)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Removals:
    """The index listener: what the router would hear."""

    def __init__(self) -> None:
        self.removed: dict = {}

    def on_stored(self, tier, run) -> None:
        pass

    def on_removed(self, tier, hashes) -> None:
        self.removed.setdefault(tier.value, []).extend(hashes)


@pytest.fixture
def gated(tmp_path):
    gate, entered = threading.Event(), threading.Event()
    gate.set()  # open unless a test closes it

    def hook(kind, mover):
        return _Gated(mover, gate, entered) if kind is OpKind.H2D else mover

    events = Removals()
    kv = KVManager(MODEL, config(tmp_path), listener=events, mover_hook=hook, model_id="m1")
    dev = device_tensors(LAYOUT, DEVICE_BLOCKS)
    kv.register_device_cache(dev, LAYOUT)
    yield kv, dev, gate, entered, events
    gate.set()
    kv.shutdown()


def _store(kv, dev, prompt, first_block):
    seq = kv.hashes(prompt).sequence
    ids = list(range(first_block, first_block + len(seq)))
    for b, h in zip(ids, seq):
        fill(dev, LAYOUT, b, int(h))
    t = kv.put_async(prompt, ids)
    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
    assert kv.drain(30)  # the disk copies landed too
    return seq


def test_contents_counts_bytes_and_ages_per_tier(gated):
    kv, dev, *_ = gated
    empty = kv.contents()
    assert [t.tier for t in empty.tiers] == ["host", "disk"]
    assert all(t.blocks == 0 and t.oldest_s is None and t.newest_s is None for t in empty.tiers)
    assert empty.tier("host").capacity_blocks == 24 and empty.tier("host").block_bytes == BLOCK_BYTES
    rng = np.random.default_rng(0)
    _store(kv, dev, rng.integers(0, 1000, 5 * TPB + 3).tolist(), 0)
    _store(kv, dev, rng.integers(0, 1000, 3 * TPB).tolist(), 10)
    c = kv.contents()
    assert c.model_id == "m1" and c.tenant == ""
    for name in ("host", "disk"):
        t = c.tier(name)
        assert (t.blocks, t.ready, t.filling, t.in_use) == (8, 8, 0, 0)
        assert t.bytes == 8 * BLOCK_BYTES
        assert 0 <= t.newest_s <= t.oldest_s < 30


def test_prefix_blocks_show_which_tier_holds_which_block(gated):
    kv, dev, *_ = gated
    prompt = np.random.default_rng(1).integers(0, 1000, 6 * TPB + 5).tolist()
    assert kv.prefix_blocks(prompt).held == {"host": 0, "disk": 0}
    seq = _store(kv, dev, prompt[: 4 * TPB], 0)  # the first 4 of its 6 full blocks
    p = kv.prefix_blocks(prompt)
    assert p.tokens == len(prompt) and p.tokens_per_block == TPB and len(p.hashes) == 6
    assert p.hashes[:4] == [int(h) for h in seq]
    assert p.held == {"host": 4, "disk": 4}
    assert p.runs() == [(0, 4, ["host", "disk"]), (4, 6, [])]
    kv.clear(["host"])
    assert kv.prefix_blocks(prompt).runs() == [(0, 4, ["disk"]), (4, 6, [])]
    # Looking changes nothing: no hit counted, no block touched.
    assert kv.stats().host.hit_blocks == 0 and kv.stats().disk.hit_blocks == 0


def test_clear_takes_what_is_free_and_keeps_what_a_load_reads(gated):
    kv, dev, gate, entered, events = gated
    rng = np.random.default_rng(2)
    a = rng.integers(0, 1000, 6 * TPB).tolist()
    b = rng.integers(0, 1000, 4 * TPB).tolist()
    seq_a, seq_b = _store(kv, dev, a, 0), _store(kv, dev, b, 10)
    evicted_before = kv.stats().host.evicted_blocks
    gate.clear()
    t = kv.get_async(a, list(range(20, 26)), layerwise=False)  # reads a's 6 host blocks, held at the gate
    assert entered.wait(10)
    done = kv.clear()
    by_tier = {c.tier: c for c in done.tiers}
    # b everywhere and a's disk copies were free; a's host blocks are read now: kept, in use (the
    # first five are also parents of the next one, which a tier keeps prefix-closed).
    assert by_tier["host"].cleared == 4 and by_tier["host"].kept == {"in_use": 6}
    assert by_tier["disk"].cleared == 10 and by_tier["disk"].kept == {}
    assert done.note is None  # no remote tier here
    assert kv.prefix_blocks(b).held == {"host": 0, "disk": 0}
    assert kv.prefix_blocks(a).held == {"host": 6, "disk": 0}
    gate.set()
    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS  # the load was never raced
    assert all(holds(dev, LAYOUT, 20 + i, int(h)) for i, h in enumerate(seq_a))
    s = kv.stats()
    assert s.host.removed_blocks.get("cleared") == 4 and s.disk.removed_blocks.get("cleared") == 10
    assert s.host.evicted_blocks == evicted_before  # a clear is not the policy's eviction
    assert sorted(events.removed["host"]) == sorted(int(h) for h in seq_b)  # what the router hears
    again = kv.clear(["host"])  # the load is done: nothing keeps them now
    assert [(c.tier, c.cleared, c.kept) for c in again.tiers] == [("host", 6, {})]
    assert all(t.blocks == 0 for t in kv.contents().tiers)
    assert_no_leaks(kv)


def test_clear_waits_for_the_disk_writes_in_flight(tmp_path):
    kv = KVManager(MODEL, config(tmp_path))
    try:
        dev = device_tensors(LAYOUT, DEVICE_BLOCKS)
        kv.register_device_cache(dev, LAYOUT)
        prompt = list(range(8 * TPB))
        for i, h in enumerate(kv.hashes(prompt).sequence):
            fill(dev, LAYOUT, i, int(h))
        t = kv.put_async(prompt, list(range(8)))
        assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
        done = kv.clear(wait_s=30)  # the disk write may still run: the clear waits for it first
        assert [(c.tier, c.cleared, c.kept) for c in done.tiers] == [("host", 8, {}), ("disk", 8, {})]
    finally:
        kv.shutdown()


def test_a_restarted_manager_adopts_nothing_a_clear_removed(tmp_path):
    kv = KVManager(MODEL, config(tmp_path))
    dev = device_tensors(LAYOUT, DEVICE_BLOCKS)
    kv.register_device_cache(dev, LAYOUT)
    _store(kv, dev, list(range(5 * TPB)), 0)
    kv.clear(["disk"])
    kv.shutdown()
    again = KVManager(MODEL, config(tmp_path))
    try:
        assert again.contents().tier("disk").blocks == 0  # the journal recorded the removals
    finally:
        again.shutdown()


def test_requests_are_checked_with_the_fix_named():
    assert parse_request({}).op == "contents"
    req = parse_request({"op": "clear", "tiers": ["host"]}).check(["device", "host", "disk"])
    assert req.wants("host") and not req.wants("disk")
    with pytest.raises(BadCacheRequest, match="op 'list' is not one of contents, prefix, clear"):
        parse_request({"op": "list"}).check(["host"])
    with pytest.raises(BadCacheRequest, match="tier 'ssd' is not a tier: name one of device, host, disk, remote"):
        parse_request({"op": "clear", "tiers": ["ssd"]}).check(["host"])
    with pytest.raises(BadCacheRequest, match="this target has no disk tier"):
        parse_request({"op": "clear", "tiers": ["disk"]}).check(["host"])
    with pytest.raises(BadCacheRequest, match="op prefix needs the prompt"):
        parse_request({"op": "prefix"}).check(["host"])
    with pytest.raises(BadCacheRequest, match="not a cache request"):
        parse_request({"op": "clear", "tier": "host"})
    with pytest.raises(BadCacheRequest, match="not a cache request"):
        parse_request({"tokens": "1 2 3"})
    assert CacheRequest(op="prefix", tokens=[1, 2]).check(["host"]).tokens == [1, 2]


def test_a_report_survives_json(gated):
    kv, dev, *_ = gated
    _store(kv, dev, list(range(3 * TPB)), 0)
    report = CacheReport("worker (embedded)", "contents", contents=[kv.contents()])
    back = parse_report(to_builtins(report))
    assert back == report and back.contents[0].tier("host").bytes == 3 * BLOCK_BYTES


@needs_redis
@pytest.mark.integration
def test_the_remote_tier_is_probed_and_listed_never_cleared(tmp_path, redis_server):
    from remote_helpers import Engine, manager

    with manager(tmp_path, redis_server.url, namespace="acme") as kv:
        engine = Engine(kv)
        prompt = list(range(4 * TPB + 1))
        engine.put(prompt)
        c = kv.contents()
        assert c.remote is not None and c.remote.startswith("redis://") and c.tenant == "acme"
        assert kv.prefix_blocks(prompt).held == {"host": 4, "remote": 4}
        done = kv.clear()
        assert [(t.tier, t.cleared) for t in done.tiers] == [("host", 4)]
        assert done.note == REMOTE_NOT_CLEARED
        assert kv.prefix_blocks(prompt).held == {"host": 0, "remote": 4}  # a load would read them from remote
        assert kv.clear(["remote"]).tiers == []  # named alone: nothing cleared, the note says why
