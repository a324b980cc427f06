"""KVManager round trips: loaded bytes always equal stored bytes, across tiers and restarts."""

import numpy as np
import pytest
from kv_helpers import MODEL, TPB, assert_no_leaks, config, device_tensors, fill, holds, open_fds, prompts
from served import wait_until

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.core.tasks import ManagerClosed, TaskFailed
from dynamo_flexkv.core.transfer.graph import OpKind

DEVICE_BLOCKS = 64


def put(kv, dev, layout, prompt, rng):
    """Engine side of a put: 'compute' each full block into random device blocks, then offload."""
    h = kv.hashes(prompt).sequence
    ids = rng.choice(DEVICE_BLOCKS, size=len(h), replace=False)
    for b, s in zip(ids, h):
        fill(dev, layout, int(b), int(s))
    return kv.put_async(prompt, ids), h


def get_and_check(kv, dev, layout, prompt, rng, skip=0, layerwise=False):
    h = kv.hashes(prompt).sequence
    ids = rng.choice(DEVICE_BLOCKS, size=len(h), replace=False)
    m = kv.match(prompt)
    cached, on_host = max(m.values()) // TPB, m["host"] // TPB
    t = kv.get_async(prompt, ids, skip_blocks=skip, layerwise=layerwise)
    layers = []  # what each wait_for_layer answered: True, or the TaskFailed of a get that found nothing
    if layerwise:
        for layer in range(MODEL.num_layers):
            try:
                layers.append(kv.wait_for_layer(t, layer, timeout=30))
            except TaskFailed as e:
                layers.append(e)
                break
    r = kv.wait([t], timeout=30)[t]
    if layerwise and r.status is TaskStatus.SUCCESS:
        assert layers == [True] * MODEL.num_layers, layers  # every layer landed, none timed out
    elif layerwise and r.status is TaskStatus.NOT_FOUND:  # its first layer wait fails, naming why
        assert len(layers) == 1 and isinstance(layers[0], TaskFailed), layers
        assert f"task {t}: not_found" in str(layers[0])
    if cached <= skip:
        assert r.status is TaskStatus.NOT_FOUND
        return 0
    if r.status is TaskStatus.NOT_FOUND:
        # Only possible when host had nothing past `skip` and no free slot to stage disk blocks
        # into (background disk writes hold host blocks until they finish).
        assert on_host <= skip
        return 0
    assert r.status is TaskStatus.SUCCESS, r
    n = r.num_tokens // TPB
    # The host prefix is always served; the disk part needs free host slots to stage into, which
    # background disk writes (holding host blocks) can take for a moment.
    assert max(0, on_host - skip) <= n <= cached - skip
    for i in range(skip, skip + n):
        assert holds(dev, layout, int(ids[i]), int(h[i])), f"block {i} restored with the wrong bytes"
    return n


@pytest.mark.parametrize("layout", list(KVLayoutType))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("nixl", [False, True], ids=["native-io", "nixl-posix"])
def test_round_trip_with_eviction_and_restart(tmp_path, layout, seed, nixl):
    if nixl:
        pytest.importorskip("nixl._api", reason="NIXL is installed by make test; GPU images may lack it")
    rng = np.random.default_rng(seed)
    cfg = config(
        tmp_path, host_blocks=12, disk_blocks=40, eviction_policy=["lru", "lfu", "fifo"][seed], enable_nixl=nixl
    )
    ps = prompts(rng, 30, max_blocks=6)
    fds = None
    loaded = 0
    for life in range(3):  # restart in between: the disk tier is re-adopted
        if life == 2:
            # After a restart has read the disk on this thread, it keeps its cached io_uring ring
            # (one per thread, by design); from here on a lifetime must not add descriptors.
            fds = open_fds()
        with KVManager(MODEL, cfg) as kv:
            dev = device_tensors(layout, DEVICE_BLOCKS)
            kv.register_device_cache(dev, layout)
            if life:
                assert len(kv.adopt_report.adopted) > 0 and kv.adopt_report.torn == 0
            for _ in range(40):
                p = ps[int(rng.integers(len(ps)))]
                if rng.random() < 0.5:
                    t, _ = put(kv, dev, layout, p, rng)
                    assert kv.wait([t], timeout=30)[t].status is TaskStatus.SUCCESS
                else:
                    loaded += get_and_check(
                        kv, dev, layout, p, rng, skip=int(rng.integers(0, 2)), layerwise=bool(rng.random() < 0.5)
                    )
            assert kv.drain(timeout=30)  # background disk writes finish before checking
            assert_no_leaks(kv)
    assert loaded > 0
    assert open_fds(settle_to=fds) <= fds, "a manager lifetime leaked file descriptors"


def test_get_from_disk_after_host_eviction(tmp_path):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=64)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        first = list(range(6 * TPB))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, first, rng)
        kv.wait([t])
        _wait_idle(kv)
        for i in range(3):  # push `first` out of host memory
            t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, [100000 + i] * (6 * TPB), rng)
            kv.wait([t])
            _wait_idle(kv)  # its disk write releases the host blocks it reads
        m = kv.match(first)
        assert m["disk"] == 6 * TPB and m["host"] < 6 * TPB
        assert get_and_check(kv, dev, KVLayoutType.LAYERBLOCK, first, rng) == 6
        assert kv.match(first)["host"] == 6 * TPB  # staged into host on the way
        p = kv.prefetch_async(first)
        assert kv.wait([p])[p].status is TaskStatus.SUCCESS
        _wait_idle(kv)
        assert_no_leaks(kv)


def test_namespaces_isolate(tmp_path):
    rng = np.random.default_rng(0)
    cfg = config(tmp_path, disk_blocks=0)
    with KVManager(MODEL, cfg, namespace="tenant-a") as a:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        a.register_device_cache(dev)
        prompt = list(range(4 * TPB))
        t, _ = put(a, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        a.wait([t])
        assert a.match(prompt)["host"] == 4 * TPB
        assert a.match(prompt, cache_salt="other")["host"] == 0
        ids = np.arange(4)
        t = a.get_async(prompt, ids, cache_salt="other")
        assert a.wait([t])[t].status is TaskStatus.NOT_FOUND


def test_put_stores_only_new_blocks(tmp_path):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, disk_blocks=0)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        prompt = list(range(6 * TPB + 3))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt[: 4 * TPB], rng)
        assert kv.wait([t])[t].num_tokens == 4 * TPB
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        assert kv.wait([t])[t].num_tokens == 2 * TPB
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        assert kv.wait([t])[t].num_tokens == 0


def test_done_says_a_task_finished_and_leaves_its_result_for_wait(tmp_path):
    rng = np.random.default_rng(3)
    with KVManager(MODEL, config(tmp_path, disk_blocks=0)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, list(range(4 * TPB)), rng)
        assert kv.drain(30) and kv.done(t) and kv.done(t)  # asking does not collect
        assert kv.wait([t])[t].num_tokens == 4 * TPB
        with pytest.raises(KeyError, match="already taken by wait"):
            kv.done(t)
        with pytest.raises(KeyError, match="never issued"):
            kv.done(t + 100)


@pytest.mark.parametrize("disk", [0, 32])
def test_stats_is_a_typed_snapshot_and_as_dict_gives_the_same_numbers(tmp_path, disk):
    import json

    from dynamo_flexkv import ManagerStats

    rng = np.random.default_rng(4)
    with KVManager(MODEL, config(tmp_path, disk_blocks=disk)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, list(range(4 * TPB)), rng)
        assert kv.wait([t])[t].ok and kv.drain(30)
        s = kv.stats()
        assert isinstance(s, ManagerStats) and s.remote is None
        assert s.host.stored_blocks == 4 and s.host.ready_blocks == 4 and s.tasks.in_flight == 0
        assert s.links["d2h"].ops >= 1 and s.links["d2h"].bytes > 0
        assert list(s.tiers) == (["host", "disk"] if disk else ["host"])
        assert (s.disk is None) == (disk == 0) and (not disk or s.disk.stored_blocks == 4)
        d = json.loads(json.dumps(s.as_dict()))  # plain values: it crosses process boundaries
        assert d["host"]["stored_blocks"] == 4 and ("disk" in d) == bool(disk)
        assert d["tasks"]["in_flight"] == 0 and d["links"]["d2h"]["bytes"] == s.links["d2h"].bytes


def _wait_idle(kv, timeout=30.0):
    assert kv.drain(timeout)
    assert kv.cache.task_ids() == []


# ---- defects found by trying the API as a new user (each test failed before its fix) -------------


def _wait_quiet(kv):
    """Every task, background disk writes included, has finished."""
    assert kv.drain(timeout=30)


# Every public KVManager call but shutdown(), as a call on a shut-down manager ``kv`` (``t``: a task
# it issued before, ``dev``: its device tensors). Kept complete by the test below.
def _enter(kv):
    with kv:
        pass


AFTER_SHUTDOWN = {
    "__enter__": lambda kv, p, t, dev: _enter(kv),
    "register_device_cache": lambda kv, p, t, dev: kv.register_device_cache(dev),
    "announce_adopted": lambda kv, p, t, dev: kv.announce_adopted(),
    "hashes": lambda kv, p, t, dev: kv.hashes(p),
    "match": lambda kv, p, t, dev: kv.match(p),
    "loadable_tokens": lambda kv, p, t, dev: kv.loadable_tokens(p),
    "observe_prefill": lambda kv, p, t, dev: kv.observe_prefill(16, 64, 0.01),
    "get_async": lambda kv, p, t, dev: kv.get_async(p, [0, 1, 2, 3]),
    "prefetch_async": lambda kv, p, t, dev: kv.prefetch_async(p),
    "put_async": lambda kv, p, t, dev: kv.put_async(p, [0, 1, 2, 3]),
    "wait": lambda kv, p, t, dev: kv.wait([t]),
    "try_wait": lambda kv, p, t, dev: kv.try_wait([t]),
    "done": lambda kv, p, t, dev: kv.done(t),
    "cancel": lambda kv, p, t, dev: kv.cancel([t]),
    "drain": lambda kv, p, t, dev: kv.drain(),
    "planned_tokens": lambda kv, p, t, dev: kv.planned_tokens(t),
    "planned_tokens_by_tier": lambda kv, p, t, dev: kv.planned_tokens_by_tier(t),
    "wait_for_layer": lambda kv, p, t, dev: kv.wait_for_layer(t, 0),
    "stats": lambda kv, p, t, dev: kv.stats(),
    "evict": lambda kv, p, t, dev: kv.evict("host"),
    "reset": lambda kv, p, t, dev: kv.reset(),
    "weights_changed": lambda kv, p, t, dev: kv.weights_changed("v2"),
    "contents": lambda kv, p, t, dev: kv.contents(),
    "prefix_blocks": lambda kv, p, t, dev: kv.prefix_blocks(p),
    "clear": lambda kv, p, t, dev: kv.clear(),
    "lookup_decision": lambda kv, p, t, dev: kv.lookup_decision(p),
    "pull_decision": lambda kv, p, t, dev: kv.pull_decision(p, 2, prompt_tokens=len(p) + 1),
    "pin_host": lambda kv, p, t, dev: kv.pin_host("peer", [1, 2], 0, 2),
    "unpin": lambda kv, p, t, dev: kv.unpin("peer"),
    "stage_host": lambda kv, p, t, dev: kv.stage_host("peer", p, [1, 2], 2, 0),
    "commit_staged": lambda kv, p, t, dev: kv.commit_staged("peer", None, 0),
}


def test_the_after_shutdown_list_names_every_public_call():
    public = {n for n in dir(KVManager) if not n.startswith("_") and callable(getattr(KVManager, n))}
    assert public | {"__enter__"} == set(AFTER_SHUTDOWN) | {"shutdown"}


def _shut_down_and_successor(path):
    """A manager shut down after storing a prompt (its disk write finished), and a second manager
    on the same directories, which re-adopted that prompt."""
    rng = np.random.default_rng(0)
    cfg = config(path, host_blocks=8, disk_blocks=32)
    kv = KVManager(MODEL, cfg)
    dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
    kv.register_device_cache(dev)
    prompt = list(range(4 * TPB))
    t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
    kv.wait([t])
    _wait_quiet(kv)
    kv.shutdown()
    kv2 = KVManager(MODEL, cfg)  # the directories are free again: a new manager re-adopts them
    assert kv2.match(prompt)["disk"] == 4 * TPB
    return kv, kv2, cfg, prompt, t, dev


@pytest.fixture(scope="module")
def shut_down(tmp_path_factory):
    made = _shut_down_and_successor(tmp_path_factory.mktemp("closed"))
    yield made
    made[1].shutdown()


@pytest.mark.parametrize("call", sorted(AFTER_SHUTDOWN))
def test_every_public_call_after_shutdown_raises_manager_closed(shut_down, call):
    kv, kv2, cfg, prompt, t, dev = shut_down
    fds = open_fds()
    with pytest.raises(
        ManagerClosed,
        match=rf"^{call}\(\): this KVManager was shut down, its memory and cache "
        r"directories are released: create a new KVManager",
    ):
        AFTER_SHUTDOWN[call](kv, prompt, t, dev)
    assert open_fds(settle_to=fds) <= fds  # the refused call opened nothing
    # It touched neither the journal nor the next manager's cache (a closed reset() wiped them once).
    assert kv2.match(prompt)["disk"] == 4 * TPB
    kv.shutdown()  # shutting down again is fine


def test_a_shut_down_managers_directories_are_adopted_by_the_next(tmp_path):
    kv, kv2, cfg, prompt, t, dev = _shut_down_and_successor(tmp_path)
    for call in AFTER_SHUTDOWN.values():  # whatever the closed manager was asked, in one go
        with pytest.raises(ManagerClosed):
            call(kv, prompt, t, dev)
    kv.shutdown()
    assert kv2.match(prompt)["disk"] == 4 * TPB
    kv2.shutdown()
    with KVManager(MODEL, cfg) as kv3:
        assert kv3.match(prompt)["disk"] == 4 * TPB


def test_reset_refuses_while_tasks_run_and_then_clears_both_tiers(tmp_path):
    import threading

    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=32)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        gate = threading.Event()
        disk_mover = kv.transfer.movers[OpKind.H2DISK]
        orig = disk_mover.run
        disk_mover.run = lambda op: (gate.wait(10), orig(op))[1]
        try:
            prompt = list(range(4 * TPB))
            t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
            assert kv.wait([t])[t].ok  # the caller's part is done; the disk write is held
            with pytest.raises(RuntimeError, match=r"reset\(\) with 1 tasks in flight: call drain\(\)"):
                kv.reset()
        finally:
            gate.set()
            disk_mover.run = orig
        _wait_quiet(kv)
        kv.reset()
        assert kv.match(prompt) == {"host": 0, "disk": 0}
        assert_no_leaks(kv)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=32)) as kv:
        assert kv.adopt_report.adopted == []  # the journal recorded the reset


def test_write_through_when_disk_holds_more_than_host(tmp_path):
    """disk_admission_hits=0: a put writes every block disk lacks, even when disk's prefix is
    longer than host's (after a restart, or host eviction)."""
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=64)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        prompt = list(range(8 * TPB))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt[: 5 * TPB], rng)
        kv.wait([t])
        _wait_quiet(kv)
        assert kv.evict("host") == 5
        assert kv.match(prompt) == {"host": 0, "disk": 5 * TPB}
        t, h = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        kv.wait([t])
        _wait_quiet(kv)
        assert kv.match(prompt) == {"host": 8 * TPB, "disk": 8 * TPB}
        assert kv.evict("host") == 8
        assert get_and_check(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng) == 8
        _wait_quiet(kv)
        assert_no_leaks(kv)


def test_evict_names_its_bad_arguments(tmp_path):
    kv = KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=32))
    with pytest.raises(ValueError, match="'host' and 'disk'"):
        kv.evict("device")
    with pytest.raises(ValueError, match="count=-1"):
        kv.evict("host", -1)
    assert kv.evict("disk") == 0
    kv.shutdown()


@pytest.mark.parametrize("call", ["get-bad-skip", "get-before-register", "put-before-register"])
def test_a_refused_call_leaves_no_task_behind(tmp_path, call):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=32)) as kv:
        prompt = list(range(4 * TPB))
        if call == "get-bad-skip":
            dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
            kv.register_device_cache(dev)
            t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
            kv.wait([t])
            _wait_quiet(kv)
            with pytest.raises(ValueError, match="skip_blocks=-1 must be >= 0"):
                kv.get_async(prompt, [0, 1, 2, 3], skip_blocks=-1)
        else:
            with pytest.raises(RuntimeError, match=r"before register_device_cache\(\): register the engine's KV"):
                if call == "get-before-register":
                    kv.get_async(prompt, [0, 1, 2, 3])
                else:
                    kv.put_async(prompt, [0, 1, 2, 3])
        assert kv.stats().tasks.in_flight == 0
        assert kv.drain(timeout=5)
        assert_no_leaks(kv)


def test_planned_tokens_by_tier_when_skip_covers_part_of_the_disk_run(tmp_path):
    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, host_blocks=8, disk_blocks=64)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        prompt = list(range(6 * TPB))
        t, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        kv.wait([t])
        _wait_quiet(kv)
        assert kv.evict("host", 4) == 4  # leaves blocks 0-1 on host
        assert kv.match(prompt) == {"host": 2 * TPB, "disk": 6 * TPB}
        t = kv.get_async(prompt, list(range(6)), skip_blocks=4)
        assert kv.planned_tokens_by_tier(t) == {"host": 0, "disk": 2 * TPB}
        assert kv.planned_tokens(t) == 2 * TPB
        assert kv.wait([t])[t].num_tokens == 2 * TPB
        t = kv.get_async(prompt, list(range(6)), skip_blocks=1)  # now all six on host
        assert kv.planned_tokens_by_tier(t) == {"host": 5 * TPB, "disk": 0}
        kv.wait([t])


def test_results_nobody_collects_expire(tmp_path):

    rng = np.random.default_rng(0)
    with KVManager(MODEL, config(tmp_path, disk_blocks=0, task_result_ttl_seconds=0.3)) as kv:
        dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
        kv.register_device_cache(dev)
        prompt = list(range(4 * TPB))
        forgotten, _ = put(kv, dev, KVLayoutType.LAYERBLOCK, prompt, rng)
        assert kv.drain(30)
        collected = kv.get_async(prompt, [0, 1, 2, 3])
        assert kv.wait([collected])[collected].ok
        st = kv.stats().tasks
        assert (st.in_flight, st.uncollected_results) == (0, 1)  # the forgotten put's result waits for its TTL
        wait_until("the put's result expired", lambda: kv.stats().tasks.expired_results == 1, timeout=10, every=0.02)
        st = kv.stats().tasks
        assert (st.in_flight, st.uncollected_results, st.expired_results) == (0, 0, 1)
        with pytest.raises(KeyError, match="nobody collected it within task_result_ttl_seconds"):
            kv.wait([forgotten])
        st = kv.stats().tasks  # nothing else is kept for expired or collected tasks
        assert (st.in_flight, st.uncollected_results, st.expired_results) == (0, 0, 1)
