"""Dynamo's real KvRouter sees exactly the device, host and disk blocks a worker holds.

tests/router_scenario.py runs in its own process (the Dynamo runtime, loopback only) and prints
what the router reports per tier next to what the worker holds, after each scripted step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is installed by make test")


def test_router_counts_each_tier_exactly(tmp_path):
    env = dict(os.environ, DYN_TCP_RPC_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1",
               DYN_SYSTEM_HOST="127.0.0.1", DYN_LOG="warn")
    script = Path(__file__).with_name("router_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(script.parent))
    checks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"check")]
    names = [c["check"] for c in checks]
    assert names == ["after-first-request", "after-device-eviction", "after-host-eviction",
                     "shared-prefix-request", "first-prompt-again", "restart-first-prompt",
                     "restart-shared-prefix"], proc.stderr[-3000:]
    for c in checks:
        assert c["got"] == c["want"], c
    # The scenario moves blocks through every tier: the checks are not all alike.
    assert {tuple(c["want"].values()) for c in checks} == {(6, 6, 6), (0, 6, 6), (0, 0, 6), (7, 7, 7), (3, 3, 6),
                                                           (0, 0, 7)}
    # After the restart only the re-announced disk blocks can be what the router counts.
    announced = [json.loads(line)["announced"] for line in proc.stdout.splitlines() if '"announced"' in line]
    assert announced == [31], announced  # 6 (a) + 3 x 7 (fillers) + 4 (b past the 3 it shares with a)
    assert proc.returncode == 0
