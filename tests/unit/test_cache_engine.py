"""CacheEngine plans against a simulated data plane: interleaved tasks, random failures.

Every slot of the simulated host and disk remembers which block was written to it, so any plan
that reads the wrong slot, or lets a slot be reused while a task reads it, is caught.
"""

import random
import threading

import pytest
from index_model import random_chains

from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.index import CacheEngine, IndexInvariantError, Tier


def make_engine(tmp_path, host=16, disk=48, **kw):
    cfg = CacheConfig.from_dict(dict(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=str(tmp_path), **kw))
    events = []

    class Listener:
        def on_stored(self, tier, run):
            events.append(("stored", tier, list(run.hashes)))

        def on_removed(self, tier, hashes):
            events.append(("removed", tier, list(hashes)))

    return CacheEngine(cfg, {Tier.HOST: host, Tier.DISK: disk}, listener=Listener()), events


class SimDataPlane:
    def __init__(self):
        self.slots = {Tier.HOST: {}, Tier.DISK: {}}

    def write(self, run, values):
        for bid, v in zip(run.block_ids, values):
            self.slots[run.tier][bid] = v

    def read(self, run):
        return [self.slots[run.tier].get(bid) for bid in run.block_ids]


def put_steps(ce, dp, tid, chain, rng, fail_p):
    plan = ce.plan_put(tid, chain)
    yield
    if plan.host is not None:
        dp.write(plan.host, plan.host.hashes)  # D2H
        if rng.random() < fail_p:
            ce.abort_task(tid)
            return
        ce.complete(plan.host, tid)
    yield
    if plan.disk is not None:
        data = dp.read(plan.host_sources)
        assert data == plan.disk.hashes, "disk write sourced from the wrong host slots"
        dp.write(plan.disk, data)  # H2DISK
        if rng.random() < fail_p:
            ce.abort_task(tid)
            return
        ce.complete(plan.disk, tid)
        ce.complete(plan.host_sources, tid)
    ce.finish_task(tid)


def get_steps(ce, dp, tid, chain, rng, fail_p, start):
    plan = ce.plan_get(tid, chain, start)
    assert plan.end <= len(chain)
    yield
    if plan.staged is not None:
        data = dp.read(plan.disk_reads)
        assert data == plan.staged.hashes, "disk read returned another block"
        dp.write(plan.staged, data)  # DISK2H
        if rng.random() < fail_p:
            ce.abort_task(tid)
            return
        ce.complete(plan.disk_reads, tid)
        ce.complete(plan.staged, tid)
    yield
    if plan.host_reads is not None:
        assert dp.read(plan.host_reads) == plan.host_reads.hashes, "H2D would load another block's bytes"
    if rng.random() < fail_p:
        ce.abort_task(tid)
        return
    if plan.host_reads is not None:
        ce.complete(plan.host_reads, tid)
    ce.finish_task(tid)


def check_ready_blocks_hold_their_bytes(ce, dp):
    for tier, idx in ce.tiers.items():
        for h in idx.hashes():
            info = idx.info(h)
            if info is not None and info.ready:  # None: another thread evicted it meanwhile
                assert dp.slots[tier][info.block_id] == h, f"{tier} block {h} lost its bytes"


@pytest.mark.parametrize("seed", range(12))
def test_interleaved_tasks_keep_bytes_and_leak_nothing(tmp_path, seed):
    interleaved_tasks(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12, 300))
def test_interleaved_tasks_long(tmp_path, seed):
    interleaved_tasks(tmp_path, seed)


def interleaved_tasks(tmp_path, seed):
    rng = random.Random(seed)
    admission = rng.choice([0, 0, 1, 2])
    ce, events = make_engine(
        tmp_path,
        host=rng.randrange(8, 40),
        disk=rng.randrange(40, 120),
        eviction_policy=rng.choice(["lru", "lfu", "slru", "fifo", "filo", "mru"]),
        disk_admission_hits=admission,
    )
    dp = SimDataPlane()
    chains = random_chains(rng, count=30, max_len=10)
    live, next_id = [], 0
    for _ in range(500):
        if len(live) < 6 and rng.random() < 0.5:
            chain = rng.choice(chains)
            next_id += 1
            if rng.random() < 0.5:
                gen = put_steps(ce, dp, next_id, chain, rng, 0.1)
            else:
                gen = get_steps(ce, dp, next_id, chain, rng, 0.1, min(len(chain), rng.randrange(0, 3)))
            live.append(gen)
        if live:
            gen = rng.choice(live)
            try:
                next(gen)
            except StopIteration:
                live.remove(gen)
        check_ready_blocks_hold_their_bytes(ce, dp)
    for gen in live:
        for _ in gen:
            pass
    assert ce.task_ids() == []
    for tier, idx in ce.tiers.items():
        assert idx.pool.num_used == len(idx)
        for h in idx.hashes():
            info = idx.info(h)
            assert info.ready and info.locks == 0, f"{tier} leaked a lock or an unready block"
    # Events tell the truth: replaying them gives exactly the ready blocks of each tier.
    seen = {Tier.HOST: set(), Tier.DISK: set()}
    for kind, tier, hashes in events:
        if kind == "stored":
            assert not seen[tier] & set(hashes)
            seen[tier] |= set(hashes)
        else:
            assert set(hashes) <= seen[tier]
            seen[tier] -= set(hashes)
    for tier, idx in ce.tiers.items():
        assert seen[tier] == set(idx.hashes())


def test_get_combines_host_and_disk(tmp_path):
    ce, _ = make_engine(tmp_path, host=8, disk=32)
    chain = list(range(100, 112))
    dp = SimDataPlane()
    for _ in put_steps(ce, dp, "p1", chain[:8], random.Random(0), 0.0):
        pass
    m = ce.match(chain)
    assert m.per_tier == {Tier.HOST: 8, Tier.DISK: 8}
    # Host runs full: a second prompt evicts host blocks but disk keeps the first prompt.
    for _ in put_steps(ce, dp, "p2", list(range(200, 208)), random.Random(0), 0.0):
        pass
    m = ce.match(chain)
    assert m.per_tier[Tier.DISK] == 8 and m.per_tier[Tier.HOST] < 8
    assert m.sources()[-1] == (Tier.DISK, m.per_tier[Tier.HOST], 8)
    plan = ce.plan_get("g", chain)
    assert plan.num_blocks == 8 and plan.staged.start == m.per_tier[Tier.HOST]
    assert plan.host_reads.hashes == chain[:8]
    assert plan.disk_reads.hashes == plan.staged.hashes
    ce.abort_task("g")
    assert ce.match(chain).per_tier == m.per_tier


def test_put_skips_what_is_held_and_match_has_no_side_effects(tmp_path):
    ce, events = make_engine(tmp_path)
    chain = list(range(1, 7))
    for _ in put_steps(ce, SimDataPlane(), "a", chain[:4], random.Random(0), 0.0):
        pass
    before = ce.stats()
    assert ce.match(chain).num_blocks == 4
    assert ce.stats() == before
    plan = ce.plan_put("b", chain)
    assert plan.held == 4 and plan.host.start == 4 and len(plan.host) == 2
    ce.abort_task("b")
    assert ce.match(chain).num_blocks == 4


def test_disk_admission_needs_hits(tmp_path):
    ce, _ = make_engine(tmp_path, disk_admission_hits=2)
    dp, chain, rng = SimDataPlane(), list(range(1, 5)), random.Random(0)

    def run(gen):
        for _ in gen:
            pass

    run(put_steps(ce, dp, "p1", chain, rng, 0.0))
    assert ce.match(chain).per_tier[Tier.DISK] == 0  # one-off prompt: not written to disk
    for i in range(2):
        run(get_steps(ce, dp, f"g{i}", chain, rng, 0.0, 0))
        run(put_steps(ce, dp, f"p{i + 2}", chain, rng, 0.0))
        assert ce.match(chain).per_tier[Tier.DISK] == (4 if i == 1 else 0)


def test_task_errors(tmp_path):
    ce, _ = make_engine(tmp_path)
    plan = ce.plan_put("t", [1, 2, 3])
    with pytest.raises(IndexInvariantError, match="already in flight"):
        ce.plan_get("t", [1])
    with pytest.raises(IndexInvariantError, match="still has 3 open runs"):
        ce.finish_task("t")
    with pytest.raises(IndexInvariantError, match="does not belong to task 'u'"):
        ce.complete(plan.host, "u")
    with pytest.raises(IndexInvariantError, match="reset with 1 tasks in flight"):
        ce.reset()
    ce.complete(plan.host, "t")
    with pytest.raises(IndexInvariantError, match="already finished"):
        ce.complete(plan.host, "t")
    ce.abort_task("t")
    with pytest.raises(KeyError, match="unknown task"):
        ce.finish_task("t")
    ce.reset()
    assert ce.match([1, 2, 3]).num_blocks == 0


def test_threads_share_one_engine(tmp_path):
    ce, _ = make_engine(tmp_path, host=64, disk=256)
    dp = SimDataPlane()
    lock = threading.Lock()  # the simulated data plane itself is not thread-safe
    chains = random_chains(random.Random(1), count=40, max_len=16)
    errors = []

    def worker(wid):
        rng = random.Random(wid)
        try:
            for i in range(300):
                chain = rng.choice(chains)
                tid = (wid, i)
                gen = (
                    put_steps if rng.random() < 0.5 else lambda *a: get_steps(*a, min(len(chain), rng.randrange(0, 2)))
                )(ce, dp, tid, chain, rng, 0.05)
                for _ in gen:
                    with lock:
                        check_ready_blocks_hold_their_bytes(ce, dp)
        except Exception as e:  # noqa: BLE001 - a worker thread's failure, surfaced below with the thread's id
            errors.append((wid, repr(e)))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ce.task_ids() == []


def test_remote_blocks_stage_after_the_disk_part_and_a_short_read_commits_only_its_prefix(tmp_path):
    eng, events = make_engine(tmp_path, host=16, disk=48)
    hashes = list(range(100, 110))
    put = eng.plan_put("p", hashes[:3])  # blocks 0-2 on host and disk
    for run in put.runs:
        eng.complete(run, "p")
    eng.finish_task("p")
    eng.tiers[Tier.HOST].evict(2)  # host keeps block 0; disk has 0-2; "remote" has 0-7
    plan = eng.plan_get("g", hashes, 0, remote=(3, 8))
    assert (plan.staged.start, plan.staged.end) == (1, 3)
    assert (plan.remote_staged.start, plan.remote_staged.end, plan.remote_staged.parent) == (3, 8, hashes[2])
    assert (plan.host_reads.start, plan.host_reads.end) == (0, 8)
    eng.complete(plan.disk_reads, "g")
    eng.complete(plan.staged, "g")
    eng.complete_prefix(plan.remote_staged, "g", 2)  # blocks 3-4 verified, 5 was bad
    assert (plan.remote_staged.start, plan.remote_staged.parent) == (5, hashes[4])
    eng.abort_task("g")  # the tail rolls back, every read lock is released
    host = eng.tiers[Tier.HOST]
    assert host.match_length(hashes) == 5 and len(host) == 5
    assert all(host.info(h).locks == 0 for h in hashes[:5])
    assert ("stored", Tier.HOST, hashes[3:5]) in events
    assert eng.stats()["requests"]["remote_hit_blocks"] == 5


def test_a_remote_probe_that_no_longer_reaches_the_local_prefix_stages_nothing(tmp_path):
    eng, _ = make_engine(tmp_path, host=16, disk=48)
    hashes = list(range(200, 206))
    plan = eng.plan_get("g", hashes, 0, remote=(2, 6))  # probed past a local prefix since evicted: a gap
    assert plan.remote_staged is None and plan.num_blocks == 0
    eng.abort_task("g")
    plan = eng.plan_get("g2", hashes, 0, remote=(0, 6))
    assert plan.remote_staged.end == 6
    eng.abort_task("g2")
    assert len(eng.tiers[Tier.HOST]) == 0


def test_remote_write_behind_never_reads_host_blocks_another_put_still_fills(tmp_path):
    eng, _ = make_engine(tmp_path, host=16, disk=48)
    hashes = list(range(300, 306))
    first = eng.plan_put("a", hashes[:3], remote=True)  # blocks 0-2 unready (owned by "a")
    assert (first.remote_sources.start, first.remote_sources.end) == (0, 3)
    second = eng.plan_put("b", hashes, remote=True)  # extends past a's unready blocks
    assert second.remote_sources is None or second.remote_sources.end == 0
    for t, _p in (("a", first), ("b", second)):
        eng.abort_task(t)
    assert len(eng.tiers[Tier.HOST]) == 0
