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
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

import yaml

from dynamo_flexkv.serve.graph import GraphError, Kind
from dynamo_flexkv.serve.ports import LOOPBACK
from dynamo_flexkv.serve.process import Process

SUBNET = "169.254.77.0/24"  # link-local: never routed off a link, and no default route is set
# UCX's TCP transport skips interfaces that have only link-local addresses (169.254/16, fe80::/10):
# each node's link also gets an address of this unique-local (ULA, never routed publicly) prefix.
SUBNET6 = "fd00:77::/64"
DEVICE = "eth0"  # each node's end of its veth pair
# Addresses a process binds or advertises for others to reach it: its own node's address.
OWN_HOST_ENV = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
                "VLLM_HOST_IP", "VLLM_NIXL_SIDE_CHANNEL_HOST")
# Addresses of the graph's infrastructure (etcd, NATS): on the frontend's node.
INFRA_URL_ENV = ("ETCD_ENDPOINTS", "NATS_SERVER")


class NodesError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    address: str  # IPv4 link-local: what every component binds and advertises
    address6: str = ""  # IPv6 ULA on the same link: what NIXL's UCX finds the link by
    device: str = DEVICE

    def argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside this node (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(frozen=True)
class Nodes:
    switch: str  # the namespace holding the bridge every node's veth pair plugs into
    nodes: Dict[str, Node]

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump({"switch": self.switch,
                                              "nodes": {n: asdict(v) for n, v in self.nodes.items()}}, sort_keys=False))

    @staticmethod
    def load(path: str) -> "Nodes":
        try:
            data = yaml.safe_load(Path(path).read_text())
            nodes = {str(n): Node(**v) for n, v in data["nodes"].items()}
            return Nodes(str(data["switch"]), nodes)
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
            raise GraphError(f"--nodes {path}: not a nodes file written by `dynamo-flexkv nodes up` ({e})") from None

    # ---- the network ---------------------------------------------------------------------------
    @staticmethod
    def up(prefix: str = "flexkv", names: Sequence[str] = ("A", "B", "C"), subnet: str = SUBNET,
           subnet6: str = SUBNET6) -> "Nodes":
        """Creates ``<prefix>-sw`` (a bridge) and one namespace ``<prefix>-<name>`` per node, each
        with a veth pair into the bridge, its address from ``subnet`` and its loopback up. Refuses
        when one of them exists already (``nodes down`` removes them)."""
        if os.geteuid() != 0:
            raise NodesError("nodes need root (network namespaces, veth pairs): run as root")
        net, net6 = ipaddress.ip_network(subnet), ipaddress.ip_network(subnet6)
        if not net.is_link_local:
            raise NodesError(f"subnet {subnet}: use a link-local range (in 169.254.0.0/16): nothing routes it off the link")
        if not net6.subnet_of(ipaddress.ip_network("fc00::/7")):
            raise NodesError(f"subnet6 {subnet6}: use a unique-local range (in fc00::/7)")
        hosts = list(net.hosts())
        if len(names) > len(hosts):
            raise NodesError(f"subnet {subnet} holds {len(hosts)} addresses, not {len(names)}")
        switch = f"{prefix}-sw"
        nodes = {n: Node(n, f"{prefix}-{n.lower()}", str(hosts[i]), str(net6[i + 1])) for i, n in enumerate(names)}
        existing = set(_netns_list()) & {switch, *(v.netns for v in nodes.values())}
        if existing:
            raise NodesError(f"network namespaces {sorted(existing)} exist already: "
                             f"`dynamo-flexkv nodes down --prefix {prefix}` removes them")
        made = Nodes(switch, nodes)
        try:
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, node in enumerate(nodes.values()):
                _ip("netns", "add", node.netns)
                port = f"p{i}"  # the switch's end
                _ip("link", "add", port, "netns", switch, "type", "veth", "peer", "name", node.device,
                    "netns", node.netns)
                _ip("-n", switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", node.netns, "addr", "add", f"{node.address}/{net.prefixlen}", "dev", node.device)
                _ip("-n", node.netns, "addr", "add", f"{node.address6}/{net6.prefixlen}", "dev", node.device, "nodad")
                _ip("-n", node.netns, "link", "set", node.device, "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            made.down()
            raise
        return made

    def down(self) -> None:
        """Removes the namespaces (their veth pairs go with them); what is gone already is skipped."""
        have = set(_netns_list())
        for ns in [v.netns for v in self.nodes.values()] + [self.switch]:
            if ns in have:
                _ip("netns", "del", ns)

    def switch_port(self, name: str) -> str:
        return f"p{list(self.nodes).index(name)}"

    def set_link(self, name: str, up: bool) -> None:
        """Node ``name``'s cable in or out: its switch port up or down (the node sees carrier loss)."""
        _ip("-n", self.switch, "link", "set", self.switch_port(name), "up" if up else "down")

    def link_bytes(self, name: str) -> Dict[str, int]:
        """Bytes node ``name`` sent and received on its link (its veth end's counters)."""
        out = _ip("-n", self[name].netns, "-s", "-j", "link", "show", "dev", self[name].device)
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


def place(processes: List[Process], infra: List[Process], nodes: Nodes, node_of: Mapping[str, str],
          source: str) -> None:
    """Puts each process on its node (``node_of``: process name -> node name; a process not in it
    stays on the launcher's own): it runs inside the node's namespace, binds and advertises the
    node's address, reaches etcd/NATS on the frontend's node, and NIXL's UCX uses TCP over the
    node's link (shared memory would not cross machines)."""
    unknown = sorted({n for n in node_of.values() if n not in nodes.nodes})
    if unknown:
        raise GraphError(f"{source}: node {unknown[0]!r} is not in the nodes file (it has {sorted(nodes.nodes)})")
    front = next((p for p in processes if p.kind is Kind.FRONTEND), None)
    home = nodes[node_of[front.name]] if front is not None and front.name in node_of else None
    infra_host = home.address if home else LOOPBACK
    for proc in infra:
        proc.argv = [a.replace(LOOPBACK, infra_host) for a in proc.argv]
        if home:
            proc.argv, proc.host = home.argv(proc.argv), home.address
    for proc in processes + infra:
        for key in INFRA_URL_ENV:
            if key in proc.env:
                proc.env[key] = proc.env[key].replace(LOOPBACK, infra_host)
    for proc in processes:
        name = node_of.get(proc.name)
        if name is None:
            continue
        node = nodes[name]
        proc.host = node.address
        for key in OWN_HOST_ENV:
            if key in proc.env or key.startswith("DYN_"):
                proc.env[key] = node.address
        proc.env.update(UCX_TLS="tcp", UCX_NET_DEVICES=node.device)
        if "--http-host" in proc.argv:
            proc.argv[proc.argv.index("--http-host") + 1] = node.address
        proc.argv = node.argv(proc.argv)


def _ip(*args: str) -> str:
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NodesError("`ip` (iproute2) is not installed: apt-get install iproute2") from None
    if p.returncode != 0:
        raise NodesError(f"ip {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def _netns_list() -> List[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]

