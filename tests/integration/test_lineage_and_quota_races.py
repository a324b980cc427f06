"""Races and shared stores around weight lineage and tenant quotas, through public interfaces: a put
hashed before weights_changed, two managers on one Redis, two tenants writing the same prefix."""

from __future__ import annotations

import threading

from kv_helpers import MODEL, TPB, config, device_tensors, fill
from node_helpers import Held

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

L = KVLayoutType.LAYERBLOCK


def prompt(k: int, blocks: int) -> list:
    return list(range(k * 100_000, k * 100_000 + TPB * blocks))


def test_no_old_block_survives_a_weight_change_raced_by_puts(tmp_path):
    """Puts from several threads race weights_changed; once it returned and everything drained,
    no block keyed by the weights before may be held (the listener = the router's view)."""
    held = Held()
    kv = KVManager(MODEL, config(tmp_path, host_blocks=256, disk_blocks=512), listener=held, model_id="A")
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    try:
        for rnd in range(20):
            version = f"v{rnd}"
            prompts = [prompt(rnd * 10 + t, 2) for t in range(4)]
            old = {int(h) for p in prompts for h in kv.hashes(p).sequence}
            start = threading.Barrier(5)
            errors = []

            def worker(t: int) -> None:
                try:
                    start.wait()
                    for _ in range(20):
                        tid = kv.put_async(prompts[t], [t * 2, t * 2 + 1])
                        kv.wait([tid], timeout=20)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
            for th in threads:
                th.start()
            start.wait()
            kv.weights_changed(version)
            for th in threads:
                th.join()
            assert not errors, errors
            assert kv.drain(20)
            stale = old & (held.blocks["host"] | held.blocks["disk"])
            assert not stale, f"round {rnd}: {len(stale)} blocks keyed by the weights before still held"
    finally:
        kv.shutdown()


class _PausingIds:
    """Device block ids whose conversion waits: holds a put between hashing and issuing."""

    def __init__(self, ids, reached: threading.Event, go: threading.Event) -> None:
        self.ids, self.reached, self.go = ids, reached, go

    def __len__(self) -> int:
        return len(self.ids)

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        self.reached.set()
        assert self.go.wait(20)
        return np.asarray(self.ids, dtype=dtype)


def test_a_put_hashed_before_the_change_commits_old_kv_after_it(tmp_path):
    held = Held()
    kv = KVManager(MODEL, config(tmp_path), listener=held, model_id="A")
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    try:
        p = prompt(1, 4)
        old = [int(h) for h in kv.hashes(p).sequence]
        for i in range(4):
            fill(dev, L, i, old[i])
        reached, go = threading.Event(), threading.Event()
        out = {}
        th = threading.Thread(
            target=lambda: out.setdefault("tid", kv.put_async(p, _PausingIds([0, 1, 2, 3], reached, go)))
        )
        th.start()
        assert reached.wait(20)
        kv.weights_changed("B")  # the engine's weights changed; the put of old KV is in flight
        go.set()
        th.join()
        r = kv.wait([out["tid"]], timeout=20)[out["tid"]]
        assert kv.drain(20)
        stale = set(old) & (held.blocks["host"] | held.blocks["disk"])
        assert r.status is not TaskStatus.SUCCESS or not stale, (
            f"put of old KV {r.status}: {len(stale)} blocks keyed by the weights before committed after "
            f"weights_changed returned; stats host used={kv.stats().host.used_blocks}"
        )
    finally:
        kv.shutdown()


# ---- remote tier quota ---------------------------------------------------------------------------
import numpy as np  # noqa: E402
from redis_fixtures import needs_redis, redis_server  # noqa: E402,F401

from dynamo_flexkv.core.remote import HEADER_BYTES, RemoteStore, fingerprint_of  # noqa: E402

SIZE = 32 << 10
VALUE = HEADER_BYTES + SIZE


def rblocks(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 2**63, size=n, dtype=np.uint64), rng.integers(0, 256, size=(n, SIZE), dtype=np.uint8)


@needs_redis
def test_a_tenant_flood_never_deletes_a_block_another_tenant_stored_under_the_same_key(redis_server):
    """Two tenants whose stores share a fingerprint (same model, same or no namespace: the
    fingerprint does not carry remote_tenant) write the same block keys. bolt's flood must not
    delete a block acme accounts for."""
    fp = fingerprint_of({"model": "m", "namespace": ""})
    with (
        RemoteStore.open(redis_server.url, fp, quota_bytes=40 * VALUE, tenant="acme") as a,
        RemoteStore.open(redis_server.url, fp, quota_bytes=4 * VALUE, tenant="bolt") as b,
    ):
        seq, data = rblocks(4, seed=1)
        assert a.put(seq, list(data)) == 4
        b.put(seq, list(data))  # the same prefix, computed by the other tenant
        for batch in range(5):
            s, d = rblocks(4, seed=50 + batch)
            b.put(s, list(d))
        assert a.exists_prefix(seq) == 4, (
            f"acme's blocks deleted by bolt's flood: exists={a.exists(seq)}, acme usage={a.quota_usage()}, "
            f"bolt usage={b.quota_usage()}"
        )


def _remote_manager(path, url, **kw):
    from kv_helpers import config as cfg

    kv = KVManager(MODEL, cfg(path, disk_blocks=0, enable_remote=True, remote_cache_url=url), model_id="A", **kw)
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    return kv, dev


@needs_redis
def test_two_managers_share_redis_one_switches_weights(tmp_path, redis_server):
    a, dev_a = _remote_manager(tmp_path / "a", redis_server.url)
    b, dev_b = _remote_manager(tmp_path / "b", redis_server.url)
    try:
        p = prompt(5, 4)
        hs = a.hashes(p).sequence
        for i in range(4):
            fill(dev_a, L, i, hs[i])
        assert a.wait([a.put_async(p, [0, 1, 2, 3])], timeout=20)
        assert a.drain(20)
        assert b.match(p).get("remote") == 4 * TPB  # same weights: b sees a's blocks
        b.weights_changed("v2")
        assert b.match(p) == {"host": 0, "remote": 0}, b.match(p)
        r = next(iter(b.wait([b.get_async(p, [10, 11, 12, 13])], timeout=20).values()))
        assert r.num_tokens == 0, r
        assert a.match(p).get("host") == 4 * TPB  # a, still on the old weights, keeps them
        # b back on the first weights by name... and a new version a later starts with
        a.weights_changed("v2")
        assert a.match(p) == {"host": 0, "remote": 0}
    finally:
        a.shutdown()
        b.shutdown()
