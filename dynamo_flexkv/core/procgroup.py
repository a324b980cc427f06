"""Stopping a process group: what serve, the benchmarks and the replay start runs in its own group
(start_new_session) with the processes it spawned (vLLM's EngineCore and Worker, a cache server's
helpers, multiprocessing's resource tracker). One way to stop one, used everywhere: a signal to
the group (SIGTERM), a bounded wait until every process of it has exited, then SIGKILL to what is
left, Python's resource trackers last. (stop_process: the same for one process without a group.)

Why trackers last: a resource tracker unlinks the shared memory its processes registered once they
are all gone (vLLM's message queues, 160-240 MiB each in /dev/shm) and ignores SIGTERM for that.
SIGKILLed together with the rest it unlinks nothing, and the segments stay until reboot.
Standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 5.0  # how long a group gets to exit on its signal before SIGKILL (stop_group's default)
TRACKER_EXIT_S = 5.0  # how long resource trackers get to unlink what the killed processes left
POLL_S = 0.05


@dataclass(frozen=True)
class Killed:
    """A process that had to be SIGKILLed: its pid and command line (shortened)."""

    pid: int
    command: str


@dataclass(frozen=True)
class GroupStop:
    """What stopping a group took: the processes SIGKILLed because they outlived the grace, and
    the resource trackers still alive TRACKER_EXIT_S after them (their shared memory may be left)."""

    killed: tuple[Killed, ...] = ()
    trackers_killed: tuple[Killed, ...] = ()

    @property
    def clean(self) -> bool:
        """Everything exited on its signal: nothing was SIGKILLed."""
        return not self.killed and not self.trackers_killed

    def describe(self) -> str:
        if self.clean:
            return "every process exited on its signal"
        parts = [f"pid {k.pid} ({k.command})" for k in self.killed]
        parts += [
            f"resource tracker pid {k.pid} (its shared memory may be left in /dev/shm)" for k in self.trackers_killed
        ]
        return "SIGKILLed " + ", ".join(parts)


def members(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (zombies are dead: a reparented one waits for init)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(name))
    return out


def group_alive(p: subprocess.Popen) -> bool:
    """Whether a process of ``p``'s group is still running (``p`` itself is reaped on the way)."""
    p.poll()
    try:
        os.killpg(p.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return bool(members(p.pid))


def wait_group(p: subprocess.Popen, deadline: float) -> bool:
    """Until nothing of ``p``'s group runs (True) or ``deadline`` (monotonic) passes (False)."""
    while group_alive(p):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to every process of ``p``'s group; nothing if the group is gone."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(p: subprocess.Popen) -> GroupStop:
    """SIGKILLs what is left of ``p``'s group, the resource trackers last: they get TRACKER_EXIT_S
    after the rest to unlink the shared memory the killed processes registered, then SIGKILL too.
    Reaps ``p``."""
    pgid = p.pid
    alive = members(pgid)
    trackers = [pid for pid in alive if _is_resource_tracker(pid)]
    killed = [k for k in (_sigkill(pid) for pid in alive if pid not in trackers) if k is not None]
    trackers_killed: list[Killed] = []
    if trackers and not wait_group(p, time.monotonic() + TRACKER_EXIT_S):
        for k in (_sigkill(pid) for pid in members(pgid)):
            if k is not None:
                (trackers_killed if k.pid in trackers else killed).append(k)
    signal_group(p, signal.SIGKILL)  # anything started meanwhile
    p.wait()
    return GroupStop(tuple(killed), tuple(trackers_killed))


def stop_group(p: subprocess.Popen, grace_s: float = GRACE_S, sig: int = signal.SIGTERM) -> GroupStop:
    """Stops ``p``'s process group: ``sig`` to all of it, a wait of up to ``grace_s`` for all of it
    to exit, then kill_group for what is left. Returns what had to be SIGKILLed; ``p`` is reaped."""
    signal_group(p, sig)
    if wait_group(p, time.monotonic() + grace_s):
        p.wait()
        return GroupStop()
    return kill_group(p)


def stop_process(p: subprocess.Popen, grace_s: float = GRACE_S, sig: int = signal.SIGTERM) -> bool:
    """Stops one process that has no group of its own (a redis-server, an etcd, a cache server a
    benchmark started): ``sig``, a wait of up to ``grace_s``, then SIGKILL. Reaps it; True when it
    exited on ``sig``."""
    if p.poll() is not None:
        return True
    p.send_signal(sig)
    try:
        p.wait(grace_s)
        return True
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return False


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text if len(text) <= 120 else text[:117] + "..."


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _sigkill(pid: int) -> Killed | None:
    command = _command(pid)  # before it is gone
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return None
    return Killed(pid, command)
