"""scripts/dashboard_snapshot.py stops every process it started when it is stopped, by Ctrl-C or by
SIGTERM (``kill``, ``timeout``): its Prometheus and served graphs run in sessions of their own, so
nothing else stops them. Its Prometheus here (the graphs stop the same way, through the same
``finally`` blocks, and take minutes to serve)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from repo_paths import ROOT
from served import wait_until

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus")

# The script's main runs under sigterm_interrupts(); this child holds its Prometheus the same way.
CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import dashboard_snapshot as d
from dynamo_flexkv.core.sysutil import sigterm_interrupts

targets = {k: [] for k in [*(s.value for s in d.Source), d.FRONTEND]}
with sigterm_interrupts(), d.prometheus(Path(sys.argv[2]), targets) as url:
    print(url, flush=True)
    sys.stdin.read()
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigtermed_snapshot_stops_its_prometheus(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ROOT / "scripts"), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prom: list[int] = []
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("http://127.0.0.1:")
        prom = [p for p in _children(child.pid) if _alive(p)]
        assert len(prom) == 1, prom
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        wait_until("the script's Prometheus stopped with it", lambda: not _alive(prom[0]), timeout=30)
    finally:
        child.kill()
        child.wait()
        for p in prom:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
