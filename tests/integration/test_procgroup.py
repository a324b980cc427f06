"""core/procgroup.py, the one way serve, the benchmarks and the replay stop a process group, on real
process groups: a Python process holding a multiprocessing shared_memory segment (registered with
multiprocessing's resource tracker, as vLLM's message queues are) and a child that ignores SIGTERM.
Stopped, nothing of the group runs and nothing of it is left in /dev/shm."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dynamo_flexkv.core.procgroup import GroupStop, kill_group, members, stop_group, stop_process

# The leader creates a segment and does not unlink it (it dies by a signal, as a killed vLLM process
# does): only its resource tracker can unlink it. Its forked child ignores SIGTERM and holds the
# tracker's pipe open, so the tracker outlives the leader until the child is SIGKILLed.
LEADER = r"""
import multiprocessing, signal, sys, time
from multiprocessing import shared_memory

def child():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(multiprocessing.current_process().pid, flush=True)  # ready: it ignores SIGTERM now
    time.sleep(600)

if __name__ == "__main__":
    multiprocessing.set_start_method("fork")
    shm = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=1 << 20)
    c = multiprocessing.Process(target=child)
    c.start()
    time.sleep(600)
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen, str, int]:
    name = f"dfkv-test-{uuid.uuid4().hex[:12]}"
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    p = subprocess.Popen([sys.executable, str(script), name], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(p.stdout.readline())  # the segment exists and the child runs
    assert os.path.exists(f"/dev/shm/{name}")
    tracker = [pid for pid in members(p.pid) if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert tracker, "the leader's resource tracker is not in its group: the test would show nothing"
    return p, name, child


def _assert_gone(p: subprocess.Popen, name: str) -> None:
    assert p.returncode is not None, "the leader was not reaped"
    assert members(p.pid) == [], "a process of the group outlived the stop"
    assert not os.path.exists(f"/dev/shm/{name}"), f"/dev/shm/{name} was left behind"


def test_stop_group_leaves_no_process_and_no_shared_memory(tmp_path):
    p, name, child = _start(tmp_path)
    try:
        done = stop_group(p, grace_s=1.0)
    finally:
        if p.returncode is None:
            kill_group(p)
    _assert_gone(p, name)
    assert p.returncode == -signal.SIGTERM  # the leader went on its SIGTERM
    # The child ignored SIGTERM and had to be killed; the tracker unlinked the segment and exited.
    assert [k.pid for k in done.killed] == [child], done.describe()
    assert done.trackers_killed == () and not done.clean
    assert f"pid {child}" in done.describe()


def test_kill_group_kills_the_resource_tracker_last(tmp_path):
    """What serve does to a hung worker: SIGKILL at once; the tracker still gets to unlink."""
    p, name, child = _start(tmp_path)
    done = kill_group(p)
    _assert_gone(p, name)
    assert p.returncode == -signal.SIGKILL
    assert sorted(k.pid for k in done.killed) == sorted([p.pid, child])
    assert done.trackers_killed == ()


def test_a_group_that_exits_on_its_signal_is_stopped_clean():
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert p.stdout.readline().strip() == "up"
    assert stop_group(p) == GroupStop()
    assert p.returncode == -signal.SIGTERM and members(p.pid) == []


def test_stopping_a_group_that_is_gone_is_a_no_op():
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait()
    assert stop_group(p).clean and kill_group(p).clean


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_the_callers(sig):
    """serve and the event bench stop some components with SIGINT: the leader gets that signal."""
    code = (
        "import signal, sys, time\n"
        f"signal.signal({int(sig)}, lambda *_: sys.exit(7))\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "up"
    assert stop_group(p, sig=sig).clean
    assert p.returncode == 7


def test_stop_process_stops_one_process_and_kills_one_that_ignores_its_signal():
    """stop_process: one process without a group of its own (a redis-server, an etcd): it exits on
    SIGTERM, or is SIGKILLed after the grace; reaped either way, and a second stop does nothing."""
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert stop_process(polite, grace_s=30) and polite.returncode == -signal.SIGTERM
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # it ignores SIGTERM now
    assert not stop_process(stubborn, grace_s=0.5) and stubborn.returncode == -signal.SIGKILL
    assert stop_process(stubborn)  # gone: nothing to do
    stubborn.stdout.close()
