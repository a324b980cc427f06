"""Nodes on one machine: Linux network namespaces joined by veth pairs to a bridge, each with its
own link-local address and no route anywhere else. One graph placed over them behaves as over
separate machines on one switch: every byte between two nodes (Dynamo's request plane, etcd, NATS,
NIXL's UCX over TCP, Redis) crosses a veth link, which ``set_link`` takes down and up again.

``dynamo-flexkv nodes up`` writes the nodes file that ``serve --nodes`` reads; components name
their node with the ``node`` option. Needs root (CAP_NET_ADMIN) and iproute2."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from dynamo_flexkv.core.errors import FlexKVError
from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.ports import LOOPBACK
from dynamo_flexkv.serve.process import Process
from dynamo_flexkv.serve.sources import origin_of
from dynamo_flexkv.serve.vllm_worker import advertise_hints_at

SUBNET = "169.254.77.0/24"  # link-local: never routed off a link, and no default route is set
# UCX's TCP transport skips interfaces that have only link-local addresses (169.254/16, fe80::/10):
# each node's link also gets an address of this unique-local (ULA, never routed publicly) prefix.
SUBNET6 = "fd00:77::/64"
DEVICE = "eth0"  # each node's end of its veth pair
# Addresses a process binds or advertises for others to reach it: its own node's address.
OWN_HOST_ENV = (
    "DYN_TCP_RPC_HOST",
    "DYN_EVENT_PLANE_HOST",
    "DYN_SYSTEM_HOST",
    "DYN_TCP_RESPONSE_STREAM_HOST",
    "VLLM_HOST_IP",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
)
# Addresses of the graph's infrastructure (etcd, NATS): on the frontend's node.
INFRA_URL_ENV = ("ETCD_ENDPOINTS", "NATS_SERVER")


class NodesError(RuntimeError, FlexKVError):
    """A node network that cannot be made, used or removed as asked."""


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    address: str  # IPv4 link-local: what every component binds and advertises
    address6: str = ""  # IPv6 ULA on the same link: what NIXL's UCX finds the link by
    device: str = DEVICE
    port: str = ""  # the switch's end of its veth pair (what `set_link` takes down)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def ucx_env(self) -> dict[str, str]:
        """What NIXL's UCX needs on this node to reach the others: TCP over its link (no shared
        memory between nodes)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.device}


NAME = re.compile(r"[A-Za-z0-9]{1,8}")


@dataclass(frozen=True)
class Nodes:
    switch: str  # the namespace holding the bridge every node's veth pair plugs into
    nodes: dict[str, Node]
    prefix: str = ""  # every namespace here is named <prefix>-...: `down` removes no other

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def save(self, path: Path) -> None:
        Path(path).write_text(
            yaml.safe_dump(
                {"prefix": self.prefix, "switch": self.switch, "nodes": {n: asdict(v) for n, v in self.nodes.items()}},
                sort_keys=False,
            )
        )

    @staticmethod
    def load(path: str, flag: str = "--nodes") -> Nodes:
        try:
            data = yaml.safe_load(Path(path).read_text())
            nodes = {str(n): Node(**v) for n, v in data["nodes"].items()}
            made = Nodes(str(data["switch"]), nodes, str(data.get("prefix", "")))
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
            raise GraphError(f"{flag} {path}: not a nodes file written by `dynamo-flexkv nodes up` ({e})") from None
        foreign = [ns for ns in made.namespaces() if not ns.startswith(f"{made.prefix}-") or not made.prefix]
        if foreign or any(not n.port for n in nodes.values()):
            raise GraphError(
                f"{flag} {path}: not a nodes file written by `dynamo-flexkv nodes up` (namespaces "
                f"{foreign or sorted(nodes)} do not match its prefix {made.prefix!r} or lack a switch port)"
            )
        return made

    def namespaces(self) -> list[str]:
        return [v.netns for v in self.nodes.values()] + [self.switch]

    def check_up(self, where: str) -> None:
        """Every namespace of the file exists (`nodes up` made them and no `nodes down` since)."""
        missing = sorted(set(self.namespaces()) - set(_netns_list()))
        if missing:
            raise GraphError(f"{where}: network namespaces {missing} do not exist: run `dynamo-flexkv nodes up` again")

    # ---- the network ---------------------------------------------------------------------------
    @staticmethod
    def up(
        prefix: str = "flexkv",
        names: Sequence[str] = ("A", "B", "C"),
        subnet: str = SUBNET,
        subnet6: str = SUBNET6,
        path: Path | None = None,
    ) -> Nodes:
        """Creates ``<prefix>-sw`` (a bridge) and one namespace ``<prefix>-<name>`` per node, each
        with a veth pair into the bridge, its address from ``subnet`` and its loopback up, and
        writes the nodes file to ``path``. Refuses when one of them exists already; a failure
        part way removes what it made."""
        if os.geteuid() != 0:
            raise NodesError("nodes need root (network namespaces, veth pairs): run as root")
        bad = [n for n in names if not NAME.fullmatch(n)]
        if bad or not names:
            raise NodesError(
                f"node names {bad or list(names)}: give 1 or more names of 1-8 letters or digits (e.g. A B C)"
            )
        if len({n.lower() for n in names} | {"sw"}) != len(names) + 1:
            raise NodesError(
                f"node names {list(names)}: each must differ from the others in more than case, "
                "and none may be 'sw' (the switch's namespace)"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,19}", prefix):
            raise NodesError(
                f"prefix {prefix!r}: 1-20 letters, digits, '_', '.' or '-', starting with a letter or digit"
            )
        net, net6 = ipaddress.ip_network(subnet), ipaddress.ip_network(subnet6)
        if not net.is_link_local:
            raise NodesError(
                f"subnet {subnet}: use a link-local range (in 169.254.0.0/16): nothing routes it off the link"
            )
        if not isinstance(net6, ipaddress.IPv6Network) or not net6.subnet_of(ipaddress.IPv6Network("fc00::/7")):
            raise NodesError(f"subnet6 {subnet6}: use a unique-local range (in fc00::/7)")
        hosts = list(net.hosts())
        if len(names) > len(hosts):
            raise NodesError(f"subnet {subnet} holds {len(hosts)} addresses, not {len(names)}")
        switch = f"{prefix}-sw"
        nodes = {
            n: Node(n, f"{prefix}-{n.lower()}", str(hosts[i]), str(net6[i + 1]), port=f"p{i}")
            for i, n in enumerate(names)
        }
        made = Nodes(switch, nodes, prefix)
        existing = set(_netns_list()) & set(made.namespaces())
        if existing:
            raise NodesError(
                f"network namespaces {sorted(existing)} exist already: `dynamo-flexkv nodes down "
                f"--file <the nodes file that made them>` removes them (or `ip netns del NAME`)"
            )
        try:
            if path is not None:
                made.save(path)  # first: a file that cannot be written leaves nothing to clean up by hand
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for node in nodes.values():
                _ip("netns", "add", node.netns)
                _ip(
                    "link",
                    "add",
                    node.port,
                    "netns",
                    switch,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    node.device,
                    "netns",
                    node.netns,
                )
                _ip("-n", switch, "link", "set", node.port, "master", "br0", "up")
                _ip("-n", node.netns, "addr", "add", f"{node.address}/{net.prefixlen}", "dev", node.device)
                _ip("-n", node.netns, "addr", "add", f"{node.address6}/{net6.prefixlen}", "dev", node.device, "nodad")
                _ip("-n", node.netns, "link", "set", node.device, "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            made.down()
            if path is not None:
                Path(path).unlink(missing_ok=True)
            raise
        return made

    def down(self) -> None:
        """Removes the namespaces (their veth pairs go with them); what is gone already is skipped."""
        have = set(_netns_list())
        for ns in self.namespaces():
            if ns in have:
                _ip("netns", "del", ns)

    def set_link(self, name: str, up: bool) -> None:
        """Node ``name``'s cable in or out: its switch port up or down (the node sees carrier loss)."""
        if self.switch not in _netns_list():
            raise NodesError(f"network namespace {self.switch} does not exist: run `dynamo-flexkv nodes up` first")
        _ip("-n", self.switch, "link", "set", self[name].port, "up" if up else "down")

    def link_bytes(self, name: str) -> dict[str, int]:
        """Bytes node ``name`` sent and received on its link (its veth end's counters)."""
        out = _ip("-n", self[name].netns, "-s", "-j", "link", "show", "dev", self[name].device)
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


def _component(process: str) -> str:
    """The component (config section) a process belongs to: a replica's name without ``-N``."""
    base, _, replica = process.rpartition("-")
    return base if base and replica.isdigit() else process


def place(
    processes: list[Process], infra: list[Process], nodes: Nodes, node_of: Mapping[str, str], source: str
) -> None:
    """Puts each process on its node (``node_of``: process name -> node name, every one named): it
    runs inside the node's namespace, binds and advertises the node's address, reaches etcd/NATS
    on the frontend's node, and NIXL's UCX uses TCP over the node's link (shared memory would not
    cross machines). Refuses what other nodes could not reach (loopback etcd/NATS/Redis URLs) and
    a serve that does not run on the frontend's node."""
    unknown = sorted((n, name) for name, n in node_of.items() if n not in nodes.nodes)
    if unknown:
        wanted, name = unknown[0]
        raise GraphError(
            f"{origin_of(source, _component(name), 'node')}: node {wanted!r} is not in the nodes file "
            f"(it has {sorted(nodes.nodes)})"
        )
    unplaced = [p.name for p in processes if p.name not in node_of]
    if unplaced:
        raise GraphError(
            f"{source}: with --nodes every component names its node: {unplaced} name none "
            f"(e.g. --set {unplaced[0].rsplit('-', 1)[0]}.node={next(iter(nodes.nodes))})"
        )
    for key in INFRA_URL_ENV:
        if _loopback(os.environ.get(key, "")):
            raise GraphError(
                f"{key}={os.environ[key]} is this machine's loopback, which other nodes cannot reach: "
                f"unset it (serve starts etcd/NATS on the frontend's node) or give an address on the nodes' link"
            )
    for p in processes:
        if p.cache is not None and p.cache.enable_remote and _loopback(p.cache.remote_cache_url or ""):
            raise GraphError(
                f"{origin_of(source, _component(p.name), 'cache', 'remote_cache_url')}: "
                f"{p.name}.cache.remote_cache_url {p.cache.remote_cache_url.split('@')[-1]} is a "
                "loopback address other nodes cannot reach: give a Redis on a node's address"
            )
    nodes.check_up(source)
    front = next(p for p in processes if p.kind is Kind.FRONTEND)
    home = nodes[node_of[front.name]]
    try:  # serve probes every component over the links from the frontend's node: it must run there
        with socket.socket() as s:
            s.bind((home.address, 0))
    except OSError:
        raise GraphError(
            f"{source}: serve must run on the frontend's node {home.name} ({home.address} is not an "
            f"address here): ip netns exec {home.netns} dynamo-flexkv serve ..."
        ) from None
    infra_host = home.address
    for proc in infra:
        proc.argv = home.argv([a.replace(LOOPBACK, infra_host) for a in proc.argv])
        proc.host = home.address
    for proc in processes + infra:
        for key in INFRA_URL_ENV:
            if key in proc.env:
                proc.env[key] = proc.env[key].replace(LOOPBACK, infra_host)
    for proc in processes:
        node = nodes[node_of[proc.name]]
        proc.host = node.address
        for key in OWN_HOST_ENV:
            if key in proc.env or key.startswith("DYN_"):
                proc.env[key] = node.address
        proc.env.update(node.ucx_env())
        for flag in ("--http-host", "--metrics-host"):
            if flag in proc.argv:
                proc.argv[proc.argv.index(flag) + 1] = node.address
        advertise_hints_at(proc, node.address)  # router-hint peers reach it on the link
        proc.argv = node.argv(proc.argv)


def _loopback(url: str) -> bool:
    return bool(re.search(r"(^|[/@,=\s])(127\.\d+\.\d+\.\d+|localhost|\[?::1\]?)([:/,\s]|$)", url))


def _ip(*args: str) -> str:
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NodesError("`ip` (iproute2) is not installed: apt-get install iproute2") from None
    except subprocess.TimeoutExpired:
        raise NodesError(f"ip {' '.join(args)}: no answer in 30 s") from None
    if p.returncode != 0:
        raise NodesError(f"ip {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def _netns_list() -> list[str]:
    # "NAME (id: N)" per line; names made here hold no space
    return [line.split(" (id:")[0].strip() for line in _ip("netns", "list").splitlines() if line.strip()]
