"""bench throttled: cost-aware loading (core/cost.py) against always-load and against recompute, on
the reference engine (`small` preset), with a disk tier throttled below what recompute costs.

The throttle is bench-only: a wrapper around the disk mover that, after each disk->host read,
sleeps until the read has taken ``bytes / rate`` (a rate-limited disk: the sleep uses no CPU, as
waiting on a slow device would not). The rate is set from the same run's recompute TTFT so that
reading the cached prefix alone takes ``SLOW_FACTOR`` (3) times recomputing the whole prompt:
whatever the machine, the tier is slower than recompute (3, not 2: the sleep does not slow down
when other work slows the CPU, recompute does). Writes and the host tier are not throttled.

Per prompt size, ``repeat`` prompts, each measured on fresh engines (empty device cache) sharing
one KVManager, whose cost model keeps its measurements across them, as a serving worker's does:

* recompute: offload off (the baseline of every ratio);
* host-90: 90% of the prompt in host memory (and on disk): always-load, then cost-aware;
* disk-90-slow: the same prompt with host dropped, only the throttled disk holds it: always-load,
  then cost-aware.

Before the timed requests, one untimed cost-aware request per case lets the cold start (which
loads, as always-load does) measure the tiers. Medians; the cost model's decisions and measured
tier costs are printed after each size.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.bench.ttft import Rig
from dynamo_flexkv.core.enums import LoadPolicy
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

SLOW_FACTOR = 3.0  # the throttled disk reads the cached prefix in this many recompute TTFTs
FRACTION = 0.9


class ThrottledDisk:
    """Bench-only: the disk mover, with each DISK2H read stretched to ``bytes / rate`` seconds."""

    def __init__(self, inner, bytes_per_s: float) -> None:
        self.inner, self.rate = inner, bytes_per_s

    def run(self, op: TransferOp) -> int:
        t0 = time.perf_counter()
        n = self.inner.run(op)
        if op.kind is OpKind.DISK2H:
            left = n / self.rate - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)  # the throttle itself: a slow device's wait
        return n

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(args: argparse.Namespace) -> list[Case]:
    cfg = EngineModelConfig.preset("small")
    sizes = [2048] if args.quick else [4096, 8192]
    repeat = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    directory = tempfile.mkdtemp(prefix="flexkv-throttled-", dir=getattr(args, "dir", None))
    rig = Rig(cfg, max(sizes), directory)
    kv = rig.kv
    disk = kv.transfer.movers[OpKind.DISK2H]
    block_bytes = kv.host.layout.block_bytes
    cases: list[Case] = []

    def ttft(policy, prompt) -> float:
        kv.cost.policy = policy
        return rig.ttft(rig.engine(True, True, False), prompt)

    try:
        rig.ttft(rig.engine(False), rng.integers(0, cfg.vocab_size, 512).tolist())  # warm-up
        for size in sizes:
            label = f"{size // 1024}K"
            cached = int(size * FRACTION)
            kv.transfer.movers[OpKind.DISK2H] = disk
            # The rate: from recompute at this size, once the engine is warm at it (the first is slower).
            base = [rig.ttft(rig.engine(False), rng.integers(0, cfg.vocab_size, size).tolist()) for _ in range(4)][1:]
            rate = (cached // cfg.block_size) * block_bytes / (SLOW_FACTOR * statistics.median(base))
            kv.transfer.movers[OpKind.DISK2H] = ThrottledDisk(disk, rate)
            times: dict[str, list[float]] = {}
            for i in range(repeat + 1):  # the first round is the untimed warm-up of the cost model
                prompt = rng.integers(0, cfg.vocab_size, size).tolist()
                rig.store(prompt[:cached])
                got = {
                    "recompute": rig.ttft(rig.engine(False), prompt),
                    "host-90-always-load": ttft(LoadPolicy.ALWAYS, prompt),
                    "host-90-cost-aware": ttft(LoadPolicy.COST_AWARE, prompt),
                }
                rig.drop_host()
                got["disk-90-slow-always-load"] = ttft(LoadPolicy.ALWAYS, prompt)
                rig.drop_host()  # the load staged the prefix into host again
                got["disk-90-slow-cost-aware"] = ttft(LoadPolicy.COST_AWARE, prompt)
                rig.idle()
                kv.reset()
                if i:
                    for name, t in got.items():
                        times.setdefault(name, []).append(t)
            kv.cost.policy = LoadPolicy.COST_AWARE
            r = statistics.median(times["recompute"]) * 1e3
            note = (
                f"small preset, {size} tokens, {int(FRACTION * 100)}% cached, disk throttled to "
                f"{rate / 1e6:.1f} MB/s (prefix read = {SLOW_FACTOR:g}x recompute), median of {repeat}"
            )
            for name in (
                "host-90-cost-aware",
                "host-90-always-load",
                "disk-90-slow-cost-aware",
                "disk-90-slow-always-load",
            ):
                cases.append(
                    Case(
                        "throttled",
                        f"{name}-{label}",
                        statistics.median(times[name]) * 1e3,
                        r,
                        "ms",
                        "recompute (offload off)",
                        note,
                    )
                )
            print(
                f"[{label}] per round, ms: "
                + "; ".join(f"{n}: " + " ".join(f"{t * 1e3:.0f}" for t in ts) for n, ts in times.items())
            )
            st = kv.stats()
            print(f"[{label}] recompute median {r:.0f} ms; decisions (tokens, all rounds): {st.prefix_tokens}")
            print(
                f"[{label}] measured tier costs: "
                + ", ".join(
                    f"{t}: {c.latency_s * 1e3:.2f} ms + {c.bandwidth_bytes_per_s / 1e9:.3f} GB/s "
                    f"({c.observations} reads)"
                    for t, c in st.tier_costs.items()
                )
            )
    finally:
        kv.transfer.movers[OpKind.DISK2H] = disk
        rig.close()
        shutil.rmtree(directory, ignore_errors=True)
    return cases
