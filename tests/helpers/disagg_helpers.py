"""What the disaggregation tests share: the served disagg graphs with tiny workers, and two
reference engines with their own NIXL (UCX) agents in this process, joined by the real handover
roles. NIXL is imported only when a pair is made, so a test module can import this before its
own importorskip."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from served import ROOT

from dynamo_flexkv.core.http_client import http_json
from dynamo_flexkv.serve import load_graph
from dynamo_flexkv.serve.launcher import Launcher
from dynamo_flexkv.serve.plan import apply_overrides, build_plan, load_config

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def tiny(section: str, tmp_path) -> list:
    return [
        f"{section}.num-device-blocks=64",
        f"{section}.cache.cpu_cache_gb=0.02",
        f"{section}.cache.ssd_cache_gb=0.05",
        f"{section}.cache.ssd_cache_dir={tmp_path}/ssd-{section}{{replica}}",
    ]


def disagg_plan(tmp_path, graph="disagg", *overrides, **build):
    """``build``: more build_plan arguments (discovery_backend, event_plane, nodes)."""
    config = apply_overrides(
        load_config(str(ROOT / "configs" / f"{graph}.yaml")),
        [
            "Common.model=tiny",
            "Common.served-model-name=flexkv-tiny",
            "Frontend.http-port=0",
            *tiny("PrefillWorker", tmp_path),
            *tiny("DecodeWorker", tmp_path),
            *overrides,
        ],
    )
    return build_plan(load_graph(str(ROOT / "graphs" / f"{graph}.py")), config, run_dir=tmp_path / "run", **build)


def agg_plan(tmp_path):
    config = apply_overrides(
        load_config(str(ROOT / "configs" / "agg.yaml")),
        [
            "Common.model=tiny",
            "Common.served-model-name=flexkv-tiny",
            "Frontend.http-port=0",
            *tiny("FlexKVWorker", tmp_path),
        ],
    )
    return build_plan(load_graph(str(ROOT / "graphs" / "agg.py")), config, run_dir=tmp_path / "run-agg")


def prompts(n: int, seed: int = 3):
    """Mixed lengths (a few words to ~400 tokens); the second half extends earlier prompts, so
    part of each is cached in the prefill worker's tiers."""
    rng = random.Random(seed)
    base = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n // 2)]
    return base, [
        rng.choice(base) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        for _ in range(n - n // 2)
    ]


def serve_all(plan, waves, max_tokens=3):
    out = []
    with ThreadPoolExecutor(4) as pool:
        for wave in waves:  # a wave ends before the next starts: its prefixes are cached by then
            out += list(pool.map(lambda p: complete(plan, p, max_tokens), wave))
    return out


def clean_exit(launcher: Launcher) -> None:
    """Workers that created a UCX backend still exit 0 (no libnl exit-time crash)."""
    for p in launcher.plan.workers:
        assert launcher.running[p.name].returncode == 0, f"{p.name} exited {launcher.running[p.name].returncode}"


def complete(plan, prompt: str, max_tokens: int) -> dict:
    return http_json(
        f"{plan.base_url}/v1/completions",
        {
            "model": plan.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "nvext": {"extra_fields": ["engine_data"]},
        },
        timeout=120,
    )


class Clock:
    """A hand-driven clock for lease tables."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def engine_pair(renew_s: float | None = None, blocks: int = 48, secret: bytes | None = None) -> Iterator[tuple]:
    """(prefill engine, decode engine, PrefillSide, DecodeSide) with a 30 s lease, a 10 s pull
    timeout and ``secret`` signing the handovers (as serve gives both workers); closed (sides, then agents) on exit."""
    from dynamo_flexkv.core.transfer.nixl_agent import KVAgent
    from dynamo_flexkv.integrations.disagg.roles import DecodeSide, PrefillSide
    from dynamo_flexkv.integrations.reference_engine import EngineModelConfig, LLMEngine

    cfg = EngineModelConfig.load("tiny")
    prefill, decode = LLMEngine(cfg, num_device_blocks=blocks), LLMEngine(cfg, num_device_blocks=blocks)
    p_agent, d_agent = KVAgent(prefill.kv_cache.layers), KVAgent(decode.kv_cache.layers)
    extra = {} if renew_s is None else {"renew_s": renew_s}
    p_side = PrefillSide(prefill, p_agent, lease_ttl=30, secret=secret, **extra)
    d_side = DecodeSide(decode, d_agent, pull_timeout=10, secret=secret)
    decode.remote_fill = d_side.fill
    try:
        yield prefill, decode, p_side, d_side
    finally:
        p_side.close()
        d_agent.close()
        p_agent.close()


def decode_one(engine, side, rid, prompt, params, handover):
    """Runs one request on the decode engine with its handover; returns its output tokens."""
    from dynamo_flexkv.integrations.disagg import HandoverParams

    engine.add_request(prompt, params, request_id=rid)
    side.expect(rid, HandoverParams.from_dict(handover))
    while engine.has_unfinished():
        engine.step()
    (req,) = [r for r in engine.take_finished() if r.id == rid]
    return req.output


def serve_releases(side, timeout: float = 10.0) -> None:
    """Services the prefill side until every lease it granted ended. A release notice is NIXL's
    notification from the decode agent (riding on the read, or sent alone when nothing was
    read): the decode side sends it and goes on, and it reaches the prefill agent
    asynchronously (UCX progress), so one service() right after a decode may not see it yet —
    in a worker the engine loop services leases every turn. Bounded well below the pair's 30 s
    lease: a notice that never arrives fails here rather than ending by expiry."""
    deadline = time.monotonic() + timeout
    while True:
        side.service()
        if len(side.leases) == 0:
            return
        assert time.monotonic() < deadline, (
            f"{len(side.leases)} leases still held {timeout:.0f} s after their decode side released them"
        )
        time.sleep(0.005)
