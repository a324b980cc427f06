"""Adversarial review of the core through its public API (README: CacheConfig, KVManager, SSD tier).

Written as a demanding user would call it: wrong types, wrong order, after shutdown, restarts on
the same directories, corrupted files between runs, bursts from several threads. Every restored
block is compared byte for byte with what was stored.
"""

from __future__ import annotations

import glob
import os
import threading

import numpy as np
import pytest
import torch
from kv_helpers import MODEL, TPB, Delivered, config, device_tensors, fill, holds, hung_disk, store_and_drain
from repo_paths import HELPERS
from served import wait_until

from dynamo_flexkv import CacheConfig, KVLayoutType, KVManager, TaskStatus
from dynamo_flexkv.core.config import ConfigError
from dynamo_flexkv.core.storage.ssd import SsdInUseError, SsdLayoutError
from dynamo_flexkv.core.tasks import TooManyTasks

L = KVLayoutType.LAYERBLOCK


def prompt(k: int, blocks: int) -> list:
    """Distinct prompts: ranges far apart so no two k share a prefix."""
    return list(range(k * 100_000, k * 100_000 + TPB * blocks))


def open_manager(path, num_device_blocks: int = 64, **kw):
    kv = KVManager(MODEL, config(path, **kw))
    dev = device_tensors(L, num_device_blocks)
    kv.register_device_cache(dev, L)
    return kv, dev


store = store_and_drain  # device blocks keyed by the prefix hashes; put and wait for the disk too


def load_checked(kv, dev, tokens, ids) -> int:
    """Get into (zeroed) blocks ``ids``; every block the get claims must be byte-exact. Returns blocks restored."""
    for b in ids:
        for layer in dev:
            layer[b].zero_()
    r = next(iter(kv.wait([kv.get_async(tokens, ids)], timeout=20).values()))
    assert r.status in (TaskStatus.SUCCESS, TaskStatus.NOT_FOUND), r
    n = r.num_tokens // TPB
    hashes = kv.hashes(tokens).sequence
    wrong = [i for i in range(n) if not holds(dev, L, ids[i], hashes[i])]
    assert not wrong, f"blocks {wrong} restored with bytes that were never stored for them"
    return n


# --------------------------------------------------------------------------- confirmed defects


def test_put_with_duplicate_device_block_ids_is_refused(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        with pytest.raises(ValueError, match="device_block_ids|duplicate"):
            kv.put_async(prompt(1, 4), [0, 0, 2, 3])
    finally:
        kv.shutdown()


def test_duplicate_put_ids_poison_what_get_returns(tmp_path):
    """Documents the damage of the defect above (passes today, as the defect's evidence): the
    get reports SUCCESS and hands back block 0's bytes for block 1."""
    kv, dev = open_manager(tmp_path)
    try:
        tokens = prompt(1, 4)
        h = kv.hashes(tokens).sequence
        for i in range(4):
            fill(dev, L, i, h[i])
        try:
            kv.wait([kv.put_async(tokens, [0, 0, 2, 3])], timeout=10)
        except ValueError:
            return  # fixed: the put is refused, nothing poisoned
        kv.drain(10)
        r = next(iter(kv.wait([kv.get_async(tokens, [10, 11, 12, 13])], timeout=10).values()))
        assert r.status is TaskStatus.SUCCESS and r.num_tokens == 4 * TPB
        assert not holds(dev, L, 11, h[1])
    finally:
        kv.shutdown()


def test_get_with_duplicate_device_block_ids_is_refused(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        store(kv, dev, prompt(1, 4), [0, 1, 2, 3])
        with pytest.raises(ValueError, match="device_block_ids|duplicate"):
            kv.get_async(prompt(1, 4), [20, 20, 20, 20])
    finally:
        kv.shutdown()


def test_float_device_block_id_is_refused(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        with pytest.raises(TypeError):
            kv.put_async(prompt(1, 1), [2.7])
    finally:
        kv.shutdown()


def test_kv_caches_without_addressable_memory_are_refused(tmp_path):
    """Meta tensors have shapes but no memory (data_ptr 0): copying into them would crash the
    process, so registering them is refused, naming the device."""
    kv = KVManager(MODEL, config(tmp_path))
    try:
        with pytest.raises(ValueError, match="'meta'.*CPU or CUDA"):
            kv.register_device_cache(device_tensors(L, 8, device="meta"), L)
    finally:
        kv.shutdown()


def test_none_device_block_ids_error_names_the_argument(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        with pytest.raises(TypeError, match="device_block_ids"):
            kv.put_async(prompt(1, 2), None)
    finally:
        kv.shutdown()


def test_skip_blocks_past_the_prompt_is_refused(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        with pytest.raises(ValueError, match="skip_blocks"):
            kv.get_async(prompt(1, 8), list(range(8)), skip_blocks=9)
    finally:
        kv.shutdown()


def test_float_skip_blocks_error_names_the_argument(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        with pytest.raises(TypeError, match="skip_blocks"):
            kv.get_async(prompt(1, 8), list(range(8)), skip_blocks=2.0)
        assert kv.stats().tasks.in_flight == 0  # refused: no task left behind
    finally:
        kv.shutdown()


def test_same_ssd_dir_listed_twice_is_a_config_error(tmp_path):
    d = str(tmp_path / "ssd")
    with pytest.raises(ConfigError, match="ssd_cache_dir"):
        CacheConfig(cpu_cache_gb=0.001, ssd_cache_gb=0.002, ssd_cache_dir=f"{d};{d}/")


def test_env_aliases_with_equal_values_are_accepted(monkeypatch):
    monkeypatch.delenv("FLEXKV_CONFIG_PATH", raising=False)
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "2")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "2.0")
    assert CacheConfig.load().cpu_cache_gb == 2.0


def test_stats_in_flight_is_zero_after_drain(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        for k in range(3):
            kv.put_async(prompt(k + 1, 1), [k])
        assert kv.drain(timeout=20)
        assert kv.stats().tasks.in_flight == 0
    finally:
        kv.shutdown()


def test_other_namespace_does_not_destroy_the_first_tenants_cache(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        store(kv, dev, prompt(1, 4), [0, 1, 2, 3])
    finally:
        kv.shutdown()
    # The promised answer (docs/PYTHON_API.md, LIMITATIONS.md): the directory is refused with
    # SsdLayoutError naming the namespaces, before the other tenant can adopt or evict anything.
    with pytest.raises(
        SsdLayoutError,
        match=r"holds 4 blocks of another namespace.*namespace '' on disk vs "
        r"'tenant-b' here",
    ):
        KVManager(MODEL, config(tmp_path), namespace="tenant-b")
    kv, dev = open_manager(tmp_path)  # the refused open released the directory's lock
    try:
        assert kv.adopt_report.adopted and not kv.adopt_report.mismatched
        assert kv.match(prompt(1, 4))["disk"] == 4 * TPB
        assert load_checked(kv, dev, prompt(1, 4), [10, 11, 12, 13]) == 4
    finally:
        kv.shutdown()


def test_put_burst_that_fits_the_disk_is_cached(tmp_path):
    kv, dev = open_manager(tmp_path, num_device_blocks=120, host_blocks=24, disk_blocks=120)
    try:
        prompts = [prompt(k, 6) for k in range(1, 21)]
        for k, pr in enumerate(prompts):
            h = kv.hashes(pr).sequence
            for i in range(6):
                fill(dev, L, 6 * k + i, h[i])
        ids = [kv.put_async(pr, [6 * k + i for i in range(6)]) for k, pr in enumerate(prompts)]
        results = kv.wait(ids, timeout=30)
        assert all(r.status is TaskStatus.SUCCESS for r in results.values())
        assert kv.drain(timeout=30)
        stored = [r.num_tokens // TPB for r in results.values()]
        assert stored == [6] * 20, f"blocks stored per put: {stored}"
        st = kv.stats()
        assert st.tasks.put_refused_blocks == 0 and st.tasks.deferred_puts == 0
        assert st.host.rolled_back_blocks == 0  # waiting for room is not a rollback
        for k in (0, 19):  # the first and the last put of the burst restore exactly
            assert load_checked(kv, dev, prompts[k], list(range(120 - 6, 120))) == 6
    finally:
        kv.shutdown()


def test_put_longer_than_the_host_tier_stores_what_fits_and_counts_the_rest(tmp_path):
    kv, dev = open_manager(tmp_path, num_device_blocks=64, host_blocks=24, disk_blocks=64)
    try:
        toks = prompt(1, 30)
        h = kv.hashes(toks).sequence
        for i in range(30):
            fill(dev, L, i, h[i])
        p = kv.put_async(toks, list(range(30)))
        r = kv.wait([p], timeout=20)[p]
        assert r.status is TaskStatus.SUCCESS and r.num_tokens == 24 * TPB
        assert kv.drain(timeout=20)
        assert kv.stats().tasks.put_refused_blocks == 6
        assert load_checked(kv, dev, toks, list(range(32, 62))) == 24
    finally:
        kv.shutdown()


def test_a_put_waiting_for_room_behind_a_hung_disk_ends_when_its_wait_is_over(tmp_path, monkeypatch):
    """The host tier is full of blocks a hung disk write locks, so no transfer finishes to retry a
    put waiting for room: the put still ends once it waited MAX_PUT_DEFER_S, storing what fits
    (nothing here, counted refused), and its engine gets its device blocks back; the disk
    writes land once the disk answers again."""
    from dynamo_flexkv.core import manager

    monkeypatch.setattr(manager, "MAX_PUT_DEFER_S", 0.5)
    disk_answers = threading.Event()
    kv = KVManager(MODEL, config(tmp_path, host_blocks=24, disk_blocks=120), mover_hook=hung_disk(disk_answers))
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    try:
        first = kv.put_async(prompt(1, 24), list(range(24)))  # fills host; its disk writes hang
        assert kv.wait([first], timeout=30)[first].num_tokens == 24 * TPB
        second = kv.put_async(prompt(2, 6), list(range(24, 30)))
        wait_until("the second put waits for room", lambda: kv.stats().tasks.deferred_puts == 1, timeout=10)
        r = kv.wait([second], timeout=30)[second]  # not 60 s: the hung disk never frees room
        assert r.status is TaskStatus.SUCCESS and r.num_tokens == 0
        assert kv.stats().tasks.put_refused_blocks == 6 and kv.stats().tasks.deferred_puts == 0
        disk_answers.set()
        assert kv.drain(timeout=30)
        assert kv.match(prompt(1, 24))["disk"] == 24 * TPB
    finally:
        disk_answers.set()
        kv.shutdown()


def test_loads_and_stores_never_wait_behind_background_disk_writes(tmp_path):
    """Disk writes that hang (a virtual disk stalled: O_DIRECT writes block) occupy no thread a
    load's or a store's device copy needs: with more writes hung than there are transfer threads,
    a load from host and a new store both finish, bytes exact; the writes land once the disk
    answers. (One shared queue once froze both demo workers: their forwards waited on loads, and
    vLLM's blocks on stores, queued behind hung writes.)"""
    disk_answers, hung = threading.Event(), []
    kv = KVManager(MODEL, config(tmp_path, host_blocks=64, disk_blocks=256), mover_hook=hung_disk(disk_answers, hung))
    dev = device_tensors(L, 64)
    kv.register_device_cache(dev, L)
    try:
        prompts = [prompt(k, 4) for k in range(1, 9)]  # 8 puts: more disk writes than transfer threads
        for k, pr in enumerate(prompts):
            for i, h in enumerate(kv.hashes(pr).sequence):
                fill(dev, L, 4 * k + i, h)
        ids = [kv.put_async(pr, [4 * k + i for i in range(4)]) for k, pr in enumerate(prompts)]
        results = kv.wait(ids, timeout=30)  # a store reports once its device copy landed
        assert all(r.status is TaskStatus.SUCCESS and r.num_tokens == 4 * TPB for r in results.values()), results
        # every thread the writes may take is taken, and more writes wait for one
        wait_until("the disk writes hang", lambda: len(hung) >= 2 and kv.transfer.queue_depth > 0, timeout=30)
        assert load_checked(kv, dev, prompts[0], [40, 41, 42, 43]) == 4  # from host, while the disk hangs
        late = prompt(9, 4)
        for i, h in enumerate(kv.hashes(late).sequence):
            fill(dev, L, 48 + i, h)
        tid = kv.put_async(late, [48, 49, 50, 51])
        assert kv.wait([tid], timeout=30)[tid].num_tokens == 4 * TPB  # a store's device copy too
        assert load_checked(kv, dev, late, [56, 57, 58, 59]) == 4
        assert not disk_answers.is_set() and kv.match(prompts[0])["disk"] == 0
        disk_answers.set()
        assert kv.drain(timeout=30)
        assert all(kv.match(pr)["disk"] == 4 * TPB for pr in [*prompts, late])
    finally:
        disk_answers.set()
        kv.shutdown()


def test_cancelling_a_burst_of_deferred_puts_leaks_nothing(tmp_path):
    kv, dev = open_manager(tmp_path, num_device_blocks=120, host_blocks=24, disk_blocks=120)
    try:
        ids = [kv.put_async(prompt(k, 6), [6 * k + i for i in range(6)]) for k in range(20)]
        kv.cancel(ids)
        results = kv.wait(ids, timeout=30)
        assert {r.status for r in results.values()} <= {TaskStatus.SUCCESS, TaskStatus.CANCELLED}
        assert kv.drain(timeout=30)
        st = kv.stats().tasks
        assert (st.in_flight, st.deferred_puts, kv.cache.task_ids()) == (0, 0, [])
        delivered = Delivered()
        late = [kv.put_async(prompt(100 + k, 6), [6 * k + i for i in range(6)], on_done=delivered) for k in range(8)]
    finally:
        kv.shutdown()  # deferred puts of a closing manager are cancelled, never left hanging
    assert all(r is not None and r.status in (TaskStatus.SUCCESS, TaskStatus.CANCELLED) for r in delivered.of(late))


# --------------------------------------------------------------------------- what held up


def test_wrong_token_types_raise_clear_errors_and_equivalent_types_agree(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        toks = prompt(1, 4)
        store(kv, dev, toks, [0, 1, 2, 3])
        for bad, exc, words in [
            ("hello", TypeError, "token_ids"),
            ((x for x in toks), TypeError, "token_ids"),
            ([float(x) for x in toks], TypeError, "token_ids"),
            ([-1] + toks[1:], ValueError, "out of range"),
            ([1 << 40] + toks[1:], ValueError, "out of range"),
            (np.array(toks).reshape(4, TPB), ValueError, "1-D"),
            (torch.tensor(toks, dtype=torch.float32), TypeError, "integer dtype"),
        ]:
            with pytest.raises(exc, match=words):
                kv.put_async(bad, [0, 1, 2, 3])
        want = kv.match(toks)
        assert want["host"] == 4 * TPB
        for same in (
            tuple(toks),
            np.array(toks, dtype=np.int32),
            np.array(toks, dtype=np.uint32),
            np.array(toks, dtype=np.int64),
            torch.tensor(toks),
            torch.tensor(toks, dtype=torch.int32),
        ):
            assert kv.match(same) == want
        assert kv.match(toks[: 3 * TPB + 5])["host"] == 3 * TPB  # trailing partial block never matches
        assert kv.stats().tasks.in_flight == 0  # refused calls left no task
    finally:
        kv.shutdown()


def test_wrong_order_and_unknown_ids(tmp_path):
    kv = KVManager(MODEL, config(tmp_path))
    try:
        toks = prompt(1, 2)
        with pytest.raises(RuntimeError, match="register_device_cache"):
            kv.get_async(toks, [0, 1])
        with pytest.raises(RuntimeError, match="register_device_cache"):
            kv.put_async(toks, [0, 1])
        dev = device_tensors(L, 8)
        kv.register_device_cache(dev, L)
        with pytest.raises(IndexError, match="out of range"):
            kv.put_async(toks, [-1, 0])
        with pytest.raises(IndexError, match="out of range"):
            kv.put_async(toks, [7, 8])
        with pytest.raises(ValueError, match="device block ids"):
            kv.put_async(toks, [0])
        store(kv, dev, toks, [0, 1])
        g = kv.get_async(toks, [2, 3], layerwise=True)
        for layer in (-1, MODEL.num_layers):
            with pytest.raises(ValueError, match="layer"):
                kv.wait_for_layer(g, layer)
        assert kv.wait_for_layer(g, MODEL.num_layers - 1, timeout=10)
        assert kv.wait([g], timeout=10)[g].status is TaskStatus.SUCCESS
        kv.cancel([g])  # issued and collected: a no-op (cancel may race wait)
        for again in (
            lambda: kv.wait([g]),
            lambda: kv.cancel([10**9]),
            lambda: kv.wait([10**9]),
            lambda: kv.try_wait([-1]),
            lambda: kv.wait_for_layer(g, 0),
        ):
            with pytest.raises(KeyError):
                again()
        with pytest.raises(ValueError, match="skip_blocks"):
            kv.get_async(toks, [0, 1], skip_blocks=-1)
    finally:
        kv.shutdown()


def test_reset_refuses_while_tasks_run_and_works_after_drain(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        toks = prompt(1, 8)
        p = kv.put_async(toks, list(range(8)))
        with pytest.raises(RuntimeError, match="drain"):
            kv.reset()
        kv.wait([p], timeout=10)
        assert kv.drain(timeout=20)
        kv.reset()
        assert kv.match(toks) == {"host": 0, "disk": 0}
    finally:
        kv.shutdown()


def test_second_manager_on_the_same_dir_is_refused_then_restart_is_byte_exact(tmp_path):
    kv, dev = open_manager(tmp_path)
    prompts = [prompt(k, 6) for k in range(1, 6)]  # 30 blocks: more than host (24), so disk serves some
    try:
        with pytest.raises(SsdInUseError, match="in use by pid"):
            KVManager(MODEL, config(tmp_path))
        for pr in prompts:
            store(kv, dev, pr, list(range(6)))
    finally:
        kv.shutdown()
    kv, dev = open_manager(tmp_path)
    try:
        for pr in prompts:
            assert kv.match(pr)["disk"] == 6 * TPB
            assert load_checked(kv, dev, pr, list(range(10, 16))) == 6
    finally:
        kv.shutdown()


def test_other_namespace_on_the_same_dir_sees_nothing(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        store(kv, dev, prompt(1, 4), [0, 1, 2, 3])
    finally:
        kv.shutdown()
    with pytest.raises(SsdLayoutError, match="namespace '' on disk vs 'tenant-b' here"):
        KVManager(MODEL, config(tmp_path), namespace="tenant-b")
    for f in glob.glob(f"{tmp_path}/ssd*/flexkv-journal.log"):  # the explicit wipe the error names
        os.unlink(f)
    other = KVManager(MODEL, config(tmp_path), namespace="tenant-b")
    try:
        assert other.match(prompt(1, 4)) == {"host": 0, "disk": 0}
    finally:
        other.shutdown()


@pytest.mark.parametrize("damage", ["flip_block_bytes", "truncate_blocks", "truncate_journal_mid_line"])
def test_damaged_files_between_runs_never_yield_wrong_bytes(tmp_path, damage):
    kv, dev = open_manager(tmp_path, host_blocks=8, disk_blocks=32)
    prompts = [prompt(k, 4) for k in range(1, 6)]
    try:
        for pr in prompts:
            store(kv, dev, pr, [0, 1, 2, 3])
    finally:
        kv.shutdown()
    blocks = sorted(glob.glob(f"{tmp_path}/ssd*/flexkv-blocks.kv"))
    journal = sorted(glob.glob(f"{tmp_path}/ssd*/flexkv-journal.log"))
    assert blocks and journal
    if damage == "flip_block_bytes":
        for f in blocks:
            size = os.path.getsize(f)
            with open(f, "r+b") as fh:
                for off in range(4096, size, 24 * 1024 + 4096):
                    fh.seek(off)
                    b = fh.read(1)
                    fh.seek(off)
                    fh.write(bytes([b[0] ^ 0xFF]) if b else b"\xff")
    elif damage == "truncate_blocks":
        with open(blocks[0], "r+b") as fh:
            fh.truncate(os.path.getsize(blocks[0]) // 3)
    else:
        size = os.path.getsize(journal[0])
        with open(journal[0], "r+b") as fh:
            fh.truncate(size - 7)
    kv, dev = open_manager(tmp_path, host_blocks=8, disk_blocks=32)
    try:
        restored = sum(load_checked(kv, dev, pr, [10, 11, 12, 13]) for pr in prompts)
        print(damage, "restored", restored, "of", 4 * len(prompts))
        if damage == "truncate_journal_mid_line":
            assert 4 * len(prompts) - 4 <= restored < 4 * len(prompts)  # only the torn last record is lost
        else:
            assert restored < 4 * len(prompts)  # the damage was seen, not served
        # the tier still works after the damage
        store(kv, dev, prompt(9, 4), [0, 1, 2, 3])
        assert load_checked(kv, dev, prompt(9, 4), [20, 21, 22, 23]) == 4
    finally:
        kv.shutdown()


def test_threaded_burst_with_eviction_restores_exact_bytes(tmp_path):
    # host 24 blocks, disk 64, 12 prompts x 4 blocks cycled by 4 threads: constant eviction on host.
    kv, dev = open_manager(tmp_path, num_device_blocks=256, host_blocks=24, disk_blocks=64)
    errors: list = []

    def worker(w: int) -> None:
        base = w * 64
        try:
            for it in range(15):
                pr = prompt(1 + (it * 7 + w) % 12, 4)
                h = kv.hashes(pr).sequence
                ids = [base + j for j in range(4)]
                for j, b in enumerate(ids):
                    fill(dev, L, b, h[j])
                kv.wait([kv.put_async(pr, ids)], timeout=30)
                load_checked(kv, dev, pr, [base + 8 + j for j in range(4)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert kv.drain(timeout=30)
        assert kv.stats().host.evicted_blocks > 0
    finally:
        kv.shutdown()


def test_result_expiry_and_flood_limit(tmp_path):
    kv, dev = open_manager(tmp_path, task_result_ttl_seconds=0.2, max_tasks_in_flight=3)
    try:
        t = kv.put_async(prompt(1, 1), [0])
        assert kv.drain(timeout=10)
        wait_until("a result expired", lambda: kv.stats().tasks.expired_results >= 1, timeout=10, every=0.02)
        with pytest.raises(KeyError):
            kv.wait([t])
        accepted = []
        with pytest.raises(TooManyTasks, match="max_tasks_in_flight"):
            for k in range(100):
                accepted.append(kv.put_async(prompt(10 + k, 4), [4 * (k % 15) + j for j in range(4)]))
        assert kv.drain(timeout=30)
        assert len(accepted) < 100
    finally:
        kv.shutdown()


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(cpu_cache_gb=float("nan")), "finite"),
        (dict(cpu_cache_gb=float("inf")), "finite"),
        (dict(cpu_cache_gb=-1), ">= 0"),
        (dict(tokens_per_block=24), "power of two"),
        (dict(tokens_per_block=16.5), "integer"),
        (dict(tokens_per_block=True), "integer"),
        (dict(evict_ratio=0), "evict_ratio"),
        (dict(evict_start_threshold=float("nan")), "finite"),
        (dict(task_result_ttl_seconds=0), "task_result_ttl_seconds"),
        (dict(max_tasks_in_flight=0), "max_tasks_in_flight"),
        (dict(io_queue_depth=0), "io_queue_depth"),
        (dict(eviction_policy="random"), "lru"),
        (dict(enable_nixl=2), "true/false"),
        (dict(enable_gds=True), "disk tier"),
        (dict(ssd_cache_gb=8), "ssd_cache_dir"),
        (dict(cpu_cache_gb=2, ssd_cache_gb=1, ssd_cache_dir="/tmp"), "smaller"),
    ],
)
def test_config_odd_values_raise_config_error(kw, words):
    with pytest.raises(ConfigError, match=words):
        CacheConfig(**kw)


def test_config_sources_unknown_keys_files_and_aliases(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEXKV_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError, match="bogus"):
        CacheConfig.from_dict({"bogus": 1})
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="ssd_cache_dir"):
        CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=str(f))
    y = tmp_path / "c.yaml"
    y.write_text("cpu_cache_gb: 1\nbogus: 3\n")
    with pytest.raises(ConfigError, match="bogus"):
        CacheConfig.load(str(y))
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "2")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "3")
    with pytest.raises(ConfigError, match="unset one"):
        CacheConfig.load()
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB")
    y.write_text(
        "cpu_cache_gb: 1\nssd_cache_dir: [" + str(tmp_path / "d1") + ", " + str(tmp_path / "d2") + "]\n"
        "ssd_cache_gb: 4\n"
    )
    c = CacheConfig.load(str(y))
    assert c.cpu_cache_gb == 2.0  # environment overrides the file
    assert len(c.ssd_cache_dir) == 2
    assert CacheConfig(cpu_cache_gb=1, ssd_cache_gb=2, ssd_cache_dir=f"{tmp_path}/a;{tmp_path}/b;").ssd_cache_dir == (
        f"{tmp_path}/a",
        f"{tmp_path}/b",
    )


@pytest.mark.integration
def test_dir_held_by_another_process_is_refused_naming_it_and_freed_by_its_death(tmp_path):
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from dynamo_flexkv import KVManager\nfrom kv_helpers import MODEL, config\n"
            f"kv = KVManager(MODEL, config({str(tmp_path)!r})); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=HELPERS,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(SsdInUseError, match=f"pid {holder.pid}"):
            KVManager(MODEL, config(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    KVManager(MODEL, config(tmp_path)).shutdown()  # the lock died with its holder


def test_array_and_tensor_ids_round_trip_and_timed_out_wait_keeps_the_result(tmp_path):
    kv, dev = open_manager(tmp_path)
    try:
        toks = np.array(prompt(1, 5), dtype=np.uint32)
        h = kv.hashes(toks).sequence
        for i in range(5):
            fill(dev, L, i, h[i])
        p = kv.put_async(toks, torch.arange(5))
        assert kv.wait([p], timeout=10)[p].status is TaskStatus.SUCCESS
        assert kv.drain(timeout=10)
        g = kv.get_async(torch.tensor(prompt(1, 5)), np.arange(30, 35, dtype=np.int32))
        first = kv.wait([g], timeout=0)[g]
        assert first.status in (TaskStatus.TIMEOUT, TaskStatus.SUCCESS)
        if first.status is TaskStatus.TIMEOUT:  # a timed-out wait does not consume the result
            assert kv.wait([g], timeout=10)[g].status is TaskStatus.SUCCESS
        assert all(holds(dev, L, 30 + i, h[i]) for i in range(5))
    finally:
        kv.shutdown()


def test_skip_blocks_from_disk_after_restart_plans_and_restores_exactly(tmp_path):
    kv, dev = open_manager(tmp_path, host_blocks=8, disk_blocks=32)
    toks = prompt(1, 6)
    try:
        store(kv, dev, toks, list(range(6)))
    finally:
        kv.shutdown()
    kv, dev = open_manager(tmp_path, host_blocks=8, disk_blocks=32)
    try:
        h = kv.hashes(toks).sequence
        g = kv.get_async(toks, list(range(10, 16)), skip_blocks=2, layerwise=True)
        assert kv.planned_tokens_by_tier(g) == {"host": 0, "disk": 4 * TPB}
        r = kv.wait([g], timeout=10)[g]
        assert r.status is TaskStatus.SUCCESS and r.num_tokens == 4 * TPB
        assert all(holds(dev, L, 10 + i, h[i]) for i in range(2, 6))
        assert not holds(dev, L, 10, h[0])  # skipped blocks are left alone
    finally:
        kv.shutdown()


def test_two_threads_waiting_on_one_task_get_its_result_once(tmp_path):
    """One get waited on from 8 threads at once: exactly one gets the result, the others a KeyError
    saying it was collected elsewhere; a wait listing the same id twice returns it once."""
    kv, dev = open_manager(tmp_path)
    try:
        toks = prompt(2, 8)
        store(kv, dev, toks, list(range(8)))
        for _ in range(20):
            g = kv.get_async(toks, list(range(20, 28)))
            barrier, got, refused = threading.Barrier(8), [], []

            def waiter():
                barrier.wait()
                try:
                    got.append(kv.wait([g], timeout=10)[g])
                except KeyError as e:
                    refused.append(str(e))

            threads = [threading.Thread(target=waiter) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            assert len(got) == 1 and got[0].status is TaskStatus.SUCCESS, got
            assert len(refused) == 7 and all("already" in m for m in refused), refused
        g = kv.get_async(toks, list(range(20, 28)))
        assert list(kv.wait([g, g], timeout=10)) == [g]
        assert kv.stats().tasks.in_flight == 0
    finally:
        kv.shutdown()


def test_a_restarts_announcement_can_be_repeated_for_a_subscriber_that_dropped_it(tmp_path):
    """announce_adopted(repeat=True) sends the re-adopted blocks still held again (the router may
    have dropped the first copy); blocks evicted since are not sent."""
    kv, dev = open_manager(tmp_path)
    store(kv, dev, prompt(7, 4), [0, 1, 2, 3])
    kv.shutdown()
    seen: list = []

    class Listener:
        def on_stored(self, tier, run) -> None:
            seen.append(len(run.hashes))

        def on_removed(self, tier, hashes) -> None:
            pass

    kv = KVManager(MODEL, config(tmp_path), listener=Listener())
    try:
        assert kv.announce_adopted(repeat=True) == 0  # nothing announced yet: nothing to repeat
        assert kv.announce_adopted() == 4 and kv.announce_adopted() == 0  # once only
        assert kv.announce_adopted(repeat=True) == 4 and seen == [4, 4]
        kv.evict("disk")
        assert kv.announce_adopted(repeat=True) == 0
    finally:
        kv.shutdown()
