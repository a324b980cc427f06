"""Small host helpers shared by serve, the remote test servers, the benches and doctor: a free
loopback port, whether a port is free, a binary on PATH. Standard library only (reading a config
or rendering a plan imports this)."""

from __future__ import annotations

import shutil
import socket
from typing import Optional

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


def find_binary(name: str) -> Optional[str]:
    """``name`` on PATH, else in the sbin directories; None if neither has it."""
    return shutil.which(name) or shutil.which(name, path=SBIN)


def require_binary(name: str, fix: str = "install Debian's redis-server package (scripts/install.sh does)") -> str:
    """``find_binary`` or FileNotFoundError "<name> not found: <fix>"."""
    path = find_binary(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: {fix}")
    return path
