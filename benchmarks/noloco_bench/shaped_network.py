"""N hosts on shaped links: a benchmark network with the bandwidth and latency of an internet swarm.

Each host is a network namespace with one veth to a shared router namespace; like a home or cloud uplink, the
host's side is shaped to ``rate`` with ``tc tbf`` on egress (its upload) and the router's side to ``rate`` too
(its download). The router forwards every packet through delay_router.py, which adds the one-way delay (half the
round trip) and jitter that this kernel's missing netem cannot. So a byte from host i to host j crosses i's
upload, the delay, and j's download: the path of two peers on different home links. With no delay and no jitter
the router's kernel forwards instead (bench outsider: hosts to cut apart, no latency to emulate).

Host i has address 10.81.i.2 (i < 250; ``subnet`` changes the 10.81). With ``subnet6`` (a /32 such as ``2a0d:81``)
host i also has the IPv6 address {subnet6}:i::2 on a /48 of its own ({subnet6}:i::/48, a site's block), forwarded
by the router's kernel (only without delay and jitter: the delaying router carries IPv4). With ``control_plane``,
each host also has a second, unshaped and undelayed link to a bridge in the router's namespace, address 10.82.i.2
(the bridge: 10.82.255.1), for a benchmark's control traffic whose volume does not scale with its emulation (bench
race: the DHT). Needs root, iproute2 and /dev/net/tun. The namespaces are named ``{prefix}-h{i}`` and
``{prefix}-r``; everything is removed on exit, and stale leftovers of a killed run are removed on entry.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

MTU = 65000
TUN = "nldelay"


@dataclass(frozen=True)
class ShapedNetwork:
    hosts: int
    rate_mbit: float
    rtt_ms: float
    jitter_ms: float
    prefix: str
    control_plane: bool = False
    subnet: str = "10.81"  # host i is {subnet}.i.2, its router side {subnet}.i.1
    subnet6: str | None = None  # host i is {subnet6}:i::2 in {subnet6}:i::/48, its router side {subnet6}:i::1

    def link(self, host: int) -> str:
        """The /24 of ``host``'s link: its address and its router side."""
        return f"{self.subnet}.{host}.0/24"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host}.2"

    def device(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    def bytes_sent(self, host: int) -> int:
        """Bytes ``host`` has sent on its shaped link since the network was made (the veth's counter)."""
        path = f"/sys/class/net/{self.device(host)}/statistics/tx_bytes"
        done = subprocess.run([*self.exec_prefix(host), "cat", path], capture_output=True, text=True, check=True)
        return int(done.stdout)

    def exec_prefix(self, host: int) -> list[str]:
        """Prefix a command line with this to run it on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    @property
    def router(self) -> str:
        return f"{self.prefix}-r"

    def router_address(self, host: int) -> str:
        """The router's address on ``host``'s link: reached from that host without crossing the delay."""
        return f"{self.subnet}.{host}.1"

    def router_exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.router]

    def control_address(self, host: int) -> str:
        """``host``'s address on the unshaped control plane (only with ``control_plane``)."""
        return f"10.82.{host}.2"

    @property
    def control_router_address(self) -> str:
        return "10.82.255.1"

    def add_addresses(self, host: int, count: int) -> list[str]:
        """``count`` more addresses for ``host`` on its link ({subnet}.{host}.3, .4, ...): one host that speaks
        from several addresses, as an outsider with a few machines or an address range does. Returns them."""
        added = [f"{self.subnet}.{host}.{3 + k}" for k in range(count)]
        for address in added:
            _run("ip", "-n", self.namespace(host), "addr", "add", f"{address}/24", "dev", self.device(host))
        return added

    def address6(self, host: int) -> str:
        """``host``'s IPv6 address (only with ``subnet6``)."""
        return str(ipaddress.ip_address(f"{self.subnet6}:{host:x}::2"))

    def add_addresses6(self, host: int, count: int) -> list[str]:
        """``count`` more IPv6 addresses for ``host``, each in another /64 of its /48 ({subnet6}:{host}:1::2,
        :2::2, ...): one site that speaks from many of its networks. Returns them."""
        added = [str(ipaddress.ip_address(f"{self.subnet6}:{host:x}:{k:x}::2")) for k in range(1, count + 1)]
        for address in added:
            _run("ip", "-n", self.namespace(host), "addr", "add", f"{address}/64", "dev", self.device(host), "nodad")
            network = ipaddress.ip_network(f"{address}/64", strict=False)
            _run("ip", "-n", self.router, "-6", "route", "add", str(network), "dev", f"{self.prefix}r{host}")
        return added

    @contextmanager
    def partition(self, *groups: Sequence[int]) -> Iterator[None]:
        """While inside: hosts of different ``groups`` cannot reach each other (the router drops what one sends
        the other, silently, as a broken path does); every host still reaches the router's own addresses (the
        bootstrap peer). Healed on exit. The control plane is not cut."""
        rules = [
            ("from", self.link(a), "to", self.link(b))
            for one in groups
            for other in groups
            if one is not other
            for a in one
            for b in other
        ]
        added = []
        try:
            for rule in rules:
                _run("ip", "-n", self.router, "rule", "add", "pref", "10", *rule, "blackhole")
                added.append(rule)
            yield
        finally:
            for rule in added:
                _run("ip", "-n", self.router, "rule", "del", "pref", "10", *rule, "blackhole")


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


def _remove(prefix: str) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith(f"{prefix}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _shape(namespace: str, device: str, rate_mbit: float, mtu: int) -> None:
    # burst: two MTU-sized packets, the least tbf can pass them with (at MTU 65000: ~10 ms of line rate at
    # 100 Mbit/s; a slow link takes a small MTU so that the burst stays a sliver of a transfer);
    # latency: how long a packet may queue before tbf drops it
    _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
         "burst", str(2 * (mtu + 14)), "latency", "400ms")  # fmt: skip


def _control_plane(net: ShapedNetwork) -> None:
    bridge = f"{net.prefix}br"
    _run("ip", "-n", net.router, "link", "add", bridge, "type", "bridge")
    _run("ip", "-n", net.router, "addr", "add", f"{net.control_router_address}/16", "dev", bridge)
    _run("ip", "-n", net.router, "link", "set", bridge, "up")
    for host in range(net.hosts):
        ns, dev, port = net.namespace(host), f"{net.prefix}c{host}", f"{net.prefix}rc{host}"
        _run("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "link", "set", port, "netns", net.router)
        _run("ip", "-n", ns, "addr", "add", f"{net.control_address(host)}/16", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", net.router, "link", "set", port, "master", bridge, "up")


@contextmanager
def shaped_network(
    hosts: int,
    *,
    rate_mbit: float,
    rtt_ms: float,
    jitter_ms: float = 0.0,
    prefix: str = "nls",
    mtu: int = MTU,
    control_plane: bool = False,
    subnet: str = "10.81",
    subnet6: str | None = None,
) -> Iterator[ShapedNetwork]:
    """``mtu``: the links' MTU. Large by default, because the delaying router forwards packet by packet in Python
    and fast links need few packets; at a rate of a few Mbit/s or less take 1500, so that tbf's burst of two
    packets is not a large share of what a transfer moves."""
    if os.geteuid() != 0:
        raise PermissionError("a shaped network needs root (network namespaces, tc, a TUN device)")
    if not 1 <= hosts < 250:
        raise ValueError(f"hosts must be in [1, 250), not {hosts}")
    if subnet6 is not None and (rtt_ms or jitter_ms):
        raise ValueError(
            "IPv6 is forwarded by the router's kernel, without delay: subnet6 needs rtt_ms = jitter_ms = 0"
        )
    net = ShapedNetwork(hosts, rate_mbit, rtt_ms, jitter_ms, prefix, control_plane, subnet, subnet6)
    _remove(prefix)
    delayer: subprocess.Popen[str] | None = None
    try:
        router = net.router
        _run("ip", "netns", "add", router)
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1",
             "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
             "net.ipv6.conf.all.forwarding=1")  # fmt: skip
        _run("ip", "-n", router, "link", "set", "lo", "up")
        for host in range(hosts):
            ns, dev, peer = net.namespace(host), net.device(host), f"{prefix}r{host}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "link", "set", peer, "netns", router)
            _run("ip", "-n", ns, "addr", "add", f"{net.address(host)}/24", "dev", dev)
            _run("ip", "-n", router, "addr", "add", f"{net.router_address(host)}/24", "dev", peer)
            _run("ip", "-n", ns, "link", "set", dev, "up", "mtu", str(mtu))
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", router, "link", "set", peer, "up", "mtu", str(mtu))
            _run("ip", "-n", ns, "route", "add", "default", "via", net.router_address(host))
            if subnet6 is not None:
                own, router_side = net.address6(host), str(ipaddress.ip_address(f"{subnet6}:{host:x}::1"))
                _run("ip", "-n", ns, "addr", "add", f"{own}/64", "dev", dev, "nodad")
                _run("ip", "-n", router, "addr", "add", f"{router_side}/64", "dev", peer, "nodad")
                _run("ip", "-n", ns, "-6", "route", "add", "default", "via", router_side)
            # Long-lived connections keep their congestion window between exchanges (a node's channels are
            # pooled): the setting a deployment guide recommends for nodes; the bench also reports cold rounds.
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", f"net.ipv4.conf.{peer}.rp_filter=0")
            if rtt_ms or jitter_ms:  # through the delay router's TUN (below)
                _run("ip", "-n", router, "rule", "add", "iif", peer, "lookup", "100")
            _shape(ns, dev, rate_mbit, mtu)
            _shape(router, peer, rate_mbit, mtu)
        if control_plane:
            _control_plane(net)
        if rtt_ms == 0 and jitter_ms == 0:  # no delay to add: the kernel forwards, which costs no CPU of note
            yield net
            return
        delayer = subprocess.Popen(
            ["ip", "netns", "exec", router, sys.executable, "-m", "noloco_bench.delay_router", TUN,
             str(rtt_ms / 2), "--jitter-ms", str(jitter_ms)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert delayer.stdout is not None
        if delayer.stdout.readline().strip() != "ready":
            raise RuntimeError("the delay router did not start")
        _run("ip", "-n", router, "link", "set", TUN, "up", "mtu", str(mtu))
        _run("ip", "netns", "exec", router, "sysctl", "-qw", f"net.ipv4.conf.{TUN}.rp_filter=0")
        _run("ip", "-n", router, "route", "add", "default", "dev", TUN, "table", "100")
        time.sleep(0.2)
        yield net
    finally:
        if delayer is not None:
            delayer.kill()
            delayer.wait()
        _remove(prefix)
