"""The ports of one launch: every listener on loopback, asked-for ports checked free by binding,
free ones picked otherwise, and Dynamo's limit on a worker's system port."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from dynamo_flexkv.core.sysutil import free_port, port_is_free
from dynamo_flexkv.serve.graph import GraphError
from dynamo_flexkv.serve.sources import origin_of

LOOPBACK = "127.0.0.1"
SYSTEM_PORT_MAX = 32767  # Dynamo reads DYN_SYSTEM_PORT as an i16: a worker's system port must stay below 32768
SYSTEM_PORT_RANGE = (21000, 32000)  # where serve picks system ports for workers without system-port


class PortBook:
    """Ports for this launch: asked-for ones must be free; 0 picks a free one (system ports from a
    range Dynamo accepts). Binding is the only honest check that a port is free."""

    def __init__(self, probe: bool = True) -> None:
        self.probe = probe
        self.taken: dict[int, str] = {}
        # A random start: launches planned at once (pytest-xdist's processes, two serves) would walk
        # the same ports from neighbouring pids and hand one port to two workers.
        self._next_system = SYSTEM_PORT_RANGE[0] + random.randrange(SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0])

    def take(self, port: int, what: str, source: str, any_port: bool) -> int:
        if port:
            if not 0 < port < (65536 if any_port else SYSTEM_PORT_MAX + 1):
                raise GraphError(
                    f"{source}: {what}={port} is out of range"
                    + ("" if any_port else f" (Dynamo's system port must be below {SYSTEM_PORT_MAX + 1})")
                )
            if port in self.taken or (self.probe and not port_free(port)):
                holder = self.taken.get(port, "another process")
                raise GraphError(
                    f"{source}: {what}={port} is in use by {holder} on {LOOPBACK}: stop it or "
                    f"pick another port (e.g. --set {what}={port + 1})"
                )
            self.taken[port] = what
            return port
        if any_port:
            while True:
                port = free_port(LOOPBACK)
                if port not in self.taken:
                    self.taken[port] = what
                    return port
        for _ in range(SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0]):
            port = self._next_system
            self._next_system = SYSTEM_PORT_RANGE[0] + (port + 1 - SYSTEM_PORT_RANGE[0]) % (
                SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0]
            )
            if port not in self.taken and port_free(port):
                self.taken[port] = what
                return port
        raise GraphError(f"no free port for {what} in {SYSTEM_PORT_RANGE}")

    def take_range(self, count: int, what: str, band: tuple) -> int:
        """The first of ``count`` consecutive free ports in ``band`` (for a process that scans upward
        from a base port, like vLLM from VLLM_PORT), all booked for ``what``."""
        span = band[1] - band[0] - count
        start = band[0] + random.randrange(span)  # random, as the system ports
        for k in range(span // count):
            base = band[0] + (start - band[0] + k * count) % span
            block = range(base, base + count)
            if any(p in self.taken for p in block) or (self.probe and not all(port_free(p) for p in block)):
                continue
            for p in block:
                self.taken[p] = what
            return base
        raise GraphError(f"no {count} consecutive free ports for {what} in {band}")


def system_port(name: str, o: Mapping[str, Any], replica: int, ports: PortBook, source: str) -> int:
    """Replica ``replica``'s Dynamo system port (/health, /metrics): system-port + replica, or a free
    one (system-port unset or 0). Every replica's must be below 32768: Dynamo reads DYN_SYSTEM_PORT
    as an i16 and refuses the worker otherwise."""
    first = o.get("system-port") or 0
    if first:
        count = o.get("replicas", 1)
        last = first + count - 1
        if not first > 0 or last > SYSTEM_PORT_MAX:
            gives = (
                f" with replicas={count} gives replica {count - 1} port {last}, which"
                if count > 1 and 0 < first <= SYSTEM_PORT_MAX
                else ""
            )
            raise GraphError(
                f"{origin_of(source, name, 'system-port')}: "
                f"{name}.system-port={first}{gives} is out of range: Dynamo reads DYN_SYSTEM_PORT "
                f"as a 16-bit signed number, so each worker's system port must be below 32768 (1..{SYSTEM_PORT_MAX}); "
                f"set {name}.system-port to a port from 1 to {SYSTEM_PORT_MAX - count + 1}"
                + (f" ({count} replicas take {count} consecutive ports)" if count > 1 else "")
                + f", or leave it out and serve picks free ones in {SYSTEM_PORT_RANGE[0]}..{SYSTEM_PORT_RANGE[1]}"
            )
    return ports.take(
        first + replica if first else 0, f"{name}.system-port", origin_of(source, name, "system-port"), any_port=False
    )


def port_free(port: int) -> bool:
    return port_is_free(port, LOOPBACK)
