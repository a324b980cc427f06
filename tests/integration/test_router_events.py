"""Dynamo's real KvRouter sees exactly the device, host and disk blocks a worker holds.

tests/helpers/router_scenario.py runs in its own process (the Dynamo runtime, loopback only, events through
a ZMQ broker as in served graphs) and prints what a separate KvRouter reports per tier next to what
the worker holds, after each scripted step. Dynamo's own warnings go to stderr: none may say that
an event batch was dropped or that an event named a block the router never learned about.
"""

import json
import os
import subprocess
import sys

import pytest
from repo_paths import HELPERS
from served import CONTRADICTIONS

pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is installed by make test")


def run_scenario(tmp_path, scenario: str):
    env = dict(
        os.environ,
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_EVENT_PLANE_HOST="127.0.0.1",
        DYN_SYSTEM_HOST="127.0.0.1",
        DYN_LOG="warn",
    )
    script = HELPERS / "router_scenario.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), scenario],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(script.parent),
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    checks = [c for c in lines if "check" in c]
    facts = {k: v for c in lines if "check" not in c for k, v in c.items()}
    for phrase in CONTRADICTIONS:
        assert phrase not in proc.stderr, [line for line in proc.stderr.splitlines() if phrase in line][:3]
    assert facts.get("relay", {}).get("skipped") == 0, (facts, proc.stderr[-3000:])
    return proc, checks, facts


def test_router_counts_each_tier_exactly(tmp_path):
    proc, checks, facts = run_scenario(tmp_path, "tiers")
    names = [c["check"] for c in checks]
    assert names == [
        "after-first-request",
        "after-device-eviction",
        "after-host-eviction",
        "shared-prefix-request",
        "first-prompt-again",
        "restart-first-prompt",
        "restart-shared-prefix",
    ], proc.stderr[-3000:]
    for c in checks:
        assert c["got"] == c["want"], c
    # The scenario moves blocks through every tier: the checks are not all alike. The device keeps
    # a's first 2 blocks when fillers evict it (tails go first), so a usable prefix stays.
    assert [tuple(c["want"].values()) for c in checks] == [
        (6, 6, 6),
        (2, 6, 6),
        (2, 2, 6),
        (7, 7, 7),
        (3, 3, 6),
        (0, 0, 6),
        (0, 0, 7),
    ]
    # After the restart only the re-announced disk blocks can be what the router counts.
    assert facts["announced"] == 31  # 6 (a) + 3 x 7 (fillers) + 4 (b past the 3 it shares with a)
    assert proc.returncode == 0


def test_router_view_survives_bursts_of_long_prompts(tmp_path):
    """Three bursts of 2,000+-token prompts into a full 320-block device cache (and full host and
    disk tiers): thousands of blocks stored and evicted per tier in a few seconds. After each burst
    the router's count for every prompt sent so far equals the worker's, per tier; no frame was
    dropped and no removal named a block the router did not know."""
    proc, checks, facts = run_scenario(tmp_path, "bursts")
    assert len(checks) == 6 + 13 + 20, proc.stderr[-3000:]
    bad = [c for c in checks if c["got"] != c["want"]]
    assert not bad, bad[:5]
    # The bursts really churned every tier, and the checks saw prompts in different states.
    assert min(facts["device_evictions"], facts["host_evictions"], facts["disk_evictions"]) > 500, facts
    assert len({tuple(c["want"].values()) for c in checks}) >= 4
    # Thousands of block events left as few frames: far below the router's 64-frame lane per burst.
    assert facts["relay"]["frames"] < 400, facts
    assert proc.returncode == 0
