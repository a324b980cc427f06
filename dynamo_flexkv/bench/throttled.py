"""bench throttled: cost-aware loading (core/cost.py) against always-load and against recompute, on
the reference engine (`small` preset), with a disk tier throttled below what recompute costs.

The throttle is bench-only: a wrapper around the disk mover that, after each disk->host read,
sleeps until the read has taken ``bytes / rate`` (a rate-limited disk: the sleep uses no CPU, as
waiting on a slow device would not). The rate is set from the same run's recompute TTFT so that
reading the cached prefix alone takes ``SLOW_FACTOR`` (3) times recomputing the whole prompt:
whatever the machine, the tier is slower than recompute (3, not 2: the sleep does not slow down
when other work slows the CPU, recompute does). Writes and the host tier are not throttled.

Per prompt size, ``repeat`` prompts, each measured on fresh engines (empty device cache). The two
policies are two offloads opened as an engine opens them (open_offload, ``load_policy`` always and
cost_aware), each with its own tiers and the same throttled disk (open_offload's ``mover_hook``);
every prompt is stored in both. The cost-aware one keeps its measurements across the rounds, as a
serving worker's does:

* recompute: offload off (the baseline of every ratio);
* host-90: 90% of the prompt in host memory (and on disk): always-load, then cost-aware;
* disk-90-slow: the same prompt with host dropped, only the throttled disk holds it: always-load,
  then cost-aware.

Before the timed requests, one untimed round lets the cost-aware offload's cold start (which
loads, as always-load does) measure the tiers. Medians; the cost-aware offload's decisions and
measured tier costs are printed after each size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.bench.ttft import Rig
from dynamo_flexkv.core.enums import LoadPolicy
from dynamo_flexkv.core.transfer.graph import OpKind, TransferOp
from dynamo_flexkv.core.transfer.runner import Mover
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LlamaModel

SLOW_FACTOR = 3.0  # the throttled disk reads the cached prefix in this many recompute TTFTs
FRACTION = 0.9


class ThrottledDisk:
    """Bench-only: the disk mover, with each DISK2H read stretched to ``bytes / rate`` seconds
    (``rate`` None: not throttled). Put in place by open_offload's ``mover_hook`` (``hook``)."""

    def __init__(self, inner: Mover, rate: float | None = None) -> None:
        self.inner: Mover = inner
        self.rate: float | None = rate

    def run(self, op: TransferOp) -> int:
        t0 = time.perf_counter()
        n = self.inner.run(op)
        if op.kind is OpKind.DISK2H and self.rate:
            left = n / self.rate - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)  # the throttle itself: a slow device's wait
        return n

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Throttle:
    """The DISK2H movers of every offload opened with ``hook``, and the rate they all read at."""

    def __init__(self) -> None:
        self.disks: list[ThrottledDisk] = []

    def hook(self, kind: OpKind, mover: Mover) -> Mover:
        if kind is not OpKind.DISK2H:
            return mover
        self.disks.append(ThrottledDisk(mover))
        return self.disks[-1]

    def set(self, bytes_per_s: float | None) -> None:
        for disk in self.disks:
            disk.rate = bytes_per_s


def run(args: argparse.Namespace) -> list[Case]:
    cfg = EngineModelConfig.preset("small")
    sizes = [2048] if args.quick else [4096, 8192]
    repeat = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    directory = tempfile.mkdtemp(prefix="flexkv-throttled-", dir=getattr(args, "dir", None))
    throttle = Throttle()
    model = LlamaModel(cfg)  # one model: both offloads' engines compute the same way
    rigs = {
        policy: Rig(cfg, max(sizes), os.path.join(directory, policy.value), policy, throttle.hook, model)
        for policy in (LoadPolicy.ALWAYS, LoadPolicy.COST_AWARE)
    }
    always, aware = rigs[LoadPolicy.ALWAYS], rigs[LoadPolicy.COST_AWARE]
    block_bytes = int(aware.offload.describe()["host_block_bytes"])
    cases: list[Case] = []

    def ttft(rig: Rig, prompt: list[int]) -> float:
        return rig.ttft(rig.engine(True, True, False), prompt)

    try:
        always.ttft(always.engine(False), rng.integers(0, cfg.vocab_size, 512).tolist())  # warm-up
        for size in sizes:
            label = f"{size // 1024}K"
            cached = int(size * FRACTION)
            throttle.set(None)
            # The rate: from recompute at this size, once the engine is warm at it (the first is slower).
            base = [
                always.ttft(always.engine(False), rng.integers(0, cfg.vocab_size, size).tolist()) for _ in range(4)
            ][1:]
            rate = (cached // cfg.block_size) * block_bytes / (SLOW_FACTOR * statistics.median(base))
            throttle.set(rate)
            times: dict[str, list[float]] = {}
            for i in range(repeat + 1):  # the first round is the untimed warm-up of the cost model
                prompt = rng.integers(0, cfg.vocab_size, size).tolist()
                for rig in rigs.values():
                    rig.store(prompt[:cached])
                got = {
                    "recompute": always.ttft(always.engine(False), prompt),
                    "host-90-always-load": ttft(always, prompt),
                    "host-90-cost-aware": ttft(aware, prompt),
                }
                for rig in rigs.values():
                    rig.drop_host()  # only the throttled disk holds the prefix
                got["disk-90-slow-always-load"] = ttft(always, prompt)
                got["disk-90-slow-cost-aware"] = ttft(aware, prompt)
                for rig in rigs.values():
                    rig.idle()
                    rig.reset()
                if i:
                    for name, t in got.items():
                        times.setdefault(name, []).append(t)
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
            st = aware.offload.stats()
            assert st is not None  # embedded tiers always answer
            print(
                f"[{label}] recompute median {r:.0f} ms; cost-aware decisions (tokens, all rounds): {st.prefix_tokens}"
            )
            print(
                f"[{label}] measured tier costs: "
                + ", ".join(
                    f"{t}: {c.latency_s * 1e3:.2f} ms + {c.bandwidth_bytes_per_s / 1e9:.3f} GB/s "
                    f"({c.observations} reads)"
                    for t, c in st.tier_costs.items()
                )
            )
    finally:
        for rig in rigs.values():
            rig.close()
        shutil.rmtree(directory, ignore_errors=True)
    return cases
