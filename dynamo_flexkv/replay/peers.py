"""The replay's peer row: the same vLLM graph with another offload system in each worker instead of
ours (today LMCache 0.5.6 in its multi-process mode, ``bench vllm --peer lmcache``'s setup).

LMCache's users run one ``lmcache server`` per node, shared by the node's engines (its CPU tier
outlives them), so the served graph gains one such server, started before the workers and stopped
after them like our node cache, with the CPU tier the workers' host tiers add up to and an ``fs``
disk tier. Each worker runs vLLM without our connector and with ``LMCacheMPConnector``; the
router scores on vLLM's device events alone (LMCache MP publishes no KV events to Dynamo:
LMCache#3661). vLLM counts what LMCache loaded as external prefix-cache hits, one number for its CPU
and disk tiers: the report shows it in the host column."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dynamo_flexkv.bench.peer_lmcache import INSTALL, LMCacheServer, kv_transfer_config, missing_reason, prefix_dir
from dynamo_flexkv.serve.graph import Kind
from dynamo_flexkv.serve.plan import LaunchPlan
from dynamo_flexkv.serve.process import Process

SERVER = "LMCacheServer"


def lmcache_config(cfg: dict[str, Any], worker: str, run_dir: Path) -> tuple[dict[str, Any], LMCacheServer]:
    """``cfg`` with ``worker``'s replicas on LMCacheMPConnector (our offload off), and the node's
    server they use: its CPU tier the size of the workers' host tiers together, 64-token chunks
    (the workers' block size), its disk tier under ``run_dir``."""
    prefix = prefix_dir()
    why = missing_reason(prefix)
    if why:
        raise ValueError(f"the lmcache configuration needs LMCache: {why}; install it with {INSTALL}")
    common, section = cfg.get("Common") or {}, dict(cfg.get(worker) or {})
    replicas = int(section.get("replicas", common.get("replicas", 1)))
    host_gb = float((section.get("cache") or {}).get("cpu_cache_gb", 0)) * replicas
    if host_gb <= 0:
        raise ValueError(
            f"the lmcache configuration sizes LMCache's CPU tier from {worker}.cache.cpu_cache_gb, "
            "which is not set: set it (the replay's --host-gb does)"
        )
    server = LMCacheServer(
        prefix,
        workdir=str(run_dir / "lmcache"),
        l1_bytes=int(host_gb * (1 << 30)),
        chunk_tokens=int(section.get("block-size", 64)),
    )
    extra = [*section.get("extra-args", []), "--kv-transfer-config", json.dumps(kv_transfer_config(server.port))]
    return {**cfg, worker: {**section, "offload": False, "extra-args": extra}}, server


def add_lmcache_server(plan: LaunchPlan, server: LMCacheServer) -> None:
    """Plans ``server`` before the workers (the launcher waits for its port, stops it after them)
    and puts LMCache's prefix first on the workers' PYTHONPATH (vLLM resolves its connector there)."""
    path = os.pathsep.join(p for p in (str(server.prefix), os.environ.get("PYTHONPATH", "")) if p)
    proc = Process(
        SERVER,
        server.args(),
        {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
        Kind.CACHE,
        server.http_port,
        dirs=[server.l2_dir],
    )
    first = next(i for i, p in enumerate(plan.processes) if p.kind is Kind.WORKER)
    plan.processes.insert(first, proc)
    for w in plan.workers:
        w.env["PYTHONPATH"] = path
