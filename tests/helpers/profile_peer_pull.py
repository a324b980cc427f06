"""Profile (issue 50): where an 8K-token peer pull's time goes, beside its ceilings, in one process
on loopback (the tests' small model: 512 blocks, 12 MiB). Two workers and their host agents as in
test_peer_pull.py; after a warm-up pull each row stores a new prefix on the source, pulls it, loads
it (pull + load), and loads it again from the receiver's own host tier (the baseline). Phases:
the receiver's staging, the request round trip (the source's pin and checksums inside it), the
NIXL read (descriptor preparation, posting, polls), the receiver's checksums, the release and the
commit. Ceilings in the same run: a memcpy of 12 MiB into touched and into fresh pages, and a raw
NIXL read of the same 512 slots between the two agents (no control plane, no checksums).
The machine is shared: read medians and minima, not single rows. UCX_TLS picks UCX's transports.

    .venv/bin/python tests/helpers/profile_peer_pull.py [ROWS]
"""

from __future__ import annotations

import collections
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kv_helpers import MODEL, config, device_tensors, fill

from dynamo_flexkv import KVLayoutType, KVManager
from dynamo_flexkv.core import native
from dynamo_flexkv.core.peer import PeerReceiver, PeerSource, SourceLimits, host_agent
from dynamo_flexkv.core.peer import receiver as receiver_module
from dynamo_flexkv.core.transfer.nixl_agent import exit_past_libnl

TPB, LAYOUT, SECRET = 16, KVLayoutType.LAYERBLOCK, b"profile"
BLOCKS = 8192 // TPB
PHASES: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str, fn: Callable) -> Callable:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[name].append(time.perf_counter() - t0)

    return wrapper


class Worker:
    def __init__(self, tmp: Path, name: str) -> None:
        self.kv = KVManager(MODEL, config(tmp / name, host_blocks=2 * BLOCKS, disk_blocks=0), model_id="m")
        self.dev = device_tensors(LAYOUT, 2 * BLOCKS)
        self.kv.register_device_cache(self.dev, LAYOUT)
        self.agent = host_agent(self.kv)

    def store(self, tokens: list[int]) -> None:
        for i, h in enumerate(int(h) for h in self.kv.hashes(tokens).sequence):
            fill(self.dev, LAYOUT, i, h)
        tid = self.kv.put_async(tokens, list(range(BLOCKS)))
        assert self.kv.wait([tid])[tid].ok

    def load(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        tid = self.kv.get_async(tokens, list(range(BLOCKS)))
        assert self.kv.wait([tid])[tid].num_tokens == BLOCKS * TPB
        return time.perf_counter() - t0


def tokens_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(BLOCKS * TPB)]


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.2f} min {min(xs) * 1e3:.2f} ms"


def main(rows: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="flexkv-profile-pull-"))
    a, b = Worker(tmp, "a"), Worker(tmp, "b")
    source = PeerSource(a.kv, a.agent, SECRET, limits=SourceLimits(max_pinned_blocks=BLOCKS))
    receiver = PeerReceiver(b.kv, b.agent, SECRET)
    b.kv.hashes = timed("receiver: block hashes of the prompt", b.kv.hashes)  # type: ignore[method-assign]
    b.kv.stage_host = timed("receiver: stage host blocks", b.kv.stage_host)  # type: ignore[method-assign]
    a.kv.pin_host = timed("  source: pin + checksums", a.kv.pin_host)  # type: ignore[method-assign]
    link = receiver_module._Link
    link.ask = timed("receiver: request -> pinned answer", link.ask)  # type: ignore[method-assign]
    b.agent.pull = timed("receiver: NIXL read", b.agent.pull)  # type: ignore[method-assign]
    b.agent._connect = timed("  descriptors (prepared once)", b.agent._connect)  # type: ignore[method-assign]
    nx = b.agent.agent
    nx.make_prepped_xfer = timed("  make_prepped_xfer", nx.make_prepped_xfer)
    nx.transfer = timed("  transfer (post)", nx.transfer)
    nx.check_xfer_state = timed("  check_xfer_state (polls)", nx.check_xfer_state)
    receiver_module._native = type(  # type: ignore[attr-defined]
        "N", (), {"checksums": staticmethod(timed("receiver: checksums", native.checksums))}
    )
    link.tell = timed("receiver: release", link.tell)  # type: ignore[method-assign]
    b.kv.commit_staged = timed("receiver: commit", b.kv.commit_staged)  # type: ignore[method-assign]
    per: dict[str, list[float]] = collections.defaultdict(list)
    try:
        warm = tokens_of(1)
        a.store(warm)
        assert receiver.pull(source.endpoint, warm).ok
        b.load(warm)
        for row in range(rows):
            tokens = tokens_of(100 + row)
            a.store(tokens)
            PHASES.clear()
            t0 = time.perf_counter()
            r = receiver.pull(source.endpoint, tokens)
            pull_s = time.perf_counter() - t0
            assert r.ok and r.blocks == BLOCKS, r
            for name, xs in PHASES.items():
                per[name].append(sum(xs))
            hinted = pull_s + b.load(tokens)
            host = b.load(tokens)
            per["pull"].append(pull_s)
            per["pull + load"].append(hinted)
            per["load from own host"].append(host)
            per["(pull + load) / host (per row)"].append(hinted / host / 1e3)
        nbytes = BLOCKS * b.kv.host.layout.block_bytes
        src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
        dst = np.zeros_like(src)
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            per["ceiling: memcpy 12 MiB, touched pages"].append(time.perf_counter() - t0)
            fresh = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
            t0 = time.perf_counter()
            np.copyto(fresh, src)
            per["ceiling: memcpy 12 MiB, fresh pages"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            native.checksums(
                b.kv.host.base, np.arange(BLOCKS, dtype=np.uint64) * np.uint64(nbytes // BLOCKS), nbytes // BLOCKS
            )
            per["ceiling: xxh3 of 12 MiB"].append(time.perf_counter() - t0)
        hashes = [int(h) for h in a.kv.hashes(tokens).sequence]
        pin = a.kv.pin_host(("profile", 1), hashes, 0, BLOCKS)
        assert pin is not None
        remote = receiver_module.RemoteHost(
            a.agent.name, a.agent.metadata, [a.kv.host.base], a.kv.host.layout.block_bytes, a.kv.host.num_blocks
        )
        for _ in range(5):
            t0 = time.perf_counter()
            b.agent.pull(remote, pin.slots, list(range(BLOCKS)), 10.0)
            per["ceiling: raw NIXL read of the 512 slots"].append(time.perf_counter() - t0)
        a.kv.unpin(("profile", 1))
        print(f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}, {nbytes / 2**20:.1f} MiB, {rows} rows")
        for name, xs in per.items():
            print(
                f"  {name:42s} {ms(xs)}"
                if "per row" not in name
                else f"  {name:42s} median {statistics.median(xs) * 1e3:.2f}"
            )
    finally:
        receiver.close()
        source.close()
        b.agent.close()
        a.agent.close()
        b.kv.shutdown()
        a.kv.shutdown()


if __name__ == "__main__":
    with exit_past_libnl():
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
