"""bench ttft: time to first token of the reference engine (`small` preset) with a prompt's
prefix cached in host or disk memory, bulk versus layerwise load, against recompute (offload
disabled) of the same prompt in the same run; and the miss path (offload on, nothing cached).

Each measurement uses a fresh engine (empty device cache) and one request, so the time is what
the offload tiers and the compute cost, not what the device prefix cache remembers.
`*-90-*-vs-device` cases compare a tier's TTFT with its ceiling: the same prompt whose 90% prefix
is already in the engine's own device cache. `*-load-added` cases isolate the load: TTFT minus
the TTFT of the same request whose prefix is already on the device (a difference of two medians:
noisy at a few ms). `disk-90-load-stall`
is the engine's own clock of the time it sat blocked on the load, layerwise versus bulk:
layerwise ought to stall at most half as long.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

import numpy as np

from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.core.config import CacheConfig
from dynamo_flexkv.core.enums import LoadPolicy
from dynamo_flexkv.core.offload import open_offload
from dynamo_flexkv.core.transfer.runner import MoverHook
from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LlamaModel, LLMEngine, SamplingParams

ONE = SamplingParams(max_tokens=1)


class Rig:
    """One model, one offload (host + disk tiers, opened as an engine opens them: open_offload),
    fresh engines per measurement. The engines and the bench reach the tiers only through the
    engine contract. ``load_policy`` and ``mover_hook``: open_offload's (bench throttled's)."""

    def __init__(
        self,
        cfg: EngineModelConfig,
        max_tokens: int,
        directory: str,
        load_policy: LoadPolicy = LoadPolicy.COST_AWARE,
        mover_hook: MoverHook | None = None,
        model: LlamaModel | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model or LlamaModel(cfg)
        self.blocks = max_tokens // cfg.block_size + 8
        block_bytes = cfg.kv_spec().token_bytes() * cfg.block_size
        gb = 2 * self.blocks * block_bytes / (1 << 30)
        config = dict(tokens_per_block=cfg.block_size, cpu_cache_gb=gb, ssd_cache_gb=2 * gb, ssd_cache_dir=directory)
        self.offload = open_offload(
            cfg.kv_spec(), CacheConfig.from_dict({**config, "load_policy": load_policy.value}), mover_hook=mover_hook
        )

    def engine(self, offload: bool, layerwise: bool = True, puts: bool = True) -> LLMEngine:
        """``puts=False``: the measured request loads but stores nothing, so one measurement does
        not change what the next one finds cached. ``layerwise``: the offload's, which it reads at
        each lookup and load (docs/ENGINE_CONTRACT.md), so bulk and layerwise loads measure the
        same tiers; one engine runs at a time."""
        if offload:
            self.offload.layerwise = layerwise
        return LLMEngine(
            self.cfg,
            num_device_blocks=self.blocks,
            model=self.model,
            offload=self.offload if offload else None,
            offload_puts=puts,
        )

    def ttft(self, engine: LLMEngine, prompt: list[int]) -> float:
        r = engine.generate([prompt], ONE)[0]
        engine.flush()
        self.last_stall = engine.load_stall_seconds
        return r.ttft

    def store(self, tokens: list[int]) -> None:
        """Puts ``tokens``' full blocks into host and disk (computing them once)."""
        self.ttft(self.engine(True), tokens)
        self.idle()

    def idle(self) -> None:
        if not self.offload.drain(60):
            raise RuntimeError("offload tasks still running after 60 s")

    def drop_host(self) -> None:
        self.offload.evict_host(60)

    def reset(self) -> None:
        self.offload.reset_tiers(60)

    def close(self) -> None:
        self.offload.shutdown()


def run(args: argparse.Namespace) -> list[Case]:
    cfg = EngineModelConfig.preset("small")
    sizes = [2048] if args.quick else [2048, 4096, 8192]
    fractions = [0.5, 0.9, 1.0]
    repeat = 1 if args.quick else 5
    rng = np.random.default_rng(0)
    directory = tempfile.mkdtemp(prefix="flexkv-ttft-", dir=getattr(args, "dir", None))
    rig = Rig(cfg, max(sizes), directory)
    cases: list[Case] = []
    try:
        rig.ttft(rig.engine(False), rng.integers(0, cfg.vocab_size, 512).tolist())  # warm-up
        for size in sizes:
            label = f"{size // 1024}K"
            times: dict[str, list[float]] = {}
            base: list[float] = []

            def add(name: str, t: float) -> None:
                times.setdefault(name, []).append(t)

            for _ in range(repeat):
                prompt = rng.integers(0, cfg.vocab_size, size).tolist()
                base.append(rig.ttft(rig.engine(False), prompt))
                add("miss", rig.ttft(rig.engine(True), prompt))  # offload on, nothing cached
                rig.idle()
                rig.reset()
                for f in fractions:
                    prompt = rng.integers(0, cfg.vocab_size, size).tolist()
                    rig.store(prompt[: int(size * f)])
                    for mode, layerwise in (("bulk", False), ("layerwise", True)):
                        add(f"host-{int(f * 100)}-{mode}", rig.ttft(rig.engine(True, layerwise, False), prompt))
                    for mode, layerwise in (("bulk", False), ("layerwise", True)):
                        rig.drop_host()  # only the disk copy is left
                        add(f"disk-{int(f * 100)}-{mode}", rig.ttft(rig.engine(True, layerwise, False), prompt))
                        add(f"disk-{int(f * 100)}-{mode}-stall", rig.last_stall)
                    if f == 0.9:  # the same request with its prefix already on the device
                        dev = rig.engine(False)
                        rig.ttft(dev, prompt[: int(size * f)])
                        add("device-90", rig.ttft(dev, prompt))
                    rig.idle()
                    rig.reset()
            b = statistics.median(base) * 1e3
            for name, ts in times.items():
                if name == "device-90" or name.endswith("-stall"):
                    continue
                cases.append(
                    Case(
                        "ttft",
                        f"{name}-{label}",
                        statistics.median(ts) * 1e3,
                        b,
                        "ms",
                        "recompute (offload off)",
                        f"small preset, {size} tokens, median of {repeat}",
                    )
                )
            dev = statistics.median(times["device-90"]) * 1e3
            for tier in ("host", "disk"):  # each tier against its ceiling: the engine's own device cache
                for mode in ("bulk", "layerwise"):
                    cases.append(
                        Case(
                            "ttft",
                            f"{tier}-90-{mode}-vs-device-{label}",
                            statistics.median(times[f"{tier}-90-{mode}"]) * 1e3,
                            dev,
                            "ms",
                            "device-cache hit, same prompt",
                            f"90% cached; median of {repeat}",
                        )
                    )
            for tier in ("host", "disk"):
                bulk = statistics.median(times[f"{tier}-90-bulk"]) * 1e3 - dev
                lw = statistics.median(times[f"{tier}-90-layerwise"]) * 1e3 - dev
                if bulk < 1.0:  # a difference of medians below a millisecond is noise, not a ratio
                    print(
                        f"({tier}-90-load-added-{label}: bulk adds {bulk:.2f} ms, layerwise {lw:.2f} ms: "
                        "below this machine's noise, no case reported)"
                    )
                    continue
                cases.append(
                    Case(
                        "ttft",
                        f"{tier}-90-load-added-{label}",
                        lw,
                        bulk,
                        "ms",
                        "bulk load's added time",
                        f"TTFT minus device-hit TTFT ({dev:.1f} ms)",
                    )
                )
            # The engine's own clock of the load it waited for (the part not hidden by compute).
            stall_lw = statistics.median(times["disk-90-layerwise-stall"]) * 1e3
            stall_bulk = statistics.median(times["disk-90-bulk-stall"]) * 1e3
            cases.append(
                Case(
                    "ttft",
                    f"disk-90-load-stall-{label}",
                    stall_lw,
                    max(stall_bulk, 1e-6),
                    "ms",
                    "bulk load stall",
                    "engine time blocked on the load: layerwise vs bulk",
                )
            )
    finally:
        rig.close()
        shutil.rmtree(directory, ignore_errors=True)
    return cases
