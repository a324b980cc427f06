"""``bench vllm --peer lmcache``: LMCache 0.5.6 in its multi-process mode beside our connector, on
the same vLLM engine, prompts and sizes.

LMCache runs as one ``lmcache server`` process (started and stopped here, ZMQ control, HTTP admin,
both on 127.0.0.1) with its CPU tier (L1) of our host tier's size and its ``fs`` disk adapter (L2);
vLLM loads ``LMCacheMPConnector`` from LMCache's own package. LMCache and the four small packages it
lacks in our venv live in their own prefix (``make peer-lmcache``), which only the peer's processes
put on PYTHONPATH. Standard library only: vllm_engine.py calls the HTTP helpers inside engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_flexkv.bench.report import Case, paired_cases
from dynamo_flexkv.core.http_client import http_json
from dynamo_flexkv.core.procgroup import stop_group
from dynamo_flexkv.core.sysutil import LOOPBACK, free_port

PEER = "lmcache"
VERSION = "0.5.6"
INSTALL = "make peer-lmcache (scripts/install_peer_lmcache.sh)"
PREFIX_ENV = "LMCACHE_PEER_DIR"  # the prefix, if not <checkout>/.peers/lmcache (also the install script's)
SHM_PREFIX = "lmcache_kv_"  # its vLLM worker's POSIX shm segments: /dev/shm/lmcache_kv_<pid>_<n>
# Ours -> LMCache's same case (case-name stems, without the size label).
SAME_CASE = (
    ("host-90", "lmcache-host-90", "its CPU tier (L1)"),
    ("disk-90", "lmcache-disk-90", "its disk tier (L2 fs adapter)"),
    ("miss", "lmcache-miss", "its miss path (LMCacheMPConnector, nothing cached)"),
    ("restart-90", "lmcache-restart-90", "a fresh engine process against its running server"),
)


# ---- the prefix -------------------------------------------------------------------------------------
def prefix_dir() -> Path:
    """Where ``make peer-lmcache`` installs LMCache: $LMCACHE_PEER_DIR, else the checkout's
    .peers/lmcache."""
    given = os.environ.get(PREFIX_ENV)
    if given:
        return Path(given).resolve()
    return Path(__file__).resolve().parents[2] / ".peers" / PEER


def missing_reason(prefix: Path) -> str | None:
    """None when LMCache ``VERSION`` is installed in ``prefix``, else what is missing."""
    dist = prefix / f"lmcache-{VERSION}.dist-info"
    if not dist.is_dir():
        found = sorted(p.name for p in prefix.glob("lmcache-*.dist-info")) if prefix.is_dir() else []
        return f"{prefix} holds {', '.join(found) or 'no LMCache'}, not lmcache {VERSION}"
    return None


def require_installed() -> Path:
    """The prefix, or exit 2 with the install command (nothing started yet)."""
    prefix = prefix_dir()
    why = missing_reason(prefix)
    if why:
        print(f"bench vllm --peer {PEER}: {why}; install it with {INSTALL}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return prefix


def peer_env(env: dict[str, str], prefix: Path) -> dict[str, str]:
    """``env`` with the prefix first on PYTHONPATH (vLLM then resolves LMCache's connector)."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(prefix), env.get("PYTHONPATH", "")) if p)
    return out


def kv_transfer_config(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{LOOPBACK}",
            "lmcache.mp.port": port,
            # A CPU worker's default (auto) picks engine_driven, which this server refuses: vLLM then
            # waits out its 300 s message timeout and dies.
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        },
    }


# ---- the server's HTTP admin API (also called inside engine processes) ------------------------------
def l1_state(http: str) -> dict[str, int]:
    """L1 object count and what the store controller still has to write to L2."""
    sm = http_json(f"{http}/status", timeout=10)["storage_manager"]
    l1 = sm["l1_managers"]["_default"]
    store = sm["store_controllers"]["_default"]
    return {
        "objects": int(l1["total_object_count"]),
        "locked": int(l1["write_locked_count"]) + int(l1["read_locked_count"]),
        "l2_pending": int(store["pending_keys_count"]) + int(store["in_flight_task_count"]),
    }


def wait_l2_written(http: str, timeout_s: float) -> None:
    """Until the server has written every L1 object to its disk tier (its L2 push is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (s := l1_state(http))["l2_pending"] or s["locked"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"LMCache server still busy after {timeout_s:.0f} s: {s}")
        time.sleep(0.02)


def clear_l1(http: str) -> None:
    """Empties the CPU tier (the disk tier keeps its copies): the next lookup reads L2."""
    http_json(f"{http}/cache/clear", {"tier": "l1", "force": False}, timeout=10)
    left = l1_state(http)
    if left["objects"]:
        raise RuntimeError(f"LMCache /cache/clear left {left['objects']} L1 objects ({left})")


def require_l1_holds(http: str, chunks: int) -> int:
    """The L1 object count, at least ``chunks`` (the prefix's), else an error."""
    n = l1_state(http)["objects"]
    if n < chunks:
        raise RuntimeError(f"LMCache's L1 holds {n} objects, fewer than the prefix's {chunks} chunks")
    return n


# ---- the server process -----------------------------------------------------------------------------
@dataclass
class LMCacheServer:
    """``lmcache server`` on 127.0.0.1 in its own process group, L1 of ``l1_bytes`` (LRU) and an fs
    L2 under ``workdir``; ``start()`` waits until its health check answers."""

    prefix: Path
    workdir: str
    l1_bytes: int
    chunk_tokens: int
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def http(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def l2_dir(self) -> str:
        return os.path.join(self.workdir, "l2")

    def args(self) -> list[str]:
        # O_DIRECT as our disk tier reads: both disk cases come from the device, not the page cache.
        l2 = {"type": "fs", "base_path": self.l2_dir, "use_odirect": True}
        return [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--http-host",
            LOOPBACK,
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(self.chunk_tokens),
            "--l1-size-gb",
            f"{self.l1_bytes / (1 << 30):.6f}",
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            json.dumps(l2),
            # OpenTelemetry's Prometheus exporter is not installed (it is not one of the four).
            "--disable-observability",
        ]

    def start(self, timeout_s: float = 120.0) -> LMCacheServer:
        os.makedirs(self.l2_dir, exist_ok=True)
        log_path = os.path.join(self.workdir, "lmcache-server.log")
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=peer_env(dict(os.environ, PYTHONUNBUFFERED="1"), self.prefix),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}; its log ends:\n{tail}")
            try:
                if http_json(f"{self.http}/healthcheck", timeout=2).get("status") == "healthy":
                    return self
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"lmcache server did not answer {self.http}/healthcheck within {timeout_s:.0f} s")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL to what is left after 15 s (core/procgroup.py)."""
        if self.proc is not None:
            done = stop_group(self.proc, grace_s=15)
            if not done.clean:
                print(f"lmcache server: stopping it {done.describe()}", file=sys.stderr, flush=True)
            self.proc = None

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def shm_segments(shm_dir: str = "/dev/shm") -> list[str]:
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []


def remove_orphan_shm(before: Sequence[str], shm_dir: str = "/dev/shm") -> list[str]:
    """Removes the LMCache KV segments that appeared since ``before`` and whose creating process
    (the pid in the name) is gone: a vLLM worker that was killed never unlinks them."""
    removed = []
    for name in set(shm_segments(shm_dir)) - set(before):
        pid = name[len(SHM_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return sorted(removed)


# ---- results -> the comparison rows ------------------------------------------------------------------
def vs_lmcache_cases(cases: Sequence[Case], labels: Sequence[str]) -> list[Case]:
    """One row per size and case both sides measured: ``<ours>-vs-lmcache-<size>``, ratio = our
    TTFT / LMCache's in its same case (lower: we are faster)."""
    return [
        Case(
            a.bench,
            f"{ours}-vs-{PEER}-{lab}",
            a.ours,
            b.ours,
            a.unit,
            f"LMCache {VERSION}: {what}",
            f"ours {a.ours:.1f} ms / LMCache {b.ours:.1f} ms; recompute {a.baseline:.1f} ms",
        )
        for lab, ours, what, a, b in paired_cases(cases, labels, SAME_CASE)
    ]
