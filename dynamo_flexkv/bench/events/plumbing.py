"""What the router, publisher and orchestrating processes share: worker ids, the endpoint, the
JSON-lines protocol between them, and /proc readings."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import sys
from collections.abc import Sequence
from typing import Any

ENDPOINT = "bench.worker.generate"
WORKER_BASE = 0x10000000  # simulated worker ids


def low_port() -> int:
    """A free loopback port below 32768 (Dynamo reads DYN_SYSTEM_PORT as an i16)."""
    rng = random.Random()
    while True:
        p = rng.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out.get("VmRSS", 0.0), out.get("VmHWM", 0.0)


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_cmd() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        os._exit(3)  # the orchestrator went away
    return json.loads(line)


def worker_ids(n: int) -> list[int]:
    return [WORKER_BASE + i for i in range(n)]


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]
