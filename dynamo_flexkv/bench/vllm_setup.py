"""What every process of ``bench vllm`` agrees on (bench/vllm_ttft.py runs them): the prompts
(generated from one seed in each), the cached fraction and block size, the engine roles, and each
engine's environment and connector config."""

from __future__ import annotations

import os
import random
from typing import Any

BLOCK = 64
FRACTION = 0.9
TOKEN_RANGE = (300, 30000)  # ordinary ids of the model directory's tokenizer, no special tokens
# role -> what it runs (bench/vllm_engine.py)
ROLES = {
    "plain": "vLLM without a connector: device prefix-cache hit",
    "flexkv": "FlexKVConnector (host + disk): host, disk",
    "flexkv-remote": "FlexKVConnector (host + disk + remote on a local redis-server): remote",
    "offloading": "vLLM's OffloadingConnector (CPUOffloadingSpec): miss, host",
}
SSD_OF = {"flexkv-restart": "flexkv"}


# ---- prompts (the same in every engine process) ----------------------------------------------------
def label(size: int) -> str:
    return f"{size // 1024}k" if size % 1024 == 0 else str(size)


def parse_sizes(text: str) -> list[int]:
    """``2k,8k`` or ``2048,8192`` -> [2048, 8192]."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        try:
            n = int(p[:-1]) * 1024 if p.endswith("k") else int(p)
        except ValueError:
            raise ValueError(f"--sizes: {part!r} is not a token count (e.g. 2048 or 2k)") from None
        if n < 2 * BLOCK:
            raise ValueError(f"--sizes: {part!r} is below {2 * BLOCK} tokens (two {BLOCK}-token blocks)")
        out.append(n)
    if not out:
        raise ValueError("--sizes: no size given (e.g. 2k,8k)")
    return sorted(set(out))


def cached_tokens(size: int, block: int = BLOCK) -> int:
    """The cached prefix: FRACTION of the prompt rounded to whole blocks, at least one block, and
    short of the whole prompt (vLLM computes at least its last token)."""
    return max(1, min(round(size * FRACTION / block), (size - 1) // block)) * block


def _tokens(key: str, n: int) -> list[int]:
    rnd = random.Random(key)
    lo, hi = TOKEN_RANGE
    return [rnd.randrange(lo, hi) for _ in range(n)]


def fresh_prompt(seed: int, size: int, i: int) -> list[int]:
    return _tokens(f"fresh:{seed}:{size}:{i}", size)


def prefix_prompt(seed: int, size: int, block: int = BLOCK) -> list[int]:
    return _tokens(f"prefix:{seed}:{size}", cached_tokens(size, block))


def suffix(seed: int, size: int, block: int, kind: str, i: int) -> list[int]:
    """The uncached rest of request ``i``: its own tokens per ``kind`` of case, so no request finds
    another one's stored suffix. Cases in different engines share a kind (their first tokens are
    compared); ``disk`` runs in the engine whose host case already stored the ``device`` ones."""
    return _tokens(f"suffix:{seed}:{size}:{kind}:{i}", size - cached_tokens(size, block))


def cpu_list() -> str:
    """The cores this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND list (``0,1``)."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def engine_env(
    workdir: str,
    role: str,
    host_bytes: int,
    disk_bytes: int,
    remote_url: str | None = None,
    node_socket: str | None = None,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXKV_")}
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        XDG_CACHE_HOME=os.path.join(workdir, "cache"),
        VLLM_CACHE_ROOT=os.path.join(workdir, "vllm-cache"),
    )
    # vLLM's CPU worker binds its OpenMP threads itself; by default ("auto") it reserves cores for
    # the other processes, one per connector too: on 2 cores the engine without a connector got one
    # thread and the engine with one got two. Every engine here gets every core this process may use.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list())
    if node_socket:  # the node cache holds the tiers (bench/vllm_node.py); this engine attaches to it
        env.update(
            FLEXKV_RUN_DIR=os.path.join(workdir, f"run-{role}"), FLEXKV_MODE="node", FLEXKV_NODE_SOCKET=node_socket
        )
        os.makedirs(env["FLEXKV_RUN_DIR"], exist_ok=True)
    elif role.startswith("flexkv"):
        env.update(
            FLEXKV_RUN_DIR=os.path.join(workdir, f"run-{role}"),
            FLEXKV_CPU_CACHE_GB=f"{host_bytes / (1 << 30):.6f}",
            FLEXKV_SSD_CACHE_GB=f"{disk_bytes / (1 << 30):.6f}",
            # the restart engine starts on the flexkv engine's disk tier (and re-adopts it)
            FLEXKV_SSD_CACHE_DIR=os.path.join(workdir, f"ssd-{SSD_OF.get(role, role)}"),
        )
        os.makedirs(env["FLEXKV_RUN_DIR"], exist_ok=True)
        os.makedirs(env["FLEXKV_SSD_CACHE_DIR"], exist_ok=True)
    if remote_url:
        env.update(FLEXKV_ENABLE_REMOTE="true", FLEXKV_REMOTE_CACHE_URL=remote_url)
    return env


def kv_transfer_config(role: str, host_bytes: int) -> dict[str, Any] | None:
    if role == "plain":
        return None
    if role == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": host_bytes},
        }
    return {
        "kv_connector": "FlexKVConnector",
        "kv_connector_module_path": "dynamo_flexkv.integrations.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # A lookup slower than the 2 s default give-up (the remote tier's existence check on a
        # loaded machine) would turn a hit case into a miss and fail the run; here its wait is
        # part of the timed TTFT instead.
        "kv_connector_extra_config": {"layerwise": True, "lookup_give_up_s": 60.0},
    }
