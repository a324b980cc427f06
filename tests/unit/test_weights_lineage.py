"""Keys that carry the weights they came from (KVManager.weights_changed, the disk journal's
lineage): after a weight update no block computed before is returned, from host or disk; the
router is told they are gone at once; a restart with the new weights adopts none of the old ones."""

from __future__ import annotations

import pytest
from kv_helpers import MODEL, TPB, config, device_tensors, fill, holds, store_and_drain
from node_helpers import Held

from dynamo_flexkv import KVLayoutType, KVManager

L = KVLayoutType.LAYERBLOCK


def prompt(k: int, blocks: int) -> list:
    return list(range(k * 100_000, k * 100_000 + TPB * blocks))


def manager(path, listener=None, **kw):
    kv = KVManager(MODEL, config(path), listener=listener, **kw)
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    return kv, dev


store = store_and_drain


def loaded(kv, dev, tokens, ids) -> int:
    """Blocks a get brings back, each checked byte for byte against what was stored for it."""
    r = next(iter(kv.wait([kv.get_async(tokens, ids)], timeout=20).values()))
    n = r.num_tokens // TPB
    hashes = kv.hashes(tokens).sequence
    assert all(holds(dev, L, ids[i], hashes[i]) for i in range(n))
    return n


def test_after_a_weight_change_no_old_block_is_returned_and_the_router_forgets_them(tmp_path):
    held = Held()
    kv, dev = manager(tmp_path, held, model_id="weights-A")
    try:
        p = prompt(1, 6)
        store(kv, dev, p, list(range(6)))
        old = [int(h) for h in kv.hashes(p).sequence]
        assert held.prefix(("host",), old) == 6 and held.prefix(("disk",), old) == 6
        assert kv.weights_changed("B") == 12  # six on host, six on disk
        assert held.prefix(("host",), old) == 0 and held.prefix(("disk",), old) == 0  # the router's view
        assert kv.match(p) == {"host": 0, "disk": 0} and kv.invalidated_blocks == 12
        assert [int(h) for h in kv.hashes(p).sequence] != old  # every tier's key carries the weights
        assert loaded(kv, dev, p, list(range(10, 16))) == 0
        store(kv, dev, p, list(range(6)))  # computed again with B: cached again
        assert loaded(kv, dev, p, list(range(10, 16))) == 6
        assert kv.weights_changed("B") == 0  # the same weights again: nothing to drop
        with pytest.raises(ValueError, match="non-empty string"):
            kv.weights_changed("")
    finally:
        kv.shutdown()


def test_a_restart_with_other_weights_starts_and_adopts_no_old_block(tmp_path):
    kv, dev = manager(tmp_path, model_id="weights-A")
    store(kv, dev, prompt(1, 4), [0, 1, 2, 3])
    kv.shutdown()
    # New weights on the same SSD directory (a new digest in the model's identity): it starts.
    kv, dev = manager(tmp_path, model_id="weights-B")
    try:
        assert kv.adopt_report.stale == 4 and not kv.adopt_report.adopted
        assert kv.match(prompt(1, 4))["disk"] == 0
        kv.weights_changed("step-2")  # an update at run time, then blocks of step 2
        store(kv, dev, prompt(2, 3), [0, 1, 2])
    finally:
        kv.shutdown()
    kv, dev = manager(tmp_path, model_id="weights-B", weights_version="step-2")  # restarted on step 2
    try:
        assert len(kv.adopt_report.adopted) == 3 and kv.adopt_report.stale == 0
        assert loaded(kv, dev, prompt(2, 3), [5, 6, 7]) == 3
    finally:
        kv.shutdown()
    kv, dev = manager(tmp_path, model_id="weights-B")  # restarted on the weights before step 2
    try:
        assert kv.adopt_report.stale == 3 and kv.match(prompt(2, 3))["disk"] == 0
    finally:
        kv.shutdown()


def test_a_weight_change_cancels_the_copies_of_old_kv_in_flight(tmp_path):
    kv, dev = manager(tmp_path, model_id="weights-A")
    try:
        p = prompt(3, 8)
        hashes = kv.hashes(p).sequence
        for i in range(8):
            fill(dev, L, i, hashes[i])
        put = kv.put_async(p, list(range(8)))
        kv.weights_changed("B")
        kv.wait([put], timeout=20)
        assert kv.drain(20) and kv.match(p) == {"host": 0, "disk": 0}
        st = kv.stats()
        assert st.tasks.in_flight == 0
    finally:
        kv.shutdown()


def test_every_block_that_leaves_a_tier_says_why(tmp_path):
    """Evicted (no copy below), demoted (the disk keeps it), invalidated (the weights changed),
    cleared (a reset): told apart in the stats the metrics are made of."""
    kv = KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=64))
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    try:
        for k in range(4):  # 24 blocks through an 8-block host tier: the older ones move down
            store(kv, dev, prompt(10 + k, 6), list(range(6)))
        host = kv.stats().host.removed_blocks
        assert host.get("demoted", 0) >= 16 and "evicted" not in host and "invalidated" not in host
        before = kv.stats()
        assert kv.weights_changed("B") == before.disk.ready_blocks + before.host.ready_blocks
        st = kv.stats()
        assert st.disk.removed_blocks == {"invalidated": before.disk.ready_blocks}
        assert st.host.removed_blocks["invalidated"] == before.host.ready_blocks > 0
        store(kv, dev, prompt(20, 6), list(range(6)))
        assert kv.drain(20)
        kv.reset()
        assert kv.stats().disk.removed_blocks["cleared"] == 6 and kv.stats().host.removed_blocks["cleared"] == 6
    finally:
        kv.shutdown()


def test_a_namespace_cannot_spell_another_namespace_with_weights(tmp_path):
    """The salt is a JSON pair once the weights changed: namespace "weights:v2" (or "a/weights:v2")
    never hashes like namespace "" (or "a") at weights version "v2"."""
    plain = KVManager(MODEL, config(tmp_path / "1", disk_blocks=0), namespace="weights:v2")
    versioned = KVManager(MODEL, config(tmp_path / "2", disk_blocks=0), weights_version="v2")
    try:
        p = prompt(30, 2)
        assert list(plain.hashes(p).sequence) != list(versioned.hashes(p).sequence)
    finally:
        plain.shutdown()
        versioned.shutdown()
