"""A shaped link between two network namespaces, for benchmarks over something closer to a real network.

Two namespaces joined by a veth pair, each end's egress limited with ``tc tbf`` (this kernel has bandwidth shaping
but no netem). Needs root and iproute2. A benchmark process enters a namespace with setns(2) before it opens any
socket; Python 3.11 has no os.setns, so it is called through libc.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class ShapedLink:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    rate: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def shaped_link(rate: str, *, prefix: str = "nlbench") -> Iterator[ShapedLink]:
    """Create the namespaces, the veth pair and the tbf qdiscs; remove them all on exit."""
    if os.geteuid() != 0:
        raise PermissionError("a shaped link needs root (network namespaces and tc)")
    names = (f"{prefix}-a", f"{prefix}-b")
    addresses = ("10.213.0.1", "10.213.0.2")
    veths = (f"{prefix}va", f"{prefix}vb")
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, address in zip(names, veths, addresses, strict=True):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            subprocess.run(
                [
                    "tc",
                    "-n",
                    name,
                    "qdisc",
                    "add",
                    "dev",
                    veth,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "1mb",
                    "latency",
                    "100ms",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        yield ShapedLink(names, addresses, rate)
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def enter_namespace(name: str) -> None:
    """Move the calling (single-threaded) process into a named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)
