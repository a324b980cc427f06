"""SIGKILL in the middle of heavy SSD writes, at random moments, many times: each restart on the
same directories re-adopts only blocks whose every byte is what the writer put there, and a get
never serves a torn block."""

import multiprocessing
import os
import signal
import time

import numpy as np
from kv_helpers import TPB, config, device_tensors, holds

from dynamo_flexkv import KVLayoutType, KVManager, TaskStatus

ROUNDS = int(os.environ.get("FLEXKV_CRASH_ROUNDS", "8"))


def _chains(adopted):
    """Every adopted block with the full prompt up to it (parents come first in the report)."""
    tokens = {}
    for e in adopted:
        assert e.tokens is not None, "the journal lost a block's token ids"
        own = np.frombuffer(e.tokens, dtype="<u4").tolist()
        tokens[e.seq_hash] = (tokens[e.parent] if e.parent is not None else []) + own
    children = {e.parent for e in adopted}
    return [(e, tokens[e.seq_hash]) for e in adopted if e.seq_hash not in children]  # leaves


def test_sigkill_during_disk_writes_never_serves_torn_blocks(tmp_path):
    ctx = multiprocessing.get_context("forkserver")  # a clean single-threaded parent per writer
    # Python 3.11's forkserver ignores the parent's sys.path, so preload installed modules only.
    ctx.set_forkserver_preload(["torch", "numpy", "dynamo_flexkv.core.manager"])
    from crash_writer import DEVICE_BLOCKS, MAX_BLOCKS

    cfg = config(tmp_path, host_blocks=12, disk_blocks=96, evict_ratio=0.1)
    rng = np.random.default_rng(7)
    adopted_total, torn_total, checked = 0, 0, 0
    for rnd in range(ROUNDS):
        ready = ctx.Event()
        writer = ctx.Process(target=_run_writer, args=(cfg, rnd, ready), daemon=True)
        t0 = time.monotonic()
        writer.start()
        assert ready.wait(120), "the writer never got going"
        t1 = time.monotonic()
        time.sleep(float(rng.uniform(0.0, 0.4)))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        assert writer.exitcode == -signal.SIGKILL
        with KVManager(*_manager_args(cfg)) as kv:
            report = kv.adopt_report
            adopted_total += len(report.adopted)
            torn_total += report.torn
            assert report.mismatched == 0
            dev = device_tensors(KVLayoutType.LAYERBLOCK, DEVICE_BLOCKS)
            kv.register_device_cache(dev)
            for leaf, prompt in _chains(report.adopted):
                h = kv.hashes(prompt).sequence
                assert int(h[-1]) == leaf.seq_hash, "journaled tokens do not hash to the journaled block"
                assert len(h) <= MAX_BLOCKS
                ids = list(range(len(h)))
                t = kv.get_async(prompt, ids)
                r = kv.wait([t], timeout=60)[t]
                assert r.status is TaskStatus.SUCCESS and r.num_tokens == len(h) * TPB, r
                for j, s in enumerate(h):
                    assert holds(dev, KVLayoutType.LAYERBLOCK, j, int(s)), f"round {rnd}: block {j} torn but served"
                checked += len(h)
            assert kv.drain(60)
        print(f"round {rnd}: writer ready after {t1 - t0:.1f}s, restart + checks {time.monotonic() - t1:.1f}s")
    print(f"{ROUNDS} kills: adopted {adopted_total} blocks (checked {checked} block loads), dropped {torn_total} torn")
    assert adopted_total > 0 and checked >= adopted_total


def _manager_args(cfg):
    from kv_helpers import MODEL

    return MODEL, cfg


def _run_writer(cfg, seed, ready):
    from crash_writer import write_forever

    write_forever(cfg, seed, ready)
