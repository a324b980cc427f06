"""Adversarial: puts deferred behind a hung disk end after MAX_PUT_DEFER_S (deferred_puts.py),
in a burst, under cancel, shutdown and recovery; every block a put reports stored loads back exact."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from kv_helpers import MODEL, TPB, Delivered, config, device_tensors, fill, holds, hung_disk
from served import wait_until

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

L = KVLayoutType.LAYERBLOCK
DEFER_S = 0.5


def prompt(k: int, blocks: int) -> list:
    return list(range(k * 100_000, k * 100_000 + TPB * blocks))


@pytest.fixture
def hung(tmp_path, monkeypatch):
    from dynamo_flexkv.core import manager

    monkeypatch.setattr(manager, "MAX_PUT_DEFER_S", DEFER_S)
    answers = threading.Event()
    kv = KVManager(MODEL, config(tmp_path, host_blocks=24, disk_blocks=200), mover_hook=hung_disk(answers))
    dev = device_tensors(L, 160)
    kv.register_device_cache(dev, L)
    raised: list = []
    old = threading.excepthook
    threading.excepthook = lambda args: raised.append(args)
    try:
        yield kv, dev, answers, raised
    finally:
        answers.set()
        kv.shutdown()
        threading.excepthook = old
    assert not raised, f"a thread raised: {[(a.thread, a.exc_value) for a in raised]}"


def put(kv, dev, tokens, ids, on_done=None):
    for i, b in enumerate(ids):
        fill(dev, L, b, kv.hashes(tokens).sequence[i])
    return kv.put_async(tokens, ids, on_done=on_done)


def fill_host(kv, dev):
    first = put(kv, dev, prompt(1, 24), list(range(24)))
    assert kv.wait([first], timeout=30)[first].num_tokens == 24 * TPB


def load_exact(kv, dev, tokens, ids) -> int:
    for b in ids:
        for layer in dev:
            layer[b].zero_()
    r = next(iter(kv.wait([kv.get_async(tokens, ids)], timeout=20).values()))
    assert r.status in (TaskStatus.SUCCESS, TaskStatus.NOT_FOUND), r
    n = r.num_tokens // TPB
    hashes = kv.hashes(tokens).sequence
    wrong = [i for i in range(n) if not holds(dev, L, ids[i], hashes[i])]
    assert not wrong, f"blocks {wrong} restored wrong"
    return n


def test_a_burst_of_60_deferred_puts_all_end_near_the_bound_and_load_back_exact(hung):
    kv, dev, answers, _ = hung
    fill_host(kv, dev)
    t0 = time.monotonic()
    ids = [put(kv, dev, prompt(10 + k, 2), [24 + 2 * k, 25 + 2 * k]) for k in range(60)]
    results = kv.wait(ids, timeout=30)
    took = time.monotonic() - t0
    assert took < DEFER_S + 5, f"60 deferred puts took {took:.2f}s"
    assert all(r.status is TaskStatus.SUCCESS for r in results.values()), results
    assert kv.stats().tasks.deferred_puts == 0
    stored = {k: results[t].num_tokens // TPB for k, t in enumerate(ids)}
    answers.set()
    assert kv.drain(timeout=30)
    for k, n in stored.items():
        got = load_exact(kv, dev, prompt(10 + k, 2), [150, 151])
        assert got >= n, f"prompt {k}: put said {n} blocks stored, load found {got}"
    # after recovery, new puts store fully
    more = [put(kv, dev, prompt(200 + k, 2), [24 + 2 * k, 25 + 2 * k]) for k in range(10)]
    assert all(r.num_tokens == 2 * TPB for r in kv.wait(more, timeout=30).values())
    for k in range(10):
        assert load_exact(kv, dev, prompt(200 + k, 2), [150, 151]) == 2


@pytest.mark.parametrize("delay", [0.0, DEFER_S * 0.9, DEFER_S, DEFER_S * 1.1])
def test_cancel_racing_the_defer_timer(hung, delay):
    kv, dev, answers, _ = hung
    fill_host(kv, dev)
    ids = [put(kv, dev, prompt(10 + k, 2), [24 + 2 * k, 25 + 2 * k]) for k in range(20)]
    wait_until("puts deferred", lambda: kv.stats().tasks.deferred_puts > 0, timeout=10)
    time.sleep(delay)
    kv.cancel(ids)
    results = kv.wait(ids, timeout=30)
    assert {r.status for r in results.values()} <= {TaskStatus.SUCCESS, TaskStatus.CANCELLED}
    assert kv.stats().tasks.deferred_puts == 0
    answers.set()
    assert kv.drain(timeout=30)
    assert kv.cache.task_ids() == []
    for k, t in enumerate(ids):
        if results[t].status is TaskStatus.SUCCESS:
            assert load_exact(kv, dev, prompt(10 + k, 2), [150, 151]) >= results[t].num_tokens // TPB


@pytest.mark.parametrize("delay", [0.0, DEFER_S * 0.95, DEFER_S, DEFER_S * 1.05])
def test_shutdown_while_the_defer_timer_is_armed(hung, delay, caplog):
    kv, dev, answers, raised = hung
    fill_host(kv, dev)
    d = Delivered()
    ids = [put(kv, dev, prompt(10 + k, 2), [24 + 2 * k, 25 + 2 * k], on_done=d) for k in range(20)]
    wait_until("puts deferred", lambda: kv.stats().tasks.deferred_puts > 0, timeout=10)
    time.sleep(delay)
    answers.set()
    with caplog.at_level(logging.DEBUG):
        t0 = time.monotonic()
        kv.shutdown()
        assert time.monotonic() - t0 < 10
        assert kv._deferred._timer is None  # shutdown disarmed it
    got = d.of(ids)
    assert all(r is not None and r.status in (TaskStatus.SUCCESS, TaskStatus.CANCELLED) for r in got), got
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def test_drain_waits_for_deferred_puts_then_returns_false_or_true_honestly(hung):
    kv, dev, answers, _ = hung
    fill_host(kv, dev)
    ids = [put(kv, dev, prompt(10 + k, 2), [24 + 2 * k, 25 + 2 * k]) for k in range(5)]
    wait_until("puts deferred", lambda: kv.stats().tasks.deferred_puts > 0, timeout=10)
    # the disk is hung: drain cannot finish (disk writes of the first put are in flight)
    assert kv.drain(timeout=DEFER_S * 3) is False
    # but the deferred puts did end by their bound
    assert kv.stats().tasks.deferred_puts == 0
    assert all(r.status is TaskStatus.SUCCESS for r in kv.wait(ids, timeout=5).values())
    answers.set()
    assert kv.drain(timeout=30)
