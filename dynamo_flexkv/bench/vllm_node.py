"""``bench vllm --node``: our connector through the node cache (``dynamo-flexkv cache-server``,
docs/NODE_CACHE.md) beside the same connector with embedded tiers, on the same vLLM engine,
prompts and sizes, each request interleaved with the other mode's same case.

* ``node-miss-*``: a third engine in the recompute / miss pair, attached to a cache server of
  its own (the miss path's cost over no connector: the lookup's round trip to the service);
* ``node-host-90-*`` / ``node-disk-90-*``: the tier cases through the service (its host tier;
  its disk tier with every host block evicted first), beside the embedded engine's host and disk;
* ``node-restart-90-*``: a fresh engine process against the service that kept running, whose
  host tier outlived the engine that stored the prefix (the embedded restart reads its
  re-adopted disk);
* ``<case>-node-vs-embedded-<size>`` rows: TTFT through the service / embedded, same case.

The service gets the embedded engine's host and disk sizes, so both modes hold the same."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from dynamo_flexkv.bench.report import Case, paired_cases
from dynamo_flexkv.core.procgroup import stop_group

# Ours embedded -> ours through the node cache (case-name stems, without the size label).
SAME_CASE = (
    ("host-90", "node-host-90", "host tier"),
    ("disk-90", "node-disk-90", "disk tier, host evicted"),
    ("miss", "node-miss", "miss path, nothing cached"),
    (
        "restart-90",
        "node-restart-90",
        "a fresh engine process: embedded re-adopts its disk, the node cache kept its host tier",
    ),
)
READY = "cache server ready on"


@dataclass
class NodeCacheServer:
    """A ``dynamo-flexkv cache-server`` with a host and a disk tier, on a socket under ``workdir``."""

    workdir: str
    host_bytes: int
    disk_bytes: int
    block: int
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return os.path.join(self.workdir, "node.sock")

    def start(self, timeout_s: float = 120.0) -> NodeCacheServer:
        ssd = os.path.join(self.workdir, "ssd")
        os.makedirs(ssd, exist_ok=True)
        sets = {
            "cpu_cache_gb": f"{self.host_bytes / (1 << 30):.6f}",
            "ssd_cache_gb": f"{self.disk_bytes / (1 << 30):.6f}",
            "ssd_cache_dir": ssd,
            "tokens_per_block": str(self.block),
        }
        argv = [
            sys.executable,
            "-m",
            "dynamo_flexkv.cli",
            "cache-server",
            "--socket",
            self.socket,
            *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXKV_")}  # the sets above, nothing else
        log = open(os.path.join(self.workdir, "cache-server.log"), "w", encoding="utf-8")  # noqa: SIM115 - pump closes it
        self.proc = proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        stdout = proc.stdout
        assert stdout is not None  # PIPE
        import threading

        ready = threading.Event()

        def pump() -> None:
            for line in stdout:
                log.write(line)
                log.flush()
                if READY in line:
                    ready.set()
            log.close()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            with open(os.path.join(self.workdir, "cache-server.log"), encoding="utf-8", errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(
                f"bench vllm --node: the cache server did not start within {timeout_s:.0f} s; its log ends:\n{tail}"
            )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            done = stop_group(self.proc, grace_s=20)
            if not done.clean:
                print(f"bench vllm --node: stopping the cache server {done.describe()}", file=sys.stderr, flush=True)
            self.proc = None


def new_server(workdir: str, host_bytes: int, disk_bytes: int, block: int) -> NodeCacheServer:
    return NodeCacheServer(tempfile.mkdtemp(prefix="node-", dir=workdir), host_bytes, disk_bytes, block).start()


def vs_embedded_cases(cases: Sequence[Case], labels: Sequence[str]) -> list[Case]:
    """One row per size and case both modes measured: ``<case>-node-vs-embedded-<size>``, ratio =
    TTFT through the node cache / embedded (the goal: at most 1.1; the miss path within 3%)."""
    return [
        Case(
            a.bench,
            f"{ours}-node-vs-embedded-{lab}",
            b.ours,
            a.ours,
            a.unit,
            f"embedded tiers: {what}",
            f"node {b.ours:.1f} ms / embedded {a.ours:.1f} ms; recompute {a.baseline:.1f} ms",
        )
        for lab, ours, what, a, b in paired_cases(cases, labels, SAME_CASE)
    ]
