"""Small host helpers shared by serve, the cache server, the remote test servers, the benches and
doctor: a free loopback port, whether a port is free, whether a Unix socket listens, a binary on
PATH, an owner-only directory, SIGTERM as Ctrl-C. Standard library only (reading a config or
rendering a plan imports this)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import threading
from collections.abc import Iterator

from dynamo_flexkv.core.errors import FlexKVError

LOOPBACK = "127.0.0.1"
SBIN = "/usr/sbin:/usr/local/sbin"  # Debian installs some servers (nats) there, outside a user's PATH


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel just handed out on ``host`` (free now; a caller binds it soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Binding is the only honest check: TIME_WAIT counts as free, a listener does not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
            return True
        except OSError:
            return False


def listening(path: str) -> bool:
    """Whether a server (a node cache server) accepts connections on the Unix socket ``path``: False
    when nothing is there or the file is a dead server's socket; any other error (not a socket, no
    permission, a path too long) raises OSError."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()


def not_a_socket(path: str) -> str | None:
    """What is at ``path`` when it is something other than a Unix socket ("a directory", "a regular
    file", ...), for a message; None when it is a socket or nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"


def memory_limit() -> tuple[int, str]:
    """(bytes of memory this process's machine or container has, where that number comes from): the
    smaller of /proc/meminfo's MemTotal and a cgroup v2 memory.max (a container's limit)."""
    total, where = 0, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total, where = int(line.split()[1]) * 1024, "MemTotal in /proc/meminfo"
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not total:
        total, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical pages"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit() and int(limit) < total:
            total, where = int(limit), "this container's cgroup memory.max"
    except OSError:
        pass
    return total, where


def host_memory_shortfall(gb: float, times: int = 1) -> tuple[str, float] | None:
    """None when ``times`` host tiers of ``gb`` GB each fit this machine's memory, else (what is
    short, for a message: "(N GiB) is larger than this machine's memory (M GiB, where)", a size each
    could have that leaves room for the engines, the disk tier's buffers and the OS)."""
    gib = 1 << 30
    need = gb * gib * max(1, times)
    have, where = memory_limit()
    if need <= have:
        return None
    fit = have / gib / max(1, times) * 0.75
    return f"({need / gib:.1f} GiB) is larger than this machine's memory ({have / gib:.1f} GiB, {where})", fit


def find_binary(name: str) -> str | None:
    """``name`` on PATH, else in the sbin directories; None if neither has it."""
    return shutil.which(name) or shutil.which(name, path=SBIN)


def require_binary(name: str, fix: str = "install Debian's redis-server package (scripts/install.sh does)") -> str:
    """``find_binary`` or FileNotFoundError "<name> not found: <fix>"."""
    path = find_binary(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: {fix}")
    return path


class UnsafeDirectory(PermissionError, FlexKVError):
    """A directory that must be private (a socket's, a run's) is another user's or writable by others."""


def private_dir(path: str, what: str, tighten: bool = False) -> str:
    """``path`` as a directory for this user's eyes: each missing component made 0700. One that
    exists must be a directory of this user that group and others cannot write to (else another
    user could put a socket or file of theirs in it): refused otherwise, naming the fix. With
    ``tighten`` (a directory the caller owns by name, e.g. a run's logs/) an existing one of this
    user also loses group and other access; without, one others may only read is used as it is."""
    path = os.path.abspath(path)
    missing = []
    head = path
    while not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            continue
        os.chmod(d, 0o700)  # whatever the umask
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is not a directory: remove it, or choose another path")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): choose a directory "
            "of your own, or a path that does not exist yet (it is made owner-only, 0700)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if tighten and mode & 0o077:
        os.chmod(path, mode & 0o700)
    elif mode & 0o022:
        # A shared directory such as /tmp (sticky, world-writable) must stay so: only a new path in it
        fix = f"chmod 700 {path}, or choose" if not mode & stat.S_ISVTX else "choose"
        raise UnsafeDirectory(
            f"{what} {path} is writable by others (mode {mode:04o}): {fix} a path that does not exist yet "
            f"(e.g. {os.path.join(path, 'flexkv')}: it is made owner-only, 0700)"
        )
    return path


def _interrupt(signum: int, frame: object) -> None:
    # once: a second SIGTERM must not cut short the stopping (a handler, not SIG_IGN, which the
    # processes started meanwhile would inherit across exec)
    signal.signal(signum, lambda *_: None)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM (``kill``, ``timeout``) raises KeyboardInterrupt in the main thread as Ctrl-C
    does, so the ``finally`` blocks stop what was started: processes in sessions of their own (served
    graphs, a Prometheus), which a signal to this process alone would orphan. Outside the main
    thread (where no signal can be handled) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
