"""An internet with home routers: public hosts and members behind real NATs, on shaped links (shaped_network.py).

The public segment is a shaped_network whose hosts have public-looking addresses (``11.81.i.2``: libp2p treats
10/8 and 192.168/16 as private and would neither relay through nor hole-punch towards them). Some of its hosts
are NAT routers instead of members: behind each, a LAN (``192.168.i.0/24``) of member namespaces that reach the
internet only through the router's masquerade (nftables), so every member behind one router shows one public
address, the router's, and nobody outside can open a connection to them. The router's uplink is the shaped link:
its members share one home uplink, as in a house.

Two kinds of NAT, as on real home and carrier routers:

- ``port_restricted``: ``masquerade`` keeps a connection's source port where it can, so one local port maps to one
  public port whatever the destination (endpoint-independent mapping); inbound packets pass only for a mapping
  that the member opened towards that very address and port. Simultaneous connects (hole punching) get through.
- ``symmetric``: ``masquerade random`` picks a new public port for every connection, so the port a peer learns
  from one connection is useless to another peer: hole punching fails, and only a relay connects two such members.

Needs root, iproute2, nftables and what shaped_network.py needs. Member namespaces are ``{prefix}-h{i}m{j}``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from noloco_bench.shaped_network import ShapedNetwork, _remove, _run, shaped_network

NatKind = Literal["port_restricted", "symmetric"]
PUBLIC_SUBNET = "11.81"  # not routed on this machine's real network: the namespaces never leave it


@dataclass(frozen=True)
class Home:
    """One NAT router and the members behind it."""

    kind: NatKind
    members: int


@dataclass(frozen=True)
class Member:
    """A place to run a node: a namespace, its own address, and the address the internet sees it by."""

    namespace: str
    address: str
    public_address: str
    behind: NatKind | None  # None: on the public segment

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


@dataclass(frozen=True)
class NatNetwork:
    shaped: ShapedNetwork
    public: tuple[Member, ...]
    private: tuple[Member, ...]

    @property
    def members(self) -> tuple[Member, ...]:
        return self.public + self.private

    # What LocalSwarm runs nodes by (launcher/local_swarm.py HostNetwork): member i is a host, the bootstrap peer
    # sits in the internet's router, which every member reaches (those behind NATs through them).
    control_plane = False

    def address(self, host: int) -> str:
        return self.members[host].address

    def control_address(self, host: int) -> str:
        return self.members[host].address

    def exec_prefix(self, host: int) -> list[str]:
        return self.members[host].exec_prefix()

    def router_address(self, host: int) -> str:
        return self.shaped.router_address(0)

    def router_exec_prefix(self) -> list[str]:
        return self.shaped.router_exec_prefix()

    @property
    def control_router_address(self) -> str:
        return self.shaped.router_address(0)


def _nat_rules(uplink: str, kind: NatKind) -> str:
    flags = " random" if kind == "symmetric" else ""
    return (
        "table ip noloco_nat {\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f'    oifname "{uplink}" masquerade{flags}\n'
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority filter; policy drop;\n"
        f'    iifname != "{uplink}" accept\n'
        "    ct state established,related accept\n"
        "  }\n"
        "}\n"
    )


def _home(net: ShapedNetwork, router_host: int, home: Home) -> list[Member]:
    router_ns = net.namespace(router_host)
    uplink = net.device(router_host)
    lan_bridge = f"{net.prefix}l{router_host}"
    _run("ip", "-n", router_ns, "link", "add", lan_bridge, "type", "bridge")
    _run("ip", "-n", router_ns, "addr", "add", f"192.168.{router_host}.1/24", "dev", lan_bridge)
    _run("ip", "-n", router_ns, "link", "set", lan_bridge, "up")
    _run("ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    subprocess.run(
        ["ip", "netns", "exec", router_ns, "nft", "-f", "-"],
        input=_nat_rules(uplink, home.kind),
        text=True,
        check=True,
        capture_output=True,
    )
    members = []
    for j in range(home.members):
        ns = f"{net.namespace(router_host)}m{j}"
        dev, port = f"{net.prefix}h{router_host}m{j}", f"{net.prefix}p{router_host}m{j}"
        address = f"192.168.{router_host}.{j + 2}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "link", "set", port, "netns", router_ns)
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{router_host}.1")
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
        _run("ip", "-n", router_ns, "link", "set", port, "master", lan_bridge, "up")
        members.append(Member(ns, address, net.address(router_host), home.kind))
    return members


def firewall(member: Member) -> None:
    """Drop every connection that comes in to ``member`` from outside (a cloud VM's closed security group, a home
    firewall without NAT): its public address stays its own, its outbound connections and their answers pass."""
    rules = (
        "table inet noloco_firewall {\n"
        "  chain input {\n"
        "    type filter hook input priority 0; policy drop;\n"
        "    iif lo accept\n"
        "    ct state established,related accept\n"
        "    meta l4proto icmp accept\n"
        "  }\n"
        "}\n"
    )
    subprocess.run([*member.exec_prefix(), "nft", "-f", "-"], input=rules, text=True, check=True)


@contextmanager
def nat_network(
    public_members: int,
    homes: Sequence[Home],
    *,
    rate_mbit: float,
    rtt_ms: float,
    jitter_ms: float = 0.0,
    prefix: str = "nlnat",
    mtu: int = 1500,
) -> Iterator[NatNetwork]:
    """``public_members`` reachable hosts (the first can be the bootstrap) and one NAT router per ``homes`` entry,
    every uplink shaped to ``rate_mbit`` with ``rtt_ms`` between any two public addresses. Removed on exit."""
    if shutil.which("nft") is None:
        raise FileNotFoundError("a NAT network needs nftables (Debian: apt-get install nftables)")
    if any(home.members < 1 for home in homes):
        raise ValueError("every home needs at least one member")
    hosts = public_members + len(homes)
    try:
        with shaped_network(
            hosts, rate_mbit=rate_mbit, rtt_ms=rtt_ms, jitter_ms=jitter_ms, prefix=prefix, mtu=mtu,
            subnet=PUBLIC_SUBNET,
        ) as shaped:  # fmt: skip
            public = tuple(
                Member(shaped.namespace(i), shaped.address(i), shaped.address(i), None) for i in range(public_members)
            )
            private: list[Member] = []
            for offset, home in enumerate(homes):
                private.extend(_home(shaped, public_members + offset, home))
            yield NatNetwork(shaped, public, tuple(private))
    finally:
        _remove(prefix)  # the member namespaces too (shaped_network removes only its own on a clean exit)
